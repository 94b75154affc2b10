"""One connection per locker that keeps its waiters' tickets alive (``sqllocker.tickets``), and,
on PostgreSQL, wakes them on release (the design is in ``notifications.py``).

On PostgreSQL the connection listens on the table's channel (the DELETE trigger sends the
lockstring while waiters hold tickets) and on its grants channel (a hand-off to a ticket), and
holds the liveness key, a session advisory lock. On MySQL/MariaDB, which has no NOTIFY, it
holds the liveness key's ``GET_LOCK`` name, and looks every second that it still does. Waiters
register before each attempt, and still wake by themselves at their backoff or the holder's
expiry, so a dropped listening connection costs latency, never correctness.

Written once for asyncio (a task per locker); the sync ``sqllocker/listener.py`` (a thread per
locker) is generated from it (``tests/unasync.py``).
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from ..errors import LockError
from ..notifications import (
    Waiter,
    WaiterQueues,
    channel_for,
    grant_digest,
    grants_channel_for,
    leaders_channel_for,
    parse_grant,
)
from . import concurrency

if True:  # ASYNC
    import asyncio
    import contextlib
else:
    import threading

    from .. import forks
    from ..notice_reading import NoticeReader

logger = logging.getLogger("sqllocker")

# How long a waiter waits for the listener to subscribe before it polls instead.
SUBSCRIBE_SECONDS = 5.0
RECONNECT_SECONDS = 1.0
# How long the listening thread blocks in one read before checking whether it should stop; on
# MySQL, how often it looks that it still holds its liveness key.
READ_SECONDS = 1.0
# MySQL: how long that look may take before the connection is taken for lost (aiomysql has no
# read timeout of its own).
LOOK_SECONDS = 10.0
# How long a stopping Locker waits for its listener to end before cancelling it again.
STOP_RETRY_SECONDS = 0.5


class AsyncReleaseListener:
    """One connection per locker that holds its tickets' liveness key, LISTENs where releases
    hand over (``hands_over``), and the waiters it wakes."""

    def __init__(self, engine: AsyncEngine, table: str, hands_over: bool = True) -> None:
        self._engine = engine
        self.hands_over = hands_over
        self.channel = channel_for(table)
        self.grants_channel = grants_channel_for(table)
        self.leaders_channel = leaders_channel_for(table)
        if True:  # ASYNC
            self._waiters = WaiterQueues()
            self._observers = WaiterQueues()  # of elections, by name (``sqllocker.elections``)
        else:
            self._waiters = WaiterQueues(self._set)
            self._observers = WaiterQueues(self._set)  # of elections, by name
        self._listening = concurrency.Event()
        self._failing = False  # its last session ended in an error, and no new one has begun
        # The session advisory lock the listening connection holds: the liveness key of this
        # Locker's tickets (None while not listening).
        self.liveness_key: int | None = None
        self.notifications = 0
        self.grants = 0
        if True:  # ASYNC
            self._task: asyncio.Task[None] | None = None
        else:
            self._lock = threading.Lock()
            self._thread: threading.Thread | None = None
            self._stopping = False
            self._pid = forks.pid
            # The reads of the listening session, while there is one: a waiting thread takes
            # them over while it waits (``wait``).
            self._reader: NoticeReader | None = None

    async def register(
        self, lockstring: str, digest: str | None = None, releases: bool = True
    ) -> Waiter[concurrency.Event]:
        """Subscribe to ``lockstring``'s next release (with ``releases``), and, for a waiter
        with a ticket (the ``digest`` of its guid), to a hand-off of its row; call before the
        acquire attempt."""
        self._start_listening()
        # Subscribed before the caller's attempt, or (after a timeout) not at all, when the
        # caller's backoff polls: never a registration that silently misses the release. Not
        # waited for while the listener's last session failed (a server that refuses it would
        # make every attempt wait that long): the caller backs off, as if alone.
        if not self._failing:
            await concurrency.wait(self._listening, SUBSCRIBE_SECONDS)
        self._catch_up()
        return self._waiters.add(Waiter(lockstring, concurrency.Event(), digest, releases))

    async def wait(self, waiter: Waiter[concurrency.Event], seconds: float | None) -> None:
        """Until ``waiter`` is woken or ``seconds`` (None: no bound) have passed. A thread
        reads the listening connection itself meanwhile, unless another does (see
        ``sqllocker.notice_reading``): a hand-off to it wakes it without a hand from the
        listener's thread."""
        if True:  # ASYNC
            await concurrency.wait(waiter.event, seconds)
        else:
            reader = self._live_reader()
            if reader is None:
                concurrency.wait(waiter.event, seconds)
            else:
                reader.wait(waiter.event, seconds)

    def wake(self, waiter: Waiter[concurrency.Event]) -> None:
        """Wake ``waiter`` from another waiter of this Locker (its turn has come): a thread
        reading the listening connection while it waits hears of it at once."""
        if True:  # ASYNC
            waiter.event.set()
        else:
            self._set(waiter.event)

    if True:  # ASYNC
        pass
    else:

        def _live_reader(self) -> NoticeReader | None:
            """The reads of this process's listening session, if it has one now (a forked
            child's is not its parent's)."""
            return self._reader if self._pid == forks.pid else None

        def _set(self, event: threading.Event) -> None:
            """Set a waiter's ``event`` (see ``NoticeReader.wake``)."""
            reader = self._live_reader()
            if reader is None:
                event.set()
            else:
                reader.wake(event)

    def _catch_up(self) -> None:
        """Before a registration: a thread hands on the notices that came while nobody read
        (see ``sqllocker.notice_reading``); a task has nothing to do, its listener's task reads
        them as they come."""
        if True:  # ASYNC
            pass
        else:
            reader = self._live_reader()
            if reader is not None:
                reader.catch_up()

    def unregister(self, waiter: Waiter[concurrency.Event]) -> None:
        self._waiters.remove(waiter)

    async def observe(self, name: str) -> Waiter[concurrency.Event]:
        """Subscribe to the next notice that the election ``name``'s leader may have changed
        (PostgreSQL, ``hands_over``); call before reading the leader, then ``unobserve``."""
        self._start_listening()
        if not self._failing:
            await concurrency.wait(self._listening, SUBSCRIBE_SECONDS)
        self._catch_up()
        return self._observers.add(Waiter(name, concurrency.Event()))

    def unobserve(self, waiter: Waiter[concurrency.Event]) -> None:
        self._observers.remove(waiter)

    def follow_releases(self, waiter: Waiter[concurrency.Event]) -> None:
        """Wake ``waiter`` on its lockstring's releases too (see ``WaiterQueues``)."""
        self._waiters.follow_releases(waiter)

    if True:  # ASYNC

        def _start_listening(self) -> None:
            if self._task is None or self._task.done():
                self._listening.clear()
                self._task = asyncio.get_running_loop().create_task(
                    self._listen(), name=f"sqllocker: listen {self.channel}"
                )

        async def stop(self) -> None:
            task, self._task = self._task, None
            if task is None:
                return
            # A cancellation can be lost on its way (Python 3.11's wait_for drops one that
            # comes as the statement it waits for ends), and the task would listen on: it is
            # cancelled again until it has ended.
            while not task.done():
                task.cancel()
                await asyncio.wait({task}, timeout=STOP_RETRY_SECONDS)
            with contextlib.suppress(asyncio.CancelledError):
                await task

        def _listening_on(self) -> bool:
            return True  # until the task is cancelled

    else:

        def _start_listening(self) -> None:
            if self._pid != forks.pid:  # a forked child listens on a connection of its own
                self._pid, self._thread, self._stopping = forks.pid, None, False
                self._reader = None
                self._listening.clear()
            with self._lock:
                if self._thread is None or not self._thread.is_alive():
                    self._listening.clear()
                    self._thread = threading.Thread(
                        target=self._listen, name=f"sqllocker-listen-{self.channel}", daemon=True
                    )
                    self._thread.start()

        def stop(self) -> None:
            self._stopping = True
            thread = self._thread
            if thread is not None and thread is not threading.current_thread():
                thread.join(READ_SECONDS * 3)

        def _listening_on(self) -> bool:
            return not self._stopping

    async def _listen(self) -> None:
        while self._listening_on():
            try:
                await self._listen_once()
            except Exception as error:  # the connection dropped: reconnect after a pause
                self._failing = True
                logger.warning("the listening connection failed (%s); reconnecting", error)
            self._listening.clear()
            self._waiters.wake_everyone()  # they may have missed a release meanwhile
            self._observers.wake_everyone()
            if self._listening_on():
                await concurrency.sleep(RECONNECT_SECONDS)

    async def _listen_once(self) -> None:
        # MySQL's GET_LOCK is not transactional: its connection needs no autocommit.
        pooled = await concurrency.pooled_connection(self._engine, autocommit=self.hands_over)
        try:
            if self.hands_over:
                await self._listen_on(pooled.driver)
            else:
                await self._hold_liveness_on(pooled.driver)
        finally:
            self._listening.clear()
            self.liveness_key = None
            await pooled.close()

    async def _listen_on(self, connection: Any) -> None:
        """PostgreSQL: LISTEN, hold a liveness key, and hand each notification on."""
        from ..backends.postgresql import LISTENER_SESSION  # the dialect of the database in use

        await connection.execute(LISTENER_SESSION)
        await connection.execute(f'LISTEN "{self.channel}"')
        await connection.execute(f'LISTEN "{self.grants_channel}"')
        await connection.execute(f'LISTEN "{self.leaders_channel}"')
        self.liveness_key = await _hold_a_key(connection)
        if True:  # ASYNC
            self._failing = False
            self._listening.set()
            async for notice in connection.notifies():
                self._received(notice)
        else:
            for notice in connection.notifies(timeout=0):  # heard while subscribing
                self._received(notice)
            # There before a waiter is told that the listener listens: one that found none
            # would wait unheard, the listener's thread reading only once a second for it.
            # (And not before the notices above were read: a waiter would read beside it.)
            reader = self._reader = NoticeReader(connection, self._heard, READ_SECONDS)
            try:
                self._failing = False
                self._listening.set()
                reader.listen(self._listening_on)
            finally:
                reader.end()
                self._reader = None

    async def _hold_liveness_on(self, connection: Any) -> None:
        """MySQL: hold a liveness key's ``GET_LOCK`` name, looking every READ_SECONDS that the
        session still does; a look that fails ends the session (the caller reconnects)."""
        from ..backends.mysql import liveness_name  # the dialect of the database in use

        key = await _hold_a_name(connection)
        self.liveness_key = key
        self._failing = False
        self._listening.set()
        while self._listening_on():
            await concurrency.sleep(READ_SECONDS)
            look = ("SELECT IS_USED_LOCK(%s) = CONNECTION_ID()", (liveness_name(key),))
            if True:  # ASYNC
                row = await asyncio.wait_for(_fetch_one(connection, *look), LOOK_SECONDS)
            else:
                row = _fetch_one(connection, *look)
            if row is None or row[0] != 1:
                raise LockError("the liveness key's GET_LOCK name is no longer held")

    def _received(self, notice: Any) -> None:
        self._heard(notice.channel, notice.payload)

    def _heard(self, channel: str, payload: str) -> None:
        self.notifications += 1
        if channel == self.channel:
            self._waiters.wake_all(payload)
        elif channel == self.leaders_channel:
            self._observers.wake_all(payload)  # a hint: they read the row again
        elif not self._waiters.names_a_head(grant_digest(payload)):
            pass  # another's: every listener hears every grant
        elif (grant := parse_grant(payload)) is not None:
            self.grants += self._waiters.hand_over(grant)


async def _hold_a_key(connection: Any) -> int:
    """Take a session advisory lock on a random key nobody holds, on ``connection``: the
    liveness key of a listener's tickets."""
    while True:
        key = secrets.randbits(64) - 2**63
        cursor = await connection.execute(
            "SELECT pg_catalog.pg_try_advisory_lock(%s::bigint)", (key,)
        )
        row = await cursor.fetchone()
        if row is not None and row[0]:
            return key


async def _hold_a_name(connection: Any) -> int:
    """MySQL: take the ``GET_LOCK`` name of a random liveness key nobody holds, on
    ``connection`` (PyMySQL's or aiomysql's)."""
    from ..backends.mysql import liveness_name  # the dialect of the database in use

    while True:
        key = secrets.randbits(64) - 2**63
        row = await _fetch_one(connection, "SELECT GET_LOCK(%s, 0)", (liveness_name(key),))
        if row is not None and row[0] == 1:
            return key


async def _fetch_one(connection: Any, sql: str, params: tuple[Any, ...]) -> Any:
    """MySQL: the first row of ``sql`` on the driver's ``connection``."""
    if True:  # ASYNC
        cursor = await connection.cursor()
    else:
        cursor = connection.cursor()
    try:
        await cursor.execute(sql, params)
        return await cursor.fetchone()
    finally:
        await cursor.close()
