# Generated from sqllocker/asyncio/rwlock.py by tests/unasync.py: edit that file, then
# run `python -m tests.unasync`.
"""Read-write locks: any number of readers together, or one writer alone (see ``rwlocks.py``).

Written once for asyncio; the sync ``sqllocker/rwlock.py`` is generated from it
(``tests/unasync.py``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from datetime import datetime
from types import TracebackType
from typing import TYPE_CHECKING, Any

from . import clock, concurrency, deadlines
from .backoff import Backoff
from .errors import LockError, LockLost
from .holding import RELEASE_PATIENCE, OnLost, OnLostOnce
from .lock import Lock
from .rwlocks import (
    FENCE_CLAIM,
    READER,
    WRITER,
    WRITER_FENCE,
    check_reader_name,
    check_side_request,
    reader_lockstring,
    reader_pattern,
    refused,
    writer_lockstring,
    writer_pattern,
)
from .telemetry import LostWith, attempted, unrecorded
from .validation import check_lockstring, check_wait

logger = logging.getLogger("sqllocker")

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

    from .lock import LockTaker, Run
    from .operations import LockInfo, LockOperations
    from .telemetry import Telemetry


class RWLock:
    """Readers together or one writer alone on ``name`` (see ``sqllocker.rwlocks``); from the
    locker's ``rwlock()``."""

    def __init__(
        self,
        locker: LockTaker,
        operations: LockOperations,
        run: Run,
        name: str,
        telemetry: Telemetry,
    ) -> None:
        self.locker = locker
        self._operations = operations
        self._run = run
        self._telemetry = telemetry
        self.name = check_lockstring(name)

    def read(
        self,
        *,
        wait: float | None = 0,
        expires: float | None = None,
        keep_alive: bool = False,
        on_lost: OnLost | None = None,
        locked_by: dict[str, Any] | None = None,
        hold_at_least: float | None = None,
    ) -> Lock:
        """A reader's lock (a row of its own, ``lock_id`` its fencing token), released as any
        lock is. Waits while a writer holds the name or waits for it; ``wait``, ``expires``,
        ``keep_alive``, ``on_lost``, ``locked_by`` and ``hold_at_least`` are the locker's
        ``lock()``'s. Raises LockBusy once ``wait`` has passed."""
        check_reader_name(self.name)
        checked = check_wait(wait, self.name)
        locked_by = check_side_request(self.name, expires, on_lost, locked_by, hold_at_least)
        recording = self._telemetry.compound("rwlock.reader", self.name, wait, mapped=True)
        try:
            reader = self._read(checked, expires, on_lost, locked_by, hold_at_least)
        except BaseException as error:
            recording.failed(error)
            raise
        reader._state.telemetry = recording.holding(reader.lock_id)
        try:
            return reader.keep_alive() if keep_alive else reader
        except BaseException:  # never handed over: given back
            _give_back(reader)
            raise
        finally:
            recording.succeeded()  # its span ends once the lock is kept alive

    def _read(
        self,
        wait: float | None,
        expires: float | None,
        on_lost: OnLost | None,
        locked_by: dict[str, Any] | None,
        hold_at_least: float | None,
    ) -> Lock:
        backoff = Backoff.for_wait(wait)
        details = {**(locked_by or {}), "rwlock": READER}
        ran_out = None  # the expiry of our last row, if it ran out before no writer was found
        while True:
            if not self._writers():
                with unrecorded():  # held only once no writer is found after it
                    reader = self.locker.lock(
                        reader_lockstring(self.name),
                        expires=expires,
                        locked_by=details,
                        on_lost=on_lost,
                        hold_at_least=hold_at_least,
                    )
                try:
                    writers = self._writers()
                except BaseException:
                    _give_back(reader)
                    raise
                if not writers and reader.is_valid():
                    return reader
                # A writer came in first (it goes before us), or we were held up so long that
                # our row may have expired before we looked: try again.
                ran_out = None if writers else reader.ttl
                _give_back(reader)
            else:
                ran_out = None
            attempted(None)  # a wait turn
            if backoff.expired():
                raise refused(self.name, READER, wait, ran_out)
            concurrency.sleep(backoff.next_delay())

    def write(
        self,
        *,
        wait: float | None = 0,
        expires: float | None = None,
        keep_alive: bool = False,
        on_lost: OnLost | None = None,
        locked_by: dict[str, Any] | None = None,
        hold_at_least: float | None = None,
    ) -> WriteLock:
        """The writer's lock, once no reader is left: the row ``name`` itself (which also
        excludes a plain lock of the name) and, taken after the readers are gone, a row whose
        id is the lock's ``lock_id``, greater than every token handed out before it. New
        readers are refused from the moment it waits. Raises LockBusy once ``wait`` has
        passed (its row given back)."""
        return self._write(wait, expires, keep_alive, on_lost, locked_by, hold_at_least)

    def _write(
        self,
        wait: float | None,
        expires: float | None,
        keep_alive: bool,
        on_lost: OnLost | None,
        locked_by: dict[str, Any] | None,
        hold_at_least: float | None,
        kind: str = "rwlock.writer",
    ) -> WriteLock:
        """``write()``, recorded as ``kind`` (an election's campaign: ``election``)."""
        checked = check_wait(wait, self.name)
        locked_by = check_side_request(self.name, expires, on_lost, locked_by, hold_at_least)
        recording = self._telemetry.compound(kind, self.name, wait, mapped=True)
        try:
            with unrecorded():  # two rows, one lock: recorded once, below
                lock = self._take_write(checked, expires, on_lost, locked_by, hold_at_least)
        except BaseException as error:
            recording.failed(error)
            raise
        lock._state.telemetry = hold = recording.holding(lock.lock_id)
        lock.claim._state.telemetry = LostWith(hold)
        try:
            try:
                _announce(self._run, self._operations, self.name)
                return lock.keep_alive() if keep_alive else lock
            except BaseException:  # cancelled meanwhile, say: the caller never gets the lock
                _give_back(lock)
                raise
        finally:
            recording.succeeded()  # its span ends once the lock is kept alive

    def _take_write(
        self,
        wait: float | None,
        expires: float | None,
        on_lost: OnLost | None,
        locked_by: dict[str, Any] | None,
        hold_at_least: float | None,
    ) -> WriteLock:
        backoff = Backoff.for_wait(wait)
        while True:
            claim = self.locker.lock(
                self.name,
                expires=expires,
                wait=backoff.remaining(),
                locked_by={**(locked_by or {}), "rwlock": WRITER},
                on_lost=_not_handed_out,
                hold_at_least=hold_at_least,
            )
            try:
                self._wait_out_readers(claim, backoff, wait)
                # Valid after the readers were found gone: the row was live when they were
                # read, so no reader can have come in since but through its expiry.
                if claim.is_valid():
                    token = self.locker.lock(
                        writer_lockstring(self.name),
                        expires=expires,
                        locked_by={
                            **(locked_by or {}),
                            "rwlock": WRITER_FENCE,
                            FENCE_CLAIM: claim.lock_id,
                        },
                        on_lost=_not_handed_out,
                    )
                    # And still valid once the token is drawn: held up on the way past the
                    # claim's expiry, the claim may have been taken over, and that writer's
                    # token drawn before ours, lower than ours: a resource fenced by it would
                    # take our writes and refuse the valid writer's.
                    if claim.is_valid():
                        # Told once, whichever row is found lost first (the locker's on_lost
                        # unless given one); rows not handed out tell nobody.
                        told = on_lost or self.locker.on_lost
                        once = OnLostOnce(told, (claim._state, token._state))
                        claim._state.on_lost = token._state.on_lost = once
                        return WriteLock(claim, token)
                    _give_back(token)
            except LockLost:
                pass  # held up past its expiry while it waited: start again
            except BaseException:
                _give_back(claim)
                raise
            _give_back(claim)
            attempted(None)  # a wait turn
            if backoff.expired():
                raise refused(self.name, WRITER, wait, claim.ttl)
            concurrency.sleep(backoff.next_delay())

    def holders(self) -> list[LockInfo]:
        """The live readers and writer, ordered by lockstring (``locked_by["rwlock"]`` says
        which is which)."""
        self._run(self._operations.ensure_setup)
        readers: list[LockInfo] = self._run(self._operations.permits, *reader_pattern(self.name))
        writers: list[LockInfo] = self._run(self._operations.permits, *writer_pattern(self.name))
        return writers + readers

    def _writers(self) -> int:
        # The count's pattern needs the backend: set up first, as a lock operation would.
        self._run(self._operations.ensure_setup)
        count: int = self._run(self._operations.count_live, *writer_pattern(self.name))
        return count

    def _wait_out_readers(self, claim: Lock, backoff: Backoff, wait: float | None) -> None:
        """Hold ``claim`` (renewing it) until no live reader is left."""
        renewed = time.monotonic()
        while self._run(self._operations.count_live, *reader_pattern(self.name)):
            attempted(None)  # a wait turn
            if backoff.expired():
                raise refused(self.name, WRITER, wait)
            if time.monotonic() - renewed > claim.ttl / 3:
                claim.extend()  # waiting readers out may outlast the claim's expiry
                renewed = time.monotonic()
            concurrency.sleep(backoff.next_delay())

    def __repr__(self) -> str:
        return f"<RWLock {self.name!r}>"


class WriteLock(Lock):
    """A writer's lock: ``claim``, the row ``name`` that keeps readers, writers and plain
    holders of the name out, and the row this handle holds, taken once the readers were gone,
    whose id is ``lock_id``. ``lockstring`` is the name; releases, extends, keep-alive,
    ``is_valid``, ``check`` and ``guard`` act on both rows."""

    def __init__(self, claim: Lock, token: Lock) -> None:
        super().__init__(
            token.locker,
            token._state,
            created=token._created,
            expires=token._expires,
            locked_by=claim.locked_by,
        )
        token._finalizer.detach()  # this handle owns the token row now
        self.claim = claim
        self.lockstring = claim.lockstring

    def is_valid(self) -> bool:
        return super().is_valid() and self.claim.is_valid()

    def check(self) -> None:
        super().check()
        self.claim.check()

    def unlock(self) -> None:
        """Delete both rows: this handle's, then the claim (tried even if the first fails)."""
        try:
            super().unlock()
        finally:
            try:
                self.claim.unlock()
            finally:
                _announce(self._state.run, self._state.operations, self.lockstring)

    def extend(self, seconds: float | None = None) -> datetime:
        self.claim.extend(seconds)
        return super().extend(seconds)

    def keep_alive(self, on_lost: OnLost | None = None) -> WriteLock:
        rows = (self.claim._state, self._state)
        once = None if on_lost is None else OnLostOnce(on_lost, rows)  # for both rows
        self.claim.keep_alive(once)
        super().keep_alive(once)
        return self

    def guard(self, connection: Connection) -> None:
        self.claim.guard(connection)
        super().guard(connection)

    def __enter__(self) -> WriteLock:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            super().__exit__(exc_type, exc_value, traceback)
        finally:
            try:
                self.claim.__exit__(exc_type, exc_value, traceback)
            finally:
                _announce(self._state.run, self._state.operations, self.lockstring)


def _announce(run: Run, operations: LockOperations, name: str) -> None:
    """Tell the observers of ``name``'s writer (an election's) that it changed, through the
    locker's ``operations`` (each run by ``run``): only a hint (see ``Election.observe``),
    so one that fails is logged, and they poll."""
    try:
        # Within a second: the rows are gone already, and a frozen connection must not keep
        # the release (whose patience is the lock's expiry) from returning.
        with deadlines.statements_end_by(clock.now() + RELEASE_PATIENCE):
            run(operations.announce_leader, name)
    except LockError as error:
        logger.info("read-write lock %r: could not tell its observers (%s)", name, error)


def _not_handed_out(lost: LockLost) -> None:
    """The on_lost of a writer's rows until they are handed out: a claim lost while it waits
    for readers is taken again, and tells nobody."""


def _give_back(lock: Lock) -> None:
    """Release a row we will not hold after all, at once (never held, it is kept for no
    ``hold_at_least``); if that fails, it expires."""
    lock._state.hold_at_least = None
    if isinstance(lock, WriteLock):
        lock.claim._state.hold_at_least = None
    with contextlib.suppress(LockError):
        lock.unlock()
