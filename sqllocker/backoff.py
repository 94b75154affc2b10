"""How a refused acquirer waits before trying again.

Capped exponential backoff with full jitter, so that waiters spread out instead of stampeding
the row together after each release, and a wake-up at the moment the holder's row can be taken
over (its ``expires`` plus grace, by the server's clock as of the refusal), so a crashed holder
is replaced on time without polling fast for the whole wait.

A waiter with a ticket on PostgreSQL (see ``sqllocker.tickets``) is handed the row by the
release, and told so by its NOTIFY: its timer then guards only against a lost notification,
and waits the longest delay. On MySQL the first waiter of each Locker polls the row, paced by
the age of the hold it waits out.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .tickets import new_hold

if TYPE_CHECKING:
    from .errors import LockBusy
    from .operations import Refused

# How long a waiter in the kernel's queue (SQLite: ``sqllocker.file_queue``) waits for its turn
# before it looks at the row (a read): whoever holds the place ahead may have stopped, or had
# its row broken by an operator's SQL.
QUEUE_PATIENCE = 0.5
# A queued waiter that finds the row free while the place ahead is held waits this long for
# its turn before it looks again: the place is most likely the next waiter's, about to insert.
FREE_ROW_PATIENCE = 0.1
FIRST_DELAY = 0.002
HEAD_FIRST_DELAY = 0.00025
# A polling head waits at most this share of the time it has headed the queue between polls:
# doubling its delay instead, it learned of a release up to as late again as the hold it waited
# through had lasted, and a turn of a short hold cost twice the hold.
HEAD_POLL_SHARE = 0.25
MAX_DELAY = 0.25
# Doublings of the first delay enough to pass any delay: past them the ceiling stays.
_DOUBLINGS = 32


@dataclass
class Backoff:
    """The delays of one waiting acquirer; ``deadline`` is monotonic, ``None`` for forever."""

    deadline: float | None
    first_delay: float = FIRST_DELAY
    max_delay: float = MAX_DELAY
    attempts: int = field(default=0, init=False)
    awaiting_hand_off: bool = field(default=False, init=False)
    heading_since: float | None = field(default=None, init=False)  # monotonic

    @classmethod
    def for_wait(cls, wait: float | None) -> Backoff:
        return cls(deadline=None if wait is None else time.monotonic() + wait)

    def remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def await_hand_off(self) -> None:
        """From now on a release hands the row over and says so. An attempt made meanwhile is
        a wasted round trip, and one that meets the release holds the lockstring's id-order
        lock just then, so that the release's trigger leaves the row to that INSERT instead of
        handing it over (most turns under contention, once holds lasted a few ms)."""
        self.awaiting_hand_off = True

    def heading(self) -> None:
        """From now on this waiter polls the row as the first of its Locker's line (MySQL's
        tickets), through a hold that began about now: from a shorter first delay, as the next
        turn is most likely soon, and then at intervals that grow with the age of the hold
        (HEAD_POLL_SHARE of it), more slowly than a newcomer's backoff."""
        self.attempts = 0
        self.first_delay = HEAD_FIRST_DELAY
        self.heading_since = time.monotonic()

    def expired(self) -> bool:
        remaining = self.remaining()
        return remaining is not None and remaining <= 0

    def next_delay(self, until_takeable: float | None = None) -> float:
        """Seconds to sleep before the next attempt (0 if the deadline has passed), no longer
        than ``until_takeable`` (``Backoff.until_takeable``) and a first delay."""
        if self.awaiting_hand_off:
            ceiling = self.max_delay
        elif self.heading_since is not None:
            headed = time.monotonic() - self.heading_since
            ceiling = min(self.max_delay, max(self.first_delay, headed * HEAD_POLL_SHARE))
        else:
            # (The exponent capped: a float overflows past 2**1023, about 1,000 attempts on.)
            ceiling = min(self.max_delay, self.first_delay * 2 ** min(self.attempts, _DOUBLINGS))
        self.attempts += 1
        delay = random.uniform(ceiling / 2, ceiling)
        if until_takeable is not None:
            # Sleep no longer than until the holder's row becomes takeable.
            delay = min(delay, until_takeable + self.first_delay)
        remaining = self.remaining()
        return delay if remaining is None else min(delay, remaining)

    def turn_patience(self, until_free: float | None) -> float:
        """How long a waiter queued behind others waits for its turn before it looks at the
        row: ``QUEUE_PATIENCE``, or less if the row as last read (``until_free``: seconds until
        it can be taken over, 0 if free; None if unknown) can be taken sooner, but at least
        ``FREE_ROW_PATIENCE``; never past the deadline. Whoever holds the place may not hold
        the row: a holder that stopped, that overran its expiry, or whose row was broken,
        keeps its place until it learns its lock is lost, while the row passes to waiters
        that find it free or takeable."""
        patience = QUEUE_PATIENCE
        if until_free is not None:
            patience = min(patience, max(until_free + self.first_delay, FREE_ROW_PATIENCE))
        remaining = self.remaining()
        return patience if remaining is None else min(patience, remaining)

    @staticmethod
    def until_takeable(refused: Refused, grace: float) -> float | None:
        """Seconds until the row that refused us can be taken over; None if unknown, or if it
        refused us past that time (a DBIx::Locker row, taken over only once expired in every
        time zone)."""
        busy, server_now = refused.busy, refused.server_now
        if busy is None or busy.expires is None or server_now is None:
            return None
        until = (busy.expires - server_now).total_seconds() + grace
        return until if until > 0 else None

    def after_refusal(
        self, refused: Refused, lockstring: str, wait: float | None, grace: float
    ) -> float:
        """After a refused attempt at ``lockstring``: the delay before the next, or, once the
        wait is over, the LockBusy to raise (it names the holder the refusal met)."""
        if self.expired():
            held = refused.busy.lockstring if refused.busy is not None else None
            raise refused.busy_after(held or lockstring, wait)
        return self.next_delay(self.until_takeable(refused, grace))

    def sleep(self, delay: float) -> None:
        if delay > 0:
            time.sleep(delay)


class WakePacing:
    """The pace of a waiter's attempts where a release's notification wakes it (PostgreSQL),
    which anyone who can connect can send: each attempt refused by the hold that refused the
    one before (no release came, or none that changed the holder) makes the next wait a little
    longer, doubling up to ``MAX_DELAY``, while a forged flood of notifications would have the
    waiter try thousands of times a second. A new holder, or a row handed over, is no such
    wake-up, and the pace starts again."""

    __slots__ = ("_not_before", "_pace")

    def __init__(self) -> None:
        self._pace = 0.0
        self._not_before = 0.0  # monotonic

    def pause(self) -> float:
        """Seconds to wait before the next attempt."""
        return max(0.0, self._not_before - time.monotonic())

    def refused(self, busy: LockBusy | None, previous: LockBusy | None) -> None:
        """After an attempt refused by ``busy``, the previous refusal's ``previous``."""
        if busy is None or new_hold(busy, previous):
            self._pace = 0.0
            return
        self._pace = min(MAX_DELAY, max(FIRST_DELAY, self._pace * 2))
        self._not_before = time.monotonic() + self._pace
