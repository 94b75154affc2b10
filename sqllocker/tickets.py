"""Every waiter takes a ticket, and waiters are served in the order of their tickets.

A waiter refused the row takes a ticket for its lockstring: a row of ``<table>_requests``
numbered in the order waiters came. It holds no connection while it waits.

A ticket is live while its Locker's listening connection holds the ticket's *liveness key*
(``AsyncReleaseListener``): on PostgreSQL a session advisory lock, on MySQL/MariaDB a
``GET_LOCK`` name (``backends.mysql.liveness_name``), taken once per session. A Locker whose
process died, or whose connection dropped, leaves only dead tickets, which nobody waits behind
and the purge sweeps. When the listener reconnects it holds a new key, and every waiter of that
Locker takes a new ticket, one after another in the order of their old ones: each waits until
the waiter ahead of it in its Locker's line has its new ticket.

**PostgreSQL hands the row over.** A ticket there also holds what a release needs to insert
the waiter's row for it (guid, holder details, expiry period; the table's ``queue_join``). The
release's trigger inserts the row for the lowest live ticket in the release's own transaction,
deletes that ticket, and says so by NOTIFY with the new row's id, the SHA-256 of the waiter's
guid (which finds the waiter) and the row's times, signed with a key the waiter gave with its
ticket (``notifications.GrantKey``), which only the trigger can read: anyone who can connect
can send a NOTIFY, but only the trigger can sign one, so the waiter believes a grant signed
with its key without reading its row back (``holding.signed_grant``). A waiter takes a new
key with each ticket but one that replaces a ticket whose join failed (which a release may
have granted the row to): a ticket whose row it gave back (``queue_leave``) took its key along.

A release cannot always grant: the id-order key it needs may be held by an acquirer's INSERT,
or the holder's row may expire instead of being released. So the first waiter of each Locker
(below) also tries the row at a slow backoff, and at the moment the holder's row can be taken
over.

**MySQL/MariaDB polls.** There is no trigger that can insert into its own table, and no NOTIFY:
the first waiter of each Locker polls the row, reading it before any INSERT, at a quarter of
the age of the hold it waits out (``Backoff.heading``). It gives its ticket up once the row is
its own, in the background.

Either way only the waiter with the lowest ticket of its Locker for a lockstring
(``LocalLine.first``) sends anything; the others wait without a statement until they are first,
or are handed the row. Its INSERT is refused while any live ticket lower than its own stands
(``anyone_ahead``), and a newcomer's first attempt while any live ticket stands at all
(``NEWCOMER``), so that nobody takes the row ahead of those already waiting, however many
there are and however long each holds the row.

A live ticket whose waiter has stopped (its process stopped while its listener's connection
lives) is handed the row by the next release on PostgreSQL, which then stays held until it
expires; and while the row is free, the first waiter behind such a ticket takes the row anyway
once it has found it so for ``PATIENCE``.

A ticket taken on a connection that dropped before its answer came back may stand all the same,
live, ahead of everyone. A waiter that takes a ticket again (``LockOperations.join_line``
retrying, or its next attempt after a failed one) first gives up every ticket of its guid; and
one that claims a row after that gives up the ticket it holds, as a release may have handed the
row to the earlier one. A give-up that fails (the connection lost as it was sent) is tried again
every ``GIVE_UP_AGAIN`` seconds (by guid, where the waiter never learnt its ticket's number),
for as long as the ticket may live: while the listener's session that keeps it alive lasts and
its Locker is open. A ticket taken for dead with its listener's connection may live on all the
same, in the old session on a server that has not noticed its client gone (PostgreSQL ends
such a session by its own keepalives, which the listener sets, within seconds): a waiter whose
ticket died so gives up every ticket of its guid as its call ends.

The ticket decides only who is *handed* the row and who may *try* for it; who holds it is
decided by the row alone, as always. A lost notification, a dropped listener or a ticket
inserted by someone else costs latency, never safety.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from .errors import LockBusy

# The gate of a newcomer's first attempt: no live ticket may stand at all (the largest bigint).
NEWCOMER = 2**63 - 1
# How long the first of a Locker's waiters finds the row free yet is refused by a live ticket
# ahead before it takes the row anyway: that ticket's waiter is not trying (its process was
# stopped, by Ctrl-Z or a debugger, while its Locker's listener lives on), and would keep
# everyone behind it from a free row for as long as it stays stopped.
PATIENCE = 1.0
# How often a waiter that is not first in its Locker's line looks whether it has become first,
# or its listener has reconnected, should a wake-up have been missed: no statement is sent.
LOOK_AGAIN = 1.0
# Seconds between the attempts to give up a ticket whose give-up failed, and how many are made:
# a database that is away longer has, as a rule, ended the listener's session too.
GIVE_UP_AGAIN = 1.0
GIVE_UP_ATTEMPTS = 60
# How long a waiter that stops waiting (its wait over, cancelled, an error) waits for its
# ticket's give-up before it goes on, the give-up left to end (or fail, and be tried again) in
# the background: on a frozen server or pooler it would not end (libpq), nor would the wait.
GIVE_UP_PATIENCE = 5.0


def new_hold(busy: LockBusy | None, previous: LockBusy | None) -> bool:
    """Whether a refusal by ``busy`` met a hold the waiter's previous refusal (``previous``)
    had not: where the first waiter polls (MySQL), its polls are paced by the age of the hold
    it waits out (``Backoff.heading``)."""
    if busy is None:
        return False
    return previous is None or busy.lock_id != previous.lock_id


@dataclass(frozen=True)
class Ticket:
    """A waiter's place: ``number`` in ``lockstring``'s line, alive while ``liveness_key`` is
    held by its Locker's listener."""

    lockstring: str
    number: int
    liveness_key: int


@dataclass(eq=False)
class _Place:
    number: int
    wake: Callable[[], None] | None = field(default=None)


class LocalLine:
    """The tickets of one Locker's waiters, per lockstring, lowest first: only the first of
    each line tries the row, and it wakes the next as it leaves (shared by the thread and the
    asyncio Lockers; the lock is never held across a wait)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lines: dict[str, list[_Place]] = {}
        self.passed = 0  # waiters that took a free row past a live ticket ahead (PATIENCE)

    def join(self, ticket: Ticket) -> None:
        with self._lock:
            line = self._lines.setdefault(ticket.lockstring, [])
            bisect.insort(line, _Place(ticket.number), key=lambda place: place.number)

    def waiting(self, lockstring: str) -> bool:
        """Whether any waiter of this Locker holds a ticket for ``lockstring``."""
        with self._lock:
            return lockstring in self._lines

    def first(self, ticket: Ticket) -> bool:
        """Whether ``ticket`` is first in its line (or not in it)."""
        with self._lock:
            line = self._lines.get(ticket.lockstring)
            return not line or line[0].number == ticket.number

    def wake_first(self, lockstring: str) -> None:
        """Wake the first waiter in ``lockstring``'s line, if it watches."""
        with self._lock:
            line = self._lines.get(lockstring)
            wake = line[0].wake if line else None
        if wake is not None:
            wake()

    def watch(self, ticket: Ticket, wake: Callable[[], None]) -> bool:
        """Whether ``ticket`` is first in its line now; if not, ``wake`` is called once it is."""
        with self._lock:
            line = self._lines.get(ticket.lockstring, [])
            for index, place in enumerate(line):
                if place.number == ticket.number:
                    place.wake = wake
                    return index == 0
            return True  # not in line (never happens): behave as the first, which tries

    def leave(self, ticket: Ticket, wake_next: bool = True) -> None:
        """Take ``ticket`` out of its line; wake the next if it was first (and ``wake_next``)."""
        with self._lock:
            line = self._lines.get(ticket.lockstring)
            if not line:
                return
            first = line[0].number == ticket.number
            line[:] = [place for place in line if place.number != ticket.number]
            if not line:
                del self._lines[ticket.lockstring]
                return
            wake = line[0].wake if first and wake_next else None
        if wake is not None:
            wake()

    def __len__(self) -> int:
        with self._lock:
            return sum(len(line) for line in self._lines.values())
