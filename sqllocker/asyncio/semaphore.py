"""Counting semaphores: at most ``limit`` holders of one name at once (see ``permits.py``).

Written once for asyncio; the sync ``sqllocker/semaphore.py`` is generated from it
(``tests/unasync.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..backoff import Backoff
from ..errors import LockBusy
from ..permits import check_semaphore, permit_lockstring, permit_pattern, refused, slots_to_try
from ..validation import check_wait
from . import concurrency

if TYPE_CHECKING:
    from ..operations import LockInfo, LockOperations
    from .lock import AsyncLock, Run
    from .locker import AsyncLocker


class AsyncSemaphore:
    """At most ``limit`` holders of ``name`` at once (see ``sqllocker.permits``); from the
    locker's ``semaphore()``."""

    def __init__(
        self, locker: AsyncLocker, operations: LockOperations, run: Run, name: str, limit: int
    ) -> None:
        self.locker = locker
        self._operations = operations
        self._run = run
        self.name, self.limit = check_semaphore(name, limit)

    async def acquire(
        self,
        *,
        wait: float | None = 0,
        expires: float | None = None,
        keep_alive: bool = False,
        **options: Any,
    ) -> AsyncLock:
        """A permit: a lock of its own (``lock_id`` its fencing token), released as any lock
        is. ``wait``, ``expires``, ``keep_alive`` and the rest are the locker's ``lock()``'s;
        raises LockBusy once ``wait`` has passed with every permit held."""
        acquisition = self.locker._telemetry.compound("semaphore", self.name, wait)
        try:
            permit = await self._acquire(
                wait=wait, expires=expires, keep_alive=keep_alive, **options
            )
        except BaseException as error:
            acquisition.failed(error)
            raise
        acquisition.succeeded()
        return permit

    async def _acquire(
        self,
        *,
        wait: float | None = 0,
        expires: float | None = None,
        keep_alive: bool = False,
        **options: Any,
    ) -> AsyncLock:
        backoff = Backoff.for_wait(check_wait(wait, self.name))
        while True:
            for slot in slots_to_try(self.limit):
                lockstring = permit_lockstring(self.name, slot)
                try:
                    permit = await self.locker.lock(lockstring, expires=expires, **options)
                except LockBusy:
                    continue
                pattern = permit_pattern(self.name)
                if await self._run(self._operations.count_live, *pattern) <= self.limit:
                    return permit.keep_alive() if keep_alive else permit
                await permit.unlock()  # over a smaller limit than others': no newcomer for now
                break
            if backoff.expired():
                raise refused(self.name, self.limit, wait)
            await concurrency.sleep(backoff.next_delay())

    async def holders(self) -> list[LockInfo]:
        """The live permits, ordered by lockstring (each ``LockInfo`` names its slot)."""
        infos: list[LockInfo] = await self._run(
            self._operations.permits, *permit_pattern(self.name)
        )
        return infos

    def __repr__(self) -> str:
        return f"<AsyncSemaphore {self.name!r} limit={self.limit}>"
