"""sqllocker for asyncio: the same locks, table and rules as ``sqllocker.Locker``.

    from sqllocker.asyncio import AsyncLocker

    locker = AsyncLocker("postgresql://db/app")
    async with locker.lock("digest 42", expires=60):
        ...

Needs the ``asyncio`` extra (greenlet and aiosqlite; aiomysql for MySQL/MariaDB).
"""

from .group import AsyncLockGroup
from .lock import AsyncLock
from .locker import Acquiring, AsyncLocker
from .semaphore import AsyncSemaphore

__all__ = ["Acquiring", "AsyncLock", "AsyncLockGroup", "AsyncLocker", "AsyncSemaphore"]
