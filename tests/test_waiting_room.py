"""PostgreSQL waiters queue in the server: first come, first served, and a refusal costs the
holder nothing."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import pytest
import sqlalchemy as sa

from sqllocker import LockBusy, Locker, queueing, waiting_room
from sqllocker.asyncio import AsyncLock, AsyncLocker
from sqllocker.asyncio import waiting_room as async_waiting_room
from sqllocker.operations import Refused
from sqllocker.queueing import QueueWait, queue_key, timed_out
from tests.helpers import (
    abandon,
    head_is_waiting,
    head_the_queue,
    leave_the_queue,
    queued,
    requests,
    wait_in_thread,
    wait_until,
    wait_until_async,
)
from tests.workers import async_url


def test_waiters_of_different_lockers_get_the_lock_in_the_order_they_came(
    migrated_postgres: str, table_name: str, admin: sa.Engine, slow_polling: None
) -> None:
    """Each waiter has a Locker (and a listener) of its own, as separate processes would: every
    release notifies all of them, and without the queue whichever reacted first would win."""
    holder = Locker(migrated_postgres, table=table_name)
    held = holder.lock("report")
    order: list[int] = []
    lockers = [Locker(migrated_postgres, table=table_name) for _ in range(5)]

    def wait(number: int) -> None:
        with lockers[number].lock("report", wait=60):
            order.append(number)
            time.sleep(0.05)

    threads = []
    for number in range(5):
        threads.append(threading.Thread(target=wait, args=(number,)))
        threads[-1].start()
        # The first waiter heads the queue; each later one waits behind it.
        wait_until(lambda: queued(admin, table_name, "report") == (1, number))
    held.unlock()
    for thread in threads:
        thread.join(30)
    assert order == [0, 1, 2, 3, 4]
    wait_until(lambda: queued(admin, table_name, "report") == (0, 0))  # every waiter left
    for locker in [holder, *lockers]:
        locker.close()


def test_a_queued_waiter_gives_up_at_its_deadline_and_leaves_the_queue(
    migrated_postgres: str, table_name: str, admin: sa.Engine
) -> None:
    holder = Locker(migrated_postgres, table=table_name)
    head, behind = (Locker(migrated_postgres, table=table_name) for _ in range(2))
    held = holder.lock("report")
    got: list[bool] = []
    first = threading.Thread(target=lambda: got.append(bool(head.lock("report", wait=30))))
    first.start()
    wait_until(lambda: queued(admin, table_name, "report") == (1, 0))

    started = time.monotonic()
    with pytest.raises(LockBusy) as busy:
        behind.lock("report", wait=0.5)
    assert 0.4 < time.monotonic() - started < 5
    assert busy.value.lock_id == held.lock_id  # it still names the holder
    assert queued(admin, table_name, "report") == (1, 0)  # only the head is left

    held.unlock()
    first.join(10)
    assert got == [True]
    for locker in (holder, head, behind):
        locker.close()


def test_the_head_has_the_row_before_leaving_and_close_finishes_the_leaving(
    migrated_postgres: str, table_name: str, admin: sa.Engine, slow_polling: None
) -> None:
    """The head leaves the queue on the room's own thread once the row is its own (lock()
    does not wait for that round trip); close() waits for leaves still under way."""
    holder = Locker(migrated_postgres, table=table_name)
    waiter = Locker(migrated_postgres, table=table_name)
    held = holder.lock("report")
    got: list[object] = []
    thread = threading.Thread(target=lambda: got.append(waiter.lock("report", wait=30)))
    thread.start()
    wait_until(lambda: queued(admin, table_name, "report") == (1, 0))
    # Handed the row by the release, not won by its own first INSERT at the head: that one
    # must withdraw its request before lock() returns (see test_hand_off.py).
    head_is_waiting(admin, table_name)
    room = waiter._waiting_room()
    leaving = threading.Event()
    real_leave = room.leave

    def slow_leave(*args: Any) -> bool:
        leaving.set()
        time.sleep(0.5)
        return real_leave(*args)

    room.leave = slow_leave  # type: ignore[method-assign]
    held.unlock()
    thread.join(10)
    assert len(got) == 1
    assert leaving.wait(5)
    assert queued(admin, table_name, "report") == (1, 0)  # lock() returned first
    waiter.close()
    assert queued(admin, table_name, "report") == (0, 0)  # close() waited for the leave
    holder.close()


def test_a_head_that_stopped_does_not_keep_the_queue_from_a_free_row(
    migrated_postgres: str,
    table_name: str,
    admin: sa.Engine,
    slow_polling: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A head whose process stopped (Ctrl-Z, a debugger) keeps its place at the front while its
    connection lives. The waiters behind it give up their place after QUEUE_PATIENCE, find
    the row free and take it, then queue again if it is not."""
    monkeypatch.setattr(queueing, "QUEUE_PATIENCE", 0.3)
    holder = Locker(migrated_postgres, table=table_name)
    held = holder.lock("report")
    stopped_head = head_the_queue(admin, table_name)  # and never coming back
    waiter = Locker(migrated_postgres, table=table_name)
    got: list[float] = []

    def wait() -> None:
        with waiter.lock("report", wait=20):
            got.append(time.monotonic())

    thread = threading.Thread(target=wait)
    thread.start()
    wait_until(lambda: queued(admin, table_name, "report") == (1, 1))
    time.sleep(1.0)  # several rounds of patience while the row is held: still waiting
    assert got == []
    released = time.monotonic()
    held.unlock()
    thread.join(10)
    assert len(got) == 1
    assert got[0] - released < 3  # not the 20 s of its deadline
    stopped_head.close()
    waiter.close()
    holder.close()


def test_a_newcomer_does_not_take_the_row_ahead_of_the_queue(
    migrated_postgres: str,
    table_name: str,
    admin: sa.Engine,
    slow_polling: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Between a release and the head's INSERT the row is free; a newcomer's first attempt
    must not take it then, or the same few processes keep taking turns while queued waiters
    wait on. Here the head never acts (a session holding the queue lock), so the row stays
    free: a waiting newcomer queues instead (and, after QUEUE_PATIENCE, takes the row past the
    stopped head); try_lock, which never waits, still takes a free row at once."""
    monkeypatch.setattr(queueing, "QUEUE_PATIENCE", 0.5)
    head = head_the_queue(admin, table_name)
    newcomer = Locker(migrated_postgres, table=table_name)
    started = time.monotonic()
    lock = newcomer.lock("report", wait=10)
    assert time.monotonic() - started >= 0.45  # it waited its turn, as long as its patience
    lock.unlock()
    taken = newcomer.try_lock("report")
    assert taken is not None
    taken.unlock()
    head.close()
    newcomer.close()


def test_a_release_that_woke_a_newcomer_about_to_queue_still_wakes_the_head(
    migrated_postgres: str,
    table_name: str,
    admin: sa.Engine,
    slow_polling: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Locker's release notification wakes one waiter of the lockstring: the one registered
    first. A newcomer registers before its first attempt; if the release lands then, the
    newcomer is the one woken, though it goes on to queue behind the head and acts on nothing
    until its own turn. The head, asleep, must be woken all the same."""
    monkeypatch.setattr(queueing, "QUEUE_PATIENCE", 10.0)
    holder = Locker(migrated_postgres, table=table_name)
    held = holder.lock("report")
    stand_in = head_the_queue(admin, table_name)  # until the head-to-be should take over
    waiters = Locker(migrated_postgres, table=table_name)
    got: list[tuple[str, float]] = []

    def wait() -> None:
        with waiters.lock("report", wait=60):
            got.append((threading.current_thread().name, time.monotonic()))
            time.sleep(0.1)

    head = threading.Thread(target=wait, name="head")
    head.start()
    wait_until(lambda: queued(admin, table_name, "report") == (1, 1))
    # The newcomer registers for releases, then is held back before its first attempt.
    newcomer_registered, newcomer_may_try = threading.Event(), threading.Event()
    try_acquire = waiters._try_acquire

    def held_back(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread().name == "newcomer" and not newcomer_may_try.is_set():
            newcomer_registered.set()
            newcomer_may_try.wait(10)
        return try_acquire(*args, **kwargs)

    monkeypatch.setattr(waiters, "_try_acquire", held_back)
    newcomer = threading.Thread(target=wait, name="newcomer")
    newcomer.start()
    assert newcomer_registered.wait(10)
    # The stand-in leaves: the head-to-be heads the queue, registers behind the newcomer,
    # finds the row held and sleeps.
    leave_the_queue(stand_in, table_name)
    wait_until(lambda: queued(admin, table_name, "report") == (1, 0))
    time.sleep(0.5)
    held.unlock()  # the notification wakes the newcomer, registered first
    released = time.monotonic()
    newcomer_may_try.set()  # refused at the gate, it queues behind the head
    head.join(20)
    newcomer.join(20)
    assert [name for name, _ in got] == ["head", "newcomer"]
    assert got[0][1] - released < 3  # woken, not left to its 30 s poll or the 10 s patience
    stand_in.close()
    waiters.close()
    holder.close()


def test_a_waiter_in_line_for_a_seat_gives_up_at_its_deadline_and_leaves_the_line(
    migrated_postgres: str, table_name: str, admin: sa.Engine
) -> None:
    holder = Locker(migrated_postgres, table=table_name)
    waiters = Locker(migrated_postgres, table=table_name)
    room = waiters._waiting_room()
    assert room is not None
    room.seats.capacity = 1
    held = holder.lock("report")
    first, first_got = wait_in_thread(waiters, wait=30)
    wait_until(lambda: queued(admin, table_name, "report") == (1, 0))
    started = time.monotonic()
    with pytest.raises(LockBusy):
        waiters.lock("report", wait=0.3)
    assert 0.25 < time.monotonic() - started < 5
    last, last_got = wait_in_thread(waiters, wait=30)  # in line behind nobody now
    time.sleep(0.2)
    held.unlock()
    first.join(10)
    first_got["lock"].unlock()
    last.join(10)
    assert "lock" in last_got  # the seat passed on, past the one that gave up
    last_got["lock"].unlock()
    waiters.close()
    holder.close()


def test_a_first_attempt_refused_at_the_gate_does_not_wait_for_anothers_insert(
    migrated_postgres: str, table_name: str, admin: sa.Engine
) -> None:
    """An INSERT waits for the lockstring's other INSERTs to finish (its turn to draw an id,
    ``Statements._new_row_in_id_order``), which lasts until their commits reach the disk. A
    waiter's first attempt that the queue refuses inserts nothing, so it must not wait for
    that turn either: while it waited, the head's INSERT, next in turn, would wait behind it.
    (PostgreSQL 15's planner checks the gate first even when it is written outside the
    subquery that waits; the statement now says so itself.)"""
    locker = Locker(migrated_postgres, table=table_name)
    locker.lock("warm-up").unlock()
    inserting = admin.connect()  # another acquirer, in the middle of its INSERT
    inserting.execute(
        sa.text("SELECT pg_advisory_xact_lock(hashtext(:table), hashtext('report'))"),
        {"table": table_name},
    )
    head = head_the_queue(admin, table_name)
    key = queue_key(f"public.{table_name}", "report")
    outcomes: list[object] = []
    attempt = threading.Thread(
        target=lambda: outcomes.append(
            locker._operations.try_acquire("report", str(uuid.uuid4()), 60.0, {}, queue_key=key)
        )
    )
    attempt.start()
    attempt.join(3)
    finished = not attempt.is_alive()
    inserting.rollback()  # lets it finish either way
    attempt.join(10)
    assert finished, "the refused attempt waited for the other INSERT's turn"
    assert isinstance(outcomes[0], Refused)
    assert locker.lock_info("report") is None
    inserting.close()
    head.close()
    locker.close()


def test_a_refused_attempt_leaves_the_holders_row_untouched(
    migrated_postgres: str, table_name: str, admin: sa.Engine
) -> None:
    """An upsert that decides not to update still locks the row it met, so the holder's release
    would wait for the refused acquirer's commit: the row's xmax would name the refuser."""
    locker = Locker(migrated_postgres, table=table_name)
    held = locker.lock("report")
    for _ in range(3):
        assert locker.try_lock("report") is None
    with admin.connect() as conn:
        xmax = conn.execute(
            sa.text(f"SELECT xmax::text FROM {table_name} WHERE lockstring = 'report'")
        ).scalar_one()
    assert xmax == "0"
    held.unlock()
    locker.close()


@dataclass
class QueuedWaits:
    """What queued waits came to: errors that reached the client (the server logs every one),
    and how many waits ran out of time without one."""

    errors: list[BaseException]
    quiet_timeouts: int = 0


@pytest.fixture
def queued_waits(monkeypatch: pytest.MonkeyPatch) -> QueuedWaits:
    """Watch every queued wait, in the thread and the asyncio rooms, with a patience of 0.2 s
    (the room's watch looks at the queue often)."""
    monkeypatch.setattr(queueing, "QUEUE_PATIENCE", 0.2)
    seen = QueuedWaits([])
    real_granted = QueueWait.granted

    def seen_timed_out(error: BaseException) -> bool:
        seen.errors.append(error)
        return timed_out(error)

    def granted(self: QueueWait, row: Any) -> bool:
        got = real_granted(self, row)
        seen.quiet_timeouts += not got
        return got

    monkeypatch.setattr(waiting_room, "timed_out", seen_timed_out)
    monkeypatch.setattr(async_waiting_room, "timed_out", seen_timed_out)
    monkeypatch.setattr(QueueWait, "granted", granted)
    return seen


def test_a_queued_wait_that_reaches_its_deadline_logs_no_error_on_the_server(
    migrated_postgres: str, table_name: str, admin: sa.Engine, queued_waits: QueuedWaits
) -> None:
    """A lock_timeout that fires is an ERROR, and the server logs each one (a waiter that gave
    up its place every QUEUE_PATIENCE logged one each time). The queue's function catches it
    on the server, so none reaches the client (nor the log). The waiter queued once: it keeps
    its place however long the row is held, and however many times the watch looks."""
    holder = Locker(migrated_postgres, table=table_name)
    held = holder.lock("report")
    stopped_head = head_the_queue(admin, table_name)
    waiter = Locker(migrated_postgres, table=table_name)
    with pytest.raises(LockBusy):
        waiter.lock("report", wait=1.0)
    assert queued_waits.errors == []
    assert queued_waits.quiet_timeouts == 1  # it did queue, once, until its deadline
    stopped_head.close()
    held.unlock()
    got = waiter.lock("report", wait=10)  # through the queue, now free
    assert got.lock_id > held.lock_id
    got.unlock()
    waiter.close()
    holder.close()


async def test_an_async_queued_wait_that_reaches_its_deadline_logs_no_error_on_the_server(
    migrated_postgres: str, table_name: str, admin: sa.Engine, queued_waits: QueuedWaits
) -> None:
    holder = Locker(migrated_postgres, table=table_name)
    held = holder.lock("report")
    stopped_head = head_the_queue(admin, table_name)
    waiter = AsyncLocker(async_url(migrated_postgres), table=table_name)
    with pytest.raises(LockBusy):
        await waiter.lock("report", wait=1.0)
    assert queued_waits.errors == []
    assert queued_waits.quiet_timeouts == 1
    stopped_head.close()
    held.unlock()
    got = await waiter.lock("report", wait=10)
    assert got.lock_id > held.lock_id
    await got.unlock()
    await waiter.aclose()
    holder.close()


async def test_sync_and_async_waiters_share_one_queue(
    migrated_postgres: str, table_name: str, admin: sa.Engine, slow_polling: None
) -> None:
    holder = Locker(migrated_postgres, table=table_name)
    held = holder.lock("report")
    first, third = (AsyncLocker(async_url(migrated_postgres), table=table_name) for _ in range(2))
    second = Locker(migrated_postgres, table=table_name)
    order: list[str] = []

    async def wait_async(name: str, locker: AsyncLocker) -> None:
        async with locker.lock("report", wait=60):
            order.append(name)
            await asyncio.sleep(0.05)

    def wait_sync() -> None:
        with second.lock("report", wait=60):
            order.append("second")
            time.sleep(0.05)

    tasks = [asyncio.create_task(wait_async("first", first))]
    await wait_until_async(lambda: queued(admin, table_name, "report") == (1, 0))
    thread = threading.Thread(target=wait_sync)
    thread.start()
    await wait_until_async(lambda: queued(admin, table_name, "report") == (1, 1))
    tasks.append(asyncio.create_task(wait_async("third", third)))
    await wait_until_async(lambda: queued(admin, table_name, "report") == (1, 2))
    held.unlock()
    await asyncio.gather(*tasks)
    await asyncio.to_thread(thread.join, 20)
    assert order == ["first", "second", "third"]
    await wait_until_async(lambda: queued(admin, table_name, "report") == (0, 0))
    holder.close()
    second.close()
    await first.aclose()
    await third.aclose()


async def test_an_async_release_that_woke_a_newcomer_about_to_queue_still_wakes_the_head(
    migrated_postgres: str,
    table_name: str,
    admin: sa.Engine,
    slow_polling: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """test_a_release_that_woke_a_newcomer_about_to_queue_still_wakes_the_head, with tasks."""
    monkeypatch.setattr(queueing, "QUEUE_PATIENCE", 10.0)
    holder = Locker(migrated_postgres, table=table_name)
    held = holder.lock("report")
    stand_in = head_the_queue(admin, table_name)
    waiters = AsyncLocker(async_url(migrated_postgres), table=table_name)
    got: list[tuple[str, float]] = []

    async def wait() -> None:
        async with waiters.lock("report", wait=60):
            task = asyncio.current_task()
            got.append((task.get_name() if task else "?", time.monotonic()))
            await asyncio.sleep(0.1)

    head = asyncio.create_task(wait(), name="head")
    await wait_until_async(lambda: queued(admin, table_name, "report") == (1, 1))
    newcomer_registered, newcomer_may_try = asyncio.Event(), asyncio.Event()
    try_acquire = waiters._try_acquire

    async def held_back(*args: Any, **kwargs: Any) -> Any:
        task = asyncio.current_task()
        if task is not None and task.get_name() == "newcomer" and not newcomer_may_try.is_set():
            newcomer_registered.set()
            await newcomer_may_try.wait()
        return await try_acquire(*args, **kwargs)

    monkeypatch.setattr(waiters, "_try_acquire", held_back)
    newcomer = asyncio.create_task(wait(), name="newcomer")
    await asyncio.wait_for(newcomer_registered.wait(), 10)
    leave_the_queue(stand_in, table_name)
    await wait_until_async(lambda: queued(admin, table_name, "report") == (1, 0))
    await asyncio.sleep(0.5)
    await asyncio.to_thread(held.unlock)
    released = time.monotonic()
    newcomer_may_try.set()
    await asyncio.wait_for(asyncio.gather(head, newcomer), 20)
    assert [name for name, _ in got] == ["head", "newcomer"]
    assert got[0][1] - released < 3
    stand_in.close()
    await waiters.aclose()
    holder.close()


async def test_an_async_head_leaves_the_queue_by_aclose_at_the_latest(
    migrated_postgres: str, table_name: str, admin: sa.Engine, slow_polling: None
) -> None:
    holder = Locker(migrated_postgres, table=table_name)
    held = holder.lock("report")
    waiter = AsyncLocker(async_url(migrated_postgres), table=table_name)

    async def take() -> AsyncLock:
        return await waiter.lock("report", wait=30)

    heading = asyncio.create_task(take())
    await wait_until_async(lambda: queued(admin, table_name, "report") == (1, 0))
    await asyncio.to_thread(held.unlock)
    lock = await asyncio.wait_for(heading, 10)
    await waiter.aclose()  # waits for the leave still under way, if it is
    assert queued(admin, table_name, "report") == (0, 0)
    assert lock.lock_id > held.lock_id
    holder.close()


async def test_an_async_waiter_behind_a_stopped_head_takes_a_free_row(
    migrated_postgres: str,
    table_name: str,
    admin: sa.Engine,
    slow_polling: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(queueing, "QUEUE_PATIENCE", 0.3)
    holder = Locker(migrated_postgres, table=table_name)
    held = holder.lock("report")
    stopped_head = head_the_queue(admin, table_name)
    waiter = AsyncLocker(async_url(migrated_postgres), table=table_name)

    async def take() -> AsyncLock:
        return await waiter.lock("report", wait=20)

    waiting = asyncio.create_task(take())
    await wait_until_async(lambda: queued(admin, table_name, "report") == (1, 1))
    await asyncio.sleep(1.0)
    assert not waiting.done()
    await asyncio.to_thread(held.unlock)
    lock = await asyncio.wait_for(waiting, 3)  # not the 20 s of its deadline
    await lock.unlock()
    stopped_head.close()
    await waiter.aclose()
    holder.close()


async def test_a_cancelled_async_waiter_leaves_the_queue(
    migrated_postgres: str, table_name: str, admin: sa.Engine, slow_polling: None
) -> None:
    holder = Locker(migrated_postgres, table=table_name)
    held = holder.lock("report")
    head, behind = (AsyncLocker(async_url(migrated_postgres), table=table_name) for _ in range(2))

    async def take(locker: AsyncLocker) -> AsyncLock:
        return await locker.lock("report", wait=60)

    heading = asyncio.create_task(take(head))
    await wait_until_async(lambda: queued(admin, table_name, "report") == (1, 0))
    waiting = asyncio.create_task(take(behind))
    await wait_until_async(lambda: queued(admin, table_name, "report") == (1, 1))
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await wait_until_async(lambda: queued(admin, table_name, "report") == (1, 0))
    assert behind._room is not None
    assert behind._room.seats.idle == []
    held.unlock()
    lock = await asyncio.wait_for(heading, 20)
    await lock.unlock()
    await wait_until_async(lambda: queued(admin, table_name, "report") == (0, 0))
    holder.close()
    await head.aclose()
    await behind.aclose()


async def test_a_waiter_cancelled_as_it_comes_to_head_the_queue_leaves_no_request_behind(
    migrated_postgres: str,
    table_name: str,
    admin: sa.Engine,
    slow_polling: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The cancellation lands as the wait's statement returns: the server has left the
    waiter's request, and its session holds the request's key. Closing the connection ends
    that session only once the server notices, and a release meanwhile granted the request a
    row nobody took (rows held for their whole expiry, under a stress of cancelled waits). The
    session must be over, and the request gone, before the cancelled caller goes on."""
    holder = Locker(migrated_postgres, table=table_name)
    held = holder.lock("report")
    waiter = AsyncLocker(async_url(migrated_postgres), table=table_name)
    await (await waiter.lock("warm up")).unlock()
    room = waiter._waiting_room()
    assert room is not None
    real_fetch_one = room._fetch_one
    sessions: list[int] = []

    async def cancelled_as_it_returns(pooled: Any, statement: tuple[str, Any]) -> Any:
        row = await real_fetch_one(pooled, statement)
        if "queue_for_hand_off" in statement[0]:
            sessions.append(pooled.session)
            raise asyncio.CancelledError
        return row

    monkeypatch.setattr(room, "_fetch_one", cancelled_as_it_returns)
    with pytest.raises(asyncio.CancelledError):
        await waiter.lock("report", wait=60)
    (session,) = sessions
    assert requests(admin, table_name) == []
    with admin.connect() as conn:
        alive = conn.execute(
            sa.text("SELECT count(*) FROM pg_stat_activity WHERE pid = :pid"), {"pid": session}
        ).scalar()
    assert alive == 0
    held.unlock()
    assert holder.locks() == []  # nothing was handed to the waiter that had gone
    await waiter.aclose()
    holder.close()


async def test_a_head_whose_leaving_fails_keeps_the_row_its_own_insert_took(
    migrated_postgres: str, table_name: str, admin: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The head takes over an expired row by its own INSERT, and its queue connection fails
    as it leaves, its request gone (a crash empties the unlogged requests table). The request
    is withdrawn from another connection, and the row, which the caller now holds, is not given
    back with it (given back, the caller's lock would be found gone at its release)."""
    holder = Locker(migrated_postgres, table=table_name, grace=0)
    abandon(holder.lock("report", expires=1))  # a holder that crashed: taken over after 1 s
    waiter = AsyncLocker(async_url(migrated_postgres), table=table_name, grace=0)
    await (await waiter.lock("warm up")).unlock()
    room = waiter._waiting_room()
    assert room is not None
    real_fetch_one = room._fetch_one

    async def failing_to_leave(pooled: Any, statement: tuple[str, Any]) -> Any:
        if "queue_leave" in statement[0]:
            with admin.begin() as conn:
                conn.exec_driver_sql(f"DELETE FROM {table_name}_requests")
            raise OSError("the server went away")
        return await real_fetch_one(pooled, statement)

    monkeypatch.setattr(room, "_fetch_one", failing_to_leave)
    lock = await waiter.lock("report", wait=30)
    info = await waiter.lock_info("report")
    assert info is not None
    assert info.lock_id == lock.lock_id
    assert requests(admin, table_name) == []
    await lock.unlock()  # no LockLost: the row was still ours
    await waiter.aclose()
    holder.close()


async def test_an_async_waiter_cancelled_in_line_for_a_seat_leaves_the_line(
    migrated_postgres: str, table_name: str, admin: sa.Engine
) -> None:
    holder = Locker(migrated_postgres, table=table_name)
    held = holder.lock("report")
    waiters = AsyncLocker(async_url(migrated_postgres), table=table_name)

    async def take() -> AsyncLock:
        return await waiters.lock("report", wait=60)

    first = asyncio.create_task(take())
    await wait_until_async(lambda: queued(admin, table_name, "report") == (1, 0))
    room = waiters._room
    assert room is not None
    room.seats.capacity = 1
    cancelled = asyncio.create_task(take())
    await asyncio.sleep(0.2)  # in line
    last = asyncio.create_task(take())
    await asyncio.sleep(0.2)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    held.unlock()
    lock = await asyncio.wait_for(first, 20)
    await lock.unlock()
    lock = await asyncio.wait_for(last, 20)  # the seat passed on, past the cancelled one
    await lock.unlock()
    await wait_until_async(lambda: queued(admin, table_name, "report") == (0, 0))
    await waiters.aclose()
    holder.close()
