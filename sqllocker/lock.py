# Generated from sqllocker/asyncio/lock.py by tests/unasync.py: edit that file, then
# run `python -m tests.unasync`.
"""A held lock: the handle a caller keeps while its row exists, and gives back with unlock().

A lock holds no connection and no transaction, only what identifies its row (``lock_id`` and
the secret ``guid``), and knows until when it may act as the holder (see ``holding.py``). The
state behind a handle (``LockState``) is what the keep-alive and the finaliser work on, never
the handle itself, so neither keeps a dropped lock alive.

Written once for asyncio; the sync ``sqllocker/lock.py`` is generated from it
(``tests/unasync.py``). An async release, once started, runs to its end (``InFlight``): a
cancelled ``unlock()`` leaves it running in a task of its own, and a second ``unlock()`` waits
for it or, if it failed, tries again, so a cancelled release never strands a row nobody can
release any more.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from datetime import datetime
from types import TracebackType
from typing import Any, Protocol, TypeVar

from sqlalchemy.engine import Connection, Engine

from . import clock, concurrency, deadlines, forks
from .errors import LockError, LockLost
from .holding import RELEASE_PATIENCE, Holding, LockHandle, OnLost
from .operations import LockInfo, LockOperations
from .validation import check_seconds

logger = logging.getLogger("sqllocker")

# Runs one LockOperations operation for the locker (in asyncio: in a greenlet, on the running
# loop's connections).
Run = Callable[..., Any]

T = TypeVar("T")


class Call(Protocol):
    """How a locker runs one of the table's operations, typed (``Locker._call``)."""

    def __call__(self, operation: Callable[..., T], *args: Any) -> T:
        """``operation(*args)`` (in asyncio: in a greenlet, on the running loop's
        connections)."""
        ...


class KeepAlives(Protocol):
    """What a lock's state asks of its locker's keep-alive (``keepalive.py``)."""

    def add(self, state: LockState) -> None:
        """Renew ``state`` in the background until it is removed."""

    def remove(self, state: LockState) -> None:
        """Stop renewing ``state``."""

    def changed(self, state: LockState) -> None:
        """``state``'s deadline or expiry period changed (an extend() of another length than
        it has): look again when to renew it, and when its deadline comes."""


class LockTaker(Protocol):
    """The locker a lock came from (``Locker``), as the lock's handle, read-write locks
    and elections know it: what takes and reads locks on its table."""

    engine: Engine
    table_name: str
    on_lost: OnLost | None  # its locks' on_lost unless given one

    def lock(
        self,
        lockstring: str,
        *,
        expires: float | None = None,
        wait: float | None = 0,
        locked_by: dict[str, Any] | None = None,
        keep_alive: bool = False,
        on_lost: OnLost | None = None,
        hold_at_least: float | None = None,
    ) -> Lock:
        """Acquire ``lockstring`` (see ``Locker.lock``)."""
        ...

    def lock_info(self, lockstring: str) -> LockInfo | None:
        """The row of ``lockstring``, live or expired, or None if there is none."""
        ...


class LockState(Holding):
    """One acquisition, as the keep-alive, the finaliser and the handle act on it, with what
    its statements need: the table's operations, how to run one (``run``) and the keep-alive.

    ``op_lock`` serialises extend, renewal and release: once release() returns, no renewal
    statement of this lock can still be in flight or start.
    """

    def __init__(
        self,
        operations: LockOperations,
        run: Run,
        keep_alives: KeepAlives,
        lockstring: str,
        lock_id: int,
        guid: str,
        ttl: float,
        sent_at: float,
        on_lost: OnLost | None,
    ) -> None:
        super().__init__(lockstring, lock_id, guid, ttl, sent_at, on_lost)
        self.operations = operations
        self.run = run
        self.keep_alives = keep_alives
        self.op_lock = concurrency.OpLock()

    def stop_renewing(self) -> None:
        self.keep_alives.remove(self)

    def extend(self, ttl: float | None = None) -> datetime:
        """Push the row's expiry to server now + ``ttl`` (None: the lock's expiry period as it
        is when the statement is sent, the keep-alive's renewal); LockLost (and lost) if it is
        not ours, or if no answer came before the row expired as we reckon it
        (``release_patience``), whatever the driver's timeouts: behind a renewal in flight, or
        on a frozen connection."""
        patience = self.release_patience()
        deadline = clock.now() + patience
        try:
            with deadlines.statements_end_by(deadline):
                return self._extend(ttl)
        except LockLost:
            raise
        except LockError as error:
            if clock.now() < deadline:
                raise
            lost, cause = self.outlived("extended"), error
        self._give_back_outlived()
        raise lost from cause

    def _give_back_outlived(self) -> None:
        """After an extend that outlived the row: one short try to delete whatever is left of
        it (by id and guid: never another holder's row), so that a renewal that still reaches
        the database late leaves no row held by nobody; a frozen database is left alone."""
        with deadlines.statements_end_by(clock.now() + RELEASE_PATIENCE):
            self._give_back_revived()

    def _extend(self, ttl: float | None) -> datetime:
        with concurrency.turn_within(self.op_lock, self.release_patience) as turn:
            if not turn:
                raise self.outlived("extended")
            self.check_extendable()
            if ttl is None:  # a renewal: the period a caller's extend() may just have changed
                ttl = self.ttl
            sent_at = clock.now()
            self.renewing(sent_at, ttl)
            other_length = ttl != self.ttl  # a caller's extend(), not the keep-alive's
            if other_length and self.kept_alive:
                self.keep_alives.changed(self)  # the deadline may have come closer
            with self.telemetry.extending():
                try:
                    # A try resent on a new connection leaves the first one's fate unknown.
                    expires: datetime = self.run(
                        self.operations.extend,
                        self.lockstring,
                        self.lock_id,
                        self.guid,
                        ttl,
                        functools.partial(self.renewal_unsure, ttl),
                    )
                except LockLost as lost:
                    self.mark_lost(lost)
                    raise
                except BaseException:
                    self.renewal_unsure(ttl)
                    raise
            if not self.held:
                # unlock() gave up waiting for this renewal and reported the lock lost, as it
                # had expired by our reckoning; but the row expires later by the database's (by
                # the time our last renewal took to reach it), and this one came in between: it
                # revived the row, for a whole expiry period, for nobody. Given back, and lost:
                # with a deadline of its own, as the extend's own has about passed.
                self._give_back_outlived()
                raise self.lost or self.release_gave_up()
            self.renewed(sent_at, ttl)
            if other_length and self.kept_alive:
                self.keep_alives.changed(self)  # renewed by the new length's cadence
            return expires

    def _give_back_revived(self) -> None:
        try:
            self.run(
                self.operations.release,
                self.lockstring,
                self.lock_id,
                self.guid,
                self.hold_at_least,
            )
        except LockError as error:
            logger.warning(
                "lock %r (id %d), renewed after its release gave up, could not be deleted; "
                "it will expire: %s",
                self.lockstring,
                self.lock_id,
                error,
            )

    def _delete_row(self) -> None:
        """Delete the row (once); LockLost if it was no longer ours.

        If the DELETE fails otherwise (the database unreachable past the retries), the lock still
        counts as held, so that unlock() can be tried again, but it is no longer kept alive: a
        holder that has stopped working must not keep others out beyond the expiry. Nor is it
        valid: the DELETE may have run, its answer lost.
        """
        # Waits for a renewal in flight, but not past the lock's expiry: one stuck on a frozen
        # server would hold the release for the driver's timeout, or for ever.
        with concurrency.turn_within(self.op_lock, self.release_patience) as turn:
            if not self.held:
                return
            self.keep_alives.remove(self)
            if not turn:
                raise self.release_gave_up()
            # From here its DELETE may run, and the row be anyone's, whether or not its answer
            # comes: valid no longer. (Failed or interrupted, unlock() again makes sure the row
            # is gone, with the patience of the row's own expiry.)
            self.release_unsure = True
            with self.telemetry.releasing():
                try:
                    self._delete_within(self.release_patience())
                except LockLost as lost:
                    self.released_lost(lost)
                    raise
            self.held = False
            self.leave_place()
            if self.operations.checkpoint_due():
                self.run(self.operations.checkpoint)

    # The DELETE itself ends by the row's expiry, as we reckon it, on a frozen connection too:
    # then nothing is left to release, and the lock is lost (``release_gave_up``).

    def _delete_within(self, patience: float) -> None:
        deadline = clock.now() + patience
        try:
            # Every cycle's release: called straight, not through ``run``.
            with deadlines.statements_end_by(deadline):
                self.operations.release(
                    self.lockstring, self.lock_id, self.guid, self.hold_at_least
                )
        except LockLost:
            raise
        except LockError as error:
            if clock.now() < deadline:
                raise
            raise self.release_gave_up() from error

    release = _delete_row


def _release_abandoned(state: LockState) -> None:
    """Runs when a held lock is garbage-collected or the interpreter exits; never raises."""
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


class Lock(LockHandle[LockState]):
    """A lock this process holds: ``with`` it, or ``lock.unlock()``."""

    def __init__(
        self,
        locker: LockTaker,
        state: LockState,
        *,
        created: object,
        expires: object,
        locked_by: dict[str, Any],
    ) -> None:
        super().__init__(
            state, _release_abandoned, created=created, expires=expires, locked_by=locked_by
        )
        self.locker = locker  # the locker it came from, for the caller: it calls nothing on it

    def unlock(self) -> None:
        """Delete our row. A second call is a no-op.

        Raises LockLost if the row was no longer ours (purged, taken over or broken after it
        expired): whatever the lock protected may have been touched by someone else meanwhile.
        Any other error leaves the lock held (no longer kept alive, nor valid: the DELETE may
        have run): call unlock() again, or let it expire.
        """
        self._refuse_in_forked_child("release")
        if not self._state.held:
            return
        try:
            self._state.release()
        except LockLost:
            self._finalizer.detach()
            raise
        if not self._state.held:
            self._finalizer.detach()

    def extend(self, seconds: float | None = None) -> datetime:
        """Set expiry to the server's now + ``seconds`` (default: the lock's expiry period).

        Raises LockLost, and the lock counts as lost, if the row is gone or has already
        expired: an expired lock is never revived, because someone may have acted on it.
        """
        ttl = self.ttl if seconds is None else check_seconds(seconds, "expires", self.lockstring)
        self._refuse_in_forked_child("extend")
        try:
            self.expires = self._state.extend(ttl)
        finally:
            self._state.telemetry.end_spans()  # its deadline moved, its turn given up
        return self.expires

    def keep_alive(self, on_lost: OnLost | None = None) -> Lock:
        """Keep the row's expiry pushed forward in the background until unlock().

        Renewal happens every ``keep_alive_fraction`` (a third, by default) of the expiry
        period, on the locker's keep-alive thread (in asyncio: by a task per lock). ``on_lost``
        (else the locker's; in asyncio, a function or a coroutine function) is called once if
        the lock is found gone or its deadline passes without a successful renewal, which is
        always before anyone else can take it over.
        """
        state = self._state
        if on_lost is not None:
            state.on_lost = on_lost
        state.kept_alive = state.held and state.lost is None
        state.keep_alives.add(state)
        return self

    def guard(self, connection: Connection) -> None:
        """Within ``connection``'s open transaction on the lock's own database, prove the lock is
        still ours and keep it from being taken over or purged until that transaction ends.

        Raises LockLost if the row is gone or expired; the caller should then roll back. If it
        returns, a commit of the transaction happens while the lock is held: a stale holder's
        transaction can never commit. PostgreSQL and MySQL take a shared row lock
        (``FOR SHARE``); SQLite takes the database's write lock with a no-op update.

        On a server, the transaction is also ended by the server (rolled back) once its client
        has been silent in it for longer than the lock's remaining life now plus a second, so
        that a client cut off by the network cannot hold the lock past its expiry for as long
        as TCP takes to give up; pauses between the transaction's statements must be shorter.
        """
        self._refuse_in_forked_child("guard")
        state = self._state
        guarding = (state.lockstring, state.lock_id, state.guid, state.guard_silence_limit())
        proven = state.operations.guard(connection, *guarding)
        state.guard_failed(proven)

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
