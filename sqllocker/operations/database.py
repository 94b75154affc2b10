"""The database the lock operations run on: its connections, the set-up on first use, and the
retries and error translation every operation shares.

Each operation checks out a connection, runs its statement(s), each one an autocommit
transaction of its own, and gives the connection back, so holding a lock holds no connection,
and a caller's own transaction never contains (or waits on, or rolls back) a lock row.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from .. import clock, deadlines, forks
from ..backends import Backend, backend_class
from ..connections import ConnectionStack, StackedConnection
from ..engine import describe_url
from ..errors import (
    UNREADABLE_VALUE,
    DatabaseError,
    LockError,
    TableMissing,
    one_line,
    unreadable_row,
)
from ..execution import DriverSession, PreparedCache
from ..schema import lock_table
from ..statements import Statements
from .pool import Connections
from .setup import Options, set_up
from .waits import THREADS, Waits

logger = logging.getLogger("sqllocker")

T = TypeVar("T")

# Retries of an operation that the database failed because of contention (deadlock victim,
# lock-wait timeout, SQLite busy). Each attempt may itself wait up to the backend's lock timeout.
CONFLICT_RETRIES = 8
# How often a caller looks whether another has finished setting up (rare: first use, and after
# a lost connection).
_SETUP_TURN_SECONDS = 0.001
_FIRST_CONFLICT_DELAY = 0.005


class _Turn:
    """A lock waited for by the caller's ``sleep``: an AsyncLocker's tasks run this code in
    greenlets on one thread, and a task blocked on a thread lock would stop the event loop, and
    with it the task holding the lock across an await. A forked child takes a lock of its own:
    the parent's may have been held at the fork by a thread the child does not have (one
    releasing a lock the collector freed, say), which would hold it for ever."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = forks.pid

    @contextmanager
    def __call__(self, sleep: Callable[[float], None]) -> Iterator[None]:
        if self._pid != forks.pid:
            self._lock, self._pid = threading.Lock(), forks.pid
        lock = self._lock
        while not lock.acquire(blocking=False):
            sleep(_SETUP_TURN_SECONDS)
        try:
            yield
        finally:
            lock.release()


# The process's migrations, one at a time: alembic runs one through module-level proxies
# (``alembic.context``, ``alembic.op``), and two at once, in threads or in the greenlets of an
# event loop's tasks, take each other's (a KeyError, a table created twice).
_one_migration = _Turn()


def _nothing_more(session: DriverSession) -> None:
    """An operation that is only its set-up (``Database.ensure_setup``)."""


class _NotSetUp:
    """What ``Database.be`` and ``Database.sql`` are before the set-up: any use raises."""

    def __init__(self, what: str) -> None:
        self._what = what

    def __getattr__(self, name: str) -> Any:
        raise LockError(f"internal error: {self._what} used before the first connection")


class Database:
    """``table_name`` through ``engine`` (a sync Engine, or an AsyncEngine's ``sync_engine``
    when called from a greenlet): the connections the lock operations run on, and what they
    learn of the database on first use.

    ``owns_engine``: the engine was made by sqllocker (AUTOCOMMIT on every connection, so raw
    pooled connections serve directly; disposed by :meth:`close`). ``transaction_pooling``: the
    connections reach PostgreSQL through a pooler that lends a server session per transaction,
    so nothing may rest on a session's state (see ``waits_by_ticket``).
    ``direct_connections``: run the lock operations on a ConnectionStack of the engine's
    connections rather than through its pool (an engine sqllocker made: see
    ``connections.py``). ``waits``: how the operations wait, for threads or for tasks (see
    ``Waits``).
    """

    def __init__(
        self,
        engine: Engine,
        table_name: str,
        *,
        owns_engine: bool,
        grace: float,
        auto_create: bool | None,
        strict: bool,
        transaction_pooling: bool = False,
        direct_connections: bool = False,
        waits: Waits = THREADS,
    ) -> None:
        self.engine = engine
        self.url = engine.url
        self.table_name = table_name
        self.table = lock_table(table_name)
        self.owns_engine = owns_engine
        self.grace = grace
        # By default only for SQLite, whose file sqllocker owns; a server's schema is the
        # operator's (`sqllocker migrate`).
        if auto_create is None:
            auto_create = backend_class(engine.dialect.name).creates_table_on_first_use
        self.auto_create = auto_create
        self.transaction_pooling = transaction_pooling
        self.sleep = waits.sleep
        self._options = Options(
            self.url, table_name, grace, strict, owns_engine, transaction_pooling
        )
        self.pool = Connections(
            engine,
            owns_engine=owns_engine,
            transaction_pooling=transaction_pooling,
            direct_connections=direct_connections,
            waits=waits,
        )
        self._backend: Backend | None = None
        self._statements: Statements | None = None
        # The backend and the statements inside an operation (set up by then): plain
        # attributes, read a few times a statement; before the set-up, any use of them is an
        # internal error.
        self.be: Backend = _NotSetUp("backend")  # type: ignore[assignment]
        self.sql: Statements = _NotSetUp("statements")  # type: ignore[assignment]
        # The parameters of the test whether a row may be taken over or purged now (set up
        # with the backend, which writes them; never changed by their users).
        self.expiry: dict[str, Any] = {}
        # See ServerSettings.replays_inserts and retries_autocommit: where a group's rows, and
        # where a lone acquire's row, are read back after their commit.
        self.inserts_replayed = False
        self.lone_inserts_retried = False
        # See ServerSettings.replicated: a waiter makes sure of a row handed to it
        # (``Acquirer.confirm_grant``); read again at every set-up, after a lost connection too.
        self.confirms_grants = False
        self._prepared: PreparedCache
        self.needs_setup = True  # see ensure_setup
        # The set-up's turn: setup again after a lost connection, when several threads or
        # tasks find it needed at once.
        self._setup_turn = _Turn()

    # -- what the set-up learnt ------------------------------------------------------------------

    @property
    def is_set_up(self) -> bool:
        """Whether a connection has taught the backend (and a set-up may still be due again)."""
        return self._backend is not None

    @property
    def backend(self) -> Backend:
        """The backend (set up on first use)."""
        if self._backend is None:
            self.ensure_setup()
        assert self._backend is not None
        return self._backend

    @property
    def statements(self) -> Statements:
        """Every statement for this table (set up on first use)."""
        if self._statements is None:
            self.ensure_setup()
        assert self._statements is not None
        return self._statements

    @property
    def waits_by_ticket(self) -> bool:
        """Whether waiters take tickets (see ``sqllocker.tickets``): on PostgreSQL through
        psycopg 3 and on MySQL/MariaDB, sync or async, unless a transaction pooler is between
        (LISTEN and the tickets' liveness lock would stay behind on whichever server session
        ran them), nor with a pool too small to spare the listener's connection, and only on a
        table made by its migration, which adds the line; elsewhere they back off and retry
        (SQLite: in the kernel's queue)."""
        dialect = self.engine.dialect
        return (
            backend_class(dialect.name).takes_tickets(dialect)
            and not self.transaction_pooling
            and self.pool.spares_listener
            and self.statements.has_line
        )

    @property
    def hands_over(self) -> bool:
        """Whether a release hands the row to the first live ticket (``Backend.hands_over``)."""
        return self.backend.hands_over

    @property
    def connects_locally(self) -> bool:
        """Whether a new connection opens a local file (``Backend.connects_locally``)."""
        return backend_class(self.engine.dialect.name).connects_locally

    @property
    def statements_await(self) -> bool:
        """Whether, under asyncio, a lock statement gives the event loop a turn
        (``Backend.statements_await``)."""
        return backend_class(self.engine.dialect.name).statements_await(self.owns_engine)

    @property
    def queue_file(self) -> str | None:
        """The database file beside which waiters queue in the kernel (SQLite), or None."""
        return backend_class(self.engine.dialect.name).queue_file(self.url)

    def ensure_setup(self) -> None:
        """Set up (``_set_up``) if it is due, outside any lock operation: as one, so that a
        connection lost meanwhile is retried and any failure is a LockError."""
        if self.needs_setup:
            self.run(None, _nothing_more)

    def _set_up(self) -> None:
        """Learn the backend and check the settings the locks' guarantees rest on: on first use,
        as the backend's capabilities (MariaDB's RETURNING) are known only once connected, and
        again after a connection was found lost. A server restarted since may run with other
        settings: one unsafe now is reported (strict: refused), and one switched to MySQL 8's
        ``innodb_autoinc_lock_mode=2`` needs the stripe lock from the next acquire on, not from
        the application's next restart."""
        if self.needs_setup:
            # The lock first: threads that all start at once must not each open a connection,
            # which the pool would then keep beside those of the lock operations.
            with self._setup_turn(self.sleep):
                if not self.needs_setup:
                    return
                with self.pool.connection() as conn:
                    setup = set_up(conn, self.table, self._options)
                    if self._backend is None:
                        self._prepared = PreparedCache(conn.dialect)
                    self._statements = self.sql = setup.statements
                    self._backend = self.be = setup.backend
                    self.inserts_replayed = setup.inserts_replayed
                    self.lone_inserts_retried = setup.lone_inserts_retried
                    self.confirms_grants = setup.confirms_grants
                    self.expiry = setup.expiry
                    self.pool.reached = True
                    self.needs_setup = False

    def create_table(self) -> None:
        """Create or upgrade the table by applying the shipped migrations; safe to repeat."""
        from ..migrations import upgrade

        with self.pool.alone, _one_migration(self.sleep):
            try:
                upgrade(self.engine, self.table_name)
            except sa.exc.SQLAlchemyError as error:
                raise DatabaseError(
                    f"could not create or upgrade lock table {self.table_name!r} in "
                    f"{describe_url(self.url)}: {one_line(error)}",
                    outage=isinstance(error, sa.exc.DBAPIError) and error.connection_invalidated,
                ) from error
        # A migration may change what the settings check found (0006's stripes table).
        self.needs_setup = True

    # -- running an operation ----------------------------------------------------------------------

    def run(
        self,
        lockstring: str | None,
        operation: Callable[[DriverSession], T],
        conflict_retries: int = CONFLICT_RETRIES,
        resent: Callable[[], None] | None = None,
    ) -> T:
        """Run ``operation`` on a pooled connection, translating driver errors into LockErrors.

        Every operation is safe to repeat (acquire recognises its own row by guid), so two kinds
        of failure are retried: a connection that turns out dead (the server restarted since it
        was pooled) is replaced once, and contention that the database resolved by rolling the
        statement back (a deadlock, a lock-wait timeout, SQLite busy) is retried with backoff,
        so that, say, a release chosen as a deadlock victim still releases. ``resent`` is
        called before the retry on a new connection: the first try's statement may still reach
        the server, later (an extend's would undo what the retry did).
        """
        created_table = False
        retried_connection = False
        conflicts = read_only = 0
        while True:
            try:
                return self._run_once(operation)
            except UNREADABLE_VALUE as error:
                if isinstance(error, LockError):
                    raise
                where = f"in {describe_url(self.url)} " + (
                    f"for lock {lockstring!r} " if lockstring is not None else ""
                )
                raise DatabaseError(
                    unreadable_row(self.table_name, where, error), lockstring
                ) from error
            except sa.exc.DBAPIError as error:
                if self._backend is not None and self.be.is_read_only(error):
                    # A standby, or a primary demoted by a failover: its connections were
                    # dropped (see _run_once), and a fresh one reaches the new primary once it
                    # is there, if the URL names every host.
                    self.needs_setup = True
                    if read_only < CONFLICT_RETRIES:
                        read_only += 1
                        logger.warning("%s accepts no writes; reconnecting", describe_url(self.url))
                        self.sleep(random.uniform(0, _FIRST_CONFLICT_DELAY * 2**read_only))
                        continue
                    raise DatabaseError(
                        f"{describe_url(self.url)} accepts no writes (a standby, or a primary "
                        "demoted by a failover): name every host of the cluster in the URL "
                        "(postgresql://user@host1:port1,host2:port2/db), so that sqllocker "
                        f"reconnects to the primary: {one_line(error.orig)}",
                        lockstring,
                        outage=True,
                    ) from error
                if error.connection_invalidated:
                    self.needs_setup = True  # the server may have restarted: see ensure_setup
                    # (Not once its deadline has passed: see sqllocker.deadlines.)
                    if not retried_connection and not deadlines.passed():
                        retried_connection = True
                        logger.warning(
                            "database connection was lost (%s); reconnecting", error.orig
                        )
                        if resent is not None:
                            resent()
                        continue
                if (
                    self._backend is not None
                    and self.be.is_transient_conflict(error)
                    and conflicts < conflict_retries
                    and not deadlines.passed()
                ):
                    conflicts += 1
                    logger.info("contention (%s); trying again", one_line(error.orig))
                    self.sleep(random.uniform(0, _FIRST_CONFLICT_DELAY * 2**conflicts))
                    continue
                if self._backend is not None and self.be.is_missing_table(error):
                    if self.auto_create and not created_table:
                        created_table = True
                        logger.info("creating lock table %s", self.table_name)
                        self.create_table()
                        continue
                    raise self._table_missing(lockstring) from error
                raise DatabaseError(
                    f"database error on {describe_url(self.url)}"
                    + (f" for lock {lockstring!r}" if lockstring is not None else "")
                    + f": {one_line(error.orig)}",
                    lockstring,
                    outage=error.connection_invalidated and self._backend is not None,
                ) from error

    def _run_once(self, operation: Callable[[DriverSession], T]) -> T:
        """``operation`` on a connection of its own, in autocommit mode, given back after.

        A Locker on an engine sqllocker made runs it on its ConnectionStack; on a caller's
        Engine, on a connection of the engine's pool (see ``Connections.pooled``).
        """
        if self.needs_setup:
            self._set_up()
        pool = self.pool
        stack = pool.stack
        if stack is None:
            with pool.pooled(self.be, self._prepared) as session:
                return operation(session)
        try:
            held = stack.take()
        except sa.exc.TimeoutError as error:
            raise pool.no_free_connection(error) from error
        except pool.connect_errors as error:
            raise pool.unreachable(error) from error
        watch = None
        try:
            if held.session is None:
                be, connection = self.be, held.connection
                held.session = DriverSession(
                    connection,
                    held.cursor,
                    self._prepared,
                    be.in_one_call(connection, self.owns_engine),
                    be.statement_warnings(connection),
                )
            deadline = deadlines.current()
            bound = self.be.operation_wait_bound
            if deadline is None or (bound is not None and clock.now() + bound < deadline):
                result = operation(held.session)
            else:
                watch = deadlines.interrupting(self.be, held.connection)
                with watch:
                    result = operation(held.session)
        except sa.exc.DBAPIError as error:
            if error.connection_invalidated or self.be.is_read_only(error):
                stack.discard(held)
                # The server went away, or takes no writes: every connection to it is as
                # useless as this one (the stack closes its idle ones when the engine is
                # disposed of).
                self.engine.dispose()
            else:
                _put_back(stack, held, watch)
            raise
        except LockError:
            _put_back(stack, held, watch)  # the operation's own verdict, its statements ended
            raise
        except BaseException:
            # Interrupted mid-statement (a KeyboardInterrupt, a cancellation, or an exception
            # that a signal handler raised, as a job's time limit does: an Exception, too):
            # the connection's state is unknown (a statement may still be running, its answer
            # still to come, to be read as the next statement's), so it must not be reused;
            # whatever it still runs is ended first, so that closing it frees its locks in the
            # database at once.
            try:
                self.be.abandon(held.connection, held.cursor)
            finally:
                stack.discard(held)
            raise
        _put_back(stack, held, watch)
        return result

    def _table_missing(self, lockstring: str | None) -> TableMissing:
        return TableMissing(
            f"lock table {self.table_name!r} does not exist in {describe_url(self.url)}; "
            f"create it with `sqllocker --url URL --table {self.table_name} migrate` "
            "(or Locker.create_table())",
            lockstring,
        )


def _put_back(
    stack: ConnectionStack, held: StackedConnection, watch: deadlines.interrupting | None
) -> None:
    """An operation's connection, once it has ended: back on the stack, unless the deadline's
    watcher ended it (as its statements ended, or after): then it goes, and what its
    statements did stands."""
    if watch is not None and watch.connection_ended:
        stack.discard(held)
    else:
        stack.give_back(held)
