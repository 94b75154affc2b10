# Generated from sqllocker/asyncio/election.py by tests/unasync.py: edit that file, then
# run `python -m tests.unasync`.
"""Leader election: one leader of a name at a time (see ``elections.py``).

Written once for asyncio; the sync ``sqllocker/election.py`` is generated from it
(``tests/unasync.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from types import TracebackType
from typing import TYPE_CHECKING, Any

from . import concurrency
from .elections import (
    HINTED_READ_GAP,
    OBSERVE_INTERVAL,
    Leader,
    leader_from,
)
from .holding import OnLost
from .rwlock import RWLock, WriteLock
from .rwlocks import check_side_request, writer_fence_pattern
from .validation import check_lockstring, check_seconds_or_zero

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

    from .listener import ReleaseListener
    from .lock import LockTaker, Run
    from .operations import LockInfo, LockOperations
    from .telemetry import Telemetry


class Leadership:
    """This process leads: ``term`` (= ``lock_id``) is its fencing token. Kept alive until
    ``resign()``; ``is_valid()`` and ``guard(conn)`` as a lock's."""

    def __init__(self, lock: WriteLock) -> None:
        self.lock = lock
        self.term = self.lock_id = lock.lock_id

    def is_valid(self) -> bool:
        """Whether this process may still act as the leader (a local check, as a lock's)."""
        return self.lock.is_valid()

    def guard(self, connection: Connection) -> None:
        """Within ``connection``'s transaction, prove the lead still ours (see a lock's
        ``guard``); LockLost once it is not."""
        self.lock.guard(connection)

    def resign(self) -> None:
        """Give up the lead at once: the next candidate in line takes it."""
        self.lock.unlock()

    def __enter__(self) -> Leadership:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.lock.__exit__(exc_type, exc_value, traceback)

    def __repr__(self) -> str:
        return f"<Leadership {self.lock.lockstring!r} term={self.term}>"


class Election:
    """Candidates for the lead of ``name`` (see ``sqllocker.elections``); from the locker's
    ``election()``."""

    def __init__(
        self,
        locker: LockTaker,
        operations: LockOperations,
        run: Run,
        name: str,
        release_listener: Callable[[], ReleaseListener | None],
        telemetry: Telemetry,
    ) -> None:
        self.locker = locker
        self._operations = operations
        self._run = run
        self._telemetry = telemetry
        # The locker's listener, where waiters take tickets: on PostgreSQL it hears the
        # candidates' NOTIFYs.
        self._release_listener = release_listener
        self.name = check_lockstring(name)

    def campaign(
        self,
        *,
        wait: float | None = None,
        expires: float | None = None,
        on_lost: OnLost | None = None,
        locked_by: dict[str, Any] | None = None,
    ) -> Leadership:
        """Wait (``None``: without limit) until this process leads, and keep the lead alive;
        ``on_lost`` (else the locker's) is called if it is lost, before anyone else can lead.
        Raises LockBusy once ``wait`` has passed."""
        rwlock = RWLock(self.locker, self._operations, self._run, self.name, self._telemetry)
        details = check_side_request(self.name, expires, on_lost, locked_by, None)
        lock = rwlock._write(
            wait, expires, True, on_lost, {**details, "election": "leader"}, None, kind="election"
        )
        return Leadership(lock)

    def leader(self) -> Leader | None:
        """Who leads now, as the row says, or None."""
        info = self.locker.lock_info(self.name)
        if info is None:
            return None
        fences: list[LockInfo] = self._run(
            self._operations.permits, *writer_fence_pattern(self.name)
        )
        return leader_from(info, fences)

    def observe(self, interval: float = OBSERVE_INTERVAL) -> Generator[Leader | None, None]:
        """The leader now, then each change of leader (None while there is none), read at
        most ``interval`` (at most a second) apart, and on PostgreSQL again at once when a
        candidate says it took or gave up the lead (a NOTIFY, taken as a hint to read)."""
        interval = min(
            max(check_seconds_or_zero(interval, "interval", self.name), 0.01),
            OBSERVE_INTERVAL,
        )
        self._run(self._operations.ensure_setup)
        listener = self._release_listener()
        if listener is not None and not listener.hands_over:
            listener = None  # MySQL/MariaDB: no NOTIFY, the poll alone
        last: Leader | None = None
        first = True
        while True:
            started = time.monotonic()
            # Subscribed before the read: a change after it wakes the wait below.
            hint = None if listener is None else listener.observe(self.name)
            try:
                now = self.leader()
                if (
                    first
                    or (now is None) != (last is None)
                    or (now and last and now.term != last.term)
                ):
                    yield now
                    first, last = False, now
                left = max(0.0, interval - (time.monotonic() - started))
                if hint is None or listener is None:
                    concurrency.sleep(left)
                else:
                    listener.wait(hint, left)
                    # A flood of NOTIFYs (anyone may send them) costs at most a read a tick.
                    gap = HINTED_READ_GAP - (time.monotonic() - started)
                    concurrency.sleep(max(0.0, gap))
            finally:
                if listener is not None and hint is not None:
                    listener.unobserve(hint)

    def __repr__(self) -> str:
        return f"<Election {self.name!r}>"
