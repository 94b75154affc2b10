# Generated from sqllocker/asyncio/queue_wait.py by tests/unasync.py: edit that file, then
# run `python -m tests.unasync`.
"""Waiting for a lock without a ticket: in the kernel's queue of its waiters on SQLite (see
``sqllocker.file_queue``), elsewhere backing off between attempts.

Written once for asyncio; the sync ``sqllocker/queue_wait.py`` is generated from it
(``tests/unasync.py``).
"""

from __future__ import annotations

from typing import Any

from . import concurrency
from .acquiring import Winnings
from .attempts import Attempts, wait_out
from .backoff import Backoff
from .errors import DatabaseError
from .file_queue import BellListener, FileQueue, PlaceRequest, offsets
from .holding import OnLost
from .lock import Call, Lock
from .operations import LockInfo, LockOperations


class QueueWait:
    """The waits of a locker's waiters where they take no tickets: ``attempts`` at the rows of
    ``table_name``, whose holders' rows ``operations`` reads (run by ``run``); a row expired
    for ``grace`` seconds may be taken over."""

    def __init__(
        self,
        attempts: Attempts,
        operations: LockOperations,
        run: Call,
        table_name: str,
        grace: float,
    ) -> None:
        self._attempts = attempts
        self._operations = operations
        self._call = run
        self._offset = offsets(table_name)  # of a lockstring's place in the kernel's queue
        self._grace = grace

    def wait(
        self,
        winnings: Winnings,
        queue: FileQueue | None,
        lockstring: str,
        guid: str,
        details: dict[str, Any],
        ttl: float,
        wait: float | None,
        on_lost: OnLost | None,
    ) -> Lock:
        """Attempts until one succeeds, or LockBusy once ``wait`` has passed, in the kernel's
        queue of ``lockstring`` (SQLite: see ``sqllocker.file_queue``): only the waiter holding
        its place tries the row, and keeps the place while the row is ours. Without a
        ``queue``, backing off between attempts."""
        backoff = Backoff.for_wait(wait)
        offset = self._offset(lockstring) if queue is not None else 0
        place = queue.take(offset) if queue is not None else None
        request: PlaceRequest | None = None
        bell: BellListener | None = None
        # Seconds until the row as last read can be taken over (0: free; None: unknown).
        until_free: float | None = None
        # Until the kernel's queue fails us (then back off, unqueued).
        in_line = queue is not None
        try:
            while True:
                if place is None and in_line and queue is not None:
                    request = request or queue.request(offset)
                    if request is None:
                        in_line = False  # the queue file cannot be opened: back off, unqueued
                    else:
                        if bell is None:
                            # Listening before the row is first read: a break after it is heard.
                            bell = queue.listen()
                            until_free = self._until_free(lockstring)
                        granted, wake = concurrency.woken_from_thread()
                        request.when_granted(wake)
                        bell.when_rung(wake)
                        concurrency.wait(granted, backoff.turn_patience(until_free))
                        place = request.take()
                        if place is not None or request.granted.is_set():
                            in_line, request = place is not None, None
                        elif not bell.heard() and not backoff.expired():
                            # Not our turn yet, and no break heard of: a look at the row, and
                            # an attempt only if it is free or takeable.
                            until_free = self._until_free(lockstring)
                            if until_free is not None and until_free > 0:
                                continue
                try:
                    # Not our turn: the row is read before any INSERT.
                    outcome = self._attempts.try_acquire(
                        winnings, lockstring, guid, details, ttl, on_lost, look_first=place is None
                    )
                except DatabaseError as error:
                    wait_out(error, backoff, lockstring)
                    continue
                if isinstance(outcome, Lock):
                    if place is not None:  # kept while the row is ours
                        outcome._state.place, place = place, None
                    return outcome
                until_free = backoff.until_takeable(outcome, self._grace)
                if place is not None and queue is not None and not backoff.expired():
                    # Our turn, but the row is held by a lock taken without its place: its
                    # release finds our place held, and rings the bell. Heard from here on,
                    # and the row read again, in case the release came before.
                    bell = bell or queue.listen()
                    bell.turns = offset
                    until_free = self._until_rung(bell, backoff, lockstring)
                    continue
                if place is not None or not in_line or backoff.expired():
                    # Our turn, but the row is held by someone who did not queue (or whose
                    # grace is not over): back off until it is free.
                    delay = backoff.after_refusal(outcome, lockstring, wait, self._grace)
                    concurrency.sleep(delay)
        finally:
            if bell is not None:
                bell.close()
            if request is not None:
                request.withdraw()
            if place is not None:
                place.leave()

    def _until_rung(self, bell: BellListener, backoff: Backoff, lockstring: str) -> float | None:
        """Holding the place of ``lockstring`` while its row is held by a lock taken without
        it: until the bell rings for a turn or a break, or a look at the row (a read, at
        ``turn_patience``) finds it free or takeable, or the wait is over; what the last look
        found (None after a ring)."""
        while True:
            bell.heard()  # a ring before this look is answered by it
            until_free = self._until_free(lockstring)
            if until_free == 0 or backoff.expired():
                return until_free
            granted, wake = concurrency.woken_from_thread()
            bell.when_rung(wake)
            concurrency.wait(granted, backoff.turn_patience(until_free))
            if bell.heard() and not bell.ours:
                continue  # rung for another place: a look (a read), not an INSERT
            if bell.ours or until_free is None:
                # Rung for our place (by the release, most likely) or a break: the row tried
                # at once, no look first. Unknown (a DBIx::Locker row): an attempt says,
                # after a while.
                return None

    def _until_free(self, lockstring: str) -> float | None:
        """A queued waiter's look at the row (a read): seconds until it can be taken over, 0
        if it is free or can be now; None if unknown (the read failed, or a DBIx::Locker row,
        taken over only once expired in every time zone)."""
        try:
            info: LockInfo | None = self._call(self._operations.lock_info, lockstring)
        except DatabaseError:
            return None
        if info is None:
            return 0.0
        return None if info.dbix_locker else max(0.0, info.seconds_left + self._grace)
