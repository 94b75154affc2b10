"""Waiters are served in the order they asked, however long the row is held: a queued waiter
keeps its place, and only a queue that stands still on a free row (its head stopped, or a
session outside sqllocker holds its key) has its waits ended (``sqllocker.queueing.Watch``)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from scripts.many_waiters import Sampler, open_connections
from sqllocker import Locker, LockTypeError, LockValueError, concurrency, queueing
from sqllocker.asyncio import AsyncLock, AsyncLocker
from sqllocker.asyncio import concurrency as async_concurrency
from sqllocker.backends.mysql import wait_patiently
from sqllocker.engine import resolve_url
from sqllocker.migrations import upgrade
from sqllocker.queueing import STUCK_LOOKS, Blocked, Seats, Watch
from tests.test_get_lock_queue import queue_name, session
from tests.workers import async_url

WAITERS = "ABCD"


@pytest.fixture
def migrated(url: str, table_name: str) -> Iterator[str]:
    """``url`` with this test's table made by the migrations (PostgreSQL's queue functions)."""
    engine = sa.create_engine(resolve_url(url))
    upgrade(engine, table_name)
    engine.dispose()
    return url


@pytest.fixture
def short_patience(monkeypatch: pytest.MonkeyPatch) -> None:
    """Queues judged stuck after 0.3 s: a waiter that gave up its place at each patience, as
    waiters did, would be behind later ones many times over in a hold of 1.2 s."""
    monkeypatch.setattr(queueing, "QUEUE_PATIENCE", 0.3)


@pytest.mark.parametrize("run", range(2))
def test_waiters_are_served_in_the_order_they_came_however_long_the_hold(
    migrated: str, table_name: str, short_patience: None, run: int
) -> None:
    """Each waiter has a Locker of its own, as a process would; they ask 0.2 s apart, behind a
    lock held 1.2 s: four times the patience. (Before the watch, three waiters asking 0.3 s
    apart behind a 1.5 s hold were served A, C, B on PostgreSQL and MariaDB.)"""
    holder = Locker(migrated, table=table_name)
    held = holder.lock("report")
    started = time.monotonic()
    lockers = [Locker(migrated, table=table_name) for _ in WAITERS]
    order: list[str] = []

    def wait(number: int) -> None:
        with lockers[number].lock("report", wait=30):
            order.append(WAITERS[number])
            time.sleep(0.02)

    threads = [threading.Thread(target=wait, args=(number,)) for number in range(len(WAITERS))]
    for thread in threads:
        thread.start()
        time.sleep(0.2)
    time.sleep(max(0.0, 1.2 - (time.monotonic() - started)))
    held.unlock()
    for thread in threads:
        thread.join(30)
    assert "".join(order) == WAITERS
    for locker in [holder, *lockers]:
        locker.close()


async def test_async_waiters_are_served_in_the_order_they_came_however_long_the_hold(
    migrated: str, table_name: str, short_patience: None
) -> None:
    holder = Locker(migrated, table=table_name)
    held = holder.lock("report")
    started = time.monotonic()
    lockers = [AsyncLocker(async_url(migrated), table=table_name) for _ in WAITERS]
    order: list[str] = []

    async def wait(number: int) -> None:
        async with lockers[number].lock("report", wait=30):
            order.append(WAITERS[number])
            await asyncio.sleep(0.02)

    tasks = []
    for number in range(len(WAITERS)):
        tasks.append(asyncio.create_task(wait(number)))
        await asyncio.sleep(0.2)
    await asyncio.sleep(max(0.0, 1.2 - (time.monotonic() - started)))
    await asyncio.to_thread(held.unlock)
    await asyncio.wait_for(asyncio.gather(*tasks), 30)
    assert "".join(order) == WAITERS
    for locker in lockers:
        await locker.aclose()
    holder.close()


def test_a_mariadb_queue_whose_name_a_stranger_holds_does_not_keep_waiters_from_a_free_row(
    mysql_url: str, table_name: str, short_patience: None
) -> None:
    """A session outside sqllocker holds the lockstring's GET_LOCK name, as a head whose process
    stopped would: the waiter behind it keeps its place while the row is held, and takes the
    row once the queue has stood still on it free, long before its deadline."""
    engine = sa.create_engine(resolve_url(mysql_url))
    upgrade(engine, table_name)
    engine.dispose()
    holder = Locker(mysql_url, table=table_name)
    waiter = Locker(mysql_url, table=table_name)
    held = holder.lock("report")
    stranger = session(mysql_url)
    with stranger.cursor() as cursor:
        cursor.execute("SELECT GET_LOCK(%s, 0)", (queue_name(waiter, "report"),))
        assert cursor.fetchone()[0] == 1
    got: list[float] = []
    thread = threading.Thread(target=lambda: got.append(bool(waiter.lock("report", wait=20))))
    thread.start()
    time.sleep(1.0)  # many looks at a held row: nothing ended
    assert got == []
    room = waiter._waiting_room()
    assert room is not None
    assert room._watch.ended == 0
    released = time.monotonic()
    held.unlock()
    thread.join(10)
    assert got == [True]
    assert time.monotonic() - released < 5  # not the 20 s of its deadline
    assert room._watch.ended == 1
    stranger.close()
    waiter.close()
    holder.close()


# -- the watch's bookkeeping ---------------------------------------------------------------------


def test_a_queue_is_stuck_after_its_row_was_takeable_under_one_head_at_every_look() -> None:
    watch = Watch()
    first, second = Blocked("report", 1, "session 1"), Blocked("report", 1, "session 2")
    assert watch.add(first)  # the first wait starts the watching loop
    assert not watch.add(second)
    assert watch.watched() == [("report", 1)]
    for _ in range(STUCK_LOOKS - 1):
        assert watch.saw("report", True, "head") == []
    assert watch.saw("report", True, "head") == ["session 1", "session 2"]
    assert watch.ended == 2
    assert watch.remove(first)
    assert watch.remove(second)
    assert watch.watched() is None  # nothing left: the loop stops
    assert watch.add(Blocked("report", 1, "session 3"))  # and starts again


@pytest.mark.parametrize(
    "between",
    [(False, "head"), (True, "another head"), (True, None)],
    ids=["a held row", "another head", "no head"],
)
def test_a_look_at_a_held_row_or_another_head_starts_the_count_again(
    between: tuple[bool, str | None],
) -> None:
    watch = Watch()
    blocked = Blocked("report", 1, "session")
    watch.add(blocked)
    for _ in range(STUCK_LOOKS - 1):
        assert watch.saw("report", True, "head") == []
    assert watch.saw("report", *between) == []
    for _ in range(STUCK_LOOKS - 2):
        assert watch.saw("report", True, "head") == []
    assert not watch.remove(blocked)  # never ended
    assert watch.ended == 0


def test_only_the_waits_of_the_stuck_lockstring_are_ended() -> None:
    watch = Watch()
    stuck, moving = Blocked("stuck", 1, "session 1"), Blocked("moving", 2, "session 2")
    watch.add(stuck)
    watch.add(moving)
    for look in range(STUCK_LOOKS):
        ended = watch.saw("stuck", True, "head")
        assert watch.saw("moving", look % 2 == 0, "head") == []
    assert ended == ["session 1"]
    assert watch.remove(stuck)
    assert not watch.remove(moving)


def test_a_closed_watch_stops_its_loop() -> None:
    watch = Watch()
    watch.add(Blocked("report", 1, "session"))
    watch.close()
    assert watch.watched() is None
    assert not watch.add(Blocked("report", 1, "session 2"))


# -- the line for a room's seats -----------------------------------------------------------------


def test_a_seat_given_back_goes_to_the_first_in_line_with_its_connection() -> None:
    seats = Seats(capacity=1)
    woken: list[str] = []
    assert seats.take(lambda: woken.append("first")) == (True, None, None)
    _, _, second = seats.take(lambda: woken.append("second"))
    _, _, third = seats.take(lambda: woken.append("third"))
    assert second is not None
    assert third is not None
    assert seats.give_back("connection") is None  # handed on, not kept nor closed
    assert woken == ["second"]
    assert seats.leave_line(second) == (True, "connection")
    assert seats.leave_line(third) == (False, None)  # gave up: out of the line
    assert seats.give_back(None) is None
    assert woken == ["second"]  # nobody left in line to wake
    assert seats.take(lambda: None)[0]  # the seat is free again


def test_a_newcomer_does_not_take_a_seat_ahead_of_the_line() -> None:
    seats = Seats(capacity=2)
    seats.take(lambda: None)
    seats.take(lambda: None)
    _, _, in_line = seats.take(lambda: None)
    assert in_line is not None
    seats.give_back(None)  # to the one in line
    seated, _, newcomer = seats.take(lambda: None)
    assert not seated
    assert newcomer is not None  # behind, though a seat came free a moment ago


def test_closing_the_seats_wakes_the_line_unseated() -> None:
    seats = Seats(capacity=1)
    seats.take(lambda: None)
    woken: list[bool] = []
    _, _, in_line = seats.take(lambda: woken.append(True))
    assert in_line is not None
    assert seats.close() == []
    assert woken == [True]
    assert seats.leave_line(in_line) == (False, None)
    assert seats.take(lambda: None) == (False, None, None)


@pytest.mark.parametrize("run", range(2))
def test_waiters_beyond_the_rooms_capacity_wait_in_line_in_the_order_they_came(
    mysql_url: str, table_name: str, run: int
) -> None:
    """MariaDB: waiters beyond the room's seats backed off unordered, and one of them could be
    passed by hundreds (scripts/many_waiters.py). (PostgreSQL's waiters hold tickets, and no
    connection: tests/test_tickets.py.)"""
    url = mysql_url
    engine = sa.create_engine(resolve_url(url))
    upgrade(engine, table_name)
    engine.dispose()
    holder = Locker(url, table=table_name)
    waiters = Locker(url, table=table_name)
    room = waiters._waiting_room()
    assert room is not None
    room.seats.capacity = 1
    held = holder.lock("report")
    acquired: list[int] = []

    def wait(number: int) -> None:
        with waiters.lock("report", wait=30):
            acquired.append(number)
            time.sleep(0.02)

    threads = [threading.Thread(target=wait, args=(n,)) for n in range(5)]
    for thread in threads:
        thread.start()
        time.sleep(0.1)
    held.unlock()
    for thread in threads:
        thread.join(20)
    assert acquired == [0, 1, 2, 3, 4]
    waiters.close()
    holder.close()


# -- a Locker's connections: within max_connections ----------------------------------------------


@pytest.mark.parametrize("server", ["postgresql", "mysql"])
def test_a_locker_with_many_waiters_opens_no_more_connections_than_max_connections(
    server: str, table_name: str, request: pytest.FixtureRequest
) -> None:
    """Its lock operations, its queued waiters on MariaDB (at most half of its budget) and
    its release listener on PostgreSQL share the budget. Before, queued waiters and the
    listener had connections of their own beyond the pool's: 8 + 1 more than it allowed."""
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
    room = locker._waiting_room()
    if server == "postgresql":
        assert room is None  # tickets, and the listener
        assert locker._listener is not None
        assert locker._listener.grants > 0
    else:
        assert room is not None
        assert room.seats.capacity == 3
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
    stack = locker._operations._stack
    assert stack is not None
    assert stack._limit == (5 if server == "postgresql" else 3)  # the listener; 3 seats
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


def test_a_mariadb_waiter_keeps_its_place_past_the_drivers_read_timeout(
    mysql_url: str, table_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """PyMySQL gives up on an answer after its read timeout (60 s by default, 1 s here): a
    queued GET_LOCK wait used to end there, and the waiter waited unqueued from then on."""
    engine = sa.create_engine(resolve_url(mysql_url))
    upgrade(engine, table_name)
    engine.dispose()
    impatient = f"{mysql_url}?read_timeout=1"
    holder = Locker(mysql_url, table=table_name)
    held = holder.lock("report")
    lockers = [Locker(impatient, table=table_name) for _ in range(2)]
    order: list[int] = []

    def wait(number: int) -> None:
        with lockers[number].lock("report", wait=30):
            order.append(number)

    threads = [threading.Thread(target=wait, args=(number,)) for number in range(2)]
    for thread in threads:
        thread.start()
        time.sleep(0.5)
    time.sleep(2.5)  # both queued for longer than the read timeout
    held.unlock()
    for thread in threads:
        thread.join(20)
    assert order == [0, 1]
    assert "could not queue" not in caplog.text
    for locker in [holder, *lockers]:
        locker.close()


async def test_an_async_mariadb_queue_whose_name_a_stranger_holds_does_not_keep_its_waiter(
    mysql_url: str, table_name: str, short_patience: None
) -> None:
    """The same through aiomysql: the watch's KILL QUERY ends a GET_LOCK wait of its driver's."""
    engine = sa.create_engine(resolve_url(mysql_url))
    upgrade(engine, table_name)
    engine.dispose()
    holder = Locker(mysql_url, table=table_name)
    waiter = AsyncLocker(async_url(mysql_url), table=table_name)
    held = holder.lock("report")
    stranger = session(mysql_url)
    with stranger.cursor() as cursor:
        cursor.execute("SELECT GET_LOCK(%s, 0)", (queue_name(holder, "report"),))

    async def take() -> AsyncLock:
        return await waiter.lock("report", wait=20)

    waiting = asyncio.create_task(take())
    await asyncio.sleep(1.0)  # many looks at a held row: nothing ended
    assert not waiting.done()
    await asyncio.to_thread(held.unlock)
    released = time.monotonic()
    lock = await asyncio.wait_for(waiting, 10)
    assert time.monotonic() - released < 5  # not the 20 s of its deadline
    room = waiter._room
    assert room is not None
    assert room._watch.ended == 1
    await lock.unlock()
    stranger.close()
    await waiter.aclose()
    holder.close()


@pytest.mark.parametrize("asynchronous", [False, True], ids=["PyMySQL", "aiomysql"])
async def test_a_mariadb_queue_connection_has_no_read_timeout_and_keeps_alive(
    mysql_url: str, table_name: str, asynchronous: bool
) -> None:
    """What lets a GET_LOCK wait last until its caller's deadline while a dead server is still
    noticed (``backends.mysql.wait_patiently``)."""
    if asynchronous:
        locker: Locker | AsyncLocker = AsyncLocker(async_url(mysql_url), table=table_name)
        pooled = await async_concurrency.pooled_connection(locker.engine, autocommit=False)  # type: ignore[arg-type]
        sock = pooled.driver._writer.get_extra_info("socket")
    else:
        locker = Locker(mysql_url, table=table_name)
        pooled = concurrency.pooled_connection(locker.engine, autocommit=False)  # type: ignore[arg-type,assignment]
        sock = pooled.driver._sock
        assert pooled.driver._read_timeout == 60  # the engine's, before
    wait_patiently(pooled.driver)
    assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 5  # not the system's 2 h
    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 15000
    if not asynchronous:
        assert pooled.driver._read_timeout is None
    if asynchronous:
        await pooled.close()  # type: ignore[misc]
        await locker.aclose()  # type: ignore[union-attr]
    else:
        pooled.close()
        locker.close()  # type: ignore[union-attr]
