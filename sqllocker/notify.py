"""Waking PostgreSQL waiters the moment a lock is released, instead of when a poll timer fires.

The table's DELETE trigger sends ``NOTIFY sqllocker_<table>, lockstring`` when a row is deleted
(release, purge, an operator's DELETE) while waiters are queued for its lockstring. Each Locker
keeps one listening connection, on one thread, shared by all its waiters. A waiter registers
*before* each attempt, so a release that happens between its refused attempt and its sleep
still wakes it.

Each notification wakes the longest-waiting waiter of that lockstring in this process, not all
of them: the others would only stampede the row and be refused again. Waiters still wake by
themselves when the holder's row is due to expire, and at a slow fallback poll, so a lost
notification (the listening connection dropped, or the server's notification queue filling
up) costs latency, never correctness.

The trigger may instead hand the row to the head of the lockstring's queue, and say so on a
second channel, ``sqllocker_<table>_granted``, with the new row's id: the head of
that lockstring's queue is found by the SHA-256 of its guid, given the Grant and woken, and
believes it only once it has read the row back under its own guid (``LockOperations.claim_grant``).
A notification proves nothing: any role that can connect can send one.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import threading
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from sqlalchemy.engine import Engine

from . import forks

logger = logging.getLogger("sqllocker")

# How long the listener blocks in one read before checking whether it should stop.
_READ_SECONDS = 1.0


Event = TypeVar("Event", threading.Event, asyncio.Event)


@dataclass(frozen=True)
class Grant:
    """What a hand-off notification claims: a release inserted row ``lock_id`` for the head of
    a queue whose guid has the SHA-256 ``digest``. To be read back before it is believed."""

    lock_id: int
    digest: str


def guid_digest(guid: str) -> str:
    """What a grant's notification names its head by: the SHA-256 of its guid, in hex, as the
    release trigger computes it. It tells the head's listener which waiter to wake, and gives
    the guid itself away to nobody."""
    return hashlib.sha256(guid.encode()).hexdigest()


def parse_grant(payload: str) -> Grant | None:
    """The Grant in a ``sqllocker_<table>_granted`` payload (``<id> <digest>``), or None if it
    is not one."""
    lock_id, _, digest = payload.partition(" ")
    try:
        return Grant(int(lock_id), digest)
    except ValueError:
        logger.warning("ignored a malformed hand-off notification: %r", payload[:100])
        return None


class Waiter(Generic[Event]):
    """One registration: set when a release of its lockstring may have made it free, or, for
    the head of the lockstring's queue (``digest``: of its guid), when a release says it
    handed it the row (then ``grant`` says which row)."""

    __slots__ = ("digest", "event", "grant", "lockstring")

    def __init__(self, lockstring: str, event: Event, digest: str | None = None) -> None:
        self.lockstring = lockstring
        self.event: Event = event
        self.digest = digest
        self.grant: Grant | None = None


class WaiterQueues:
    """The registered waiters of one listener, per lockstring, oldest first (shared by the
    thread and the asyncio listeners; the lock is never held across a wait)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: dict[str, deque[Waiter[Any]]] = defaultdict(deque)
        self._heads: dict[str, Waiter[Any]] = {}

    def add(self, waiter: Waiter[Event]) -> Waiter[Event]:
        with self._lock:
            self._waiters[waiter.lockstring].append(waiter)
            if waiter.digest is not None:
                self._heads[waiter.digest] = waiter
        return waiter

    def remove(self, waiter: Waiter[Any]) -> None:
        with self._lock:
            if waiter.digest is not None and self._heads.get(waiter.digest) is waiter:
                del self._heads[waiter.digest]
            queue = self._waiters.get(waiter.lockstring)
            if queue is not None:
                with contextlib.suppress(ValueError):  # already woken and removed
                    queue.remove(waiter)
                if not queue:
                    del self._waiters[waiter.lockstring]

    def step_aside(self, waiter: Waiter[Any]) -> None:
        """Remove ``waiter``, which stops listening in order to queue for its lockstring, and
        hand a release that already woke it on to the next waiter. It acts on nothing until
        it heads the queue itself; the waiter that does head it (registered after this one,
        when its turn came) would otherwise sleep through the release."""
        self.remove(waiter)
        if waiter.event.is_set():
            self.wake_first(waiter.lockstring)

    def wake_first(self, lockstring: str) -> None:
        with self._lock:
            queue = self._waiters.get(lockstring)
            if queue:
                queue.popleft().event.set()
                if not queue:
                    del self._waiters[lockstring]

    def hand_over(self, grant: Grant) -> bool:
        """Give ``grant`` to the head it names, if it is registered here, and wake it; False if
        it is not (it is between two attempts, or in another process)."""
        with self._lock:
            waiter = self._heads.pop(grant.digest, None)
            if waiter is None:
                return False
            waiter.grant = grant
            waiter.event.set()
            return True

    def wake_everyone(self) -> None:
        with self._lock:
            for queue in self._waiters.values():
                for waiter in queue:
                    waiter.event.set()
            self._waiters.clear()
            self._heads.clear()


def channel_for(table: str) -> str:
    """The NOTIFY channel of ``table``'s DELETE trigger."""
    return f"sqllocker_{table}"


def grants_channel_for(table: str) -> str:
    """The NOTIFY channel on which the DELETE trigger says it handed a row to a queue's head."""
    return f"sqllocker_{table}_granted"


class ReleaseListener:
    """One LISTEN connection per Locker, and the waiters it wakes."""

    def __init__(self, engine: Engine, table: str) -> None:
        self._engine = engine
        self.channel = channel_for(table)
        self.grants_channel = grants_channel_for(table)
        self._lock = threading.Lock()
        self._waiters = WaiterQueues()
        self._thread: threading.Thread | None = None
        self._listening = threading.Event()
        self._stopping = False
        self._pid = forks.pid
        self.notifications = 0
        self.grants = 0

    def register(self, lockstring: str, digest: str | None = None) -> Waiter[threading.Event]:
        """Subscribe to ``lockstring``'s next release, and, for the head of its queue (the
        ``digest`` of its guid), to a hand-off of its row; call before the acquire attempt."""
        self._ensure_listening()
        return self._waiters.add(Waiter(lockstring, threading.Event(), digest))

    def unregister(self, waiter: Waiter[threading.Event]) -> None:
        self._waiters.remove(waiter)

    def step_aside(self, waiter: Waiter[threading.Event]) -> None:
        """``unregister`` for a waiter about to queue: see ``WaiterQueues.step_aside``."""
        self._waiters.step_aside(waiter)

    def stop(self) -> None:
        self._stopping = True
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(_READ_SECONDS * 3)

    # -- the listening thread ------------------------------------------------------------------

    def _ensure_listening(self) -> None:
        if self._pid != forks.pid:  # a forked child listens on a connection of its own
            self._pid, self._thread, self._stopping = forks.pid, None, False
            self._listening.clear()
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._listening.clear()
                self._thread = threading.Thread(
                    target=self._listen, name=f"sqllocker-listen-{self.channel}", daemon=True
                )
                self._thread.start()
        # Subscribed before the caller's attempt, or not at all (then it polls): never a
        # registration that silently misses the release.
        self._listening.wait(5)

    def _listen(self) -> None:
        while not self._stopping:
            try:
                self._listen_once()
            except Exception as error:  # the connection dropped: reconnect after a pause
                self._listening.clear()
                logger.warning("release notifications interrupted (%s); reconnecting", error)
                self._waiters.wake_everyone()  # they may have missed a release meanwhile
                if not self._stopping:
                    threading.Event().wait(1.0)

    def _listen_once(self) -> None:
        fairy = self._engine.raw_connection()
        connection: Any = fairy.driver_connection
        fairy.detach()  # ours for good: it never goes back to the pool
        try:
            connection.autocommit = True
            connection.execute(f'LISTEN "{self.channel}"')
            connection.execute(f'LISTEN "{self.grants_channel}"')
            self._listening.set()
            while not self._stopping:
                for notice in connection.notifies(timeout=_READ_SECONDS):
                    self.notifications += 1
                    if notice.channel == self.channel:
                        self._waiters.wake_first(notice.payload)
                    elif (grant := parse_grant(notice.payload)) is not None:
                        self.grants += self._waiters.hand_over(grant)
        finally:
            self._listening.clear()
            connection.close()
