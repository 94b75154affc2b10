# Generated from sqllocker/asyncio/ticket_wait.py by tests/unasync.py: edit that file, then
# run `python -m tests.unasync`.
"""Waiting for a lock in line by ticket, where waiters take tickets (PostgreSQL and MySQL/MariaDB:
see ``sqllocker.tickets``), with the listener that keeps a locker's tickets alive.

Written once for asyncio; the sync ``sqllocker/ticket_wait.py`` is generated from it
(``tests/unasync.py``).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any

from sqlalchemy.engine import Engine

from . import clock, concurrency, deadlines, tickets
from .acquiring import Winnings
from .attempts import Attempts, wait_out
from .backoff import Backoff, WakePacing
from .errors import DatabaseError
from .holding import OnLost, signed_grant
from .listener import ReleaseListener
from .lock import Call, Lock
from .notifications import Grant, GrantKey, guid_digest
from .operations import Acquired, LockOperations, Refused
from .tickets import LOOK_AGAIN, NEWCOMER, LocalLine, Ticket

logger = logging.getLogger("sqllocker")


class TicketWait:
    """The waits of a locker's waiters in line by ticket for the rows of ``table_name`` on
    ``engine``: ``attempts`` at the rows, tickets taken and given up through ``operations``
    (run by ``run``); a row expired for ``grace`` seconds may be taken over.

    ``listener``: the connection that keeps the tickets alive, once a waiter needed it;
    ``line``: this locker's waiters' tickets; ``leaving``: the give-ups tried again in the
    background, which ``closing`` ends.
    """

    def __init__(
        self,
        attempts: Attempts,
        operations: LockOperations,
        run: Call,
        engine: Engine,
        table_name: str,
        grace: float,
    ) -> None:
        self._attempts = attempts
        self._operations = operations
        self._call = run
        self._engine = engine
        self._table_name = table_name
        self._grace = grace
        self._setup_lock = threading.Lock()  # never held across a wait
        self.listener: ReleaseListener | None = None
        self.line = LocalLine()  # the tickets of this Locker's waiters
        self.leaving = concurrency.Background("sqllocker-ticket-leaver")
        self.closing = concurrency.Event()  # set by close: ends the give-ups tried again

    def close(self) -> None:
        """End the give-ups tried again, and stop listening."""
        self.closing.set()
        self.leaving.close()
        if self.listener is not None:
            self.listener.stop()

    def release_listener(self) -> ReleaseListener | None:
        """The connection that keeps this Locker's tickets alive (and, on PostgreSQL, wakes
        its waiters on NOTIFY), where waiters take tickets; None where they back off."""
        if not self._operations.waits_by_ticket:
            return None
        with self._setup_lock:
            if self.listener is None:
                self.listener = ReleaseListener(
                    self._engine, self._table_name, self._operations.hands_over
                )
            return self.listener

    def wait(
        self,
        winnings: Winnings,
        listener: ReleaseListener,
        lockstring: str,
        guid: str,
        details: dict[str, Any],
        ttl: float,
        wait: float | None,
        on_lost: OnLost | None,
    ) -> Lock:
        """``_wait_for`` where waiters take tickets: refused, a waiter takes a ticket; on
        PostgreSQL a release hands it the row when its turn comes, and the first of this
        Locker's waiters for the row also tries it now and then; on MySQL that first waiter
        polls the row, at a quarter of the age of the hold it waits out (see
        ``sqllocker.tickets``). While the listener reconnects, a waiter keeps its ticket,
        dead now, and tries by it; one without a ticket backs off and tries, as if alone."""
        backoff = Backoff.for_wait(wait)
        polls = not listener.hands_over  # the first waiter polls the row (MySQL)
        digest = guid_digest(guid)  # what a release's grant names this waiter by
        line = self.line
        ticket: Ticket | None = None
        refused = Refused(None, None)  # the last refusal, which LockBusy names
        # The first attempt: not ahead of anyone waiting. Where a waiter of this Locker holds a
        # ticket already, it would be refused: take a ticket at once.
        gate: int | None = None if line.waiting(lockstring) else NEWCOMER
        try_now = True
        wakes = WakePacing()  # attempts woken by notifications anyone can send
        free_since: float | None = None  # in line, refused a free row by a ticket ahead
        # A join failed, and may have taken a ticket all the same, kept alive by this key.
        unsure: int | None = None
        # What a release signs its grant to our ticket with: a new one for each ticket, but
        # for one that replaces a ticket whose join failed (that one may have been granted).
        grant_key: GrantKey | None = None
        doubled = False  # a ticket of ours may have been handed a row ahead of ``ticket``
        rejoining = False  # our dead ticket given up, the next of our line not yet woken
        outlived = False  # a ticket of ours died with the listener's session (see below)
        dead_standing = False  # and its give-up failed: it may live on (see below)
        outcome: Lock | None = None  # ours, once won by an attempt or handed over
        try:
            while True:
                if (
                    ticket is not None
                    and listener.liveness_key not in (None, ticket.liveness_key)
                    and line.first(ticket)
                ):
                    # The listener's session ended, and the ticket's life with it: once it has
                    # a new one, give the ticket up and take a new one. The waiters of our line
                    # behind us take theirs after us, in order. A row handed to it before it
                    # died, which we never heard of, is under our guid: the next attempt finds
                    # it ours and takes it. Nothing is given back: a give-up under this guid
                    # that reached the server late (held up, or sent again on a new connection)
                    # would delete the row we had won by then.
                    dead, ticket = ticket, None
                    given_up = self._give_up(dead, guid, give_back=False, wake_next=False)
                    dead_standing = dead_standing or not given_up
                    rejoining = outlived = True
                    try_now = True
                waiter = listener.register(lockstring, digest, releases=False)
                try:
                    key = listener.liveness_key
                    if rejoining and key is None:
                        rejoining = False  # nothing to take a ticket with: the next tries too
                        line.wake_first(lockstring)
                    if ticket is None and gate is None and key is not None:
                        if grant_key is None or unsure is None:
                            grant_key = GrantKey(clock.now())
                        try:
                            ticket, held, replaced = self._join_line(
                                lockstring, guid, ttl, details, key, unsure is not None, grant_key
                            )
                        except DatabaseError as error:
                            unsure = key
                            wait_out(error, backoff, lockstring)
                            continue
                        unsure = None  # the join gave up whatever an earlier one took
                        doubled = doubled or replaced
                        line.join(ticket)
                        if rejoining:
                            rejoining = False
                            line.wake_first(lockstring)  # the next of our dead tickets
                        if polls:
                            backoff.heading()
                        else:
                            backoff.await_hand_off()
                        # A release may have come before our ticket: try at once, unless the
                        # row is polled anyway, as soon (Backoff.heading).
                        try_now = not held and not polls
                    wake = functools.partial(listener.wake, waiter)  # once it is first
                    first = ticket is None or line.watch(ticket, wake)
                    if first:
                        listener.follow_releases(waiter)
                    if first and try_now and not polls and (pause := wakes.pause()) > 0:
                        left = backoff.remaining()
                        concurrency.sleep(pause if left is None else min(pause, left))
                    if first and try_now:
                        waited = 0.0 if free_since is None else time.monotonic() - free_since
                        in_line = ticket is not None and waited < tickets.PATIENCE
                        try:
                            attempt = self._attempts.try_acquire(
                                winnings,
                                lockstring,
                                guid,
                                details,
                                ttl,
                                on_lost,
                                ticket.number if in_line and ticket is not None else gate,
                                look_first=in_line and polls,
                                in_line=in_line,
                            )
                        except DatabaseError as error:
                            wait_out(error, backoff, lockstring)
                            continue
                        if isinstance(attempt, Lock):
                            line.passed += ticket is not None and not in_line
                            outcome = attempt
                            return attempt
                        gated_unasked = gate is not None and attempt.busy is None
                        gate = None
                        if ticket is None or attempt.busy is not None:
                            free_since = None
                        elif free_since is None:
                            free_since = time.monotonic()
                        wakes.refused(attempt.busy, refused.busy)
                        if attempt.busy is not None or refused.busy is None:
                            if tickets.new_hold(attempt.busy, refused.busy) and polls:
                                backoff.heading()  # polls paced by the age of this hold
                            refused = attempt
                        if backoff.expired() and gated_unasked:
                            continue  # the gate refused us unasked: one full attempt first
                    try_now = True
                    if backoff.expired():
                        raise refused.busy_after(lockstring, wait)
                    if ticket is None and key is not None:
                        continue  # refused: take a ticket
                    if first:
                        delay = backoff.next_delay(Backoff.until_takeable(refused, self._grace))
                    else:  # wakes when it is first, or is handed the row
                        remaining = backoff.remaining()
                        delay = LOOK_AGAIN if remaining is None else min(LOOK_AGAIN, remaining)
                    listener.wait(waiter, delay)
                    if waiter.grant is not None and ticket is not None:
                        try:
                            claimed = self._claim(lockstring, guid, ttl, waiter.grant, grant_key)
                        except DatabaseError as error:
                            # The row handed over is ours (guid): the next attempt finds it so.
                            wait_out(error, backoff, lockstring)
                            try_now = True
                            continue
                        if claimed is not None:
                            if not doubled:  # else given up below: it may be the one left
                                line.leave(ticket)
                                ticket = None  # the release that granted it took it
                            outcome = self._attempts.handle(
                                winnings, lockstring, guid, claimed, ttl, details, on_lost
                            )
                            return outcome
                finally:
                    listener.unregister(waiter)
        finally:
            if rejoining:
                line.wake_first(lockstring)
            if ticket is not None and outcome is not None and polls:
                # Won by our own INSERT where no release hands rows over: there is nothing to
                # give back, and the caller need not wait for the round trip (the ticket keeps
                # nobody from a row that is ours).
                self.leaving.call_soon(self._give_up, ticket, guid, False)
            elif ticket is not None:
                # Given up before the caller has its lock: a later release must not hand a
                # row to a ticket nobody waits on. Without the lock, a row handed to it goes
                # back.
                self._give_up(ticket, guid, outcome is None)
            elif unsure is not None:  # and, without the lock, a row handed to it goes back
                self._give_up_every(lockstring, unsure, guid, outcome is None)
            if outlived and listener.liveness_key is not None:
                # Every ticket of our guid goes as the call ends. Without the lock, a row handed
                # to a dead ticket of ours, which no attempt took before the wait ended, stands
                # under our guid: it goes back too (nothing of this call's can be deleted by it
                # now). With it, a dead ticket whose give-up failed may live on, its old session
                # still holding the key on a server that has not noticed its client gone: the
                # next release but ours would hand it a row, to stand held by nobody. Given up
                # in the background: it gives nothing back, and the caller has its lock.
                key = listener.liveness_key
                if outcome is None:
                    self._give_up_every(lockstring, key, guid, True)
                elif dead_standing:
                    self.leaving.call_soon(self._give_up_every, lockstring, key, guid, False)

    def _claim(
        self, lockstring: str, guid: str, ttl: float, grant: Grant, key: GrantKey | None
    ) -> Acquired | None:
        """The row ``grant`` says a release inserted for us, if it is so: signed with ``key``,
        the key of our ticket, it is believed as it comes (``holding.signed_grant``), where the
        server replicates once renewed by a commit of our own (``LockOperations.confirm_grant``);
        not signed at all (a ticket taken by an older release of sqllocker's), it is read back
        from the table (``LockOperations.claim_grant``). A grant signed with another key is
        not ours, or not ours to keep: ignored."""
        signed = grant.signed
        if signed is not None:
            acquired = None if key is None else signed_grant(grant, key, ttl)
            if acquired is not None:
                logger.debug("acquired %r (id %d), handed over", lockstring, grant.lock_id)
                return self._made_sure(lockstring, acquired, guid, ttl)
            if key is None or not key.signed(signed):
                logger.warning(
                    "a hand-off notification for %r (id %d) is not signed with its ticket's "
                    "key; ignored",
                    lockstring,
                    grant.lock_id,
                )
                return None
            # Ours, but heard too late to count on without the table's word.
        claimed: Acquired | None = self._call(
            self._operations.claim_grant, lockstring, grant.lock_id, guid
        )
        return None if claimed is None else self._made_sure(lockstring, claimed, guid, ttl)

    def _made_sure(
        self, lockstring: str, granted: Acquired, guid: str, ttl: float
    ) -> Acquired | None:
        """``granted``, where the server replicates renewed by a commit of our own first
        (``LockOperations.confirm_grant``): a read of the row is no proof that a standby has
        it. None if it is not ours any more."""
        if not self._operations.confirms_grants:
            return granted
        confirmed: Acquired | None = self._call(
            self._operations.confirm_grant, lockstring, granted, guid, ttl
        )
        return confirmed

    def _give_up(self, ticket: Ticket, guid: str, give_back: bool, wake_next: bool = True) -> bool:
        """Give up ``ticket`` (``_leave_line``), then wake the next waiter of this Locker (if
        ``wake_next``): told sooner, it would find our ticket still ahead of its own. A give-up
        that failed is tried again in the background (``_give_up_again``). Whether it was
        given up."""
        given_up = False
        try:
            given_up = self._leave_line(ticket.lockstring, ticket.number, guid, give_back)
            return given_up
        finally:
            self.line.leave(ticket, wake_next)
            if not given_up:
                number, key = ticket.number, ticket.liveness_key
                self.leaving.call_soon(
                    self._give_up_again, ticket.lockstring, number, key, guid, give_back
                )

    def _give_up_every(
        self, lockstring: str, liveness_key: int, guid: str, give_back: bool
    ) -> None:
        """Give up every ticket of ``guid`` for ``lockstring``: a join that failed may have
        taken one, alive while ``liveness_key`` is held. A give-up that failed is tried again
        in the background, as for a known ticket."""
        if not self._leave_line(lockstring, None, guid, give_back):
            self.leaving.call_soon(
                self._give_up_again, lockstring, None, liveness_key, guid, give_back
            )

    def _give_up_again(
        self,
        lockstring: str,
        number: int | None,
        liveness_key: int,
        guid: str,
        give_back: bool,
    ) -> None:
        """Try to give up ticket ``number`` (None: every ticket of ``guid``), alive while
        ``liveness_key`` is held, again every ``tickets.GIVE_UP_AGAIN`` seconds while it may
        live: left live with nobody waiting on it, it would be handed the next row, to stand
        held by nobody until it expires (PostgreSQL), or hold every waiter behind it back from
        a free row for PATIENCE at each turn (MariaDB)."""
        for _attempt in range(tickets.GIVE_UP_ATTEMPTS):
            concurrency.wait(self.closing, tickets.GIVE_UP_AGAIN)
            listener = self.listener
            if self.closing.is_set() or listener is None or listener.liveness_key != liveness_key:
                return  # the ticket has died with the listener's session, or will with it
            if self._leave_line(lockstring, number, guid, give_back, quiet=True):
                logger.info("gave up a ticket for %r after all", lockstring)
                return
        logger.warning(
            "could not give up a ticket for %r; it stands until this Locker is closed", lockstring
        )

    def _join_line(
        self,
        lockstring: str,
        guid: str,
        ttl: float,
        details: dict[str, Any],
        key: int,
        replacing: bool,
        grant_key: GrantKey,
    ) -> tuple[Ticket, bool, bool]:
        """A ticket for ``lockstring``, alive while ``key`` is held, whether the row is held,
        and whether an earlier one may have been handed it (``LockOperations.join_line``;
        ``replacing`` an earlier one that may stand); a release signs its grant to it with
        ``grant_key``."""
        join = (lockstring, guid, ttl, details, key, replacing, grant_key.pads)
        number, held, replaced = self._operations.join_line(*join)
        return Ticket(lockstring, number, key), held, replaced

    def _leave_line(
        self, lockstring: str, number: int | None, guid: str, give_back: bool, quiet: bool = False
    ) -> bool:
        """Give up ticket ``number`` (None: every ticket of ``guid``; see
        ``LockOperations.leave_line``), whoever stops waiting for it. Whether it was: a failure
        is logged (at DEBUG if ``quiet``), not raised. Given no answer within
        ``tickets.GIVE_UP_PATIENCE``, it is left to end in the background and counts as failed
        (tried again: a ticket given up twice is given up once). So it may reach the server
        late: one that gives a row back is sent only by a caller that has stopped waiting, or
        it could delete a row the caller had won meanwhile under the same guid."""
        leave = (lockstring, number, guid, give_back)
        log = logger.debug if quiet else logger.warning
        try:
            bound = clock.now() + tickets.GIVE_UP_PATIENCE
            outer = deadlines.current()
            with deadlines.statements_end_by(bound if outer is None else min(outer, bound)):
                self._operations.leave_line(*leave)
        except DatabaseError as error:
            log("could not give up a ticket for %r (%s)", lockstring, error)
            return False
        return True
