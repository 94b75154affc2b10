"""Attacks on the async lock cycle's cancellation and release deadlines (one timer per loop)."""
# ruff: noqa: F811  (fixtures imported from test_asyncio)

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa

from sqllocker import Locker, LockError, LockLost
from sqllocker.asyncio import AsyncLock, AsyncLocker, alarm, concurrency
from sqllocker.engine import resolve_url
from tests.test_asyncio import (  # noqa: F401  (fixtures)
    MakeAsync,
    alocker,
    blocker,
    eventually,
    hopping_alocker,
    make_async_locker,
)
from tests.workers import async_url


def hold_rows(blocker: sa.Connection, locker: AsyncLocker, locks: list[AsyncLock]) -> None:
    """In ``blocker``'s one transaction, write every lock's row so that their DELETEs wait."""
    blocker.begin()
    table = locker.table
    for lock in locks:
        blocker.execute(
            table.update().where(table.c.id == lock.lock_id).values(expires=table.c.expires)
        )


async def _release_timed(lock: AsyncLock, started: float) -> tuple[float, BaseException | None]:
    try:
        await lock.unlock()
    except BaseException as error:
        return time.monotonic() - started, error
    return time.monotonic() - started, None


async def test_deadlines_of_locks_released_together_each_fire_at_their_own_time(
    alocker: AsyncLocker, blocker: sa.Connection
) -> None:
    """Releases blocked on their rows, their deadlines added in no order (a later one first,
    then an earlier one): each gives up at its own deadline, with the lock's own error."""
    ttls = [3.0, 2.0, 4.0, 2.5, 2.0, 3.5]
    locks = [await alocker.lock(f"deadline {n}", expires=ttl) for n, ttl in enumerate(ttls)]
    patience = [lock._state.release_patience() for lock in locks]
    hold_rows(blocker, alocker, locks)
    started = time.monotonic()
    tasks = []
    for lock in locks:
        tasks.append(asyncio.ensure_future(_release_timed(lock, started)))
        await asyncio.sleep(0.05)
    results = await asyncio.gather(*tasks)
    blocker.rollback()
    for (took, error), expected in zip(results, patience, strict=True):
        assert isinstance(error, LockError), error
        assert not isinstance(error, (asyncio.TimeoutError, asyncio.CancelledError))
        assert expected - 0.3 < took < expected + 0.9, (took, expected)


@pytest.mark.parametrize("order", ["cancel_first", "deadline_first"])
async def test_caller_cancelled_in_the_deadlines_turn(
    alocker: AsyncLocker, blocker: sa.Connection, monkeypatch: pytest.MonkeyPatch, order: str
) -> None:
    """The caller's cancel() in the very callback where the release's deadline fires: the
    caller gets its CancelledError, nothing leaks, and a later unlock() ends."""
    lock = await alocker.lock("race", expires=2.0)
    hold_rows(blocker, alocker, [lock])
    releasing: asyncio.Task[None] = asyncio.ensure_future(lock.unlock())
    original = concurrency._Bounded.expire

    def expire(self: Any) -> None:
        if order == "cancel_first":
            releasing.cancel()
            original(self)
        else:
            original(self)
            releasing.cancel()

    monkeypatch.setattr(concurrency._Bounded, "expire", expire)
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(asyncio.shield(releasing), 10)
    assert releasing.cancelled()
    monkeypatch.undo()
    # Its deadline passed, its DELETE cancelled unanswered: the lock expired unconfirmed, as
    # when its caller's cancellation comes first in that turn (lost, and on_lost told).
    assert (lock.is_locked, lock._state.lost is not None) == (False, True)
    blocker.rollback()
    # Whatever happened to the row, a later unlock() ends with the lock let go or lost.
    with contextlib.suppress(LockLost):
        await asyncio.wait_for(lock.unlock(), 10)
    assert not lock.is_locked
    await asyncio.sleep(0.2)
    assert not alarm.of(asyncio.get_running_loop())._due


@pytest.mark.parametrize("how", ["timeout", "wait_for"])
async def test_a_cycle_under_tiny_timeouts_raises_timeout_only_and_leaves_no_row(
    hopping_alocker: AsyncLocker, how: str
) -> None:
    """Timeouts cut a cycle at points spread over its acquire and its release: only
    TimeoutError is raised, and no row is left that nobody holds."""
    alocker = hopping_alocker
    await (await alocker.lock("warm up")).unlock()
    started = time.monotonic()
    async with alocker.lock("timed"):
        pass
    took = time.monotonic() - started
    task = asyncio.current_task()
    assert task is not None
    outcomes: dict[str, int] = {}
    for step in range(60):
        seconds = took * step / 40
        name = f"t {step}"

        async def cycle(name: str = name) -> None:
            async with alocker.lock(name):
                await asyncio.sleep(0)

        try:
            if how == "timeout":
                async with asyncio.timeout(seconds):
                    await cycle()
            else:
                await asyncio.wait_for(cycle(), seconds)
            outcomes["done"] = outcomes.get("done", 0) + 1
        except TimeoutError:
            outcomes["timeout"] = outcomes.get("timeout", 0) + 1
        assert task.cancelling() == 0

        async def gone(name: str = name) -> bool:
            return await alocker.lock_info(name) is None

        await eventually(gone)
    assert outcomes.get("timeout", 0) >= 2, outcomes


async def test_cancel_from_another_task_while_releasing_then_deadline(
    alocker: AsyncLocker, blocker: sa.Connection
) -> None:
    """The caller cancelled while its release waits on the row: the release goes on and gives
    up at its deadline; a second unlock() waiting on it gets the lock's error, not a
    CancelledError nor a TimeoutError."""
    lock = await alocker.lock("go on", expires=2.0)
    hold_rows(blocker, alocker, [lock])
    releasing = asyncio.ensure_future(lock.unlock())
    await asyncio.sleep(0.3)
    releasing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await releasing
    second = asyncio.ensure_future(lock.unlock())
    started = time.monotonic()
    try:
        await asyncio.wait_for(second, 10)
        error: BaseException | None = None
    except BaseException as caught:
        error = caught
    took = time.monotonic() - started
    blocker.rollback()
    assert isinstance(error, LockError), repr(error)
    assert took < 2.5


async def test_no_growth_of_the_loops_timers_over_a_long_run(alocker: AsyncLocker) -> None:
    """1,500 releases, each bounded by its lock's life, set a handful of timers on the loop,
    not one each: a cancelled timer stays in the loop's heap until its time comes. (The heap's
    size itself says little: a driver's own cancelled timers come and go in it, psycopg's one
    for each wait on its socket.)"""
    loop = asyncio.get_running_loop()
    await (await alocker.lock("warm up", expires=5)).unlock()
    ours = alarm.of(loop)
    set_by_alarm = 0
    call_at = loop.call_at

    def counted(when: float, callback: Any, *args: Any, **kwargs: Any) -> asyncio.TimerHandle:
        nonlocal set_by_alarm
        set_by_alarm += getattr(callback, "__self__", None) is ours
        return call_at(when, callback, *args, **kwargs)

    scheduled: list[asyncio.TimerHandle] = loop._scheduled  # type: ignore[attr-defined]
    live_before = sum(not handle.cancelled() for handle in scheduled)
    loop.call_at = counted  # type: ignore[assignment]
    started = time.monotonic()
    try:
        for n in range(1500):
            async with alocker.lock(f"long {n % 7}", expires=5 + (n % 13)):
                pass
    finally:
        del loop.call_at
    live_after = sum(not handle.cancelled() for handle in scheduled)
    assert live_after <= live_before + 3, (live_before, live_after)
    # Wound again for an earlier deadline and after a ring (one in 5 s at most): a few each
    # ring, against 1,500 for a timer of each release's own.
    rings = (time.monotonic() - started) / 5 + 1
    assert set_by_alarm <= 3 * rings + 3, (set_by_alarm, rings)
    assert not ours._due


def _blocked_release_in_new_loop(url: str, table: str, name: str) -> tuple[float, Any]:
    """In asyncio.run of its own: a lock whose DELETE a blocker's transaction holds up; how
    late its release ended against the lock's own patience (the time left of its life as its
    holder reckons it, less under load when the acquire took long), and what it raised."""

    async def scenario() -> tuple[float, Any]:
        locker = AsyncLocker(async_url(url), table=table, grace=0)
        engine = sa.create_engine(resolve_url(url))
        connection = engine.connect()
        try:
            lock = await locker.lock(name, expires=2.0)
            hold_rows(connection, locker, [lock])
            started = time.monotonic()
            patience = lock._state.release_patience()
            took, error = await _release_timed(lock, started)
            connection.rollback()
            return took - patience, error
        finally:
            connection.close()
            engine.dispose()
            await locker.aclose()

    return asyncio.run(scenario())


@pytest.fixture
def sync_table(make_locker: Callable[..., Locker], table_name: str) -> str:
    make_locker()
    return table_name


# A release blocked by another session's open transaction: SQLite has one writer at a time.
@pytest.mark.parametrize("backend", ["postgresql", "mysql"], indirect=True)
def test_asyncio_run_twice_each_release_deadline_fires(
    backend: str, url: str, sync_table: str
) -> None:
    for run in range(3):
        with warnings.catch_warnings():
            warnings.simplefilter("error", ResourceWarning)
            late, error = _blocked_release_in_new_loop(url, sync_table, f"run {run}")
        assert isinstance(error, LockError), repr(error)
        assert -0.3 < late < 0.9, late
        gc.collect()


# A release blocked by another session's open transaction: SQLite has one writer at a time.
@pytest.mark.parametrize("backend", ["postgresql", "mysql"], indirect=True)
def test_several_loops_in_threads_each_release_deadline_fires(
    backend: str, url: str, sync_table: str
) -> None:
    results: list[tuple[float, Any]] = []

    def in_thread(n: int) -> None:
        results.append(_blocked_release_in_new_loop(url, sync_table, f"thread {n}"))

    threads = [threading.Thread(target=in_thread, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(results) == 4
    for late, error in results:
        assert isinstance(error, LockError), repr(error)
        assert -0.3 < late < 0.9, late


async def test_many_concurrent_cycles_leave_no_deadline_and_no_row(alocker: AsyncLocker) -> None:
    loop = asyncio.get_running_loop()
    await (await alocker.lock("warm up")).unlock()

    async def cycles(n: int) -> None:
        for round_ in range(4):
            async with alocker.lock(f"many {n}", expires=5 + (n * 7 + round_) % 11, wait=None):
                await asyncio.sleep(0)

    await asyncio.wait_for(asyncio.gather(*(cycles(n) for n in range(150))), 120)
    assert not alarm.of(loop)._due
    for n in range(0, 150, 17):
        assert await alocker.lock_info(f"many {n}") is None


async def test_unlock_behind_a_stuck_renewal_cancelled_then_the_row_freed(
    alocker: AsyncLocker, blocker: sa.Connection
) -> None:
    """A renewal stuck on the row (the blocker's transaction), unlock() behind it cancelled by
    its caller: once the row is free the release goes on, and no row is left."""
    lock = await alocker.lock("renewed", expires=6.0)
    hold_rows(blocker, alocker, [lock])
    extending = asyncio.ensure_future(lock.extend())
    await asyncio.sleep(0.3)
    releasing = asyncio.ensure_future(lock.unlock())
    await asyncio.sleep(0.3)
    releasing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await releasing
    blocker.rollback()
    with contextlib.suppress(LockError):
        await asyncio.wait_for(extending, 10)

    async def gone() -> bool:
        # The release's task learns of its DELETE a step after others can see it.
        return await alocker.lock_info("renewed") is None and not lock.is_locked

    await eventually(gone)


# A release blocked by another session's open transaction: SQLite has one writer at a time.
@pytest.mark.parametrize("backend", ["postgresql", "mysql"], indirect=True)
def test_a_forked_child_s_release_deadline_fires(backend: str, url: str, sync_table: str) -> None:
    import os

    _, error = _blocked_release_in_new_loop(url, sync_table, "parent")
    assert isinstance(error, LockError)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            late, error = _blocked_release_in_new_loop(url, sync_table, "child")
            code = 0 if isinstance(error, LockError) and -0.3 < late < 0.9 else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
