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

logger = logging.getLogger("sqllocker")

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
