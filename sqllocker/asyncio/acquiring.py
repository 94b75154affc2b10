"""What ``AsyncLocker.lock()`` returns: an acquire that is awaited, or held for a block."""

from __future__ import annotations

from collections.abc import Coroutine, Generator
from types import TracebackType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .lock import AsyncLock


class Acquiring:
    """Await it for the lock, or ``async with`` it to hold the lock for the block (released at
    its end, as ``async with lock:`` does)."""

    def __init__(self, acquire: Coroutine[Any, Any, AsyncLock]) -> None:
        self._acquire = acquire
        self._lock: AsyncLock | None = None

    def __await__(self) -> Generator[Any, None, AsyncLock]:
        return self._acquire.__await__()

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
