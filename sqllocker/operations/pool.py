"""The connections the lock operations run on: a ConnectionStack of an engine sqllocker made,
or the pool of a caller's Engine; and the errors of a database that lends none."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.pool import QueuePool, StaticPool

from .. import deadlines
from ..backends import Backend, backend_class
from ..connections import ConnectionStack
from ..engine import describe_url
from ..errors import DatabaseError, LockError, one_line
from ..execution import DriverSession, PreparedCache, forget_cursor, kept_cursor
from ..sqlalchemy_internals import most_connections
from .in_memory import DatabaseInMemory
from .waits import THREADS, Waits

# The fewest connections a pool must allow for a Locker to keep one listening for releases:
# the lock operations must always have at least two of the rest.
LISTENING_BUDGET = 3


class Connections:
    """The connections of ``engine`` for the lock operations (see ``Database`` for
    ``owns_engine``, ``transaction_pooling``, ``direct_connections`` and ``waits``).
    ``reached``: a connection has been made and set up before, so one that fails now is an
    outage (a restart or a failover), not a wrong URL."""

    def __init__(
        self,
        engine: Engine,
        *,
        owns_engine: bool,
        transaction_pooling: bool,
        direct_connections: bool,
        waits: Waits = THREADS,
    ) -> None:
        self.engine = engine
        self.url = engine.url
        self.owns_engine = owns_engine
        self.transaction_pooling = transaction_pooling
        self.reached = False
        # An in-memory SQLite database lives in one connection (StaticPool): no stack, and one
        # operation at a time on it, whichever thread or task runs it: a task's operation
        # awaits the driver between its statements, and another's must not come in between
        # (into a group's transaction, say, and out with its rollback).
        direct = direct_connections and owns_engine and isinstance(engine.pool, QueuePool)
        self.stack = ConnectionStack(engine, waits.connection_changes) if direct else None
        self.one_connection = isinstance(engine.pool, StaticPool)
        # A database that lives in the pool's one connection, and goes with it.
        self.in_memory: DatabaseInMemory | None = None
        if self.one_connection and backend_class(engine.dialect.name).in_memory(engine.url):
            self.in_memory = DatabaseInMemory()
            sa.event.listen(engine, "connect", self._connected)
        self.alone: contextlib.AbstractContextManager[Any] = (
            waits.one_operation_at_a_time() if self.one_connection else contextlib.nullcontext()
        )
        # Whether the pool can spare a connection for the release listener (see
        # Database.waits_by_ticket); the pool's limits never change.
        budget = self.connection_budget
        self.spares_listener = budget is None or budget >= LISTENING_BUDGET

    @contextmanager
    def pooled(self, backend: Backend, prepared: PreparedCache) -> Iterator[DriverSession]:
        """A connection of the engine's pool, in autocommit mode, for one operation.

        An engine sqllocker made is AUTOCOMMIT for every connection, so its raw pooled
        connections serve directly; a caller's Engine gets AUTOCOMMIT through an SQLAlchemy
        Connection, which also restores the connection's own setting when it goes back.
        """
        with self.alone:
            yield from self._pooled(backend, prepared)

    def _pooled(self, backend: Backend, prepared: PreparedCache) -> Iterator[DriverSession]:
        try:
            checkout: Any = self.engine.raw_connection() if self.owns_engine else None
            connection = None if self.owns_engine else self.engine.connect()
        except sa.exc.TimeoutError as error:
            raise self.no_free_connection(error) from error
        except self.connect_errors as error:
            raise self.unreachable(error) from error
        fairy = checkout if connection is None else connection.connection
        # A database in memory lives in the pool's one connection: never closed here.
        keeps_abandoned = self.in_memory is not None
        cursor = None
        watch = None
        try:
            dbapi_connection = fairy.dbapi_connection
            if keeps_abandoned:
                backend.settle(dbapi_connection)
            one_call = backend.in_one_call(dbapi_connection, self.owns_engine)
            warnings = backend.statement_warnings(dbapi_connection)
            cursor = kept_cursor(fairy)
            watch = deadlines.interrupting(backend, dbapi_connection)
            with watch:
                yield DriverSession(dbapi_connection, cursor, prepared, one_call, warnings)
        except sa.exc.DBAPIError as error:
            if error.connection_invalidated or backend.is_read_only(error):
                fairy.invalidate(error.orig)
                if self.owns_engine:
                    # The server went away: every pooled connection is as dead as this one.
                    self.engine.dispose()
            elif watch is not None and watch.connection_ended:
                fairy.invalidate(error.orig)
            raise
        except BaseException as error:
            if not isinstance(error, LockError):
                # Cancelled (async) or interrupted mid-statement (an exception from a signal
                # handler, such as a job's time limit, may be an Exception): the connection's
                # state is unknown (a statement may still be running, its answer still to
                # come), so it must not be reused; whatever it still runs is ended first, so
                # that closing it frees its locks. (A database in memory's one connection
                # serves on, settled before its next operation: closed, it would take every
                # lock with it.)
                try:
                    if cursor is not None:
                        backend.abandon(fairy.dbapi_connection, cursor)
                finally:
                    if keeps_abandoned:
                        forget_cursor(fairy)
                    else:
                        fairy.invalidate(error)
            elif watch is not None and watch.connection_ended:
                fairy.invalidate(error)
            raise
        else:
            if watch.connection_ended:
                # Interrupted as its statements ended: they stand, the connection goes.
                fairy.invalidate()
        finally:
            (fairy if connection is None else connection).close()

    @contextmanager
    def connection(self) -> Iterator[Connection]:
        """An SQLAlchemy Connection, for the rare statements outside the lock operations."""
        with self.alone:
            yield from self._connection()

    def _connection(self) -> Iterator[Connection]:
        try:
            connection = self.engine.connect()
        except sa.exc.TimeoutError as error:
            raise self.no_free_connection(error) from error
        except sa.exc.DBAPIError as error:
            raise self.unreachable(error) from error
        with connection:
            yield connection

    @property
    def connect_errors(self) -> tuple[type[BaseException], ...]:
        """What opening a connection raises: SQLAlchemy's wrapped errors, or the driver's own
        (``raw_connection()`` does not wrap them)."""
        return (sa.exc.DBAPIError, self.engine.dialect.loaded_dbapi.Error)

    def no_free_connection(self, error: sa.exc.TimeoutError) -> DatabaseError:
        """The error for a pool that lent no connection within its timeout."""
        return DatabaseError(
            f"no connection to {describe_url(self.url)} came free in time: {one_line(error)}; "
            "more threads or tasks run lock operations at once than the pool allows "
            "(pool_size + max_overflow, or the Locker's max_connections), or connections are "
            "held elsewhere"
        )

    def unreachable(self, error: BaseException | None) -> DatabaseError:
        """The error for a database that could not be connected to; ``error`` is the driver's,
        or SQLAlchemy's wrapping of it."""
        if isinstance(error, sa.exc.DBAPIError):
            error = error.orig
        advice = "check the URL (--url or $SQLLOCKER_URL) and that the server is running"
        if "unsupported startup parameter" in str(error):
            advice = (
                "a pooler such as PgBouncer refused the session settings sqllocker sends; if "
                "it pools transactions, pass transaction_pooling=True (the command line's "
                "--transaction-pooling)"
            )
        url = describe_url(self.url)
        # Reachable before: a restart or a failover, not a wrong URL.
        outage = self.reached
        return DatabaseError(f"cannot connect to {url}: {one_line(error)}; {advice}", outage=outage)

    def close(self) -> None:
        if not self.owns_engine:
            return
        # Between operations: one closing the connection under another's statement crashed
        # the interpreter (SQLite in memory, its one connection shared by threads).
        with self.alone:
            if self.in_memory is not None:
                self.in_memory.gone("its Locker was closed")
            self.engine.dispose()

    def forget_connections(self) -> None:
        """Drop the engine's connections without closing them (an AsyncLocker's, when the event
        loop they were made on has ended, which alone could close them)."""
        if self.stack is not None:
            self.stack.forget()
        if self.owns_engine:
            if self.in_memory is not None:
                self.in_memory.gone("its AsyncLocker moved to another event loop")
            self.engine.dispose(close=False)

    def _connected(self, _dbapi_connection: Any, _record: Any) -> None:
        """A new connection to a database in memory, and so a new database: the one before is
        gone, however its connection went."""
        assert self.in_memory is not None
        self.in_memory.connected()

    @property
    def connection_budget(self) -> int | None:
        """How many connections the engine's pool lets be open at once (None: no limit), which
        the lock operations share with the Locker's listener."""
        pool = self.engine.pool
        return most_connections(pool) if isinstance(pool, QueuePool) else None

    def reserve_for_waiting(self) -> None:
        """Set aside one of the pool's connections for the Locker's listener (which keeps its
        waiters' tickets alive), checked out of the pool for as long as it listens. Asked
        before any connection is made (whether the table has its line of tickets is not known
        yet): a ConnectionStack, which the pool does not see, opens one fewer from the start."""
        dialect = self.engine.dialect
        if self.transaction_pooling or not backend_class(dialect.name).takes_tickets(dialect):
            return
        if self.spares_listener and self.stack is not None:
            self.stack.reserve(1)

    def connections(self) -> tuple[int, int]:
        """(open, in use): the connections the lock operations have now, for the benchmark and
        the soak test (the engine's pool also counts those it lends to other statements)."""
        if self.stack is not None:
            return self.stack.open, self.stack.in_use
        pool: Any = self.engine.pool
        return pool.checkedin() + pool.checkedout(), pool.checkedout()
