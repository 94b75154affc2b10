"""``concurrency.Wakeup``: how a sync waiter in the kernel's queue (SQLite) is woken by the thread
that got its place, or by the bell's reader: any number of wakes, from any threads, end its one
wait, and none raises."""

from __future__ import annotations

import threading
from collections.abc import Callable

from sqllocker import concurrency


def test_a_wake_before_the_wait_ends_it_at_once_and_a_second_wake_is_harmless() -> None:
    wakeup, wake = concurrency.woken_from_thread()
    wake()
    wake()
    concurrency.wait(wakeup, None)  # would block for ever, had the first wake been lost
    wake()  # after the wait, too


def test_a_wait_never_woken_ends_at_its_timeout() -> None:
    wakeup, _ = concurrency.woken_from_thread()
    concurrency.wait(wakeup, 0.01)
    concurrency.wait(wakeup, -1.0)  # a patience already spent: no wait, no error


def test_wakes_racing_from_many_threads_end_the_wait_and_none_raises() -> None:
    errors: list[BaseException] = []
    for _ in range(200):
        wakeup, wake = concurrency.woken_from_thread()
        start = threading.Barrier(5)

        def waker(wake: Callable[[], None] = wake, start: threading.Barrier = start) -> None:
            start.wait()
            try:
                wake()
            except BaseException as error:
                errors.append(error)

        threads = [threading.Thread(target=waker) for _ in range(4)]
        for thread in threads:
            thread.start()
        start.wait()
        concurrency.wait(wakeup, None)
        for thread in threads:
            thread.join()
    assert errors == []
