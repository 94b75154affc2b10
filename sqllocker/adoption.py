"""Adopting a DBIx::Locker table: converting it into sqllocker's table, keeping its rows.

The conversion rides on the first migration (``migrations/versions/0001``): statements that
move the old table out of the way run before it creates the table, statements that bring the
rows back run after, all in its transaction where the database has transactional DDL
(PostgreSQL, SQLite). Each row keeps its id, since DBIx::Locker releases by id alone; its
``created``/``expires``, local times of the Perl processes' zone, become UTC; ``locked_by``
becomes JSON; its guid is the column's default (``schema.FOREIGN_GUID_PREFIX``), which marks
it as DBIx::Locker's. New ids start above every id the old table handed out, so that a Perl
process still holding a stale id can never release a lock taken after the adoption.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any
from zoneinfo import ZoneInfo

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.sql.expression import Executable

from .backends import backend_for
from .errors import LockValueError
from .schema import UTCDateTime, lock_table
from .validation import check_table_name

# Where the DBIx::Locker table waits while its successor is made, where DDL commits (MySQL): it
# is renamed (atomically) rather than dropped before its rows are safe.
SET_ASIDE_SUFFIX = "_dbix_locker"
_INSERT_BATCH = 500
_DBIX_COLUMNS = {"id", "lockstring", "created", "expires", "locked_by"}


@dataclass
class Adoption:
    """What the first migration runs around its creation of the table (see module doc)."""

    before_create: list[Executable | str] = field(default_factory=list)
    after_create: list[Executable | str] = field(default_factory=list)
    rows: int = 0


def check_zone(name: str) -> ZoneInfo:
    """The IANA time zone ``name`` (e.g. America/New_York), or a one-line LockValueError."""
    try:
        return ZoneInfo(name)
    except (KeyError, ValueError, OSError) as error:  # ZoneInfoNotFoundError is a KeyError
        raise LockValueError(
            f"unknown time zone {name!r} (an IANA name, e.g. America/New_York)"
        ) from error


def set_aside_name(table: str) -> str:
    return check_table_name(table) + SET_ASIDE_SUFFIX


def plan_adoption(
    conn: Connection, table: str, perl_tz: ZoneInfo, exact_lockstrings: bool, *, set_aside: bool
) -> Adoption:
    """The statements that adopt DBIx::Locker table ``table``, with its rows as they are now.

    ``set_aside``: the table has been renamed already (``Backend.prepare_adoption``, where
    ``Backend.adoption_sets_table_aside``), so the rows are read from there. Refuses
    (LockValueError) a table that is not DBIx::Locker's.
    """
    check_table_name(table)
    dialect = conn.dialect
    source = set_aside_name(table) if set_aside else table
    columns = _columns(conn, source)
    if not columns:
        raise LockValueError(f"there is no table {table!r} to adopt")
    if "guid" in columns:
        raise LockValueError(f"table {table!r} has a guid column: it is sqllocker's already")
    if not set(columns) >= _DBIX_COLUMNS:
        missing = ", ".join(sorted(_DBIX_COLUMNS - set(columns)))
        raise LockValueError(f"table {table!r} is not a DBIx::Locker table (it lacks {missing})")

    adoption = Adoption()
    old = sa.table(source, *(sa.column(name) for name in sorted(_DBIX_COLUMNS)))
    rows = conn.execute(sa.select(old).order_by(old.c.id)).all()
    adoption.rows = len(rows)
    backend = backend_for(dialect)
    adoption.before_create += backend.adoption_before_create(table, set_aside)
    highest_row = max([int(row.id) for row in rows], default=0)
    ids_from = backend.ids_handed_out_below(conn, source, highest_row)

    target = lock_table(table)
    converted = [
        {
            "id": int(row.id),
            "lockstring": row.lockstring,
            "created": _utc(row.created, perl_tz, fold=0),
            "expires": _utc(row.expires, perl_tz, fold=1),
            "locked_by": _locked_by(row.locked_by),
        }
        for row in rows
    ]
    for start in range(0, len(converted), _INSERT_BATCH):
        batch = converted[start : start + _INSERT_BATCH]
        adoption.after_create.append(
            sa.insert(_plain(target)).values(
                [_as_column_values(values, dialect) for values in batch]
            )
        )
    adoption.after_create += backend.next_id_at_least(table, ids_from)
    adoption.after_create += backend.adoption_after_create(conn, source, table, exact_lockstrings)
    return adoption


def _columns(conn: Connection, table: str) -> dict[str, Any]:
    """The columns of ``table`` (empty if it does not exist)."""
    inspector = sa.inspect(conn)
    if not inspector.has_table(table):
        return {}
    return {column["name"]: column for column in inspector.get_columns(table)}


def _utc(value: Any, zone: ZoneInfo, fold: int) -> datetime:
    """A DBIx::Locker time (a local time of ``zone``, as text or a naive datetime) in UTC; an
    aware one (a PostgreSQL timestamptz, which the session's zone already read right) as is.
    An expiry in the hour a clock goes back is read as the later of its two instants."""
    if isinstance(value, str):
        value = datetime.fromisoformat(value.strip())
    if not isinstance(value, datetime):
        raise LockValueError(f"not a time: {value!r}")
    moment: datetime = value if value.tzinfo else value.replace(tzinfo=zone, fold=fold)
    return moment.astimezone(timezone.utc)


def _locked_by(value: Any) -> str:
    """``locked_by`` as a JSON object: DBIx::Locker writes one; anything else is kept as text."""
    if value is None:
        return "{}"
    if isinstance(value, dict):
        return json.dumps(value)
    try:
        document = json.loads(value)
    except (TypeError, ValueError):
        document = None
    if not isinstance(document, dict):
        document = {"dbix_locked_by": str(value)}
    return json.dumps(document)


class _ServerReadText(sa.types.UserDefinedType[str]):
    """Text bound with no type of its own (a string literal in ``--sql``): the server reads it
    as the column's type, as it reads the text DBIx::Locker inserts."""

    cache_ok = True

    def get_col_spec(self, **kw: Any) -> str:
        return "TEXT"

    def literal_processor(self, dialect: sa.engine.Dialect) -> Any:
        text: sa.types.TypeEngine[str] = sa.String()
        return text.literal_processor(dialect)


def _plain(target: sa.Table) -> sa.TableClause:
    """The lock table with its values as text, so that the insert binds (or, for ``--sql``,
    writes out) each value as the backend reads it in."""
    return sa.table(
        target.name,
        sa.column("id", sa.BigInteger()),
        *(
            sa.column(name, _ServerReadText())
            for name in ("lockstring", "created", "expires", "locked_by")
        ),
    )


def _as_column_values(values: dict[str, Any], dialect: sa.engine.Dialect) -> dict[str, Any]:
    times = UTCDateTime()
    converted = dict(values)
    for key in ("created", "expires"):
        as_bound = times.process_bind_param(values[key], dialect)
        converted[key] = as_bound if isinstance(as_bound, str) else as_bound.isoformat(sep=" ")
    return converted
