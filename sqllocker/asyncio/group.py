"""Several locks taken together: every one of them, or none (``lock_all``).

Written once for asyncio; the sync ``sqllocker/group.py`` is generated from it
(``tests/unasync.py``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import datetime
from types import TracebackType

from ..errors import LockError
from ..holding import GroupBase
from .lock import AsyncLock


class AsyncLockGroup(GroupBase[AsyncLock]):
    """Locks taken together by ``lock_all``: ``async with`` it, or ``await group.unlock()``.
    ``locks`` are the member locks, in canonical order."""

    async def unlock(self) -> None:
        """Release every member (each is tried); the first LockLost (or other error) met is
        raised after."""
        await self._each(AsyncLock.unlock)

    async def extend(self, seconds: float | None = None) -> list[datetime]:
        """Extend every member (see ``extend`` of a lock); LockLost if any is no longer ours."""
        return [await lock.extend(seconds) for lock in self.locks]

    def keep_alive(self) -> AsyncLockGroup:
        for lock in self.locks:
            lock.keep_alive()
        return self

    async def __aenter__(self) -> AsyncLockGroup:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self._each(lambda lock: lock.__aexit__(exc_type, exc_value, traceback))

    async def _each(self, release: Callable[[AsyncLock], Awaitable[None]]) -> None:
        errors: list[BaseException] = []
        for lock in self.locks:
            try:
                await release(lock)
            except LockError as error:
                errors.append(error)
        self._first_error(errors)
