"""Acquiring: one attempt at a lock, at a group of locks in one transaction, and the claim of a
row a release handed over."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import sqlalchemy as sa

from .. import clock, deadlines
from ..execution import DriverSession
from .attempt import Attempt
from .database import Database
from .outcomes import Acquired, Refused
from .release import Releaser

logger = logging.getLogger("sqllocker")

# Attempts at one acquire when the holder vanishes between our refused INSERT and our look-up of
# who holds it; past this, the caller is told "busy" (and, with a wait, simply tries again later).
_ATTEMPTS_PER_TRY = 3


class Acquirer:
    """The acquires of rows of ``database``'s table, each one attempt that never waits for a
    holder (the front ends wait between attempts), run by ``attempt``'s statements; a row
    handed over is renewed by ``renewal``'s (``confirm_grant``)."""

    def __init__(self, database: Database, attempt: Attempt, renewal: Releaser) -> None:
        self._db = database
        self._attempt = attempt
        self._renewal = renewal

    def try_acquire(
        self,
        lockstring: str,
        guid: str,
        ttl: float,
        details: dict[str, Any],
        queue_key: int | None = None,
        look_first: bool = False,
        in_line: bool = False,
    ) -> Acquired | Refused:
        """One attempt at ``lockstring`` (a few statements at most; never waits for a holder).

        With ``queue_key``, refused also while live tickets lower than it wait for the
        lockstring, however free the row: see ``Statements.acquire_unless_queued``; ``in_line``
        (a waiter with a ticket), a refusal then reads who holds the row, and takes over an
        expired one. With ``look_first`` (a waiter polling, where releases do not hand the row
        over, or one queued on SQLite whose turn it is not), the holder's row is read before
        any INSERT (``Attempt._refused_by_holder``)."""

        sent_at = 0.0
        in_memory = self._db.pool.in_memory

        def attempt(conn: DriverSession) -> Acquired | Refused:
            nonlocal sent_at
            # The validity deadline counts from before the attempt's statements are sent (the
            # server's expiry cannot start earlier), on each connection Database.run tries: not from
            # before a first one whose answer was lost, and a reconnection after an outage.
            sent_at = clock.now()
            outcome = self._attempt.acquire_on(
                conn, lockstring, guid, ttl, details, queue_key, look_first, in_line
            )
            if self._db.lone_inserts_retried and isinstance(outcome, Acquired):
                outcome = self._attempt.as_stored(conn, lockstring, guid, outcome)
            if in_memory is not None and isinstance(outcome, Acquired):
                outcome.database = in_memory.number  # read while the connection is ours
            return outcome

        for _attempt in range(_ATTEMPTS_PER_TRY):
            outcome = self._db.run(lockstring, attempt)
            if isinstance(outcome, Acquired):
                logger.debug("acquired %r (id %d)", lockstring, outcome.lock_id)
                outcome.sent_at = sent_at - outcome.age
                return outcome
            if outcome.busy is not None or queue_key is not None:
                break  # a live holder, or a queue to join: no point asking again at once
        return outcome

    def try_acquire_all(
        self, members: list[tuple[str, str]], ttl: float, details: dict[str, Any]
    ) -> list[Acquired] | Refused:
        """One attempt at every ``(lockstring, guid)`` of ``members`` (already in their
        canonical order) in one transaction: every row, or none.

        Rows are taken in that order, so two groups that overlap wait for each other in the
        same order and cannot deadlock (nor, with single locks, which wait for one row only).
        A member held by someone else, or contention the database resolved by failing us,
        rolls the whole attempt back and refuses it.
        """
        sent_at = 0.0
        in_memory = self._db.pool.in_memory

        def attempt(conn: DriverSession) -> list[Acquired] | Refused:
            nonlocal sent_at
            sent_at = clock.now()  # as for one lock: before this connection's statements
            outcome = self._acquire_all_on(conn, members, ttl, details)
            if in_memory is not None and isinstance(outcome, list):
                for acquired in outcome:
                    acquired.database = in_memory.number  # read while the connection is ours
            return outcome

        outcome = self._db.run(members[0][0], attempt)
        if isinstance(outcome, list):
            for acquired in outcome:
                acquired.sent_at = sent_at - acquired.age
            logger.debug("acquired %d locks at once", len(outcome))
        return outcome

    def _acquire_all_on(
        self,
        conn: DriverSession,
        members: list[tuple[str, str]],
        ttl: float,
        details: dict[str, Any],
    ) -> list[Acquired] | Refused:
        be = self._db.be
        conn.transaction_control(be.begin)
        lockstring = members[0][0]
        try:
            taken: list[Acquired] = []
            for lockstring, guid in members:
                params = self._attempt.params(lockstring, guid, ttl, details)
                outcome = self._attempt.insert_or_learn_holder(conn, params)
                if not isinstance(outcome, Acquired):
                    conn.transaction_control("ROLLBACK")
                    return outcome
                taken.append(outcome)
            conn.transaction_control("COMMIT")
        except sa.exc.DBAPIError as error:
            self._roll_back_quietly(conn)
            if be.is_transient_conflict(error) and not deadlines.passed():
                # As for one lock (``Attempt.acquire_on``): a refusal, until the deadline; a
                # wait for a member's key that ran out names who holds it.
                return Refused(self._attempt.key_blocker(conn, lockstring), None)
            raise
        except BaseException:
            self._roll_back_quietly(conn)
            raise
        # Committed: a failure from here on is tried again (Database.run), and the rows found ours.
        if self._db.inserts_replayed:
            return self._attempt.all_as_stored(conn, members, taken)
        return taken

    @staticmethod
    def _roll_back_quietly(conn: DriverSession) -> None:
        """Roll back after a failure (a connection that is gone has nothing to roll back)."""
        with contextlib.suppress(Exception):
            conn.transaction_control("ROLLBACK")

    def claim_grant(self, lockstring: str, lock_id: int, guid: str) -> Acquired | None:
        """The row a hand-off notification says a release inserted for us (``lock_id``), if
        the table bears it out: ours (by guid) and unexpired. None otherwise: anyone who can
        connect can send a NOTIFY, and a row is ours only if the table says so."""
        params = {"ls": lockstring, "lock_id": lock_id, "lock_guid": guid}
        sent_at = clock.now()
        row = self._db.run(
            lockstring, lambda conn: conn.execute(self._db.sql.own_row, params).first()
        )
        if row is None:
            logger.warning(
                "a hand-off notification for %r (id %d) is not borne out by the table; ignored",
                lockstring,
                lock_id,
            )
            return None
        # Its expiry period began when the release inserted it, before we heard of it.
        age = max(0.0, (row.server_now - row.created).total_seconds())
        acquired = Acquired(row.id, row.created, row.expires, age=age)
        acquired.sent_at = sent_at - age
        logger.debug("acquired %r (id %d), handed over by its release", lockstring, row.id)
        return acquired

    def confirm_grant(
        self, lockstring: str, granted: Acquired, guid: str, ttl: float
    ) -> Acquired | None:
        """``granted``, a row a release handed us, made sure of where the server replicates
        (``Database.confirms_grants``): renewed by a commit of our own, which the server
        acknowledges only once its synchronous standbys have it, and so the release's commit
        before it. That one may have been acknowledged without them: a wait for a standby that
        anyone cancels ends with the commit visible (and its notification sent), and a failover
        then loses the row while we would hold its lock. None if the row is not ours and
        unexpired (lost in a failover, or run out meanwhile)."""
        mine = {"ls": lockstring, "lock_id": granted.lock_id, "lock_guid": guid}
        ttl_value = self._db.be.seconds_value(ttl)
        sent_at = clock.now()
        expires = self._db.run(
            lockstring, lambda conn: self._renewal.extend_on(conn, mine, ttl_value)
        )
        if expires is None:
            logger.warning(
                "the row handed over for %r (id %d) is no longer ours; not counted on",
                lockstring,
                granted.lock_id,
            )
            return None
        confirmed = Acquired(granted.lock_id, granted.created, expires)
        confirmed.sent_at = sent_at  # its expiry period begins with our renewal
        return confirmed
