"""One attempt at a lock, and the handle of a row won: what every way of waiting for a lock
repeats.

Written once for asyncio; the sync ``sqllocker/attempts.py`` is generated from it
(``tests/unasync.py``).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

if True:  # ASYNC
    import asyncio

from ..backoff import Backoff
from ..errors import DatabaseError
from ..file_queue import FileQueue, offsets
from ..holding import OnLost
from ..operations import Acquired, LockOperations, Refused
from ..telemetry import attempted
from . import concurrency
from .acquiring import Winnings
from .lock import AsyncCall, AsyncKeepAlives, AsyncLock, AsyncLockState, AsyncLockTaker

if True:  # ASYNC
    from .tasks import spawn

logger = logging.getLogger("sqllocker")


async def wait_out(error: DatabaseError, backoff: Backoff, lockstring: str) -> None:
    """After a waiting attempt failed with ``error``: if it is an outage (a failover, a restart)
    and the wait is not over, wait it out, as for a holder; else raise it. An attempt cut off may
    have taken the row; the next one finds it ours (guid)."""
    if not error.outage or backoff.expired():
        raise error
    logger.warning("waiting for %r through an outage: %s", lockstring, error)
    await concurrency.sleep(backoff.next_delay())


class AsyncAttempts:
    """Attempts at rows of the table of ``locker`` (whose locks their handles name), through
    ``operations``, each run by ``run``; the locks won are kept alive by ``keep_alives``. On
    SQLite, ``file_queue`` is the kernel's queue of the waiters (``sqllocker.file_queue``)."""

    def __init__(
        self,
        locker: AsyncLockTaker,
        operations: LockOperations,
        run: AsyncCall,
        keep_alives: AsyncKeepAlives,
        file_queue: FileQueue | None,
    ) -> None:
        self._locker = locker
        self._operations = operations
        self._call = run
        self._keep_alives = keep_alives
        self.file_queue = file_queue
        self._in_memory = operations.database.pool.in_memory
        self._offset = offsets(locker.table_name)  # of a lockstring's place in file_queue
        if True:  # ASYNC
            self._statements_await = operations.statements_await

    async def try_acquire(
        self,
        winnings: Winnings,
        lockstring: str,
        guid: str,
        details: dict[str, Any],
        ttl: float,
        on_lost: OnLost | None,
        queue_key: int | None = None,
        look_first: bool = False,
        in_line: bool = False,
    ) -> AsyncLock | Refused:
        attempt = (lockstring, guid, ttl, details, queue_key, look_first, in_line)
        if True:  # ASYNC
            if not self._statements_await:
                # Its statements give the event loop no turn (SQLite, on the Locker's own
                # engine): one first, before anything is sent, where a cancellation leaves
                # nothing behind; a task that takes lock after lock lets the others run.
                await asyncio.sleep(0)
            outcome = await concurrency.shielded(
                self._call(self._operations.try_acquire, *attempt),
                f"acquire {lockstring!r}",
                functools.partial(self._release_won, lockstring, guid),
            )
        else:
            outcome = self._operations.try_acquire(*attempt)
        attempted(outcome)
        if not isinstance(outcome, Acquired):
            return outcome
        return self.handle(winnings, lockstring, guid, outcome, ttl, details, on_lost)

    def handle(
        self,
        winnings: Winnings,
        lockstring: str,
        guid: str,
        acquired: Acquired,
        ttl: float,
        details: dict[str, Any],
        on_lost: OnLost | None,
    ) -> AsyncLock:
        """The handle of a row just won, recorded in the acquire's ``winnings``: if the acquire
        ends in an exception before it hands the lock over, it is released (``acquisition``).
        On SQLite it holds no place in the kernel's queue (a waiter that held one puts it in):
        its release looks whether a waiter took the place meanwhile, and rings the bell for it
        (``file_queue.Unplaced``)."""
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
        if self.file_queue is not None:
            state.place = self.file_queue.unplaced(self._offset(lockstring))
        elif self._in_memory is not None:
            self._in_memory.hold(state, acquired.database)  # lost if its database goes
        lock = AsyncLock(
            self._locker,
            state,
            created=acquired.created,
            expires=acquired.expires,
            locked_by=details,
        )
        return winnings.won(lock)

    async def try_once(
        self,
        winnings: Winnings,
        lockstring: str,
        guid: str,
        details: dict[str, Any],
        ttl: float,
        on_lost: OnLost | None,
    ) -> AsyncLock:
        """One attempt, or LockBusy. On SQLite it takes no place in the kernel's queue (see
        ``handle``)."""
        outcome = await self.try_acquire(winnings, lockstring, guid, details, ttl, on_lost)
        if not isinstance(outcome, AsyncLock):
            raise outcome.busy_after(lockstring, 0)
        return outcome

    if True:  # ASYNC

        def _release_won(self, lockstring: str, guid: str, outcome: Acquired | Refused) -> None:
            """The caller of an attempt was cancelled: release the lock if the attempt won it."""
            if isinstance(outcome, Acquired):
                logger.info(
                    "releasing %r (id %d): its acquirer was cancelled", lockstring, outcome.lock_id
                )
                release = self._call(self._operations.release, lockstring, outcome.lock_id, guid)
                spawn(release, f"release {lockstring!r} after cancellation")
