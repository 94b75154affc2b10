"""sqllocker for asyncio: the same locks, table and rules as ``sqllocker.Locker``.

    from sqllocker.asyncio import AsyncLocker

    locker = AsyncLocker("postgresql://db/app")
    async with locker.lock("digest 42", expires=60):
        ...

Needs the ``asyncio`` extra (greenlet and aiosqlite; aiomysql for MySQL/MariaDB). A URL that
names no driver gets psycopg 3 (PostgreSQL), aiomysql (MySQL/MariaDB) or aiosqlite (SQLite);
an engine must be an ``AsyncEngine``.

What differs from the sync front end:

- ``locker.lock(...)`` is awaited for the lock (``lock = await locker.lock(...)``), or held
  for a block with ``async with``; releases, extends and the table's reads are awaited.
- ``locked`` decorates coroutine functions; ``on_lost`` may be a coroutine function.
- Kept-alive locks are renewed by a task per lock, on the locker's event loop.
- Cancellation: a task cancelled while acquiring returns at once; its attempt finishes in the
  background, and a lock it turns out to have won is released straight away, so no row is
  left behind (unless the event loop itself shuts down mid-statement: then the row expires).
  What an acquire of any kind has already won when it is cancelled (a semaphore's permit as
  it is counted, a waiter's row as it gives up its ticket, a group's rows) is released before
  the cancellation goes on (``acquiring.acquisition``). A cancelled ``unlock()`` finishes its
  release in the background, and a cancelled wait stops at once.
- An AsyncLocker's connections, listener and keep-alive tasks belong to the event loop that
  runs them. It may serve one loop after another (``asyncio.run`` twice, a test framework's
  loop per test): when a new loop first uses it, what belonged to the previous loop is
  dropped. A loop that shuts down its async generators before closing (``asyncio.run`` does)
  closes the locker's connections as it ends, as ``aclose()`` would (see ``loop_end``); with
  a caller's AsyncEngine, disposing of that engine's pooled connections stays the caller's
  part. Two loops running at once cannot share one; the second is refused with a LockError.
- Close it with ``await locker.aclose()``, or ``async with AsyncLocker(...) as locker``.
"""

from .acquiring import Acquiring
from .election import AsyncElection, AsyncLeadership
from .group import AsyncLockGroup
from .lock import AsyncLock
from .locker import AsyncLocker
from .rwlock import AsyncRWLock
from .semaphore import AsyncSemaphore

__all__ = [
    "Acquiring",
    "AsyncElection",
    "AsyncLeadership",
    "AsyncLock",
    "AsyncLockGroup",
    "AsyncLocker",
    "AsyncRWLock",
    "AsyncSemaphore",
]
