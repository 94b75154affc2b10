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
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any
from zoneinfo import ZoneInfo

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.sql.expression import Executable

from .errors import LockValueError
from .schema import UTCDateTime, lock_table
from .validation import check_table_name

# Where the DBIx::Locker table waits, on MySQL/MariaDB, while its successor is made: DDL commits
# there, so the old table is renamed (atomically) rather than dropped before its rows are safe.
SET_ASIDE_SUFFIX = "_dbix_locker"
# SQLite without AUTOINCREMENT (DBIx::Locker's DDL) keeps no record of the ids it handed out and
# reuses the highest deleted one; new ids start this far above the highest row left, past any
# id a stale Perl holder of a deleted row could still carry.
SQLITE_ID_GAP = 1_000_000
_INSERT_BATCH = 500
_DBIX_COLUMNS = {"id", "lockstring", "created", "expires", "locked_by"}
_COLLATION = re.compile(r"[A-Za-z0-9_]+")


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


def set_table_aside(conn: Connection, table: str) -> None:
    """MySQL/MariaDB: rename the DBIx::Locker table, atomically, before its rows are read:
    a Perl process that locks meanwhile finds no table and reports its lock refused."""
    conn.exec_driver_sql(f"RENAME TABLE {table} TO {set_aside_name(table)}")


def plan_adoption(
    conn: Connection, table: str, perl_tz: ZoneInfo, exact_lockstrings: bool, *, set_aside: bool
) -> Adoption:
    """The statements that adopt DBIx::Locker table ``table``, with its rows as they are now.

    ``set_aside``: MySQL, the table has been renamed already (:func:`set_table_aside`), so the
    rows are read from there. Refuses (LockValueError) a table that is not DBIx::Locker's.
    """
    check_table_name(table)
    dialect = conn.dialect
    name = dialect.name
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
    ids_from = max([int(row.id) for row in rows], default=0) + 1
    if name == "postgresql":
        adoption.before_create += [
            f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE",
            f"DROP TABLE {table}",
        ]
        last = conn.exec_driver_sql(
            "SELECT pg_catalog.pg_sequence_last_value(pg_catalog.pg_get_serial_sequence("
            "%(table)s::text, 'id'::text)::regclass)",
            {"table": table},
        ).scalar()
        ids_from = max(ids_from, int(last or 0) + 1)
    elif name == "mysql":
        if not set_aside:
            adoption.before_create.append(f"RENAME TABLE {table} TO {set_aside_name(table)}")
        next_id = conn.exec_driver_sql(
            "SELECT auto_increment FROM information_schema.tables "
            "WHERE table_schema = DATABASE() AND table_name = %(table)s",
            {"table": source},
        ).scalar()
        ids_from = max(ids_from, int(next_id or 0))
    else:
        adoption.before_create.append(f"DROP TABLE {table}")
        ids_from += SQLITE_ID_GAP

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
    adoption.after_create += _ids_from(name, table, ids_from)
    if name == "mysql":
        if not exact_lockstrings:
            adoption.after_create += _keep_collation(conn, source, table)
        adoption.after_create.append(f"DROP TABLE {set_aside_name(table)}")
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


def _ids_from(name: str, table: str, first: int) -> list[Executable | str]:
    """Statements that make the table's next id ``first`` or more."""
    if name == "postgresql":
        return [
            sa.text(
                "SELECT pg_catalog.setval(pg_catalog.pg_get_serial_sequence(:table, 'id'), :last)"
            ).bindparams(table=table, last=first - 1)
        ]
    if name == "mysql":
        return [f"ALTER TABLE {table} AUTO_INCREMENT = {int(first)}"]
    return [
        sa.text("DELETE FROM sqlite_sequence WHERE name = :table").bindparams(table=table),
        sa.text("INSERT INTO sqlite_sequence (name, seq) VALUES (:table, :last)").bindparams(
            table=table, last=first - 1
        ),
    ]


def _keep_collation(conn: Connection, source: str, table: str) -> list[Executable | str]:
    """MySQL: give the new lockstring column the old one's character set and collation, so that
    the same lockstrings collide as before (without ``--exact-lockstrings``)."""
    charset, collation = conn.exec_driver_sql(
        "SELECT character_set_name, collation_name FROM information_schema.columns "
        "WHERE table_schema = DATABASE() AND table_name = %(table)s AND column_name = 'lockstring'",
        {"table": source},
    ).one()
    if not (
        charset and collation and _COLLATION.fullmatch(charset) and _COLLATION.fullmatch(collation)
    ):
        return []
    return [
        f"ALTER TABLE {table} MODIFY lockstring VARCHAR(128) CHARACTER SET {charset} "
        f"COLLATE {collation} NOT NULL"
    ]
