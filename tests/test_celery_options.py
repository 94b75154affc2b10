"""sqllocker.celery without workers: options checked when a task is made, the skipped record,
the beat window, and a task called directly (in the caller's process) under its lock."""

from __future__ import annotations

import itertools
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
        {"lock_wait": -1},
        {"lock_expires": 0},
        {"lock_hold_at_least": -5},
        {"lock_retry_countdown": "soon"},
        # A copy that waits out another copy's window runs after it: every copy would run.
        {"lock_hold_at_least": "schedule", "on_busy": "retry"},
        {"lock_hold_at_least": 540, "on_busy": "retry"},
        {"lock_hold_at_least": "schedule", "lock_wait": 30},
        {"lock_hold_at_least": 540, "lock_wait": None},
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
    # An hourly run sent at 12:00 (the clock's own now is no run's: in an hour's last five
    # seconds it counts as a worker behind the beat's next run).
    sent = datetime(2026, 11, 30, 12, 0, 0, 500000, tzinfo=timezone.utc)
    hourly = crontab(minute=0, nowfun=lambda: sent)
    window = schedule_window({"a": {"task": "t", "schedule": hourly}}, "t", sent, 0)
    assert window == pytest.approx(0.75 * 3599.5, abs=0.1)


@pytest.mark.parametrize(
    ("entry", "run_at", "next_run"),
    [
        (crontab(minute=0, hour="8-17"), "16:00", "17:00"),  # then 08:00 the next day
        (crontab(minute="0,50"), "12:50", "13:00"),
        (crontab(minute=0, hour="9,11"), "09:00", "11:00"),
    ],
)
@pytest.mark.parametrize("ahead", [0.5, -0.5])
def test_the_beat_window_ends_before_the_next_run_of_an_uneven_crontab(
    entry: crontab, run_at: str, next_run: str, ahead: float
) -> None:
    """A crontab whose gaps differ: the window is three quarters of the gap to the next run,
    whatever the one after it, with the worker's clock a moment ahead of the beat's or
    behind (the gap after the next run was taken for this one's: the next run skipped)."""
    day = "2026-11-30T"
    now = datetime.fromisoformat(day + run_at).replace(tzinfo=timezone.utc)
    now += timedelta(seconds=ahead)
    gap = datetime.fromisoformat(day + next_run).replace(tzinfo=timezone.utc) - now
    moving = iter(now + timedelta(microseconds=n) for n in itertools.count())
    schedule = crontab(
        minute=entry._orig_minute, hour=entry._orig_hour, nowfun=lambda: next(moving)
    )
    window = schedule_window({"a": {"task": "t", "schedule": schedule}}, "t", now, 1.0)
    assert window == pytest.approx(0.75 * gap.total_seconds() - 1.0, abs=1.0)


@pytest.mark.parametrize("behind", [0.01, 0.2, 2.0, -0.2])
def test_the_beat_window_of_a_worker_whose_clock_is_off_the_beats(behind: float) -> None:
    """A crontab run every minute, sent at the minute by the beat; the worker's clock ``behind``
    seconds behind it (or ahead). Counted from the worker's clock, the next fire time was the
    run's own, a moment away: the window came out too short to be given (or a fraction of a
    second, letting a second beat's copy run again), not three quarters of the minute."""
    fire = datetime(2026, 11, 30, 12, 0, tzinfo=timezone.utc)
    now = fire - timedelta(seconds=behind)
    # A clock that moves on as it is read, as a live one does.
    moving = iter(now + timedelta(microseconds=n) for n in itertools.count())
    every_minute = crontab(minute="*", nowfun=lambda: next(moving))
    window = schedule_window({"a": {"task": "t", "schedule": every_minute}}, "t", now, 1.0)
    assert window == pytest.approx(0.75 * 60 - 1.0, abs=0.75 * abs(behind) + 0.01)


def test_a_failed_run_keeps_no_window_from_its_retry(
    app: Celery, make_locker: Callable[..., Locker]
) -> None:
    """A run that raised (a retry's Retry, or an error) did not do its work: its lock keeps no
    ``lock_hold_at_least`` window, which would have its own retry (the same task id) skipped,
    and reported a success."""
    locker = make_locker()
    calls: list[str] = []

    @app.task(
        base=LockedTask,
        locker=locker,
        lock="report {day}",
        lock_hold_at_least=3600,
        shared=False,
        lazy=False,
    )
    def report(day: str) -> str:
        calls.append(day)
        if len(calls) == 1:
            raise RuntimeError("the report's database is down")
        return day

    with pytest.raises(RuntimeError):
        report("2026-11-25")
    assert locker.lock_info("report 2026-11-25") is None
    assert report("2026-11-25") == "2026-11-25"
    assert calls == ["2026-11-25", "2026-11-25"]
    assert locker.lock_info("report 2026-11-25") is not None  # held for its window now


def test_an_eager_task_that_would_retry_raises_instead(
    app: Celery, make_locker: Callable[..., Locker]
) -> None:
    """Run eagerly, retry() runs the task again at once, and again: busy, it raises LockBusy
    (as called directly), not a RecursionError."""
    locker = make_locker()

    @app.task(
        base=LockedTask,
        locker=locker,
        lock="job",
        on_busy="retry",
        max_retries=None,  # for ever, as a worker would
        shared=False,
        lazy=False,
    )
    def job() -> str:
        return "ran"

    app.conf.task_always_eager = True
    app.conf.task_eager_propagates = True
    with locker.lock("job"), pytest.raises(LockBusy):
        job.delay()


def test_a_run_that_ends_in_ignore_keeps_its_window(
    app: Celery, make_locker: Callable[..., Locker]
) -> None:
    """``Ignore`` is Celery's control flow after the work is done (``self.replace()`` ends with
    it): the window stands, and another copy of the period is skipped."""
    from celery.exceptions import Ignore

    locker = make_locker()

    @app.task(
        base=LockedTask,
        locker=locker,
        lock="report {day}",
        lock_hold_at_least=3600,
        shared=False,
        lazy=False,
    )
    def report(day: str) -> str:
        raise Ignore

    with pytest.raises(Ignore):
        report("2026-11-25")
    assert locker.lock_info("report 2026-11-25") is not None
