"""SQLite: the embedded default. One machine, one file, one writer at a time (WAL)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import re
import sqlite3
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import unquote_to_bytes

import sqlalchemy as sa
from sqlalchemy.dialects import sqlite
from sqlalchemy.engine import URL, AdaptedConnection, Connection, Dialect, Engine
from sqlalchemy.pool import AssertionPool, AsyncAdaptedQueuePool, NullPool, Pool, StaticPool
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.expression import Executable
from sqlalchemy.types import TypeEngine
from sqlalchemy.util import asbool

from .. import file_queue
from ..schema import UTCDateTime
from ..server_settings import (
    LOSES_ROWS,
    SPLITS_THE_DATABASE,
    TAKES_NO_FILE_LOCKS,
    ServerSettings,
    UnsafeSetting,
)
from ..timeouts import SQLITE_BUSY_TIMEOUT_SECONDS
from .base import Backend, StatementParts

if TYPE_CHECKING:
    from sqlalchemy.sql import Insert
    from sqlalchemy.sql.selectable import TextualSelect

    from ..execution import OneCall

logger = logging.getLogger("sqllocker")

T = TypeVar("T")

TIMESTAMP_FORMAT = "%Y-%m-%d %H:%M:%f"
# SQLite without AUTOINCREMENT (DBIx::Locker's DDL) keeps no record of the ids it handed out and
# reuses the highest deleted one; an adopted table's new ids start this far above the highest row
# left (or the highest id handed out, where AUTOINCREMENT recorded it), past any id a stale Perl
# holder of a deleted row could still carry.
ADOPTED_ID_GAP = 1_000_000
# The page size of a file sqllocker makes. Each commit writes every page it changed to the log
# in full, and a lock's cycle changes seven (the row's, both indexes', the id sequence's): with
# SQLite's default of 4 KiB, writing them out was most of a cycle's time.
NEW_FILE_PAGE_SIZE = 1024


class SQLiteBackend(Backend):
    name = "sqlite"
    sync_driver = "sqlite"
    async_driver = "sqlite+aiosqlite"
    share_locks_rows = False
    limits_connections = False
    creates_table_on_first_use = True
    checkpoints_after_releases = True
    reads_timestamps_as_text = True
    # SQLite takes its write lock at once: a deferred transaction that writes after another's
    # commit fails "database is locked" at once, whatever the busy timeout.
    begin = "BEGIN IMMEDIATE"
    # A statement of a lock operation waits only in SQLite's busy handler, for another
    # connection's write lock, and for no longer than the busy timeout (which SQLite's
    # interrupt() does not cut short: it ends the statement once the wait is over); an
    # operation run under a deadline (a release, an extend) sends two statements at most.
    operation_wait_bound = 2 * SQLITE_BUSY_TIMEOUT_SECONDS
    # sqlite3's interrupt() ends the statements running, if any, and no more: the connection
    # (an in-memory database's only one) serves on.
    interrupt_ends_connection = False
    connects_locally = True

    @classmethod
    def for_dialect(cls, dialect: Dialect) -> Backend:
        returning = sqlite3.sqlite_version_info >= (3, 35)
        return cls(insert_returning=returning, update_returning=returning)

    def now(self) -> ColumnElement[Any]:
        return sa.func.strftime(TIMESTAMP_FORMAT, "now", type_=UTCDateTime())

    def shifted_now(self, param: str) -> ColumnElement[Any]:
        return self.shifted(sa.literal("now"), param)

    def shifted(self, moment: ColumnElement[Any], param: str) -> ColumnElement[Any]:
        return sa.func.strftime(
            TIMESTAMP_FORMAT,
            sa.func.julianday(moment) + sa.bindparam(param, type_=sa.Float()) / 86400.0,
            type_=UTCDateTime(),
        )

    def readable_text(self, column: ColumnElement[str]) -> ColumnElement[str]:
        # A database in UTF-8 keeps the bytes a client gives as text, UTF-8 or not (DBD::SQLite
        # those of a Perl byte string), and sqlite3 cannot read a value that is not UTF-8 as
        # text: read as its bytes. (One in UTF-16 converted the text as it was written, and its
        # bytes are UTF-16.)
        as_bytes = sa.case((_IN_UTF8, sa.cast(column, sa.LargeBinary())), else_=column)
        return sa.type_coerce(as_bytes, _ForeignText())

    def matches_glob(self, column: ColumnElement[str]) -> ColumnElement[bool]:
        # SQLite's LIKE ignores ASCII case; GLOB does not, and is a glob already.
        return column.op("GLOB", is_comparison=True)(sa.bindparam("pattern", type_=sa.String()))

    def literal_glob(self, text: str) -> str:
        return "".join(f"[{ch}]" if ch in "[*?" else ch for ch in text)

    def glob_value(self, pattern: str) -> str:
        return pattern.replace("[", "[[]")

    def starts_with(self, column: ColumnElement[str], prefix: str) -> ColumnElement[bool]:
        return column.op("GLOB", is_comparison=True)(sa.literal(self.literal_glob(prefix) + "*"))

    def acquire(self, statements: StatementParts) -> Insert:
        c = statements.table.c
        insert = sqlite.insert(statements.table).values(statements.new_row)
        insert = insert.on_conflict_do_nothing(index_elements=[c.lockstring])
        return insert.returning(*statements.returned) if self.insert_returning else insert

    def checkpoint(self) -> TextualSelect | None:
        """Copy what the write-ahead log holds back into the database file, now, without
        waiting for (or blocking) anyone.

        A purge batch writes thousands of WAL pages. Left alone, they are copied back by SQLite's
        auto-checkpoint in whichever connection next commits past the log's limit: usually a
        lock operation, which then takes milliseconds instead of a fraction of one.
        """
        return sa.text("PRAGMA wal_checkpoint(PASSIVE)").columns(
            sa.column("busy", sa.Integer),
            sa.column("log", sa.Integer),
            sa.column("checkpointed", sa.Integer),
        )

    @classmethod
    def timestamp_type(cls, dialect: Dialect) -> TypeEngine[Any]:
        # Plain text in, plain text out: the values are written by strftime() in SQL, and
        # SQLAlchemy's own SQLite DATETIME parser would insist on its own format.
        return dialect.type_descriptor(_TimestampText())

    @classmethod
    def timestamp_bind(cls, value: Any) -> Any:
        return value.strftime("%Y-%m-%d %H:%M:%S.%f")[:23]

    @classmethod
    def foreign_guid_default(cls) -> str:
        from ..schema import FOREIGN_GUID_PREFIX

        return f"('{FOREIGN_GUID_PREFIX}' || substr(lower(hex(randomblob(16))), 1, 31))"

    def is_unique_violation(self, error: sa.exc.DBAPIError) -> bool:
        return isinstance(error.orig, sqlite3.IntegrityError) and "UNIQUE" in str(error.orig)

    def is_transient_conflict(self, error: sa.exc.DBAPIError) -> bool:
        return isinstance(error.orig, sqlite3.OperationalError) and (
            "database is locked" in str(error.orig) or "database table is locked" in str(error.orig)
        )

    def is_missing_table(self, error: sa.exc.DBAPIError) -> bool:
        return "no such table" in str(error.orig)

    def is_read_only(self, error: sa.exc.DBAPIError) -> bool:
        # A file the process may not write: no other server to try.
        return False

    @classmethod
    def in_memory(cls, url: URL) -> bool:
        return _database_file(url) is None

    @classmethod
    def missing_database(cls, url: URL) -> str | None:
        database = _database_file(url)
        if database is None or os.path.exists(database):
            return None
        return os.path.abspath(database)

    @classmethod
    def queue_file(cls, url: URL) -> str | None:
        database = _database_file(url)
        return os.path.abspath(database) if database and file_queue.AVAILABLE else None

    @classmethod
    def pool_class(cls, url: URL) -> type[Pool] | None:
        asynchronous = url.get_driver_name() == "aiosqlite"
        if _database_file(url) is None:
            # The one connection a database in memory lives in, for every thread: with one per
            # thread (SingletonThreadPool), each thread had a database of its own, and two
            # threads could hold one lockstring at once. Named, too: SQLAlchemy 2.1 warns that
            # a later release will give a mode=memory URL a pool whose connections come and go.
            # (A Locker runs one operation at a time on it: Connections.alone.)
            return StaticPool
        # SQLAlchemy before 2.0.38 gives aiosqlite's file databases a NullPool: every lock
        # operation would open a connection and apply its settings.
        return AsyncAdaptedQueuePool if asynchronous else None

    @classmethod
    def connect_args(
        cls, url: URL, transaction_pooling: bool, default: Callable[[str, object], None]
    ) -> dict[str, Any]:
        return {
            "timeout": SQLITE_BUSY_TIMEOUT_SECONDS,
            # Lockers are shared between threads; the pool lends a connection to one at a time.
            "check_same_thread": False,
        }

    @classmethod
    def configure_engine(cls, engine: Engine) -> None:
        sa.event.listen(engine, "connect", _configure_connection)

    @classmethod
    def in_one_call(cls, dbapi_connection: Any, configured: bool) -> OneCall | None:
        # aiosqlite runs each call of a connection in its thread: a call is a thread's wake-up
        # and the event loop's, most of an async cycle (CHANGELOG.md). On the connections of
        # an engine sqllocker made, a statement that need not wait runs without that trip.
        if isinstance(dbapi_connection, AdaptedConnection):
            return _in_one_call_of_aiosqlite(dbapi_connection, configured)
        return None

    @classmethod
    def statements_await(cls, configured: bool) -> bool:
        # On an engine sqllocker made, one that need not wait runs on the event loop's thread.
        return not configured

    @classmethod
    def interrupt(cls, dbapi_connection: Any) -> None:
        # A statement that runs ends at once; one waiting for another connection's write lock
        # (the busy timeout) only once that wait is over, which ``bound_waits`` cuts short.
        dbapi_connection.interrupt()

    @classmethod
    def abandon(cls, dbapi_connection: Any, cursor: Any) -> None:
        # Closed with a statement not run to its end, a connection is not closed: SQLite keeps
        # it, with the write lock that statement holds, until the statement is finalised, when
        # its cursor is freed (after a garbage collection, if a reference cycle holds it), and
        # the statement then commits. Such a statement is one still waiting for another
        # connection's write lock (under aiosqlite, a cancelled call runs on in its thread), or
        # an UPDATE ... RETURNING whose rows were not read. Interrupted, the first ends once its
        # wait is over, and the second at its next step (reading the rest of its rows), both
        # with SQLITE_INTERRUPT, their writes rolled back.
        raw = _sqlite3_of(dbapi_connection)
        if raw is not None:
            with contextlib.suppress(sqlite3.Error):
                raw.interrupt()  # from any thread
        try:
            if isinstance(dbapi_connection, AdaptedConnection):
                kept = getattr(cursor, "_cursor", None)  # aiosqlite's, under SQLAlchemy's
                if kept is not None and hasattr(kept, "fetchall"):
                    dbapi_connection.run_async(lambda _driver: _finish_aiosqlite_cursor(kept))
            elif isinstance(cursor, sqlite3.Cursor):
                _finish_cursor(cursor)
            dbapi_connection.rollback()  # a transaction the operation began (BEGIN IMMEDIATE)
        except Exception as error:  # sqlite3's or aiosqlite's: the connection is closed next
            logger.debug("abandoning a connection: %s", error)

    @classmethod
    def settle(cls, dbapi_connection: Any) -> None:
        # Abandoned, an operation's statement is interrupted and its transaction rolled back;
        # but that rollback may itself have been cut short.
        raw = _sqlite3_of(dbapi_connection)
        if raw is not None and raw.in_transaction:
            logger.info("rolling back a transaction an abandoned lock operation left open")
            try:
                dbapi_connection.rollback()
            except Exception as error:  # sqlite3's or aiosqlite's; the operation meets it too
                logger.warning(
                    "could not roll back an abandoned operation's transaction: %s", error
                )

    @classmethod
    def bound_waits(cls, dbapi_connection: Any, seconds: float) -> object | None:
        # The busy timeout, where it is longer than what is left: SQLite's interrupt() does not
        # end a wait in the busy handler (a backup, an operator's shell holding the write lock).
        # Rounded up: a wait cut short of the deadline by a fraction of a millisecond would
        # end in an error judged as the database's, not as the deadline's (the lock lost).
        # No further: past the deadline, the watcher's interrupt, which the wait ignores, ends
        # the statement it lets run (a release that would have succeeded).
        if seconds >= SQLITE_BUSY_TIMEOUT_SECONDS:
            return None  # no connection sqllocker's operations run on waits longer
        cut = max(0, math.ceil(seconds * 1000))
        try:
            return _on_sqlite3(
                dbapi_connection,
                lambda conn: _cut_busy_timeout(conn, cut),
                lambda driver: _cut_busy_timeout_async(driver, cut),
            )
        except Exception as error:  # sqlite3's or aiosqlite's; the operation meets it too
            logger.warning("could not cut the busy timeout to the lock's deadline: %s", error)
            return None

    @classmethod
    def unbound_waits(cls, dbapi_connection: Any, undo: object) -> None:
        restore = f"PRAGMA busy_timeout = {int(undo)}"  # type: ignore[call-overload]
        try:
            _on_sqlite3(
                dbapi_connection,
                lambda conn: conn.execute(restore),
                lambda driver: driver.execute_fetchall(restore),
            )
        except Exception as error:
            logger.warning("closing a connection whose busy timeout was left cut: %s", error)
            with contextlib.suppress(Exception):
                dbapi_connection.close()

    @classmethod
    def in_transaction(cls, driver_connection: Any) -> bool | None:
        within = getattr(driver_connection, "in_transaction", None)  # sqlite3's, aiosqlite's
        return None if within is None else bool(within)

    def bound_silence(self, conn: Connection, seconds: float) -> None:
        """No network lies between SQLite and its client: a client that is silent in its
        transaction is a live process, and its file locks end with it."""

    def read_settings(self, conn: Connection, table: str) -> ServerSettings:
        problems = []
        # A crash loses a database in memory whole, with every process that could hold its
        # locks: its journal (MEMORY, always) and its syncing lose nothing that outlives them.
        # Asked of the connection, not the URL: a caller's ``creator`` may open a file (and
        # the memdb VFS names a database that is in memory all the same).
        files = {row[1]: row[2] for row in conn.exec_driver_sql("PRAGMA database_list")}
        main = files.get("main")
        if main and os.path.exists(main):
            if conn.exec_driver_sql("PRAGMA synchronous").scalar() == 0:
                problems.append(UnsafeSetting("PRAGMA synchronous=OFF", LOSES_ROWS))
            journal = str(conn.exec_driver_sql("PRAGMA journal_mode").scalar()).lower()
            if journal in {"off", "memory"}:
                setting = f"PRAGMA journal_mode={journal.upper()}"
                problems.append(UnsafeSetting(setting, LOSES_ROWS))
        problems += [
            UnsafeSetting(option, TAKES_NO_FILE_LOCKS) for option in _unlocked(conn.engine.url)
        ]
        pool = conn.engine.pool
        if _splits_a_database_in_memory(conn.engine.url, pool):
            problems.append(UnsafeSetting(f"a {type(pool).__name__}", SPLITS_THE_DATABASE))
        return ServerSettings(problems, lock_stripes=False, foreign=self.foreign_table(conn, table))

    def foreign_table(self, conn: Connection, table: str) -> str | None:
        columns = set(
            conn.exec_driver_sql("SELECT name FROM pragma_table_info(?)", (table,)).scalars()
        )
        if not columns:
            return None
        if "guid" not in columns:
            return "it has no guid column"
        ddl = conn.exec_driver_sql(
            "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)
        ).scalar()
        if "AUTOINCREMENT" not in str(ddl).upper():
            return "it is not AUTOINCREMENT, so SQLite reuses the ids of deleted rows"
        return None

    @classmethod
    @contextmanager
    def migration_connection(cls, engine: Engine) -> Iterator[Connection]:
        # BEGIN IMMEDIATE takes SQLite's write lock up front, so processes that all find the
        # table missing at once create it one after another; alembic joins the open transaction.
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                # Never in place of the error: a connection invalidated by an interrupt has
                # nothing left to roll back, and one that fails to is closed below.
                with contextlib.suppress(sa.exc.SQLAlchemyError):
                    if not conn.invalidated:
                        conn.exec_driver_sql("ROLLBACK")
                raise
            conn.exec_driver_sql("COMMIT")

    def adoption_before_create(self, table: str) -> list[Executable | str]:
        # The migration's BEGIN IMMEDIATE has kept every other writer out since the rows were
        # read; they wait (their busy timeout), then write to the new table.
        return [f"DROP TABLE {table}"]

    def ids_handed_out_below(self, conn: Connection, source: str, highest_row: int) -> int:
        # A table made with AUTOINCREMENT (not by DBIx::Locker's DDL) recorded the highest id
        # it ever handed out, which may be far above its rows.
        recorded = 0
        if conn.exec_driver_sql(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'sqlite_sequence'"
        ).first():
            seq = conn.exec_driver_sql(
                "SELECT max(seq) FROM sqlite_sequence WHERE name = ?", (source,)
            ).scalar()
            recorded = int(seq or 0)
        return max(highest_row, recorded) + 1 + ADOPTED_ID_GAP

    def next_id_at_least(self, table: str, first: int) -> list[Executable | str]:
        return [
            sa.text("DELETE FROM sqlite_sequence WHERE name = :table").bindparams(table=table),
            sa.text("INSERT INTO sqlite_sequence (name, seq) VALUES (:table, :last)").bindparams(
                table=table, last=first - 1
            ),
        ]


_IN_UTF8 = sa.literal_column("(SELECT encoding FROM pragma_encoding())") == "UTF-8"


class _ForeignText(sa.TypeDecorator[str]):
    """Text read as text, or as its bytes (``readable_text``): those decoded as UTF-8, a byte
    that is no UTF-8 shown as a ``\\xNN`` escape."""

    impl = sa.String()
    cache_ok = True

    def process_result_value(self, value: Any, dialect: Dialect) -> str | None:
        if value is None or isinstance(value, str):
            return value
        return bytes(value).decode("utf-8", "backslashreplace")


class _TimestampText(sa.types.UserDefinedType[str]):
    """Declared as DATETIME so that the column reads as a timestamp to people and tools."""

    cache_ok = True

    def get_col_spec(self, **kw: Any) -> str:
        return "DATETIME"


def _configure_connection(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    try:
        # WAL lets readers (sqllocker list, operators) run beside writers. NORMAL synchronous is
        # durable across application crashes; only an OS crash can lose the last commits, and
        # SQLite locks are one-machine locks, so every holder dies with the OS too.
        _use_wal(cursor, _sleep_for(dbapi_connection))
        cursor.execute("PRAGMA synchronous=NORMAL")
        # SQLite's own checkpoint runs inside whichever commit takes the log past its limit:
        # every so often a release, which still holds the lockstring's place in the queue file
        # (its waiters wait the checkpoint out too). The releases checkpoint instead, once
        # they have left their places (LockOperations.checkpoint_due).
        cursor.execute("PRAGMA wal_autocheckpoint=0")
    finally:
        cursor.close()


def _splits_a_database_in_memory(url: URL, pool: Pool) -> bool:
    """Whether ``pool`` (a caller's engine's: sqllocker's own keep one connection) splits an
    in-memory database: one without a shared cache is each connection's own, so only a pool
    of one connection shares it; one with a shared cache lives while a connection to it is
    open, which a NullPool closes after every operation."""
    if _database_file(url) is not None or isinstance(pool, (StaticPool, AssertionPool)):
        return False
    uri = _sqlite_uri(url)
    private = uri is None or uri[1].get("cache") != "shared"
    return private or isinstance(pool, NullPool)


# What SQLite reads as true in a URI's boolean option (``sqlite3_uri_boolean``), but a number.
_TRUE_WORDS = frozenset({"yes", "true", "on"})
_LEADING_DIGITS = re.compile(r"[0-9]+")


def _unlocked(url: URL) -> list[str]:
    """The options of ``url``'s SQLite URI with which it takes no file locks and still writes
    (``immutable`` takes none either, but writes nothing), as written. Any one of a repeated
    option counts, whichever SQLite reads: the check errs on the side of a warning."""
    parsed = _uri_parts(url)
    if parsed is None:
        return []
    unlocked = []
    for name, value in parsed[1]:
        if name == "nolock" and _uri_boolean(value):
            unlocked.append(f"nolock={value}")
        elif name == "vfs" and value.endswith("-none"):  # unix-none, win32-none
            unlocked.append(f"vfs={value}")
    return unlocked


def _uri_boolean(value: str) -> bool:
    """``value`` as SQLite reads a URI's boolean: a number by its leading digits (as a byte),
    else yes, true or on, in any case."""
    digits = _LEADING_DIGITS.match(value)
    if digits is not None:
        return int(digits.group()) % 256 != 0
    return value.lower() in _TRUE_WORDS


def _sqlite_uri(url: URL) -> tuple[str, dict[str, str]] | None:
    """``url``'s database as an SQLite URI (``uri=true``, as SQLAlchemy reads it): its path
    and its options (from the path, and from the URL's query, which SQLAlchemy passes on),
    or None where it is a plain file name."""
    parsed = _uri_parts(url)
    return None if parsed is None else (parsed[0], dict(parsed[1]))


def _uri_parts(url: URL) -> tuple[str, list[tuple[str, str]]] | None:
    """``_sqlite_uri`` with every option, in order, repeats and all. A value runs up to the
    next ``&`` (SQLAlchemy adds the URL's query after a ``?``, which SQLite reads as part of
    the value before it)."""
    database = url.database or ""
    uri = url.query.get("uri")
    if not isinstance(uri, str) or not database.startswith("file:"):
        return None
    try:
        if not asbool(uri):
            return None
    except ValueError:  # as SQLAlchemy reads it: it refuses the URL on connecting
        return None
    # As SQLite reads it: a fragment ends the URI, an authority is empty or "localhost", %HH
    # escapes are decoded (file:///tmp/my%20locks.db is "my locks.db"), a NUL ends a value.
    path, _, inline = database[len("file:") :].partition("#")[0].partition("?")
    if path.startswith("//"):
        authority, slash, rest = path[2:].partition("/")
        if authority in ("", "localhost"):
            path = slash + rest
    pairs = [part.partition("=")[::2] for part in inline.split("&") if part]
    # SQLAlchemy adds the URL's query to the URI as it is: SQLite decodes those too.
    pairs += [(key, value) for key, value in url.query.items() if isinstance(value, str)]
    return _uri_text(path), [(_uri_text(key), _uri_text(value)) for key, value in pairs]


def _uri_text(text: str) -> str:
    """A part of an SQLite URI as SQLite reads it: %HH escapes decoded to bytes (a file name's
    bytes, whatever their encoding), up to a NUL."""
    return os.fsdecode(unquote_to_bytes(text).partition(b"\0")[0])


def _database_file(url: URL) -> str | None:
    """The file of ``url``'s database as given (a URI's path without its options), or None for
    an in-memory one."""
    uri = _sqlite_uri(url)
    if uri is None:
        database = url.database or ""
    elif uri[1].get("mode") == "memory" or uri[1].get("vfs") == "memdb":
        return None
    else:
        database = uri[0]
    return None if database in ("", ":memory:") else database


def _in_one_call_of_aiosqlite(connection: AdaptedConnection, unwaited: bool) -> OneCall:
    """A statement in one hop to aiosqlite's thread: its rows by ``execute_fetchall``, where
    SQLAlchemy's cursor executes and fetches in two, or its count of rows changed by the
    connection's ``execute``, where SQLAlchemy 2.0's cursor also opens and closes a cursor of
    aiosqlite's around it. ``unwaited`` (a connection of an engine sqllocker made): first
    without the hop, if the statement need not wait (``_without_waiting``)."""

    def call(sql: str, parameters: Any, returns_rows: bool) -> tuple[list[Any], int]:
        if unwaited:
            done = _without_waiting(connection, sql, parameters, returns_rows)
            if done is not None:
                return done
        try:
            if returns_rows:
                fetched = connection.run_async(
                    lambda driver: driver.execute_fetchall(sql, parameters)
                )
                return list(fetched), -1
            cursor = connection.run_async(lambda driver: driver.execute(sql, parameters))
            return [], cursor.rowcount
        except ValueError as error:
            # A closed connection. aiosqlite's words for it changed, and SQLAlchemy 2.0 takes
            # only the older ones for a lost connection, 2.1 either: this says both.
            raise sqlite3.OperationalError(f"no active connection ({error})") from error

    return call


def _without_waiting(
    connection: AdaptedConnection, sql: str, parameters: Any, returns_rows: bool
) -> tuple[list[Any], int] | None:
    """``sql`` on aiosqlite's sqlite3 connection, from the event loop's thread, with no wait
    for another connection's write lock: its rows, or how many rows it changed (as
    ``_in_one_call_of_aiosqlite``); None if it would have waited (it wrote nothing), or
    aiosqlite's connection is gone: it is then sent to aiosqlite's thread, to wait there.

    A trip to aiosqlite's thread and back wakes that thread, then the event loop, and costs
    more than a lock cycle's statements themselves (``scripts/bench.py``, the async cycle's
    layers). Between an operation's calls aiosqlite's thread is idle; on a connection
    sqllocker configured a commit writes the log without syncing it (WAL,
    ``synchronous=NORMAL``) and runs no checkpoint (``wal_autocheckpoint=0``: the releases
    checkpoint, in aiosqlite's thread), so the statement holds the loop for its own work
    only; the first write after a checkpoint syncs the log's header, once per checkpoint. A
    statement in a transaction (a group's) goes to aiosqlite's thread, where it began. Such a
    statement gives the loop no turn: an acquire gives it one before it starts
    (``Backend.statements_await``)."""
    raw = getattr(connection.driver_connection, "_connection", None)  # aiosqlite's, not public
    if not isinstance(raw, sqlite3.Connection):
        return None
    try:
        if raw.in_transaction:
            return None  # a group's (BEGIN IMMEDIATE): its statements stay where it began
        own = raw.execute("PRAGMA busy_timeout").fetchone()[0]
    except sqlite3.ProgrammingError:  # closed meanwhile, or usable from its own thread only
        return None
    raw.execute("PRAGMA busy_timeout = 0")
    try:
        cursor = raw.execute(sql, parameters)
        if returns_rows:
            return cursor.fetchall(), -1
        return [], cursor.rowcount
    except sqlite3.OperationalError as error:
        if not _busy(error):
            raise
        # SQLite rolls a statement that found the database busy back; one whose commit did
        # (in a rollback journal, never in WAL mode) leaves its transaction open: nobody's.
        if raw.in_transaction:
            raw.rollback()
        return None
    finally:
        raw.execute(f"PRAGMA busy_timeout = {int(own)}")


def _busy(error: sqlite3.OperationalError) -> bool:
    """Whether ``error`` is SQLITE_BUSY (another connection holds the lock it needed)."""
    code = getattr(error, "sqlite_errorcode", None)  # Python 3.11 and later
    if code is None:
        return str(error).startswith("database is locked")
    return code & 0xFF == sqlite3.SQLITE_BUSY  # type: ignore[no-any-return]


def _on_sqlite3(
    dbapi_connection: Any,
    work: Callable[[sqlite3.Connection], T],
    hop: Callable[[Any], Awaitable[T]],
) -> T:
    """``work`` on ``dbapi_connection``'s sqlite3 connection. Under aiosqlite's, from this
    thread: between an operation's calls aiosqlite's own thread is idle, and a trip there and
    back (``hop``, on aiosqlite's connection) costs a wake-up of each thread; unless that
    connection may be used from its own thread only (a caller's engine, made without
    ``check_same_thread=False``)."""
    if not isinstance(dbapi_connection, AdaptedConnection):
        return work(dbapi_connection)
    driver = dbapi_connection.driver_connection
    raw = getattr(driver, "_connection", None)  # aiosqlite's, not public
    if isinstance(raw, sqlite3.Connection):
        try:
            return work(raw)
        except sqlite3.ProgrammingError:
            pass  # another thread's
    return dbapi_connection.run_async(hop)


def _sqlite3_of(dbapi_connection: Any) -> sqlite3.Connection | None:
    """The sqlite3 connection of ``dbapi_connection`` (sqlite3's, or aiosqlite's adapted by
    SQLAlchemy), or None once aiosqlite's is closed."""
    if not isinstance(dbapi_connection, AdaptedConnection):
        return dbapi_connection if isinstance(dbapi_connection, sqlite3.Connection) else None
    raw = getattr(dbapi_connection.driver_connection, "_connection", None)  # not public
    return raw if isinstance(raw, sqlite3.Connection) else None


def _finish_cursor(cursor: sqlite3.Cursor) -> None:
    """Step ``cursor``'s statement, if it has one not run to its end, and close it: interrupted
    (``SQLiteBackend.abandon``), the statement ends rolled back."""
    with contextlib.suppress(sqlite3.Error):
        cursor.fetchall()
    cursor.close()


async def _finish_aiosqlite_cursor(cursor: Any) -> None:
    """``_finish_cursor`` on aiosqlite's ``cursor``, in its connection's thread, after the call
    that thread is running."""
    with contextlib.suppress(sqlite3.Error):
        await cursor.fetchall()
    await cursor.close()


def _cut_busy_timeout(conn: sqlite3.Connection, cut: int) -> int | None:
    """``SQLiteBackend.bound_waits``: the busy timeout ``conn`` had, or None if ``cut`` (ms) is
    no shorter."""
    own = int(conn.execute("PRAGMA busy_timeout").fetchone()[0])
    if cut >= own:
        return None
    conn.execute(f"PRAGMA busy_timeout = {cut}")
    return own


async def _cut_busy_timeout_async(driver: Any, cut: int) -> int | None:
    """``_cut_busy_timeout`` on aiosqlite's connection, in one call of its adapter."""
    own = int((await driver.execute_fetchall("PRAGMA busy_timeout"))[0][0])
    if cut >= own:
        return None
    await driver.execute_fetchall(f"PRAGMA busy_timeout = {cut}")
    return own


def _sleep_for(dbapi_connection: Any) -> Callable[[float], None]:
    """How to pause on this connection: aiosqlite's (adapted by SQLAlchemy) connects on the
    application's event loop, where a blocking sleep would stall every other task."""
    if isinstance(dbapi_connection, AdaptedConnection):
        return lambda seconds: dbapi_connection.run_async(lambda _: asyncio.sleep(seconds))
    return time.sleep


def _use_wal(cursor: Any, sleep: Callable[[float], None]) -> None:
    """Put the file in WAL mode (which it keeps) unless it already is.

    Switching needs the file to itself, and SQLite answers "database is locked" at once,
    without waiting in its busy handler, while another connection writes. A file made by
    other tools starts in rollback-journal mode, and processes starting together on it failed
    to connect; so the switch is retried for as long as the busy timeout, and a file already
    in WAL mode, the usual case, is not asked to switch at all. (An in-memory database answers
    "memory" to the switch: that is as far as it goes.)
    """
    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_SECONDS
    delay = 0.001
    while True:
        cursor.execute("PRAGMA journal_mode")
        if str(cursor.fetchone()[0]).lower() == "wal":
            return
        try:
            # Only a file that holds nothing yet takes it (the switch to WAL writes the first).
            cursor.execute(f"PRAGMA page_size={NEW_FILE_PAGE_SIZE}")
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.fetchall()
            return
        except Exception as error:  # sqlite3's or aiosqlite's OperationalError
            if "database is locked" not in str(error) or time.monotonic() >= deadline:
                raise
        sleep(delay)
        delay = min(delay * 2, 0.05)
