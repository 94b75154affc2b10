"""APScheduler 3.x jobs that run once per fire time across several scheduler processes.

``pip install 'sqllocker[apscheduler]'``, then give the scheduler an executor that takes a lock
named by the job's id and its scheduled fire time before each run::

    from sqllocker.apscheduler import LockedThreadPoolExecutor

    scheduler = BackgroundScheduler(executors={"default": LockedThreadPoolExecutor(locker)})
    scheduler.add_job(sync, "cron", minute="*", id="sync")

Each scheduler process computes the same fire times for the job; the first to take the lock
``apscheduler <job id> <fire time in UTC>`` runs it, and the others skip that fire time (logged at
INFO). The lock is kept for at least ``hold_at_least`` seconds plus the job's
``misfire_grace_time``, so that a scheduler whose clock runs late, or that catches up on a
misfired or coalesced run, still finds it held. A job needs an id of its own that every
scheduler gives it (``add_job(..., id="sync")``), or the schedulers would not agree on a name.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime, timezone
from typing import Any

from apscheduler.executors.base import run_job
from apscheduler.executors.pool import ThreadPoolExecutor

from .errors import LockBusy, LockError, LockValueError
from .lock import Lock
from .locker import Locker

logger = logging.getLogger("sqllocker.apscheduler")

# How long, beyond a job's misfire_grace_time, another scheduler may still fire the same time:
# the skew between the schedulers' clocks, and how late a busy scheduler starts a run.
DEFAULT_HOLD_AT_LEAST = 60.0

_current: ContextVar[tuple[Lock, datetime] | None] = ContextVar(
    "sqllocker_apscheduler_run", default=None
)


def current_lock() -> Lock:
    """The lock the running job holds (for its fencing token, ``lock_id``)."""
    return _running()[0]


def scheduled_run_time() -> datetime:
    """The fire time the running job was scheduled for (timezone-aware, UTC)."""
    return _running()[1]


def _running() -> tuple[Lock, datetime]:
    running = _current.get()
    if running is None:
        raise LockError("this is for the body of a job run by a LockedThreadPoolExecutor")
    return running


def lockstring_for(job_id: str, run_time: datetime) -> str:
    """The lock of one fire time of a job: the same in every scheduler process."""
    return f"apscheduler {job_id} {run_time.astimezone(timezone.utc).isoformat()}"


class LockedThreadPoolExecutor(ThreadPoolExecutor):  # type: ignore[misc]
    """APScheduler's thread pool executor, running each fire time of a job under its own lock:
    once across all the scheduler processes that share ``locker``'s table.

    ``hold_at_least``: seconds (beyond the job's ``misfire_grace_time``) for which the lock of a
    fire time is kept after its run started, however quickly the run ends: longer than the skew
    between the schedulers' clocks and the delay of a busy scheduler. ``max_workers`` and
    ``pool_kwargs`` are ``ThreadPoolExecutor``'s.

    Once every ``hold_at_least`` seconds, a run's thread also purges the table's expired rows
    (``purge_expired_locks``), since each fire time leaves a row of its own.
    """

    def __init__(
        self,
        locker: Locker,
        *,
        hold_at_least: float = DEFAULT_HOLD_AT_LEAST,
        max_workers: int = 10,
        pool_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(locker, Locker):
            raise LockValueError(
                f"LockedThreadPoolExecutor needs a Locker, not {type(locker).__name__}"
            )
        if isinstance(hold_at_least, bool) or not isinstance(hold_at_least, int | float):
            raise LockValueError("hold_at_least must be a number of seconds")
        if not hold_at_least > 0:
            raise LockValueError(f"hold_at_least must be positive, not {hold_at_least!r}")
        super().__init__(max_workers, pool_kwargs)
        self.locker = locker
        self.hold_at_least = float(hold_at_least)
        self._purging = threading.Lock()
        self._purged_at = -math.inf

    def _do_submit_job(self, job: Any, run_times: list[datetime]) -> None:
        def callback(future: Any) -> None:
            error = future.exception()
            if error is not None:
                self._run_job_error(job.id, error, error.__traceback__)
            else:
                self._run_job_success(job.id, future.result())

        future = self._pool.submit(
            self._run_each, job, job._jobstore_alias, run_times, self._logger.name
        )
        future.add_done_callback(callback)

    def _run_each(
        self, job: Any, jobstore_alias: str, run_times: list[datetime], logger_name: str
    ) -> list[Any]:
        """APScheduler's own ``run_job`` (misfire check, events, logging) once per fire time,
        on the job with its function under that fire time's lock."""
        events: list[Any] = []
        for run_time in run_times:
            locked = _LockedRun(job, self._under_lock(job, run_time))
            events.extend(run_job(locked, jobstore_alias, [run_time], logger_name))
        return events

    def _under_lock(self, job: Any, run_time: datetime) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            _check_shared(job, run_time)
            lockstring = lockstring_for(job.id, run_time)
            window = self.hold_at_least + (job.misfire_grace_time or 0)
            try:
                lock = self.locker.lock(
                    lockstring,
                    keep_alive=True,
                    hold_at_least=window,
                    locked_by={"apscheduler_job": job.id},
                )
            except LockBusy as busy:
                logger.info("skipped job %s at %s: %s", job.id, run_time.isoformat(), busy)
                return None
            with lock, _running_as(lock, run_time):
                result = job.func(*args, **kwargs)
            self._purge_now_and_then()
            return result

        return run

    def _purge_now_and_then(self) -> None:
        """Purge the table's expired rows, once a window: each fire time has a row of its own,
        which no later fire time takes over, so without a purge the table would grow by a row
        per fire time."""
        with self._purging:
            now = time.monotonic()
            if now - self._purged_at < self.hold_at_least:
                return
            self._purged_at = now
        try:
            self.locker.purge_expired_locks()
        except LockError as error:
            logger.warning("could not purge the expired locks: %s", error)


def _check_shared(job: Any, run_time: datetime) -> None:
    """Refuse a fire time that is not the same in every scheduler: one that is not a whole
    millisecond was drawn from a scheduler's own clock (an interval trigger anchored at the
    moment it was added, a date trigger's default of now) or at random (``jitter``), and each
    scheduler would take a lock of its own and run it."""
    if run_time.microsecond % 1000:
        raise LockValueError(
            f"job {job.id!r}: its fire time {run_time.isoformat()} is not one every scheduler "
            "computes (an interval trigger without start_date, a date trigger without "
            "run_date, or jitter), so each would run it; give the trigger a start_date or "
            "run_date of whole seconds, or use a cron trigger, and no jitter"
        )


class _LockedRun:
    """A job as ``run_job`` sees it, with its function under one fire time's lock."""

    def __init__(self, job: Any, func: Callable[..., Any]) -> None:
        self._job = job
        self.func = func

    def __getattr__(self, name: str) -> Any:
        return getattr(self._job, name)

    def __str__(self) -> str:
        return str(self._job)


@contextmanager
def _running_as(lock: Lock, run_time: datetime) -> Iterator[None]:
    token = _current.set((lock, run_time))
    try:
        yield
    finally:
        _current.reset(token)
