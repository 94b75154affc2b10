"""Reading the table (its rows, a lockstring's holder, the live rows of a pattern) and
breaking a lock, the operator's tool for dead holders."""

from __future__ import annotations

import logging
from datetime import timedelta

import sqlalchemy as sa

from ..errors import DatabaseError, LockError, describe_holder, one_line
from ..execution import DriverSession
from ..identity import holder_details
from ..schema import FOREIGN_CLOCK_MARGIN
from .database import Database
from .outcomes import LockInfo, row_info

logger = logging.getLogger("sqllocker")


class Inspection:
    """The rows of ``database``'s table as ``LockInfo``, for the Locker's inspection methods,
    semaphores, read-write locks and elections; and ``break_lock``."""

    def __init__(self, database: Database) -> None:
        self._db = database

    def locks(self, pattern: str | None) -> list[LockInfo]:
        def read(conn: DriverSession) -> list[LockInfo]:
            if pattern is None:
                rows = conn.execute(self._db.sql.list_locks(False))
            else:
                glob = self._db.be.glob_value(pattern)
                rows = conn.execute(self._db.sql.list_locks(True), {"pattern": glob})
            return [row_info(row) for row in rows]

        return self._db.run(None, read)

    def overview(
        self, pattern: str | None, most_expired: int
    ) -> tuple[list[LockInfo], list[LockInfo], int]:
        """What ``top`` shows, read on one connection: the rows not expired, oldest first; at
        most ``most_expired`` expired ones, longest expired first; and how many are expired.
        Only what a screen shows is read: the expired rows a purge has yet to delete can be
        many, the held ones are few.

        Three statements, and rows expire between them: the count comes first, with the
        server's time it counted at; the held rows are those not expired by then, each placed
        as ``row_info`` finds it, one expired since counted too. A row is in one list or the
        other, never both, and in one of them (unless a screen's worth of expired rows is
        shown, and it is counted below)."""
        matching = pattern is not None

        def read(conn: DriverSession) -> tuple[list[LockInfo], list[LockInfo], int]:
            sql, be = self._db.sql, self._db.be  # set up by now
            given = {} if pattern is None else {"pattern": be.glob_value(pattern)}
            margin = {"minus_margin": be.seconds_value(-FOREIGN_CLOCK_MARGIN)}
            counted = conn.execute(sql.count_expired(matching), given | margin).one()
            count, since = int(counted.expired), counted.server_now
            rows = conn.execute(sql.expired_rows(matching), given | margin | {"most": most_expired})
            expired = [row_info(row) for row in rows]
            shown = {info.lock_id for info in expired}
            held: list[LockInfo] = []
            bounds = {
                "since": since,
                "since_foreign": since - timedelta(seconds=FOREIGN_CLOCK_MARGIN),
            }
            for info in map(row_info, conn.execute(sql.held_rows(matching), given | bounds)):
                if not info.expired:
                    held.append(info)
                    continue
                count += 1  # expired since it was counted: the last to, shown last
                if info.lock_id not in shown and len(expired) < most_expired:
                    expired.append(info)
            return held, expired, max(count, len(expired))

        return self._db.run(None, read)

    def lock_info(self, lockstring: str) -> LockInfo | None:
        def read(conn: DriverSession) -> LockInfo | None:
            row = conn.execute(self._db.sql.holder, {"ls": lockstring}).first()
            return None if row is None else row_info(row)

        return self._db.run(lockstring, read)

    def count_live(self, literal: str, wildcard: str) -> int:
        """How many rows that cannot be taken over now have a lockstring that is ``literal``
        followed by what the glob ``wildcard`` matches."""
        params = {
            "pattern": self._db.be.literal_glob(literal) + self._db.be.glob_value(wildcard),
            **self._db.expiry,
        }
        return int(
            self._db.run(
                literal, lambda conn: conn.execute(self._db.sql.count_live, params).one().live
            )
        )

    def announce_leader(self, name: str) -> None:
        """Tell the observers of the election ``name`` to read its leader again (PostgreSQL:
        a NOTIFY they take as a hint only); nothing elsewhere."""
        self._db.ensure_setup()
        statement = self._db.sql.leader_notice
        if statement is not None:
            self._db.run(name, lambda conn: conn.execute(statement, {"ls": name}))

    def count_permits(self, literal: str, wildcard: str, turn: str) -> tuple[int, LockInfo | None]:
        """``count_live``, and the row of the lockstring ``turn`` (a semaphore's turn: see
        ``sqllocker.permits``), live or expired, or None, read on one connection."""
        params = {
            "pattern": self._db.be.literal_glob(literal) + self._db.be.glob_value(wildcard),
            **self._db.expiry,
        }

        def read(conn: DriverSession) -> tuple[int, LockInfo | None]:
            live = int(conn.execute(self._db.sql.count_live, params).one().live)
            row = conn.execute(self._db.sql.holder, {"ls": turn}).first()
            return live, None if row is None else row_info(row)

        return self._db.run(literal, read)

    def permits(self, literal: str, wildcard: str) -> list[LockInfo]:
        """The unexpired rows whose lockstring is ``literal`` then what ``wildcard`` matches."""

        def read(conn: DriverSession) -> list[LockInfo]:
            pattern = self._db.be.literal_glob(literal) + self._db.be.glob_value(wildcard)
            rows = conn.execute(self._db.sql.list_locks(True), {"pattern": pattern})
            return [info for info in map(row_info, rows) if not info.expired]

        return self._db.run(literal, read)

    def expired_locks(self) -> list[LockInfo]:
        def read(conn: DriverSession) -> list[LockInfo]:
            params = self._db.expiry
            return [row_info(row) for row in conn.execute(self._db.sql.purgeable, params)]

        return self._db.run(None, read)

    def break_lock(self, lockstring: str, lock_id: int | None) -> LockInfo | None:
        def delete(conn: DriverSession) -> LockInfo | None:
            row = conn.execute(self._db.sql.holder, {"ls": lockstring}).first()
            if row is None or (lock_id is not None and row.id != lock_id):
                return None
            # By id: if the row was released and taken again since we read it, nothing is broken.
            params = {"ls": lockstring, "lock_id": row.id}
            deleted = conn.affected(self._db.sql.break_lock, params)
            return row_info(row) if deleted else None

        try:
            # One retry, for a deadlock; a lock wait that times out twice is a transaction that
            # holds the row (a guard()), which more waits would not see end any sooner.
            broken = self._db.run(lockstring, delete, conflict_retries=1)
        except DatabaseError as error:
            cause = error.__cause__
            if not (  # never connected (the database unreachable): no backend to ask
                self._db.is_set_up
                and isinstance(cause, sa.exc.DBAPIError)
                and self._db.be.is_transient_conflict(cause)
            ):
                raise
            raise LockError(
                f"cannot break lock {lockstring!r} now: its row is locked by a transaction still "
                "open (its holder's guard(), or another session's); it can be broken once that "
                "transaction ends (the server ends a guarded transaction whose client has been "
                f"silent for the lock's remaining life): {one_line(cause.orig)}",
                lockstring,
            ) from error
        if broken is not None:
            logger.warning(
                "broke lock %r (id %d) held by %s, on behalf of %s",
                lockstring,
                broken.lock_id,
                describe_holder(broken.locked_by),
                describe_holder(holder_details({})),
            )
        return broken
