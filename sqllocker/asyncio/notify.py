"""Waking async PostgreSQL waiters on release: the asyncio twin of ``sqllocker/notify.py``.

One task per AsyncLocker holds a psycopg 3 AsyncConnection that LISTENs on the table's channel
(the DELETE trigger sends the lockstring while waiters are queued), and each notification wakes
the longest-waiting waiter of that lockstring; a hand-off to the head of a queue
(``sqllocker_<table>_granted``) wakes that lockstring's head, which reads its row back before
it believes it. Waiters register before each attempt, and still wake by themselves at their
backoff or the holder's expiry, so a dropped listening connection costs latency, never
correctness.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.util import greenlet_spawn

from ..notify import Waiter, WaiterQueues, channel_for, grants_channel_for, parse_grant

logger = logging.getLogger("sqllocker")

_RECONNECT_SECONDS = 1.0
_SUBSCRIBE_SECONDS = 5.0


class AsyncReleaseListener:
    """One LISTEN connection per AsyncLocker, and the waiters it wakes."""

    def __init__(self, engine: AsyncEngine, table: str) -> None:
        self._engine = engine
        self.channel = channel_for(table)
        self.grants_channel = grants_channel_for(table)
        self._waiters = WaiterQueues()
        self._task: asyncio.Task[None] | None = None
        self._listening = asyncio.Event()
        self.notifications = 0
        self.grants = 0

    async def register(self, lockstring: str, digest: str | None = None) -> Waiter[asyncio.Event]:
        """Subscribe to ``lockstring``'s next release, and, for the head of its queue (the
        ``digest`` of its guid), to a hand-off of its row; call before the acquire attempt."""
        if self._task is None or self._task.done():
            self._listening.clear()
            self._task = asyncio.get_running_loop().create_task(
                self._listen(), name=f"sqllocker: listen {self.channel}"
            )
        # Subscribed before the caller's attempt, or (after a timeout) not at all, when the
        # caller's backoff polls: never a registration that silently misses the release.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._listening.wait(), _SUBSCRIBE_SECONDS)
        return self._waiters.add(Waiter(lockstring, asyncio.Event(), digest))

    def unregister(self, waiter: Waiter[asyncio.Event]) -> None:
        self._waiters.remove(waiter)

    def step_aside(self, waiter: Waiter[asyncio.Event]) -> None:
        """``unregister`` for a waiter about to queue: see ``WaiterQueues.step_aside``."""
        self._waiters.step_aside(waiter)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _listen(self) -> None:
        while True:
            try:
                await self._listen_once()
            except asyncio.CancelledError:
                raise
            except Exception as error:  # the connection dropped: reconnect after a pause
                logger.warning("release notifications interrupted (%s); reconnecting", error)
            self._listening.clear()
            self._waiters.wake_everyone()  # they may have missed a release meanwhile
            await asyncio.sleep(_RECONNECT_SECONDS)

    async def _listen_once(self) -> None:
        fairy = await greenlet_spawn(self._engine.sync_engine.raw_connection)
        connection: Any = fairy.driver_connection  # psycopg.AsyncConnection
        fairy.detach()  # ours for good: it never goes back to the pool
        try:
            await connection.set_autocommit(True)
            await connection.execute(f'LISTEN "{self.channel}"')
            await connection.execute(f'LISTEN "{self.grants_channel}"')
            self._listening.set()
            async for notice in connection.notifies():
                self.notifications += 1
                if notice.channel == self.channel:
                    self._waiters.wake_first(notice.payload)
                elif (grant := parse_grant(notice.payload)) is not None:
                    self.grants += self._waiters.hand_over(grant)
        finally:
            self._listening.clear()
            await connection.close()
