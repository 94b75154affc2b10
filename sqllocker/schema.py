"""The lock table: the single definition that create_table(), the migrations and the statements use.

The column types are where the three backends are made to agree:

* ``id`` is the fencing token, so it must never be reused. SQLite reuses the highest deleted rowid
  unless the table is ``AUTOINCREMENT`` (DBIx::Locker's delete-by-id then deleted the next holder's
  lock); PostgreSQL sequences and InnoDB's persisted AUTO_INCREMENT never go back.
* ``lockstring`` compares exactly everywhere. MariaDB's default collations fold case and ignore
  trailing spaces, and even ``utf8mb4_bin`` pads; a NO PAD binary collation makes "Foo", "foo",
  "Foo " and "Foö" four locks there, as they are on PostgreSQL and SQLite.
* ``created``/``expires`` are UTC instants written from the server's clock only. SQLite has no
  timestamp type: they are stored as ``YYYY-MM-DD HH:MM:SS.SSS`` UTC text, which sorts correctly
  and reads plainly in the sqlite3 shell.
* ``guid`` has a database-side default, which sqllocker never uses: it lets DBIx::Locker, which
  does not know the column, keep inserting during a move from Perl, and marks its rows
  (:data:`FOREIGN_GUID_PREFIX`) so that they are judged by its clock's rules, not ours.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any, Protocol

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Dialect
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.types import TypeEngine

from .validation import MAX_LOCKSTRING_LENGTH, check_table_name

DEFAULT_TABLE = "semaphores"
GUID_LENGTH = 36
# The start of the guid the database writes for a client that leaves the column out
# (DBIx::Locker); sqllocker's own guids are hex digits only, so they never start with it.
FOREIGN_GUID_PREFIX = "dbix-"
# How much longer than its written expiry such a row counts as held. DBIx::Locker writes
# ``expires`` as its client's local time, which the table reads as UTC: a client west of UTC
# writes a time that many hours early. Waiting out the largest offset there is (14 hours) means
# no such row is ever taken over or purged while its holder still counts on it.
FOREIGN_CLOCK_MARGIN = 14 * 3600


class ForeignGuidDefault(sa.sql.expression.FunctionElement[str]):
    """The guid column's server default: :data:`FOREIGN_GUID_PREFIX` and 31 random hex digits.

    Such a row's holder knows no guid (DBIx::Locker releases by id alone), so the value only has
    to fill the column and mark the row; it is not a secret.
    """

    type = sa.String(GUID_LENGTH)
    name = "foreign_guid_default"
    inherit_cache = True


@compiles(ForeignGuidDefault)
def _foreign_guid_default(element: ForeignGuidDefault, compiler: SQLCompiler, **kw: Any) -> str:
    return _backend(compiler.dialect).foreign_guid_default()


class Lockstring(sa.TypeDecorator[str]):
    """VARCHAR(128) with exact (binary, no-pad) comparison on every backend."""

    impl = sa.String(MAX_LOCKSTRING_LENGTH)
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        return _backend(dialect).lockstring_type(dialect, MAX_LOCKSTRING_LENGTH)


class HolderJSON(sa.TypeDecorator[Any]):
    """JSON: who holds a lock (``locked_by``); PostgreSQL's JSONB."""

    impl = sa.JSON()
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        return _backend(dialect).holder_json_type(dialect)


class UTCDateTime(sa.TypeDecorator[datetime]):
    """A UTC instant; results are always timezone-aware UTC datetimes, whatever the backend."""

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        return _backend(dialect).timestamp_type(dialect)

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> Any:
        if value is None:
            return None
        return _backend(dialect).timestamp_bind(value.astimezone(timezone.utc))

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        return to_utc(value)

    def result_processor(self, dialect: Dialect, coltype: object) -> Any:
        # A driver that returns the text as it is (SQLite's) needs to_utc alone: two of these
        # are read on every acquire, and the decorator's generic chain costs two calls more each.
        if _backend(dialect).reads_timestamps_as_text:
            return to_utc
        return super().result_processor(dialect, coltype)


def to_utc(value: Any) -> datetime | None:
    """A timestamp from any backend (aware, naive-UTC, or SQLite text) as an aware UTC datetime."""
    if value is None:
        return None
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    if not isinstance(value, datetime):
        raise ValueError(f"not a timestamp: {value!r}")
    if value.tzinfo is None:
        return value.replace(tzinfo=timezone.utc)
    return value.astimezone(timezone.utc)


# The prefixes of SQLAlchemy's options for its two MySQL dialects: ``mysql+pymysql://`` and
# ``mariadb+pymysql://``, which takes only ``mariadb_`` ones without a warning (and a
# statement's ``limit`` only so).
_MYSQL_OPTION_PREFIXES = ("mysql_", "mariadb_")


def mysql_options(**options: object) -> dict[str, Any]:
    """SQLAlchemy's MySQL options (``engine=`` for ``mysql_engine``...), for both dialects."""
    return {
        prefix + name: value for prefix in _MYSQL_OPTION_PREFIXES for name, value in options.items()
    }


def lock_table(name: str = DEFAULT_TABLE, metadata: sa.MetaData | None = None) -> sa.Table:
    """The lock table named ``name``; a fresh MetaData unless one is given."""
    check_table_name(name)
    return sa.Table(
        name,
        metadata if metadata is not None else sa.MetaData(),
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            primary_key=True,
            autoincrement=True,
            comment="fencing token: strictly increasing, never reused",
        ),
        sa.Column("lockstring", Lockstring(), nullable=False),
        sa.Column(
            "guid", sa.String(GUID_LENGTH), nullable=False, server_default=ForeignGuidDefault()
        ),
        sa.Column("created", UTCDateTime(), nullable=False),
        sa.Column("expires", UTCDateTime(), nullable=False),
        sa.Column("locked_by", HolderJSON(), nullable=False),
        sa.UniqueConstraint("lockstring", name=unique_constraint_name(name)),
        sa.Index(expires_index_name(name), "expires"),
        sqlite_autoincrement=True,
        **mysql_options(engine="InnoDB", charset="utf8mb4"),
    )


def unique_constraint_name(table: str) -> str:
    return f"uq_{table}_lockstring"


def expires_index_name(table: str) -> str:
    return f"ix_{table}_expires"


class ColumnRules(Protocol):
    """What the table's column types ask of the database they are compiled for: its backend's
    (``backends.Backend``)."""

    reads_timestamps_as_text: bool

    def lockstring_type(self, dialect: Dialect, length: int) -> TypeEngine[Any]: ...

    def timestamp_type(self, dialect: Dialect) -> TypeEngine[Any]: ...

    def holder_json_type(self, dialect: Dialect) -> TypeEngine[Any]: ...

    def timestamp_bind(self, value: Any) -> Any: ...

    def foreign_guid_default(self) -> str: ...


# The backends build on this module's types; they give it how to find theirs when imported
# (``backends.backend_class``).
_column_rules: list[Callable[[str], ColumnRules]] = []


def use_column_rules(rules_of: Callable[[str], ColumnRules]) -> None:
    """Look up the column rules of a dialect, by its name, with ``rules_of`` from now on."""
    _column_rules[:] = [rules_of]


def _backend(dialect: Dialect) -> ColumnRules:
    return _column_rules[0](dialect.name)


# alembic's version table of the default lock table; a table of another name has its own.
VERSION_TABLE = "sqllocker_alembic_version"
# Where MySQL's old table goes when the new one is swapped in (dropped once the adoption is
# done), and the name the new one is built under until then.
SET_ASIDE_SUFFIX = "_dbix_locker"
SWAP_SUFFIX = "_sqllocker_new"


def version_table_for(table: str) -> str:
    """sqllocker_alembic_version for the default table; one per table for the others."""
    check_table_name(table)
    return VERSION_TABLE if table == DEFAULT_TABLE else f"{VERSION_TABLE}_{table}"


def current_revision_on(conn: Connection, table: str = DEFAULT_TABLE) -> str | None:
    """The migration revision recorded for ``table`` on ``conn``, or None."""
    from alembic.runtime.migration import MigrationContext  # alembic only when asked

    context = MigrationContext.configure(conn, opts={"version_table": version_table_for(table)})
    return context.get_current_revision()


def set_aside_name(table: str) -> str:
    return check_table_name(table) + SET_ASIDE_SUFFIX


def swap_name(table: str) -> str:
    return check_table_name(table) + SWAP_SUFFIX


# MySQL/MariaDB: the rows an acquire locks, one per stripe of lockstrings, so that acquirers of
# one lockstring draw their ids in turn (see ``Statements.acquire``). The stripe of a lockstring
# is CRC32 of its UTF-8 bytes modulo this; never change it without a migration that changes
# the rows, and never while any sqllocker of the old count runs.
ID_ORDER_STRIPES = 1024


def id_order_table_name(table: str) -> str:
    return f"{check_table_name(table)}_id_order"


def id_order_table(table: str) -> sa.Table:
    """MySQL/MariaDB: the stripes table beside lock table ``table`` (migration 0006)."""
    return sa.Table(
        id_order_table_name(table),
        sa.MetaData(),
        sa.Column("stripe", sa.SmallInteger(), primary_key=True, autoincrement=False),
        **mysql_options(engine="InnoDB"),
    )


def requests_table_name(table: str) -> str:
    return f"{check_table_name(table)}_requests"


def requests_table(table: str) -> sa.Table:
    """MySQL/MariaDB: the tickets of lock table ``table``'s waiters, one row each, numbered in
    the order they came (``sqllocker.tickets``), each with the SHA-256 of its waiter's guid (the
    guid is the holder's secret); alive while the GET_LOCK name of their ``liveness_key`` is
    held (``backends.mysql.liveness_name``). PostgreSQL's is reached only through the table's
    functions."""
    return sa.Table(
        requests_table_name(table),
        sa.MetaData(),
        sa.Column("ticket", sa.BigInteger(), primary_key=True, autoincrement=True),
        sa.Column("lockstring", Lockstring(), nullable=False),
        sa.Column("guid_sha256", sa.String(64), nullable=False),
        sa.Column("liveness_key", sa.BigInteger(), nullable=False),
        **mysql_options(engine="MEMORY"),
    )
