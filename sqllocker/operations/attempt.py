"""The statements of one attempt at a row: the INSERT, the look at who refused it, and the
takeover of an expired holder's row."""

from __future__ import annotations

import logging
from typing import Any

import sqlalchemy as sa
from sqlalchemy.sql import ClauseElement

from .. import deadlines
from ..errors import LockBusy, TableMissing
from ..execution import DriverSession
from ..identity import public_details
from ..schema import ID_ORDER_STRIPES
from .database import Database
from .outcomes import Acquired, Refused
from .release import Releaser

logger = logging.getLogger("sqllocker")


class Attempt:
    """One attempt's statements at a row of ``database``'s table, on a connection the caller's
    operation holds. ``renewal`` renews a row of ours an earlier attempt left (its answer
    lost).

    Each statement commits by itself: what makes this safe is in the statements, not in a
    transaction around them (see ``insert_or_learn_holder``)."""

    def __init__(self, database: Database, renewal: Releaser) -> None:
        self._db = database
        self._renewal = renewal

    def acquire_on(
        self,
        conn: DriverSession,
        lockstring: str,
        guid: str,
        ttl: float,
        details: dict[str, Any],
        queue_key: int | None,
        look_first: bool,
        in_line: bool,
    ) -> Acquired | Refused:
        be, sql = self._db.be, self._db.sql
        params = self.params(lockstring, guid, ttl, details)
        try:
            if queue_key is not None:
                # A newcomer's first attempt, or a waiter's by ticket. Refused, a newcomer takes
                # a ticket, and learns who holds the row when it next tries; asking now too
                # would add a round trip to every hand-off.
                params["queue_key"] = queue_key
                if look_first and (refused := self._refused_by_holder(conn, params)):
                    return refused
                gated = self._insert(conn, sql.acquire_unless_queued, params, queued_ok=True)
                if gated is not None or not in_line:
                    return gated or Refused(None, None)
                return self.learn_holder(conn, params)
            if look_first and (refused := self._refused_by_holder(conn, params)):
                return refused
            return self.insert_or_learn_holder(conn, params)
        except sa.exc.DBAPIError as error:
            # Contention is a refusal, tried again; past the acquire's deadline (its wait and
            # the slack) it is the database's error: a transaction that holds a row, or
            # SQLite's file, that long is no holder of the lock.
            if not be.is_transient_conflict(error) or deadlines.passed():
                raise
            logger.debug("acquire of %r met contention (%s); retrying", lockstring, error.orig)
            return Refused(self.key_blocker(conn, lockstring), None)

    def key_blocker(self, conn: DriverSession, lockstring: str) -> LockBusy | None:
        """After an acquire waited out its bound for the lockstring's id-order key
        (PostgreSQL): the LockBusy that names the session holding that key, if one does. Held
        longer than an INSERT, it is held by a session outside sqllocker's protocol."""
        statement = self._db.sql.id_order_blocker
        if statement is None:
            return None
        try:
            row = conn.execute(statement, {"ls": lockstring}).first()
        except sa.exc.DBAPIError:
            return None  # pg_locks not readable: the caller says "busy", as it would anyway
        return None if row is None else LockBusy(lockstring, key_holder_pid=row.pid)

    def params(
        self, lockstring: str, guid: str, ttl: float, details: dict[str, Any]
    ) -> dict[str, Any]:
        be = self._db.be
        return {
            "ls": lockstring,
            "lock_guid": guid,
            "ttl": be.seconds_value(ttl),
            "holder": details,
            **self._db.expiry,
        }

    def insert_or_learn_holder(
        self, conn: DriverSession, params: dict[str, Any]
    ) -> Acquired | Refused:
        """Insert our row; if refused, read the holder's row and take it over if it has expired.

        Each statement commits by itself: what makes this safe is in the statements, not in a
        transaction around them. The INSERT is refused while any row holds the lockstring; the
        takeover deletes (or, PostgreSQL, replaces) the row only if it is still expired when
        it runs, so of several acquirers racing for one expired row one wins and the others'
        INSERTs are refused by the winner's row.
        """
        acquired = self._insert(conn, self._db.sql.acquire, params)
        if acquired is not None:
            return acquired
        return self.learn_holder(conn, params)

    def _refused_by_holder(self, conn: DriverSession, params: dict[str, Any]) -> Refused | None:
        """A waiter polling the row by ticket reads it before any INSERT: the refusal by a
        live holder's row, or None (free, ours, or takeable: the INSERT follows). A refused
        INSERT takes a lock on the holder's row, which its release then waits for, and costs
        a round trip more than the read. (Reading whether a live ticket stands ahead as well
        was measured to cost more than the INSERTs it spared.)"""
        held = conn.execute(self._db.sql.holder_for_acquirer, params).first()
        if held is None or held.ours or held.takeable:
            return None
        return self._refused_by(held, params)

    def learn_holder(self, conn: DriverSession, params: dict[str, Any]) -> Acquired | Refused:
        """After our INSERT was refused: the row that refused it, ours after all, or taken
        over if it has expired."""
        row = conn.execute(self._db.sql.holder_for_acquirer, params).first()
        if row is None:
            # Released in between (or, in line by ticket, a live ticket ahead refused us).
            return Refused(None, None)
        if row.ours:
            # Ours and unexpired: an INSERT of ours committed but its answer was lost with the
            # connection (_run retried), or a release handed the row to our ticket. Its expiry
            # period began when it was inserted, not now. (Ours but expired, it is not "ours":
            # an outage outlasted it, and it is taken over below, or refuses us, like anyone's.)
            # Renewed before it counts, so that its expiry starts from this attempt: an
            # outage may have left it a moment to live, less than the deadline's margin.
            mine = {"ls": params["ls"], "lock_id": row.id, "lock_guid": params["lock_guid"]}
            expires = self._renewal.extend_on(conn, mine, params["ttl"])
            if expires is None:
                return Refused(None, None)  # expired meanwhile: taken over on a later try
            return Acquired(row.id, row.created, expires)
        if row.takeable:
            # Expired beyond grace by the server's clock: take it over, or lose the race.
            return self._take_over(conn, params) or Refused(None, None)
        return self._refused_by(row, params)

    @staticmethod
    def _refused_by(row: Any, params: dict[str, Any]) -> Refused:
        """The refusal by the holder's ``row`` (``holder_for_acquirer``)."""
        busy = LockBusy(
            params["ls"],
            holder=public_details(row.locked_by),
            lock_id=row.id,
            created=row.created,
            expires=row.expires,
        )
        return Refused(busy, row.server_now)

    def _take_over(self, conn: DriverSession, params: dict[str, Any]) -> Acquired | None:
        """Replace an expired holder's row with ours: atomically on PostgreSQL; elsewhere by
        deleting it only if still expired, then inserting (the unique key picks one winner)."""
        sql = self._db.sql
        taken = None
        if self._db.be.atomic_takeover:
            taken = self._insert(conn, sql.take_over, params)
        elif conn.affected(sql.take_over_expired, params):
            taken = self._insert(conn, sql.acquire, params)
        if taken is not None:
            taken.took_over = True
        return taken

    def _insert(
        self,
        conn: DriverSession,
        statement: ClauseElement,
        params: dict[str, Any],
        queued_ok: bool = False,
    ) -> Acquired | None:
        """Run an acquiring INSERT: its row, or None if refused (``queued_ok``: it inserts
        nothing while waiters are queued, which is no sign of a missing stripe row)."""
        be = self._db.be
        try:
            if be.insert_returning:
                row = conn.first_row(statement, params)
                inserted = row is not None
            else:
                inserted, row = self._insert_then_read(conn, statement, params)
        except sa.exc.IntegrityError as error:
            if be.is_unique_violation(error):
                return None
            raise
        if not inserted and not queued_ok:
            self._check_silent_refusal(params)
        if row is None:
            return None
        lock_id, created, expires = row
        return Acquired(lock_id, created, expires)

    def _insert_then_read(
        self, conn: DriverSession, statement: ClauseElement, params: dict[str, Any]
    ) -> tuple[bool, tuple[int, object, object] | None]:
        """Without RETURNING (MySQL 8): the INSERT, then whether it inserted a row, and that
        row's id and times, read by the id the driver reports and our guid. No row if it
        inserted none, or if its row was gone by the read (broken meanwhile): the table says
        who holds the lockstring then, not the INSERT."""
        result = conn.execute(statement, params)
        if result.rowcount != 1 or result.lastrowid is None:
            return False, None
        lock_id = result.lastrowid
        mine = {"ls": params["ls"], "lock_id": lock_id, "lock_guid": params["lock_guid"]}
        times = conn.execute(self._db.sql.times_of, mine).first()
        if times is None:
            logger.info("%r was inserted (id %d), and gone when read back", params["ls"], lock_id)
            return True, None
        return True, (lock_id, times.created, times.expires)

    def _check_silent_refusal(self, params: dict[str, Any]) -> None:
        """An INSERT that inserted nothing without an error: held, under ON CONFLICT DO NOTHING.
        On MySQL a held row is a duplicate-key error; nothing inserted means that the stripes
        table had no row to lock for the lockstring, which would refuse it for ever."""
        id_order = self._db.sql.id_order
        if id_order is None:
            return
        raise TableMissing(
            f"lock table {self._db.table_name!r}'s {id_order.name} lacks the row of "
            f"{params['ls']!r}'s stripe; insert again the stripes 0 to {ID_ORDER_STRIPES - 1} "
            "that migration 0006 inserted",
            params["ls"],
        )

    def as_stored(
        self, conn: DriverSession, lockstring: str, guid: str, acquired: Acquired
    ) -> Acquired | Refused:
        """``acquired`` as its row stands once committed, read back by guid, where the server's
        answer to the INSERT is not the last word (``ServerSettings.retries_autocommit``; for a
        group's rows, ``replays_inserts``): a row inserted again carries its new id, and a
        lockstring whose row is not ours is refused, whatever the INSERT answered."""
        params = {"ls": lockstring, "lock_guid": guid, **self._db.expiry}
        row = conn.execute(self._db.sql.holder_for_acquirer, params).first()
        if row is None or not row.ours:
            logger.info(
                "%r was reported inserted (id %d), but the table holds %s: refused",
                lockstring,
                acquired.lock_id,
                "no row" if row is None else f"another's row (id {row.id})",
            )
            return Refused(None, None) if row is None else self._refused_by(row, params)
        if row.id != acquired.lock_id:
            logger.info(
                "%r was inserted again as id %d, not %d", lockstring, row.id, acquired.lock_id
            )
        return Acquired(row.id, row.created, row.expires, age=acquired.age)

    def all_as_stored(
        self, conn: DriverSession, members: list[tuple[str, str]], taken: list[Acquired]
    ) -> list[Acquired] | Refused:
        """A group's rows read back as ``_as_stored`` reads one: a member whose row is not ours
        refuses the group, which gives back the members it did take."""
        stored = [
            self.as_stored(conn, lockstring, guid, acquired)
            for (lockstring, guid), acquired in zip(members, taken, strict=True)
        ]
        acquired = [outcome for outcome in stored if isinstance(outcome, Acquired)]
        if len(acquired) == len(stored):
            return acquired
        for (lockstring, guid), outcome in zip(members, stored, strict=True):
            if isinstance(outcome, Acquired):
                mine = {"ls": lockstring, "lock_id": outcome.lock_id, "lock_guid": guid}
                conn.affected(self._db.sql.release, mine)
        return next(outcome for outcome in stored if isinstance(outcome, Refused))
