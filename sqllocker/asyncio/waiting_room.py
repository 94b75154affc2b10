"""Queueing async PostgreSQL waiters in the server: the asyncio twin of
``sqllocker/waiting_room.py`` (same advisory lock keys, so sync and async waiters of one
lockstring share one queue, first come, first served).

A queued waiter awaits ``pg_advisory_lock`` on a psycopg AsyncConnection of its own. If its
task is cancelled meanwhile, the connection is closed, which ends the session and with it any
place in the queue: a cancelled waiter never keeps others waiting. The head of a queue leaves a
Request for a release to grant, and withdraws it as a sync head does (see ``Turn``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.util import greenlet_spawn

from ..statements import Statements
from ..waiting_room import (
    DEFAULT_CAPACITY,
    Entry,
    QueueWait,
    Request,
    Seats,
    timed_out,
)

logger = logging.getLogger("sqllocker")


class AsyncTurn:
    """The head of one lockstring's queue: ``await leave()`` once the row is ours, or the wait
    ends. ``request`` as for ``Turn``."""

    def __init__(
        self,
        room: AsyncWaitingRoom,
        connection: Any,
        key: int,
        request: Request | None = None,
    ) -> None:
        self._room = room
        self._connection: Any = connection
        self._key = key
        self.request = request

    async def leave(self, give_back: bool = True) -> bool:
        """As ``Turn.leave``, in the foreground."""
        connection, self._connection = self._connection, None
        if connection is None:
            return False
        # Shielded: a second cancellation must not leave the queue lock (or a request) held.
        return await asyncio.shield(
            self._room.leave(connection, self._key, self.request, give_back)
        )

    def leave_soon(self) -> None:
        """Leave in a task of its own, once the row is ours and no request of ours stands:
        the caller has its lock without waiting for this round trip (the next waiter could
        not have the row anyway)."""
        assert self.request is None, "a standing request is withdrawn in the foreground"
        connection, self._connection = self._connection, None
        if connection is not None:
            self._room.leave_soon(connection, self._key)

    def granted(self) -> None:
        """``leave_soon`` after a release handed us the row (which took our request with it)."""
        self.request = None
        self.leave_soon()


class AsyncWaitingRoom:
    """One AsyncLocker's queues, and the connections its queued waiters wait on."""

    def __init__(
        self, engine: AsyncEngine, statements: Statements, capacity: int = DEFAULT_CAPACITY
    ) -> None:
        self._engine = engine
        self.seats = Seats(capacity)
        self.queue_wait = QueueWait(statements)
        self._leaving: set[asyncio.Task[bool]] = set()

    def key(self, lockstring: str) -> int:
        """The advisory lock key of ``lockstring``'s queue in this room's table."""
        return self.queue_wait.key(lockstring)

    async def enter(
        self,
        lockstring: str,
        timeout: float | None,
        before_blocking: Callable[[], None],
        request: Request,
    ) -> Entry[AsyncTurn]:
        """As ``WaitingRoom.enter``."""
        connection = await self._checkout()
        if connection is None:
            return Entry(None, try_again=False, usable=False)
        key = self.key(lockstring)
        before_blocking()
        try:
            statement = self.queue_wait.statement(key, timeout, request)
            cursor = await connection.execute(*statement)
            if self.queue_wait.granted(await cursor.fetchone()):
                turn = AsyncTurn(self, connection, key, request)
                return Entry(turn, try_again=True, usable=True)
            await self._checkin(connection)  # the caller's deadline, or our patience, came first
            return Entry(None, try_again=True, usable=True)
        except BaseException as error:
            if timed_out(error):
                await self._checkin(connection)  # the caller's deadline, or our patience
                return Entry(None, try_again=True, usable=True)
            await asyncio.shield(self._discard(connection))
            if not isinstance(error, Exception):
                raise  # cancelled: closing the connection has left the queue
            logger.warning("could not queue for %r (%s); waiting unqueued", lockstring, error)
            return Entry(None, try_again=True, usable=False)

    async def leave(
        self, connection: Any, key: int, request: Request | None = None, give_back: bool = True
    ) -> bool:
        """As ``WaitingRoom.leave``."""
        try:
            cursor = await connection.execute(
                *self.queue_wait.leave_statement(key, request, give_back)
            )
            row = await cursor.fetchone()
        except Exception as error:  # closing the connection ends the queue lock too
            logger.warning("could not leave a lock queue (%s); closing its connection", error)
            await self._discard(connection)
            return False
        await self._checkin(connection)
        return request is not None and bool(row[0])

    def leave_soon(self, connection: Any, key: int) -> None:
        """``leave`` in a task of its own, kept until it is done (``close`` waits for it)."""
        task = asyncio.get_running_loop().create_task(self.leave(connection, key))
        self._leaving.add(task)
        task.add_done_callback(self._leaving.discard)

    async def close(self) -> None:
        if self._leaving:
            await asyncio.gather(*self._leaving, return_exceptions=True)
        for connection in self.seats.close():
            with contextlib.suppress(Exception):
                await connection.close()

    async def _checkout(self) -> Any | None:
        free, connection = self.seats.take()
        if not free or connection is not None:
            return connection
        opened: Any = None
        try:
            fairy = await greenlet_spawn(self._engine.sync_engine.raw_connection)
            opened = fairy.driver_connection  # psycopg.AsyncConnection
            fairy.detach()  # ours: it never goes back to the pool
            await opened.set_autocommit(True)
            return opened
        except Exception as error:
            await self._discard(opened)
            logger.warning("could not open a connection to queue on (%s)", error)
            return None

    async def _checkin(self, connection: Any) -> None:
        extra = self.seats.give_back(connection)
        if extra is not None:
            with contextlib.suppress(Exception):
                await extra.close()

    async def _discard(self, connection: Any | None) -> None:
        self.seats.give_back(None)
        if connection is not None:
            with contextlib.suppress(Exception):
                await connection.close()
