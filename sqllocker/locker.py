"""The Locker: takes, extends, releases and purges lock rows on one table of one database.

Every operation checks out a connection, runs its statement(s) in one short autocommit
transaction, and gives the connection back, so holding a lock holds no connection, and a
caller's own transaction never contains (or waits on, or rolls back) a lock row.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import URL, Connection, Engine

from . import validation
from .backends import Backend, backend_for
from .durability import unsafe_settings
from .engine import create_locker_engine, describe_url, resolve_url
from .errors import (
    DatabaseError,
    LockBusy,
    LockError,
    LockLost,
    LockTypeError,
    LockValueError,
    TableMissing,
    UnsafeDatabase,
    UnsafeDatabaseWarning,
    describe_holder,
    one_line,
)
from .execution import PreparedCache, Session
from .identity import holder_details
from .keepalive import DEFAULT_FRACTION, KeepAlive
from .lock import Lock, LockState, OnLost
from .notify import ReleaseListener
from .schema import DEFAULT_TABLE, lock_table
from .statements import Statements
from .waiting import Backoff

logger = logging.getLogger("sqllocker")

T = TypeVar("T")

DEFAULT_EXPIRES = 3600.0
DEFAULT_GRACE = 1.0
DEFAULT_PURGE_BATCH = 1000
# Attempts at one acquire when the holder vanishes between our refused INSERT and our look-up of
# who holds it; past this, the caller is told "busy" (and, with a wait, simply tries again later).
_ATTEMPTS_PER_TRY = 3
# Retries of an operation that the database failed because of contention (deadlock victim,
# lock-wait timeout, SQLite busy). Each attempt may itself wait up to the backend's lock timeout.
_CONFLICT_RETRIES = 8
_FIRST_CONFLICT_DELAY = 0.005


@dataclass(frozen=True)
class LockInfo:
    """One row of the lock table, as :meth:`Locker.locks` reports it."""

    lock_id: int
    lockstring: str
    guid: str
    created: datetime
    expires: datetime
    locked_by: dict[str, Any]
    expired: bool
    seconds_left: float  # until expiry by the server's clock; negative once expired


def _lock_info(row: Any) -> LockInfo:
    return LockInfo(
        lock_id=row.id,
        lockstring=row.lockstring,
        guid=row.guid,
        created=row.created,
        expires=row.expires,
        locked_by=row.locked_by,
        expired=bool(row.expired),
        seconds_left=(row.expires - row.server_now).total_seconds(),
    )


@dataclass(frozen=True)
class _Acquired:
    lock_id: int
    created: datetime
    expires: datetime


@dataclass(frozen=True)
class _Refused:
    busy: LockBusy | None  # None: refused by contention without a holder to name
    server_now: datetime | None


class Locker:
    """Hands out locks kept as rows of ``table`` in the database at ``url_or_engine``.

    ``url_or_engine``: an SQLAlchemy URL or Engine; ``None`` means ``$SQLLOCKER_URL``, else the
    SQLite file ``sqllocker.db`` in the working directory. ``postgres://`` and ``postgresql://``
    mean psycopg 3; ``mysql://`` and ``mariadb://`` mean PyMySQL.

    ``expires`` is the default lifetime of a lock in seconds; a lock that is not released or
    extended within it may be taken over by the next acquirer once a further ``grace`` seconds
    have passed (the grace lets a holder that just noticed its expiry stop first).

    ``auto_create`` creates the table on first use if it is missing: by default for SQLite, whose
    file sqllocker owns, and never for a server, whose schema is the operator's (``sqllocker
    migrate``).

    ``on_lost`` is the default callback for kept-alive locks found lost (see ``Lock.keep_alive``);
    ``keep_alive_fraction`` is how much of its expiry period passes between two renewals.

    On first use the locker checks the database's durability settings: with a setting that can
    lose an acknowledged lock row in a crash (and so hand out a second holder and a reused
    token), it warns, or with ``strict=True`` refuses with ``UnsafeDatabase``.
    """

    def __init__(
        self,
        url_or_engine: str | URL | Engine | None = None,
        *,
        table: str = DEFAULT_TABLE,
        expires: float = DEFAULT_EXPIRES,
        grace: float = DEFAULT_GRACE,
        auto_create: bool | None = None,
        on_lost: OnLost | None = None,
        keep_alive_fraction: float = DEFAULT_FRACTION,
        strict: bool = False,
    ) -> None:
        self.table_name = validation.check_table_name(table)
        self.expires = validation.check_seconds(expires, "expires")
        self.grace = validation.check_grace(grace)
        if isinstance(keep_alive_fraction, bool) or not (
            isinstance(keep_alive_fraction, int | float) and 0 < keep_alive_fraction < 1
        ):
            raise LockValueError(
                f"keep_alive_fraction must be between 0 and 1, not {keep_alive_fraction!r}"
            )
        validation.check_on_lost(on_lost)
        self.on_lost = on_lost
        self.strict = strict
        self._keep_alives = KeepAlive(keep_alive_fraction)
        self.engine: Engine
        if isinstance(url_or_engine, Engine):
            self.engine = url_or_engine.execution_options(isolation_level="AUTOCOMMIT")
            self._owns_engine = False
        elif url_or_engine is None or isinstance(url_or_engine, str | URL):
            self.engine = create_locker_engine(resolve_url(url_or_engine))
            self._owns_engine = True
        else:
            raise LockTypeError(
                f"url_or_engine must be a URL string, sqlalchemy URL or Engine, not "
                f"{type(url_or_engine).__name__}"
            )
        self.url = self.engine.url
        self.table = lock_table(self.table_name)
        self.auto_create = (
            self.engine.dialect.name == "sqlite" if auto_create is None else auto_create
        )
        self._backend: Backend | None = None
        self._statements: Statements | None = None
        self._prepared: PreparedCache
        self._setup_lock = threading.Lock()
        self._listener: ReleaseListener | None = None

    # -- public API -----------------------------------------------------------------------------

    def lock(
        self,
        lockstring: str,
        *,
        expires: float | None = None,
        wait: float | None = 0,
        locked_by: dict[str, Any] | None = None,
        keep_alive: bool = False,
        on_lost: OnLost | None = None,
    ) -> Lock:
        """Acquire ``lockstring`` or raise LockBusy.

        ``expires``: seconds until the lock may be taken over (default: the locker's).
        ``wait``: 0 tries once; a number of seconds keeps trying until then, backing off with
        jitter; ``None`` waits forever. ``locked_by``: extra JSON details stored with the
        holder's host, pid, thread, program and user. ``keep_alive``: renew the lock in the
        background until it is released (see ``Lock.keep_alive``), calling ``on_lost`` (else the
        locker's) if it is lost.
        """
        validation.check_on_lost(on_lost)
        lockstring = validation.check_lockstring(lockstring)
        ttl = (
            self.expires
            if expires is None
            else validation.check_seconds(expires, "expires", lockstring)
        )
        wait = validation.check_wait(wait, lockstring)
        extra = validation.check_locked_by(locked_by, lockstring)
        backoff = Backoff.for_wait(wait)
        listener = self._release_listener() if wait != 0 else None
        while True:
            # Subscribe before the attempt: a release between a refusal and the sleep still
            # wakes us.
            waiter = listener.register(lockstring) if listener is not None else None
            try:
                outcome = self._try_acquire(lockstring, ttl, extra, on_lost or self.on_lost)
                if isinstance(outcome, Lock):
                    return outcome.keep_alive() if keep_alive else outcome
                if backoff.expired():
                    raise self._busy_after(lockstring, outcome, wait)
                delay = backoff.next_delay(
                    outcome.busy.expires if outcome.busy else None, outcome.server_now, self.grace
                )
                if waiter is not None:
                    waiter.event.wait(delay)  # a release notification, or the backoff, ends it
                else:
                    backoff.sleep(delay)
            finally:
                if listener is not None and waiter is not None:
                    listener.unregister(waiter)

    @staticmethod
    def _busy_after(lockstring: str, refused: _Refused, wait: float | None) -> LockBusy:
        """The LockBusy for a caller who tried (and, with ``wait``, waited) in vain."""
        waited = 0.0 if wait is None else wait
        busy = refused.busy
        return LockBusy(
            lockstring,
            holder=busy.holder if busy else None,
            lock_id=busy.lock_id if busy else None,
            created=busy.created if busy else None,
            expires=busy.expires if busy else None,
            waited=waited,
        )

    def try_lock(
        self,
        lockstring: str,
        *,
        expires: float | None = None,
        locked_by: dict[str, Any] | None = None,
    ) -> Lock | None:
        """Acquire ``lockstring`` if it is free: a Lock, or None if someone holds it."""
        try:
            return self.lock(lockstring, expires=expires, wait=0, locked_by=locked_by)
        except LockBusy:
            return None

    def purge_expired_locks(self, batch_size: int = DEFAULT_PURGE_BATCH) -> int:
        """Delete rows expired (by the server's clock) for longer than grace; returns how many.

        Deletes in batches of ``batch_size``, each its own short transaction, so a large purge
        never blocks acquirers for long. Database errors propagate.
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise LockTypeError(f"batch_size must be a positive int, not {batch_size!r}")
        total = 0
        while True:
            deleted = self._run(None, lambda conn: self._purge_batch(conn, batch_size))
            total += deleted
            if deleted < batch_size:
                break
        if total:
            logger.info("purged %d expired lock(s) from %s", total, self.table_name)
        return total

    def locks(self, pattern: str | None = None) -> list[LockInfo]:
        """Every row of the table, live and expired, ordered by lockstring; with ``pattern``, only
        lockstrings matching that shell-style glob (``*`` and ``?``; case-sensitive)."""
        if pattern is not None and not isinstance(pattern, str):
            raise LockTypeError(f"pattern must be a str, not {type(pattern).__name__}")

        def read(conn: Session) -> list[LockInfo]:
            if pattern is None:
                rows = conn.execute(self._sql.list_locks())
            else:
                glob = self._be.glob_value(pattern)
                rows = conn.execute(self._sql.list_locks(pattern=True), {"pattern": glob})
            return [_lock_info(row) for row in rows]

        return self._run(None, read)

    def lock_info(self, lockstring: str) -> LockInfo | None:
        """The row of ``lockstring``, live or expired, or None if there is none."""
        lockstring = validation.check_lockstring(lockstring)

        def read(conn: Session) -> LockInfo | None:
            row = conn.execute(self._sql.holder, {"ls": lockstring}).first()
            return None if row is None else _lock_info(row)

        return self._run(lockstring, read)

    def expired_locks(self) -> list[LockInfo]:
        """The rows purge_expired_locks() would delete now (expired for longer than grace)."""

        def read(conn: Session) -> list[LockInfo]:
            params = {"minus_grace": self._be.seconds_value(-self.grace)}
            return [_lock_info(row) for row in conn.execute(self._sql.purgeable, params)]

        return self._run(None, read)

    def break_lock(self, lockstring: str, lock_id: int | None = None) -> LockInfo | None:
        """Delete ``lockstring``'s row whoever holds it (an operator's tool for dead holders).

        With ``lock_id``, only that exact acquisition is broken. Returns the row that was deleted,
        or None if there was none (or it had another id). The holder finds out at its next
        extend or unlock, which raise LockLost.
        """
        lockstring = validation.check_lockstring(lockstring)

        def delete(conn: Session) -> LockInfo | None:
            def statements() -> LockInfo | None:
                row = conn.execute(self._sql.holder, {"ls": lockstring}).first()
                if row is None or (lock_id is not None and row.id != lock_id):
                    return None
                params = {"ls": lockstring, "lock_id": row.id}
                deleted = conn.execute(self._sql.break_lock, params).rowcount
                return _lock_info(row) if deleted else None

            return self._write(conn, statements)

        broken = self._run(lockstring, delete)
        if broken is not None:
            logger.warning(
                "broke lock %r (id %d) held by %s, on behalf of %s",
                lockstring,
                broken.lock_id,
                describe_holder(broken.locked_by),
                describe_holder(holder_details("-", {})),
            )
        return broken

    def create_table(self) -> None:
        """Create or upgrade the table by applying the shipped migrations; safe to repeat."""
        from .migrations import upgrade

        upgrade(self.engine, self.table_name)

    def close(self) -> None:
        """Stop keeping locks alive, and close the pooled connections of an engine the locker
        created (not a caller's)."""
        self._keep_alives.stop()
        if self._listener is not None:
            self._listener.stop()
        if self._owns_engine:
            self.engine.dispose()

    def __repr__(self) -> str:
        return f"<Locker {describe_url(self.url)} table={self.table_name}>"

    # -- operations used by Lock ----------------------------------------------------------------

    def _release(self, lockstring: str, lock_id: int, guid: str) -> None:
        deleted = self._run(
            lockstring,
            lambda conn: self._write(
                conn,
                lambda: (
                    conn.execute(
                        self._sql.release, {"lock_id": lock_id, "lock_guid": guid}
                    ).rowcount
                ),
            ),
        )
        if deleted != 1:
            raise LockLost(
                f"lock {lockstring!r} (id {lock_id}) was no longer ours at release: it expired "
                "and was purged, taken over or broken; work done under it may have overlapped "
                "with another holder's",
                lockstring,
                lock_id,
            )
        logger.debug("released %r (id %d)", lockstring, lock_id)

    def _release_listener(self) -> ReleaseListener | None:
        """PostgreSQL (psycopg 3) waiters wake on NOTIFY; other backends back off and retry."""
        dialect = self.engine.dialect
        if dialect.name != "postgresql" or dialect.driver != "psycopg":
            return None
        with self._setup_lock:
            if self._listener is None:
                self._listener = ReleaseListener(self.engine, self.table_name)
            return self._listener

    def _keep_alive(self, state: LockState) -> None:
        self._keep_alives.add(state)

    def _forget_kept_alive(self, state: LockState) -> None:
        self._keep_alives.remove(state)

    def _guard(self, connection: Connection, state: LockState) -> None:
        if not connection.in_transaction():
            raise LockError(
                "guard() needs a connection inside a transaction: the protection lasts until "
                "that transaction ends",
                state.lockstring,
            )
        self._ensure_setup()
        params = {"lock_id": state.lock_id, "lock_guid": state.guid}
        if self._be.begin_immediate:
            # SQLite: a write takes the database's write lock until the caller's transaction
            # ends, so nobody can take over or purge the row meanwhile.
            proven = connection.execute(self._sql.guard_by_writing, params).rowcount == 1
        else:
            proven = connection.execute(self._sql.guard, params).first() is not None
        if not proven or not state.held:
            lost = LockLost(
                f"lock {state.lockstring!r} (id {state.lock_id}) is no longer ours (expired, "
                "taken over, purged or released); roll this transaction back",
                state.lockstring,
                state.lock_id,
            )
            if state.held:
                state.mark_lost(lost)
            raise lost

    def _extend(self, lockstring: str, lock_id: int, guid: str, ttl: float) -> datetime:
        params = {"lock_id": lock_id, "lock_guid": guid, "ttl": self._be.seconds_value(ttl)}

        def extend(conn: Session) -> datetime | None:
            def statements() -> datetime | None:
                result = conn.execute(self._sql.extend, params)
                if self._be.update_returning:
                    row = result.first()
                    return None if row is None else row.expires
                if result.rowcount != 1:
                    return None
                times = conn.execute(self._sql.times_of, params).one()
                return times.expires  # type: ignore[no-any-return]

            return self._write(conn, statements)

        expires = self._run(lockstring, extend)
        if expires is None:
            raise LockLost(
                f"lock {lockstring!r} (id {lock_id}) could not be extended: it had already "
                "expired, or was purged, taken over or broken; an expired lock is never revived",
                lockstring,
                lock_id,
            )
        return expires

    # -- internals -------------------------------------------------------------------------------

    def _try_acquire(
        self, lockstring: str, ttl: float, extra: dict[str, Any], on_lost: OnLost | None
    ) -> Lock | _Refused:
        guid = str(uuid.uuid4())
        details = holder_details(guid, extra)
        refused = _Refused(None, None)
        for _attempt in range(_ATTEMPTS_PER_TRY):
            # The validity deadline counts from before the statement is sent: the server's
            # expiry cannot start earlier than that.
            sent_at = time.monotonic()
            outcome = self._run(
                lockstring, lambda conn: self._acquire_on(conn, lockstring, guid, ttl, details)
            )
            if isinstance(outcome, _Acquired):
                logger.debug("acquired %r (id %d)", lockstring, outcome.lock_id)
                state = LockState(self, lockstring, outcome.lock_id, guid, ttl, sent_at, on_lost)
                return Lock(
                    state, created=outcome.created, expires=outcome.expires, locked_by=details
                )
            refused = outcome
            if outcome.busy is not None:
                break  # a live holder: no point asking again at once
        return refused

    def _acquire_on(
        self, conn: Session, lockstring: str, guid: str, ttl: float, details: dict[str, Any]
    ) -> _Acquired | _Refused:
        be, sql = self._be, self._sql
        params = {
            "ls": lockstring,
            "lock_guid": guid,
            "ttl": be.seconds_value(ttl),
            "minus_grace": be.seconds_value(-self.grace),
            "holder": details,
        }

        def statements() -> _Acquired | _Refused:
            acquired = self._insert(conn, params)
            # The row may be an expired holder's: delete it only if so (by the server's clock),
            # then insert again. Two racers may both get here; the unique key lets one win.
            if (
                acquired is None
                and not be.atomic_takeover
                and conn.execute(sql.take_over_expired, params).rowcount
            ):
                acquired = self._insert(conn, params)
            if acquired is not None:
                return acquired
            row = conn.execute(sql.holder, params).first()
            if row is None:
                return _Refused(None, None)  # released in between: try again
            if row.guid == guid:
                # Our INSERT committed but its answer was lost with the connection (_run retried).
                return _Acquired(row.id, row.created, row.expires)
            busy = LockBusy(
                lockstring,
                holder=row.locked_by,
                lock_id=row.id,
                created=row.created,
                expires=row.expires,
            )
            return _Refused(busy, row.server_now)

        try:
            return self._write(conn, statements)
        except sa.exc.DBAPIError as error:
            if be.is_transient_conflict(error):
                logger.debug("acquire of %r met contention (%s); retrying", lockstring, error.orig)
                return _Refused(None, None)
            raise

    def _insert(self, conn: Session, params: dict[str, Any]) -> _Acquired | None:
        try:
            result = conn.execute(self._sql.acquire, params)
        except sa.exc.IntegrityError as error:
            if self._be.is_unique_violation(error):
                return None
            raise
        if self._be.insert_returning:
            row = result.first()
            return None if row is None else _Acquired(row.id, row.created, row.expires)
        if result.rowcount != 1 or result.lastrowid is None:
            return None
        lock_id = result.lastrowid
        mine = {"lock_id": lock_id, "lock_guid": params["lock_guid"]}
        times = conn.execute(self._sql.times_of, mine).one()
        return _Acquired(lock_id, times.created, times.expires)

    def _purge_batch(self, conn: Session, batch_size: int) -> int:
        params = {"minus_grace": self._be.seconds_value(-self.grace)}
        return self._write(
            conn, lambda: conn.execute(self._sql.purge_batch(batch_size), params).rowcount
        )

    def _write(self, conn: Session, statements: Callable[[], T]) -> T:
        """Run ``statements`` as one transaction (SQLite: BEGIN IMMEDIATE), or as autocommit
        statements on the servers, where each one is atomic by itself."""
        if not self._be.begin_immediate:
            return statements()
        conn.execute_text("BEGIN IMMEDIATE")
        try:
            result = statements()
        except BaseException:
            conn.dbapi_connection.rollback()
            raise
        conn.execute_text("COMMIT")
        return result

    def _run(self, lockstring: str | None, operation: Callable[[Session], T]) -> T:
        """Run ``operation`` on a pooled connection, translating driver errors into LockErrors.

        Every operation is safe to repeat (acquire recognises its own row by guid), so two kinds
        of failure are retried: a connection that turns out dead (the server restarted since it
        was pooled) is replaced once, and contention that the database resolved by rolling the
        statement back (a deadlock, a lock-wait timeout, SQLite busy) is retried with backoff,
        so that, say, a release chosen as a deadlock victim still releases.
        """
        created_table = False
        retried_connection = False
        conflicts = 0
        while True:
            try:
                with self._connect() as conn:
                    return operation(conn)
            except sa.exc.DBAPIError as error:
                if error.connection_invalidated and not retried_connection:
                    retried_connection = True
                    logger.warning("database connection was lost (%s); reconnecting", error.orig)
                    continue
                if (
                    self._backend is not None
                    and self._be.is_transient_conflict(error)
                    and conflicts < _CONFLICT_RETRIES
                ):
                    conflicts += 1
                    logger.info("contention (%s); trying again", one_line(error.orig))
                    time.sleep(random.uniform(0, _FIRST_CONFLICT_DELAY * 2**conflicts))
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
                ) from error

    @contextmanager
    def _connect(self) -> Iterator[Session]:
        """A cursor on a pooled connection in autocommit mode, for one operation.

        An engine the locker made is AUTOCOMMIT for every connection, so its raw pooled
        connections serve directly; a caller's Engine gets AUTOCOMMIT through an SQLAlchemy
        Connection, which also restores the connection's own setting when it goes back.
        """
        self._ensure_setup()
        try:
            checkout: Any = self.engine.raw_connection() if self._owns_engine else None
            connection = None if self._owns_engine else self.engine.connect()
        except sa.exc.DBAPIError as error:
            raise self._unreachable(error.orig) from error
        except self.engine.dialect.loaded_dbapi.Error as error:  # raw_connection() does not wrap
            raise self._unreachable(error) from error
        fairy = checkout if connection is None else connection.connection
        session = Session(fairy.driver_connection, self._prepared)
        try:
            yield session
        except sa.exc.DBAPIError as error:
            if error.connection_invalidated:
                fairy.invalidate(error.orig)
                if self._owns_engine:
                    # The server went away: every pooled connection is as dead as this one.
                    self.engine.dispose()
            raise
        finally:
            session.close()
            (fairy if connection is None else connection).close()

    @contextmanager
    def _connection(self) -> Iterator[Connection]:
        """An SQLAlchemy Connection, for the rare statements outside the lock operations."""
        try:
            connection = self.engine.connect()
        except sa.exc.DBAPIError as error:
            raise self._unreachable(error.orig) from error
        with connection:
            yield connection

    def _unreachable(self, error: BaseException | None) -> DatabaseError:
        return DatabaseError(
            f"cannot connect to {describe_url(self.url)}: {one_line(error)}; check the "
            "URL (--url or $SQLLOCKER_URL) and that the server is running"
        )

    def _ensure_setup(self) -> None:
        if self._backend is None:
            with self._connection() as conn:
                self._setup(conn)

    def _setup(self, conn: Connection) -> None:
        # The backend's capabilities (MariaDB's RETURNING) are known only once connected.
        with self._setup_lock:
            if self._backend is None:
                backend = backend_for(conn.dialect)
                self._check_durability(conn)
                self._statements = Statements(self.table, backend)
                self._prepared = PreparedCache(conn.dialect)
                self._backend = backend

    def _check_durability(self, conn: Connection) -> None:
        problems = unsafe_settings(conn, self.table_name)
        if not problems:
            return
        message = (
            f"{describe_url(self.url)} can lose acknowledged lock rows in a crash "
            f"({', '.join(problems)}): a lost row lets a second holder in and its lock id be "
            "reused; change the setting, or pass strict=True to refuse such databases"
        )
        if self.strict:
            raise UnsafeDatabase(message)
        logger.warning("%s", message)
        warnings.warn(message, UnsafeDatabaseWarning, stacklevel=6)

    def _table_missing(self, lockstring: str | None) -> TableMissing:
        return TableMissing(
            f"lock table {self.table_name!r} does not exist in {describe_url(self.url)}; "
            f"create it with `sqllocker migrate --url URL --table {self.table_name}` "
            "(or Locker.create_table())",
            lockstring,
        )

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
