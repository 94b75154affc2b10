"""Waking PostgreSQL waiters the moment a lock is released, instead of when a poll timer fires.

Each Locker keeps one listening connection, on one thread (or task), shared by all its waiters.
A release of a lockstring for which waiters hold tickets (``sqllocker.tickets``) hands the row
to the first live ticket, and says so on ``sqllocker_<table>_granted`` with the new row's id:
its waiter is found by the SHA-256 of its guid, given the Grant and woken. Any role that can
connect can send a notification, so one proves nothing by itself: the waiter believes it only
if it is signed with the key of its own ticket (``GrantKey``; the key is in the owner-only
requests table, and only the release trigger can sign with it), and reads the row back under
its own guid where a grant is not signed at all (``LockOperations.claim_grant``).

When the release cannot hand the row over, its trigger sends ``NOTIFY sqllocker_<table>,
lockstring`` instead, which wakes the waiters that try the row: in each Locker the first of its
waiters for that lockstring, and newcomers not yet in line. A waiter registers *before* each
attempt, so a release that happens between its refused attempt and its sleep still wakes it.
Waiters still wake by themselves when the holder's row is due to expire, and at a slow fallback
poll, so a lost notification (the listening connection dropped, or the server's notification
queue filling up) costs latency, never correctness.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import os
import threading
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, TypeVar

logger = logging.getLogger("sqllocker")

Event = TypeVar("Event", threading.Event, asyncio.Event)


@dataclass(frozen=True)
class Signed:
    """What a grant's notification says besides the row's id, signed by the release trigger
    with the ticket's key: when the ticket was taken and the new row's times, by the server's
    clock (``message``: the text signed; ``mac``: its HMAC-SHA256 in hex, as sent)."""

    joined: datetime
    created: datetime
    expires: datetime
    message: bytes
    mac: str


@dataclass(frozen=True)
class Grant:
    """What a hand-off notification claims: a release inserted row ``lock_id`` for the head of
    a queue whose guid has the SHA-256 ``digest``. Believed only if ``signed`` with the key
    its head gave with its ticket (``GrantKey.signed``), or once read back from the table where
    it is not signed at all (a ticket taken without a key)."""

    lock_id: int
    digest: str
    signed: Signed | None = None


def guid_digest(guid: str) -> str:
    """What a grant's notification names its head by: the SHA-256 of its guid, in hex, as the
    release trigger computes it. It tells the head's listener which waiter to wake, and gives
    the guid itself away to nobody."""
    return hashlib.sha256(guid.encode()).hexdigest()


def _utc(text: str) -> datetime:
    """A grant's UTC time (``YYYY-MM-DDTHH:MM:SS.ffffff``, no offset), aware: parsed with its
    offset in one call (a text that has one already is malformed)."""
    return datetime.fromisoformat(text + "+00:00")


def grant_digest(payload: str) -> str | None:
    """The digest a ``sqllocker_<table>_granted`` payload names its head by, read without
    parsing the rest: every listener hears every grant, and most name another's waiter."""
    fields = payload.split(" ", 2)
    return fields[1] if len(fields) > 1 else None


def parse_grant(payload: str) -> Grant | None:
    """The Grant in a ``sqllocker_<table>_granted`` payload, or None if it is not one: ``<id>
    <digest>`` (unsigned), or ``<id> <digest> <joined> <created> <expires> <hmac>``, the times
    UTC to the microsecond (signed: see migration 0003)."""
    fields = payload.split(" ")
    try:
        if len(fields) == 2:
            return Grant(int(fields[0]), fields[1])
        if len(fields) == 6:
            signed = Signed(
                _utc(fields[2]),
                _utc(fields[3]),
                _utc(fields[4]),
                payload[: payload.rindex(" ")].encode(),
                fields[5],
            )
            return Grant(int(fields[0]), fields[1], signed)
    except ValueError:
        pass
    logger.warning("ignored a malformed hand-off notification: %r", payload[:100])
    return None


# HMAC's pads as byte tables: each byte of the padded key XOR 0x36 (inner) or 0x5C (outer).
_INNER_PAD = bytes(byte ^ 0x36 for byte in range(256))
_OUTER_PAD = bytes(byte ^ 0x5C for byte in range(256))


class GrantKey:
    """A waiter's secret for the grants of its tickets: 32 random bytes, given to the ticket's
    ``queue_join`` as its HMAC-SHA256 pads (``pads``: ``K xor ipad || K xor opad``), kept by
    the server where only the table's owner can read it, and deleted with the ticket. Only the
    release trigger (which runs with the owner's rights) can sign a grant with it.

    ``since``: the monotonic time before the first ticket taken with it was sent (the conservative
    start of a grant's validity counts from it: ``sqllocker.operations.acquire.signed_grant``).
    """

    __slots__ = ("_key", "pads", "since")

    def __init__(self, since: float) -> None:
        self._key = os.urandom(32)
        padded = self._key.ljust(64, b"\0")
        self.pads = padded.translate(_INNER_PAD) + padded.translate(_OUTER_PAD)
        self.since = since

    def signed(self, signed: Signed) -> bool:
        """Whether ``signed`` bears this key's HMAC (compared in constant time)."""
        expected = hmac.new(self._key, signed.message, hashlib.sha256).hexdigest()
        return hmac.compare_digest(expected.encode(), signed.mac.encode())


class Waiter(Generic[Event]):
    """One registration: set when a release of its lockstring may have made it free (with
    ``releases``), or, for a waiter with a ticket (``digest``: of its guid), when a release says
    it handed it the row (then ``grant`` says which row)."""

    __slots__ = ("digest", "event", "grant", "lockstring", "releases")

    def __init__(
        self, lockstring: str, event: Event, digest: str | None = None, releases: bool = True
    ) -> None:
        self.lockstring = lockstring
        self.event: Event = event
        self.digest = digest
        self.releases = releases
        self.grant: Grant | None = None


class WaiterQueues:
    """The registered waiters of one listener: per lockstring those that follow its releases,
    and by digest those a grant may name (shared by the thread and the asyncio listeners; the
    lock is never held across a wait)."""

    def __init__(self, wake: Callable[[Any], None] | None = None) -> None:
        self._lock = threading.Lock()
        self._waiters: dict[str, deque[Waiter[Any]]] = defaultdict(deque)
        self._heads: dict[str, Waiter[Any]] = {}
        # How a waiter's event is set (the sync listener's may leave it to its own thread).
        self._wake: Callable[[Any], None] = wake or _set

    def add(self, waiter: Waiter[Event]) -> Waiter[Event]:
        with self._lock:
            if waiter.releases:
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

    def follow_releases(self, waiter: Waiter[Any]) -> None:
        """Wake ``waiter``, registered without ``releases``, on its lockstring's releases too."""
        with self._lock:
            if not waiter.releases:
                waiter.releases = True
                self._waiters[waiter.lockstring].append(waiter)

    def wake_all(self, lockstring: str) -> None:
        """Wake the waiters following ``lockstring``'s releases: in a Locker, the first of its
        waiters with a ticket, and newcomers between their first attempt and their ticket."""
        with self._lock:
            queue = self._waiters.pop(lockstring, None)
            for waiter in queue or ():
                self._wake(waiter.event)

    def names_a_head(self, digest: str | None) -> bool:
        """Whether a head of ``digest`` is registered here now: a grant to anyone else is not
        parsed (``hand_over`` looks again, under the lock)."""
        return digest in self._heads

    def hand_over(self, grant: Grant) -> bool:
        """Give ``grant`` to the head it names, if it is registered here, and wake it; False if
        it is not (it is between two attempts, or in another process)."""
        with self._lock:
            waiter = self._heads.pop(grant.digest, None)
            if waiter is None:
                return False
            waiter.grant = grant
            self._wake(waiter.event)
            return True

    def wake_everyone(self) -> None:
        with self._lock:
            for queue in self._waiters.values():
                for waiter in queue:
                    waiter.event.set()
            for waiter in self._heads.values():
                waiter.event.set()
            self._waiters.clear()
            self._heads.clear()


def _set(event: Any) -> None:
    event.set()


def channel_for(table: str) -> str:
    """The NOTIFY channel of ``table``'s DELETE trigger."""
    return f"sqllocker_{table}"


def leaders_channel_for(table: str) -> str:
    """The NOTIFY channel on which a writer of a read-write lock (an election's leader) says,
    with the name as payload, that it took or gave up ``name``: a hint to observers to read
    the leader's row again, never believed for itself (see ``sqllocker.elections``)."""
    return f"sqllocker_{table}_leaders"


def grants_channel_for(table: str) -> str:
    """The NOTIFY channel on which the DELETE trigger says it handed a row to a queue's head."""
    return f"sqllocker_{table}_granted"
