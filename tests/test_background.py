"""A sync Locker's background calls (``concurrency.Background``: its tickets' give-ups, the
forget of a failed acquire's rows) run as asyncio's do, each as soon as it is asked for."""

from __future__ import annotations

import os
import threading
import time

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
