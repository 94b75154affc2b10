"""The keep-alive thread survives a lock taken out of it while another's on_lost runs."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from sqllocker import Lock, Locker, LockLost


@pytest.mark.slow
def test_an_entry_removed_while_on_lost_runs_does_not_stop_the_renewals(locker: Locker) -> None:
    keep_alives = locker._keep_alives
    renewed = locker.lock("renewed meanwhile", expires=2, keep_alive=True)
    first, second = locker.lock("first", expires=0.3), locker.lock("second", expires=0.3)
    time.sleep(0.5)  # both past their deadlines

    def forget(other: Lock) -> Callable[[LockLost], object]:
        return lambda lost: keep_alives.remove(other._state)  # as its unlock() would

    with keep_alives._condition:  # the scheduler sees both at once, in this order
        first.keep_alive(on_lost=forget(second))
        second.keep_alive(on_lost=forget(first))
    time.sleep(3)  # past the renewed lock's own expiry: only renewals keep it
    assert renewed.is_valid()
    renewed.unlock()
    for lock in (first, second):
        assert not lock.is_valid()
        with contextlib.suppress(LockLost):
            lock.unlock()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["postgresql"])
def test_renewals_that_each_take_their_time_do_not_fall_behind(
    locker: Locker, table_name: str
) -> None:
    """A slow server that still answers (each renewal takes 0.3 s: a trigger sleeps): eight
    kept-alive locks of 3 s need 2.4 s of renewals a second, more than one worker can send, and
    none of them may be lost for want of a worker."""
    lost: list[LockLost] = []
    locks = [
        locker.lock(f"slow {n}", expires=3, keep_alive=True, on_lost=lost.append) for n in range(8)
    ]
    with locker.engine.begin() as conn:
        conn.exec_driver_sql(
            f"CREATE FUNCTION {table_name}_slow() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN PERFORM pg_sleep(0.3); RETURN NEW; END $$"
        )
        conn.exec_driver_sql(
            f"CREATE TRIGGER {table_name}_slow BEFORE UPDATE ON {table_name} "
            f"FOR EACH ROW EXECUTE FUNCTION {table_name}_slow()"
        )
    try:
        time.sleep(8)
        assert lost == []
        assert all(lock.is_valid() for lock in locks)
    finally:
        with locker.engine.begin() as conn:
            conn.exec_driver_sql(f"DROP TRIGGER {table_name}_slow ON {table_name}")
            conn.exec_driver_sql(f"DROP FUNCTION {table_name}_slow()")
        for lock in locks:
            with contextlib.suppress(LockLost):
                lock.unlock()


HELD_BY_A_THREAD_AS_THE_MAIN_ONE_RETURNS = """
import sys, threading, time
from sqllocker import Locker

locker = Locker(sys.argv[1], table=sys.argv[2], grace=0)
lost = []

def work():
    # A 2 s period gives each renewal over a second to land on a loaded machine.
    with locker.lock("job", expires=2, keep_alive=True, on_lost=lost.append) as lock:
        time.sleep(4.5)  # over two periods, after the main thread has returned
        print(f"valid {lock.is_valid()} lost {len(lost)}", flush=True)

threading.Thread(target=work).start()
"""


def test_a_thread_outliving_the_main_one_keeps_its_lock_renewed(
    url: str, table_name: str, locker: Locker
) -> None:
    """Once the main thread returns, the interpreter waits for the other threads, and
    ``concurrent.futures`` executors take no more work: the keep-alive's scheduler crashed
    submitting a renewal, and a thread's kept-alive lock expired, unrenewed, its on_lost never
    called (another process could take it over while the thread worked on)."""
    done = subprocess.run(
        [sys.executable, "-c", HELD_BY_A_THREAD_AS_THE_MAIN_ONE_RETURNS, url, table_name],
        capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    assert done.stdout.strip() == "valid True lost 0", done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert locker.lock_info("job") is None


@pytest.mark.parametrize("backend", ["sqlite"])  # the keep-alive's own threads
def test_an_on_lost_that_exits_leaves_the_other_locks_renewed(
    make_locker: Callable[..., Locker],
) -> None:
    """An on_lost that raises SystemExit ran on a renewal's worker thread and ended it; the
    dead worker, still counted idle, was handed every later renewal of every lock: a healthy
    kept-alive lock expired unrenewed."""
    locker, operator = make_locker(), make_locker()

    def exits(lost: LockLost) -> None:
        raise SystemExit(1)

    told: list[LockLost] = []
    first = locker.lock("A", expires=3, keep_alive=True, on_lost=exits)
    second = locker.lock("B", expires=3, keep_alive=True, on_lost=told.append)
    operator.break_lock("A")  # A's next renewal finds it gone, and its on_lost exits
    time.sleep(6)  # two periods: only renewals keep B
    assert not told
    assert second.is_valid()
    second.unlock()
    with contextlib.suppress(LockLost):
        first.unlock()


@pytest.mark.parametrize("backend", ["sqlite"])  # the keep-alive's own threads
def test_a_renewal_thread_that_cannot_start_is_tried_again(
    make_locker: Callable[..., Locker], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No thread to be had (a limit on processes) for a while: starting a renewal worker
    raised out of the scheduler, which died; the locks then expired unrenewed, their on_lost
    never called, while another process took them over."""
    import sqllocker.keepalive as keepalive

    locker = make_locker()
    told: list[LockLost] = []
    lock = locker.lock("job", expires=3, keep_alive=True, on_lost=told.append)
    refusing = {"until": time.monotonic() + 0.8}
    real_init = keepalive._Worker.__init__

    def no_thread(self: object, name: str) -> None:
        if time.monotonic() < refusing["until"]:
            raise RuntimeError("can't start new thread")
        real_init(self, name)  # type: ignore[arg-type]

    monkeypatch.setattr(keepalive._Worker, "__init__", no_thread)
    time.sleep(7)  # two periods and more: only renewals keep it
    assert not told
    assert lock.is_valid()
    lock.unlock()
