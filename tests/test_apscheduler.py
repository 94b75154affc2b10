"""sqllocker.apscheduler with real APScheduler 3 BackgroundScheduler processes
(tests/apscheduler_worker.py): the same cron job every second in three schedulers runs once per
fire time, none missed while a scheduler lives, though one is SIGKILLed halfway and another is
stopped (SIGSTOP) for a while and catches up on the fire times it missed."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("apscheduler")

from sqllocker import Locker, LockError
from tests import forked_cli
from tests.helpers import stop_outside_a_write, wait_until

pytestmark = pytest.mark.slow  # real workers, schedulers or processes

ROOT = Path(__file__).resolve().parent.parent


def test_three_schedulers_run_a_cron_job_once_per_fire_time(
    url: str, table_name: str, tmp_path: Path, make_locker: Callable[..., Locker]
) -> None:
    make_locker()  # creates the table
    command = [url, table_name, str(tmp_path), "12"]  # 12 s
    # python -m tests.apscheduler_worker, each a process of its own forked from a server that
    # imported it once (``tests/forked_cli.py``).
    schedulers = [
        forked_cli.Popen(
            [*command, *(["catch-up"] if number == 1 else [])],
            program="apscheduler",
            cwd=ROOT,
            stderr=tmp_path / f"scheduler-{number}.log",
        )
        for number in range(3)
    ]
    try:
        for scheduler in schedulers:
            assert scheduler.stdout is not None
            assert scheduler.stdout.readline() == "ready\n"
        all_ready = datetime.now().astimezone()
        time.sleep(2)
        stop_outside_a_write(schedulers[1].pid, url)  # misses fire times, then catches up
        time.sleep(3.5)
        stopped_until = datetime.now().astimezone()
        os.kill(schedulers[1].pid, signal.SIGCONT)
        time.sleep(0.5)
        os.kill(schedulers[2].pid, signal.SIGKILL)
        for scheduler in schedulers[:2]:
            assert scheduler.wait(timeout=60) == 0
        first_end = datetime.now().astimezone()
    finally:
        for scheduler in schedulers:
            if scheduler.poll() is None:
                scheduler.kill()
                scheduler.wait()

    records = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert [r for r in records if r["event"] == "overlap"] == []
    runs = Counter(r["fire_time"] for r in records)
    assert [t for t, count in runs.items() if count > 1] == []  # once per fire time
    # Every second from the moment all three ran to the end of the first to stop has its run.
    fire_times = {datetime.fromisoformat(t) for t in runs}
    expected = {
        all_ready.replace(microsecond=0) + timedelta(seconds=s)
        for s in range(1, int((first_end - all_ready).total_seconds()) - 1)
    }
    assert sorted(expected - fire_times) == []
    assert len({r["pid"] for r in records}) >= 2  # the runs were shared among the schedulers
    # The stopped scheduler resumed and tried the fire times it had missed: each was skipped.
    caught_up = [
        datetime.fromisoformat(match)
        for match in re.findall(
            r"skipped job tick at (\S+):", (tmp_path / "scheduler-1.log").read_text()
        )
    ]
    assert len([t for t in caught_up if t < stopped_until - timedelta(seconds=1)]) >= 2


def docs_example(page: str) -> str:
    text = (ROOT / "docs" / page).read_text()
    return text.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"], indirect=True)
def test_the_docs_example_runs_once_per_fire_time_in_two_processes(
    url: str, table_name: str, tmp_path: Path, make_locker: Callable[..., Locker]
) -> None:
    make_locker()
    example = docs_example("apscheduler.md")
    assert '"postgresql://app@db/app"' in example
    example = example.replace('"postgresql://app@db/app"', f"{url!r}, table={table_name!r}")
    (tmp_path / "scheduler.py").write_text(example)
    outputs = [tmp_path / f"scheduler-{number}.out" for number in range(2)]
    schedulers = [
        subprocess.Popen(
            [sys.executable, "scheduler.py"],
            cwd=tmp_path,
            stdout=output.open("w"),
            stderr=subprocess.DEVNULL,
        )
        for output in outputs
    ]

    def lines() -> list[str]:
        return [line for output in outputs for line in output.read_text().splitlines()]

    try:
        wait_until(lambda: len(lines()) >= 4, timeout=60)
    finally:
        for scheduler in schedulers:
            scheduler.send_signal(signal.SIGINT)
            scheduler.wait(timeout=30)
    fire_times = Counter(line.split()[1] for line in lines())
    assert len(fire_times) >= 4
    assert set(fire_times.values()) == {1}


def test_expired_rows_of_past_fire_times_are_purged(
    make_locker: Callable[..., Locker],
) -> None:
    """Every fire time has a row of its own: the executor purges the expired ones once a window,
    so the table holds about a window's worth, not a row per fire time."""
    from apscheduler.schedulers.background import BackgroundScheduler

    from sqllocker.apscheduler import LockedThreadPoolExecutor

    locker = make_locker()
    runs: list[float] = []
    scheduler = BackgroundScheduler(
        executors={"default": LockedThreadPoolExecutor(locker, hold_at_least=1)}
    )
    start = datetime(2026, 1, 1, tzinfo=timezone.utc)  # the same in every scheduler
    scheduler.add_job(
        lambda: runs.append(time.monotonic()), "interval", seconds=0.25, start_date=start, id="t"
    )
    scheduler.start()
    try:
        wait_until(lambda: len(runs) >= 32, timeout=60)
    finally:
        scheduler.shutdown()
    rows = locker.locks("apscheduler t *")
    # a window (1 s + the job's misfire_grace_time, 1 s) and a purge interval (1 s) of rows
    assert len(rows) <= 3 / 0.25 + 2 < len(runs)


@pytest.mark.parametrize("backend", ["sqlite"])  # the check is before any SQL
@pytest.mark.parametrize("anchor", ["interval", "jitter", "date"])
def test_a_fire_time_not_every_scheduler_computes_is_refused(
    make_locker: Callable[..., Locker], anchor: str
) -> None:
    """An interval trigger anchored at the moment it was added (its default start_date), a date
    trigger's default run_date (now) and jitter give each scheduler fire times of its own, so
    each would take a lock of its own and run the job: the run fails instead, loudly."""
    from apscheduler.events import EVENT_JOB_ERROR, EVENT_JOB_EXECUTED
    from apscheduler.schedulers.background import BackgroundScheduler

    from sqllocker import LockValueError
    from sqllocker.apscheduler import LockedThreadPoolExecutor

    ran: list[float] = []
    outcomes: list[Any] = []
    scheduler = BackgroundScheduler(executors={"default": LockedThreadPoolExecutor(make_locker())})
    scheduler.add_listener(outcomes.append, EVENT_JOB_ERROR | EVENT_JOB_EXECUTED)
    # As a scheduler's own clock draws them: not whole milliseconds (1 in 1,000 would be).
    own = datetime.now(timezone.utc).replace(microsecond=123456) + timedelta(seconds=1)
    if anchor == "interval":
        scheduler.add_job(ran.append, "interval", seconds=1, start_date=own, args=[1], id="j")
    elif anchor == "jitter":
        scheduler.add_job(ran.append, "interval", seconds=1, jitter=0.5, args=[1], id="j")
    else:
        scheduler.add_job(ran.append, "date", run_date=own, args=[1], id="j")
    # Jitter draws anew each time, a whole millisecond 1 time in 1,000: one of three may run.
    runs, may_run = (3, 1) if anchor == "jitter" else (1, 0)
    scheduler.start()
    try:
        wait_until(lambda: len(outcomes) >= runs, timeout=30)
    finally:
        scheduler.shutdown()
    refused = [o for o in outcomes if isinstance(o.exception, LockValueError)]
    assert len(refused) >= len(outcomes) - may_run, outcomes
    assert len(ran) <= may_run


def test_bad_options_are_refused(make_locker: Callable[..., Locker]) -> None:
    from sqllocker import LockValueError
    from sqllocker.apscheduler import LockedThreadPoolExecutor, scheduled_run_time

    with pytest.raises(LockValueError):
        LockedThreadPoolExecutor("sqlite:///x.db")  # type: ignore[arg-type]
    for bad in (0, -1, True, "60"):
        with pytest.raises(LockValueError):
            LockedThreadPoolExecutor(make_locker(), hold_at_least=bad)  # type: ignore[arg-type]
    with pytest.raises(LockError):
        scheduled_run_time()
