"""Keeping async locks alive: one task per kept-alive lock, on the locker's event loop.

The rules are the sync keep-alive's (``sqllocker/keepalive.py``): renew every ``fraction`` of
the expiry period with the statement of ``extend()``, retry transient errors with backoff, and
declare the lock lost, calling its ``on_lost``, the moment its validity deadline passes without
a successful renewal, even while a renewal is still stuck on a stalled connection. No
connection is held between renewals.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging

from .. import clock
from ..errors import LockError, LockLost
from ..keepalive import FIRST_RETRY_DELAY
from .lock import AsyncLockState
from .tasks import spawn

logger = logging.getLogger("sqllocker")


class AsyncKeepAlive:
    """The kept-alive locks of one AsyncLocker, each renewed by a task of its own."""

    def __init__(self, fraction: float) -> None:
        self.fraction = fraction
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._wakes: dict[int, asyncio.Event] = {}  # each task's, set by ``changed``
        self._stopping = False  # while ``stop`` runs: the locks it stops renewing are lost

    def add(self, state: AsyncLockState) -> None:
        if not state.held or state.lost is not None or id(state) in self._tasks:
            return
        # Made here, not as the task starts: an extend() right after keep_alive(), before the
        # task has run, must find it.
        wake = self._wakes[id(state)] = asyncio.Event()
        task = spawn(self._keep(state, wake), f"keep {state.lockstring!r} alive")
        self._tasks[id(state)] = task
        task.add_done_callback(functools.partial(self._ended, state))

    def _ended(self, state: AsyncLockState, _task: asyncio.Task[None]) -> None:
        """``state``'s task has ended (or was cancelled before it began): stopped, the lock is
        lost."""
        self._tasks.pop(id(state), None)
        if self._stopping and state.held and state.lost is None:
            state.mark_lost(state.no_longer_renewed())

    def changed(self, state: AsyncLockState) -> None:
        """``state``'s deadline came closer, or its expiry period changed (an extend() of
        another length): its task looks again."""
        wake = self._wakes.get(id(state))
        if wake is not None:
            wake.set()

    def remove(self, state: AsyncLockState) -> None:
        self._wakes.pop(id(state), None)
        task = self._tasks.pop(id(state), None)
        if task is not None:
            task.cancel()

    def forget_tasks(self) -> None:
        """Drop the tasks of an event loop that has ended (they can be neither awaited nor
        cancelled from another loop); their locks are renewed no more and expire."""
        self._tasks.clear()
        self._wakes.clear()

    def __len__(self) -> int:
        return len(self._tasks)

    async def stop(self) -> None:
        """Stop renewing everything. The locks stay held until they expire, and are lost from
        now (their on_lost is called): nothing renews them."""
        self._stopping = True
        tasks = list(self._tasks.values())
        self._tasks.clear()
        try:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task  # its ``_ended`` has run, as it was added first
        finally:
            self._stopping = False  # usable again (on the next event loop, say)

    async def _keep(self, state: AsyncLockState, wake: asyncio.Event) -> None:
        next_renewal = state.first_renewal(self.fraction)
        failures = 0
        renewal: asyncio.Task[object] | None = None
        try:
            while state.held and state.lost is None:
                now = clock.now()
                if now >= state.valid_until:
                    state.mark_lost(state.deadline_passed())
                    return
                if renewal is None and now >= next_renewal:
                    renewal = asyncio.ensure_future(state.extend(None))  # the period as sent
                if renewal is None:
                    # Not wait_for: on Python 3.11 it returns, its cancellation lost, when
                    # cancelled just as the event is set (unlock() right after an extend()).
                    woken = asyncio.ensure_future(wake.wait())
                    try:
                        await asyncio.wait(
                            {woken}, timeout=min(next_renewal, state.valid_until) - now
                        )
                    finally:
                        woken.cancel()
                    if wake.is_set():
                        wake.clear()
                        next_renewal = min(next_renewal, state.renewal_by(self.fraction))
                    continue
                # Wait for the renewal, but never past the deadline.
                await asyncio.wait({renewal}, timeout=max(0.0, state.valid_until - now))
                if not renewal.done():
                    continue  # the deadline passed with the renewal still in flight
                error = (
                    LockError("renewal cancelled", state.lockstring)
                    if renewal.cancelled()
                    else renewal.exception()
                )
                renewal = None
                state.telemetry.end_spans()
                if isinstance(error, LockLost):
                    return  # extend() marked it lost (or it was released meanwhile)
                if isinstance(error, LockError):
                    failures += 1
                    delay = min(state.ttl * self.fraction, FIRST_RETRY_DELAY * 2 ** (failures - 1))
                    logger.warning(
                        "could not renew lock %r (id %d), attempt %d: %s; retrying in %.2fs",
                        state.lockstring,
                        state.lock_id,
                        failures,
                        error,
                        delay,
                    )
                    next_renewal = clock.now() + delay
                elif error is not None:
                    logger.error("unexpected error renewing lock %r: %r", state.lockstring, error)
                    next_renewal = clock.now() + state.ttl * self.fraction
                else:
                    failures = 0
                    next_renewal = state.renewal_by(self.fraction)
        finally:
            if self._wakes.get(id(state)) is wake:
                del self._wakes[id(state)]
            if renewal is not None and not renewal.done():
                renewal.cancel()
                # Its span ends once it does (it runs to its end: see concurrency.within).
                renewal.add_done_callback(lambda _: state.telemetry.end_spans())
            else:
                state.telemetry.end_spans()
