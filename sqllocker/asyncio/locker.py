"""The locker: validates, waits, and hands out locks.

The statements, retries and error handling live in ``operations.LockOperations``, shared by the
two front ends, so sync and async processes contend for the same lockstrings under the same
rules. Written once, for asyncio, in ``sqllocker/asyncio/locker.py``; ``sqllocker/locker.py``
is generated from it (``tests/unasync.py``), and the two ``concurrency`` modules hold what
differs between them.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import Any, ParamSpec, TypeVar

from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine

from .. import validation
from ..defaults import (
    DEFAULT_EXPIRES,
    DEFAULT_GRACE,
    DEFAULT_PURGE_BATCH,
    DEFAULT_PURGE_PAUSE_RATIO,
)
from ..engine import describe_url
from ..errors import LockBusy, LockTypeError
from ..file_queue import FileQueue
from ..holding import OnLost
from ..keepalive import DEFAULT_FRACTION
from ..operations import LockInfo, LockOperations
from ..schema import DEFAULT_TABLE
from ..telemetry import NameMapping, Telemetry, system_name
from . import concurrency
from .acquirer import AsyncAcquirer
from .acquiring import Winnings, acquisition
from .decorating import lock_decorator
from .election import AsyncElection
from .group import AsyncLockGroup
from .keepalive import AsyncKeepAlive
from .lock import AsyncLock
from .rwlock import AsyncRWLock
from .semaphore import AsyncSemaphore

if True:  # ASYNC
    import asyncio
    from collections.abc import Coroutine

    from .acquiring import Acquiring
    from .loop_end import LoopBinding

logger = logging.getLogger("sqllocker")

T = TypeVar("T")
P = ParamSpec("P")
R = TypeVar("R")

__all__ = ["AsyncLocker", "LockInfo"]


def _engine(
    url_or_engine: str | URL | AsyncEngine | None, pooled: bool, most: int | None
) -> tuple[AsyncEngine, bool]:
    """The locker's engine, and whether sqllocker made it (see ``AsyncLocker``)."""
    if isinstance(url_or_engine, AsyncEngine):
        return url_or_engine.execution_options(isolation_level="AUTOCOMMIT"), False
    if url_or_engine is None or isinstance(url_or_engine, str | URL):
        engine = concurrency.create_engine(
            url_or_engine, transaction_pooling=pooled, max_connections=most
        )
        return engine, True
    kind = type(url_or_engine).__name__
    raise LockTypeError(
        f"url_or_engine must be a URL string, sqlalchemy URL or AsyncEngine, not {kind}"
        + concurrency.wrong_engine_hint(kind)
    )


class AsyncLocker:
    """Hands out locks kept as rows of ``table`` in the database at ``url_or_engine``.

    ``url_or_engine``: an SQLAlchemy URL or Engine; ``None`` means ``$SQLLOCKER_URL``, else the
    SQLite file ``sqllocker.db`` in the working directory. ``postgres://`` and ``postgresql://``
    mean psycopg 3; ``mysql://`` and ``mariadb://`` mean PyMySQL (see ``sqllocker.asyncio``
    for the async drivers).

    ``expires`` is the default lifetime of a lock in seconds; a lock that is not released or
    extended within it may be taken over by the next acquirer once a further ``grace`` seconds
    have passed (the grace lets a holder that just noticed its expiry stop first).

    ``auto_create`` creates the table on first use if it is missing: by default for SQLite, whose
    file sqllocker owns, and never for a server, whose schema is the operator's (``sqllocker
    migrate``).

    ``on_lost`` is the default callback for kept-alive locks found lost (see ``keep_alive`` of a
    lock); ``keep_alive_fraction`` is how much of its expiry period passes between two renewals.

    On first use the locker checks the database settings its guarantees rest on: with a setting
    that can lose an acknowledged lock row in a crash (and so hand out a second holder and a
    reused token), or hand out tokens out of holding order (MariaDB/MySQL
    ``innodb_autoinc_lock_mode=2``), it warns, or with ``strict=True`` refuses with
    ``UnsafeDatabase``.

    ``max_connections``: the most connections the locker opens to a PostgreSQL or MySQL/MariaDB
    server at once (default: SQLAlchemy's 5 + 10), shared by its lock operations and its
    listener, which keeps its waiters' tickets alive; for an engine of your own, its pool's
    ``pool_size + max_overflow`` is that limit.

    ``meter_provider``, ``tracer_provider``: OpenTelemetry's, to record metrics and spans
    through (``pip install 'sqllocker[otel]'``; default: the global ones, once set; nothing is
    recorded without any). ``telemetry_name``: makes the ``sqllocker.name`` attribute of a
    lockstring (default: its UUIDs and hex ids as ``<id>``, runs of digits as ``<n>``; ``str``
    for the exact lockstring, if they are few). See ``sqllocker.telemetry``.

    ``transaction_pooling``: PostgreSQL is reached through a pooler that lends a server session
    per transaction (PgBouncer's ``pool_mode = transaction``), where no session setting, prepared
    statement, LISTEN or session lock lasts from one statement to the next. The locker then
    sends no session settings and prepares nothing (a caller's Engine must be made with
    ``connect_args={"prepare_threshold": None}``), and waiters back off and retry instead of
    taking tickets and waking on NOTIFY.
    """

    def __init__(
        self,
        url_or_engine: str | URL | AsyncEngine | None = None,
        *,
        table: str = DEFAULT_TABLE,
        expires: float = DEFAULT_EXPIRES,
        grace: float = DEFAULT_GRACE,
        auto_create: bool | None = None,
        on_lost: OnLost | None = None,
        keep_alive_fraction: float = DEFAULT_FRACTION,
        strict: bool = False,
        transaction_pooling: bool = False,
        max_connections: int | None = None,
        meter_provider: Any = None,
        tracer_provider: Any = None,
        telemetry_name: NameMapping | None = None,
    ) -> None:
        options = validation.check_locker_options(
            table, expires, grace, keep_alive_fraction, on_lost
        )
        most = validation.check_max_connections(
            max_connections, not isinstance(url_or_engine, AsyncEngine)
        )
        self.table_name, self.expires, self.grace, fraction = options
        pooled = validation.check_flag(transaction_pooling, "transaction_pooling")
        validation.check_telemetry_options(meter_provider, tracer_provider, telemetry_name)
        self.on_lost = on_lost
        self.strict = strict
        self.engine, owns_engine = _engine(url_or_engine, pooled, most)
        self.url = self.engine.url
        if True:  # ASYNC
            sync_engine = self.engine.sync_engine  # the lock operations run on it in greenlets
        else:
            sync_engine = self.engine
        self._operations = LockOperations(
            sync_engine,
            self.table_name,
            owns_engine=owns_engine,
            grace=self.grace,
            auto_create=auto_create,
            strict=strict,
            transaction_pooling=pooled,
            direct_connections=owns_engine,
            waits=concurrency.WAITS,
        )
        self.table = self._operations.table
        self.auto_create = self._operations.auto_create
        self._telemetry = Telemetry(
            self.table_name,
            functools.partial(system_name, sync_engine),
            meter_provider,
            tracer_provider,
            telemetry_name,
        )
        self._keep_alives = AsyncKeepAlive(fraction)
        # The listener holds a connection of the pool's; the lock operations get the rest.
        self._operations.reserve_for_waiting()
        queue_file = self._operations.queue_file
        self._file_queue = FileQueue(queue_file) if queue_file is not None else None
        self._acquirer = AsyncAcquirer(
            self,
            self._operations,
            self._call,
            self._keep_alives,
            self._file_queue,
            self._telemetry,
            self.grace,
            self._readying,
        )
        self._tickets = self._acquirer.tickets
        if True:  # ASYNC
            self._loop = LoopBinding()
            self._ready_lock: asyncio.Lock | None = None
            # The loop this locker was found set up on (and bound to): a set-up stays done.
            self._ready_on: asyncio.AbstractEventLoop | None = None

    # -- public API -----------------------------------------------------------------------------

    def lock(
        self,
        lockstring: str,
        *,
        expires: float | None = None,
        wait: float | None = 0,
        locked_by: dict[str, Any] | None = None,
        keep_alive: bool = False,
        on_lost: OnLost | None = None,
        hold_at_least: float | None = None,
    ) -> Acquiring:
        """Acquire ``lockstring`` or raise LockBusy. The lock is a context manager that releases
        it at the end of the block.

        ``expires``: seconds until the lock may be taken over (default: the locker's).
        ``wait``: 0 tries once; a number of seconds keeps trying until then, backing off with
        jitter; ``None`` waits forever. Waiters are served first come, first served: on
        PostgreSQL and MySQL/MariaDB each takes a ticket, holding no connection, and is handed
        the row by a release (PostgreSQL) or polls it when its turn comes (see
        ``sqllocker.tickets``); on SQLite they queue in the kernel. ``locked_by``: extra JSON
        details stored with the holder's host, pid, thread (or task), program and user.
        ``keep_alive``: renew the lock in the background until it is released (see
        ``keep_alive`` of a lock), calling ``on_lost`` (else the locker's) if it is lost.
        ``hold_at_least``: a release within that many seconds of the acquire (by the server's
        clock) keeps the row until then, so that
        nobody else takes the lock in that window: a job scheduled on several machines runs
        once per window, however quickly it finishes.

        Bad arguments raise here, before anything is sent.
        """
        request = validation.check_lock_request(
            lockstring, expires, self.expires, wait, locked_by, on_lost
        )
        hold = validation.check_hold_at_least(hold_at_least, request[0])
        on_lost = on_lost or self.on_lost
        if True:  # ASYNC
            return Acquiring(
                acquisition(self._acquirer.acquire, *request, keep_alive, on_lost, hold)
            )
        else:
            return acquisition(self._acquirer.acquire, *request, keep_alive, on_lost, hold)

    def _acquire_request(
        self,
        lockstring: str,
        expires: float | None = None,
        wait: float | None = 0,
        locked_by: dict[str, Any] | None = None,
        keep_alive: bool = False,
        on_lost: OnLost | None = None,
        hold_at_least: float | None = None,
    ) -> Callable[[Winnings], Awaitable[AsyncLock]]:
        """``lock()``'s acquire, its arguments checked, to run in an acquisition that takes
        more than this lock (a semaphore's)."""
        request = validation.check_lock_request(
            lockstring, expires, self.expires, wait, locked_by, on_lost
        )
        hold = validation.check_hold_at_least(hold_at_least, request[0])
        return functools.partial(
            self._acquirer.acquire, *request, keep_alive, on_lost or self.on_lost, hold
        )

    def locked(
        self,
        lockstring: str | None = None,
        *,
        key: Callable[..., str] | None = None,
        wait: float | None = 0,
        on_busy: str = "skip",
        expires: float | None = None,
        keep_alive: bool = True,
        hold_at_least: float | None = None,
    ) -> Callable[[Callable[P, Awaitable[R]]], Callable[P, Awaitable[R | None]]]:
        """Decorate a function to run under a lock: ``@locker.locked("report {day}")``.

        ``lockstring`` is a ``str.format`` template over the function's arguments, by name
        (checked against its signature now). Each field takes a str, int, bool, None,
        Decimal, date, datetime, time, UUID or Enum of those, and raises LockTypeError at the
        call for any other type, before any SQL; with two fields or more, ``%`` and the first
        character of the text between fields are percent-encoded in each field's text, so
        that distinct arguments give distinct names. ``key=`` instead: a callable given the
        call's arguments that returns the lockstring. When the lock is held by someone else
        (after ``wait``), ``on_busy="skip"`` returns None without calling the function (logged
        at INFO) and ``"raise"`` raises LockBusy. The lock is kept alive while the function
        runs (``keep_alive``), released when it returns or raises (unless ``hold_at_least``
        keeps it), and LockLost is raised at the end if it was lost meanwhile.
        """
        return lock_decorator(
            self, lockstring, key, wait, on_busy, expires, keep_alive, hold_at_least
        )

    async def lock_all(
        self,
        lockstrings: Sequence[str],
        *,
        wait: float | None = 0,
        expires: float | None = None,
        locked_by: dict[str, Any] | None = None,
        keep_alive: bool = False,
        on_lost: OnLost | None = None,
    ) -> AsyncLockGroup:
        """Acquire every one of ``lockstrings`` at once, or none: a lock group, or LockBusy
        naming a member that is held (after ``wait``, as ``lock()`` waits).

        Each attempt takes the rows in one transaction, in a canonical order (by code point),
        so that groups that overlap never deadlock; one held member refuses the attempt, which
        then takes nothing. The members are ordinary locks, each with its own fencing token.
        """
        return await self._acquirer.lock_all(
            lockstrings,
            wait=wait,
            expires=expires,
            locked_by=locked_by,
            keep_alive=keep_alive,
            on_lost=on_lost,
            defaults=(self.expires, self.on_lost),
        )

    def semaphore(self, name: str, limit: int) -> AsyncSemaphore:
        """A counting semaphore: at most ``limit`` holders of ``name`` at once, each holding a
        permit (a lock of its own) from ``.acquire(wait=..., expires=..., keep_alive=...)``
        (see ``sqllocker.permits``)."""
        return AsyncSemaphore(
            self,
            self._operations,
            self._call,
            name,
            limit,
            request=self._acquire_request,
            telemetry=self._telemetry,
        )

    def election(self, name: str) -> AsyncElection:
        """Leader election for ``name``: ``.campaign()`` waits until this process leads and
        keeps the lead alive; ``.leader()`` and ``.observe()`` say who leads (see
        ``sqllocker.elections``)."""
        return AsyncElection(
            self,
            self._operations,
            self._call,
            name,
            self._tickets.release_listener,
            self._telemetry,
        )

    def rwlock(self, name: str) -> AsyncRWLock:
        """A read-write lock: any number of readers of ``name`` together, from ``.read()``, or
        one writer alone, from ``.write()``, each with ``wait``, ``expires``, ``keep_alive``,
        ``on_lost`` and ``locked_by`` (see ``sqllocker.rwlocks``)."""
        return AsyncRWLock(self, self._operations, self._call, name, self._telemetry)

    async def try_lock(
        self,
        lockstring: str,
        *,
        expires: float | None = None,
        locked_by: dict[str, Any] | None = None,
    ) -> AsyncLock | None:
        """Acquire ``lockstring`` if it is free: the lock, or None if someone holds it."""
        try:
            return await self.lock(lockstring, expires=expires, wait=0, locked_by=locked_by)
        except LockBusy:
            return None

    async def purge_expired_locks(
        self,
        batch_size: int = DEFAULT_PURGE_BATCH,
        pause_ratio: float = DEFAULT_PURGE_PAUSE_RATIO,
    ) -> int:
        """Delete rows expired (by the server's clock) for longer than grace; returns how many.

        Deletes in batches of ``batch_size``, each its own short transaction, so a large purge
        never blocks acquirers for long, and after each full batch rests ``pause_ratio`` times
        as long as the batch took, so that it leaves most of the server to the acquirers (0:
        flat out). On PostgreSQL it also deletes the tickets of waiters whose Locker is gone,
        which are not counted. Database errors propagate.
        """
        purged: int = await self._call(
            self._operations.purge_expired,
            validation.check_batch_size(batch_size),
            validation.check_pause_ratio(pause_ratio),
        )
        if purged and self._file_queue is not None:
            self._file_queue.ring()  # holders of purged rows may still hold their places
        self._telemetry.purged(purged)
        return purged

    async def locks(self, pattern: str | None = None) -> list[LockInfo]:
        """Every row of the table, live and expired, ordered by lockstring; with ``pattern``, only
        lockstrings matching that shell-style glob (``*`` and ``?``; case-sensitive)."""
        infos: list[LockInfo] = await self._call(
            self._operations.locks, validation.check_pattern(pattern)
        )
        return infos

    async def lock_info(self, lockstring: str) -> LockInfo | None:
        """The row of ``lockstring``, live or expired, or None if there is none."""
        checked = validation.check_lockstring(lockstring)
        info: LockInfo | None = await self._call(self._operations.lock_info, checked)
        return info

    async def expired_locks(self) -> list[LockInfo]:
        """The rows purge_expired_locks() would delete now (expired for longer than grace)."""
        infos: list[LockInfo] = await self._call(self._operations.expired_locks)
        return infos

    async def break_lock(self, lockstring: str, lock_id: int | None = None) -> LockInfo | None:
        """Delete ``lockstring``'s row whoever holds it (an operator's tool for dead holders).

        With ``lock_id``, only that exact acquisition is broken. Returns the row that was deleted,
        or None if there was none (or it had another id). The holder finds out at its next
        extend or unlock, which raise LockLost. A row that a transaction still open has locked
        (the holder's ``guard()``) cannot be broken until it ends: a LockError says so after
        two of the database's lock waits.
        """
        checked = validation.check_lockstring(lockstring)
        info: LockInfo | None = await self._call(self._operations.break_lock, checked, lock_id)
        if info is not None and self._file_queue is not None:
            # Its holder keeps its place in the queue until it learns: wake the waiters.
            self._file_queue.ring()
        return info

    async def create_table(self) -> None:
        """Create or upgrade the table by applying the shipped migrations; safe to repeat."""
        await concurrency.run(self._operations.create_table)

    async def aclose(self) -> None:
        """Stop keeping locks alive (those still held are lost: their ``on_lost`` is called) and
        listening, and close the pooled connections of an engine the locker created (not a
        caller's)."""
        if True:  # ASYNC
            self._bind_to_running_loop()
        await self._keep_alives.stop()
        await self._tickets.close()
        if self._file_queue is not None:
            self._file_queue.close()
        await concurrency.run(self._operations.close)

    async def __aenter__(self) -> AsyncLocker:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"<AsyncLocker {describe_url(self.url)} table={self.table_name}>"

    # -- internals -------------------------------------------------------------------------------

    if True:  # ASYNC

        def _call(self, operation: Callable[..., T], *args: Any) -> Coroutine[Any, Any, T]:
            """Run one of the table's operations (in asyncio: in a greenlet, on the running
            loop's connections; the set-up first, where it is due)."""
            if self._is_ready():
                return concurrency.run(operation, *args)
            return self._call_when_ready(operation, *args)

        async def _call_when_ready(self, operation: Callable[..., T], *args: Any) -> T:
            await self._ready()
            return await concurrency.run(operation, *args)

    else:

        def _call(self, operation: Callable[..., T], *args: Any) -> T:
            """Run one of the table's operations."""
            return operation(*args)

    async def _ready(self) -> None:
        """Set up on first use, one task at a time (in asyncio: LockOperations's own set-up lock
        is a thread lock, which one task must never hold while another task on the same thread
        waits; a sync locker sets up in its first operation)."""
        if True:  # ASYNC
            if self._is_ready():
                return
            self._bind_to_running_loop()
            if self._operations.is_set_up:
                return
            if self._ready_lock is None:
                self._ready_lock = asyncio.Lock()
            async with self._ready_lock:
                await concurrency.run(self._operations.ensure_setup)

    if True:  # ASYNC

        def _readying(self) -> Awaitable[None] | None:
            """``_ready()``, or None where it has nothing to do (every acquire asks)."""
            return None if self._is_ready() else self._ready()

    else:
        _readying = _ready

    if True:  # ASYNC

        def _is_ready(self) -> bool:
            """Set up, on the running loop: ``_ready`` has nothing to do (every operation asks)."""
            running = asyncio.get_running_loop()
            if self._ready_on is running:
                return True
            if self._loop.loop is running and self._operations.is_set_up:
                self._ready_on = running
                return True
            return False

        def _bind_to_running_loop(self) -> None:
            """Make the running loop this locker's, dropping what belonged to the previous one.

            A driver connection, an asyncio.Event or a task made on one loop fails on another
            ("attached to a different loop"); once that loop has ended they are useless anyway.
            Its pooled connections are forgotten without closing them: closing needs their loop.
            """
            if not self._loop.bind(self, self._close_at_loop_end):
                return
            self._ready_on = None
            logger.info(
                "%r moves to a new event loop, dropping the previous loop's connections", self
            )
            self._tickets.forget()
            self._ready_lock = None
            self._keep_alives.forget_tasks()
            self._operations.forget_connections()

        async def _close_at_loop_end(self) -> None:
            """``aclose()``, as this locker's loop shuts down: its connections can be closed only
            on it (see ``loop_end``). The locker stays usable, on the next loop."""
            if not self._loop.is_running():
                return
            try:
                await self.aclose()
            except Exception as error:
                logger.warning(
                    "%r: closing its connections at its loop's end failed: %s", self, error
                )
