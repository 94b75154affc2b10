"""Adopting a DBIx::Locker table: converting it into sqllocker's table, keeping its rows.

The conversion rides on the first migration (``migrations/versions/0001``). Every check (is
there such a table, is it DBIx::Locker's and not sqllocker's already, are the names the
adoption needs free) comes first, before anything is written (:func:`check_adoptable`).

Where DDL is transactional (PostgreSQL, SQLite) the old table is locked, its rows read, and it
is dropped and replaced in the migration's one transaction: Perl processes that lock meanwhile
wait, and then write to the new table. MySQL/MariaDB commits each DDL statement, so the new
table is built complete under a name of its own (:func:`swap_name`), and the backend swaps it
in with the rows of the old one copied at the last moment, while the old one is locked (see
``Backend.swap_in``): the name never stands for an empty table, nor for none.

Each row keeps its id, since DBIx::Locker releases by id alone; its ``created``/``expires``,
local times of the Perl processes' zone, become UTC; ``locked_by`` becomes JSON; its guid is
the column's default (``schema.FOREIGN_GUID_PREFIX``), which marks it as DBIx::Locker's. New
ids start above every id the old table handed out, so that a Perl process still holding a
stale id can never release a lock taken after the adoption.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any
from zoneinfo import ZoneInfo

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.sql.expression import Executable

from .backends import backend_for
from .errors import LockValueError
from .schema import UTCDateTime, set_aside_name, swap_name
from .validation import check_table_name

_INSERT_BATCH = 500
_DBIX_COLUMNS = {"id", "lockstring", "created", "expires", "locked_by"}

# A step of the migration: a statement, or (applied on a live connection, not printed by
# ``--sql``) a function of the connection.
Step = Executable | str | Callable[[Connection], None]


@dataclass
class Adoption:
    """What the first migration runs around its creation of the table (see module doc):
    ``create_as``, the name it creates the table under (None: the table's own)."""

    before_create: list[Step] = field(default_factory=list)
    after_create: list[Step] = field(default_factory=list)
    rows: int = 0
    create_as: str | None = None


def check_zone(name: str) -> ZoneInfo:
    """The IANA time zone ``name`` (e.g. America/New_York), or a one-line LockValueError."""
    try:
        return ZoneInfo(name)
    except (KeyError, ValueError, OSError) as error:  # ZoneInfoNotFoundError is a KeyError
        raise LockValueError(
            f"unknown time zone {name!r} (an IANA name, e.g. America/New_York)"
        ) from error


def check_adoptable(conn: Connection, table: str, version_table: str) -> None:
    """Refuse (LockValueError, nothing written) unless ``table`` is a DBIx::Locker table that
    can be adopted here now: not sqllocker's already, no version row, and every name the
    adoption makes beside it free."""
    check_table_name(table)
    columns = _columns(conn, table)
    if not columns:
        raise LockValueError(f"there is no table {table!r} to adopt")
    if "guid" in columns:
        raise LockValueError(f"table {table!r} has a guid column: it is sqllocker's already")
    if not set(columns) >= _DBIX_COLUMNS:
        missing = ", ".join(sorted(_DBIX_COLUMNS - set(columns)))
        raise LockValueError(f"table {table!r} is not a DBIx::Locker table (it lacks {missing})")
    inspector = sa.inspect(conn)
    if inspector.has_table(version_table):
        rows = conn.execute(sa.select(sa.func.count()).select_from(sa.table(version_table)))
        if rows.scalar():
            raise LockValueError(
                f"table {table!r} has a migration recorded in {version_table!r}, yet no guid "
                "column: it is neither DBIx::Locker's as made nor sqllocker's"
            )
    refusal = backend_for(conn.dialect).adoption_refusal(conn, table)
    if refusal is not None:
        raise LockValueError(f"table {table!r} cannot be adopted as it is: {refusal}")
    existing = set(inspector.get_table_names()) | set(inspector.get_view_names())
    for name in backend_for(conn.dialect).adoption_names(table):
        if name in existing:
            raise LockValueError(
                f"{name!r} exists already, and the adoption of {table!r} makes it (left by an "
                f"interrupted adoption? {table!r} itself is untouched): drop it and adopt again"
            )


def interrupted_after_swap(conn: Connection, table: str, version_table: str) -> bool:
    """Whether an adoption of ``table`` swapped its new table in and was stopped before it
    recorded its revision (MySQL: a crash, a kill): the table is sqllocker's, complete, the
    old one still aside. Adopting it again finishes the adoption."""
    backend = backend_for(conn.dialect)
    if not backend.adoption_swaps or "guid" not in _columns(conn, table):
        return False
    # What the adoption makes before its swap is all there, and the old table aside.
    inspector = sa.inspect(conn)
    existing = set(inspector.get_table_names()) | set(inspector.get_view_names())
    if not set(backend.adoption_names(table)) - {swap_name(table)} <= existing:
        return False
    if not inspector.has_table(version_table):
        return True
    rows = conn.execute(sa.select(sa.func.count()).select_from(sa.table(version_table)))
    return not rows.scalar()


def plan_adoption(
    conn: Connection, table: str, perl_tz: ZoneInfo, exact_lockstrings: bool, *, online: bool
) -> Adoption:
    """The steps that adopt DBIx::Locker table ``table`` (checked by :func:`check_adoptable`).

    ``online``: run on this connection now, where the backend locks the old table first
    (``Backend.prepare_adoption``); else printed (``--sql``), with the rows as they are now.
    """
    backend = backend_for(conn.dialect)
    adoption = Adoption()
    if backend.adoption_swaps:
        new = swap_name(table)
        adoption.create_as = new
        adoption.after_create += backend.lockstring_like(conn, table, new, exact_lockstrings)
        if online:

            def swap(connection: Connection) -> None:
                adoption.rows = backend.swap_in(
                    connection,
                    table,
                    new,
                    set_aside_name(table),
                    lambda c: copy_rows(c, table, new, perl_tz),
                )

            adoption.after_create.append(swap)
            return adoption
        inserts, ids = _converted_inserts(conn, table, new, perl_tz)
        adoption.rows = len(ids)
        adoption.after_create += inserts
        next_id = backend.ids_handed_out_below(conn, table, max(ids, default=0))
        adoption.after_create += backend.next_id_at_least(new, next_id)
        adoption.after_create.append(
            f"RENAME TABLE {table} TO {set_aside_name(table)}, {new} TO {table}"
        )
        adoption.after_create.append(f"DROP TABLE {set_aside_name(table)}")
        return adoption
    grants = backend.grants_kept(conn, table, online)  # read before the table goes
    sequence = backend.sequence_name_kept(conn, table)  # likewise
    adoption.before_create += backend.adoption_before_create(table)
    inserts, ids = _converted_inserts(conn, table, table, perl_tz)
    adoption.rows = len(ids)
    next_id = backend.ids_handed_out_below(conn, table, max(ids, default=0))
    adoption.after_create += sequence
    adoption.after_create += inserts
    adoption.after_create += backend.next_id_at_least(table, next_id)
    adoption.after_create += grants
    return adoption


def copy_rows(conn: Connection, source: str, target: str, perl_tz: ZoneInfo) -> list[int]:
    """Copy DBIx::Locker table ``source``'s rows, converted, into lock table ``target``;
    returns their ids."""
    inserts, ids = _converted_inserts(conn, source, target, perl_tz)
    for insert in inserts:
        conn.execute(insert)
    return ids


def _converted_inserts(
    conn: Connection, source: str, target: str, perl_tz: ZoneInfo
) -> tuple[list[Executable], list[int]]:
    """The inserts of ``source``'s rows as they are now into ``target``, and their ids."""
    old = sa.table(source, *(sa.column(name) for name in sorted(_DBIX_COLUMNS)))
    rows = conn.execute(sa.select(old).order_by(old.c.id)).all()
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
    plain = _plain(target)
    inserts: list[Executable] = []
    for start in range(0, len(converted), _INSERT_BATCH):
        batch = converted[start : start + _INSERT_BATCH]
        inserts.append(
            sa.insert(plain).values([_as_column_values(values, conn.dialect) for values in batch])
        )
    return inserts, [int(values["id"]) for values in converted]


def _columns(conn: Connection, table: str) -> dict[str, Any]:
    """The columns of ``table`` (empty if it does not exist)."""
    inspector = sa.inspect(conn)
    if not inspector.has_table(table):
        return {}
    return {column["name"]: column for column in inspector.get_columns(table)}


def _utc(value: Any, zone: ZoneInfo, fold: int) -> datetime:
    """A DBIx::Locker time (a local time of ``zone``, as text or a naive datetime) in UTC (an
    aware one, which no adoptable table holds, as is).
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


def _plain(target: str) -> sa.TableClause:
    """The lock table ``target`` (a checked name, or the name MySQL builds it under, longer)
    with its values as text, so that the insert binds (or, for ``--sql``, writes out) each
    value as the backend reads it in."""
    return sa.table(
        target,
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
