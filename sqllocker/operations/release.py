"""A held row: its release, its extension, its guard in a caller's transaction; and SQLite's
checkpoints after releases."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..backends import backend_class
from ..errors import DatabaseError, LockError, LockLost, NotDurable, one_line
from ..execution import DriverSession
from ..sqlalchemy_internals import commits_each_statement
from .database import Database

logger = logging.getLogger("sqllocker")

# SQLite: a Locker's releases checkpoint the write-ahead log every this many. A lock cycle
# writes about 7 pages to the log, so this is about SQLite's own limit of 1000 pages.
CHECKPOINT_EVERY = 128


class Releaser:
    """Releases, extends and guards rows of ``database``'s table that a caller holds (by
    id and guid), and checkpoints SQLite's log every ``CHECKPOINT_EVERY`` releases."""

    def __init__(self, database: Database) -> None:
        self._db = database
        # Only an engine sqllocker made has SQLite's own checkpoints turned off.
        backend = backend_class(database.engine.dialect.name)
        self._checkpoints_after_releases = (
            database.owns_engine and backend.checkpoints_after_releases
        )
        self._releases = 0

    def release(
        self, lockstring: str, lock_id: int, guid: str, hold_at_least: float | None = None
    ) -> None:
        """Delete our row; LockLost if it was no longer ours. With ``hold_at_least``, a release
        within that many seconds of the row's creation keeps the row until then instead (see
        ``Statements.finish_within_window``)."""
        params: dict[str, Any] = {"ls": lockstring, "lock_id": lock_id, "lock_guid": guid}
        try:
            self._release(lockstring, lock_id, params, hold_at_least)
        except NotDurable as error:
            # Our row's DELETE (or its window's UPDATE) committed here: it wrote, so it matched
            # our row. A failover may bring the row back, held by nobody till it expires; a
            # waiter it was handed to makes sure of it itself (``Acquirer.confirm_grant``).
            logger.warning(
                "released %r (id %d), maybe not for good: %s", lockstring, lock_id, error
            )

    def _release(
        self, lockstring: str, lock_id: int, params: dict[str, Any], hold_at_least: float | None
    ) -> None:
        if hold_at_least is not None:
            params["hold"] = self._db.be.seconds_value(hold_at_least)
            kept = self._db.run(
                lockstring, lambda conn: conn.affected(self._db.sql.finish_within_window, params)
            )
            if kept == 1:
                logger.debug(
                    "finished %r (id %d); it stays held till its window ends", lockstring, lock_id
                )
                return
        resent: list[bool] = []
        deleted = self._db.run(
            lockstring,
            lambda conn: conn.affected(self._db.sql.release, params),
            resent=lambda: resent.append(True),
        )
        if deleted != 1:
            raise LockLost(
                f"lock {lockstring!r} (id {lock_id}) was no longer ours at release: "
                + (
                    "this release's first try, whose answer was lost with its connection, may "
                    "have deleted it; or "
                    if resent
                    else ""
                )
                + "it expired and was purged, taken over or broken; work done under it may "
                "have overlapped with another holder's",
                lockstring,
                lock_id,
            )
        logger.debug("released %r (id %d)", lockstring, lock_id)

    def extend(
        self,
        lockstring: str,
        lock_id: int,
        guid: str,
        ttl: float,
        resent: Callable[[], None] | None = None,
    ) -> datetime:
        """Push our row's expiry to the server's now + ``ttl``; LockLost if it is gone or has
        already expired (an expired lock is never revived). ``resent``: see ``Database.run``."""

        params = {"ls": lockstring, "lock_id": lock_id, "lock_guid": guid}
        expires = self._db.run(
            lockstring,
            lambda conn: self.extend_on(conn, params, self._db.be.seconds_value(ttl)),
            resent=resent,
        )
        if expires is None:
            raise LockLost(
                f"lock {lockstring!r} (id {lock_id}) could not be extended: it had already "
                "expired, or was purged, taken over or broken; an expired lock is never revived",
                lockstring,
                lock_id,
            )
        return expires

    def extend_on(self, conn: DriverSession, row: dict[str, Any], ttl: Any) -> datetime | None:
        """Push the expiry of our ``row`` (its ``lock_id`` and ``lock_guid``) to the server's
        now + ``ttl`` (a backend's seconds value): its new expiry, or None if it is gone or has
        already expired."""
        params = {**row, "ttl": ttl}
        result = conn.execute(self._db.sql.extend, params)
        if self._db.be.update_returning:
            renewed = result.first()
            return None if renewed is None else renewed.expires
        if result.rowcount != 1:
            return None
        # Gone again already (released by another thread, or broken): not ours any more.
        times = conn.execute(self._db.sql.times_of, params).first()
        return None if times is None else times.expires

    def forget_attempt(self, members: Sequence[tuple[str, str]]) -> int:
        """Delete the rows an acquire that failed may have left (its INSERTs committed, its
        answer lost), each lockstring's by the guid it was tried with; how many were deleted."""

        def forget(conn: DriverSession) -> int:
            statement = self._db.sql.forget_attempt
            return sum(
                conn.affected(statement, {"ls": lockstring, "lock_guid": guid})
                for lockstring, guid in members
            )

        return self._db.run(members[0][0], forget)

    def checkpoint_due(self) -> bool:
        """Counts a release; whether the log is due a checkpoint (``checkpoint``) now. Counted
        without a lock: a count lost between threads only moves a checkpoint by a release."""
        if not self._checkpoints_after_releases:
            return False
        self._releases += 1
        return self._releases % CHECKPOINT_EVERY == 0

    def checkpoint(self) -> None:
        """Copy the write-ahead log back into the database file, without waiting for (or
        blocking) anyone: after a release has left its place, so that no waiter waits for it.
        A failure is logged, not raised: the release it follows has succeeded."""
        try:
            self._db.run(None, self.checkpoint_on)
        except LockError as error:
            logger.warning("could not checkpoint the database's log (%s)", error)

    def checkpoint_on(self, conn: DriverSession) -> None:
        checkpoint = self._db.sql.checkpoint
        if checkpoint is None:
            return
        try:
            conn.execute(checkpoint)
        except sa.exc.DBAPIError as error:  # another checkpoint running: it does the job
            if not self._db.be.is_transient_conflict(error):
                raise

    def guard(
        self, connection: Connection, lockstring: str, lock_id: int, guid: str, silence: float
    ) -> bool:
        """In ``connection``'s open transaction, whether our row is still ours and unexpired;
        if so, it stays so until that transaction ends, which the server brings about if the
        client is silent in it for ``silence`` seconds (see ``Lock.guard``)."""
        if not connection.in_transaction() or commits_each_statement(connection):
            raise LockError(
                "guard() needs a connection inside a transaction (not in AUTOCOMMIT): the "
                "protection lasts until that transaction ends",
                lockstring,
            )
        if connection.in_nested_transaction():
            raise LockError(
                "guard() in a savepoint (begin_nested) lasts only until the savepoint is rolled "
                "back, while the transaction around it may still commit: guard the outer "
                "transaction, before its savepoints",
                lockstring,
            )
        self._db.ensure_setup()
        params = {"ls": lockstring, "lock_id": lock_id, "lock_guid": guid}
        if not self._db.be.share_locks_rows:
            # SQLite: a write takes the database's write lock until the caller's transaction
            # ends, so nobody can take over or purge the row meanwhile.
            proven = connection.execute(self._db.sql.guard_by_writing, params).rowcount == 1
            self._check_driver_transaction(connection, lockstring)
            return proven
        # The silence bound first: set after the row lock, a client cut off between the two
        # statements kept the row locked, and the lock from being taken over, for as long as
        # TCP took to give up.
        self._db.be.bound_silence(connection, silence)
        try:
            row = connection.execute(self._db.sql.guard, params).first()
        except sa.exc.DBAPIError as error:
            if self._db.be.reads_an_older_snapshot(connection, error):
                if self._ours_now(lockstring, params):
                    raise _older_snapshot(lockstring) from error
                return False
            raise DatabaseError(
                f"guard() of lock {lockstring!r} failed: {one_line(error.orig)}", lockstring
            ) from error
        if row is None:
            if self._db.be.reads_an_older_snapshot(connection, None) and self._ours_now(
                lockstring, params
            ):
                raise _older_snapshot(lockstring)
            return False
        self._check_driver_transaction(connection, lockstring)
        return True

    def _ours_now(self, lockstring: str, params: dict[str, Any]) -> bool:
        """Whether the row is ours and unexpired, read outside the caller's transaction (whose
        snapshot may be older than the row): on one of the lock operations' own connections."""
        return (
            self._db.run(lockstring, lambda conn: conn.execute(self._db.sql.guard, params).first())
            is not None
        )

    def _check_driver_transaction(self, connection: Connection, lockstring: str) -> None:
        """After the guard's statement: refused unless the driver is in a transaction (one in
        autocommit, set on the driver where SQLAlchemy does not see it, has already committed
        the statement and let its row lock go)."""
        driver = connection.connection.driver_connection
        if self._db.be.in_transaction(driver) is False:
            raise LockError(
                "guard() needs a connection inside a transaction: this one's driver commits "
                "each statement (autocommit), so the protection would end with the guard's own",
                lockstring,
            )


def _older_snapshot(lockstring: str) -> LockError:
    return LockError(
        "guard() cannot prove the lock in this transaction: it reads the snapshot it took "
        "first (REPEATABLE READ or SERIALIZABLE), older than the lock's row or its last "
        "renewal; roll back, and guard first thing in the transaction, or use READ COMMITTED",
        lockstring,
    )
