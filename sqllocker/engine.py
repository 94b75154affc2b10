"""Turning what the caller gave (nothing, a URL, an Engine) into the engine the locker uses.

Only engines sqllocker creates get its connection settings (SQLite WAL and busy timeout,
PostgreSQL ``synchronous_commit=on``, connect timeouts); a caller's own Engine is used as it is,
with AUTOCOMMIT applied per connection, because changing it would change the caller's other work.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import URL, AdaptedConnection, Engine, make_url

from .errors import LockValueError

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

logger = logging.getLogger("sqllocker")

URL_ENVIRONMENT_VARIABLE = "SQLLOCKER_URL"
DEFAULT_SQLITE_FILE = "sqllocker.db"
CONNECT_TIMEOUT_SECONDS = 10
# How long an SQLite connection waits for another process's write transaction. Lock operations
# hold the write lock for microseconds; this only has to outlast a burst of 8+ writers or a purge
# batch, and keeps "database is locked" from reaching users.
SQLITE_BUSY_TIMEOUT_SECONDS = 60
# PostgreSQL/MariaDB: a lock statement waits on another session's uncommitted row only if that
# session inserted inside a long transaction (not sqllocker's way). Bound the wait; a timeout is
# treated as contention, not as a failure.
ROW_LOCK_TIMEOUT_SECONDS = 10
# The longest any one statement may take, waits included (a purge batch, a migration step), and
# the longest a driver waits for an answer: past it, a statement stuck on a dead connection or a
# hung server fails, and an unlock() queued behind it gets its turn. A URL parameter of the same
# name (statement_timeout, read_timeout, ...) overrides it.
STATEMENT_TIMEOUT_SECONDS = 60
# PostgreSQL: a connection whose peer stopped answering is given up after this long (TCP
# keepalives for an idle one, tcp_user_timeout for unacknowledged data).
DEAD_PEER_SECONDS = 15

_DRIVER_FOR_SCHEME = {
    "postgres": "postgresql+psycopg",
    "postgresql": "postgresql+psycopg",
    "mysql": "mysql+pymysql",
    "mariadb": "mysql+pymysql",
}
# The async front end's drivers. psycopg 3 is both; aiomysql speaks PyMySQL's protocol and raises
# PyMySQL's errors, and aiosqlite runs the standard sqlite3 module on a thread.
_ASYNC_DRIVER_FOR_SCHEME = {
    "postgres": "postgresql+psycopg",
    "postgresql": "postgresql+psycopg",
    "mysql": "mysql+aiomysql",
    "mariadb": "mysql+aiomysql",
    "sqlite": "sqlite+aiosqlite",
}

_engines_we_own: weakref.WeakSet[Engine] = weakref.WeakSet()


def resolve_url(url: str | URL | None, *, asynchronous: bool = False) -> URL:
    """None means $SQLLOCKER_URL, else the SQLite file sqllocker.db in the working directory.

    A URL that names no driver gets sqllocker's choice for its backend (an async driver if
    ``asynchronous``); one that names a driver keeps it.
    """
    if url is None:
        url = os.environ.get(URL_ENVIRONMENT_VARIABLE) or f"sqlite:///{DEFAULT_SQLITE_FILE}"
    drivers = _ASYNC_DRIVER_FOR_SCHEME if asynchronous else _DRIVER_FOR_SCHEME
    if isinstance(url, str):
        scheme, separator, rest = url.partition("://")
        if separator and scheme in drivers:
            url = f"{drivers[scheme]}://{rest}"
        try:
            url = make_url(url)
        except (sa.exc.ArgumentError, ValueError):
            # The message must not repeat the string: it may hold a password.
            raise LockValueError(
                f"not a database URL: {scheme + separator if separator else 'no scheme'}...; "
                "expected e.g. postgresql://user@host/db, mysql://user@host/db or "
                "sqlite:///path/to.db"
            ) from None
    elif asynchronous and "+" not in url.drivername and url.drivername in drivers:
        url = url.set(drivername=drivers[url.drivername])
    return url


def create_locker_engine(url: URL, *, transaction_pooling: bool = False) -> Engine:
    """An engine configured for short autocommit lock statements on ``url``'s backend (reached
    through a transaction-pooling PgBouncer if ``transaction_pooling``)."""
    try:
        engine = sa.create_engine(url, **_engine_options(url, transaction_pooling))
    except (sa.exc.NoSuchModuleError, ImportError) as error:
        raise LockValueError(
            f"{describe_url(url)}: sqllocker cannot reach this database: {error} (supported: "
            "sqlite, postgresql (pip install 'sqllocker[postgres]'), mysql (sqllocker[mysql]))"
        ) from None
    _configure(engine)
    return engine


def create_async_locker_engine(url: URL, *, transaction_pooling: bool = False) -> AsyncEngine:
    """The same, for the async front end (``url`` must name an async driver)."""
    from sqlalchemy.ext.asyncio import create_async_engine

    try:
        engine = create_async_engine(url, **_engine_options(url, transaction_pooling))
    except sa.exc.InvalidRequestError as error:  # a sync driver
        raise LockValueError(
            f"{describe_url(url)} names a driver without asyncio support; use "
            "postgresql+psycopg://, mysql+aiomysql:// or sqlite+aiosqlite:/// (or leave the "
            f"driver out): {error}"
        ) from error
    _configure(engine.sync_engine)
    return engine


def _engine_options(url: URL, transaction_pooling: bool) -> dict[str, Any]:
    backend = url.get_backend_name()
    connect_args: dict[str, Any] = {}

    def default(name: str, value: object) -> None:
        """A driver argument, unless the URL gives its own (the URL's wins)."""
        if name not in url.query:
            connect_args[name] = value

    if backend == "sqlite":
        connect_args["timeout"] = SQLITE_BUSY_TIMEOUT_SECONDS
        # Lockers are shared between threads; SQLAlchemy's pool hands a connection to one at a time.
        connect_args["check_same_thread"] = False
    elif backend == "postgresql":
        connect_args.setdefault("connect_timeout", CONNECT_TIMEOUT_SECONDS)
        # libpq's own settings (not the server's), so they pass through a pooler too.
        default("keepalives", 1)
        default("keepalives_idle", DEAD_PEER_SECONDS // 3)
        default("keepalives_interval", DEAD_PEER_SECONDS // 6)
        default("keepalives_count", 3)
        default("tcp_user_timeout", DEAD_PEER_SECONDS * 1000)
        if transaction_pooling:
            # Each transaction may run on another server session: a statement prepared on one
            # is missing on the next (PgBouncer before 1.21), and PgBouncer refuses the
            # ``options`` startup parameter, whose settings would not reach later sessions
            # anyway. The settings check reads the server's own synchronous_commit instead.
            connect_args["prepare_threshold"] = None
        elif "options" not in url.query:
            # A lock row acknowledged and then lost in a crash would let a second holder in with
            # the same id; synchronous_commit=off does exactly that. Force it on for our session.
            connect_args["options"] = (
                f"-c synchronous_commit=on -c lock_timeout={ROW_LOCK_TIMEOUT_SECONDS * 1000} "
                f"-c statement_timeout={STATEMENT_TIMEOUT_SECONDS * 1000}"
            )
        if "application_name" not in url.query:
            connect_args["application_name"] = "sqllocker"
    elif backend in {"mysql", "mariadb"}:  # PyMySQL and aiomysql take the same arguments
        connect_args.setdefault("connect_timeout", CONNECT_TIMEOUT_SECONDS)
        if url.get_driver_name() == "pymysql":  # aiomysql has no socket timeouts
            default("read_timeout", STATEMENT_TIMEOUT_SECONDS)
            default("write_timeout", STATEMENT_TIMEOUT_SECONDS)
        if "init_command" not in url.query:
            connect_args["init_command"] = (
                f"SET SESSION innodb_lock_wait_timeout = {ROW_LOCK_TIMEOUT_SECONDS}"
            )
    return {
        "isolation_level": "AUTOCOMMIT",
        "connect_args": connect_args,
        # Every lock statement commits by itself, so the pool's rollback-on-return would be a
        # wasted round trip per operation (PyMySQL sends it over the network: ~60 us of a
        # ~400 us cycle).
        "pool_reset_on_return": None,
    }


def _configure(engine: Engine) -> None:
    if engine.dialect.name == "sqlite":
        sa.event.listen(engine, "connect", _configure_sqlite_connection)
    _engines_we_own.add(engine)


def _configure_sqlite_connection(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    try:
        # WAL lets readers (sqllocker list, operators) run beside writers. NORMAL synchronous is
        # durable across application crashes; only an OS crash can lose the last commits, and
        # SQLite locks are one-machine locks, so every holder dies with the OS too.
        _use_wal(cursor, _sleep_for(dbapi_connection))
        cursor.execute("PRAGMA synchronous=NORMAL")
    finally:
        cursor.close()


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
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.fetchall()
            return
        except Exception as error:  # sqlite3's or aiosqlite's OperationalError
            if "database is locked" not in str(error) or time.monotonic() >= deadline:
                raise
        sleep(delay)
        delay = min(delay * 2, 0.05)


def _forget_pools_after_fork() -> None:
    # A child must not use (or, on garbage collection, close) its parent's pooled sockets.
    for engine in list(_engines_we_own):
        engine.dispose(close=False)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools_after_fork)


def prepares_statements(driver_connection: Any) -> bool:
    """Whether ``driver_connection`` (psycopg's, sync or async) prepares statements it runs
    often on the server, which a transaction pooler before PgBouncer 1.21 breaks: the next
    run lands on another server session, where "prepared statement ... does not exist"."""
    return getattr(driver_connection, "prepare_threshold", None) is not None


# Query parameters that carry secrets (libpq's password and sslpassword, a token, ...).
_SECRET_QUERY_WORDS = ("pass", "pwd", "secret", "token", "key")


def describe_url(url: URL) -> str:
    """The URL without its password, nor any secret among its query parameters, for messages."""
    hidden = {
        name: "***"
        for name in url.query
        if any(word in name.lower() for word in _SECRET_QUERY_WORDS)
    }
    if hidden:
        url = url.update_query_dict(hidden)
    return url.render_as_string(hide_password=True).replace("%2A%2A%2A", "***")
