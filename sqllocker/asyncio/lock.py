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
from collections.abc import Awaitable, Callable
from datetime import datetime
from types import TracebackType
from typing import Any, Protocol, TypeVar

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from .. import clock, deadlines, forks
from ..errors import LockError, LockLost
from ..holding import RELEASE_PATIENCE, Holding, LockHandle, OnLost
from ..operations import LockInfo, LockOperations
from ..validation import check_seconds
from . import concurrency

if True:  # ASYNC
    import asyncio
    import contextlib
    import inspect

    from .tasks import spawn


logger = logging.getLogger("sqllocker")

# Runs one LockOperations operation for the locker (in asyncio: in a greenlet, on the running
# loop's connections).
Run = Callable[..., Awaitable[Any]]

T = TypeVar("T")


class AsyncCall(Protocol):
    """How a locker runs one of the table's operations, typed (``AsyncLocker._call``)."""

    async def __call__(self, operation: Callable[..., T], *args: Any) -> T:
        """``operation(*args)`` (in asyncio: in a greenlet, on the running loop's
        connections)."""
        ...


class AsyncKeepAlives(Protocol):
    """What a lock's state asks of its locker's keep-alive (``keepalive.py``)."""

    def add(self, state: AsyncLockState) -> None:
        """Renew ``state`` in the background until it is removed."""

    def remove(self, state: AsyncLockState) -> None:
        """Stop renewing ``state``."""

    def changed(self, state: AsyncLockState) -> None:
        """``state``'s deadline or expiry period changed (an extend() of another length than
        it has): look again when to renew it, and when its deadline comes."""


class AsyncLockTaker(Protocol):
    """The locker a lock came from (``AsyncLocker``), as the lock's handle, read-write locks
    and elections know it: what takes and reads locks on its table."""

    engine: AsyncEngine
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
    ) -> Awaitable[AsyncLock]:
        """Acquire ``lockstring`` (see ``AsyncLocker.lock``)."""
        ...

    async def lock_info(self, lockstring: str) -> LockInfo | None:
        """The row of ``lockstring``, live or expired, or None if there is none."""
        ...


class AsyncLockState(Holding):
    """One acquisition, as the keep-alive, the finaliser and the handle act on it, with what
    its statements need: the table's operations, how to run one (``run``) and the keep-alive.

    ``op_lock`` serialises extend, renewal and release: once release() returns, no renewal
    statement of this lock can still be in flight or start.
    """

    def __init__(
        self,
        operations: LockOperations,
        run: Run,
        keep_alives: AsyncKeepAlives,
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
        if True:  # ASYNC
            self.loop = asyncio.get_running_loop()
            self.releasing: concurrency.InFlight[None] | None = None

    def stop_renewing(self) -> None:
        self.keep_alives.remove(self)

    async def extend(self, ttl: float | None = None) -> datetime:
        """Push the row's expiry to server now + ``ttl`` (None: the lock's expiry period as it
        is when the statement is sent, the keep-alive's renewal); LockLost (and lost) if it is
        not ours, or if no answer came before the row expired as we reckon it
        (``release_patience``), whatever the driver's timeouts: behind a renewal in flight, or
        on a frozen connection."""
        patience = self.release_patience()
        if True:  # ASYNC
            try:
                return await concurrency.within(
                    self._extend(ttl), patience, f"extend {self.lockstring!r}"
                )
            except asyncio.TimeoutError as timeout:
                lost = self.outlived("extended")
                # A database error met at the deadline, if that is what ended it (``within``).
                error = timeout.__cause__
                cause: LockError | None = error if isinstance(error, LockError) else None
        else:
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
        await self._give_back_outlived()
        raise lost from cause

    async def _give_back_outlived(self) -> None:
        """After an extend that outlived the row: one short try to delete whatever is left of
        it (by id and guid: never another holder's row), so that a renewal that still reaches
        the database late leaves no row held by nobody; a frozen database is left alone."""
        if True:  # ASYNC
            with contextlib.suppress(asyncio.TimeoutError):
                await concurrency.within(
                    self._give_back_revived(), RELEASE_PATIENCE, f"give {self.lockstring!r} back"
                )
        else:
            with deadlines.statements_end_by(clock.now() + RELEASE_PATIENCE):
                self._give_back_revived()

    async def _extend(self, ttl: float | None) -> datetime:
        async with concurrency.turn_within(self.op_lock, self.release_patience) as turn:
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
                    expires: datetime = await self.run(
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
                await self._give_back_outlived()
                raise self.lost or self.release_gave_up()
            self.renewed(sent_at, ttl)
            if other_length and self.kept_alive:
                self.keep_alives.changed(self)  # renewed by the new length's cadence
            return expires

    async def _give_back_revived(self) -> None:
        try:
            await self.run(
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

    async def _delete_row(self) -> None:
        """Delete the row (once); LockLost if it was no longer ours.

        If the DELETE fails otherwise (the database unreachable past the retries), the lock still
        counts as held, so that unlock() can be tried again, but it is no longer kept alive: a
        holder that has stopped working must not keep others out beyond the expiry. Nor is it
        valid: the DELETE may have run, its answer lost.
        """
        # Waits for a renewal in flight, but not past the lock's expiry: one stuck on a frozen
        # server would hold the release for the driver's timeout, or for ever.
        async with concurrency.turn_within(self.op_lock, self.release_patience) as turn:
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
                    await self._delete_within(self.release_patience())
                except LockLost as lost:
                    self.released_lost(lost)
                    raise
            self.held = False
            self.leave_place()
            if self.operations.checkpoint_due():
                await self.run(self.operations.checkpoint)

    # The DELETE itself ends by the row's expiry, as we reckon it, on a frozen connection too:
    # then nothing is left to release, and the lock is lost (``release_gave_up``).
    if True:  # ASYNC

        def _delete_within(self, patience: float) -> Awaitable[None]:
            # Every cycle's release: no coroutine of its own.
            return concurrency.within(
                self.run(
                    self.operations.release,
                    self.lockstring,
                    self.lock_id,
                    self.guid,
                    self.hold_at_least,
                ),
                patience,
                f"release {self.lockstring!r}",
                self.release_gave_up,
            )

    else:

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

    if True:  # ASYNC

        async def release(self) -> None:
            """``_delete_row``, run to its end whoever stops waiting for it; a call while it runs
            waits for it."""
            flight = self.releasing
            if flight is not None:
                await flight.wait()
                return
            if not self.held:
                return
            # Set before it starts: a release that fails at once clears it again.
            flight = self.releasing = concurrency.InFlight(f"release {self.lockstring!r}")
            if not self.op_lock.locked():
                await flight.run(self._release_in_flight())
                return
            # Behind a statement of the lock's in flight (a renewal, which may be stuck on a
            # frozen server, and whose cancellation may wait on it too): waited for no longer
            # than the lock lives. The release goes on by itself, and finds the lock let go.
            try:
                await asyncio.wait_for(
                    flight.run(self._release_in_flight()), self.release_patience()
                )
            except asyncio.TimeoutError:
                self.keep_alives.remove(self)
                raise self.release_gave_up() from None

        async def _release_in_flight(self) -> None:
            try:
                await self._delete_row()
            finally:
                if self.held:
                    self.releasing = None  # it failed: a later unlock() tries again

        def _call_on_lost(self, on_lost: OnLost, lost: LockLost) -> None:
            result = on_lost(lost)
            if inspect.isawaitable(result):
                spawn(_await(result), f"on_lost of {self.lockstring!r}")

    else:
        release = _delete_row


if True:  # ASYNC

    async def _await(awaitable: Any) -> None:
        try:
            await awaitable
        except Exception:
            logger.exception("async on_lost callback raised")

    def _release_abandoned(state: AsyncLockState) -> None:
        """Runs when a held lock is garbage-collected; it cannot await, so it hands the release
        to the lock's event loop if that still runs, and otherwise leaves the row to expire."""
        if not state.held or state.pid != forks.pid or state.releasing is not None:
            return
        loop = state.loop
        if loop.is_closed():
            logger.warning(
                "lock %r (id %d) was dropped after its event loop closed; it will expire",
                state.lockstring,
                state.lock_id,
            )
            return
        logger.warning(
            "lock %r (id %d) was released by garbage collection; unlock() it or use `async with`",
            state.lockstring,
            state.lock_id,
        )
        try:
            loop.call_soon_threadsafe(_release_in_loop, state)
        except RuntimeError:  # the loop closed meanwhile
            logger.warning("could not release abandoned lock %r; it will expire", state.lockstring)

    def _release_in_loop(state: AsyncLockState) -> None:
        async def release() -> None:
            try:
                await state.release()
            except LockLost:
                logger.info("abandoned lock %r was already gone", state.lockstring)
            except Exception as error:
                logger.warning(
                    "could not release abandoned lock %r; it will expire: %s",
                    state.lockstring,
                    error,
                )

        spawn(release(), f"release abandoned {state.lockstring!r}")

else:

    def _release_abandoned(state: AsyncLockState) -> None:
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
            logger.info(
                "abandoned lock %r (id %d) was already gone", state.lockstring, state.lock_id
            )
        except Exception as error:
            logger.warning(
                "could not release abandoned lock %r (id %d); it will expire: %s",
                state.lockstring,
                state.lock_id,
                error,
            )


class AsyncLock(LockHandle[AsyncLockState]):
    """A lock this process holds: ``async with`` it, or ``await lock.unlock()``."""

    def __init__(
        self,
        locker: AsyncLockTaker,
        state: AsyncLockState,
        *,
        created: object,
        expires: object,
        locked_by: dict[str, Any],
    ) -> None:
        super().__init__(
            state, _release_abandoned, created=created, expires=expires, locked_by=locked_by
        )
        self.locker = locker  # the locker it came from, for the caller: it calls nothing on it

    async def unlock(self) -> None:
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
            await self._state.release()
        except LockLost:
            self._finalizer.detach()
            raise
        if not self._state.held:
            self._finalizer.detach()

    async def extend(self, seconds: float | None = None) -> datetime:
        """Set expiry to the server's now + ``seconds`` (default: the lock's expiry period).

        Raises LockLost, and the lock counts as lost, if the row is gone or has already
        expired: an expired lock is never revived, because someone may have acted on it.
        """
        ttl = self.ttl if seconds is None else check_seconds(seconds, "expires", self.lockstring)
        self._refuse_in_forked_child("extend")
        try:
            self.expires = await self._state.extend(ttl)
        finally:
            self._state.telemetry.end_spans()  # its deadline moved, its turn given up
        return self.expires

    def keep_alive(self, on_lost: OnLost | None = None) -> AsyncLock:
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

    async def guard(self, connection: AsyncConnection) -> None:
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
        if True:  # ASYNC
            proven = await connection.run_sync(state.operations.guard, *guarding)
        else:
            proven = state.operations.guard(connection, *guarding)
        state.guard_failed(proven)

    async def __aenter__(self) -> AsyncLock:
        return self

    async def __aexit__(
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
            await self.unlock()
        except Exception as error:
            lost = self._release_failed_at_exit(error, lost, exc_value)
        if lost is not None:
            # Losing the lock matters more than the body's error, which stays attached as cause.
            raise lost from exc_value
