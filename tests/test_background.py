"""A sync Locker's background calls (``concurrency.Background``: its tickets' give-ups, the
forget of a failed acquire's rows) run as asyncio's do, each as soon as it is asked for."""

from __future__ import annotations

import operator
import os
import threading
import time

import pytest

from sqllocker.concurrency import Background


def test_a_call_that_takes_long_holds_up_no_later_call() -> None:
    """A forget of a cut acquire looks for its rows again for up to 30 s: a ticket's give-up
    asked for meanwhile waited behind it, its ticket standing in line all that while."""
    background = Background("test-background")
    forgetting, given_up = threading.Event(), threading.Event()
    try:
        background.call_soon(forgetting.wait, 30)
        background.call_soon(given_up.set)
        assert given_up.wait(5)
    finally:
        forgetting.set()
        background.close()


def test_calls_one_after_another_share_one_thread() -> None:
    background = Background("test-background")
    idents: list[int] = []
    for _ in range(20):
        done = threading.Event()
        background.call_soon(lambda done=done: (idents.append(threading.get_ident()), done.set()))
        assert done.wait(5)
    background.close()
    assert len(set(idents)) == 1


def test_close_waits_for_every_call_asked_for() -> None:
    background = Background("test-background")
    calls: list[int] = []
    background.call_soon(lambda: (time.sleep(0.3), calls.append(1)))
    background.call_soon(lambda: (time.sleep(0.1), calls.append(2)))
    background.call_soon(calls.append, 3)
    background.close()
    assert sorted(calls) == [1, 2, 3]


def test_a_forked_child_runs_its_own_calls() -> None:
    background = Background("test-background")
    background.call_soon(time.sleep, 0.5)  # the parent's thread, busy as the child starts
    pid = os.fork()
    if pid == 0:  # the child: the parent's threads do not exist here
        ran = threading.Event()
        background.call_soon(ran.set)
        os._exit(0 if ran.wait(5) else 1)
    _, status = os.waitpid(pid, 0)
    background.close()
    assert os.waitstatus_to_exitcode(status) == 0


def test_threads_stop_at_most_and_every_call_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """An outage's forgets and give-ups, each waiting between its tries, start no thread
    beyond MOST: the calls beyond wait for one to come free."""
    monkeypatch.setattr(Background, "MOST", 4)
    background = Background("test-most")
    ran, free = [], threading.Event()
    for number in range(40):
        background.call_soon(lambda number=number: (free.wait(5), ran.append(number)))
    time.sleep(0.2)
    assert sum(t.name == "test-most" for t in threading.enumerate()) == 4
    free.set()
    background.close()
    assert sorted(ran) == list(range(40))


def test_idle_threads_beyond_a_trickles_need_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """The thread that came idle last takes the next call: a trickle of calls keeps one busy,
    and the others of a burst end once idle for KEEP_IDLE (woken in turn, none would)."""
    monkeypatch.setattr(Background, "KEEP_IDLE", 0.5)
    background = Background("test-trickle")
    free = threading.Event()
    for _ in range(8):
        background.call_soon(free.wait, 5)
    free.set()
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:  # a call every 0.1 s, for six idle periods
        done = threading.Event()
        background.call_soon(done.set)
        assert done.wait(5)
        time.sleep(0.1)
    # One, or two if a call came before the last call's thread was idle again (a loaded
    # machine): with the longest idle woken first, all eight stayed.
    assert sum(t.name == "test-trickle" for t in threading.enumerate()) <= 2
    background.close()


def test_a_call_that_raises_is_logged_and_the_next_runs(caplog: pytest.LogCaptureFixture) -> None:
    background = Background("test-background")
    ran = threading.Event()
    background.call_soon(operator.truediv, 1, 0)
    background.call_soon(ran.set)
    assert ran.wait(5)
    background.close()
    assert "a background call of test-background failed" in caplog.text


def test_a_child_forked_within_a_call_runs_its_own_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """In the child, the parent's worker that forked returns from its call: it must leave the
    child's Background (a lock of its own) alone, or the child's later calls hang (they did
    once that thread had been idle for KEEP_IDLE)."""
    monkeypatch.setattr(Background, "KEEP_IDLE", 0.1)
    background = Background("test-background")
    forked: list[int] = []

    def check_in_child() -> None:
        time.sleep(0.5)  # the call that forked has returned meanwhile, and KEEP_IDLE passed
        ran = threading.Event()
        background.call_soon(ran.set)
        os._exit(0 if ran.wait(5) else 1)

    def fork() -> None:
        pid = os.fork()
        if pid == 0:
            threading.Thread(target=check_in_child).start()
            return
        forked.append(pid)

    background.call_soon(fork)
    deadline = time.monotonic() + 5
    while not forked and time.monotonic() < deadline:
        time.sleep(0.01)
    _, status = os.waitpid(forked[0], 0)
    background.close()
    assert os.waitstatus_to_exitcode(status) == 0
