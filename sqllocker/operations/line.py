"""The waiting line: a waiter's ticket taken and given up (see ``sqllocker.tickets``)."""

from __future__ import annotations

import logging
from typing import Any

import sqlalchemy as sa

from ..execution import DriverSession
from .database import Database
from .outcomes import Joined

logger = logging.getLogger("sqllocker")


class WaitingLine:
    """The tickets of waiters for rows of ``database``'s table, where waiters take them
    (``Database.waits_by_ticket``)."""

    def __init__(self, database: Database) -> None:
        self._db = database
        # The table's queue_join takes no key (PostgreSQL, a table behind revision 0003): its
        # grants come unsigned, and are read back, until the table is migrated and this
        # process starts again.
        self._unsigned = False
        # Told once that the driver would show a ticket's key in the statement's text.
        self._in_text = False
        # Whether roles other than the owner may read the tickets' keys: asked once, before
        # the first ticket with a key (None: not yet asked).
        self._keys_read: bool | None = None

    def join_line(
        self,
        lockstring: str,
        guid: str,
        ttl: float,
        details: dict[str, Any],
        liveness_key: int,
        replacing: bool = False,
        grant_key: bytes | None = None,
    ) -> Joined:
        """Take a ticket for ``lockstring`` (``sqllocker.tickets``), alive while
        ``liveness_key`` is held: its number, and whether the row is held (where the backend
        hands the row over, which reads it in the same statement; elsewhere False: the
        caller's polls find out).

        ``replacing``: an earlier attempt of this waiter's (``guid``) failed, and may have
        taken a ticket all the same, its answer lost with its connection; so may an attempt
        retried here. Such a ticket stays live, and would keep everyone behind it waiting (or,
        where releases hand rows over, be handed one nobody claims): it is given up first.

        ``grant_key``: where releases hand rows over, the pads of the key a release signs its
        grant to this ticket with (``notifications.GrantKey``)."""
        params = {
            "ls": lockstring,
            "lock_guid": guid,
            "holder": details,
            "ttl": ttl,
            "liveness_key": liveness_key,
        }
        signed = dict(params, grant_key=grant_key)
        earlier = {"ticket": None, "ls": lockstring, "lock_guid": guid, "give_back": False}
        attempted = replacing

        def join(conn: DriverSession) -> Joined:
            nonlocal attempted
            replaced = attempted
            if replaced:
                conn.execute(self._db.sql.leave_line, earlier)
            attempted = True
            result = self._join(conn, params, signed if grant_key is not None else None)
            if not self._db.be.hands_over:
                assert result.lastrowid is not None, "a ticket's INSERT reports its id"
                return Joined(int(result.lastrowid), False, replaced)
            row = result.one()
            return Joined(int(row.ticket), bool(row.held), replaced)

        return self._db.run(lockstring, join)

    def _join(
        self, conn: DriverSession, unsigned: dict[str, Any], signed: dict[str, Any] | None
    ) -> Any:
        """The join's statement: with ``signed`` (its parameters with a grant key) where
        releases hand the row over and the table's ``queue_join`` takes a key, else
        ``unsigned``."""
        sql, be = self._db.sql, self._db.be
        if not be.hands_over:
            return conn.execute(sql.join_line, unsigned)
        if signed is None or self._unsigned:
            return conn.execute(sql.join_line_unsigned, unsigned)
        if be.binds_in_text(conn.dbapi_connection):
            if not self._in_text:
                self._in_text = True
                logger.warning(
                    "the driver writes parameters into the statement's text (psycopg's "
                    "ClientCursor?), which pg_stat_activity shows: hand-offs from %s are read "
                    "back from the table, their tickets taken without a key",
                    self._db.table_name,
                )
            return conn.execute(sql.join_line_unsigned, unsigned)
        if self._keys_read is None:
            self._keys_read = self._others_read_tickets(conn)
        if self._keys_read:
            return conn.execute(sql.join_line_unsigned, unsigned)
        try:
            return conn.execute(sql.join_line, signed)
        except sa.exc.DBAPIError as error:
            if not be.is_missing_function(error):
                raise
        self._unsigned = True
        logger.warning(
            "the lock table %s is behind revision 0003 (its queue_join takes no key): hand-offs "
            "are read back from the table until `sqllocker migrate` brings it up to date",
            self._db.table_name,
        )
        return conn.execute(sql.join_line_unsigned, unsigned)

    def _others_read_tickets(self, conn: DriverSession) -> bool:
        """Whether roles other than the owner may read the tickets, their keys included
        (``Backend.others_read_tickets``): then tickets are taken without a key, and a release's
        grant is read back from the table. Asked once per Locker: a role let read them later
        is seen once its processes start again."""
        query = self._db.be.others_read_tickets(self._db.table_name)
        if query is None:
            return False
        if not conn.execute(query).one().read_by_others:
            return False
        logger.warning(
            "roles other than its owner may read the tickets of %s (a grant, PUBLIC, or "
            "pg_read_all_data), keys included: hand-offs are read back from the table, their "
            "tickets taken without a key",
            self._db.table_name,
        )
        return True

    def leave_line(self, lockstring: str, ticket: int | None, guid: str, give_back: bool) -> bool:
        """Give up ``ticket``; with ``give_back``, a row already handed to it is deleted again
        (its waiter stopped waiting), where releases hand rows over. Says whether one was."""
        params = {"ticket": ticket, "ls": lockstring, "lock_guid": guid, "give_back": give_back}

        def leave(conn: DriverSession) -> bool:
            result = conn.execute(self._db.sql.leave_line, params)
            return self._db.be.hands_over and bool(result.one().given_back)

        given_back = self._db.run(lockstring, leave)
        if given_back:
            logger.debug("gave back %r, handed over to a waiter that stopped waiting", lockstring)
        return given_back
