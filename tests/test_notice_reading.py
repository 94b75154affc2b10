"""PostgreSQL, sync: a waiting thread reads its Locker's listening connection itself while it
waits (``sqllocker.notice_reading``), so a hand-off wakes it without a hand from the listener's
thread; the listener's thread reads the rest of the time, and gets the connection back
whatever ends a wait."""

from __future__ import annotations

import contextlib
import inspect
import os
import random
import resource
import signal
import sys
import threading
import time
from types import FrameType
from typing import Any

import pytest
import sqlalchemy as sa

from sqllocker import LockBusy, Locker, notice_reading
from sqllocker import listener as listening
from tests.helpers import in_line, tickets, wait_in_thread, wait_until


def closing_ends_the_listener(waiter: Locker) -> None:
    """``waiter.close()`` leaves its listener's thread ended."""
    listener = waiter._tickets.listener
    assert listener is not None
    assert listener._thread is not None
    listening_thread = listener._thread
    waiter.close()
    assert not listening_thread.is_alive()


def handed_over(holder: Locker, waiter: Locker, admin: sa.Engine, table: str, times: int) -> None:
    """``times`` hand-offs of "report" from ``holder`` to a thread of ``waiter``'s."""
    for _ in range(times):
        held = holder.lock("report")
        thread, result = wait_in_thread(waiter, wait=30, expires=20)
        in_line(admin, table)
        held.unlock()
        thread.join(10)
        assert "lock" in result, result
        result["lock"].unlock()


@pytest.fixture
def heard_on(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, str]]:
    """Every notice a listener hands on, as (the thread that read it, its channel)."""
    heard: list[tuple[int, str]] = []
    hear = listening.ReleaseListener._heard

    def recording(self: listening.ReleaseListener, channel: str, payload: str) -> None:
        heard.append((threading.get_ident(), channel))
        hear(self, channel, payload)

    monkeypatch.setattr(listening.ReleaseListener, "_heard", recording)
    return heard


def test_a_waiting_thread_reads_the_grant_of_its_hand_off_itself(
    holder_and_waiter: tuple[Locker, Locker],
    table_name: str,
    admin: sa.Engine,
    heard_on: list[tuple[int, str]],
) -> None:
    """The grant was read by the listener's thread, which then woke the waiting thread: that
    hand was most of a hand-off's latency. Five hand-offs: a waiter in line still tries the
    row now and then (``Backoff.await_hand_off``), and one whose try meets the release may
    take the row by it, its grant then read by whichever thread reads."""
    holder, waiter = holder_and_waiter
    read_by_waiter = 0
    for _ in range(5):
        held = holder.lock("report")
        thread, result = wait_in_thread(waiter, wait=60, expires=20)
        in_line(admin, table_name)
        heard_on.clear()
        held.unlock()
        thread.join(10)
        assert result["lock"].lock_id > held.lock_id
        listener = waiter._tickets.listener
        assert listener is not None
        read_by_waiter += (thread.ident, listener.grants_channel) in heard_on
        result["lock"].unlock()
    assert read_by_waiter >= 3


def test_threads_of_one_locker_are_served_in_turn_while_one_of_them_reads_for_all(
    holder_and_waiter: tuple[Locker, Locker],
    table_name: str,
    admin: sa.Engine,
    heard_on: list[tuple[int, str]],
) -> None:
    """Four threads wait: one reads the listening connection, and hands the others' grants
    on as the listener's thread would; each leaves it to the next, or to the listener's
    thread, once served."""
    holder, waiter = holder_and_waiter
    held = holder.lock("report")
    waits = []
    for number in range(4):
        waits.append(wait_in_thread(waiter, wait=60, expires=20))
        in_line(admin, table_name, waiters=number + 1)
    held.unlock()
    for thread, result in waits:
        thread.join(10)
        assert "lock" in result, result
        result["lock"].unlock()
    listener = waiter._tickets.listener
    assert listener is not None
    waiting = {thread.ident for thread, _ in waits}
    readers = {ident for ident, channel in heard_on if channel == listener.grants_channel}
    assert readers & waiting  # some grants were read by a waiting thread
    assert tickets(admin, table_name) == []


def test_closing_a_locker_while_a_thread_reads_its_listening_connection_ends_the_listener(
    holder_and_waiter: tuple[Locker, Locker], table_name: str, admin: sa.Engine
) -> None:
    """The listener's thread, ending, waits for the waiting thread to leave the connection
    before it is closed; the waiting thread finds out at its next read, at once."""
    holder, waiter = holder_and_waiter
    held = holder.lock("report")
    thread, result = wait_in_thread(waiter, wait=3, expires=20)
    in_line(admin, table_name)
    closing_ends_the_listener(waiter)
    thread.join(10)
    assert not thread.is_alive()
    assert isinstance(result.get("error"), LockBusy), result
    held.unlock()


class Interrupted(Exception):
    """What the test's signal handler raises in the waiting thread."""


def test_what_a_signal_handler_raises_in_a_reading_thread_ends_its_wait_not_the_listener(
    holder_and_waiter: tuple[Locker, Locker], table_name: str, admin: sa.Engine
) -> None:
    """The main thread waits, and reads the listening connection meanwhile, when a signal's
    handler raises: lock() raises it, as it would from any wait, the ticket is given up, and
    the listener's session lives on (its key, and the tickets of the Locker's other waiters,
    with it): a read interrupted so is no lost connection. The next waiter is served."""
    holder, waiter = holder_and_waiter
    held = holder.lock("report")

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise Interrupted

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 1.5)
        with pytest.raises(Interrupted):
            waiter.lock("report", wait=30, expires=20)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    listener = waiter._tickets.listener
    assert listener is not None
    key = listener.liveness_key
    assert key is not None
    wait_until(lambda: tickets(admin, table_name) == [])
    thread, result = wait_in_thread(waiter, wait=60, expires=20)
    in_line(admin, table_name)
    assert listener.liveness_key == key
    held.unlock()
    thread.join(10)
    assert "lock" in result, result
    result["lock"].unlock()


def test_a_child_forked_while_a_thread_reads_the_listening_connection_listens_on_its_own(
    holder_and_waiter: tuple[Locker, Locker], table_name: str, admin: sa.Engine
) -> None:
    """A process forked while a thread of its parent reads the listening connection: the
    child waits on a listener of its own, never on its parent's reading (whose thread is not
    in the child, and whose connection is the parent's)."""
    holder, waiter = holder_and_waiter
    held = holder.lock("report")
    thread, result = wait_in_thread(waiter, wait=60, expires=20)
    in_line(admin, table_name)
    pid = os.fork()
    if pid == 0:  # the child: its wait ends at its bound, refused
        code = 1
        try:
            waiter.lock("report", wait=1.5, expires=20)
        except LockBusy:
            code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + 30
    while (ended := os.waitpid(pid, os.WNOHANG)) == (0, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    if ended == (0, 0):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise AssertionError("the forked child's wait did not end")
    assert os.waitstatus_to_exitcode(ended[1]) == 0
    held.unlock()
    thread.join(10)
    assert "lock" in result, result
    result["lock"].unlock()


def _raise_in_lead_as_it_ends(frame: FrameType, event: str, arg: object) -> Any:
    """A trace function that raises KeyboardInterrupt once, in NoticeReader._lead, as the
    step that puts the lead down is about to run: where a signal handler's exception can
    land."""
    if frame.f_code is not notice_reading.NoticeReader._lead.__code__:
        return None

    def local(frame: FrameType, event: str, arg: object) -> Any:
        line = inspect.getframeinfo(frame).code_context or [""]
        if event == "line" and "self._leader = self._leading = None" in line[0]:
            sys.settrace(None)
            frame.f_trace = None
            raise KeyboardInterrupt
        return local

    return local


def test_a_lead_left_without_putting_it_down_is_taken_back(
    holder_and_waiter: tuple[Locker, Locker], table_name: str, admin: sa.Engine
) -> None:
    """A signal handler's exception lands in the step that puts the lead down, which never
    runs: the thread has left its wait, but its Locker's reader still named it as the one
    reading. No thread led again, the listener's thread read for nobody, and closing the
    Locker left that thread waiting for the lead for good. Now the lead of a thread no longer
    in its call is taken back."""
    holder, waiter = holder_and_waiter
    held = holder.lock("report")
    sys.settrace(_raise_in_lead_as_it_ends)
    try:
        with pytest.raises(KeyboardInterrupt):
            waiter.lock("report", wait=1, expires=20)
    finally:
        sys.settrace(None)
    held.unlock()
    handed_over(holder, waiter, admin, table_name, times=3)
    closing_ends_the_listener(waiter)


def test_a_storm_of_raising_signal_handlers_in_the_reading_thread_leaves_its_locker_working(
    holder_and_waiter: tuple[Locker, Locker], table_name: str, admin: sa.Engine
) -> None:
    """SIGALRM every fraction of a millisecond while the main thread waits for a lock that
    other threads of its Locker wait for too, its handler raising whenever the main thread
    runs a step of the reader's: whatever step each exception cut short, the Locker's threads
    are served within their bounds, hand-offs are read by the waiting thread afterwards, and
    closing the Locker ends its listener."""
    holder, waiter = holder_and_waiter
    stop = threading.Event()
    failures: list[BaseException] = []

    def holding() -> None:
        while not stop.is_set():
            held = holder.lock("report", wait=30, expires=20)
            time.sleep(0.02)
            held.unlock()
            time.sleep(0.001)

    def waiting() -> None:
        try:
            while not stop.is_set():
                with contextlib.suppress(LockBusy):
                    waiter.lock("report", wait=5, expires=20).unlock()
        except BaseException as error:
            failures.append(error)

    threads = [threading.Thread(target=holding)] + [
        threading.Thread(target=waiting) for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    armed = False
    interrupted = 0

    def interrupt(signum: int, frame: FrameType | None) -> None:
        # In the reader's own steps, and in what it enters and leaves a lock by: one within
        # threading's Event.wait can leave a RuntimeError of its own, as it could before
        # the reader was there.
        nonlocal interrupted
        if not armed or frame is None:
            return
        caller = frame.f_back
        if frame.f_code.co_filename == notice_reading.__file__ or (
            frame.f_code.co_name in ("__enter__", "__exit__")
            and caller is not None
            and caller.f_code.co_filename == notice_reading.__file__
        ):
            interrupted += 1
            raise Interrupted

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        storm_ends = time.monotonic() + 4
        while time.monotonic() < storm_ends:
            signal.setitimer(signal.ITIMER_REAL, random.uniform(0.0001, 0.0005), 0.0003)
            armed = True
            try:
                waiter.lock("report", wait=1, expires=20).unlock()
            except (Interrupted, LockBusy):
                pass
            finally:
                armed = False
                signal.setitimer(signal.ITIMER_REAL, 0)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        stop.set()
        for thread in threads:
            thread.join(30)
    assert interrupted > 0
    assert not [thread for thread in threads if thread.is_alive()]
    assert not failures, failures
    handed_over(holder, waiter, admin, table_name, times=3)
    closing_ends_the_listener(waiter)


def test_a_thread_woken_by_a_grant_the_main_thread_read_is_woken_by_the_listeners_thread(
    holder_and_waiter: tuple[Locker, Locker],
    table_name: str,
    admin: sa.Engine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The main thread leads while another thread of its Locker waits for another lock: the
    grant of that lock, read by the main thread, is set by the listener's thread, never by
    the main thread, where a signal handler's exception inside Event.set would leave the
    event's lock held and its thread waiting for good."""
    holder, waiter = holder_and_waiter
    set_by: list[int] = []
    set_deferred = notice_reading.NoticeReader._set_deferred

    def recording(self: notice_reading.NoticeReader) -> None:
        if self._deferred:
            set_by.append(threading.get_ident())
        set_deferred(self)

    monkeypatch.setattr(notice_reading.NoticeReader, "_set_deferred", recording)
    held_a, held_b = holder.lock("a"), holder.lock("b")
    result: dict[str, Any] = {}

    def then_b() -> None:  # once the main thread leads: another thread waits, and is served
        in_line(admin, table_name)
        thread, got = wait_in_thread(waiter, "b", wait=60, expires=20)
        in_line(admin, table_name, waiters=2)
        held_b.unlock()
        thread.join(10)
        result.update(got)
        if "lock" in got:
            got["lock"].unlock()
        held_a.unlock()

    other = threading.Thread(target=then_b)
    other.start()
    lock_a = waiter.lock("a", wait=30, expires=20)  # the main thread leads meanwhile
    other.join(20)
    lock_a.unlock()
    assert "lock" in result, result
    assert set_by
    assert threading.get_ident() not in set_by


class _Lost(Exception):
    """What the test's stand-in for a signal handler raises as the connection is read."""


def test_what_a_signal_handler_raises_as_the_connection_is_read_is_not_a_lost_connection(
    holder_and_waiter: tuple[Locker, Locker], table_name: str, admin: sa.Engine
) -> None:
    """A handler's exception that came as libpq read the connection was taken for the
    connection lost: the caller never saw it, its wait ran to its bound, and the listener
    reconnected (a new session, its tickets dead). The main thread must be the one reading
    as the hand-off comes: a loaded machine may let the listener's own thread read it first,
    and the wait is then tried again."""
    holder, waiter = holder_and_waiter
    waiter.lock("warm", wait=5).unlock()
    listener = waiter._tickets.listener
    assert listener is not None
    wait_until(lambda: listener._reader is not None)
    reader = listener._reader
    assert reader is not None
    key = listener.liveness_key
    raised_in_main: list[bool] = []

    class Interrupting:
        def __init__(self, pgconn: Any) -> None:
            self._pgconn = pgconn

        def __getattr__(self, name: str) -> Any:
            return getattr(self._pgconn, name)

        def consume_input(self) -> None:
            self._pgconn.consume_input()
            if threading.current_thread() is threading.main_thread():
                raised_in_main.append(True)
                raise _Lost

    reader._pgconn = Interrupting(reader._pgconn)
    for _ in range(5):
        held = holder.lock("report")
        releaser = threading.Timer(1.0, held.unlock)
        releaser.start()
        try:
            try:
                taken = waiter.lock("report", wait=10, expires=20)
            except _Lost:
                break
            # The main thread read nothing meanwhile, or what it raised was swallowed.
            assert not raised_in_main, "the handler's exception did not reach the caller"
            taken.unlock()
        finally:
            releaser.join()
    else:
        pytest.fail("the main thread never read the connection as a hand-off came")
    assert listener.liveness_key == key
    assert reader._failure is None


def test_a_process_with_more_than_1024_files_open_still_hands_off(
    holder_and_waiter: tuple[Locker, Locker], table_name: str, admin: sa.Engine
) -> None:
    """The reader's pipes get numbers past 1,023, which select() refuses: the listener's
    thread failed at its first wait, and reconnected every second."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = 1200
    if soft < needed:
        assert hard >= needed, "this test needs RLIMIT_NOFILE of 1200"
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    opened = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        holder, waiter = holder_and_waiter
        waiter.lock("warm", wait=5).unlock()  # the reader made now: its pipes past 1,023
        listener = waiter._tickets.listener
        assert listener is not None
        key = listener.liveness_key
        handed_over(holder, waiter, admin, table_name, times=2)
        time.sleep(2.5)  # the listener's thread waited, idle, twice meanwhile
        assert listener.liveness_key == key
    finally:
        for fd in opened:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
