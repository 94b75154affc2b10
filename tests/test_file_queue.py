"""SQLite waiters queue in the kernel, on a byte of a file beside the database: the one waiter
holding a lockstring's place tries the row, keeps the place while it holds the row, and the
release wakes the next one (``sqllocker/file_queue.py``). A lock taken with a wait takes the
place too (``wait=1`` below); one taken at once does not, and its release rings for the waiter
that took the place meanwhile (the tests of ``Unplaced``, at the end)."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import sqlite3
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sqllocker import LockBusy, Locker, LockLost, backoff, file_queue
from sqllocker.file_queue import AVAILABLE, SUFFIX, FileQueue
from sqllocker.operations import release as releasing
from tests.helpers import wait_in_thread, wait_until
from tests.test_cli import SQLLOCKER
from tests.test_hand_off import counting_attempts

pytestmark = pytest.mark.skipif(not AVAILABLE, reason="open file description locks are Linux's")


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'locks.db'}"


@pytest.fixture
def lockers(sqlite_url: str, tmp_path: Path) -> Any:
    made: list[Locker] = []

    def make() -> Locker:
        locker = Locker(sqlite_url, grace=0)
        made.append(locker)
        return locker

    yield make
    for locker in made:
        locker.close()
    # Every request was granted once its holder left: none is left blocked for good.
    wait_until(lambda: place_threads(tmp_path) == 0)


def place_threads(tmp_path: Path) -> int:
    """Threads waiting for a place in the queue of the test's database (only: a thread of an
    earlier test may still be on its way out)."""
    name = FileQueue(str(tmp_path / "locks.db")).thread_name
    return sum(thread.name == name for thread in threading.enumerate())


def test_a_waiter_is_woken_by_the_release_not_by_a_poll_timer(
    lockers: Callable[[], Locker], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Polling from 2 ms up, a waiter made eight or more attempts in 0.6 s; queued for the
    place, it makes none until the holder gives the place up with its row."""
    holder, waiter = lockers(), lockers()
    attempts = counting_attempts(waiter, monkeypatch)
    held = holder.lock("report", wait=1, expires=30)
    thread, result = wait_in_thread(waiter, wait=30, expires=30)
    wait_until(lambda: place_threads(tmp_path) == 1)
    time.sleep(0.6)
    assert attempts == []
    assert (tmp_path / f"locks.db{SUFFIX}").exists()
    held.unlock()
    thread.join(10)
    lock = result["lock"]
    assert len(attempts) == 1
    assert lock.lock_id > held.lock_id
    lock.unlock()


def test_a_newcomer_waits_behind_the_holders_place_even_when_the_row_is_free(
    lockers: Callable[[], Locker], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The place says who tries: a newcomer that finds the row free while the place is held
    (most likely by the next waiter, about to insert) waits a moment for its turn, reads the
    row again, and only then makes its one attempt: here at a row deleted behind its
    holder's back, which keeps its place."""
    holder, newcomer = lockers(), lockers()
    attempts = counting_attempts(newcomer, monkeypatch)
    held = holder.lock("report", wait=1, expires=30)
    holder.break_lock("report")
    thread, result = wait_in_thread(newcomer, wait=0.4, expires=30)
    thread.join(10)
    assert len(attempts) == 1  # at its deadline, the one full attempt
    lock = result["lock"]
    lock.unlock()
    held._state.held = False  # its row is gone; only its place was left
    held._state.leave_place()


def test_waiters_that_give_up_leave_one_request_behind_for_the_next(
    lockers: Callable[[], Locker], tmp_path: Path
) -> None:
    """The kernel's wait cannot time out, so a waiter that gives up leaves its request queued
    for the next waiter of its process: twenty timed-out waits cost one blocked thread, not
    twenty, and it goes once the place is granted."""
    holder, waiter = lockers(), lockers()
    held = holder.lock("report", wait=1, expires=30)
    for _ in range(20):
        with pytest.raises(LockBusy):
            waiter.lock("report", wait=0.01)
    assert place_threads(tmp_path) == 1
    held.unlock()
    wait_until(lambda: place_threads(tmp_path) == 0)
    with waiter.lock("report", wait=0) as lock:
        assert lock.is_valid()


def placers(tmp_path: Path) -> list[threading.Thread]:
    """The threads that waited for a place of the test's database, now idle."""
    name = FileQueue(str(tmp_path / "locks.db")).thread_name + " idle"
    return [thread for thread in threading.enumerate() if thread.name == name]


def waited_for_the_place(holder: Locker, waiter: Locker, tmp_path: Path) -> threading.Thread:
    """A wait of ``waiter``'s behind ``holder``'s lock, served by the kernel's queue: the
    thread that waited for the place."""
    held = holder.lock("report", wait=1, expires=30)
    thread, result = wait_in_thread(waiter, wait=30, expires=30)
    wait_until(lambda: place_threads(tmp_path) == 1)
    name = FileQueue(str(tmp_path / "locks.db")).thread_name
    [placer] = [thread for thread in threading.enumerate() if thread.name == name]
    held.unlock()
    thread.join(10)
    result["lock"].unlock()
    return placer


def test_a_wait_is_served_by_the_thread_of_the_last_not_a_new_one(
    lockers: Callable[[], Locker], tmp_path: Path
) -> None:
    """A thread's start and end cost more CPU than a contended turn's statements: the thread
    that waited for a place stays a while for the next request, and serves it."""
    holder, waiter = lockers(), lockers()
    first = waited_for_the_place(holder, waiter, tmp_path)
    wait_until(lambda: placers(tmp_path) == [first])
    assert waited_for_the_place(holder, waiter, tmp_path) is first


def test_idle_placers_end_when_their_while_is_over_or_their_locker_closes(
    lockers: Callable[[], Locker], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    holder, waiter = lockers(), lockers()
    monkeypatch.setattr(file_queue, "IDLE_SECONDS", 0.3)
    placer = waited_for_the_place(holder, waiter, tmp_path)
    placer.join(5)
    assert not placer.is_alive()
    monkeypatch.setattr(file_queue, "IDLE_SECONDS", 60)
    placer = waited_for_the_place(holder, waiter, tmp_path)
    wait_until(lambda: placers(tmp_path) == [placer])
    waiter.close()
    placer.join(5)
    assert not placer.is_alive()


def test_a_forked_childs_wait_has_a_thread_of_its_own(
    lockers: Callable[[], Locker], tmp_path: Path
) -> None:
    """Its parent's threads were not forked with it, neither an idle one nor one still waiting
    for a request its waiter gave up: a child handed its request to one, or taking over the
    other's, would wait for a grant that never comes (and find the row free at its next look
    only)."""
    holder, waiter = lockers(), lockers()
    waited_for_the_place(holder, waiter, tmp_path)
    assert placers(tmp_path)
    held = holder.lock("report", wait=1, expires=30)
    with pytest.raises(LockBusy):
        waiter.lock("report", wait=0.05)  # its request is left queued, for the next wait
    pid = os.fork()
    if pid == 0:  # the child: its wait's request must be waited for by a thread of its own
        code = 1
        try:
            wait_in_thread(waiter, wait=2, expires=30)
            wait_until(lambda: place_threads(tmp_path) == 1, timeout=5)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    held.unlock()
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_child_forked_while_a_thread_held_its_queues_lock_closes_it(tmp_path: Path) -> None:
    """The lock a parent's thread held at the fork is held in the child for good, by nobody:
    the child's queue gets one of its own before the child runs on."""
    queue = FileQueue(str(tmp_path / "locks.db"))
    queue.listen().close()  # the queue in use: a reader thread, a spare file
    taken, forked = threading.Event(), threading.Event()

    def hold() -> None:
        with queue._lock:
            taken.set()
            forked.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    taken.wait(10)
    pid = os.fork()
    if pid == 0:  # the child: close() must return, or the alarm ends the child
        signal.alarm(5)
        queue.close()
        os._exit(0)
    forked.set()
    holder.join(10)
    _, status = os.waitpid(pid, 0)
    queue.close()
    assert os.waitstatus_to_exitcode(status) == 0


def test_waiters_of_other_lockstrings_do_not_wait_for_each_other(
    lockers: Callable[[], Locker],
) -> None:
    holder, other = lockers(), lockers()
    with holder.lock("report", expires=30), other.lock("digest", wait=1) as lock:
        assert lock.is_valid()
    assert FileQueue.offset("t", "report") != FileQueue.offset("t", "digest")
    assert FileQueue.offset("t", "report") != FileQueue.offset("u", "report")


def test_a_forked_child_leaves_its_parents_place_alone(lockers: Callable[[], Locker]) -> None:
    """A child's copy of its parent's file must neither give up the parent's place (nor the
    row) nor keep it after the parent gave it up."""
    holder, waiter = lockers(), lockers()
    held = holder.lock("report", wait=1, expires=30)
    pid = os.fork()
    if pid == 0:  # the child: dropping the lock must leave the parent's place and row alone
        held._state.leave_place()
        os._exit(0)
    os.waitpid(pid, 0)
    with pytest.raises(LockBusy):
        waiter.lock("report", wait=0.3)
    held.unlock()
    with waiter.lock("report", wait=5) as lock:
        assert lock.is_valid()


def test_a_place_dropped_without_leaving_is_given_up(tmp_path: Path) -> None:
    """A lock whose release failed and that was then forgotten must not keep its place for the
    life of the process: every later waiter of its lockstring would wait out its patience."""
    queue = FileQueue(str(tmp_path / "locks.db"))
    offset = queue.offset("semaphores", "report")
    place = queue.take(offset)
    assert place is not None
    assert queue.take(offset) is None
    del place
    gc.collect()
    again = queue.take(offset)
    assert again is not None
    again.leave()
    queue.close()


@pytest.mark.parametrize(
    "url", ["sqlite://", "sqlite:///file:shared-memory?mode=memory&cache=shared&uri=true"]
)
def test_a_database_in_memory_waits_unqueued(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    locker = Locker(url)
    try:
        assert locker._file_queue is None
        with locker.lock("report", wait=1) as lock:
            assert lock.is_valid()
    finally:
        locker.close()
    assert list(tmp_path.iterdir()) == []


async def test_an_async_waiter_is_woken_by_the_release_too(sqlite_url: str) -> None:
    from sqllocker.asyncio import AsyncLocker

    holder = AsyncLocker(sqlite_url.replace("sqlite:", "sqlite+aiosqlite:"), grace=0)
    waiter = AsyncLocker(sqlite_url.replace("sqlite:", "sqlite+aiosqlite:"), grace=0)
    try:
        held = await holder.lock("report", wait=1, expires=30)
        attempts: list[float] = []
        try_acquire = waiter._operations.try_acquire

        def counted(*args: Any) -> Any:
            attempts.append(time.monotonic())
            return try_acquire(*args)

        waiter._operations.try_acquire = counted  # type: ignore[method-assign]

        async def wait() -> Any:
            return await waiter.lock("report", wait=30, expires=30)

        task = asyncio.create_task(wait())
        await asyncio.sleep(0.6)
        assert attempts == []
        await held.unlock()
        lock = await asyncio.wait_for(task, 10)
        assert len(attempts) == 1
        await lock.unlock()
    finally:
        await holder.aclose()
        await waiter.aclose()


def test_releases_checkpoint_the_log_once_they_have_left_their_place(
    lockers: Callable[[], Locker], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite's own checkpoint ran inside whichever commit took the log past its limit, now and
    then a release still holding its place: its waiters waited it out. The engine's connections
    no longer checkpoint as they commit; a release does, every CHECKPOINT_EVERY, once its place
    is free."""
    monkeypatch.setattr(releasing, "CHECKPOINT_EVERY", 4)
    locker = lockers()
    probe = FileQueue(str(tmp_path / "locks.db"))
    places_free: list[bool] = []
    checkpoint = locker._operations.checkpoint

    def looking_first() -> None:
        place = probe.take(probe.offset(locker.table_name, "report"))
        places_free.append(place is not None)
        if place is not None:
            place.leave()
        checkpoint()

    locker._operations.checkpoint = looking_first  # type: ignore[method-assign]
    for _ in range(12):
        with locker.lock("report"):
            pass
    assert places_free == [True, True, True]
    with locker.engine.connect() as connection:
        assert connection.exec_driver_sql("PRAGMA wal_autocheckpoint").scalar() == 0
    log, copied = log_pages(tmp_path / "locks.db")
    assert log == copied  # every page in the log is in the database file already
    probe.close()


def log_pages(database: Path) -> tuple[int, int]:
    """(pages in the write-ahead log, pages of it already copied back): a passive checkpoint's
    count, on a connection of its own that writes nothing."""
    connection = sqlite3.connect(database)
    try:
        _, log, copied = connection.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        return int(log), int(copied)
    finally:
        connection.close()


def test_without_the_releases_checkpoints_the_log_grows_past_sqlites_limit(
    lockers: Callable[[], Locker], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the releases' checkpoints are for: with none, nothing copies the log back (the
    engine's connections no longer do it as they commit) and it grows with every lock; with
    them, it starts again as it did with SQLite's own."""
    monkeypatch.setattr(releasing, "CHECKPOINT_EVERY", 10**9)
    locker = lockers()
    for _ in range(200):
        with locker.lock("report"):
            pass
    log, _ = log_pages(tmp_path / "locks.db")
    assert log > 1000  # SQLite's own limit, in pages
    monkeypatch.setattr(releasing, "CHECKPOINT_EVERY", 128)
    for _ in range(300):
        with locker.lock("report"):
            pass
    log, _ = log_pages(tmp_path / "locks.db")
    assert log <= 128 * 8  # started again after a checkpoint, as with SQLite's own


# A waiter's patience for its turn, made long: what serves it sooner than this is not a poll.
LONG_PATIENCE = 10.0


def test_a_queued_waiter_hears_a_break_at_once_not_at_its_next_look(
    lockers: Callable[[], Locker], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The holder lives and keeps its place; its row is broken by sqllocker (``break_lock``,
    ``release --force``). The waiter was served only at its next try, up to a second later;
    the breaker now rings the queue's bell, and every waiter of the database tries the row."""
    monkeypatch.setattr(backoff, "QUEUE_PATIENCE", LONG_PATIENCE)
    holder, waiter, breaker = lockers(), lockers(), lockers()
    held = holder.lock("report", wait=1, expires=60, keep_alive=False)
    thread, result = wait_in_thread(waiter, wait=30, expires=30)
    wait_until(lambda: place_threads(tmp_path) == 1)
    time.sleep(0.5)  # the waiter is waiting for its turn by now
    assert "lock" not in result
    broken = time.monotonic()
    assert breaker.break_lock("report") is not None
    thread.join(LONG_PATIENCE + 5)
    lock = result["lock"]
    assert result["returned"] - broken < 2.0  # not LONG_PATIENCE
    assert lock.lock_id > held.lock_id
    lock.unlock()
    with pytest.raises(LockLost):
        held.unlock()


def test_a_queued_waiter_is_served_when_the_row_expires_not_at_its_next_look(
    lockers: Callable[[], Locker], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The holder lives, keeps its place, and lets its row expire: the waiter reads the row's
    own expiry when it queues, and tries it then, not at its next look."""
    monkeypatch.setattr(backoff, "QUEUE_PATIENCE", LONG_PATIENCE)
    holder, waiter = lockers(), lockers()
    held = holder.lock("report", wait=1, expires=1, keep_alive=False)
    thread, result = wait_in_thread(waiter, wait=30, expires=30)
    thread.join(LONG_PATIENCE + 5)
    lock = result["lock"]
    assert lock.created >= held.expires  # not before the row expired, by the database's clock
    assert (lock.created - held.expires).total_seconds() < 2.0  # not LONG_PATIENCE after
    lock.unlock()


def test_a_queued_waiter_tries_a_row_only_once_a_look_finds_it_free(
    lockers: Callable[[], Locker], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """An operator's SQL deletes the row: no bell rings, and the waiter finds out at its next
    look at the row (a read), which comes well before the row's expiry. Looks that find the row
    held make no attempt at it."""
    monkeypatch.setattr(backoff, "QUEUE_PATIENCE", 0.2)
    holder, waiter = lockers(), lockers()
    attempts = counting_attempts(waiter, monkeypatch)
    held = holder.lock("report", wait=1, expires=60, keep_alive=False)
    thread, result = wait_in_thread(waiter, wait=30, expires=30)
    time.sleep(1.0)  # five looks or so
    assert attempts == []
    with sqlite3.connect(tmp_path / "locks.db") as operator:
        operator.execute("DELETE FROM semaphores WHERE lockstring = 'report'")
    thread.join(20)
    assert len(attempts) == 1
    result["lock"].unlock()
    with pytest.raises(LockLost):
        held.unlock()


async def test_an_async_queued_waiter_hears_a_break_too(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sqllocker.asyncio import AsyncLock, AsyncLocker

    monkeypatch.setattr(backoff, "QUEUE_PATIENCE", LONG_PATIENCE)
    async_url = sqlite_url.replace("sqlite:", "sqlite+aiosqlite:")
    holder, waiter, breaker = (AsyncLocker(async_url, grace=0) for _ in range(3))
    try:
        held = await holder.lock("report", wait=1, expires=60, keep_alive=False)

        async def wait() -> AsyncLock:
            return await waiter.lock("report", wait=30, expires=30)

        task = asyncio.create_task(wait())
        await asyncio.sleep(0.5)
        assert not task.done()
        broken = time.monotonic()
        assert await breaker.break_lock("report") is not None
        lock = await asyncio.wait_for(task, LONG_PATIENCE + 5)
        assert time.monotonic() - broken < 2.0
        await lock.unlock()
        with pytest.raises(LockLost):
            await held.unlock()
    finally:
        for locker in (holder, waiter, breaker):
            await locker.aclose()


def test_a_queued_waiter_hears_release_force_from_another_process(
    lockers: Callable[[], Locker], monkeypatch: pytest.MonkeyPatch, sqlite_url: str
) -> None:
    """The operator's ``sqllocker release --force``, run beside a live holder: the bell rings
    across processes, through the queue file. (The console script's start is slow on a loaded
    machine: the bound is set against a patience of a minute.)"""
    monkeypatch.setattr(backoff, "QUEUE_PATIENCE", 60.0)
    holder, waiter = lockers(), lockers()
    held = holder.lock("report", wait=1, expires=120, keep_alive=False)
    thread, result = wait_in_thread(waiter, wait=120, expires=30)
    time.sleep(0.5)
    released = subprocess.run(
        [SQLLOCKER, "--url", sqlite_url, "release", "report", "--force"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert released.returncode == 0, released.stderr
    thread.join(30)
    assert result["lock"].lock_id > held.lock_id  # served, not waiting out its patience
    result["lock"].unlock()
    with pytest.raises(LockLost):
        held.unlock()


def test_the_bell_wakes_every_listener_of_every_queue_and_its_reader_ends_with_the_queue(
    tmp_path: Path,
) -> None:
    """One queue rings (a breaker's Locker); two other queues of the same database (two
    waiters' Lockers, as two processes would have) hear it, each of their listeners, also
    one that was not waiting just then; a ring before a listener listened is not heard by it."""
    path = str(tmp_path / "locks.db")
    breaker, first, second = FileQueue(path), FileQueue(path), FileQueue(path)
    breaker.ring()  # before anyone listens
    listeners = [first.listen(), first.listen(), second.listen()]
    woken = [threading.Event() for _ in listeners]
    for listener, event in zip(listeners[:2], woken[:2], strict=True):
        listener.when_rung(event.set)
    time.sleep(0.2)
    assert not any(event.is_set() for event in woken)
    assert not any(listener.heard() for listener in listeners)
    breaker.ring()
    for event in woken[:2]:
        assert event.wait(5)
    wait_until(lambda: listeners[2].heard())  # heard without waiting: for its next wait
    listeners[2].when_rung(woken[2].set)
    assert not woken[2].is_set()  # heard() forgot it
    for listener in listeners:
        listener.close()
    for queue in (breaker, first, second):
        queue.close()
    bells = f"{first.thread_name} bell"
    wait_until(lambda: not any(thread.name == bells for thread in threading.enumerate()))


def test_the_bells_reader_stays_a_while_for_the_next_listener_then_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process taking turns listens for each wait, milliseconds apart: one reader serves
    them all, rather than a thread started for each wait."""
    queue = FileQueue(str(tmp_path / "locks.db"))
    bells = f"{queue.thread_name} bell"

    def readers() -> list[threading.Thread]:
        return [thread for thread in threading.enumerate() if thread.name == bells]

    queue.listen().close()
    [reader] = readers()
    time.sleep(0.2)  # past a few of its reads with nobody listening
    queue.listen().close()
    assert readers() == [reader]
    monkeypatch.setattr(file_queue, "IDLE_SECONDS", 0.3)
    reader.join(5)
    assert not reader.is_alive()
    queue.close()


# -- locks taken at once, without their places (file_queue.Unplaced) ----------------------------


def test_a_lock_taken_at_once_takes_no_place_and_its_release_rings_for_the_waiter(
    lockers: Callable[[], Locker], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A lock taken at once (``wait=0``) leaves its place free. A waiter that comes meanwhile
    takes the place, makes its one attempt, and then only looks at the row, at its patience
    (made long here) or when the bell rings; the release finds the place held and rings it,
    and the waiter is served at once, not at its next look, nor at the row's expiry."""
    monkeypatch.setattr(backoff, "QUEUE_PATIENCE", LONG_PATIENCE)
    holder, waiter = lockers(), lockers()
    probe = FileQueue(str(tmp_path / "locks.db"))
    offset = probe.offset(holder.table_name, "report")
    attempts = counting_attempts(waiter, monkeypatch)
    held = holder.lock("report", expires=60)
    assert not probe.is_held(offset)
    thread, result = wait_in_thread(waiter, wait=30, expires=30)
    wait_until(lambda: probe.is_held(offset))  # the waiter's, on its first attempt
    time.sleep(0.6)
    assert len(attempts) == 1
    assert "lock" not in result
    released = time.monotonic()
    held.unlock()
    thread.join(LONG_PATIENCE + 5)
    lock = result["lock"]
    assert result["returned"] - released < 1.0  # not LONG_PATIENCE, nor the row's expiry
    assert len(attempts) == 2
    assert lock.lock_id > held.lock_id
    lock.unlock()
    assert not probe.is_held(offset)
    probe.close()


def test_a_waiter_behind_a_lock_taken_at_once_hears_a_break_too(
    lockers: Callable[[], Locker], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(backoff, "QUEUE_PATIENCE", LONG_PATIENCE)
    holder, waiter, breaker = lockers(), lockers(), lockers()
    held = holder.lock("report", expires=60, keep_alive=False)
    thread, result = wait_in_thread(waiter, wait=30, expires=30)
    time.sleep(0.5)
    broken = time.monotonic()
    assert breaker.break_lock("report") is not None
    thread.join(LONG_PATIENCE + 5)
    assert result["returned"] - broken < 2.0
    result["lock"].unlock()
    with pytest.raises(LockLost):
        held.unlock()


def test_the_turns_bell_wakes_only_waiters_holding_their_places(tmp_path: Path) -> None:
    """A release without a place rings for the waiter that holds it; queued waiters, behind
    it, are not woken to try the row before it."""
    path = str(tmp_path / "locks.db")
    ringer, listening = FileQueue(path), FileQueue(path)
    queued, placed = listening.listen(), listening.listen()
    placed.turns = 12345
    woken = {"queued": threading.Event(), "placed": threading.Event()}
    queued.when_rung(woken["queued"].set)
    placed.when_rung(woken["placed"].set)
    ringer.ring(turn=12345)
    assert woken["placed"].wait(5)
    time.sleep(0.2)
    assert not woken["queued"].is_set()
    ringer.ring()
    assert woken["queued"].wait(5)
    for listener in (queued, placed):
        listener.close()
    for queue in (ringer, listening):
        queue.close()


# Processes of the mixed fleet below, and the turns each takes.
MIXED_PROCESSES = 6
MIXED_TURNS = 40


def _mixed_worker(url: str, number: int, inside: Any, overlaps: Any, ids: Any, go: Any) -> None:
    """Half the workers take the lock at once (no place), trying again after a refusal, from
    ``go`` on; the other half wait for it (in the kernel's queue). Each checks that it is
    alone inside."""
    locker = Locker(url, grace=0)
    if number % 2:
        go.wait(60)
    try:
        for _ in range(MIXED_TURNS):
            if number % 2:
                while True:
                    try:
                        lock = locker.lock("report", expires=30)
                        break
                    except LockBusy:
                        time.sleep(0.001)
            else:
                lock = locker.lock("report", wait=60, expires=30)
            with inside.get_lock():
                inside.value += 1
                if inside.value != 1:
                    overlaps.value += 1
            with ids.get_lock():
                if lock.lock_id <= ids.value:  # fencing tokens in the order of the holds
                    overlaps.value += 1
                ids.value = lock.lock_id
            time.sleep(0.002)
            with inside.get_lock():
                inside.value -= 1
            lock.unlock()
    finally:
        locker.close()


def test_waiters_and_locks_taken_at_once_from_many_processes_never_overlap(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Processes that take the lock at once, without a place, and processes that wait for it
    in the kernel's queue, on one lockstring: never two holders, fencing tokens in order.
    The waiters queue first, behind a lock held at once by this process, and the first is
    served at its release, not at its next look (made long)."""
    import multiprocessing

    monkeypatch.setattr(backoff, "QUEUE_PATIENCE", LONG_PATIENCE)
    context = multiprocessing.get_context("fork")
    inside, overlaps, ids = context.Value("i", 0), context.Value("i", 0), context.Value("q", 0)
    go = context.Event()
    locker = Locker(sqlite_url, grace=0)
    held = locker.lock("report", expires=60)
    workers = [
        context.Process(target=_mixed_worker, args=(sqlite_url, n, inside, overlaps, ids, go))
        for n in range(MIXED_PROCESSES)
    ]
    for worker in workers:
        worker.start()
    time.sleep(1.0)  # every waiter queued behind the lock taken at once
    assert ids.value == 0
    released = time.monotonic()
    held.unlock()
    wait_until(lambda: ids.value > 0, timeout=LONG_PATIENCE + 5)
    served = time.monotonic() - released  # by a waiter: the others start now
    go.set()
    for worker in workers:
        worker.join(120)
        assert worker.exitcode == 0
    locker.close()
    assert overlaps.value == 0
    assert served < 1.0  # not LONG_PATIENCE
