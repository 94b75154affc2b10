"""Counting semaphores: at most ``limit`` holders of one name at once (see ``permits.py``).

Written once for asyncio; the sync ``sqllocker/semaphore.py`` is generated from it
(``tests/unasync.py``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

from ..backoff import Backoff
from ..errors import LockBusy, LockError
from ..holding import OnLost
from ..permits import (
    TURN_EXPIRES,
    admits,
    check_semaphore,
    permit_lockstring,
    permit_pattern,
    refused,
    slots_to_try,
    turn_details,
    turn_lockstring,
)
from ..telemetry import unrecorded
from ..validation import check_hold_at_least, check_wait
from . import concurrency
from .acquiring import Winnings, acquisition

if TYPE_CHECKING:
    from ..operations import LockInfo, LockOperations
    from ..telemetry import Telemetry
    from .lock import AsyncLock, AsyncLockTaker, Run

logger = logging.getLogger("sqllocker")


class Request(Protocol):
    """The locker's acquire of one lock, its arguments checked, to run in the acquisition of a
    permit (``AsyncLocker._acquire_request``)."""

    def __call__(
        self,
        lockstring: str,
        expires: float | None = None,
        wait: float | None = 0,
        locked_by: dict[str, Any] | None = None,
        keep_alive: bool = False,
        on_lost: OnLost | None = None,
        hold_at_least: float | None = None,
    ) -> Callable[[Winnings], Awaitable[AsyncLock]]: ...


def _turn_lost(_: object) -> None:
    """A turn that could not be renewed lapses: the waiter simply has none any more."""


class AsyncSemaphore:
    """At most ``limit`` holders of ``name`` at once (see ``sqllocker.permits``); from the
    locker's ``semaphore()``."""

    def __init__(
        self,
        locker: AsyncLockTaker,
        operations: LockOperations,
        run: Run,
        name: str,
        limit: int,
        *,
        request: Request,
        telemetry: Telemetry,
    ) -> None:
        self.locker = locker
        self._request = request
        self._telemetry = telemetry
        self._operations = operations
        self._run = run
        self.name, self.limit = check_semaphore(name, limit)

    async def acquire(
        self,
        *,
        wait: float | None = 0,
        expires: float | None = None,
        keep_alive: bool = False,
        hold_at_least: float | None = None,
        **options: Any,
    ) -> AsyncLock:
        """A permit: a lock of its own (``lock_id`` its fencing token), released as any lock
        is. ``wait``, ``expires``, ``keep_alive``, ``hold_at_least`` and the rest are the
        locker's ``lock()``'s; raises LockBusy once ``wait`` has passed with every permit
        held. A waiter refused for its smaller limit takes the semaphore's turn (see
        ``sqllocker.permits``)."""
        checked_wait = check_wait(wait, self.name)
        hold = check_hold_at_least(hold_at_least, self.name)
        # Granted only once counted: until then a permit is held for no window and not kept
        # alive, so that one refused goes back at once (``permit.unlock()``).
        request = functools.partial(self._request, expires=expires, **options)
        recording = self._telemetry.compound("semaphore", self.name, wait)
        try:
            # A permit counts as held once granted: one refused by the count, given back at
            # once, and the turn, a waiter's place, are never held locks.
            with unrecorded():
                permit = await acquisition(self._acquire, request, checked_wait, keep_alive, hold)
        except BaseException as error:
            recording.failed(error)
            raise
        permit._state.telemetry = recording.acquired(permit.lock_id)
        return permit

    async def _acquire(
        self,
        request: Callable[[str], Callable[[Winnings], Awaitable[AsyncLock]]],
        wait: float | None,
        keep_alive: bool,
        hold_at_least: float | None,
        winnings: Winnings,
    ) -> AsyncLock:
        backoff = Backoff.for_wait(wait)
        turn: AsyncLock | None = None
        try:
            while True:
                outnumbered = False
                for slot in slots_to_try(self.limit):
                    try:
                        permit = await request(permit_lockstring(self.name, slot))(winnings)
                    except LockBusy:
                        continue
                    live, reserved = await self._count()
                    if admits(self.limit, live, reserved, turn.lock_id if turn else None):
                        permit._state.hold_at_least = hold_at_least
                        return permit.keep_alive() if keep_alive else permit
                    # Never granted: deleted at once (no window, whatever hold_at_least says).
                    await permit.unlock()
                    outnumbered = live > self.limit
                    break
                else:  # every slot of ours is held: are there more holders than our limit?
                    outnumbered = (turn is None or not turn.is_locked) and not backoff.expired()
                    outnumbered = outnumbered and (await self._count())[0] > self.limit
                if backoff.expired():
                    raise refused(self.name, self.limit, wait)
                if outnumbered and (turn is None or not turn.is_locked):
                    if turn is not None:  # lost (broken by an operator, or not renewed)
                        await self._end_turn(turn)
                    turn = await self._take_turn(winnings)
                await concurrency.sleep(backoff.next_delay())
        finally:
            if turn is not None:
                await self._end_turn(turn)

    async def _count(self) -> tuple[int, LockInfo | None]:
        """The live permits, and the row of the semaphore's turn (see ``sqllocker.permits``)."""
        counted: tuple[int, LockInfo | None] = await self._run(
            self._operations.count_permits, *permit_pattern(self.name), turn_lockstring(self.name)
        )
        return counted

    async def _take_turn(self, winnings: Winnings) -> AsyncLock | None:
        """The semaphore's turn for this waiter, refused for its smaller limit, if nobody else
        has it: kept alive while it waits, it holds newcomers off the permits it needs."""
        request = self._request(
            turn_lockstring(self.name),
            expires=TURN_EXPIRES,
            locked_by=turn_details(self.limit),
            keep_alive=True,
            on_lost=_turn_lost,
        )
        try:
            turn: AsyncLock = await request(winnings)
        except LockBusy:
            return None
        return turn

    async def _end_turn(self, turn: AsyncLock) -> None:
        try:
            await turn.unlock()
        except LockError as error:  # lapsed, or the database away: it expires
            logger.info("semaphore %r: could not give its turn up (%s)", self.name, error)

    async def holders(self) -> list[LockInfo]:
        """The live permits, ordered by lockstring (each ``LockInfo`` names its slot)."""
        infos: list[LockInfo] = await self._run(
            self._operations.permits, *permit_pattern(self.name)
        )
        return infos

    def __repr__(self) -> str:
        return f"<AsyncSemaphore {self.name!r} limit={self.limit}>"
