"""Acquiring: a lock (at once, or waiting for it in whichever way the database's waiters wait)
and a group of locks, recorded by telemetry.

Written once for asyncio; the sync ``sqllocker/acquirer.py`` is generated from it
(``tests/unasync.py``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable, Sequence, Sized
from typing import Any

from .. import clock, deadlines, tickets, timeouts, validation
from ..backoff import Backoff
from ..engine import describe_url
from ..errors import DatabaseError, LockError
from ..file_queue import FileQueue
from ..holding import OnLost, OnLostOnce
from ..identity import holder_details, new_guid
from ..operations import LockOperations, Refused
from ..telemetry import Telemetry, attempted
from ..timeouts import CONNECT_SLACK_SECONDS
from . import concurrency
from .acquiring import Winnings, acquisition
from .attempts import AsyncAttempts
from .group import AsyncLockGroup
from .lock import AsyncCall, AsyncKeepAlives, AsyncLock, AsyncLockTaker
from .queue_wait import AsyncQueueWait
from .ticket_wait import AsyncTicketWait

if True:  # ASYNC
    import asyncio

    from ..operations import Acquired
    from .tasks import spawn

logger = logging.getLogger("sqllocker")

# How long each try to delete a failed acquire's row may take (``_forget_attempt``).
FORGET_PATIENCE = 2.0
FORGET_FOR = 30.0


# The block an acquire on SQLite runs in instead of ``deadlines.connections_by`` (its connections
# open a local file), and that of one that waits for ever instead of its statements' bound.
_NO_BOUND = contextlib.nullcontext()


def _attempt_name(members: list[tuple[str, str]]) -> str:
    """An acquire of ``members`` as its log lines name it."""
    first = members[0][0]
    return repr(first) if len(members) == 1 else f"a group of {len(members)} from {first!r}"


class AsyncAcquirer:
    """The acquires of ``locker``'s locks: ``attempts`` at rows, and waits in line by ticket
    (``tickets``) or in the kernel's queue of ``file_queue`` and backing off; one lock or a
    group, through ``operations`` (each run by ``run``), kept alive by ``keep_alives`` and
    recorded by ``telemetry``; a row expired for ``grace`` seconds may be taken over.
    ``ready``: the set-up an acquire awaits first (in asyncio), None where it has nothing to
    do."""

    def __init__(
        self,
        locker: AsyncLockTaker,
        operations: LockOperations,
        run: AsyncCall,
        keep_alives: AsyncKeepAlives,
        file_queue: FileQueue | None,
        telemetry: Telemetry,
        grace: float,
        ready: Callable[[], Awaitable[None] | None],
    ) -> None:
        table_name = locker.table_name
        self.attempts = AsyncAttempts(locker, operations, run, keep_alives, file_queue)
        self.tickets = AsyncTicketWait(
            self.attempts, operations, run, locker.engine, table_name, grace
        )
        self._queue_wait = AsyncQueueWait(self.attempts, operations, run, table_name, grace)
        self._file_queue = file_queue
        self._operations = operations
        self._call = run
        self._telemetry = telemetry
        self._grace = grace
        self._ready = ready
        self._connects_locally = operations.connects_locally

    async def acquire(
        self,
        lockstring: str,
        ttl: float,
        wait: float | None,
        extra: dict[str, Any],
        keep_alive: bool,
        on_lost: OnLost | None,
        hold_at_least: float | None,
        winnings: Winnings,
    ) -> AsyncLock:
        # A new connection gives up with the wait (a little after), not after the driver's
        # connect timeout: a server that accepts and never answers ends a wait on time too.
        # (SQLite's open a file: nothing to give up on, and no block to enter every cycle.)
        # And its statements end with the wait (``timeouts.ACQUIRE_SLACK_SECONDS`` after): on a
        # frozen server or pooler, whose kernel still acknowledges, libpq waits for ever. On
        # SQLite, so do their waits for another connection's write lock (an operator's shell,
        # a stopped process in its transaction), each of which would otherwise last the busy
        # timeout, and be tried again as contention: cut, with no watcher (nothing else waits).
        answer_by, answered, connecting = self._bounds(wait, lockstring)
        # One guid for every attempt of this call: a release may hand the row to it (as our
        # ticket), and an attempt that finds the row under it knows the row is ours.
        guid = new_guid()
        attempts_bound = self._local_bound(answer_by)
        try:
            with answered, connecting:
                return await self._acquire_within(
                    lockstring,
                    guid,
                    ttl,
                    wait,
                    extra,
                    keep_alive,
                    on_lost,
                    hold_at_least,
                    winnings,
                    attempts_bound,
                )
        except DatabaseError:
            self._forget_after_failure([(lockstring, guid)], ttl, answer_by)
            raise

    def _bounds(
        self, wait: float | None, lockstring: str, group: int = 1
    ) -> tuple[
        float | None,
        contextlib.AbstractContextManager[object],
        contextlib.AbstractContextManager[object],
    ]:
        """An acquire's deadline for its statements (its wait plus
        ``timeouts.ACQUIRE_SLACK_SECONDS``; None for ``wait=None``), and on the servers the
        blocks that keep it and its new connections' (the wait plus CONNECT_SLACK_SECONDS;
        for ``wait=None``, the driver's connect timeout, whatever an outer block said)."""
        if wait is None:
            connects = _NO_BOUND if self._connects_locally else deadlines.connections_by(None)
            return None, _NO_BOUND, connects
        now = clock.now()
        answer_by = now + wait + timeouts.ACQUIRE_SLACK_SECONDS
        if self._connects_locally:
            return answer_by, _NO_BOUND, _NO_BOUND
        no_answer = functools.partial(self._no_answer, lockstring, group)
        connecting = deadlines.connections_by(now + wait + CONNECT_SLACK_SECONDS)
        return answer_by, concurrency.answered_by(answer_by, no_answer), connecting

    def _forget_after_failure(
        self, members: list[tuple[str, str]], ttl: float, answer_by: float | None
    ) -> None:
        """After an acquire of ``members`` failed with a DatabaseError: its INSERTs may have
        committed with the answer lost, rows held by nobody that would keep everyone out until
        they expired, so they are deleted in the background (``_forget_attempt``). Cut at the
        deadline, they may commit later still (a commit waiting, which no statement timeout
        ends); on SQLite, a wait for the write lock cut short has written nothing."""
        cut = answer_by is not None and not self._connects_locally and clock.now() >= answer_by
        self.tickets.leaving.call_soon(self._forget_attempt, members, ttl, cut)

    def _local_bound(self, answer_by: float | None) -> contextlib.AbstractContextManager[object]:
        """On SQLite, the block an acquire's attempts run in: their waits for another
        connection's write lock end by ``answer_by``, and contention is not tried again past
        it (the servers' acquires are bounded by ``answered_by`` instead). Around the attempts
        alone, not the keep-alive their lock starts: an asyncio task copies the context it is
        made in, and a renewal must not carry the acquire's deadline for its life."""
        if answer_by is None or not self._connects_locally:
            return _NO_BOUND
        return deadlines.waits_end_by(answer_by)

    def _no_answer(self, lockstring: str, group: int = 1) -> DatabaseError:
        """The error of an acquire whose statements did not end by its wait plus
        ``timeouts.ACQUIRE_SLACK_SECONDS`` (of a ``group`` of locks, ``lockstring`` first)."""
        slack = timeouts.ACQUIRE_SLACK_SECONDS
        what = f"lock {lockstring!r}" if group == 1 else f"{group} locks from {lockstring!r}"
        return DatabaseError(
            f"no answer from {describe_url(self._operations.database.url)} for {what} within "
            f"its wait and {slack:g} s more: the server or a pooler may be frozen",
            lockstring,
            outage=True,
        )

    async def _forget_attempt(
        self, members: list[tuple[str, str]], ttl: float, cut: bool = False
    ) -> None:
        """Delete the rows a failed acquire of ``members`` (each lockstring with its guid; a
        group's commit together or not at all) may have left, once the database answers:
        tried every ``tickets.GIVE_UP_AGAIN`` seconds, each try ending by FORGET_PATIENCE,
        until the rows would have expired, or for FORGET_FOR at most, in the background beside
        the tickets' give-ups; never another acquisition's row (``Statements.forget_attempt``).
        An acquire ``cut`` at its deadline may still be committing its rows, not yet there to
        delete: until all are found, they are looked for again, through the same window (a try
        deletes a group's rows one by one, and its commit may land between two of them)."""
        what = _attempt_name(members)
        until = clock.now() + min(ttl, FORGET_FOR)
        answered = False
        found = 0
        while not self.tickets.closing.is_set() and clock.now() < until:
            deleted: int | None = None
            try:
                if True:  # ASYNC
                    with contextlib.suppress(asyncio.TimeoutError):
                        deleted = await concurrency.within(
                            self._call(self._operations.forget_attempt, members),
                            FORGET_PATIENCE,
                            f"forget a failed acquire of {what}",
                        )
                else:
                    bound = clock.now() + FORGET_PATIENCE
                    with deadlines.statements_end_by(bound):
                        deleted = self._operations.forget_attempt(members)
            except LockError:
                pass
            answered = answered or deleted is not None
            found += deleted or 0
            if deleted is None or (cut and found < len(members)):
                await concurrency.wait(self.tickets.closing, tickets.GIVE_UP_AGAIN)
                continue
            if found:
                logger.info("deleted the row(s) of a failed acquire of %s", what)
            return
        if found:  # cut, and some did not turn up while they were looked for
            logger.info(
                "deleted %d of the %d rows of a failed acquire of %s; one committed later will "
                "expire",
                found,
                len(members),
                what,
            )
        elif answered:  # cut, and none turned up while it was looked for
            logger.info(
                "no row of a failed acquire of %s turned up; one committed later will expire",
                what,
            )
        else:
            logger.warning(
                "the row a failed acquire of %s may have left could not be deleted; it will expire",
                what,
            )

    async def _acquire_within(
        self,
        lockstring: str,
        guid: str,
        ttl: float,
        wait: float | None,
        extra: dict[str, Any],
        keep_alive: bool,
        on_lost: OnLost | None,
        hold_at_least: float | None,
        winnings: Winnings,
        attempts_bound: contextlib.AbstractContextManager[object],
    ) -> AsyncLock:
        with attempts_bound:
            if True:  # ASYNC
                readying = self._ready()
                if readying is not None:
                    await readying
            details = holder_details(extra, concurrency.task_name())
            acquisition = self._telemetry.acquiring(lockstring, wait)
            try:
                if wait == 0:
                    lock = await self.attempts.try_once(
                        winnings, lockstring, guid, details, ttl, on_lost
                    )
                else:
                    lock = await self._wait_for(
                        winnings, lockstring, guid, details, ttl, wait, on_lost
                    )
            except BaseException as error:
                acquisition.failed(error)
                raise
        lock._state.telemetry = acquisition.holding(lock._state.lock_id)
        lock._state.hold_at_least = hold_at_least
        try:
            return lock.keep_alive() if keep_alive else lock
        finally:
            acquisition.succeeded()  # its span ends once the lock is kept alive

    async def _wait_for(
        self,
        winnings: Winnings,
        lockstring: str,
        guid: str,
        details: dict[str, Any],
        ttl: float,
        wait: float | None,
        on_lost: OnLost | None,
    ) -> AsyncLock:
        """Attempts until one succeeds, or LockBusy once ``wait`` has passed: in line by
        ticket where waiters take tickets (``AsyncTicketWait``), in the kernel's queue on
        SQLite, and elsewhere backing off between attempts (``AsyncQueueWait``)."""
        listener = self.tickets.release_listener()
        if listener is not None:
            return await self.tickets.wait(
                winnings, listener, lockstring, guid, details, ttl, wait, on_lost
            )
        return await self._queue_wait.wait(
            winnings, self._file_queue, lockstring, guid, details, ttl, wait, on_lost
        )

    async def lock_all(
        self,
        lockstrings: Sequence[str],
        *,
        wait: float | None = 0,
        expires: float | None = None,
        locked_by: dict[str, Any] | None = None,
        keep_alive: bool = False,
        on_lost: OnLost | None = None,
        defaults: tuple[float, OnLost | None],
    ) -> AsyncLockGroup:
        """``AsyncLocker.lock_all``, with the locker's ``defaults`` (its expiry and its
        ``on_lost``) as they are now."""
        size = len(lockstrings) if isinstance(lockstrings, Sized) else 0
        acquisition = self._telemetry.compound("group", f"group of {size}", wait)
        try:
            group = await self._lock_all(
                lockstrings,
                wait=wait,
                expires=expires,
                locked_by=locked_by,
                keep_alive=keep_alive,
                on_lost=on_lost,
                defaults=defaults,
            )
        except BaseException as error:
            acquisition.failed(error)
            raise
        for lock in group:
            lock._state.telemetry = acquisition.member(lock.lock_id)
        acquisition.succeeded()
        return group

    async def _lock_all(
        self,
        lockstrings: Sequence[str],
        *,
        wait: float | None = 0,
        expires: float | None = None,
        locked_by: dict[str, Any] | None = None,
        keep_alive: bool = False,
        on_lost: OnLost | None = None,
        defaults: tuple[float, OnLost | None],
    ) -> AsyncLockGroup:
        default_expires, default_on_lost = defaults
        names = validation.canonical_order(lockstrings)
        request = validation.check_lock_request(
            names[0], expires, default_expires, wait, locked_by, on_lost
        )
        _, ttl, wait, extra = request
        on_lost = on_lost or default_on_lost
        once = OnLostOnce(on_lost)  # for the group, not each row
        return await acquisition(self._acquire_all, names, ttl, wait, extra, keep_alive, once)

    async def _acquire_all(
        self,
        names: list[str],
        ttl: float,
        wait: float | None,
        extra: dict[str, Any],
        keep_alive: bool,
        on_lost: OnLostOnce,
        winnings: Winnings,
    ) -> AsyncLockGroup:
        # Bounded as lock()'s acquire is (see ``acquire``).
        answer_by, answered, connecting = self._bounds(wait, names[0], len(names))
        members = [(name, new_guid()) for name in names]
        try:
            with answered, connecting:
                return await self._acquire_all_within(
                    members, ttl, wait, extra, keep_alive, on_lost, winnings, answer_by
                )
        except DatabaseError:
            self._forget_after_failure(members, ttl, answer_by)
            raise

    async def _acquire_all_within(
        self,
        members: list[tuple[str, str]],
        ttl: float,
        wait: float | None,
        extra: dict[str, Any],
        keep_alive: bool,
        on_lost: OnLostOnce,
        winnings: Winnings,
        answer_by: float | None,
    ) -> AsyncLockGroup:
        names = [name for name, _ in members]
        if True:  # ASYNC
            readying = self._ready()
            if readying is not None:
                await readying
        details = holder_details(extra, concurrency.task_name())
        backoff = Backoff.for_wait(wait)
        with self._local_bound(answer_by):
            while True:
                if True:  # ASYNC
                    outcome = await concurrency.shielded(
                        self._call(self._operations.try_acquire_all, members, ttl, details),
                        f"acquire {len(names)} locks",
                        functools.partial(self._release_group_won, members),
                    )
                else:
                    outcome = self._operations.try_acquire_all(members, ttl, details)
                for attempt in [outcome] if isinstance(outcome, Refused) else outcome:
                    attempted(attempt)  # a wait turn, or a member taken (over)
                if not isinstance(outcome, Refused):
                    break
                await concurrency.sleep(backoff.after_refusal(outcome, names[0], wait, self._grace))
        locks = [
            self.attempts.handle(winnings, name, guid, acquired, ttl, details, on_lost)
            for (name, guid), acquired in zip(members, outcome, strict=True)
        ]
        on_lost.rows = [lock._state for lock in locks]
        group = AsyncLockGroup(locks)
        return group.keep_alive() if keep_alive else group

    if True:  # ASYNC

        def _release_group_won(
            self, members: list[tuple[str, str]], outcome: list[Acquired] | Refused
        ) -> None:
            """The caller of a group's attempt was cancelled: release the rows it took, if any."""
            if isinstance(outcome, list):
                for (name, guid), acquired in zip(members, outcome, strict=True):
                    release = self._call(self._operations.release, name, acquired.lock_id, guid)
                    spawn(release, f"release {name!r} after cancellation")
