"""The lock operations on one table, shared by the sync and the async front ends.

Each operation checks out a connection, runs its statement(s), each one an autocommit
transaction of its own, and gives the connection back, so holding a lock holds no connection,
and a caller's own transaction never contains (or waits on, or rolls back) a lock row. No
operation needs a transaction around several statements: every write checks, in its own WHERE
clause, what makes it right (our id and guid, or expiry by the server's clock), so a row that
changed between two statements makes the second do nothing rather than something wrong.

The code here is synchronous. ``Locker`` calls it directly; ``sqllocker.asyncio.AsyncLocker``
calls it inside SQLAlchemy's ``greenlet_spawn`` on its AsyncEngine's ``sync_engine``, where every
driver call becomes an await on the event loop. So both front ends send the very same
statements with the very same retries and error handling; they differ only in how they wait,
hold locks and keep them alive.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.pool import QueuePool
from sqlalchemy.sql import ClauseElement

from . import clock, deadlines
from .backends import Backend, backend_class, backend_for
from .connections import ConnectionStack
from .engine import describe_url, prepares_statements
from .errors import (
    DatabaseError,
    ForeignTable,
    LockBusy,
    LockError,
    LockLost,
    LockValueError,
    TableMissing,
    UnsafeDatabase,
    UnsafeDatabaseWarning,
    describe_holder,
    one_line,
)
from .execution import DriverSession, PreparedCache, kept_cursor
from .identity import holder_details, public_details
from .schema import FOREIGN_CLOCK_MARGIN, ID_ORDER_STRIPES, id_order_table, lock_table
from .server_settings import UnsafeSetting
from .sqlalchemy_internals import most_connections
from .statements import Statements

logger = logging.getLogger("sqllocker")

T = TypeVar("T")

# Attempts at one acquire when the holder vanishes between our refused INSERT and our look-up of
# who holds it; past this, the caller is told "busy" (and, with a wait, simply tries again later).
_ATTEMPTS_PER_TRY = 3
# Retries of an operation that the database failed because of contention (deadlock victim,
# lock-wait timeout, SQLite busy). Each attempt may itself wait up to the backend's lock timeout.
_CONFLICT_RETRIES = 8
# How often a caller looks whether another has finished setting up (rare: first use, and after
# a lost connection).
_SETUP_TURN_SECONDS = 0.001
# SQLite: a Locker's releases checkpoint the write-ahead log every this many. A lock cycle
# writes about 7 pages to the log, so this is about SQLite's own limit of 1000 pages.
CHECKPOINT_EVERY = 128
# The fewest connections a pool must allow for a Locker to keep one listening for releases:
# the lock operations must always have at least two of the rest.
LISTENING_BUDGET = 3
_FIRST_CONFLICT_DELAY = 0.005


@dataclass(frozen=True)
class LockInfo:
    """One row of the lock table, as ``Locker.locks`` reports it."""

    lock_id: int
    lockstring: str
    created: datetime
    expires: datetime
    locked_by: dict[str, Any]
    expired: bool
    seconds_left: float  # until expiry by the server's clock; negative once expired
    # Written by DBIx::Locker (its guid is the column's default): its times are its client's
    # local times, so it is taken over or purged only once expired in every time zone.
    dbix_locker: bool = False
    # Created after the server's now: a client's clock, not the server's, wrote it (DBIx::Locker
    # east of UTC writes times hours ahead).
    created_in_future: bool = False


def _lock_info(row: Any) -> LockInfo:
    return LockInfo(
        lock_id=row.id,
        lockstring=row.lockstring,
        created=row.created,
        expires=row.expires,
        locked_by=public_details(row.locked_by),
        expired=bool(row.expired),
        seconds_left=(row.expires - row.server_now).total_seconds(),
        dbix_locker=bool(row.dbix_locker),
        created_in_future=row.created > row.server_now,
    )


class Acquired:
    """Our row was inserted. ``created`` and ``expires`` may be as the driver read them (see
    ``Statements._returned``). ``age``: seconds the row had already existed, by the server's
    clock, when a hand-off notification's claim found it (``claim_grant``). A row an attempt
    finds under our guid (an earlier attempt's, whose answer was lost) is renewed by it
    first (``_learn_holder``): its expiry then counts from that attempt.

    ``sent_at``, set by ``try_acquire`` before it hands the Acquired on: the monotonic time the
    successful statement was sent, less ``age``. The lock's validity deadline counts from it
    (see ``lock.py``). Set on the one object rather than copied into a second, immutable one:
    the copy was a measurable share of the library's own Python in an uncontended cycle.
    """

    __slots__ = ("age", "created", "expires", "lock_id", "sent_at", "took_over")

    def __init__(self, lock_id: int, created: object, expires: object, age: float = 0.0) -> None:
        self.lock_id = lock_id
        self.created = created
        self.expires = expires
        self.age = age
        self.sent_at = 0.0
        self.took_over = False  # an expired holder's row was replaced (sqllocker.telemetry)


class Joined(NamedTuple):
    """A ticket taken (``LockOperations.join_line``): its number; whether the row is held;
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


def _nothing_more(session: DriverSession) -> None:
    """An operation that is only its set-up (``LockOperations.ensure_setup``)."""


class LockOperations:
    """The lock operations on ``table_name`` through ``engine`` (a sync Engine, or an AsyncEngine's
    ``sync_engine`` when called from a greenlet).

    ``owns_engine``: the engine was made by sqllocker (AUTOCOMMIT on every connection, so raw
    pooled connections serve directly; disposed by :meth:`close`). ``transaction_pooling``: the
    connections reach PostgreSQL through a pooler that lends a server session per transaction,
    so nothing may rest on a session's state (see ``waits_by_ticket``).
    ``direct_connections``: run the lock operations on a ConnectionStack of the engine's
    connections rather than through its pool (an engine sqllocker made: see
    ``connections.py``), whose callers wait for a free one on ``connection_changes`` (a
    ``threading.Condition``, or its twin for tasks). ``sleep`` is how a retry after contention
    waits: ``time.sleep``, or an await of ``asyncio.sleep`` for the async front end.
    """

    def __init__(
        self,
        engine: Engine,
        table_name: str,
        *,
        owns_engine: bool,
        grace: float,
        auto_create: bool | None,
        strict: bool,
        transaction_pooling: bool = False,
        direct_connections: bool = False,
        connection_changes: Callable[[], Any] = threading.Condition,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.engine = engine
        self.url = engine.url
        self.table_name = table_name
        self.table = lock_table(table_name)
        self.owns_engine = owns_engine
        self.grace = grace
        # By default only for SQLite, whose file sqllocker owns; a server's schema is the
        # operator's (`sqllocker migrate`).
        if auto_create is None:
            auto_create = backend_class(engine.dialect.name).creates_table_on_first_use
        self.auto_create = auto_create
        self.strict = strict
        self.transaction_pooling = transaction_pooling
        self._sleep = sleep
        # An in-memory SQLite database lives in one connection (SingletonThreadPool): no stack.
        direct = direct_connections and owns_engine and isinstance(engine.pool, QueuePool)
        self._stack = ConnectionStack(engine, connection_changes) if direct else None
        # Only an engine sqllocker made has SQLite's own checkpoints turned off.
        backend = backend_class(engine.dialect.name)
        self._checkpoints_after_releases = owns_engine and backend.checkpoints_after_releases
        self._releases = 0
        # Whether the pool can spare a connection for the release listener (see
        # waits_by_ticket); the pool's limits never change.
        budget = self.connection_budget
        self._pool_spares_listener = budget is None or budget >= LISTENING_BUDGET
        self._backend: Backend | None = None
        # The parameters of the test whether a row may be taken over or purged now (set up
        # with the backend, which writes them; never changed by their users).
        self._expiry: dict[str, Any] = {}
        self._statements: Statements | None = None
        # See ServerSettings.replays_inserts and retries_autocommit: where a group's rows, and
        # where a lone acquire's row, are read back after their commit.
        self._inserts_replayed = False
        self._lone_inserts_retried = False
        self._prepared: PreparedCache
        self._needs_setup = True  # see ensure_setup
        self._setup_lock = threading.Lock()

    # -- the lock operations -----------------------------------------------------------------------

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
        any INSERT (``_refused_by_holder``)."""

        sent_at = 0.0

        def attempt(conn: DriverSession) -> Acquired | Refused:
            nonlocal sent_at
            # The validity deadline counts from before the attempt's statements are sent (the
            # server's expiry cannot start earlier), on each connection _run tries: not from
            # before a first one whose answer was lost, and a reconnection after an outage.
            sent_at = clock.now()
            outcome = self._acquire_on(
                conn, lockstring, guid, ttl, details, queue_key, look_first, in_line
            )
            if self._lone_inserts_retried and isinstance(outcome, Acquired):
                return self._as_stored(conn, lockstring, guid, outcome)
            return outcome

        for _attempt in range(_ATTEMPTS_PER_TRY):
            outcome = self._run(lockstring, attempt)
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

        def attempt(conn: DriverSession) -> list[Acquired] | Refused:
            nonlocal sent_at
            sent_at = clock.now()  # as for one lock: before this connection's statements
            return self._acquire_all_on(conn, members, ttl, details)

        outcome = self._run(members[0][0], attempt)
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
        be = self._be
        conn.transaction_control(be.begin)
        lockstring = members[0][0]
        try:
            taken: list[Acquired] = []
            for lockstring, guid in members:
                params = self._acquire_params(lockstring, guid, ttl, details)
                outcome = self._insert_or_learn_holder(conn, params)
                if not isinstance(outcome, Acquired):
                    conn.transaction_control("ROLLBACK")
                    return outcome
                taken.append(outcome)
            conn.transaction_control("COMMIT")
        except sa.exc.DBAPIError as error:
            self._roll_back_quietly(conn)
            if be.is_transient_conflict(error):
                # As for one lock: a wait for a member's key that ran out names who holds it.
                return Refused(self._key_blocker(conn, lockstring), None)
            raise
        except BaseException:
            self._roll_back_quietly(conn)
            raise
        # Committed: a failure from here on is tried again (_run), and the rows found ours.
        if self._inserts_replayed:
            return self._all_as_stored(conn, members, taken)
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
        params = {"lock_id": lock_id, "lock_guid": guid}
        sent_at = clock.now()
        row = self._run(lockstring, lambda conn: conn.execute(self._sql.own_row, params).first())
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

    def release(
        self, lockstring: str, lock_id: int, guid: str, hold_at_least: float | None = None
    ) -> None:
        """Delete our row; LockLost if it was no longer ours. With ``hold_at_least``, a release
        within that many seconds of the row's creation keeps the row until then instead (see
        ``Statements.finish_within_window``)."""
        params: dict[str, Any] = {"lock_id": lock_id, "lock_guid": guid}
        if hold_at_least is not None:
            params["hold"] = self._be.seconds_value(hold_at_least)
            kept = self._run(
                lockstring, lambda conn: conn.affected(self._sql.finish_within_window, params)
            )
            if kept == 1:
                logger.debug(
                    "finished %r (id %d); it stays held till its window ends", lockstring, lock_id
                )
                return
        deleted = self._run(lockstring, lambda conn: conn.affected(self._sql.release, params))
        if deleted != 1:
            raise LockLost(
                f"lock {lockstring!r} (id {lock_id}) was no longer ours at release: it expired "
                "and was purged, taken over or broken; work done under it may have overlapped "
                "with another holder's",
                lockstring,
                lock_id,
            )
        logger.debug("released %r (id %d)", lockstring, lock_id)

    def forget_attempt(self, lockstring: str, guid: str) -> int:
        """Delete the row an acquire by ``guid`` that failed may have left (its INSERT
        committed, its answer lost); how many were deleted."""
        params = {"ls": lockstring, "lock_guid": guid}
        return self._run(lockstring, lambda conn: conn.affected(self._sql.forget_attempt, params))

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
            self._run(None, self._checkpoint_on)
        except LockError as error:
            logger.warning("could not checkpoint the database's log (%s)", error)

    def _checkpoint_on(self, conn: DriverSession) -> None:
        checkpoint = self._sql.checkpoint
        if checkpoint is None:
            return
        try:
            conn.execute(checkpoint)
        except sa.exc.DBAPIError as error:  # another checkpoint running: it does the job
            if not self._be.is_transient_conflict(error):
                raise

    def extend(self, lockstring: str, lock_id: int, guid: str, ttl: float) -> datetime:
        """Push our row's expiry to the server's now + ``ttl``; LockLost if it is gone or has
        already expired (an expired lock is never revived)."""

        params = {"lock_id": lock_id, "lock_guid": guid}
        expires = self._run(
            lockstring, lambda conn: self._extend_on(conn, params, self._be.seconds_value(ttl))
        )
        if expires is None:
            raise LockLost(
                f"lock {lockstring!r} (id {lock_id}) could not be extended: it had already "
                "expired, or was purged, taken over or broken; an expired lock is never revived",
                lockstring,
                lock_id,
            )
        return expires

    def _extend_on(self, conn: DriverSession, row: dict[str, Any], ttl: Any) -> datetime | None:
        """Push the expiry of our ``row`` (its ``lock_id`` and ``lock_guid``) to the server's
        now + ``ttl`` (a backend's seconds value): its new expiry, or None if it is gone or has
        already expired."""
        params = {**row, "ttl": ttl}
        result = conn.execute(self._sql.extend, params)
        if self._be.update_returning:
            renewed = result.first()
            return None if renewed is None else renewed.expires
        if result.rowcount != 1:
            return None
        # Gone again already (released by another thread, or broken): not ours any more.
        times = conn.execute(self._sql.times_of, params).first()
        return None if times is None else times.expires

    def purge_expired(self, batch_size: int, pause_ratio: float) -> int:
        """Delete rows expired beyond grace in batches, each its own short transaction, so a
        large purge never blocks acquirers for long; returns how many.

        After each full batch it rests ``pause_ratio`` times as long as the batch took: a purge
        flat out keeps a server core busy (and its commits share the log flush with the
        acquirers'), which on a small machine multiplied a concurrent worker's p99 by 4-7.
        It then sweeps the tickets of waiters gone since (``Statements.sweep_stale_requests``),
        which nothing else might ever delete.
        """
        total = 0
        while True:
            started = clock.now()
            deleted = self._run(None, lambda conn: self._purge_batch(conn, batch_size))
            total += deleted
            if deleted < batch_size:
                break
            if pause_ratio:
                self._sleep((clock.now() - started) * pause_ratio)
        if total:
            logger.info("purged %d expired lock(s) from %s", total, self.table_name)
        if self._sql.sweep_stale_requests is not None:
            swept = self._run(None, self._sweep_stale_requests)
            if swept:
                logger.info("swept %d ticket(s) of Lockers gone from %s", swept, self.table_name)
        return total

    def locks(self, pattern: str | None) -> list[LockInfo]:
        def read(conn: DriverSession) -> list[LockInfo]:
            if pattern is None:
                rows = conn.execute(self._sql.list_locks())
            else:
                glob = self._be.glob_value(pattern)
                rows = conn.execute(self._sql.list_locks(pattern=True), {"pattern": glob})
            return [_lock_info(row) for row in rows]

        return self._run(None, read)

    def count_live(self, literal: str, wildcard: str) -> int:
        """How many rows that cannot be taken over now have a lockstring that is ``literal``
        followed by what the glob ``wildcard`` matches."""
        params = {
            "pattern": self._be.literal_glob(literal) + self._be.glob_value(wildcard),
            **self._expiry_params(),
        }
        return int(
            self._run(literal, lambda conn: conn.execute(self._sql.count_live, params).one().live)
        )

    def announce_leader(self, name: str) -> None:
        """Tell the observers of the election ``name`` to read its leader again (PostgreSQL:
        a NOTIFY they take as a hint only); nothing elsewhere."""
        self.ensure_setup()
        statement = self._sql.leader_notice
        if statement is not None:
            self._run(name, lambda conn: conn.execute(statement, {"ls": name}))

    def count_permits(self, literal: str, wildcard: str, turn: str) -> tuple[int, LockInfo | None]:
        """``count_live``, and the row of the lockstring ``turn`` (a semaphore's turn: see
        ``sqllocker.permits``), live or expired, or None, read on one connection."""
        params = {
            "pattern": self._be.literal_glob(literal) + self._be.glob_value(wildcard),
            **self._expiry_params(),
        }

        def read(conn: DriverSession) -> tuple[int, LockInfo | None]:
            live = int(conn.execute(self._sql.count_live, params).one().live)
            row = conn.execute(self._sql.holder, {"ls": turn}).first()
            return live, None if row is None else _lock_info(row)

        return self._run(literal, read)

    def permits(self, literal: str, wildcard: str) -> list[LockInfo]:
        """The unexpired rows whose lockstring is ``literal`` then what ``wildcard`` matches."""

        def read(conn: DriverSession) -> list[LockInfo]:
            pattern = self._be.literal_glob(literal) + self._be.glob_value(wildcard)
            rows = conn.execute(self._sql.list_locks(pattern=True), {"pattern": pattern})
            return [info for info in map(_lock_info, rows) if not info.expired]

        return self._run(literal, read)

    def lock_info(self, lockstring: str) -> LockInfo | None:
        def read(conn: DriverSession) -> LockInfo | None:
            row = conn.execute(self._sql.holder, {"ls": lockstring}).first()
            return None if row is None else _lock_info(row)

        return self._run(lockstring, read)

    def join_line(
        self,
        lockstring: str,
        guid: str,
        ttl: float,
        details: dict[str, Any],
        liveness_key: int,
        replacing: bool = False,
    ) -> Joined:
        """Take a ticket for ``lockstring`` (``sqllocker.tickets``), alive while
        ``liveness_key`` is held: its number, and whether the row is held (where the backend
        hands the row over, which reads it in the same statement; elsewhere False: the
        caller's polls find out).

        ``replacing``: an earlier attempt of this waiter's (``guid``) failed, and may have
        taken a ticket all the same, its answer lost with its connection; so may an attempt
        retried here. Such a ticket stays live, and would keep everyone behind it waiting (or,
        where releases hand rows over, be handed one nobody claims): it is given up first."""
        params = {
            "ls": lockstring,
            "lock_guid": guid,
            "holder": details,
            "ttl": ttl,
            "liveness_key": liveness_key,
        }
        earlier = {"ticket": None, "ls": lockstring, "lock_guid": guid, "give_back": False}
        attempted = replacing

        def join(conn: DriverSession) -> Joined:
            nonlocal attempted
            replaced = attempted
            if replaced:
                conn.execute(self._sql.leave_line, earlier)
            attempted = True
            result = conn.execute(self._sql.join_line, params)
            if not self._be.hands_over:
                assert result.lastrowid is not None, "a ticket's INSERT reports its id"
                return Joined(int(result.lastrowid), False, replaced)
            row = result.one()
            return Joined(int(row.ticket), bool(row.held), replaced)

        return self._run(lockstring, join)

    def leave_line(self, lockstring: str, ticket: int | None, guid: str, give_back: bool) -> bool:
        """Give up ``ticket``; with ``give_back``, a row already handed to it is deleted again
        (its waiter stopped waiting), where releases hand rows over. Says whether one was."""
        params = {"ticket": ticket, "ls": lockstring, "lock_guid": guid, "give_back": give_back}

        def leave(conn: DriverSession) -> bool:
            result = conn.execute(self._sql.leave_line, params)
            return self._be.hands_over and bool(result.one().given_back)

        given_back = self._run(lockstring, leave)
        if given_back:
            logger.debug("gave back %r, handed over to a waiter that stopped waiting", lockstring)
        return given_back

    def expired_locks(self) -> list[LockInfo]:
        def read(conn: DriverSession) -> list[LockInfo]:
            params = self._expiry_params()
            return [_lock_info(row) for row in conn.execute(self._sql.purgeable, params)]

        return self._run(None, read)

    def break_lock(self, lockstring: str, lock_id: int | None) -> LockInfo | None:
        def delete(conn: DriverSession) -> LockInfo | None:
            row = conn.execute(self._sql.holder, {"ls": lockstring}).first()
            if row is None or (lock_id is not None and row.id != lock_id):
                return None
            # By id: if the row was released and taken again since we read it, nothing is broken.
            params = {"ls": lockstring, "lock_id": row.id}
            deleted = conn.affected(self._sql.break_lock, params)
            return _lock_info(row) if deleted else None

        try:
            # One retry, for a deadlock; a lock wait that times out twice is a transaction that
            # holds the row (a guard()), which more waits would not see end any sooner.
            broken = self._run(lockstring, delete, conflict_retries=1)
        except DatabaseError as error:
            cause = error.__cause__
            if not (isinstance(cause, sa.exc.DBAPIError) and self._be.is_transient_conflict(cause)):
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

    def guard(
        self, connection: Connection, lockstring: str, lock_id: int, guid: str, silence: float
    ) -> bool:
        """In ``connection``'s open transaction, whether our row is still ours and unexpired;
        if so, it stays so until that transaction ends, which the server brings about if the
        client is silent in it for ``silence`` seconds (see ``Lock.guard``)."""
        if not connection.in_transaction():
            raise LockError(
                "guard() needs a connection inside a transaction: the protection lasts until "
                "that transaction ends",
                lockstring,
            )
        self.ensure_setup()
        params = {"lock_id": lock_id, "lock_guid": guid}
        if not self._be.share_locks_rows:
            # SQLite: a write takes the database's write lock until the caller's transaction
            # ends, so nobody can take over or purge the row meanwhile.
            return connection.execute(self._sql.guard_by_writing, params).rowcount == 1
        if connection.execute(self._sql.guard, params).first() is None:
            return False
        self._be.bound_silence(connection, silence)
        return True

    def create_table(self) -> None:
        """Create or upgrade the table by applying the shipped migrations; safe to repeat."""
        from .migrations import upgrade

        upgrade(self.engine, self.table_name)
        # A migration may change what the settings check found (0006's stripes table).
        self._needs_setup = True

    def close(self) -> None:
        if self.owns_engine:
            self.engine.dispose()

    def forget_connections(self) -> None:
        """Drop the engine's connections without closing them (an AsyncLocker's, when the event
        loop they were made on has ended, which alone could close them)."""
        if self._stack is not None:
            self._stack.forget()
        if self.owns_engine:
            self.engine.dispose(close=False)

    @property
    def connection_budget(self) -> int | None:
        """How many connections the engine's pool lets be open at once (None: no limit), which
        the lock operations share with the Locker's listener."""
        pool = self.engine.pool
        return most_connections(pool) if isinstance(pool, QueuePool) else None

    def reserve_for_waiting(self) -> None:
        """Set aside one of the pool's connections for the Locker's listener (which keeps its
        waiters' tickets alive), checked out of the pool for as long as it listens. Asked
        before any connection is made (whether the table has its line of tickets is not known
        yet): a ConnectionStack, which the pool does not see, opens one fewer from the start."""
        dialect = self.engine.dialect
        if self.transaction_pooling or not backend_class(dialect.name).takes_tickets(dialect):
            return
        if self._pool_spares_listener and self._stack is not None:
            self._stack.reserve(1)

    def connections(self) -> tuple[int, int]:
        """(open, in use): the connections the lock operations have now, for the benchmark and
        the soak test (the engine's pool also counts those it lends to other statements)."""
        if self._stack is not None:
            return self._stack.open, self._stack.in_use
        pool: Any = self.engine.pool
        return pool.checkedin() + pool.checkedout(), pool.checkedout()

    # -- the statements of each operation ----------------------------------------------------------

    def _as_stored(
        self, conn: DriverSession, lockstring: str, guid: str, acquired: Acquired
    ) -> Acquired | Refused:
        """``acquired`` as its row stands once committed, read back by guid, where the server's
        answer to the INSERT is not the last word (``ServerSettings.retries_autocommit``; for a
        group's rows, ``replays_inserts``): a row inserted again carries its new id, and a
        lockstring whose row is not ours is refused, whatever the INSERT answered."""
        params = {"ls": lockstring, "lock_guid": guid, **self._expiry_params()}
        row = conn.execute(self._sql.holder_for_acquirer, params).first()
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

    def _all_as_stored(
        self, conn: DriverSession, members: list[tuple[str, str]], taken: list[Acquired]
    ) -> list[Acquired] | Refused:
        """A group's rows read back as ``_as_stored`` reads one: a member whose row is not ours
        refuses the group, which gives back the members it did take."""
        stored = [
            self._as_stored(conn, lockstring, guid, acquired)
            for (lockstring, guid), acquired in zip(members, taken, strict=True)
        ]
        acquired = [outcome for outcome in stored if isinstance(outcome, Acquired)]
        if len(acquired) == len(stored):
            return acquired
        for (_lockstring, guid), outcome in zip(members, stored, strict=True):
            if isinstance(outcome, Acquired):
                conn.affected(self._sql.release, {"lock_id": outcome.lock_id, "lock_guid": guid})
        return next(outcome for outcome in stored if isinstance(outcome, Refused))

    def _acquire_on(
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
        be, sql = self._be, self._sql
        params = self._acquire_params(lockstring, guid, ttl, details)
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
                return self._learn_holder(conn, params)
            if look_first and (refused := self._refused_by_holder(conn, params)):
                return refused
            return self._insert_or_learn_holder(conn, params)
        except sa.exc.DBAPIError as error:
            if not be.is_transient_conflict(error):
                raise
            logger.debug("acquire of %r met contention (%s); retrying", lockstring, error.orig)
            return Refused(self._key_blocker(conn, lockstring), None)

    def _key_blocker(self, conn: DriverSession, lockstring: str) -> LockBusy | None:
        """After an acquire waited out its bound for the lockstring's id-order key
        (PostgreSQL): the LockBusy that names the session holding that key, if one does. Held
        longer than an INSERT, it is held by a session outside sqllocker's protocol."""
        statement = self._sql.id_order_blocker
        if statement is None:
            return None
        try:
            row = conn.execute(statement, {"ls": lockstring}).first()
        except sa.exc.DBAPIError:
            return None  # pg_locks not readable: the caller says "busy", as it would anyway
        return None if row is None else LockBusy(lockstring, key_holder_pid=row.pid)

    def _acquire_params(
        self, lockstring: str, guid: str, ttl: float, details: dict[str, Any]
    ) -> dict[str, Any]:
        be = self._be
        return {
            "ls": lockstring,
            "lock_guid": guid,
            "ttl": be.seconds_value(ttl),
            "holder": details,
            **self._expiry_params(),
        }

    def _expiry_params(self) -> dict[str, Any]:
        """The parameters of the test whether a row may be taken over or purged now."""
        return self._expiry

    def _insert_or_learn_holder(
        self, conn: DriverSession, params: dict[str, Any]
    ) -> Acquired | Refused:
        """Insert our row; if refused, read the holder's row and take it over if it has expired.

        Each statement commits by itself: what makes this safe is in the statements, not in a
        transaction around them. The INSERT is refused while any row holds the lockstring; the
        takeover deletes (or, PostgreSQL, replaces) the row only if it is still expired when
        it runs, so of several acquirers racing for one expired row one wins and the others'
        INSERTs are refused by the winner's row.
        """
        acquired = self._insert(conn, self._sql.acquire, params)
        if acquired is not None:
            return acquired
        return self._learn_holder(conn, params)

    def _refused_by_holder(self, conn: DriverSession, params: dict[str, Any]) -> Refused | None:
        """A waiter polling the row by ticket reads it before any INSERT: the refusal by a
        live holder's row, or None (free, ours, or takeable: the INSERT follows). A refused
        INSERT takes a lock on the holder's row, which its release then waits for, and costs
        a round trip more than the read. (Reading whether a live ticket stands ahead as well
        cost more than the INSERTs it spared: docs/speed-history.md.)"""
        held = conn.execute(self._sql.holder_for_acquirer, params).first()
        if held is None or held.ours or held.takeable:
            return None
        return self._refused_by(held, params)

    def _learn_holder(self, conn: DriverSession, params: dict[str, Any]) -> Acquired | Refused:
        """After our INSERT was refused: the row that refused it, ours after all, or taken
        over if it has expired."""
        row = conn.execute(self._sql.holder_for_acquirer, params).first()
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
            mine = {"lock_id": row.id, "lock_guid": params["lock_guid"]}
            expires = self._extend_on(conn, mine, params["ttl"])
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
        sql = self._sql
        taken = None
        if self._be.atomic_takeover:
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
        be = self._be
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
        mine = {"lock_id": lock_id, "lock_guid": params["lock_guid"]}
        times = conn.execute(self._sql.times_of, mine).first()
        if times is None:
            logger.info("%r was inserted (id %d), and gone when read back", params["ls"], lock_id)
            return True, None
        return True, (lock_id, times.created, times.expires)

    def _check_silent_refusal(self, params: dict[str, Any]) -> None:
        """An INSERT that inserted nothing without an error: held, under ON CONFLICT DO NOTHING.
        On MySQL a held row is a duplicate-key error; nothing inserted means that the stripes
        table had no row to lock for the lockstring, which would refuse it for ever."""
        id_order = self._sql.id_order
        if id_order is None:
            return
        raise TableMissing(
            f"lock table {self.table_name!r}'s {id_order.name} lacks the row of "
            f"{params['ls']!r}'s stripe; insert again the stripes 0 to {ID_ORDER_STRIPES - 1} "
            "that migration 0006 inserted",
            params["ls"],
        )

    def _purge_batch(self, conn: DriverSession, batch_size: int) -> int:
        params = self._expiry_params()
        deleted = conn.affected(self._sql.purge_batch(batch_size), params)
        if deleted:
            # The purge pays for its own WAL pages here, rather than the next lock operation
            # (the rounds that showed it are in docs/speed-history.md).
            self._checkpoint_on(conn)
        return deleted

    def _sweep_stale_requests(self, conn: DriverSession) -> int:
        sweep = self._sql.sweep_stale_requests
        if sweep is None:
            return 0
        result = conn.execute(sweep)
        return int(result.one().swept) if self._be.hands_over else result.rowcount

    # -- connections, retries and errors -----------------------------------------------------------

    def _run(
        self,
        lockstring: str | None,
        operation: Callable[[DriverSession], T],
        conflict_retries: int = _CONFLICT_RETRIES,
    ) -> T:
        """Run ``operation`` on a pooled connection, translating driver errors into LockErrors.

        Every operation is safe to repeat (acquire recognises its own row by guid), so two kinds
        of failure are retried: a connection that turns out dead (the server restarted since it
        was pooled) is replaced once, and contention that the database resolved by rolling the
        statement back (a deadlock, a lock-wait timeout, SQLite busy) is retried with backoff,
        so that, say, a release chosen as a deadlock victim still releases.
        """
        created_table = False
        retried_connection = False
        conflicts = read_only = 0
        while True:
            try:
                return self._run_once(operation)
            except sa.exc.DBAPIError as error:
                if self._backend is not None and self._be.is_read_only(error):
                    # A standby, or a primary demoted by a failover: its connections were
                    # dropped (see _run_once), and a fresh one reaches the new primary once it
                    # is there, if the URL names every host.
                    self._needs_setup = True
                    if read_only < _CONFLICT_RETRIES:
                        read_only += 1
                        logger.warning("%s accepts no writes; reconnecting", describe_url(self.url))
                        self._sleep(random.uniform(0, _FIRST_CONFLICT_DELAY * 2**read_only))
                        continue
                    raise DatabaseError(
                        f"{describe_url(self.url)} accepts no writes (a standby, or a primary "
                        "demoted by a failover): name every host of the cluster in the URL "
                        "(postgresql://user@host1:port1,host2:port2/db), so that sqllocker "
                        f"reconnects to the primary: {one_line(error.orig)}",
                        lockstring,
                        outage=True,
                    ) from error
                if error.connection_invalidated:
                    self._needs_setup = True  # the server may have restarted: see ensure_setup
                    # (Not once its deadline has passed: see sqllocker.deadlines.)
                    if not retried_connection and not deadlines.passed():
                        retried_connection = True
                        logger.warning(
                            "database connection was lost (%s); reconnecting", error.orig
                        )
                        continue
                if (
                    self._backend is not None
                    and self._be.is_transient_conflict(error)
                    and conflicts < conflict_retries
                ):
                    conflicts += 1
                    logger.info("contention (%s); trying again", one_line(error.orig))
                    self._sleep(random.uniform(0, _FIRST_CONFLICT_DELAY * 2**conflicts))
                    continue
                if self._backend is not None and self._be.is_missing_table(error):
                    if self.auto_create and not created_table:
                        created_table = True
                        logger.info("creating lock table %s", self.table_name)
                        self.create_table()
                        continue
                    raise self._table_missing(lockstring) from error
                raise DatabaseError(
                    f"database error on {describe_url(self.url)}"
                    + (f" for lock {lockstring!r}" if lockstring is not None else "")
                    + f": {one_line(error.orig)}",
                    lockstring,
                    outage=error.connection_invalidated and self._backend is not None,
                ) from error

    def _run_once(self, operation: Callable[[DriverSession], T]) -> T:
        """``operation`` on a connection of its own, in autocommit mode, given back after.

        A Locker on an engine sqllocker made runs it on its ConnectionStack; on a caller's
        Engine, on a connection of the engine's pool (see :meth:`_pooled`).
        """
        if self._needs_setup:
            self._set_up()
        stack = self._stack
        if stack is None:
            with self._pooled() as session:
                return operation(session)
        try:
            held = stack.take()
        except sa.exc.TimeoutError as error:
            raise self._no_free_connection(error) from error
        except self._connect_errors as error:
            raise self.unreachable(error) from error
        try:
            if held.session is None:
                one_call = self._be.in_one_call(held.connection)
                held.session = DriverSession(held.connection, held.cursor, self._prepared, one_call)
            with deadlines.interrupting(self._be.interrupt, held.connection):
                result = operation(held.session)
        except sa.exc.DBAPIError as error:
            if error.connection_invalidated or self._be.is_read_only(error):
                stack.discard(held)
                # The server went away, or takes no writes: every connection to it is as
                # useless as this one (the stack closes its idle ones when the engine is
                # disposed of).
                self.engine.dispose()
            else:
                stack.give_back(held)
            raise
        except Exception:
            stack.give_back(held)
            raise
        except BaseException:
            # Interrupted mid-statement: the connection's state is unknown (a statement may
            # still be running), so it must not be reused.
            stack.discard(held)
            raise
        stack.give_back(held)
        return result

    @contextmanager
    def _pooled(self) -> Iterator[DriverSession]:
        """A connection of the engine's pool, in autocommit mode, for one operation.

        An engine sqllocker made is AUTOCOMMIT for every connection, so its raw pooled
        connections serve directly; a caller's Engine gets AUTOCOMMIT through an SQLAlchemy
        Connection, which also restores the connection's own setting when it goes back.
        """
        try:
            checkout: Any = self.engine.raw_connection() if self.owns_engine else None
            connection = None if self.owns_engine else self.engine.connect()
        except sa.exc.TimeoutError as error:
            raise self._no_free_connection(error) from error
        except self._connect_errors as error:
            raise self.unreachable(error) from error
        fairy = checkout if connection is None else connection.connection
        try:
            dbapi_connection = fairy.dbapi_connection
            one_call = self._be.in_one_call(dbapi_connection)
            with deadlines.interrupting(self._be.interrupt, dbapi_connection):
                yield DriverSession(dbapi_connection, kept_cursor(fairy), self._prepared, one_call)
        except sa.exc.DBAPIError as error:
            if error.connection_invalidated or (
                self._backend is not None and self._be.is_read_only(error)
            ):
                fairy.invalidate(error.orig)
                if self.owns_engine:
                    # The server went away: every pooled connection is as dead as this one.
                    self.engine.dispose()
            raise
        except BaseException as error:
            if not isinstance(error, Exception):
                # Cancelled (async) or interrupted mid-statement: the connection's state is
                # unknown (a statement may still be running), so it must not be reused.
                fairy.invalidate(error)
            raise
        finally:
            (fairy if connection is None else connection).close()

    @contextmanager
    def connection(self) -> Iterator[Connection]:
        """An SQLAlchemy Connection, for the rare statements outside the lock operations."""
        try:
            connection = self.engine.connect()
        except sa.exc.TimeoutError as error:
            raise self._no_free_connection(error) from error
        except sa.exc.DBAPIError as error:
            raise self.unreachable(error) from error
        with connection:
            yield connection

    @property
    def _connect_errors(self) -> tuple[type[BaseException], ...]:
        """What opening a connection raises: SQLAlchemy's wrapped errors, or the driver's own
        (``raw_connection()`` does not wrap them)."""
        return (sa.exc.DBAPIError, self.engine.dialect.loaded_dbapi.Error)

    def _no_free_connection(self, error: sa.exc.TimeoutError) -> DatabaseError:
        """The error for a pool that lent no connection within its timeout."""
        return DatabaseError(
            f"no connection to {describe_url(self.url)} came free in time: {one_line(error)}; "
            "more threads or tasks run lock operations at once than the pool allows "
            "(pool_size + max_overflow, or the Locker's max_connections), or connections are "
            "held elsewhere"
        )

    def unreachable(self, error: BaseException | None) -> DatabaseError:
        """The error for a database that could not be connected to; ``error`` is the driver's,
        or SQLAlchemy's wrapping of it."""
        if isinstance(error, sa.exc.DBAPIError):
            error = error.orig
        advice = "check the URL (--url or $SQLLOCKER_URL) and that the server is running"
        if "unsupported startup parameter" in str(error):
            advice = (
                "a pooler such as PgBouncer refused the session settings sqllocker sends; if "
                "it pools transactions, pass transaction_pooling=True (the command line's "
                "--transaction-pooling)"
            )
        url = describe_url(self.url)
        # Reachable before: a restart or a failover, not a wrong URL.
        outage = self._backend is not None
        return DatabaseError(f"cannot connect to {url}: {one_line(error)}; {advice}", outage=outage)

    def ensure_setup(self) -> None:
        """Set up (``_set_up``) if it is due, outside any lock operation: as one, so that a
        connection lost meanwhile is retried and any failure is a LockError."""
        if self._needs_setup:
            self._run(None, _nothing_more)

    def _set_up(self) -> None:
        """Learn the backend and check the settings the locks' guarantees rest on: on first use,
        as the backend's capabilities (MariaDB's RETURNING) are known only once connected, and
        again after a connection was found lost. A server restarted since may run with other
        settings: one unsafe now is reported (strict: refused), and one switched to MySQL 8's
        ``innodb_autoinc_lock_mode=2`` needs the stripe lock from the next acquire on, not from
        the application's next restart."""
        if self._needs_setup:
            # The lock first: threads that all start at once must not each open a connection,
            # which the pool would then keep beside those of the lock operations.
            with self._setup_turn():
                if not self._needs_setup:
                    return
                with self.connection() as conn:
                    self._check_pooled_connection(conn)
                    backend = backend_for(conn.dialect)
                    settings = backend.read_settings(conn, self.table_name)
                    if settings.foreign is not None:
                        raise ForeignTable.naming(
                            self.table_name, describe_url(self.url), settings.foreign
                        )
                    self._report(settings.unsafe)
                    id_order = id_order_table(self.table_name) if settings.lock_stripes else None
                    if self._backend is None:
                        self._prepared = PreparedCache(conn.dialect)
                    self._statements = Statements(
                        self.table,
                        backend,
                        id_order,
                        settings.schema,
                        has_line=settings.has_line,
                    )
                    self._backend = backend
                    self._inserts_replayed = settings.replays_inserts
                    # Read off one connection: only sqllocker's own connections, each straight
                    # to the server, are all set alike.
                    self._lone_inserts_retried = settings.replays_inserts and (
                        settings.retries_autocommit
                        or not self.owns_engine
                        or self.transaction_pooling
                    )
                    self._expiry = {
                        "minus_grace": backend.seconds_value(-self.grace),
                        "minus_foreign_grace": backend.seconds_value(
                            -self.grace - FOREIGN_CLOCK_MARGIN
                        ),
                    }
                    self._needs_setup = False

    @contextmanager
    def _setup_turn(self) -> Iterator[None]:
        """The setup lock, waited for by ``sleep``: an AsyncLocker's tasks run this code in
        greenlets on one thread, and a task blocked on the lock would stop the event loop, and
        with it the task holding the lock across an await (setup again after a lost connection,
        when several tasks find it needed at once)."""
        while not self._setup_lock.acquire(blocking=False):
            self._sleep(_SETUP_TURN_SECONDS)
        try:
            yield
        finally:
            self._setup_lock.release()

    def _check_pooled_connection(self, conn: Connection) -> None:
        """Through a transaction pooler, refuse a caller's Engine whose connections prepare
        statements: sqllocker's own are made not to, and it cannot change a caller's."""
        if self.transaction_pooling and prepares_statements(conn.connection.driver_connection):
            raise LockValueError(
                f"{describe_url(self.url)}: with transaction_pooling=True the engine's "
                "connections must not prepare statements, which a transaction pooler hands to "
                "one server session and the next statement may not find; create it with "
                "connect_args={'prepare_threshold': None}"
            )

    def _report(self, problems: list[UnsafeSetting]) -> None:
        """Warn of (or, strict, refuse) settings that break a guarantee of the locks."""
        if not problems:
            return
        harms = {
            harm: ", ".join(p.setting for p in problems if p.harm == harm)
            for harm in dict.fromkeys(p.harm for p in problems)
        }
        message = (
            f"{describe_url(self.url)}: "
            + "; ".join(f"{settings} {harm}" for harm, settings in harms.items())
            + f"; change {'these settings' if len(problems) > 1 else 'the setting'}, or pass "
            "strict=True to refuse such databases"
        )
        if self.strict:
            raise UnsafeDatabase(message)
        logger.warning("%s", message)
        warnings.warn(message, UnsafeDatabaseWarning, stacklevel=2)

    def _table_missing(self, lockstring: str | None) -> TableMissing:
        return TableMissing(
            f"lock table {self.table_name!r} does not exist in {describe_url(self.url)}; "
            f"create it with `sqllocker --url URL --table {self.table_name} migrate` "
            "(or Locker.create_table())",
            lockstring,
        )

    @property
    def waits_by_ticket(self) -> bool:
        """Whether waiters take tickets (see ``sqllocker.tickets``): on PostgreSQL through
        psycopg 3 and on MySQL/MariaDB, sync or async, unless a transaction pooler is between
        (LISTEN and the tickets' liveness lock would stay behind on whichever server session
        ran them), nor with a pool too small to spare the listener's connection, and only on a
        table made by its migration, which adds the line; elsewhere they back off and retry
        (SQLite: in the kernel's queue)."""
        dialect = self.engine.dialect
        return (
            backend_class(dialect.name).takes_tickets(dialect)
            and not self.transaction_pooling
            and self._pool_spares_listener
            and self.statements.has_line
        )

    @property
    def hands_over(self) -> bool:
        """Whether a release hands the row to the first live ticket (``Backend.hands_over``)."""
        return self.backend.hands_over

    @property
    def queue_file(self) -> str | None:
        """The database file beside which waiters queue in the kernel (SQLite), or None."""
        return backend_class(self.engine.dialect.name).queue_file(self.url)

    @property
    def backend(self) -> Backend:
        """The backend (set up on first use)."""
        if self._backend is None:
            self.ensure_setup()
        assert self._backend is not None
        return self._backend

    @property
    def statements(self) -> Statements:
        """Every statement for this table (set up on first use)."""
        if self._statements is None:
            self.ensure_setup()
        assert self._statements is not None
        return self._statements

    @property
    def _be(self) -> Backend:
        if self._backend is None:
            raise LockError("internal error: backend used before the first connection")
        return self._backend

    @property
    def _sql(self) -> Statements:
        if self._statements is None:
            raise LockError("internal error: statements used before the first connection")
        return self._statements
