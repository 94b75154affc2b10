"""A held lock for asyncio code: the same row, deadline and rules as ``sqllocker.Lock``.

What differs is cancellation. A task can be cancelled at any await, and a lock must survive
that: a release, once started, runs to its end in a task of its own (a cancelled ``unlock()``
leaves it running, and a second ``unlock()`` waits for it or, if it failed, tries again), so a
cancelled release never strands a row that nobody can release any more.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable
from datetime import datetime
from types import TracebackType
from typing import TYPE_CHECKING, Any

from sqlalchemy.ext.asyncio import AsyncConnection

from .. import clock, forks
from ..errors import LockLost
from ..lock import Holding, LockHandle, OnLost
from ..validation import check_seconds
from .tasks import spawn

if TYPE_CHECKING:
    from ..operations import LockOperations
    from .keepalive import AsyncKeepAlive
    from .locker import AsyncLocker

# Runs one LockOperations operation from the event loop: AsyncLocker's, with its set-up and loop
# binding.
Run = Callable[..., Awaitable[Any]]

logger = logging.getLogger("sqllocker")


class AsyncLockState(Holding):
    """An acquisition made on an event loop. The keep-alive task and the finaliser work on this,
    never on the AsyncLock, so neither keeps a dropped lock alive. It has what its operations
    need: the table's operations (``operations``), how to run one of them from the event loop
    (``run``: in a greenlet, on the connections of the running loop) and the keep-alive tasks.

    ``op_lock`` serialises extend, renewal and release, as in the sync LockState.
    """

    def __init__(
        self,
        operations: LockOperations,
        run: Run,
        keep_alives: AsyncKeepAlive,
        lockstring: str,
        lock_id: int,
        guid: str,
        ttl: float,
        sent_at: float,
        on_lost: OnLost | None,
    ) -> None:
        super().__init__(lockstring, lock_id, guid, ttl, sent_at, on_lost)
        self.operations = operations
        self.run = run
        self.keep_alives = keep_alives
        self.loop = asyncio.get_running_loop()
        self.op_lock = asyncio.Lock()
        self.releasing: asyncio.Task[None] | None = None

    async def extend(self, ttl: float) -> datetime:
        """Push the row's expiry to server now + ``ttl``; LockLost (and lost) if it is not ours."""
        async with self.op_lock:
            self.check_extendable()
            sent_at = clock.now()
            try:
                expires: datetime = await self.run(
                    self.operations.extend, self.lockstring, self.lock_id, self.guid, ttl
                )
            except LockLost as lost:
                self.mark_lost(lost)
                raise
            self.renewed(sent_at, ttl)
            return expires

    async def release(self) -> None:
        """Delete the row (once); LockLost if it was no longer ours.

        The DELETE runs in a task of its own, shielded from the caller's cancellation.
        """
        if self.releasing is None:
            if not self.held:
                return
            self.releasing = spawn(self._delete_row(), f"release {self.lockstring!r}")
        await asyncio.shield(self.releasing)

    async def _delete_row(self) -> None:
        try:
            async with self.op_lock:  # waits for a renewal in flight
                if not self.held:
                    return
                # Whatever the DELETE's outcome, renewals stop: a holder that has stopped working
                # must not keep others out beyond the expiry.
                self.keep_alives.remove(self)
                try:
                    await self.run(
                        self.operations.release,
                        self.lockstring,
                        self.lock_id,
                        self.guid,
                        self.hold_at_least,
                    )
                except LockLost:
                    self.held = False
                    raise
                self.held = False
        finally:
            if self.held:
                self.releasing = None  # it failed: a later unlock() tries again

    def _call_on_lost(self, on_lost: OnLost, lost: LockLost) -> None:
        result = on_lost(lost)
        if inspect.isawaitable(result):
            spawn(_await(result), f"on_lost of {self.lockstring!r}")


async def _await(awaitable: Any) -> None:
    try:
        await awaitable
    except Exception:
        logger.exception("async on_lost callback raised")


def _release_abandoned(state: AsyncLockState) -> None:
    """Runs when a held AsyncLock is garbage-collected; it cannot await, so it hands the release
    to the lock's event loop if that still runs, and otherwise leaves the row to expire."""
    if not state.held or state.pid != forks.pid or state.releasing is not None:
        return
    loop = state.loop
    if loop.is_closed():
        logger.warning(
            "lock %r (id %d) was dropped after its event loop closed; it will expire",
            state.lockstring,
            state.lock_id,
        )
        return
    logger.warning(
        "lock %r (id %d) was released by garbage collection; unlock() it or use `async with`",
        state.lockstring,
        state.lock_id,
    )
    try:
        loop.call_soon_threadsafe(_release_in_loop, state)
    except RuntimeError:  # the loop closed meanwhile
        logger.warning("could not release abandoned lock %r; it will expire", state.lockstring)


def _release_in_loop(state: AsyncLockState) -> None:
    async def release() -> None:
        try:
            await state.release()
        except LockLost:
            logger.info("abandoned lock %r was already gone", state.lockstring)
        except Exception as error:
            logger.warning(
                "could not release abandoned lock %r; it will expire: %s", state.lockstring, error
            )

    spawn(release(), f"release abandoned {state.lockstring!r}")


class AsyncLock(LockHandle[AsyncLockState]):
    """A lock this process holds, for asyncio code: ``async with`` it, or ``await unlock()``."""

    def __init__(
        self,
        locker: AsyncLocker,
        state: AsyncLockState,
        *,
        created: object,
        expires: object,
        locked_by: dict[str, Any],
    ) -> None:
        super().__init__(
            state, _release_abandoned, created=created, expires=expires, locked_by=locked_by
        )
        self.locker = locker  # the AsyncLocker it came from, for the caller

    async def unlock(self) -> None:
        """Delete our row. A second call is a no-op (or waits for the first, if it is running).

        Raises LockLost if the row was no longer ours. Cancelling the caller does not stop the
        release: it finishes in the background. Any other error leaves the lock held (no longer
        kept alive): call unlock() again, or let it expire.
        """
        self._refuse_in_forked_child("release")
        if not self._state.held:
            return
        try:
            await self._state.release()
        except LockLost:
            self._finalizer.detach()
            raise
        if not self._state.held:
            self._finalizer.detach()

    async def extend(self, seconds: float | None = None) -> datetime:
        """Set expiry to the server's now + ``seconds`` (default: the lock's expiry period).

        Raises LockLost, and the lock counts as lost, if the row is gone or has already
        expired: an expired lock is never revived.
        """
        ttl = self.ttl if seconds is None else check_seconds(seconds, "expires", self.lockstring)
        self._refuse_in_forked_child("extend")
        self.expires = await self._state.extend(ttl)
        return self.expires

    def keep_alive(self, on_lost: OnLost | None = None) -> AsyncLock:
        """Keep the row's expiry pushed forward by a task of the locker until unlock().

        ``on_lost`` (else the locker's), a function or a coroutine function, is called once if
        the lock is found gone or its deadline passes without a successful renewal, which is
        always before anyone else can take it over.
        """
        if on_lost is not None:
            self._state.on_lost = on_lost
        self._state.keep_alives.add(self._state)
        return self

    async def guard(self, connection: AsyncConnection) -> None:
        """Within ``connection``'s open transaction, prove the lock is still ours and keep it
        from being taken over or purged until that transaction ends (see ``Lock.guard``)."""
        state = self._state
        proven = await connection.run_sync(
            state.operations.guard, state.lockstring, state.lock_id, state.guid
        )
        state.guard_failed(proven)

    async def __aenter__(self) -> AsyncLock:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._state.pid != forks.pid or self._unlocked_by_caller():
            return
        # As in the sync Lock: losing the lock during the body outranks the body's own error
        # (attached as its cause).
        lost = self._lapsed()
        try:
            await self.unlock()
        except Exception as error:
            lost = self._release_failed_at_exit(error, lost, exc_value)
        if lost is not None:
            raise lost from exc_value
