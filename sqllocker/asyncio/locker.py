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
import threading
import time
from collections.abc import Awaitable, Callable, Sequence, Sized
from types import TracebackType
from typing import Any, ParamSpec, TypeVar

from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine

from .. import tickets, validation
from ..backoff import Backoff
from ..decorators import check_decoration, lock_namer, when_busy
from ..defaults import (
    DEFAULT_EXPIRES,
    DEFAULT_GRACE,
    DEFAULT_PURGE_BATCH,
    DEFAULT_PURGE_PAUSE_RATIO,
)
from ..engine import describe_url
from ..errors import DatabaseError, LockBusy, LockTypeError
from ..file_queue import BellListener, FileQueue, PlaceRequest
from ..holding import OnLost
from ..identity import holder_details, new_guid
from ..keepalive import DEFAULT_FRACTION
from ..notifications import guid_digest
from ..operations import Acquired, LockInfo, LockOperations, Refused
from ..schema import DEFAULT_TABLE
from ..telemetry import NameMapping, Telemetry, attempted, named, system_name
from ..tickets import LOOK_AGAIN, NEWCOMER, LocalLine, Ticket
from . import concurrency
from .acquiring import Winnings, acquisition
from .election import AsyncElection
from .group import AsyncLockGroup
from .keepalive import AsyncKeepAlive
from .listener import AsyncReleaseListener
from .lock import AsyncLock, AsyncLockState
from .rwlock import AsyncRWLock
from .semaphore import AsyncSemaphore

if True:  # ASYNC
    import asyncio

    from ..errors import LockError
    from ..operations import Joined
    from .acquiring import Acquiring
    from .loop_end import at_loop_end
    from .tasks import spawn

logger = logging.getLogger("sqllocker")

T = TypeVar("T")
P = ParamSpec("P")
R = TypeVar("R")

__all__ = ["AsyncLocker", "LockInfo"]


async def _wait_out(error: DatabaseError, backoff: Backoff, lockstring: str) -> None:
    """After a waiting attempt failed with ``error``: if it is an outage (a failover, a restart)
    and the wait is not over, wait it out, as for a holder; else raise it. An attempt cut off may
    have taken the row; the next one finds it ours (guid)."""
    if not error.outage or backoff.expired():
        raise error
    logger.warning("waiting for %r through an outage: %s", lockstring, error)
    await concurrency.sleep(backoff.next_delay())


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
    lockstring (default: its runs of digits as ``<n>``; ``str`` for the exact lockstring, if
    they are few). See ``sqllocker.telemetry``.

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
        self.on_lost = on_lost
        self.strict = strict
        self.engine: AsyncEngine
        if isinstance(url_or_engine, AsyncEngine):
            self.engine = url_or_engine.execution_options(isolation_level="AUTOCOMMIT")
            owns_engine = False
        elif url_or_engine is None or isinstance(url_or_engine, str | URL):
            self.engine = concurrency.create_engine(
                url_or_engine, transaction_pooling=pooled, max_connections=most
            )
            owns_engine = True
        else:
            kind = type(url_or_engine).__name__
            raise LockTypeError(
                f"url_or_engine must be a URL string, sqlalchemy URL or AsyncEngine, not {kind}"
                + concurrency.wrong_engine_hint(kind)
            )
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
            connection_changes=concurrency.ConnectionChanges,
            sleep=concurrency.sleep_in_operation,
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
        self._setup_lock = threading.Lock()  # never held across a wait
        self._listener: AsyncReleaseListener | None = None
        self._line = LocalLine()  # the tickets of this Locker's waiters
        self._leaving = concurrency.Background("sqllocker-ticket-leaver")
        self._closing = concurrency.Event()  # set by close: ends the give-ups tried again
        # The listener holds a connection of the pool's; the lock operations get the rest.
        self._operations.reserve_for_waiting()
        queue_file = self._operations.queue_file
        self._file_queue = FileQueue(queue_file) if queue_file is not None else None
        if True:  # ASYNC
            self._loop: asyncio.AbstractEventLoop | None = None
            self._loop_end: Any = None
            self._ready_lock: asyncio.Lock | None = None

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
            return Acquiring(acquisition(self._acquire, *request, keep_alive, on_lost, hold))
        else:
            return acquisition(self._acquire, *request, keep_alive, on_lost, hold)

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
        return functools.partial(self._acquire, *request, keep_alive, on_lost or self.on_lost, hold)

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
        behaviour = check_decoration(on_busy, wait, expires, hold_at_least)

        def decorate(function: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R | None]]:
            concurrency.check_decorated(function)
            name_lock = lock_namer(lockstring, key, function)
            # What telemetry names these locks by: the template, never a call's own name.
            recorded_as = lockstring if lockstring is not None else function.__qualname__

            @functools.wraps(function)
            async def under_lock(*args: P.args, **kwargs: P.kwargs) -> R | None:
                name = name_lock(args, kwargs)
                try:
                    with named(recorded_as):
                        lock = await self.lock(
                            name,
                            wait=wait,
                            expires=expires,
                            keep_alive=keep_alive,
                            hold_at_least=hold_at_least,
                        )
                except LockBusy as busy:
                    when_busy(behaviour, function, busy)
                    return None
                async with lock:
                    return await function(*args, **kwargs)

            return under_lock

        return decorate

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
        size = len(lockstrings) if isinstance(lockstrings, Sized) else 0
        acquisition = self._telemetry.compound("group", f"group of {size}", wait)
        try:
            group = await self._lock_all(
                lockstrings,
                wait=wait,
                expires=expires,
                locked_by=locked_by,
                keep_alive=keep_alive,
                on_lost=on_lost,
            )
        except BaseException as error:
            acquisition.failed(error)
            raise
        for lock in group:
            lock._state.telemetry = acquisition.member(lock.lock_id)
        acquisition.succeeded()
        return group

    async def _lock_all(
        self,
        lockstrings: Sequence[str],
        *,
        wait: float | None = 0,
        expires: float | None = None,
        locked_by: dict[str, Any] | None = None,
        keep_alive: bool = False,
        on_lost: OnLost | None = None,
    ) -> AsyncLockGroup:
        names = validation.canonical_order(lockstrings)
        request = validation.check_lock_request(
            names[0], expires, self.expires, wait, locked_by, on_lost
        )
        _, ttl, wait, extra = request
        on_lost = on_lost or self.on_lost
        return await acquisition(self._acquire_all, names, ttl, wait, extra, keep_alive, on_lost)

    async def _acquire_all(
        self,
        names: list[str],
        ttl: float,
        wait: float | None,
        extra: dict[str, Any],
        keep_alive: bool,
        on_lost: OnLost | None,
        winnings: Winnings,
    ) -> AsyncLockGroup:
        if True:  # ASYNC
            await self._ready()
        details = holder_details(extra, concurrency.task_name())
        members = [(name, new_guid()) for name in names]
        backoff = Backoff.for_wait(wait)
        while True:
            if True:  # ASYNC
                outcome = await concurrency.shielded(
                    self._call(self._operations.try_acquire_all, members, ttl, details),
                    f"acquire {len(names)} locks",
                    functools.partial(self._release_group_won, members),
                )
            else:
                outcome = self._operations.try_acquire_all(members, ttl, details)
            if not isinstance(outcome, Refused):
                locks = [
                    self._lock(winnings, name, guid, acquired, ttl, details, on_lost)
                    for (name, guid), acquired in zip(members, outcome, strict=True)
                ]
                group = AsyncLockGroup(locks)
                return group.keep_alive() if keep_alive else group
            await concurrency.sleep(backoff.after_refusal(outcome, names[0], wait, self.grace))

    def semaphore(self, name: str, limit: int) -> AsyncSemaphore:
        """A counting semaphore: at most ``limit`` holders of ``name`` at once, each holding a
        permit (a lock of its own) from ``.acquire(wait=..., expires=..., keep_alive=...)``
        (see ``sqllocker.permits``)."""
        return AsyncSemaphore(self, self._operations, self._call, name, limit)

    def election(self, name: str) -> AsyncElection:
        """Leader election for ``name``: ``.campaign()`` waits until this process leads and
        keeps the lead alive; ``.leader()`` and ``.observe()`` say who leads (see
        ``sqllocker.elections``)."""
        return AsyncElection(self, self._operations, self._call, name)

    def rwlock(self, name: str) -> AsyncRWLock:
        """A read-write lock: any number of readers of ``name`` together, from ``.read()``, or
        one writer alone, from ``.write()``, each with ``wait``, ``expires``, ``keep_alive``,
        ``on_lost`` and ``locked_by`` (see ``sqllocker.rwlocks``)."""
        return AsyncRWLock(self, self._operations, self._call, name)

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
        """Stop keeping locks alive and listening, and close the pooled connections of an
        engine the locker created (not a caller's)."""
        if True:  # ASYNC
            self._bind_to_running_loop()
        await self._keep_alives.stop()
        self._closing.set()
        await self._leaving.close()
        if self._listener is not None:
            await self._listener.stop()
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

    async def _acquire(
        self,
        lockstring: str,
        ttl: float,
        wait: float | None,
        extra: dict[str, Any],
        keep_alive: bool,
        on_lost: OnLost | None,
        hold_at_least: float | None,
        winnings: Winnings,
    ) -> AsyncLock:
        if True:  # ASYNC
            await self._ready()
        # One guid for every attempt of this call: a release may hand the row to it (as our
        # ticket), and an attempt that finds the row under it knows the row is ours.
        guid = new_guid()
        details = holder_details(extra, concurrency.task_name())
        acquisition = self._telemetry.acquiring(lockstring, wait)
        try:
            if wait == 0:
                lock = await self._try_once(winnings, lockstring, guid, details, ttl, on_lost)
            else:
                lock = await self._wait_for(winnings, lockstring, guid, details, ttl, wait, on_lost)
        except BaseException as error:
            acquisition.failed(error)
            raise
        lock._state.telemetry = acquisition.acquired(lock._state.lock_id)
        lock._state.hold_at_least = hold_at_least
        return lock.keep_alive() if keep_alive else lock

    async def _wait_for(
        self,
        winnings: Winnings,
        lockstring: str,
        guid: str,
        details: dict[str, Any],
        ttl: float,
        wait: float | None,
        on_lost: OnLost | None,
    ) -> AsyncLock:
        """Attempts until one succeeds, or LockBusy once ``wait`` has passed: in line by
        ticket where waiters take tickets (``_wait_with_ticket``), in the kernel's queue on
        SQLite, and elsewhere backing off between attempts (``_wait_in_line``)."""
        listener = self._release_listener()
        if listener is not None:
            return await self._wait_with_ticket(
                winnings, listener, lockstring, guid, details, ttl, wait, on_lost
            )
        return await self._wait_in_line(
            winnings, self._file_queue, lockstring, guid, details, ttl, wait, on_lost
        )

    async def _wait_with_ticket(
        self,
        winnings: Winnings,
        listener: AsyncReleaseListener,
        lockstring: str,
        guid: str,
        details: dict[str, Any],
        ttl: float,
        wait: float | None,
        on_lost: OnLost | None,
    ) -> AsyncLock:
        """``_wait_for`` where waiters take tickets: refused, a waiter takes a ticket; on
        PostgreSQL a release hands it the row when its turn comes, and the first of this
        Locker's waiters for the row also tries it now and then; on MySQL that first waiter
        polls the row, at a quarter of the age of the hold it waits out (see
        ``sqllocker.tickets``). While the listener reconnects, a waiter keeps its ticket,
        dead now, and tries by it; one without a ticket backs off and tries, as if alone."""
        backoff = Backoff.for_wait(wait)
        polls = not listener.hands_over  # the first waiter polls the row (MySQL)
        digest = guid_digest(guid)  # what a release's grant names this waiter by
        line = self._line
        ticket: Ticket | None = None
        refused = Refused(None, None)  # the last refusal, which LockBusy names
        # The first attempt: not ahead of anyone waiting. Where a waiter of this Locker holds a
        # ticket already, it would be refused: take a ticket at once.
        gate: int | None = None if line.waiting(lockstring) else NEWCOMER
        try_now = True
        free_since: float | None = None  # in line, refused a free row by a ticket ahead
        # A join failed, and may have taken a ticket all the same, kept alive by this key.
        unsure: int | None = None
        doubled = False  # a ticket of ours may have been handed a row ahead of ``ticket``
        rejoining = False  # our dead ticket given up, the next of our line not yet woken
        outcome: AsyncLock | None = None  # ours, once won by an attempt or handed over
        try:
            while True:
                if (
                    ticket is not None
                    and listener.liveness_key not in (None, ticket.liveness_key)
                    and line.first(ticket)
                ):
                    # The listener's session ended, and the ticket's life with it: once it has
                    # a new one, give the ticket up (with a row handed to it that we never
                    # heard of), and take a new one. The waiters of our line behind us take
                    # theirs after us, in order.
                    dead, ticket = ticket, None
                    await self._give_up(dead, guid, give_back=True, wake_next=False)
                    rejoining = True
                    try_now = True
                waiter = await listener.register(lockstring, digest, releases=False)
                try:
                    key = listener.liveness_key
                    if rejoining and key is None:
                        rejoining = False  # nothing to take a ticket with: the next tries too
                        line.wake_first(lockstring)
                    if ticket is None and gate is None and key is not None:
                        try:
                            ticket, held, replaced = await self._join_line(
                                lockstring, guid, ttl, details, key, unsure is not None
                            )
                        except DatabaseError as error:
                            unsure = key
                            await _wait_out(error, backoff, lockstring)
                            continue
                        unsure = None  # the join gave up whatever an earlier one took
                        doubled = doubled or replaced
                        line.join(ticket)
                        if rejoining:
                            rejoining = False
                            line.wake_first(lockstring)  # the next of our dead tickets
                        if polls:
                            backoff.heading()
                        else:
                            backoff.await_hand_off()
                        # A release may have come before our ticket: try at once, unless the
                        # row is polled anyway, as soon (Backoff.heading).
                        try_now = not held and not polls
                    first = ticket is None or line.watch(ticket, waiter.event.set)
                    if first:
                        listener.follow_releases(waiter)
                    if first and try_now:
                        waited = 0.0 if free_since is None else time.monotonic() - free_since
                        in_line = ticket is not None and waited < tickets.PATIENCE
                        try:
                            attempt = await self._try_acquire(
                                winnings,
                                lockstring,
                                guid,
                                details,
                                ttl,
                                on_lost,
                                ticket.number if in_line and ticket is not None else gate,
                                look_first=in_line and polls,
                                in_line=in_line,
                            )
                        except DatabaseError as error:
                            await _wait_out(error, backoff, lockstring)
                            continue
                        if isinstance(attempt, AsyncLock):
                            line.passed += ticket is not None and not in_line
                            outcome = attempt
                            return attempt
                        gated_unasked = gate is not None and attempt.busy is None
                        gate = None
                        if ticket is None or attempt.busy is not None:
                            free_since = None
                        elif free_since is None:
                            free_since = time.monotonic()
                        if attempt.busy is not None or refused.busy is None:
                            if tickets.new_hold(attempt.busy, refused.busy) and polls:
                                backoff.heading()  # polls paced by the age of this hold
                            refused = attempt
                        if backoff.expired() and gated_unasked:
                            continue  # the gate refused us unasked: one full attempt first
                    try_now = True
                    if backoff.expired():
                        raise refused.busy_after(lockstring, wait)
                    if ticket is None and key is not None:
                        continue  # refused: take a ticket
                    if first:
                        busy = refused.busy
                        delay = backoff.next_delay(
                            busy.expires if busy else None, refused.server_now, self.grace
                        )
                    else:  # wakes when it is first, or is handed the row
                        remaining = backoff.remaining()
                        delay = LOOK_AGAIN if remaining is None else min(LOOK_AGAIN, remaining)
                    await concurrency.wait(waiter.event, delay)
                    if waiter.grant is not None and ticket is not None:
                        claimed: Acquired | None = await self._call(
                            self._operations.claim_grant, lockstring, waiter.grant.lock_id, guid
                        )
                        if claimed is not None:
                            if not doubled:  # else given up below: it may be the one left
                                line.leave(ticket)
                                ticket = None  # the release that granted it took it
                            outcome = self._lock(
                                winnings, lockstring, guid, claimed, ttl, details, on_lost
                            )
                            return outcome
                finally:
                    listener.unregister(waiter)
        finally:
            if rejoining:
                line.wake_first(lockstring)
            if ticket is not None and outcome is not None and polls:
                # Won by our own INSERT where no release hands rows over: there is nothing to
                # give back, and the caller need not wait for the round trip (the ticket keeps
                # nobody from a row that is ours).
                self._leaving.call_soon(self._give_up, ticket, guid, False)
            elif ticket is not None:
                # Given up before the caller has its lock: a later release must not hand a
                # row to a ticket nobody waits on. Without the lock, a row handed to it goes
                # back.
                await self._give_up(ticket, guid, outcome is None)
            elif unsure is not None:  # and, without the lock, a row handed to it goes back
                await self._give_up_every(lockstring, unsure, guid, outcome is None)

    async def _give_up(
        self, ticket: Ticket, guid: str, give_back: bool, wake_next: bool = True
    ) -> None:
        """Give up ``ticket`` (``_leave_line``), then wake the next waiter of this Locker (if
        ``wake_next``): told sooner, it would find our ticket still ahead of its own. A give-up
        that failed is tried again in the background (``_give_up_again``)."""
        given_up = False
        try:
            given_up = await self._leave_line(ticket.lockstring, ticket.number, guid, give_back)
        finally:
            self._line.leave(ticket, wake_next)
            if not given_up:
                number, key = ticket.number, ticket.liveness_key
                self._leaving.call_soon(
                    self._give_up_again, ticket.lockstring, number, key, guid, give_back
                )

    async def _give_up_every(
        self, lockstring: str, liveness_key: int, guid: str, give_back: bool
    ) -> None:
        """Give up every ticket of ``guid`` for ``lockstring``: a join that failed may have
        taken one, alive while ``liveness_key`` is held. A give-up that failed is tried again
        in the background, as for a known ticket."""
        if not await self._leave_line(lockstring, None, guid, give_back):
            self._leaving.call_soon(
                self._give_up_again, lockstring, None, liveness_key, guid, give_back
            )

    async def _give_up_again(
        self,
        lockstring: str,
        number: int | None,
        liveness_key: int,
        guid: str,
        give_back: bool,
    ) -> None:
        """Try to give up ticket ``number`` (None: every ticket of ``guid``), alive while
        ``liveness_key`` is held, again every ``tickets.GIVE_UP_AGAIN`` seconds while it may
        live: left live with nobody waiting on it, it would be handed the next row, to stand
        held by nobody until it expires (PostgreSQL), or hold every waiter behind it back from
        a free row for PATIENCE at each turn (MariaDB)."""
        for _attempt in range(tickets.GIVE_UP_ATTEMPTS):
            await concurrency.wait(self._closing, tickets.GIVE_UP_AGAIN)
            listener = self._listener
            if self._closing.is_set() or listener is None or listener.liveness_key != liveness_key:
                return  # the ticket has died with the listener's session, or will with it
            if await self._leave_line(lockstring, number, guid, give_back, quiet=True):
                logger.info("gave up a ticket for %r after all", lockstring)
                return
        logger.warning(
            "could not give up a ticket for %r; it stands until this Locker is closed", lockstring
        )

    async def _join_line(
        self,
        lockstring: str,
        guid: str,
        ttl: float,
        details: dict[str, Any],
        key: int,
        replacing: bool,
    ) -> tuple[Ticket, bool, bool]:
        """A ticket for ``lockstring``, alive while ``key`` is held, whether the row is held,
        and whether an earlier one may have been handed it (``LockOperations.join_line``;
        ``replacing`` an earlier one that may stand)."""
        join = (lockstring, guid, ttl, details, key, replacing)
        if True:  # ASYNC
            number, held, replaced = await concurrency.shielded(
                self._call(self._operations.join_line, *join),
                f"take a ticket for {lockstring!r}",
                functools.partial(self._leave_joined, lockstring, guid),
            )
        else:
            number, held, replaced = self._operations.join_line(*join)
        return Ticket(lockstring, number, key), held, replaced

    async def _leave_line(
        self, lockstring: str, number: int | None, guid: str, give_back: bool, quiet: bool = False
    ) -> bool:
        """Give up ticket ``number`` (None: every ticket of ``guid``; see
        ``LockOperations.leave_line``), whoever stops waiting for it. Whether it was: a failure
        is logged (at DEBUG if ``quiet``), not raised."""
        leave = (lockstring, number, guid, give_back)
        try:
            if True:  # ASYNC
                await asyncio.shield(self._call(self._operations.leave_line, *leave))
            else:
                self._operations.leave_line(*leave)
        except DatabaseError as error:
            log = logger.debug if quiet else logger.warning
            log("could not give up a ticket for %r (%s)", lockstring, error)
            return False
        return True

    async def _try_once(
        self,
        winnings: Winnings,
        lockstring: str,
        guid: str,
        details: dict[str, Any],
        ttl: float,
        on_lost: OnLost | None,
    ) -> AsyncLock:
        """One attempt, or LockBusy; on SQLite taking the lockstring's place in the kernel's
        queue too if it is free, so that waiters wake when this lock is released."""
        queue = self._file_queue
        place = queue.take(queue.offset(self.table_name, lockstring)) if queue else None
        try:
            outcome = await self._try_acquire(winnings, lockstring, guid, details, ttl, on_lost)
        except BaseException:
            if place is not None:
                place.leave()
            raise
        if not isinstance(outcome, AsyncLock):
            if place is not None:
                place.leave()
            raise outcome.busy_after(lockstring, 0)
        outcome._state.place = place
        return outcome

    async def _wait_in_line(
        self,
        winnings: Winnings,
        queue: FileQueue | None,
        lockstring: str,
        guid: str,
        details: dict[str, Any],
        ttl: float,
        wait: float | None,
        on_lost: OnLost | None,
    ) -> AsyncLock:
        """Attempts until one succeeds, or LockBusy once ``wait`` has passed, in the kernel's
        queue of ``lockstring`` (SQLite: see ``sqllocker.file_queue``): only the waiter holding
        its place tries the row, and keeps the place while the row is ours. Without a
        ``queue``, backing off between attempts."""
        backoff = Backoff.for_wait(wait)
        offset = queue.offset(self.table_name, lockstring) if queue is not None else 0
        place = queue.take(offset) if queue is not None else None
        request: PlaceRequest | None = None
        bell: BellListener | None = None
        # Seconds until the row as last read can be taken over (0: free; None: unknown).
        until_free: float | None = None
        # Until the kernel's queue fails us (then back off, unqueued).
        in_line = queue is not None
        try:
            while True:
                if place is None and in_line and queue is not None:
                    request = request or queue.request(offset)
                    if request is None:
                        in_line = False  # the queue file cannot be opened: back off, unqueued
                    else:
                        if bell is None:
                            # Listening before the row is first read: a break after it is heard.
                            bell = queue.listen()
                            until_free = await self._until_free(lockstring)
                        granted, wake = concurrency.woken_from_thread()
                        request.when_granted(wake)
                        bell.when_rung(wake)
                        await concurrency.wait(granted, backoff.turn_patience(until_free))
                        place = request.take()
                        if place is not None or request.granted.is_set():
                            in_line, request = place is not None, None
                        elif not bell.heard() and not backoff.expired():
                            # Not our turn yet, and no break heard of: a look at the row, and
                            # an attempt only if it is free or takeable.
                            until_free = await self._until_free(lockstring)
                            if until_free is not None and until_free > 0:
                                continue
                try:
                    # Not our turn: the row is read before any INSERT.
                    outcome = await self._try_acquire(
                        winnings, lockstring, guid, details, ttl, on_lost, look_first=place is None
                    )
                except DatabaseError as error:
                    await _wait_out(error, backoff, lockstring)
                    continue
                if isinstance(outcome, AsyncLock):
                    outcome._state.place, place = place, None
                    return outcome
                until_free = backoff.until_takeable(outcome, self.grace)
                if place is not None or not in_line or backoff.expired():
                    # Our turn, but the row is held by someone who did not queue (or whose
                    # grace is not over): back off until it is free.
                    delay = backoff.after_refusal(outcome, lockstring, wait, self.grace)
                    await concurrency.sleep(delay)
        finally:
            if bell is not None:
                bell.close()
            if request is not None:
                request.withdraw()
            if place is not None:
                place.leave()

    async def _until_free(self, lockstring: str) -> float | None:
        """A queued waiter's look at the row (a read): seconds until it can be taken over, 0
        if it is free or can be now; None if unknown (the read failed, or a DBIx::Locker row,
        taken over only once expired in every time zone)."""
        try:
            info: LockInfo | None = await self._call(self._operations.lock_info, lockstring)
        except DatabaseError:
            return None
        if info is None:
            return 0.0
        return None if info.dbix_locker else max(0.0, info.seconds_left + self.grace)

    async def _try_acquire(
        self,
        winnings: Winnings,
        lockstring: str,
        guid: str,
        details: dict[str, Any],
        ttl: float,
        on_lost: OnLost | None,
        queue_key: int | None = None,
        look_first: bool = False,
        in_line: bool = False,
    ) -> AsyncLock | Refused:
        attempt = (lockstring, guid, ttl, details, queue_key, look_first, in_line)
        if True:  # ASYNC
            outcome = await concurrency.shielded(
                self._call(self._operations.try_acquire, *attempt),
                f"acquire {lockstring!r}",
                functools.partial(self._release_won, lockstring, guid),
            )
        else:
            outcome = self._operations.try_acquire(*attempt)
        attempted(outcome)
        if not isinstance(outcome, Acquired):
            return outcome
        return self._lock(winnings, lockstring, guid, outcome, ttl, details, on_lost)

    def _lock(
        self,
        winnings: Winnings,
        lockstring: str,
        guid: str,
        acquired: Acquired,
        ttl: float,
        details: dict[str, Any],
        on_lost: OnLost | None,
    ) -> AsyncLock:
        """The handle of a row just won, recorded in the acquire's ``winnings``: if the acquire
        ends in an exception before it hands the lock over, it is released (``acquisition``)."""
        state = AsyncLockState(
            self._operations,
            self._call,
            self._keep_alives,
            lockstring,
            acquired.lock_id,
            guid,
            ttl,
            acquired.sent_at,
            on_lost,
        )
        lock = AsyncLock(
            self, state, created=acquired.created, expires=acquired.expires, locked_by=details
        )
        return winnings.won(lock)

    async def _call(self, operation: Callable[..., T], *args: Any) -> T:
        """Run one of the table's operations (in asyncio: in a greenlet, on the running loop's
        connections)."""
        if True:  # ASYNC
            await self._ready()
            return await concurrency.run(operation, *args)
        else:
            return operation(*args)

    def _release_listener(self) -> AsyncReleaseListener | None:
        """The connection that keeps this Locker's tickets alive (and, on PostgreSQL, wakes
        its waiters on NOTIFY), where waiters take tickets; None where they back off."""
        if not self._operations.waits_by_ticket:
            return None
        with self._setup_lock:
            if self._listener is None:
                self._listener = AsyncReleaseListener(
                    self.engine, self.table_name, self._operations.hands_over
                )
            return self._listener

    if True:  # ASYNC

        def _release_won(self, lockstring: str, guid: str, outcome: Acquired | Refused) -> None:
            """The caller of an attempt was cancelled: release the lock if the attempt won it."""
            if isinstance(outcome, Acquired):
                logger.info(
                    "releasing %r (id %d): its acquirer was cancelled", lockstring, outcome.lock_id
                )
                release = self._call(self._operations.release, lockstring, outcome.lock_id, guid)
                spawn(release, f"release {lockstring!r} after cancellation")

        def _leave_joined(self, lockstring: str, guid: str, joined: Joined) -> None:
            """The caller of a join was cancelled: give up the ticket it took."""
            leave = self._call(self._operations.leave_line, lockstring, joined.ticket, guid, True)
            spawn(leave, f"give up a ticket for {lockstring!r} after cancellation")

        def _release_group_won(
            self, members: list[tuple[str, str]], outcome: list[Acquired] | Refused
        ) -> None:
            """The caller of a group's attempt was cancelled: release the rows it took, if any."""
            if isinstance(outcome, list):
                for (name, guid), acquired in zip(members, outcome, strict=True):
                    release = self._call(self._operations.release, name, acquired.lock_id, guid)
                    spawn(release, f"release {name!r} after cancellation")

        async def _ready(self) -> None:
            """Set up on first use, one task at a time: LockOperations's own set-up lock is a
            thread lock, which one task must never hold while another task on the same thread
            waits."""
            self._bind_to_running_loop()
            if self._operations.is_set_up:
                return
            if self._ready_lock is None:
                self._ready_lock = asyncio.Lock()
            async with self._ready_lock:
                await concurrency.run(self._operations.ensure_setup)

        def _bind_to_running_loop(self) -> None:
            """Make the running loop this locker's, dropping what belonged to the previous one.

            A driver connection, an asyncio.Event or a task made on one loop fails on another
            ("attached to a different loop"); once that loop has ended they are useless anyway.
            Its pooled connections are forgotten without closing them: closing needs their loop.
            """
            loop = asyncio.get_running_loop()
            previous = self._loop
            if previous is loop:
                return
            if previous is not None and previous.is_running():
                raise LockError(
                    f"{self!r} is in use on another event loop that is still running (in "
                    "another thread); its connections belong to that loop: make one "
                    "AsyncLocker per loop"
                )
            self._loop = loop
            self._loop_end = at_loop_end(self._close_at_loop_end)
            if previous is None:
                return
            logger.info(
                "%r moves to a new event loop, dropping the previous loop's connections", self
            )
            self._listener = None
            self._line = LocalLine()
            self._leaving = concurrency.Background("sqllocker-ticket-leaver")
            self._closing = concurrency.Event()
            self._ready_lock = None
            self._keep_alives.forget_tasks()
            self._operations.forget_connections()

        async def _close_at_loop_end(self) -> None:
            """``aclose()``, as this locker's loop shuts down: its connections can be closed only
            on it (see ``loop_end``). The locker stays usable, on the next loop."""
            if self._loop is not asyncio.get_running_loop():
                return
            try:
                await self.aclose()
            except Exception as error:
                logger.warning(
                    "%r: closing its connections at its loop's end failed: %s", self, error
                )
