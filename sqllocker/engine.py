"""Turning what the caller gave (nothing, a URL, an Engine) into the engine the locker uses.

Only engines sqllocker creates get its connection settings (each backend's ``connect_args`` and
``configure_engine``: SQLite WAL and busy timeout, PostgreSQL ``synchronous_commit=on``, connect
timeouts); a caller's own Engine is used as it is,
with AUTOCOMMIT applied per connection, because changing it would change the caller's other work.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import URL, Engine, make_url

from . import deadlines
from .backends import Backend, backend_class, url_names
from .errors import LockValueError

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

logger = logging.getLogger("sqllocker")

URL_ENVIRONMENT_VARIABLE = "SQLLOCKER_URL"
# Set by ``sqllocker run`` in the environment of a command it withheld $SQLLOCKER_URL from:
# a sqllocker in it that is given no URL must not fall back to the local SQLite file, and so
# lock apart from everyone else who locks the same names in the run's database.
URL_WITHHELD_VARIABLE = "SQLLOCKER_URL_WITHHELD"
DEFAULT_SQLITE_FILE = "sqllocker.db"
_engines_we_own: weakref.WeakSet[Engine] = weakref.WeakSet()


def resolve_url(url: str | URL | None, *, asynchronous: bool = False) -> URL:
    """None means $SQLLOCKER_URL, else the SQLite file sqllocker.db in the working directory.

    A URL that names no driver gets sqllocker's choice for its backend (an async driver if
    ``asynchronous``); one that names a driver keeps it.
    """
    if url is None:
        url = os.environ.get(URL_ENVIRONMENT_VARIABLE)
        if not url and os.environ.get(URL_WITHHELD_VARIABLE):
            raise LockValueError(
                "no database URL: `sqllocker run` passed its own on to this command only in "
                f"${URL_ENVIRONMENT_VARIABLE} with --pass-url (it may hold a password), and the "
                f"default, the local file {DEFAULT_SQLITE_FILE}, would lock apart from the "
                "run's database; give this sqllocker its URL (--url)"
            )
        url = url or f"sqlite:///{DEFAULT_SQLITE_FILE}"
    names = url_names()
    if isinstance(url, str):
        scheme, separator, rest = url.partition("://")
        backend_name = scheme.partition("+")[0]
        if separator and backend_name in names:
            url = backend_class(backend_name).url_text(url)
            scheme, separator, rest = url.partition("://")
        if separator and scheme in names:
            url = f"{_driver_scheme(scheme, asynchronous)}://{rest}"
        try:
            url = make_url(url)
        except (sa.exc.ArgumentError, ValueError):
            # The message must not repeat the string: it may hold a password.
            raise LockValueError(
                f"not a database URL: {scheme + separator if separator else 'no scheme'}...; "
                "expected e.g. postgresql://user@host/db, mysql://user@host/db or "
                "sqlite:///path/to.db"
            ) from None
    elif asynchronous and "+" not in url.drivername and url.drivername in names:
        url = url.set(drivername=_driver_scheme(url.drivername, asynchronous))
    return url


def _driver_scheme(name: str, asynchronous: bool) -> str:
    return backend_class(name).driver_scheme(name, asynchronous)


def create_locker_engine(
    url: URL, *, transaction_pooling: bool = False, max_connections: int | None = None
) -> Engine:
    """An engine configured for short autocommit lock statements on ``url``'s backend (reached
    through a transaction-pooling PgBouncer if ``transaction_pooling``), whose pool opens at
    most ``max_connections`` to a server (None: SQLAlchemy's 5 + 10)."""
    options = _engine_options(url, transaction_pooling, max_connections)
    try:
        engine = sa.create_engine(url, **options)
    except (sa.exc.NoSuchModuleError, ImportError) as error:
        raise LockValueError(
            f"{describe_url(url)}: sqllocker cannot reach this database: {error} (supported: "
            "sqlite, postgresql (pip install 'sqllocker[postgres]'), mysql (sqllocker[mysql]))"
        ) from None
    _configure(engine)
    return engine


def create_async_locker_engine(
    url: URL, *, transaction_pooling: bool = False, max_connections: int | None = None
) -> AsyncEngine:
    """The same, for the async front end (``url`` must name an async driver)."""
    from sqlalchemy.ext.asyncio import create_async_engine

    options = _engine_options(url, transaction_pooling, max_connections)
    try:
        engine = create_async_engine(url, **options)
    except sa.exc.InvalidRequestError as error:  # a sync driver
        raise LockValueError(
            f"{describe_url(url)} names a driver without asyncio support; use "
            "postgresql+psycopg://, mysql+aiomysql:// or sqlite+aiosqlite:/// (or leave the "
            f"driver out): {error}"
        ) from error
    _configure(engine.sync_engine)
    return engine


def _engine_options(
    url: URL, transaction_pooling: bool, max_connections: int | None
) -> dict[str, Any]:
    def default(name: str, value: object) -> None:
        """A driver argument, unless the URL gives its own (the URL's wins)."""
        if name not in url.query:
            connect_args[name] = value

    backend = backend_class(url.get_backend_name())
    connect_args: dict[str, Any] = {}
    connect_args.update(backend.connect_args(url, transaction_pooling, default))
    options: dict[str, Any] = {
        "isolation_level": "AUTOCOMMIT",
        "connect_args": connect_args,
        # Every lock statement commits by itself, so the pool's rollback-on-return would be a
        # wasted round trip per operation (PyMySQL sends it over the network).
        "pool_reset_on_return": None,
    }
    pool_class = backend.pool_class(url)
    if pool_class is not None:
        options["poolclass"] = pool_class
    if max_connections is not None and backend.limits_connections:
        # SQLAlchemy's default split: 5 kept open, the rest opened as needed.
        pool_size = min(5, max_connections)
        options.update(pool_size=pool_size, max_overflow=max_connections - pool_size)
    return options


def _configure(engine: Engine) -> None:
    backend = backend_class(engine.dialect.name)
    # First: the backend's own may connect (returning the connection), with these caps.
    sa.event.listen(engine, "do_connect", _connect_within_deadline(backend))
    backend.configure_engine(engine)
    _engines_we_own.add(engine)


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


def _connect_within_deadline(backend: type[Backend]) -> Callable[..., None]:
    """A ``do_connect`` listener: within ``sqllocker.deadlines.connections_by``, the new
    connection gives up by its deadline (``Backend.cap_connect``)."""

    def cap(dialect: Any, _record: Any, _cargs: Any, cparams: dict[str, Any]) -> None:
        seconds = deadlines.connect_within()
        if seconds is not None:
            backend.cap_connect(dialect, cparams, seconds)

    return cap
