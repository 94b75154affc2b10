"""The AsyncLocker: the asyncio front end, on the same table and statements as ``Locker``.

Every operation is ``operations.LockOperations``'s, run by SQLAlchemy's ``greenlet_spawn`` on the
AsyncEngine's ``sync_engine``: the driver calls become awaits on the event loop, and the SQL,
retries and error handling are exactly the sync front end's. So sync and async processes
contend for the same lockstrings under the same rules. This module adds what is particular to
asyncio: waiting with ``asyncio.sleep``, keep-alive tasks, an async LISTEN connection, and
cancellation.

Cancellation: a task cancelled while acquiring returns at once; its attempt finishes in the
background, and a lock it turns out to have won is released straight away, so no row is left
behind (unless the event loop itself shuts down mid-statement: then the row expires). A release
is likewise finished in the background (see ``lock.py``), and a cancelled wait stops at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Generator, Sequence
from types import TracebackType
from typing import Any, ParamSpec, TypeVar

from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.util import greenlet_spawn

from .. import validation
from ..backoff import Backoff
from ..decorators import LockstringTemplate, check_decoration, when_busy
from ..engine import create_async_locker_engine, describe_url, resolve_url
from ..errors import LockBusy, LockError, LockTypeError
from ..group import canonical_order
from ..identity import holder_details, new_guid
from ..keepalive import DEFAULT_FRACTION
from ..lock import OnLost
from ..locker import (
    DEFAULT_EXPIRES,
    DEFAULT_GRACE,
    DEFAULT_PURGE_BATCH,
    DEFAULT_PURGE_PAUSE_RATIO,
)
from ..notify import guid_digest
from ..operations import Acquired, LockInfo, LockOperations, Refused
from ..schema import DEFAULT_TABLE
from ..waiting_room import Request
from .group import AsyncLockGroup
from .keepalive import AsyncKeepAlive
from .lock import AsyncLock, AsyncLockState
from .loop_end import at_loop_end
from .notify import AsyncReleaseListener
from .semaphore import AsyncSemaphore
from .tasks import spawn
from .waiting_room import AsyncTurn, AsyncWaitingRoom

logger = logging.getLogger("sqllocker")

T = TypeVar("T")
P = ParamSpec("P")
R = TypeVar("R")


def _sleep_in_greenlet(seconds: float) -> None:
    """LockOperations's pause between retries after contention, without blocking the event loop."""
    try:
        from sqlalchemy.util import await_
    except ImportError:  # SQLAlchemy 2.0 calls it await_only
        from sqlalchemy.util import await_only as await_
    await_(asyncio.sleep(seconds))


class AsyncLocker:
    """Hands out locks kept as rows of ``table``, for asyncio code.

    The arguments are ``Locker``'s. ``url_or_engine`` is a URL or an ``AsyncEngine``; a URL that
    names no driver gets psycopg 3 (PostgreSQL), aiomysql (MySQL/MariaDB) or aiosqlite (SQLite).
    ``on_lost`` may be a function or a coroutine function. Close it with ``await aclose()``, or
    use ``async with AsyncLocker(...) as locker``.

    Its connections, listener and keep-alive tasks belong to the event loop that runs them. One
    AsyncLocker may serve one loop after another (``asyncio.run`` twice, a test framework's loop
    per test): when a new loop first uses it, what belonged to the previous loop is dropped,
    and its connections are made afresh. A loop that shuts down its async generators before
    closing (``asyncio.run`` does) closes the locker's connections as it ends, as ``aclose()``
    would (see ``loop_end``); with a caller's AsyncEngine, disposing of that engine's pooled
    connections stays the caller's part. Two loops running at once cannot share one; the
    second is refused with a LockError.
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
    ) -> None:
        options = validation.check_locker_options(
            table, expires, grace, keep_alive_fraction, on_lost
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
            url = resolve_url(url_or_engine, asynchronous=True)
            self.engine = create_async_locker_engine(url, transaction_pooling=pooled)
            owns_engine = True
        else:
            raise LockTypeError(
                f"url_or_engine must be a URL string, sqlalchemy URL or AsyncEngine, not "
                f"{type(url_or_engine).__name__}"
            )
        self.url = self.engine.url
        self._operations = LockOperations(
            self.engine.sync_engine,
            self.table_name,
            owns_engine=owns_engine,
            grace=self.grace,
            auto_create=auto_create,
            strict=strict,
            transaction_pooling=pooled,
            sleep=_sleep_in_greenlet,
        )
        self.table = self._operations.table
        self.auto_create = self._operations.auto_create
        self._keep_alives = AsyncKeepAlive(fraction)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_end: AsyncGenerator[None, None] | None = None
        self._setup_lock: asyncio.Lock | None = None
        self._listener: AsyncReleaseListener | None = None
        self._room: AsyncWaitingRoom | None = None

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
        """Acquire ``lockstring`` (arguments as ``Locker.lock``): ``await`` it for an AsyncLock,
        or ``async with`` it to hold the lock for a block. Raises LockBusy if it stays held.

        Bad arguments raise here, before anything is awaited or sent.
        """
        request = validation.check_lock_request(
            lockstring, expires, self.expires, wait, locked_by, on_lost
        )
        hold = validation.check_hold_at_least(hold_at_least, request[0])
        return Acquiring(self._acquire(*request, keep_alive, on_lost or self.on_lost, hold))

    def locked(
        self,
        lockstring: str,
        *,
        wait: float | None = 0,
        on_busy: str = "skip",
        expires: float | None = None,
        keep_alive: bool = True,
        hold_at_least: float | None = None,
    ) -> Callable[[Callable[P, Awaitable[R]]], Callable[P, Awaitable[R | None]]]:
        """``Locker.locked`` for coroutine functions: the lock is taken and released with
        ``await``, and kept alive by a task while the coroutine runs."""
        behaviour = check_decoration(on_busy, wait, expires, hold_at_least)

        def decorate(function: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R | None]]:
            if not inspect.iscoroutinefunction(function):
                raise LockTypeError(
                    f"{function.__qualname__} is not a coroutine function: decorate it with "
                    "sqllocker.Locker.locked"
                )
            template = LockstringTemplate(lockstring, function)

            @functools.wraps(function)
            async def under_lock(*args: P.args, **kwargs: P.kwargs) -> R | None:
                name = template.render(args, kwargs)
                try:
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
        """Every one of ``lockstrings`` at once, or none (see ``Locker.lock_all``)."""
        names = canonical_order(lockstrings)
        request = validation.check_lock_request(
            names[0], expires, self.expires, wait, locked_by, on_lost
        )
        _, ttl, wait, extra = request
        on_lost = on_lost or self.on_lost
        await self._ready()
        task = asyncio.current_task()
        details = holder_details(extra, task.get_name() if task is not None else None)
        members = [(name, new_guid()) for name in names]
        backoff = Backoff.for_wait(wait)
        while True:
            attempt = spawn(
                self._call(self._operations.try_acquire_all, members, ttl, details),
                f"acquire {len(names)} locks",
            )
            try:
                outcome = await asyncio.shield(attempt)
            except asyncio.CancelledError:
                attempt.add_done_callback(functools.partial(self._undo_group, members))
                raise
            if not isinstance(outcome, Refused):
                locks = [
                    self._lock(name, guid, acquired, ttl, details, on_lost)
                    for (name, guid), acquired in zip(members, outcome, strict=True)
                ]
                group = AsyncLockGroup(locks)
                return group.keep_alive() if keep_alive else group
            await asyncio.sleep(backoff.after_refusal(outcome, names[0], wait, self.grace))

    def _undo_group(self, members: list[tuple[str, str]], attempt: asyncio.Task[Any]) -> None:
        """The caller of a group's attempt was cancelled: release the rows it took, if any."""
        if attempt.cancelled() or attempt.exception() is not None:
            return
        outcome = attempt.result()
        if isinstance(outcome, list):
            for (name, guid), acquired in zip(members, outcome, strict=True):
                release = self._call(self._operations.release, name, acquired.lock_id, guid)
                spawn(release, f"release {name!r} after cancellation")

    def semaphore(self, name: str, limit: int) -> AsyncSemaphore:
        """A counting semaphore (see ``Locker.semaphore``): ``await sem.acquire()``."""
        return AsyncSemaphore(self, self._operations, name, limit)

    async def try_lock(
        self,
        lockstring: str,
        *,
        expires: float | None = None,
        locked_by: dict[str, Any] | None = None,
    ) -> AsyncLock | None:
        """Acquire ``lockstring`` if it is free: an AsyncLock, or None if someone holds it."""
        try:
            return await self.lock(lockstring, expires=expires, wait=0, locked_by=locked_by)
        except LockBusy:
            return None

    async def purge_expired_locks(
        self,
        batch_size: int = DEFAULT_PURGE_BATCH,
        pause_ratio: float = DEFAULT_PURGE_PAUSE_RATIO,
    ) -> int:
        """Delete rows expired (by the server's clock) for longer than grace, in batches, resting
        between them as ``Locker.purge_expired_locks`` does (with ``asyncio.sleep``)."""
        return await self._call(
            self._operations.purge_expired,
            validation.check_batch_size(batch_size),
            validation.check_pause_ratio(pause_ratio),
        )

    async def locks(self, pattern: str | None = None) -> list[LockInfo]:
        """Every row of the table (see ``Locker.locks``)."""
        return await self._call(self._operations.locks, validation.check_pattern(pattern))

    async def lock_info(self, lockstring: str) -> LockInfo | None:
        """The row of ``lockstring``, live or expired, or None if there is none."""
        return await self._call(self._operations.lock_info, validation.check_lockstring(lockstring))

    async def expired_locks(self) -> list[LockInfo]:
        """The rows purge_expired_locks() would delete now."""
        return await self._call(self._operations.expired_locks)

    async def break_lock(self, lockstring: str, lock_id: int | None = None) -> LockInfo | None:
        """Delete ``lockstring``'s row whoever holds it (see ``Locker.break_lock``)."""
        checked = validation.check_lockstring(lockstring)
        return await self._call(self._operations.break_lock, checked, lock_id)

    async def create_table(self) -> None:
        """Create or upgrade the table by applying the shipped migrations; safe to repeat."""
        await greenlet_spawn(self._operations.create_table)

    async def aclose(self) -> None:
        """Stop keeping locks alive and listening, and dispose of an engine the locker made."""
        self._bind_to_running_loop()
        await self._keep_alives.stop()
        if self._listener is not None:
            await self._listener.stop()
        if self._room is not None:
            await self._room.close()
        if self._operations.owns_engine:
            await self.engine.dispose()

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
        hold_at_least: float | None = None,
    ) -> AsyncLock:
        await self._ready()
        # One guid for every attempt, as in Locker.lock: a release may hand the row to it.
        guid = new_guid()
        task = asyncio.current_task()
        details = holder_details(extra, task.get_name() if task is not None else None)
        if wait == 0:
            outcome = await self._try_acquire(lockstring, guid, details, ttl, on_lost)
            if not isinstance(outcome, AsyncLock):
                raise outcome.busy_after(lockstring, wait)
            lock = outcome
        else:
            lock = await self._wait_for(lockstring, guid, details, ttl, wait, on_lost)
        lock._state.hold_at_least = hold_at_least
        return lock.keep_alive() if keep_alive else lock

    async def _wait_for(
        self,
        lockstring: str,
        guid: str,
        details: dict[str, Any],
        ttl: float,
        wait: float | None,
        on_lost: OnLost | None,
    ) -> AsyncLock:
        """Attempts until one succeeds, or LockBusy once ``wait`` has passed (as
        ``Locker._wait_for``)."""
        backoff = Backoff.for_wait(wait)
        listener = await self._release_listener()
        room = self._waiting_room() if listener is not None else None
        turn: AsyncTurn | None = None
        # A waiter's first attempt does not take the row ahead of waiters already queued.
        gate = room.key(lockstring) if room is not None else None
        digest = guid_digest(guid)  # what a release's grant names this waiter by
        try:
            while True:
                # Subscribe before the attempt: a release between a refusal and the sleep
                # still wakes us.
                heading = digest if turn is not None and turn.request is not None else None
                waiter = await listener.register(lockstring, heading) if listener else None
                try:
                    outcome = await self._try_acquire(lockstring, guid, details, ttl, on_lost, gate)
                    gated, gate = gate is not None, None
                    if isinstance(outcome, AsyncLock):
                        if turn is not None:
                            if turn.request is None:
                                turn.leave_soon()
                            else:  # withdrawn before the caller has the lock
                                await turn.leave(give_back=False)
                        return outcome
                    if backoff.expired():
                        if gated and outcome.busy is None:
                            continue  # the gate refused us unasked: one full attempt first
                        raise outcome.busy_after(lockstring, wait)
                    if (
                        room is not None
                        and turn is None
                        and listener is not None
                        and waiter is not None
                    ):
                        # Queue behind earlier waiters (see sqllocker.waiting_room).
                        entry = await room.enter(
                            lockstring,
                            backoff.remaining(),
                            before_blocking=functools.partial(listener.step_aside, waiter),
                            request=Request(lockstring, guid, details, ttl),
                        )
                        turn = entry.turn
                        if turn is not None and turn.request is not None:
                            backoff.await_hand_off()
                        if not entry.usable:
                            room = None  # full, or failing: wait unqueued from now on
                        if entry.try_again:
                            continue  # we were not listening while queued: try again at once
                    delay = backoff.next_delay(
                        outcome.busy.expires if outcome.busy else None,
                        outcome.server_now,
                        self.grace,
                    )
                    if waiter is None:
                        await asyncio.sleep(delay)
                    else:  # a release notification, or the backoff, ends the wait
                        with contextlib.suppress(asyncio.TimeoutError):
                            await asyncio.wait_for(waiter.event.wait(), delay)
                        if waiter.grant is not None and turn is not None:
                            claimed = await self._call(
                                self._operations.claim_grant, lockstring, waiter.grant.lock_id, guid
                            )
                            if claimed is not None:
                                turn.granted()
                                return self._lock(lockstring, guid, claimed, ttl, details, on_lost)
                finally:
                    if listener is not None and waiter is not None:
                        listener.unregister(waiter)
        finally:
            if turn is not None:
                # Withdrawing our request, and giving back a row handed to it meanwhile.
                await turn.leave()

    async def _try_acquire(
        self,
        lockstring: str,
        guid: str,
        details: dict[str, Any],
        ttl: float,
        on_lost: OnLost | None,
        queue_key: int | None = None,
    ) -> AsyncLock | Refused:
        attempt = spawn(
            self._call(self._operations.try_acquire, lockstring, guid, ttl, details, queue_key),
            f"acquire {lockstring!r}",
        )
        try:
            # Shielded: cancelling the caller must not cut the statement off halfway, when
            # nobody would know whether the row was written.
            outcome = await asyncio.shield(attempt)
        except asyncio.CancelledError:
            attempt.add_done_callback(functools.partial(self._undo_attempt, lockstring, guid))
            raise
        if not isinstance(outcome, Acquired):
            return outcome
        return self._lock(lockstring, guid, outcome, ttl, details, on_lost)

    def _lock(
        self,
        lockstring: str,
        guid: str,
        acquired: Acquired,
        ttl: float,
        details: dict[str, Any],
        on_lost: OnLost | None,
    ) -> AsyncLock:
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
        return AsyncLock(
            self, state, created=acquired.created, expires=acquired.expires, locked_by=details
        )

    def _undo_attempt(self, lockstring: str, guid: str, attempt: asyncio.Task[Any]) -> None:
        """The caller of an attempt was cancelled: release the lock if the attempt won it."""
        if attempt.cancelled() or attempt.exception() is not None:
            return
        outcome = attempt.result()
        if isinstance(outcome, Acquired):
            logger.info(
                "releasing %r (id %d): its acquirer was cancelled", lockstring, outcome.lock_id
            )
            release = self._call(self._operations.release, lockstring, outcome.lock_id, guid)
            spawn(release, f"release {lockstring!r} after cancellation")

    async def _call(self, operation: Callable[..., T], *args: Any) -> T:
        """Run one LockOperations operation in a greenlet, where its driver calls are awaited."""
        await self._ready()
        return await greenlet_spawn(operation, *args)

    async def _ready(self) -> None:
        """Set up on first use, one task at a time: LockOperations's own set-up lock is a thread
        lock, which one task must never hold while another task on the same thread waits."""
        self._bind_to_running_loop()
        if self._operations._backend is not None:
            return
        if self._setup_lock is None:
            self._setup_lock = asyncio.Lock()
        async with self._setup_lock:
            await greenlet_spawn(self._operations.ensure_setup)

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
                f"{self!r} is in use on another event loop that is still running (in another "
                "thread); its connections belong to that loop: make one AsyncLocker per loop"
            )
        self._loop = loop
        self._loop_end = at_loop_end(self._close_at_loop_end)
        if previous is None:
            return
        logger.info("%r moves to a new event loop, dropping the previous loop's connections", self)
        self._listener = None
        self._room = None
        self._setup_lock = None
        self._keep_alives.forget_tasks()
        if self._operations.owns_engine:
            self.engine.sync_engine.dispose(close=False)

    async def _close_at_loop_end(self) -> None:
        """``aclose()``, as this locker's loop shuts down: its connections can be closed only
        on it (see ``loop_end``). The locker stays usable, on the next loop."""
        if self._loop is not asyncio.get_running_loop():
            return
        try:
            await self.aclose()
        except Exception as error:
            logger.warning("%r: closing its connections at its loop's end failed: %s", self, error)

    async def _release_listener(self) -> AsyncReleaseListener | None:
        """PostgreSQL waiters wake on NOTIFY; other backends back off and retry."""
        if not self._operations.notifies_releases:
            return None
        if self._listener is None:
            self._listener = AsyncReleaseListener(self.engine, self.table_name)
        return self._listener

    def _waiting_room(self) -> AsyncWaitingRoom:
        """Where PostgreSQL waiters queue, sync and async alike, so that one at a time tries."""
        if self._room is None:
            self._room = AsyncWaitingRoom(self.engine, self._operations.statements)
        return self._room


class Acquiring:
    """What ``AsyncLocker.lock()`` returns: await it for the lock, or ``async with`` it to hold
    the lock for the block (released at its end, as ``async with lock:`` does)."""

    def __init__(self, acquire: Any) -> None:
        self._acquire = acquire
        self._lock: AsyncLock | None = None

    def __await__(self) -> Generator[Any, None, AsyncLock]:
        return self._acquire.__await__()  # type: ignore[no-any-return]

    async def __aenter__(self) -> AsyncLock:
        self._lock = await self._acquire
        return self._lock

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        assert self._lock is not None
        await self._lock.__aexit__(exc_type, exc_value, traceback)
