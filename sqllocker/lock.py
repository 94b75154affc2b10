"""A held lock: the handle a caller keeps while its row exists, and gives back with unlock().

A Lock holds no connection and no transaction, only what identifies its row (``lock_id`` and
the secret ``guid``). Every later statement matches both, so a Lock whose row expired and was
taken over can never touch the new holder's row.

Besides the row, a Lock knows until when it may *act* as the holder: a validity deadline on
``clock.now()`` (a clock that counts time spent suspended), taken when the acquire (or last
extend) statement was sent, plus the expiry period, minus a safety margin. The row cannot
expire before that moment (the server starts its clock no earlier than the statement was
sent), and nobody can take it over before expiry plus grace, so a holder that stops at its
deadline has always stopped before anyone else starts.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import datetime, timezone
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from sqlalchemy.engine import Connection

from . import clock, forks
from .errors import LockError, LockLost
from .finaliser import Finaliser
from .schema import to_utc
from .validation import check_seconds

if TYPE_CHECKING:
    from .keepalive import KeepAlive
    from .locker import Locker
    from .operations import LockOperations

logger = logging.getLogger("sqllocker")

OnLost = Callable[[LockLost], object]


# How fast our clock may run slow against the server's: twice the 500 ppm that NTP slews a clock
# by at most, so that the margin of a day-long lock covers a day of drift, not a second.
CLOCK_DRIFT = 1e-3


def safety_margin(ttl: float) -> float:
    """How long before the row's expiry a holder stops trusting its lock: a second plus the
    drift our clock may gather over the expiry period, and never more than a tenth of it."""
    return min(ttl / 10, 1.0 + ttl * CLOCK_DRIFT)


class Holding:
    """What the sync and async lock states share: one acquisition's identity, whether it is
    held, whether it is known lost, its validity deadline, and the errors that describe it."""

    def __init__(
        self,
        lockstring: str,
        lock_id: int,
        guid: str,
        ttl: float,
        sent_at: float,
        on_lost: OnLost | None,
    ) -> None:
        self.lockstring = lockstring
        self.lock_id = lock_id
        self.guid = guid
        self.ttl = ttl
        self.pid = forks.pid
        self.held = True
        self.lost: LockLost | None = None
        self.on_lost = on_lost
        # Seconds from the row's creation that a release keeps it for (see Locker.lock).
        self.hold_at_least: float | None = None
        self.valid_until = sent_at + ttl - safety_margin(ttl)
        self._lost_lock = threading.Lock()

    def is_valid(self) -> bool:
        return self.held and self.lost is None and clock.now() < self.valid_until

    def renewed(self, sent_at: float, ttl: float) -> None:
        """An extend sent at ``sent_at`` succeeded: the deadline moves on from then."""
        self.ttl = ttl
        self.valid_until = sent_at + ttl - safety_margin(ttl)

    def check_extendable(self) -> None:
        """Raise LockLost if the lock was released or is known lost."""
        if not self.held:
            raise LockLost(
                f"lock {self.lockstring!r} (id {self.lock_id}) is not held: it was released",
                self.lockstring,
                self.lock_id,
            )
        if self.lost is not None:
            raise self.lost

    def check_valid(self) -> None:
        """Raise LockLost unless :meth:`is_valid`."""
        if self.is_valid():
            return
        if self.lost is not None:
            raise self.lost
        reason = "was released" if not self.held else "passed its deadline without renewal"
        raise LockLost(
            f"lock {self.lockstring!r} (id {self.lock_id}) {reason}; another process may hold "
            "it now",
            self.lockstring,
            self.lock_id,
        )

    def deadline_passed(self) -> LockLost:
        """The error of a kept-alive lock whose renewals did not succeed before its deadline."""
        return LockLost(
            f"lock {self.lockstring!r} (id {self.lock_id}) could not be renewed before its "
            "deadline; it must be treated as lost (another process may take it over once it "
            "expires)",
            self.lockstring,
            self.lock_id,
        )

    def guard_failed(self, proven: bool) -> None:
        """After a guard statement: raise LockLost (marking the lock lost) unless it proved the
        row ours and the lock is still held."""
        if proven and self.held:
            return
        lost = LockLost(
            f"lock {self.lockstring!r} (id {self.lock_id}) is no longer ours (expired, taken "
            "over, purged or released); roll this transaction back",
            self.lockstring,
            self.lock_id,
        )
        if self.held:
            self.mark_lost(lost)
        raise lost

    def mark_lost(self, lost: LockLost) -> bool:
        """Record that the lock is lost; call on_lost the first time. True if this was the first."""
        with self._lost_lock:
            if self.lost is not None:
                return False
            self.lost = lost
        logger.warning("%s", lost)
        if self.on_lost is not None and self.pid == forks.pid:
            try:
                self._call_on_lost(self.on_lost, lost)
            except Exception:
                logger.exception("on_lost callback for lock %r raised", self.lockstring)
        return True

    def _call_on_lost(self, on_lost: OnLost, lost: LockLost) -> None:
        on_lost(lost)


class LockState(Holding):
    """A thread-side acquisition. The keep-alive thread and the finaliser work on this, never on
    the Lock, so neither keeps a dropped Lock alive. It has what its operations need: the
    table's operations (``operations``) and the keep-alive scheduler (``keep_alives``).

    ``op_lock`` serialises extend, renewal and release: once release() returns, no renewal
    statement of this lock can still be in flight or start.
    """

    def __init__(
        self,
        operations: LockOperations,
        keep_alives: KeepAlive,
        lockstring: str,
        lock_id: int,
        guid: str,
        ttl: float,
        sent_at: float,
        on_lost: OnLost | None,
    ) -> None:
        super().__init__(lockstring, lock_id, guid, ttl, sent_at, on_lost)
        self.operations = operations
        self.keep_alives = keep_alives
        self.op_lock = threading.RLock()

    def extend(self, ttl: float) -> datetime:
        """Push the row's expiry to server now + ``ttl``; LockLost (and lost) if it is not ours."""
        with self.op_lock:
            self.check_extendable()
            sent_at = clock.now()
            try:
                expires = self.operations.extend(self.lockstring, self.lock_id, self.guid, ttl)
            except LockLost as lost:
                self.mark_lost(lost)
                raise
            self.renewed(sent_at, ttl)
            return expires

    def release(self) -> None:
        """Delete the row (once); LockLost if it was no longer ours.

        If the DELETE fails otherwise (the database unreachable past the retries), the lock still
        counts as held, so that unlock() can be tried again, but it is no longer kept alive: a
        holder that has stopped working must not keep others out beyond the expiry.
        """
        with self.op_lock:
            if not self.held:
                return
            self.held = False
            self.keep_alives.remove(self)
            try:
                self.operations.release(
                    self.lockstring, self.lock_id, self.guid, self.hold_at_least
                )
            except LockLost:
                raise
            except BaseException:
                self.held = True
                raise

    def guard(self, connection: Connection) -> None:
        self.guard_failed(
            self.operations.guard(connection, self.lockstring, self.lock_id, self.guid)
        )


def _release_abandoned(state: LockState) -> None:
    """Runs when a held Lock is garbage-collected or the interpreter exits; never raises."""
    if not state.held or state.pid != forks.pid:
        return  # a forked child must not release its parent's lock
    try:
        state.release()
        logger.warning(
            "lock %r (id %d) was released by garbage collection; unlock() it or use `with`",
            state.lockstring,
            state.lock_id,
        )
    except LockLost:
        logger.info("abandoned lock %r (id %d) was already gone", state.lockstring, state.lock_id)
    except Exception as error:
        logger.warning(
            "could not release abandoned lock %r (id %d); it will expire: %s",
            state.lockstring,
            state.lock_id,
            error,
        )


HoldingT = TypeVar("HoldingT", bound=Holding)


def _utc(value: object) -> datetime:
    """A NOT NULL timestamp column's value, as the driver read it or already converted, as an
    aware UTC datetime."""
    if isinstance(value, datetime) and value.tzinfo is timezone.utc:
        return value
    instant = to_utc(value)
    if instant is None:
        raise TypeError("a lock row's timestamp read as NULL")
    return instant


class LockHandle(Generic[HoldingT]):
    """What a caller holds, sync or async: the row's identity and times, and the local checks
    that need no round trip. Dropping a held handle runs ``release_abandoned`` on its state."""

    def __init__(
        self,
        state: HoldingT,
        release_abandoned: Callable[[HoldingT], None],
        *,
        created: object,
        expires: object,
        locked_by: dict[str, Any],
    ) -> None:
        self._state = state
        self.lockstring = state.lockstring
        self.lock_id = state.lock_id
        self.guid = state.guid
        # As the driver read them, or datetimes: converted on first read (see ``created``).
        self._created = created
        self._expires = expires
        self.locked_by = locked_by
        self._finalizer = Finaliser(self, release_abandoned, state)

    @property
    def created(self) -> datetime:
        """When the row was inserted, by the server's clock (aware, UTC).

        The acquire hands over the driver's value (SQLite's text, say); it is read into a
        datetime here, once, as most holders never look (see ``Statements._returned``).
        """
        self._created = created = _utc(self._created)
        return created

    @property
    def expires(self) -> datetime:
        """When the row expires, by the server's clock (aware, UTC), as of the acquire or the
        last extend."""
        self._expires = expires = _utc(self._expires)
        return expires

    @expires.setter
    def expires(self, value: datetime) -> None:
        self._expires = value

    @property
    def ttl(self) -> float:
        """The expiry period: extend() and keep-alive renew by this many seconds."""
        return self._state.ttl

    @property
    def is_locked(self) -> bool:
        """True until unlock(), or until the lock is found to be lost."""
        return self._state.held and self._state.lost is None

    def is_valid(self) -> bool:
        """Whether the holder may still act: held, not known lost, and before its deadline.

        Checked locally, without a round trip: the deadline is the moment the last successful
        acquire or extend was *sent* plus the expiry period, less a safety margin.
        """
        return self._state.is_valid()

    def check(self) -> None:
        """Raise LockLost unless :meth:`is_valid`; call it before each step of long work."""
        self._state.check_valid()

    def _refuse_in_forked_child(self, action: str) -> None:
        """A forked child shares its parent's lock handles but not its lock: releasing or
        renewing the row would pull it from under the parent, which still acts on it."""
        if self._state.pid != forks.pid:
            raise LockError(
                f"cannot {action} lock {self.lockstring!r} (id {self.lock_id}) in process "
                f"{forks.pid}: it was acquired by process {self._state.pid}, which this one was "
                "forked from, and only that process may release or extend it",
                self.lockstring,
            )

    def _unlocked_by_caller(self) -> bool:
        """Whether the caller released the lock with unlock() (then leaving a ``with`` block
        is quiet, as a second unlock() is)."""
        return not self._state.held and self._state.lost is None

    def _lapsed(self) -> LockLost | None:
        """At the end of a ``with`` block: the LockLost to report if the lock was lost (or
        lapsed) while the body ran, even if nobody took the row over meanwhile."""
        try:
            self.check()
        except LockLost as error:
            return error
        return None

    def _release_failed_at_exit(
        self, error: Exception, lost: LockLost | None, body_error: BaseException | None
    ) -> LockLost | None:
        """The release at the end of a ``with`` block raised ``error``: the LockLost to report,
        or ``error`` itself re-raised, unless the body failed: its exception must reach the
        caller whatever happens here."""
        if isinstance(error, LockLost):
            return error
        if body_error is None:
            raise error
        logger.error(
            "could not release lock %r (id %d) after the body raised; it will expire: %s",
            self.lockstring,
            self.lock_id,
            error,
            exc_info=error,
        )
        return lost

    def __repr__(self) -> str:
        state = "held" if self.is_locked else "released"
        return (
            f"<{type(self).__name__} {self.lockstring!r} id={self.lock_id} {state} "
            f"expires={self.expires.isoformat(timespec='seconds')}>"
        )


class Lock(LockHandle[LockState]):
    """A lock this process holds. Use it as a context manager, or call :meth:`unlock`."""

    def __init__(
        self,
        locker: Locker,
        state: LockState,
        *,
        created: object,
        expires: object,
        locked_by: dict[str, Any],
    ) -> None:
        super().__init__(
            state, _release_abandoned, created=created, expires=expires, locked_by=locked_by
        )
        self.locker = locker  # the Locker it came from, for the caller: it calls nothing on it

    def unlock(self) -> None:
        """Delete our row. A second call is a no-op.

        Raises LockLost if the row was no longer ours (purged, taken over or broken after it
        expired): whatever the lock protected may have been touched by someone else meanwhile.
        Any other error leaves the lock held (no longer kept alive): call unlock() again, or let
        it expire.
        """
        self._refuse_in_forked_child("release")
        if not self._state.held:
            return
        try:
            self._state.release()
        except LockLost:
            self._finalizer.detach()
            raise
        self._finalizer.detach()

    def extend(self, seconds: float | None = None) -> datetime:
        """Set expiry to the server's now + ``seconds`` (default: the lock's expiry period).

        Raises LockLost, and the lock counts as lost, if the row is gone or has already
        expired: an expired lock is never revived, because someone may have acted on it.
        """
        ttl = self.ttl if seconds is None else check_seconds(seconds, "expires", self.lockstring)
        self._refuse_in_forked_child("extend")
        self.expires = self._state.extend(ttl)
        return self.expires

    def keep_alive(self, on_lost: OnLost | None = None) -> Lock:
        """Keep the row's expiry pushed forward in the background until unlock().

        Renewal happens every ``keep_alive_fraction`` (a third, by default) of the expiry
        period, on the locker's one keep-alive thread. ``on_lost`` (else the locker's) is called
        once, from that thread, if the lock is found gone or its deadline passes without a
        successful renewal, which is always before anyone else can take it over.
        """
        if on_lost is not None:
            self._state.on_lost = on_lost
        self._state.keep_alives.add(self._state)
        return self

    def guard(self, connection: Connection) -> None:
        """Within ``connection``'s open transaction on the lock's own database, prove the lock is
        still ours and keep it from being taken over or purged until that transaction ends.

        Raises LockLost if the row is gone or expired; the caller should then roll back. If it
        returns, a commit of the transaction happens while the lock is held: a stale holder's
        transaction can never commit. PostgreSQL and MySQL take a shared row lock
        (``FOR SHARE``); SQLite takes the database's write lock with a no-op update.
        """
        self._state.guard(connection)

    def __enter__(self) -> Lock:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._state.pid != forks.pid:
            logger.debug("not releasing %r in forked child %d", self.lockstring, forks.pid)
            return
        if self._unlocked_by_caller():
            return
        lost = self._lapsed()
        try:
            self.unlock()
        except Exception as error:
            lost = self._release_failed_at_exit(error, lost, exc_value)
        if lost is not None:
            # Losing the lock matters more than the body's error, which stays attached as cause.
            raise lost from exc_value
