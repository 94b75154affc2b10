"""sqllocker.asyncio on every backend: the core behaviours through AsyncLocker, sync and async
lockers on one table, keep-alive tasks, NOTIFY wake-ups, and cancellation at every await.

The multi-process mutual-exclusion test with sync and async workers side by side is in
test_mutual_exclusion.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import logging
import random
import sqlite3
import subprocess
import sys
import threading
import time
import warnings
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from sqllocker import (
    DatabaseError,
    LockBusy,
    Locker,
    LockError,
    LockLost,
    LockTypeError,
    LockValueError,
    TableMissing,
    clock,
)
from sqllocker.asyncio import AsyncLock, AsyncLocker
from sqllocker.asyncio.acquiring import Winnings, acquisition
from sqllocker.engine import resolve_url
from sqllocker.operations import Acquired
from tests.helpers import abandon
from tests.workers import async_url

MakeAsync = Callable[..., AsyncLocker]


@pytest.fixture
async def make_async_locker(
    make_locker: Callable[..., Locker], url: str, table_name: str
) -> AsyncIterator[MakeAsync]:
    """AsyncLockers on this test's table (created by make_locker); grace 0, as there."""
    make_locker()  # creates the table
    lockers: list[AsyncLocker] = []

    def make(**options: Any) -> AsyncLocker:
        options.setdefault("table", table_name)
        options.setdefault("grace", 0)
        locker = AsyncLocker(async_url(url), **options)
        lockers.append(locker)
        return locker

    yield make
    for locker in lockers:
        await locker.aclose()


@pytest.fixture
def alocker(make_async_locker: MakeAsync) -> AsyncLocker:
    return make_async_locker()


@pytest.fixture
async def hopping_alocker(
    make_async_locker: MakeAsync, url: str, table_name: str
) -> AsyncIterator[AsyncLocker]:
    """``alocker``, but on SQLite one whose every statement goes to aiosqlite's thread and
    back, an await where a cancellation can come mid-statement: on an engine of the caller's,
    as a statement that finds the database busy does. (On the engine it makes, its
    uncontended cycle awaits no statement.)"""
    if not url.startswith("sqlite"):
        yield make_async_locker()
        return
    make_async_locker()  # the table
    engine = create_async_engine(async_url(url))
    locker = AsyncLocker(engine, table=table_name, grace=0)
    try:
        yield locker
    finally:
        await locker.aclose()
        await engine.dispose()


@pytest.fixture
def blocker(url: str) -> Iterator[sa.Connection]:
    """A sync connection whose open transaction can make a lock statement wait: its write holds
    the row (PostgreSQL, MariaDB) or the whole database (SQLite) until it rolls back."""
    engine = sa.create_engine(resolve_url(url))
    connection = engine.connect()
    yield connection
    connection.close()
    engine.dispose()


def hold_up(blocker: sa.Connection, locker: AsyncLocker, lockstring: str) -> None:
    """In ``blocker``'s transaction, write a row that makes ``lockstring``'s statements wait."""
    blocker.begin()
    now = datetime.now(timezone.utc)
    blocker.execute(
        locker.table.insert().values(
            lockstring=lockstring,
            guid="blocker",
            created=now,
            expires=now + timedelta(hours=1),
            locked_by={},
        )
    )


def hold_row(blocker: sa.Connection, locker: AsyncLocker, lock: AsyncLock) -> None:
    """In ``blocker``'s transaction, write ``lock``'s own row (a no-op update) so that a DELETE
    of it waits."""
    blocker.begin()
    table = locker.table
    blocker.execute(
        table.update().where(table.c.id == lock.lock_id).values(expires=table.c.expires)
    )


async def eventually(check: Callable[[], Any], seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not await check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


# -- the core behaviours ------------------------------------------------------------------------


async def test_lock_unlock_relock_and_busy(alocker: AsyncLocker) -> None:
    lock = await alocker.lock("Zombie Soup", expires=60)
    assert isinstance(lock, AsyncLock)
    assert lock.lock_id > 0
    assert timedelta(seconds=59) < lock.expires - lock.created < timedelta(seconds=61)
    row = await alocker.lock_info("Zombie Soup")
    assert row is not None
    assert (lock.created, lock.expires) == (row.created, row.expires)
    assert lock.locked_by["task"]  # the asyncio task's name, beside host, pid and thread
    with pytest.raises(LockBusy) as busy:
        await alocker.lock("Zombie Soup")
    assert busy.value.lock_id == lock.lock_id
    assert busy.value.holder is not None
    assert busy.value.holder["task"] == lock.locked_by["task"]
    assert "guid" not in busy.value.holder
    assert await alocker.try_lock("Zombie Soup") is None
    await lock.unlock()
    assert not lock.is_locked
    await lock.unlock()  # a no-op
    again = await alocker.lock("Zombie Soup")
    assert again.lock_id > lock.lock_id
    assert again.guid != lock.guid
    await again.unlock()
    assert await alocker.locks() == []


async def test_async_with_releases_on_exit_and_when_the_body_raises(alocker: AsyncLocker) -> None:
    async with alocker.lock("job") as lock:
        assert lock.is_locked
        assert (await alocker.lock_info("job")) is not None
    assert not lock.is_locked
    with pytest.raises(RuntimeError, match="body"):
        async with await alocker.lock("job"):
            raise RuntimeError("body")
    assert await alocker.lock_info("job") is None


async def test_leaving_async_with_after_an_explicit_unlock_is_quiet(alocker: AsyncLocker) -> None:
    async with alocker.lock("job") as lock:
        await lock.unlock()
        async with lock:
            pass
    assert not lock.is_locked
    assert await alocker.locks() == []


async def test_an_async_lock_held_at_least_keeps_its_row_for_the_window(
    alocker: AsyncLocker,
) -> None:
    async with alocker.lock("report", hold_at_least=1.0) as lock:
        pass
    info = await alocker.lock_info("report")
    assert info is not None
    assert info.lock_id == lock.lock_id
    with pytest.raises(LockBusy, match="finished at"):
        await alocker.lock("report")


async def test_sync_and_async_lockers_exclude_each_other(
    alocker: AsyncLocker, make_locker: Callable[..., Locker]
) -> None:
    sync = make_locker()
    with sync.lock("shared"):
        assert await alocker.try_lock("shared") is None
    async with alocker.lock("shared") as lock:
        assert sync.try_lock("shared") is None
        info = sync.lock_info("shared")
        assert info is not None
        assert info.lock_id == lock.lock_id


async def test_extend_moves_expiry_and_never_revives(alocker: AsyncLocker) -> None:
    lock = await alocker.lock("job", expires=10)
    before = lock.expires
    assert await lock.extend(600) > before
    await lock.unlock()
    short = await alocker.lock("short", expires=0.5)
    await asyncio.sleep(1.0)
    with pytest.raises(LockLost):
        await short.extend()
    assert not short.is_locked


async def test_expired_row_is_taken_over_and_the_stale_holder_cannot_touch_it(
    alocker: AsyncLocker,
) -> None:
    stale = await alocker.lock("job", expires=0.5)
    await asyncio.sleep(1.0)
    fresh = await alocker.lock("job")
    assert fresh.lock_id > stale.lock_id
    with pytest.raises(LockLost):
        await stale.extend()
    with pytest.raises(LockLost):
        await stale.unlock()
    info = await alocker.lock_info("job")
    assert info is not None
    assert info.lock_id == fresh.lock_id
    await fresh.unlock()


async def test_wait_acquires_once_released_and_gives_up_in_time(alocker: AsyncLocker) -> None:
    held = await alocker.lock("job")
    asyncio.get_running_loop().call_later(0.3, lambda: asyncio.ensure_future(held.unlock()))
    async with alocker.lock("job", wait=10) as lock:
        assert lock.is_locked
        started = time.monotonic()
        with pytest.raises(LockBusy) as busy:
            await alocker.lock("job", wait=0.3)
        assert time.monotonic() - started >= 0.3
        assert busy.value.waited == 0.3
        assert busy.value.lock_id == lock.lock_id


async def test_a_wait_that_runs_out_at_once_names_the_holder_or_takes_over(
    alocker: AsyncLocker,
) -> None:
    # A PostgreSQL waiter's first attempt does not ask who holds the row: see test_locking.
    async with alocker.lock("job") as held:
        with pytest.raises(LockBusy) as busy:
            await alocker.lock("job", wait=1e-9)
        assert busy.value.lock_id == held.lock_id
        assert busy.value.holder is not None
    stale = await alocker.lock("job", expires=0.2)
    await asyncio.sleep(0.4)
    fresh = await alocker.lock("job", wait=1e-9)
    assert fresh.lock_id > stale.lock_id
    await fresh.unlock()


async def test_tasks_never_hold_one_lock_at_once(alocker: AsyncLocker) -> None:
    inside: list[str] = []
    entries: list[int] = []
    counter = {"value": 0}
    overlaps = 0

    async def worker(name: str) -> None:
        nonlocal overlaps
        for _ in range(15):
            async with alocker.lock("counter", wait=None) as lock:
                overlaps += bool(inside)
                inside.append(name)
                entries.append(lock.lock_id)
                value = counter["value"]
                await asyncio.sleep(0.001)  # every other task runs meanwhile
                counter["value"] = value + 1
                inside.remove(name)

    await asyncio.wait_for(asyncio.gather(*(worker(f"task {n}") for n in range(6))), 120)
    assert overlaps == 0
    assert counter["value"] == 90
    assert entries == sorted(entries)  # fencing tokens grow with each holder
    assert len(set(entries)) == 90


async def test_listing_purging_and_breaking(alocker: AsyncLocker) -> None:
    kept = await alocker.lock("report:1")
    abandon(await alocker.lock("report:2", expires=0.3))  # as if its holder had crashed
    other = await alocker.lock("other")
    assert [info.lockstring for info in await alocker.locks("report:*")] == [
        "report:1",
        "report:2",
    ]
    await asyncio.sleep(0.8)
    assert [info.lockstring for info in await alocker.expired_locks()] == ["report:2"]
    assert await alocker.purge_expired_locks() == 1
    broken = await alocker.break_lock("other")
    assert broken is not None
    assert broken.lock_id == other.lock_id
    with pytest.raises(LockLost):
        await other.unlock()
    await kept.unlock()


async def test_a_dropped_lock_is_released_on_its_loop(alocker: AsyncLocker) -> None:
    await alocker.lock("forgotten")  # nobody keeps it
    gc.collect()

    async def released() -> bool:
        return await alocker.lock_info("forgotten") is None

    await eventually(released, 5)


async def test_a_dropped_kept_alive_lock_whose_on_lost_refers_to_it_is_released(
    alocker: AsyncLocker,
) -> None:
    class Alarm:
        lock: AsyncLock

        def __call__(self, lost: LockLost) -> None:
            raise AssertionError(f"{self.lock.lockstring} was dropped, not lost")

    alarm = Alarm()
    alarm.lock = await alocker.lock("forgotten", expires=1, keep_alive=True, on_lost=alarm)
    del alarm
    gc.collect()  # a cycle: the lock, its state, its on_lost

    async def released() -> bool:
        return await alocker.lock_info("forgotten") is None and len(alocker._keep_alives) == 0

    await eventually(released, 5)


async def test_a_kept_alive_lock_whose_locker_is_closed_is_lost_and_its_holder_told(
    make_async_locker: MakeAsync,
) -> None:
    locker = make_async_locker()
    told: list[LockLost] = []
    lock = await locker.lock("job", expires=5, keep_alive=True, on_lost=told.append)
    await locker.aclose()
    assert [error.lockstring for error in told] == ["job"]
    assert not lock.is_valid()
    with contextlib.suppress(LockError):  # its row, still there, given back
        await lock.unlock()
    assert lock._state.held is False


# -- bad input and errors -------------------------------------------------------------------------


async def test_bad_input_is_refused_before_anything_is_sent(
    alocker: AsyncLocker, caplog: pytest.LogCaptureFixture
) -> None:
    await (await alocker.lock("warm up")).unlock()
    caplog.set_level(logging.DEBUG, logger="sqllocker.sql")
    caplog.clear()
    bad_calls: list[tuple[Callable[[], Any], type[Exception]]] = [
        (lambda: alocker.lock(""), LockValueError),
        (lambda: alocker.lock("x" * 129), LockValueError),
        (lambda: alocker.lock(42), LockTypeError),  # type: ignore[arg-type]
        (lambda: alocker.lock("job", expires=-1), LockValueError),
        (lambda: alocker.lock("job", wait=-1), LockValueError),
        (lambda: alocker.lock("job", locked_by={"pid": 1}), LockValueError),
        (lambda: alocker.lock("job", on_lost="nope"), LockTypeError),  # type: ignore[arg-type]
    ]
    for call, error in bad_calls:
        with pytest.raises(error):
            call()  # raises at the call, before anything is awaited
    for coroutine, error in [
        (lambda: alocker.purge_expired_locks(0), LockTypeError),
        (lambda: alocker.purge_expired_locks(pause_ratio=-1), LockValueError),
        (lambda: alocker.locks(7), LockTypeError),  # type: ignore[arg-type]
        (lambda: alocker.lock_info(""), LockValueError),
    ]:
        with pytest.raises(error):
            await coroutine()
    assert [r for r in caplog.records if r.name == "sqllocker.sql"] == []
    assert await alocker.locks() == []


def test_bad_locker_options_and_sync_drivers_are_refused(tmp_path: Any) -> None:
    with pytest.raises(LockValueError):
        AsyncLocker(f"sqlite+aiosqlite:///{tmp_path / 'x.db'}", table="bad name")
    with pytest.raises(LockValueError):
        AsyncLocker(f"sqlite+aiosqlite:///{tmp_path / 'x.db'}", expires=0)
    with pytest.raises(LockTypeError):
        AsyncLocker(42)  # type: ignore[arg-type]
    with pytest.raises(LockTypeError):
        AsyncLocker(sa.create_engine("sqlite://"))  # type: ignore[arg-type]
    with pytest.raises(LockValueError, match="asyncio"):
        AsyncLocker(f"sqlite+pysqlite:///{tmp_path / 'x.db'}")
    with pytest.raises(LockTypeError, match="AsyncLocker"):
        Locker(create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'x.db'}"))  # type: ignore[arg-type]


async def test_missing_table_names_the_command_that_creates_it(url: str) -> None:
    async with AsyncLocker(async_url(url), table="no_such_table", auto_create=False) as locker:
        with pytest.raises(TableMissing) as caught:
            await locker.lock("job")
        assert "`sqllocker --url URL --table no_such_table migrate`" in str(caught.value)
        assert caught.value.lockstring == "job"


async def test_sqlite_creates_its_table_on_first_use(tmp_path: Any) -> None:
    async with (
        AsyncLocker(f"sqlite:///{tmp_path / 'fresh.db'}") as locker,
        locker.lock("job") as lock,
    ):
        assert lock.lock_id == 1


async def test_async_sqlite_keeps_its_connections_from_one_operation_to_the_next(
    tmp_path: Any,
) -> None:
    """A file database's connections are pooled on every SQLAlchemy release: one that opened
    a connection (and applied its settings) per operation would make every lock a connect."""
    connects: list[object] = []
    async with AsyncLocker(f"sqlite:///{tmp_path / 'kept.db'}") as locker:
        await (await locker.lock("first")).unlock()  # the table, the connection, its settings
        sa.event.listen(locker.engine.sync_engine, "connect", lambda *_: connects.append(_))
        for number in range(5):
            async with locker.lock(f"job {number}"), locker.lock(f"other {number}"):
                pass
        assert connects == []


def _traced(engine: AsyncEngine, threads: list[tuple[int, str]]) -> None:
    """Record each statement of ``engine``'s connections that writes a lock row (INSERT,
    DELETE), with the thread that ran it: SQLite's trace callback runs on that thread."""

    def trace(sql: str) -> None:
        if sql.lstrip().upper().startswith(("INSERT", "DELETE")):
            threads.append((threading.get_ident(), sql.split()[0].upper()))

    def connected(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.driver_connection._connection.set_trace_callback(trace)

    sa.event.listen(engine.sync_engine, "connect", connected)


async def test_an_sqlite_cycle_that_need_not_wait_runs_on_the_event_loops_thread(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each call of an aiosqlite connection is a hop to its thread and back, which costs more
    than a lock cycle's statements: on a Locker's own engine an acquire's INSERT and a
    release's DELETE that need not wait for another connection's write lock run on the event
    loop's thread, and a whole cycle makes no call of aiosqlite's."""
    import aiosqlite.core

    calls: list[str] = []
    original = aiosqlite.core.Connection._execute

    async def counted(self: Any, function: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(function.__name__)
        return await original(self, function, *args, **kwargs)

    threads: list[tuple[int, str]] = []
    async with AsyncLocker(f"sqlite:///{tmp_path / 'hops.db'}") as locker:
        _traced(locker.engine, threads)
        await (await locker.lock("first")).unlock()  # the table, the connection, its settings
        threads.clear()
        monkeypatch.setattr(aiosqlite.core.Connection, "_execute", counted)
        lock = await locker.lock("job")
        assert lock.lock_id == 2
        with contextlib.closing(sqlite3.connect(tmp_path / "hops.db")) as other:
            committed = other.execute("SELECT id FROM semaphores").fetchall()
        assert committed == [(2,)]
        await lock.unlock()
        assert calls == []
        assert threads == [(threading.get_ident(), "INSERT"), (threading.get_ident(), "DELETE")]


async def test_a_task_taking_sqlite_lock_after_lock_lets_the_others_run(tmp_path: Any) -> None:
    """Its statements run on the event loop's thread, an acquire gives the loop a turn before
    it starts: a task that takes and releases lock after lock, and awaits nothing else, does
    not keep the other tasks from running until it is done."""
    async with AsyncLocker(f"sqlite:///{tmp_path / 'turns.db'}") as locker:
        await (await locker.lock("first")).unlock()
        turns = 0
        done = False

        async def other_task() -> None:
            nonlocal turns
            while not done:
                turns += 1
                await asyncio.sleep(0)

        other = asyncio.ensure_future(other_task())
        await asyncio.sleep(0)
        turns = 0
        for number in range(50):
            async with locker.lock(f"item {number}"):
                pass
        done = True
        await other
        assert turns >= 50  # a turn before each of the 50 acquires


_CANCELLED_AS_THE_LOOP_ENDS = """
import asyncio, sqlite3, sys
from sqllocker.asyncio import AsyncLocker

async def body(url, turns):
    locker = AsyncLocker(url)  # not closed: the loop's end cancels what it left running
    await (await locker.lock("warm up")).unlock()

    async def holder():
        async with locker.lock("job", expires=60):
            await asyncio.sleep(0)

    task = asyncio.ensure_future(holder())
    for _ in range(turns):
        await asyncio.sleep(0)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass

for turns in range(8):
    path = f"{sys.argv[1]}/{turns}.db"
    asyncio.run(body(f"sqlite:///{path}", turns))
    left = sqlite3.connect(path).execute("SELECT id FROM semaphores WHERE lockstring = 'job'")
    print(turns, left.fetchall())
"""


def test_an_sqlite_cycle_cancelled_as_its_event_loop_ends_leaves_no_row(tmp_path: Any) -> None:
    """A task in ``async with locker.lock()`` cancelled after a few turns of the loop, and the
    loop then ended (``asyncio.run`` returning, the locker never closed, which cancels every
    task left): on SQLite's own engine the acquire's turn comes before anything is sent, and
    its statements, once started, give the loop none, so no cancellation lands where the row
    is won and a task must still give it back."""
    done = subprocess.run(
        [sys.executable, "-c", _CANCELLED_AS_THE_LOOP_ENDS, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert done.stdout.splitlines() == [f"{turns} []" for turns in range(8)], done.stderr


async def test_an_sqlite_statement_that_must_wait_waits_in_aiosqlites_thread(
    tmp_path: Any,
) -> None:
    """An acquire's INSERT that finds another connection writing (an operator's transaction)
    waits in aiosqlite's thread, for as long as the busy timeout, not on the event loop's:
    the loop serves other callers meanwhile (the operator's thread asks it to run something
    once the INSERT has begun, and commits), and the acquire takes the row once the writer is
    done. Tried on the loop's thread first, it wrote nothing there."""
    path = tmp_path / "waits.db"
    threads: list[tuple[int, str]] = []
    async with AsyncLocker(f"sqlite:///{path}") as locker:
        _traced(locker.engine, threads)
        await (await locker.lock("first")).unlock()
        threads.clear()
        loop = asyncio.get_running_loop()
        writer = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        writer.execute("BEGIN IMMEDIATE")
        served: list[bool] = []

        def operator() -> None:
            while not threads:  # the acquire's INSERT has begun
                time.sleep(0.001)
            try:
                asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(timeout=30)
                served.append(True)
            except concurrent.futures.TimeoutError:
                served.append(False)  # the loop was held by the INSERT's wait
            writer.execute("COMMIT")

        thread = threading.Thread(target=operator)
        thread.start()
        try:
            lock = await locker.lock("job")
        finally:
            thread.join()
            writer.close()
        assert served == [True]
        assert lock.lock_id == 2
        await lock.unlock()
        loop_thread = threading.get_ident()
        inserts = [thread for thread, kind in threads if kind == "INSERT"]
        assert len(inserts) == 2
        assert inserts[0] == loop_thread  # found the database busy, and wrote nothing
        assert inserts[1] != loop_thread  # waited for the writer in aiosqlite's thread
        async with locker.engine.connect() as conn:
            rows = (await conn.exec_driver_sql("SELECT lockstring FROM semaphores")).all()
        assert rows == []


async def test_a_callers_sqlite_engine_runs_every_statement_in_aiosqlites_thread(
    tmp_path: Any,
) -> None:
    """A caller's engine may sync every commit (``synchronous=FULL``) or checkpoint inside
    one: its statements never run on the event loop's thread."""
    engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'callers.db'}")
    threads: list[tuple[int, str]] = []
    _traced(engine, threads)
    try:
        async with AsyncLocker(engine) as locker:
            await (await locker.lock("first")).unlock()
            await (await locker.lock("job")).unlock()
    finally:
        await engine.dispose()
    assert [kind for _, kind in threads][-2:] == ["INSERT", "DELETE"]
    assert threading.get_ident() not in {thread for thread, _ in threads}


async def test_a_closed_aiosqlite_connection_fails_the_one_call_as_a_dbapi_error(
    tmp_path: Any,
) -> None:
    """aiosqlite's own error for a closed connection is a ValueError, no DBAPI error: the one
    call raises it as SQLAlchemy's cursor does (OperationalError), which the lock operations
    take for a lost connection (and replace it) where a ValueError would escape as no
    LockError."""
    from sqllocker.asyncio.greenlets import run as in_greenlet
    from sqllocker.backends.sqlite import SQLiteBackend

    async with AsyncLocker(f"sqlite:///{tmp_path / 'closed.db'}") as locker:
        await (await locker.lock("first")).unlock()
        pooled = await in_greenlet(locker.engine.sync_engine.raw_connection)
        one_call = SQLiteBackend.in_one_call(pooled.dbapi_connection, False)
        assert one_call is not None
        assert await in_greenlet(one_call, "SELECT 1", (), True) == ([(1,)], -1)
        await pooled.driver_connection.close()  # behind the pool's back
        for returns_rows in (True, False):
            with pytest.raises(sqlite3.OperationalError):
                await in_greenlet(one_call, "SELECT 1", (), returns_rows)
        await in_greenlet(pooled.invalidate)
        stack = locker._operations.database.pool.stack
        assert stack is not None
        for held in stack._idle:  # a kept connection closed, then replaced
            await held.connection.driver_connection.close()
        lock = await locker.lock("job")
        await lock.unlock()
        assert lock.lock_id == 2


async def test_every_statement_on_a_closed_aiosqlite_connection_replaces_it(
    tmp_path: Any,
) -> None:
    """Not only the acquire and the release: an extend, a listing and a purge on a kept
    connection closed behind the pool's back replace it as a lost connection, on SQLAlchemy
    2.0 (whose aiosqlite dialect knows only aiosqlite's older words for it) as on 2.1."""
    async with AsyncLocker(f"sqlite:///{tmp_path / 'closed.db'}") as locker:
        lock = await locker.lock("held")

        async def close_the_kept_connections() -> None:
            assert locker._operations.database.pool.stack is not None
            for held in locker._operations.database.pool.stack._idle:
                await held.connection.driver_connection.close()

        await close_the_kept_connections()
        await lock.extend(60)
        await close_the_kept_connections()
        assert [info.lockstring for info in await locker.locks()] == ["held"]
        await close_the_kept_connections()
        assert await locker.purge_expired_locks() == 0
        await close_the_kept_connections()
        await lock.unlock()
        assert await locker.locks() == []


@pytest.mark.parametrize(
    "bad_url",
    [
        "postgresql://postgres@127.0.0.1:1/test",
        "mysql://root@127.0.0.1:1/test",
        "sqlite:////nonexistent-directory/for/sure/locks.db",
    ],
)
async def test_unreachable_database_is_a_database_error(bad_url: str) -> None:
    async with AsyncLocker(bad_url) as locker:
        with pytest.raises(DatabaseError, match="check the URL"):
            await locker.lock("job")
    # aiosqlite stops the thread of a connection that failed to open without awaiting it, and
    # the thread's reply then meets a closed loop (omnilib/aiosqlite#241, fix pending in #389);
    # give it a moment while the loop still runs.
    await asyncio.sleep(0.1)


# -- keep-alive and on_lost -----------------------------------------------------------------------


@pytest.mark.slow
async def test_keep_alive_task_holds_a_short_lock(make_async_locker: MakeAsync) -> None:
    locker, other = make_async_locker(), make_async_locker()
    lock = await locker.lock("job", expires=1, keep_alive=True)
    await asyncio.sleep(3.0)  # three expiry periods
    assert lock.is_valid()
    assert await other.try_lock("job") is None
    await lock.unlock()
    assert len(locker._keep_alives) == 0


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sqlite"])  # the keep-alive's doing: any backend
async def test_a_lock_kept_alive_late_in_its_life_is_renewed_before_its_deadline(
    make_async_locker: MakeAsync,
) -> None:
    locker, other = make_async_locker(), make_async_locker()
    lock = await locker.lock("job", expires=3)
    await asyncio.sleep(2.3)  # less than a third of the period left
    lock.keep_alive()
    await asyncio.sleep(3.0)  # past the deadline it had
    assert lock.is_valid()
    assert await other.try_lock("job") is None
    await lock.unlock()


@pytest.mark.parametrize("backend", ["sqlite"])  # the keep-alive's doing: any backend
async def test_a_renewal_that_fails_unexpectedly_is_retried_a_period_later(
    make_async_locker: MakeAsync, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not at once, again and again until the deadline."""
    locker = make_async_locker()
    lock = await locker.lock("job", expires=3)
    tries: list[float] = []

    async def failing(self: object, ttl: float | None) -> None:
        tries.append(time.monotonic())
        raise RuntimeError("a bug")

    monkeypatch.setattr(type(lock._state), "extend", failing)
    lock.keep_alive()
    await asyncio.sleep(2.5)
    assert 1 <= len(tries) <= 3
    monkeypatch.undo()
    with contextlib.suppress(LockLost):
        await lock.unlock()


@pytest.mark.parametrize("kind", ["function", "coroutine function"])
async def test_on_lost_is_called_once_when_the_lock_is_broken(
    make_async_locker: MakeAsync, kind: str
) -> None:
    locker, operator = make_async_locker(), make_async_locker()
    calls: list[LockLost] = []
    called = asyncio.Event()

    def on_lost(error: LockLost) -> None:
        calls.append(error)
        called.set()

    async def on_lost_async(error: LockLost) -> None:
        on_lost(error)

    callback = on_lost if kind == "function" else on_lost_async
    lock = await locker.lock("job", expires=1, keep_alive=True, on_lost=callback)
    await operator.break_lock("job")
    await asyncio.wait_for(called.wait(), 5)
    await asyncio.sleep(0.8)  # no second call
    assert len(calls) == 1
    assert calls[0].lockstring == "job"
    assert not lock.is_valid()
    with pytest.raises(LockLost):
        async with lock:
            pass


@pytest.mark.parametrize("answer", ["given", "lost"])
async def test_a_kept_alive_lock_given_a_shorter_expiry_is_renewed_by_it(
    alocker: AsyncLocker, monkeypatch: pytest.MonkeyPatch, answer: str
) -> None:
    """As the sync keep-alive: after extend(2) on a kept-alive lock of 30 s, renewals come by
    the new period's cadence (the task slept until the longer period's renewal, 10 s on); an
    extend(2) whose answer is lost has the lock renewed by its shorter deadline."""
    told = asyncio.Event()
    lock = await alocker.lock("job", expires=30, keep_alive=True, on_lost=lambda _: told.set())
    if answer == "lost":
        extend = alocker._operations.extend

        def answered_lost(*args: Any) -> Any:
            extend(*args)
            raise DatabaseError("the connection was lost before the answer came", outage=True)

        monkeypatch.setattr(alocker._operations, "extend", answered_lost)
        with pytest.raises(DatabaseError):
            await lock.extend(2)
        monkeypatch.undo()
    else:
        await lock.extend(2)
    await asyncio.sleep(3)  # past the deadline extend(2) set: renewed meanwhile
    assert lock.is_valid()
    assert not told.is_set()
    await lock.unlock()


async def test_an_async_locker_closes_right_after_an_extend_of_another_length(
    alocker: AsyncLocker,
) -> None:
    """The extend wakes the lock's keep-alive task; cancelled just then, by unlock() or
    aclose(), it must end (Python 3.11's wait_for lost such a cancellation: the task renewed
    a released lock on, and aclose() waited for it for ever)."""
    lock = await alocker.lock("job", expires=3, keep_alive=True)
    await asyncio.sleep(0.2)  # the task waiting for its next renewal
    await lock.extend(4)
    await lock.unlock()
    await asyncio.sleep(0.2)
    assert len(alocker._keep_alives) == 0
    assert not [t for t in asyncio.all_tasks() if "keep 'job' alive" in t.get_name()]
    kept = await alocker.lock("kept", expires=3, keep_alive=True)
    await asyncio.sleep(0.2)
    await kept.extend(4)
    await asyncio.wait_for(alocker.aclose(), 10)
    assert len(alocker._keep_alives) == 0


async def test_on_lost_fires_at_the_deadline_while_a_renewal_hangs(
    alocker: AsyncLocker, monkeypatch: pytest.MonkeyPatch
) -> None:
    called = asyncio.Event()
    told_at: list[float] = []

    def on_lost(_: LockLost) -> None:
        told_at.append(clock.now())
        called.set()

    lock = await alocker.lock("job", expires=1, keep_alive=True, on_lost=on_lost)
    # The acquire's sending time plus the expiry, less the safety margin: before the row can
    # expire on the server, let alone be taken over.
    deadline = lock._state.valid_until

    async def hang(*_: Any) -> datetime:
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    monkeypatch.setattr(lock._state, "run", hang)  # every statement of this lock hangs
    await asyncio.wait_for(called.wait(), 5)
    assert told_at[0] >= deadline  # told at the deadline (the margin is for a late loop)
    assert not lock.is_valid()
    with pytest.raises(LockLost):
        lock.check()


async def test_guard_proves_the_lock_inside_the_callers_transaction(
    alocker: AsyncLocker, url: str
) -> None:
    engine: AsyncEngine = create_async_engine(async_url(url))
    try:
        lock = await alocker.lock("job")
        async with engine.connect() as conn:
            with pytest.raises(LockError, match="inside a transaction"):
                await lock.guard(conn)
            async with conn.begin():
                await lock.guard(conn)
        await lock.unlock()
        stale = await alocker.lock("stale", expires=0.3)
        await asyncio.sleep(0.8)
        async with engine.connect() as conn, conn.begin():
            with pytest.raises(LockLost):
                await stale.guard(conn)
    finally:
        await engine.dispose()


@pytest.mark.parametrize("backend", ["postgresql", "mysql"], indirect=True)  # SQLite: no network
async def test_guard_gives_the_pooled_connection_back_with_its_own_silence_limit(
    alocker: AsyncLocker, url: str, backend: str
) -> None:
    """The asyncio twin of test_holding's: the limit guard() sets for a silent client (on
    MariaDB, a session variable set back as the transaction ends) is gone after commit."""
    setting = {
        "postgresql": "SHOW idle_in_transaction_session_timeout",
        "mysql": "SELECT @@session.idle_transaction_timeout",
    }[backend]
    engine: AsyncEngine = create_async_engine(async_url(url), pool_size=1, max_overflow=0)
    try:
        async with engine.connect() as conn:
            before = (await conn.exec_driver_sql(setting)).scalar()
        lock = await alocker.lock("job", expires=30)
        async with engine.connect() as conn, conn.begin():
            await lock.guard(conn)
            assert (await conn.exec_driver_sql(setting)).scalar() not in {"0", 0, before}
        async with engine.connect() as conn:  # the same pooled connection
            assert (await conn.exec_driver_sql(setting)).scalar() == before
        await lock.unlock()
    finally:
        await engine.dispose()


# -- cancellation -------------------------------------------------------------------------------


async def test_cancelled_acquire_leaves_no_row(
    alocker: AsyncLocker, blocker: sa.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    await (await alocker.lock("warm up")).unlock()
    caplog.set_level(logging.INFO, logger="sqllocker")
    hold_up(blocker, alocker, "job")  # our INSERT (SQLite: our BEGIN IMMEDIATE) now waits
    acquiring = asyncio.ensure_future(alocker.lock("job", wait=None))
    await asyncio.sleep(0.5)
    assert not acquiring.done()
    acquiring.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(acquiring, 2)  # at once, although the statement still waits
    blocker.rollback()  # the attempt goes on, and wins the row...

    async def undone() -> bool:
        return any("its acquirer was cancelled" in r.getMessage() for r in caplog.records)

    await eventually(undone)  # ...which is released, since nobody is left to hold it

    async def gone() -> bool:
        return await alocker.lock_info("job") is None

    await eventually(gone)
    async with alocker.lock("job"):
        pass


async def test_a_lock_cycle_cancelled_at_any_point_leaves_no_row(
    hopping_alocker: AsyncLocker,
) -> None:
    """An uncontended ``async with lock()`` cancelled at points spread over its acquire and its
    release (after a number of the event loop's turns, then after fractions of a cycle's
    time): whatever its statement in flight won is given back (the acquire's undo, the release
    run to its end), and no row is left that nobody holds."""
    alocker = hopping_alocker
    await (await alocker.lock("warm up")).unlock()
    held: list[AsyncLock] = []

    async def cycle(name: str) -> None:
        async with alocker.lock(name) as lock:
            held.append(lock)

    started = time.monotonic()
    await cycle("timed")
    took = time.monotonic() - started
    waits = [("turns", turns) for turns in range(8)]
    waits += [("seconds", took * step / 16) for step in range(1, 33)]
    cancelled = 0
    for number, (kind, amount) in enumerate(waits):
        name = f"cycle {number}"
        task = asyncio.ensure_future(cycle(name))
        if kind == "turns":
            for _ in range(int(amount)):
                await asyncio.sleep(0)
        else:
            await asyncio.sleep(amount)
        task.cancel()  # nothing, once the cycle is over
        try:
            await task
        except asyncio.CancelledError:
            cancelled += 1

        async def gone(name: str = name) -> bool:
            return await alocker.lock_info(name) is None

        await eventually(gone)
    assert cancelled >= 2  # in the acquire, at the least, and then further on

    async def all_released() -> bool:
        # A release cancelled mid-way runs to its end in the background: its row may be seen
        # gone by another connection before the release has read its answer.
        return all(not lock.is_locked for lock in held)

    await eventually(all_released)
    async with alocker.lock("cycle 0"):  # free for the next holder
        pass


async def test_cancelled_release_can_still_be_released(
    alocker: AsyncLocker, blocker: sa.Connection
) -> None:
    lock = await alocker.lock("job")
    hold_row(blocker, alocker, lock)  # our DELETE (SQLite: our BEGIN IMMEDIATE) now waits
    releasing = asyncio.ensure_future(lock.unlock())
    await asyncio.sleep(0.5)
    releasing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(releasing, 2)
    assert lock.is_locked  # not released yet: the row is still there
    second = asyncio.ensure_future(lock.unlock())  # waits for the release in flight
    await asyncio.sleep(0.2)
    blocker.rollback()
    await asyncio.wait_for(second, 10)
    assert not lock.is_locked
    assert await alocker.lock_info("job") is None


async def test_failed_release_can_be_retried(
    alocker: AsyncLocker, monkeypatch: pytest.MonkeyPatch
) -> None:
    lock = await alocker.lock("job", keep_alive=True)
    real_release = alocker._operations.release
    failures = {"left": 1}

    def flaky(*args: Any) -> None:  # runs in the operation's greenlet, as the real one does
        if failures["left"]:
            failures["left"] -= 1
            raise DatabaseError("simulated outage", "job")
        real_release(*args)

    monkeypatch.setattr(alocker._operations, "release", flaky)
    with pytest.raises(DatabaseError):
        await lock.unlock()
    assert lock.is_locked  # still held, so unlock() can be tried again...
    assert len(alocker._keep_alives) == 0  # ...but no longer renewed
    await lock.unlock()
    assert not lock.is_locked
    assert await alocker.lock_info("job") is None


async def test_cancelled_wait_stops_at_once(make_async_locker: MakeAsync) -> None:
    holder, waiter = make_async_locker(), make_async_locker()
    held = await holder.lock("job")
    waiting = asyncio.ensure_future(waiter.lock("job", wait=None))
    await asyncio.sleep(0.5)
    assert not waiting.done()
    cancelled_at = time.monotonic()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(waiting, 10)
    assert time.monotonic() - cancelled_at < 5  # not at the holder's release: it never comes
    info = await holder.lock_info("job")
    assert info is not None
    assert info.lock_id == held.lock_id
    await held.unlock()
    assert await holder.lock_info("job") is None


def cancel_once_won(locker: AsyncLocker, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The first of ``locker``'s attempts that wins its row cancels its caller's task as it
    ends: the acquire is cancelled at its next await, with the row in. The ids won."""
    real = locker._operations.try_acquire
    won: list[int] = []

    def try_acquire(*args: Any) -> Any:  # runs in the caller's task, in the operation's greenlet
        outcome = real(*args)
        if isinstance(outcome, Acquired) and not won:
            won.append(outcome.lock_id)
            task = asyncio.current_task()
            assert task is not None
            task.cancel()
        return outcome

    monkeypatch.setattr(locker._operations, "try_acquire", try_acquire)
    return won


async def cancelled(acquire: Any) -> BaseException:
    """Run ``acquire`` in a task of its own, which must end cancelled; its CancelledError, kept
    (with it the frames it passed through, and whatever they held)."""
    task = asyncio.ensure_future(acquire)
    try:
        await asyncio.wait_for(asyncio.shield(task), 30)
    except asyncio.CancelledError as error:
        assert task.cancelled()
        return error
    raise AssertionError(f"not cancelled: {task!r}")


async def test_a_semaphore_acquire_cancelled_with_its_permit_in_gives_it_back(
    alocker: AsyncLocker, monkeypatch: pytest.MonkeyPatch
) -> None:
    permits = alocker.semaphore("api quota", limit=3)
    won = cancel_once_won(alocker, monkeypatch)
    kept = await cancelled(permits.acquire(expires=120))  # cancelled as it counts the permits
    assert won
    # Given back before the cancellation went on, although the caller keeps its error (and so
    # the frame that held the permit, which garbage collection would otherwise release).
    assert await permits.holders() == []
    held = [await permits.acquire() for _ in range(3)]
    for permit in held:
        await permit.unlock()
    del kept


async def test_postgres_wait_cancelled_as_it_gives_up_its_ticket_releases_what_it_won(
    migrated_postgres: str, table_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with (
        AsyncLocker(migrated_postgres, table=table_name, grace=0) as holder,
        AsyncLocker(migrated_postgres, table=table_name, grace=0) as waiter,
    ):
        crashed = abandon(await holder.lock("job", expires=1))
        won = cancel_once_won(waiter, monkeypatch)
        # Refused, it takes a ticket; once the crashed holder's row expires, its own attempt
        # takes it over, and it is cancelled as it then gives up its ticket.
        kept = await cancelled(waiter.lock("job", wait=30, expires=120))
        assert won
        assert await holder.lock_info("job") is None
        async with holder.lock("job") as lock:
            assert lock.lock_id > crashed.lock_id
        del kept


async def test_a_lock_an_acquire_won_but_never_handed_over_is_deleted_whatever_its_window(
    alocker: AsyncLocker,
) -> None:
    """hold_at_least keeps a row its holder finished with; a lock nobody was handed never had
    a holder, so it goes at once (a permit granted, then cancelled as its waiter gives up its
    semaphore's turn)."""

    async def acquire_then_fail(winnings: Winnings) -> AsyncLock:
        await alocker._acquire_request("job", hold_at_least=60)(winnings)
        raise RuntimeError("cut short after the win")

    with pytest.raises(RuntimeError):
        await acquisition(acquire_then_fail)
    assert await alocker.lock_info("job") is None
    async with alocker.lock("job"):
        pass


def test_a_semaphore_acquire_whose_count_fails_gives_its_permit_back(
    make_locker: Callable[..., Locker], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sync twin of a cancellation: any error between the permit's row and its caller."""
    locker = make_locker()
    permits = locker.semaphore("api quota", limit=2)
    real = locker._operations.try_acquire

    def then_fail(*args: Any) -> Any:
        outcome = real(*args)
        if isinstance(outcome, Acquired):
            monkeypatch.setattr(locker._operations, "count_live", failing)
            monkeypatch.setattr(locker._operations, "count_permits", failing, raising=False)
        return outcome

    def failing(*_: Any) -> Any:
        raise DatabaseError("simulated outage", "api quota")

    monkeypatch.setattr(locker._operations, "try_acquire", then_fail)
    with pytest.raises(DatabaseError) as kept:
        permits.acquire(expires=120)
    monkeypatch.undo()
    assert permits.holders() == []  # although the error, kept, holds the frame that had it
    held = [permits.acquire() for _ in range(2)]
    for permit in held:
        permit.unlock()
    del kept


async def _settled(lockers: list[AsyncLocker]) -> None:
    """Until nothing a cancelled caller left running runs any more: attempts and releases in
    flight, and the ticket give-ups done in the background."""
    from sqllocker.asyncio import tasks

    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + 60
    while tasks.running(loop) or any(locker._tickets.leaving._tasks for locker in lockers):
        assert time.monotonic() < deadline, "background work still running"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("seed", [56, 9])
async def test_acquires_cut_short_at_random_strand_nothing(
    make_async_locker: MakeAsync, seed: int
) -> None:
    """Every kind of acquire under asyncio.wait_for with a random small timeout, the callers
    keeping their TimeoutErrors: afterwards no row is held by nobody, and a full set of permits
    and every lock can be taken at once."""
    rng = random.Random(seed)
    lockers = [make_async_locker(), make_async_locker()]
    kinds: list[Callable[[AsyncLocker], Any]] = [
        lambda locker: locker.lock("job", expires=120),
        lambda locker: locker.lock("job", wait=1, expires=120),
        lambda locker: locker.try_lock("job", expires=120),
        lambda locker: locker.lock_all(["job", "other"], wait=1, expires=120),
        lambda locker: locker.semaphore("quota", 3).acquire(expires=120),
        lambda locker: locker.semaphore("quota", 3).acquire(wait=1, expires=120),
        lambda locker: locker.semaphore("quota", 2).acquire(wait=1, expires=120),
    ]
    kept: list[BaseException] = []
    counts = {"held": 0, "cut short": 0, "busy": 0}

    async def caller(locker: AsyncLocker, rounds: int) -> None:
        for _ in range(rounds):
            acquire = rng.choice(kinds)(locker)
            try:
                held = await asyncio.wait_for(acquire, rng.uniform(0.0, 0.12))
            except asyncio.TimeoutError as error:
                kept.append(error)  # and with it the frames it passed through
                counts["cut short"] += 1
                continue
            except LockBusy:
                counts["busy"] += 1
                continue
            if held is None:  # try_lock, refused
                counts["busy"] += 1
                continue
            counts["held"] += 1
            await asyncio.sleep(rng.uniform(0.0, 0.01))
            await held.unlock()

    await asyncio.gather(*(caller(lockers[n % 2], 20) for n in range(8)))
    await _settled(lockers)
    stranded = [info for info in await lockers[0].locks() if not info.expired]
    print(f"\n[stress] seed {seed}: {counts}")
    assert counts["cut short"] > 0  # both happened
    assert counts["held"] > 0
    assert stranded == []
    permits = [await lockers[0].semaphore("quota", 3).acquire() for _ in range(3)]
    group = await lockers[1].lock_all(["job", "other"])
    for permit in permits:
        await permit.unlock()
    await group.unlock()
    assert kept  # kept to the end


# -- waking on NOTIFY (PostgreSQL) --------------------------------------------------------------


async def test_postgres_async_waiter_wakes_on_notify(
    migrated_postgres: str, table_name: str, slow_polling: None
) -> None:
    holder = Locker(migrated_postgres, table=table_name, grace=0)  # a sync process's release
    held = holder.lock("job")
    async with AsyncLocker(migrated_postgres, table=table_name, grace=0) as waiter:
        waiting = asyncio.ensure_future(waiter.lock("job", wait=60))
        await asyncio.sleep(0.5)  # refused, and waiting: its next poll is 30 s away
        assert not waiting.done()
        held.unlock()
        freed = time.monotonic()
        lock = await asyncio.wait_for(waiting, 20)
        assert time.monotonic() - freed < 10  # far sooner than the poll: NOTIFY woke it
        assert waiter._tickets.listener is not None
        assert waiter._tickets.listener.notifications >= 1
        await lock.unlock()
    holder.close()


async def test_a_callers_async_engine_is_used_as_it_is(
    make_locker: Callable[..., Locker], url: str, table_name: str
) -> None:
    make_locker()  # creates the table
    engine = create_async_engine(async_url(url))
    try:
        async with AsyncLocker(engine, table=table_name, grace=0) as locker:
            async with locker.lock("job") as lock:
                assert await locker.try_lock("job") is None
                info = await locker.lock_info("job")
                assert info is not None
                assert info.lock_id == lock.lock_id
            assert await locker.locks() == []
        async with engine.connect() as conn:  # the caller's engine still works: not disposed
            assert (await conn.execute(sa.text("SELECT 1"))).scalar() == 1
    finally:
        await engine.dispose()


@pytest.mark.slow
def test_one_locker_serves_one_event_loop_after_another(
    make_locker: Callable[..., Locker], url: str, table_name: str
) -> None:
    """``asyncio.run`` twice, or pytest-asyncio's loop per test, with one AsyncLocker: each loop
    gets connections (and, on PostgreSQL, a listener and a queue) of its own; the previous
    loop's are unusable once it has closed."""
    holder = make_locker(grace=0)
    locker = AsyncLocker(async_url(url), table=table_name, grace=0)
    told: list[LockLost] = []

    async def wait_for_a_release_and_keep_alive(name: str) -> int:
        held = holder.lock(name)
        asyncio.get_running_loop().call_later(0.2, held.unlock)
        lock = await locker.lock(name, wait=10, expires=1, keep_alive=True, on_lost=told.append)
        await asyncio.sleep(1.2)  # past the deadline, unless this loop's task renewed it
        assert lock.is_valid()
        await lock.unlock()
        return lock.lock_id

    first = asyncio.run(wait_for_a_release_and_keep_alive("loop job"))
    second = asyncio.run(wait_for_a_release_and_keep_alive("loop job"))
    assert second > first
    assert told == []  # the first loop's end closed the locker: nothing since was lost
    assert asyncio.run(locker.locks()) == []
    asyncio.run(locker.aclose())


def test_one_locker_on_two_running_loops_at_once_is_refused(url: str, table_name: str) -> None:
    """Two threads each running a loop cannot share an AsyncLocker (its connections are bound
    to one loop): the second gets a LockError saying so, not a driver's 'attached to a
    different loop'."""
    Locker(url, table=table_name).create_table()
    locker = AsyncLocker(async_url(url), table=table_name)
    entered, leave = threading.Event(), threading.Event()

    async def hold_the_loop() -> None:
        await (await locker.lock("first loop")).unlock()
        entered.set()
        while not leave.is_set():
            await asyncio.sleep(0.01)
        await locker.aclose()

    other = threading.Thread(target=asyncio.run, args=(hold_the_loop(),))
    other.start()
    try:
        assert entered.wait(30)
        with pytest.raises(LockError, match="event loop"):
            asyncio.run(locker.locks())
    finally:
        leave.set()
        other.join(30)


_LOOP_AFTER_LOOP = """
import asyncio, gc, sys, threading
from sqllocker import Locker
from sqllocker.asyncio import AsyncLocker

sync_url, async_url, table = sys.argv[1:4]
holder = Locker(sync_url, table=table, grace=0)
holder.create_table()  # by the migrations: on PostgreSQL, with the queue's functions
locker = AsyncLocker(async_url, table=table, grace=0)
kept = []


async def one_loop(n):
    async with locker.lock(f"job {n}"):
        pass
    held = holder.lock("contended")  # a waiter: on PostgreSQL, the listener and the queue
    threading.Timer(0.2, held.unlock).start()
    await (await locker.lock("contended", wait=10)).unlock()
    # Left held, kept alive, when the loop ends: its task is cancelled with the loop's.
    kept.append(await locker.lock(f"left held {n}", expires=60, keep_alive=True))
    return len(await locker.locks())


print([asyncio.run(one_loop(n)) for n in range(3)])
gc.collect()
holder.close()
"""


@pytest.mark.slow
def test_a_loop_closed_with_a_library_task_pending_is_not_kept_for_good() -> None:
    """The tasks the library starts to outlive their callers (a release after a cancellation,
    an on_lost callback) are kept referenced until done: a loop closed by hand with one still
    pending (no asyncio.run to cancel it) must go with it, not stay referenced for good."""
    from sqllocker.asyncio import tasks

    loop = asyncio.new_event_loop()

    async def start() -> None:
        tasks.spawn(asyncio.sleep(3600), "sleeps past its loop")

    loop.run_until_complete(start())
    assert len(tasks.running(loop)) == 1
    loop.close()
    gone = weakref.ref(loop)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        del loop
        gc.collect()
    assert gone() is None


def test_loop_after_loop_leaves_no_connection_behind(url: str, table_name: str) -> None:
    """An AsyncLocker used by ``asyncio.run`` after ``asyncio.run``, never closed: each loop's
    connections are closed as that loop shuts down, while it still can. Forgotten instead,
    they were closed by the garbage collector after their loop had closed: a ResourceWarning
    from every driver, and from aiomysql a traceback ("Event loop is closed") on stderr."""
    arguments = [url, async_url(url), table_name]
    finished = subprocess.run(
        [sys.executable, "-W", "always::ResourceWarning", "-c", _LOOP_AFTER_LOOP, *arguments],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert finished.returncode == 0, finished.stderr
    # Each loop's lock left held is still there: the loop's end released nothing.
    assert finished.stdout.split() == ["[1,", "2,", "3]"]
    for sign in ("ResourceWarning", "Event loop is closed", "Exception ignored", "Traceback"):
        assert sign not in finished.stderr, finished.stderr


# Run in a process of its own: a task blocked on a thread lock stops the event loop, and then no
# timeout of the loop's can end the test.
SETUP_AGAIN_IN_SEVERAL_TASKS = """
import asyncio, sys
from sqllocker.asyncio import AsyncLocker, concurrency

async def main(url):
    locker = AsyncLocker(url)
    await (await locker.lock("warm")).unlock()
    operations = locker._operations
    backend = type(operations.database.be)
    read_settings = backend.read_settings

    def slow_read_settings(self, conn, table):  # an await inside the setup
        concurrency.sleep_in_operation(0.2)
        return read_settings(self, conn, table)

    backend.read_settings = slow_read_settings
    operations.database.needs_setup = True  # as after a lost connection
    locks = await asyncio.gather(*(locker.lock(f"lock {n}") for n in range(3)))
    for lock in locks:
        await lock.unlock()
    await locker.aclose()
    print("served", len(locks))

asyncio.run(main(sys.argv[1]))
"""


@pytest.mark.slow
def test_tasks_that_find_the_setup_needed_again_at_once_do_not_stop_the_event_loop(
    tmp_path: Path,
) -> None:
    """After a lost connection every task's next operation sets up again, one at a time under
    a thread lock; the first holds it across an await of its setup. The others used to block on
    the lock, which stopped the event loop, and the first never finished."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'locks.db'}"
    done = subprocess.run(
        [sys.executable, "-c", SETUP_AGAIN_IN_SEVERAL_TASKS, url],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "served 3"
