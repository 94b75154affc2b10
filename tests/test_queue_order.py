"""Waiters are served in the order they asked, however long the row is held, and a Locker's
waiters, however many, stay within its connections."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from sqllocker import Locker, LockTypeError, LockValueError
from sqllocker.asyncio import AsyncLocker
from sqllocker.engine import resolve_url
from sqllocker.migrations import upgrade
from tests.connection_count import Sampler, open_connections
from tests.helpers import wait_until
from tests.workers import async_url

WAITERS = "ABCD"


def assert_served_in_order(order: list[str], url: str) -> None:
    """``order`` is WAITERS, each waiter served in its turn. On SQLite, where the kernel orders
    the waiters, a waiter may be passed by one that came after it (CI, beside the other test
    worker, has seen B, A, C, D); #34's bound is 3. The servers' tickets keep the order
    exactly."""
    assert sorted(order) == sorted(WAITERS), order
    allowed = 1 if url.startswith("sqlite") else 0
    served = {waiter: order.index(waiter) for waiter in WAITERS}
    passed_by = {
        waiter: sum(served[later] < served[waiter] for later in WAITERS[number + 1 :])
        for number, waiter in enumerate(WAITERS)
    }
    assert max(passed_by.values()) <= allowed, (order, passed_by)


@pytest.fixture
def migrated(url: str, table_name: str) -> Iterator[str]:
    """``url`` with this test's table made by the migrations (PostgreSQL's queue functions)."""
    engine = sa.create_engine(resolve_url(url))
    upgrade(engine, table_name)
    engine.dispose()
    return url


class Line:
    """Whether the waiters started so far have asked: on a server, until each holds its ticket
    (a thread or task started on a loaded machine may not have asked yet when the next one
    does); on SQLite, whose waiters queue in the kernel, a moment each."""

    def __init__(self, url: str, table: str) -> None:
        self.table = table
        self.admin = None if url.startswith("sqlite") else sa.create_engine(resolve_url(url))

    def asked(self, waiters: int) -> None:
        time.sleep(0.2)
        if self.admin is not None:
            wait_until(lambda: self._tickets() >= waiters, 30)

    def _tickets(self) -> int:
        assert self.admin is not None
        with self.admin.connect() as conn:
            count = conn.exec_driver_sql(f"SELECT count(*) FROM {self.table}_requests").scalar()
        return int(count or 0)

    def close(self) -> None:
        if self.admin is not None:
            self.admin.dispose()


@pytest.mark.parametrize("run", range(2))
@pytest.mark.slow
def test_waiters_are_served_in_the_order_they_came_however_long_the_hold(
    migrated: str, table_name: str, run: int
) -> None:
    """Each waiter has a Locker of its own, as a process would; they ask 0.2 s apart, behind a
    lock held 1.2 s. (When waiters gave up their places after a second to try the row, three
    waiters asking 0.3 s apart behind a 1.5 s hold were served A, C, B on PostgreSQL and
    MariaDB.)"""
    holder = Locker(migrated, table=table_name)
    held = holder.lock("report")
    lockers = [Locker(migrated, table=table_name) for _ in WAITERS]
    for locker in lockers:
        locker.locks()  # set up: what is timed is the waits, not a first use
    started = time.monotonic()
    order: list[str] = []

    def wait(number: int) -> None:
        with lockers[number].lock("report", wait=30):
            order.append(WAITERS[number])
            time.sleep(0.02)

    threads = [threading.Thread(target=wait, args=(number,)) for number in range(len(WAITERS))]
    line = Line(migrated, table_name)
    for number, thread in enumerate(threads):
        thread.start()
        line.asked(number + 1)
    line.close()
    time.sleep(max(0.0, 1.2 - (time.monotonic() - started)))
    held.unlock()
    for thread in threads:
        thread.join(30)
    assert_served_in_order(order, migrated)
    for locker in [holder, *lockers]:
        locker.close()


async def test_async_waiters_are_served_in_the_order_they_came_however_long_the_hold(
    migrated: str, table_name: str
) -> None:
    holder = Locker(migrated, table=table_name)
    held = holder.lock("report")
    lockers = [AsyncLocker(async_url(migrated), table=table_name) for _ in WAITERS]
    for locker in lockers:
        await locker.locks()  # set up: what is timed is the waits, not a first use
    started = time.monotonic()
    order: list[str] = []

    async def wait(number: int) -> None:
        async with lockers[number].lock("report", wait=30):
            order.append(WAITERS[number])
            await asyncio.sleep(0.02)

    tasks = []
    line = Line(migrated, table_name)
    for number in range(len(WAITERS)):
        tasks.append(asyncio.create_task(wait(number)))
        await asyncio.to_thread(line.asked, number + 1)
    line.close()
    await asyncio.sleep(max(0.0, 1.2 - (time.monotonic() - started)))
    await asyncio.to_thread(held.unlock)
    await asyncio.wait_for(asyncio.gather(*tasks), 30)
    assert_served_in_order(order, migrated)
    for locker in lockers:
        await locker.aclose()
    holder.close()


# -- a Locker's connections: within max_connections ----------------------------------------------


@pytest.mark.parametrize("server", ["postgresql", "mysql"])
def test_a_locker_with_many_waiters_opens_no_more_connections_than_max_connections(
    server: str, table_name: str, request: pytest.FixtureRequest
) -> None:
    """Its lock operations and its listener share the budget, and its waiters, taking tickets,
    hold none. Before, queued waiters and the listener had connections of their own beyond the
    pool's: 8 + 1 more than it allowed."""
    url = str(request.getfixturevalue(f"{server}_url"))
    engine = sa.create_engine(resolve_url(url))
    upgrade(engine, table_name)
    engine.dispose()
    baseline = open_connections(url)
    locker = Locker(url, table=table_name, max_connections=6)
    sampler = Sampler(url)
    served: list[int] = []

    def waiter() -> None:
        for _ in range(3):
            with locker.lock("report", wait=60):
                served.append(1)
                time.sleep(0.002)

    threads = [threading.Thread(target=waiter) for _ in range(30)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    most = sampler.stop() - baseline
    listener = locker._tickets.listener
    assert listener is not None  # tickets, kept alive by the listener
    if server == "postgresql":
        assert listener.grants > 0
    locker.close()
    assert len(served) == 90
    assert 2 <= most <= 6  # it did wait in line, and stayed within its budget


@pytest.mark.parametrize("server", ["postgresql", "mysql"])
async def test_an_async_locker_with_many_waiting_tasks_stays_within_max_connections(
    server: str, table_name: str, request: pytest.FixtureRequest
) -> None:
    """The same budget for 30 tasks of an AsyncLocker, whose lock operations take their
    connections from a stack too: a task that finds them all in use waits for one as a task,
    and the event loop goes on (a heartbeat task keeps beating). Waiting as a thread would,
    it stopped the loop, and nobody could give a connection back."""
    url = str(request.getfixturevalue(f"{server}_url"))
    engine = sa.create_engine(resolve_url(url))
    upgrade(engine, table_name)
    engine.dispose()
    baseline = open_connections(url)
    locker = AsyncLocker(async_url(url), table=table_name, max_connections=6)
    sampler = Sampler(url)
    served: list[int] = []
    longest_beat = 0.0

    async def waiter() -> None:
        for _ in range(3):
            async with locker.lock("report", wait=60):
                served.append(1)
                await asyncio.sleep(0.002)

    async def heartbeat() -> None:
        nonlocal longest_beat
        while True:
            started = time.monotonic()
            await asyncio.sleep(0.01)
            longest_beat = max(longest_beat, time.monotonic() - started)

    beating = asyncio.create_task(heartbeat())
    try:
        await asyncio.wait_for(asyncio.gather(*(waiter() for _ in range(30))), 60)
    finally:
        beating.cancel()
        most = sampler.stop() - baseline
        await locker.aclose()
    assert len(served) == 90
    assert 2 <= most <= 6
    stack = locker._operations.database.pool.stack
    assert stack is not None
    assert stack._limit == 5  # one for the listener
    assert longest_beat < 5  # the loop never stopped for a connection


def test_max_connections_is_a_whole_number_for_a_locker_that_makes_its_engine(
    tmp_path: Path,
) -> None:
    sqlite_url = f"sqlite:///{tmp_path / 'locks.db'}"
    with pytest.raises(LockTypeError):
        Locker(sqlite_url, max_connections=2.5)  # type: ignore[arg-type]
    with pytest.raises(LockTypeError):
        Locker(sqlite_url, max_connections=True)
    with pytest.raises(LockValueError):
        Locker(sqlite_url, max_connections=0)
    engine = sa.create_engine(resolve_url(sqlite_url))
    with pytest.raises(LockValueError, match="size the pool of your engine"):
        Locker(engine, max_connections=4)
    engine.dispose()
