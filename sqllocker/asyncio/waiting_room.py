"""MySQL/MariaDB: waiters of one lockstring queue in the server, first come, first served (the
design is in ``queueing.py``).

A queued waiter waits in ``GET_LOCK`` on a connection of its own, checked out of the Locker's
pool, whose limit it counts toward; sync and async waiters of one lockstring share one queue.
If an async waiter's task is cancelled meanwhile, its connection is closed, which ends the
session and with it any place in the queue: a cancelled waiter never keeps others waiting. The
room's watch ends the waits of a queue that stands still on a free row (see
``queueing.Watch``).

Written once for asyncio; the sync ``sqllocker/waiting_room.py`` is generated from it
(``tests/unasync.py``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from ..queueing import (
    DEFAULT_CAPACITY,
    AnyQueueWait,
    Blocked,
    Entry,
    QueueKey,
    Seats,
    Watch,
    look_interval,
)
from . import concurrency

if True:  # ASYNC
    import asyncio

logger = logging.getLogger("sqllocker")


class AsyncTurn:
    """The head of one lockstring's queue: ``leave()`` once the row is ours, or the wait ends."""

    def __init__(self, room: AsyncWaitingRoom, connection: Any, key: QueueKey) -> None:
        self._room = room
        self._connection: Any = connection
        self._key = key

    async def leave(self) -> None:
        """Leave the queue."""
        connection, self._connection = self._connection, None
        if connection is None:
            return
        if True:  # ASYNC
            # A second cancellation must not leave the queue lock held.
            await asyncio.shield(self._room.leave(connection, self._key))
        else:
            self._room.leave(connection, self._key)

    def leave_soon(self) -> None:
        """Leave in the background, once the row is ours: the caller has its lock without
        waiting for this round trip (the next waiter could not have the row anyway)."""
        connection, self._connection = self._connection, None
        if connection is not None:
            self._room.leave_soon(connection, self._key)


class AsyncWaitingRoom:
    """One locker's queues, and the connections its queued waiters wait on."""

    def __init__(
        self,
        engine: AsyncEngine,
        queue_wait: AnyQueueWait,
        look: Callable[[str, QueueKey], Awaitable[tuple[bool, Any]]],
        end_waits: Callable[[list[Any]], Awaitable[None]],
        capacity: int = DEFAULT_CAPACITY,
    ) -> None:
        """``look`` and ``end_waits`` are the Locker's ``look_at_queue`` and
        ``end_queued_waits`` operations, which run on the Locker's pool."""
        self._engine = engine
        self.seats = Seats(capacity)
        self.queue_wait = queue_wait
        self._look = look
        self._end_waits = end_waits
        self._watch = Watch()
        self._watching = concurrency.Background("sqllocker-queue-watch")
        self._leaving = concurrency.Background("sqllocker-queue-leaver")

    def key(self, lockstring: str) -> QueueKey:
        """The advisory lock key of ``lockstring``'s queue in this room's table."""
        return self.queue_wait.key(lockstring)

    async def enter(self, lockstring: str, timeout: float | None) -> Entry[AsyncTurn]:
        """Become the head of ``lockstring``'s queue, waiting at most ``timeout`` seconds (or
        until the watch finds the queue stuck)."""
        seated, connection = await self._checkout(timeout)
        if not seated:
            # Closed, or the caller's deadline came while it waited in line for a seat.
            return Entry(None, usable=not self.seats.closed)
        connection = connection or await self._connect()
        if connection is None:
            return Entry(None, usable=False)
        key = self.key(lockstring)
        blocked = Blocked(lockstring, key, connection.session)
        if self._watch.add(blocked):
            self._watching.call_soon(self._watch_queues)
        ended = False
        try:
            try:
                row = await self._fetch_one(connection, self.queue_wait.statement(key, timeout))
            finally:
                ended = self._watch.remove(blocked)
            if not ended:
                if self.queue_wait.granted(row):
                    return Entry(AsyncTurn(self, connection, key), usable=True)
                await self._checkin(connection)  # the caller's deadline came first
                return Entry(None, usable=True)
        except BaseException as error:
            if True:  # ASYNC
                await asyncio.shield(self._discard(connection))
            else:
                self._discard(connection)
            if not isinstance(error, Exception):
                raise  # cancelled or interrupted: we have left the queue
            if not ended:
                logger.warning("could not queue for %r (%s); waiting unqueued", lockstring, error)
                return Entry(None, usable=False)
            return Entry(None, usable=True)
        # Ended by the watch: whatever the wait returned, its connection goes (a cancel still
        # on its way must not reach a later statement), and with it any place.
        if True:  # ASYNC
            await asyncio.shield(self._discard(connection))
        else:
            self._discard(connection)
        return Entry(None, usable=True)

    async def _watch_queues(self) -> None:
        """Look at the queues of the waits queued behind a head, every ``look_interval()``
        while there are any, and end the waits of those that are stuck (``queueing.Watch``)."""
        while True:
            await concurrency.sleep(look_interval())
            watched = self._watch.watched()
            if watched is None:
                return
            for lockstring, key in watched:
                try:
                    takeable, head = await self._look(lockstring, key)
                    sessions = self._watch.saw(lockstring, takeable, head)
                    if sessions:
                        logger.info(
                            "the queue for %r stood still on a free row; its waiters try it",
                            lockstring,
                        )
                        await self._end_waits(sessions)
                except Exception as error:
                    logger.warning("could not look at the queue for %r (%s)", lockstring, error)

    async def leave(self, connection: Any, key: QueueKey) -> None:
        """Leave the queue of ``key`` (see ``Turn.leave``); never raises but to be cancelled
        or interrupted."""
        try:
            await self._fetch_one(connection, self.queue_wait.leave_statement(key))
        except BaseException as error:
            await self._discard(connection)
            if not isinstance(error, Exception):
                raise
            logger.warning("could not leave a lock queue (%s); closing its connection", error)
            return
        await self._checkin(connection)

    def leave_soon(self, connection: Any, key: QueueKey) -> None:
        """``leave`` in the background (``close`` waits for it)."""
        self._leaving.call_soon(self.leave, connection, key)

    async def close(self) -> None:
        self._watch.close()
        await self._watching.close()
        await self._leaving.close()
        for connection in self.seats.close():
            with contextlib.suppress(Exception):
                await connection.close()

    # -- connections ----------------------------------------------------------------------------

    async def _fetch_one(
        self, pooled: concurrency.PooledConnection, statement: tuple[str, tuple[Any, ...]]
    ) -> Any:
        """Run ``statement`` on the driver connection of ``pooled``; its first row."""
        connection = pooled.driver
        if True:  # ASYNC
            cursor = await connection.cursor()
        else:
            cursor = connection.cursor()
        try:
            await cursor.execute(*statement)
            return await cursor.fetchone()
        finally:
            await cursor.close()

    async def _checkout(self, timeout: float | None) -> tuple[bool, Any | None]:
        """A seat, waiting in line for one at most ``timeout`` seconds: (whether we have one,
        a kept connection that comes with it or None)."""
        woken, wake = concurrency.woken_from_thread()
        seated, connection, in_line = self.seats.take(wake)
        if in_line is None:
            return seated, connection
        try:
            await concurrency.wait(woken, timeout)
        except BaseException:
            seated, connection = self.seats.leave_line(in_line)
            if seated:  # given to us as we were cancelled or interrupted: pass it on
                if True:  # ASYNC
                    await asyncio.shield(self._checkin(connection))
                else:
                    self._checkin(connection)
            raise
        return self.seats.leave_line(in_line)

    async def _connect(self) -> Any | None:
        """A new connection for a seat we have, or None (the seat given back)."""
        try:
            connection = await concurrency.pooled_connection(self._engine, autocommit=False)
        except BaseException as error:
            await self._discard(None)
            if not isinstance(error, Exception):
                raise
            logger.warning("could not open a connection to queue on (%s)", error)
            return None
        try:
            self.queue_wait.prepare(connection.driver)
            row = await self._fetch_one(connection, (self.queue_wait.session_statement, ()))
            connection.session = row[0]
        except BaseException as error:
            await self._discard(connection)
            if not isinstance(error, Exception):
                raise
            logger.warning("could not set up a connection to queue on (%s)", error)
            return None
        return connection

    async def _checkin(self, connection: Any) -> None:
        extra = self.seats.give_back(connection)
        if extra is not None:
            with contextlib.suppress(Exception):
                await extra.close()

    async def _discard(self, connection: Any | None) -> None:
        # Closed before its seat is free: the next waiter's new connection is not one more.
        try:
            if connection is not None:
                with contextlib.suppress(Exception):
                    await connection.close()
        finally:
            self.seats.give_back(None)
