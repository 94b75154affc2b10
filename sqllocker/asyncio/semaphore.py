"""Counting semaphores for asyncio: ``sqllocker.semaphore``'s, permits taken with ``await``."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from ..backoff import Backoff
from ..errors import LockBusy
from ..semaphore import check_semaphore, permit_lockstring, permit_pattern, refused, slots_to_try
from ..validation import check_wait

if TYPE_CHECKING:
    from ..operations import LockInfo, LockOperations
    from .lock import AsyncLock
    from .locker import AsyncLocker


class AsyncSemaphore:
    """At most ``limit`` holders of ``name`` at once; from ``AsyncLocker.semaphore``."""

    def __init__(self, locker: AsyncLocker, table: LockOperations, name: str, limit: int) -> None:
        self.locker = locker
        self._operations = table
        self.name, self.limit = check_semaphore(name, limit)

    async def acquire(
        self,
        *,
        wait: float | None = 0,
        expires: float | None = None,
        keep_alive: bool = False,
        **options: Any,
    ) -> AsyncLock:
        """A permit, as ``Semaphore.acquire``."""
        backoff = Backoff.for_wait(check_wait(wait, self.name))
        while True:
            for slot in slots_to_try(self.limit):
                lockstring = permit_lockstring(self.name, slot)
                try:
                    permit = await self.locker.lock(lockstring, expires=expires, **options)
                except LockBusy:
                    continue
                live = await self.locker._call(
                    self._operations.count_live, *permit_pattern(self.name)
                )
                if live <= self.limit:
                    return permit.keep_alive() if keep_alive else permit
                await permit.unlock()  # over a smaller limit than others': no newcomer now
                break
            if backoff.expired():
                raise refused(self.name, self.limit, wait)
            await asyncio.sleep(backoff.next_delay())

    async def holders(self) -> list[LockInfo]:
        """The live permits, ordered by lockstring."""
        return await self.locker._call(self._operations.permits, *permit_pattern(self.name))

    def __repr__(self) -> str:
        return f"<AsyncSemaphore {self.name!r} limit={self.limit}>"
