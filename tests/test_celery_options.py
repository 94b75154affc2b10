"""sqllocker.celery without workers: options checked when a task is made, the skipped record,
the beat window, and a task called directly (in the caller's process) under its lock."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta, timezone

import pytest

pytest.importorskip("celery")

from celery import Celery
from celery.schedules import crontab

from sqllocker import LockBusy, Locker, LockError, LockValueError
from sqllocker.celery import (
    LockedTask,
    current_lock,
    is_skipped,
    schedule_window,
)


@pytest.fixture
def app() -> Celery:
    return Celery("options", broker="memory://", backend="cache+memory://", set_as_current=False)


@pytest.mark.parametrize(
    "options",
    [
        {"on_busy": "wait"},
        {"lock_hold_at_least": "daily"},
        {"lock": "report {month}"},  # the task takes no argument 'month'
    ],
)
def test_bad_options_are_refused_when_the_task_is_made(
    app: Celery, options: dict[str, object]
) -> None:
    with pytest.raises(LockValueError):

        @app.task(base=LockedTask, shared=False, lazy=False, **options)
        def report(day: str) -> str:
            return day


def test_a_task_called_directly_runs_under_its_lock(
    app: Celery, make_locker: Callable[..., Locker]
) -> None:
    locker = make_locker()
    ids: list[int] = []

    @app.task(base=LockedTask, locker=locker, lock="report {day}", shared=False, lazy=False)
    def report(day: str) -> str:
        ids.append(current_lock().lock_id)
        return day

    @app.task(
        base=LockedTask,
        locker=locker,
        lock="report {day}",
        on_busy="retry",
        lazy=False,
        shared=False,
    )
    def report_or_retry(day: str) -> str:
        return day

    assert report("2026-11-25") == "2026-11-25"
    assert len(ids) == 1
    assert locker.lock_info("report 2026-11-25") is None  # released
    with locker.lock("report 2026-11-26"):
        assert is_skipped(report("2026-11-26"))
        with pytest.raises(LockBusy):  # retry needs a worker: called directly, it raises
            report_or_retry("2026-11-26")
    with pytest.raises(LockError):
        current_lock()


def test_the_beat_window_is_three_quarters_of_the_period_less_the_grace() -> None:
    now = datetime.now(timezone.utc)  # a run just sent
    every = {"a": {"task": "t", "schedule": 600}}
    assert schedule_window(every, "t", now, 1.0) == pytest.approx(449.0, abs=0.1)
    delta = {"a": {"task": "t", "schedule": timedelta(minutes=10)}}
    assert schedule_window(delta, "t", now, 1.0) == pytest.approx(449.0, abs=0.1)
    with pytest.raises(LockValueError):  # too short for the grace
        schedule_window({"a": {"task": "t", "schedule": 1}}, "t", now, 1.0)
    with pytest.raises(LockValueError):  # two entries: which period?
        schedule_window({**every, "b": {"task": "t", "schedule": 60}}, "t", now, 1.0)
    with pytest.raises(LockValueError):
        schedule_window(every, "other", now, 1.0)
    hourly = crontab(minute=0)
    window = schedule_window({"a": {"task": "t", "schedule": hourly}}, "t", hourly.now(), 0)
    assert 0 < window <= 0.75 * 3600
