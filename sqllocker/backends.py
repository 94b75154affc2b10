"""What differs between SQLite, PostgreSQL and MySQL/MariaDB, and nothing else.

Each backend says how to read the *server's* clock and shift it by a number of seconds (client
clocks are never consulted: DBIx::Locker's client-side local-time strings let a purge in another
time zone delete a live lock), how acquire can take over an expired row, and how its driver
reports the few errors sqllocker must tell apart.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Dialect
from sqlalchemy.sql.elements import ColumnElement

from .schema import UTCDateTime

SQLITE_TIMESTAMP_FORMAT = "%Y-%m-%d %H:%M:%f"


@dataclass(frozen=True)
class Backend:
    """One database family's clock, capabilities and error codes."""

    name: str
    # PostgreSQL takes over an expired row in one statement (ON CONFLICT DO UPDATE ... WHERE
    # expired); the others delete the row if still expired and insert again.
    atomic_takeover: bool
    # PostgreSQL and MySQL can share-lock one row until the caller's transaction ends (FOR
    # SHARE); SQLite can only take its database-wide write lock, by writing to the row.
    share_locks_rows: bool
    insert_returning: bool
    update_returning: bool

    @property
    def begin(self) -> str:
        """How a transaction of several lock statements starts: SQLite takes its write lock at
        once (a deferred transaction that writes after another's commit fails "database is
        locked" at once, whatever the busy timeout)."""
        return "BEGIN IMMEDIATE" if self.name == "sqlite" else "BEGIN"

    def now(self) -> ColumnElement[Any]:
        """The server's current time, re-read per statement (not frozen at transaction start)."""
        if self.name == "postgresql":
            return sa.func.pg_catalog.clock_timestamp(type_=UTCDateTime())
        if self.name == "mysql":
            return sa.func.utc_timestamp(sa.literal_column("6"), type_=UTCDateTime())
        return sa.func.strftime(SQLITE_TIMESTAMP_FORMAT, "now", type_=UTCDateTime())

    def shifted_now(self, param: str) -> ColumnElement[Any]:
        """The server's time plus the bound parameter ``param`` (see :meth:`seconds_value`)."""
        if self.name == "postgresql":
            return sa.func.pg_catalog.clock_timestamp(type_=UTCDateTime()) + sa.cast(
                sa.bindparam(param, type_=sa.Interval()), sa.Interval()
            )
        if self.name == "mysql":
            return sa.func.timestampadd(
                sa.literal_column("MICROSECOND"),
                sa.bindparam(param, type_=sa.BigInteger()),
                sa.func.utc_timestamp(sa.literal_column("6")),
                type_=UTCDateTime(),
            )
        return sa.func.strftime(
            SQLITE_TIMESTAMP_FORMAT,
            sa.func.julianday("now") + sa.bindparam(param, type_=sa.Float()) / 86400.0,
            type_=UTCDateTime(),
        )

    def shifted(self, moment: ColumnElement[Any], param: str) -> ColumnElement[Any]:
        """A timestamp column (or expression) plus the bound parameter ``param`` (see
        :meth:`seconds_value`)."""
        if self.name == "postgresql":
            return moment + sa.cast(sa.bindparam(param, type_=sa.Interval()), sa.Interval())
        if self.name == "mysql":
            return sa.func.timestampadd(
                sa.literal_column("MICROSECOND"),
                sa.bindparam(param, type_=sa.BigInteger()),
                moment,
                type_=UTCDateTime(),
            )
        return sa.func.strftime(
            SQLITE_TIMESTAMP_FORMAT,
            sa.func.julianday(moment) + sa.bindparam(param, type_=sa.Float()) / 86400.0,
            type_=UTCDateTime(),
        )

    def with_json_key(
        self, document: ColumnElement[Any], key: str, text: ColumnElement[Any]
    ) -> ColumnElement[Any]:
        """JSON ``document`` with ``key`` set to the string ``text`` (an SQL expression)."""
        if self.name == "postgresql":
            path = sa.cast(sa.literal("{" + key + "}"), postgresql.ARRAY(sa.Text))
            value = sa.func.pg_catalog.to_jsonb(sa.cast(text, sa.Text))
            return sa.func.pg_catalog.jsonb_set(document, path, value)
        return sa.func.json_set(document, sa.literal(f"$.{key}"), sa.cast(text, sa.String))

    def seconds_value(self, seconds: float) -> Any:
        """A number of seconds as :meth:`shifted_now` wants its parameter."""
        if self.name == "postgresql":
            return timedelta(seconds=seconds)
        if self.name == "mysql":
            return round(seconds * 1_000_000)
        return seconds

    def equal(self, left: ColumnElement[Any], right: ColumnElement[Any]) -> ColumnElement[bool]:
        """``left = right`` for strings. On PostgreSQL both sides are cast to text: varchar has
        no ``=`` of its own, so an exact ``=(varchar, varchar)`` that another role created in a
        schema on our path would be chosen over pg_catalog's (CVE-2018-1058); with text on both
        sides, pg_catalog's is the exact match, and it comes first."""
        return self._as_text(left) == self._as_text(right)

    def starts_with(self, column: ColumnElement[str], prefix: str) -> ColumnElement[bool]:
        """``column`` starts with the constant ``prefix`` (which holds no wildcard), exactly."""
        if self.name == "postgresql":
            return sa.func.pg_catalog.starts_with(
                self._as_text(column), sa.cast(sa.literal(prefix), sa.Text), type_=sa.Boolean()
            )
        if self.name == "sqlite":
            # GLOB, as LIKE would ignore case.
            return column.op("GLOB", is_comparison=True)(sa.literal(prefix + "*"))
        return column.like(sa.literal(prefix + "%"))

    def _as_text(self, value: ColumnElement[Any]) -> ColumnElement[Any]:
        return sa.cast(value, sa.Text) if self.name == "postgresql" else value

    def quote_identifier(self, name: str) -> str:
        """``name`` as a quoted SQL identifier (PostgreSQL's rules)."""
        return '"' + name.replace('"', '""') + '"'

    def matches_glob(self, column: ColumnElement[str]) -> ColumnElement[bool]:
        """``column`` matches the bound ``pattern`` (see :meth:`glob_value`), case-sensitively."""
        pattern = sa.bindparam("pattern", type_=sa.String())
        if self.name == "sqlite":
            # SQLite's LIKE ignores ASCII case; GLOB does not, and is a glob already.
            return column.op("GLOB")(pattern)
        return self._as_text(column).like(pattern, escape="\\")

    def literal_glob(self, text: str) -> str:
        """``text`` as the start of a :meth:`matches_glob` pattern that matches only itself:
        nothing in it is a wildcard, ``*`` and ``?`` included."""
        if self.name == "sqlite":
            return "".join(f"[{ch}]" if ch in "[*?" else ch for ch in text)
        return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")

    def glob_value(self, pattern: str) -> str:
        """A shell-style pattern (``*`` and ``?`` are the wildcards) as :meth:`matches_glob`
        wants it; every other character, SQL's own wildcards included, matches only itself."""
        if self.name == "sqlite":
            return pattern.replace("[", "[[]")
        escaped = pattern.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        return escaped.replace("*", "%").replace("?", "_")

    # -- errors -------------------------------------------------------------------------------

    def is_unique_violation(self, error: sa.exc.DBAPIError) -> bool:
        if self.name == "postgresql":
            return _sqlstate(error) == "23505"
        if self.name == "mysql":
            return _mysql_errno(error) == 1062
        return isinstance(error.orig, sqlite3.IntegrityError) and "UNIQUE" in str(error.orig)

    def is_transient_conflict(self, error: sa.exc.DBAPIError) -> bool:
        """Contention the database resolved by failing us: try again, it is not a fault."""
        if self.name == "postgresql":
            # serialization failure, deadlock, lock_timeout
            return _sqlstate(error) in {"40001", "40P01", "55P03"}
        if self.name == "mysql":
            # lock wait timeout, deadlock, and InnoDB's AUTO-INC lock lost to a deadlock or a
            # timeout ("Failed to read auto-increment value"), met by transactions of several
            # INSERT ... SELECTs (lock_all)
            return _mysql_errno(error) in {1205, 1213, 1467}
        return _sqlite_busy(error)

    def is_missing_table(self, error: sa.exc.DBAPIError) -> bool:
        if self.name == "postgresql":
            return _sqlstate(error) == "42P01"
        if self.name == "mysql":
            return _mysql_errno(error) == 1146
        return "no such table" in str(error.orig)


def backend_for(dialect: Dialect) -> Backend:
    name = dialect.name
    if name == "postgresql":
        return Backend(
            name,
            atomic_takeover=True,
            share_locks_rows=True,
            insert_returning=True,
            update_returning=True,
        )
    if name in {"mysql", "mariadb"}:
        # MariaDB >= 10.5 has INSERT ... RETURNING, MySQL none; neither has UPDATE ... RETURNING.
        return Backend(
            "mysql",
            atomic_takeover=False,
            share_locks_rows=True,
            insert_returning=bool(dialect.insert_returning),
            update_returning=False,
        )
    if name == "sqlite":
        returning = sqlite3.sqlite_version_info >= (3, 35)
        return Backend(
            name,
            atomic_takeover=False,
            share_locks_rows=False,
            insert_returning=returning,
            update_returning=returning,
        )
    raise ValueError(f"sqllocker supports SQLite, PostgreSQL and MySQL/MariaDB, not {name!r}")


def _sqlstate(error: sa.exc.DBAPIError) -> str | None:
    return getattr(error.orig, "sqlstate", None)


def _mysql_errno(error: sa.exc.DBAPIError) -> int | None:
    args = getattr(error.orig, "args", ())
    return args[0] if args and isinstance(args[0], int) else None


def _sqlite_busy(error: sa.exc.DBAPIError) -> bool:
    return isinstance(error.orig, sqlite3.OperationalError) and (
        "database is locked" in str(error.orig) or "database table is locked" in str(error.orig)
    )
