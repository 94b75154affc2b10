"""What the lock operations answer: a row of the table, an acquire won or refused, a ticket."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

from ..errors import LockBusy
from ..identity import public_details
from ..schema import FOREIGN_CLOCK_MARGIN


@dataclass(frozen=True)
class LockInfo:
    """One row of the lock table, as ``Locker.locks`` reports it."""

    lock_id: int
    lockstring: str
    created: datetime
    expires: datetime
    locked_by: dict[str, Any]
    # Expired by the server's clock; a row DBIx::Locker wrote, once its written expiry is past
    # in every time zone (``schema.FOREIGN_CLOCK_MARGIN``), as sqllocker takes it over.
    expired: bool
    seconds_left: float  # until the written expiry by the server's clock; negative once past
    # Written by DBIx::Locker (its guid is the column's default): its times are its client's
    # local times, so it is taken over or purged only once expired in every time zone.
    dbix_locker: bool = False
    # Created after the server's now: a client's clock, not the server's, wrote it (DBIx::Locker
    # east of UTC writes times hours ahead).
    created_in_future: bool = False

    @property
    def expiry_unknown(self) -> bool:
        """A DBIx::Locker row past its written expiry, not yet in every time zone: held, as far
        as any Locker knows, for a time nobody can say (its client's local time)."""
        return self.dbix_locker and not self.expired and self.seconds_left <= 0


def row_info(row: Any) -> LockInfo:
    seconds_left = (row.expires - row.server_now).total_seconds()
    dbix_locker = bool(row.dbix_locker)
    return LockInfo(
        lock_id=row.id,
        lockstring=row.lockstring,
        created=row.created,
        expires=row.expires,
        locked_by=public_details(row.locked_by),
        expired=bool(row.expired) and (not dbix_locker or seconds_left <= -FOREIGN_CLOCK_MARGIN),
        seconds_left=seconds_left,
        dbix_locker=dbix_locker,
        created_in_future=row.created > row.server_now,
    )


class Acquired:
    """Our row was inserted. ``created`` and ``expires`` may be as the driver read them (see
    ``Statements._returned``). ``age``: seconds the row had already existed, by the server's
    clock, when a hand-off notification's claim found it (``claim_grant``). A row an attempt
    finds under our guid (an earlier attempt's, whose answer was lost) is renewed by it
    first (``Attempt.learn_holder``): its expiry then counts from that attempt.

    ``sent_at``, set by ``try_acquire`` before it hands the Acquired on: the monotonic time the
    successful statement was sent, less ``age`` (for a grant signed by its release, the start
    ``holding.signed_grant`` proves). The lock's validity deadline counts from it (see
    ``lock.py``). Set on the one object rather than copied into a second, immutable one: the
    copy was a measurable share of the library's own Python in an uncontended cycle.
    """

    __slots__ = ("age", "created", "database", "expires", "lock_id", "sent_at", "took_over")

    def __init__(self, lock_id: int, created: object, expires: object, age: float = 0.0) -> None:
        self.lock_id = lock_id
        self.created = created
        self.expires = expires
        self.age = age
        self.sent_at = 0.0
        self.took_over = False  # an expired holder's row was replaced (sqllocker.telemetry)
        self.database = 0  # in memory: the database it is in (``DatabaseInMemory.number``)


class Joined(NamedTuple):
    """A ticket taken (``WaitingLine.join_line``): its number; whether the row is held;
    whether an earlier ticket of the same waiter may have been taken too, whose answer was
    lost. Given up before this one was taken, that one may have been handed the row first
    (PostgreSQL): a waiter that claims a row cannot then tell which of its tickets it was."""

    ticket: int
    held: bool
    replaced: bool


@dataclass(frozen=True)
class Refused:
    """Someone else holds the lockstring (``busy``), or contention refused us without a holder to
    name (``busy`` None); ``server_now`` is the database's time as of the refusal."""

    busy: LockBusy | None
    server_now: datetime | None

    def busy_after(self, lockstring: str, wait: float | None) -> LockBusy:
        """The LockBusy for a caller who tried (and, with ``wait``, waited) in vain."""
        busy = self.busy
        return LockBusy(
            lockstring,
            holder=busy.holder if busy else None,
            lock_id=busy.lock_id if busy else None,
            created=busy.created if busy else None,
            expires=busy.expires if busy else None,
            waited=0.0 if wait is None else wait,
            key_holder_pid=busy.key_holder_pid if busy else None,
        )
