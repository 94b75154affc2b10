"""Celery tasks that run at most one copy per lockstring across all workers.

``pip install 'sqllocker[celery]'``, then::

    from sqllocker.celery import LockedTask

    @app.task(base=LockedTask, locker=locker, lock="report {day}", on_busy="skip")
    def make_report(day: str) -> None: ...

Celery makes each decorated task a subclass of ``base`` with the decorator's keyword arguments
as class attributes, so every option below is such an argument (or an attribute of a subclass of
``LockedTask``). The lock is taken before the task's body runs, kept alive while it runs, and
released when it returns or raises; a lock lost meanwhile is the task's failure (``LockLost``).

- ``locker``: the ``Locker`` (or a function of no arguments returning one, called once per
  process on first use). Required.
- ``lock``: a ``str.format`` template over the task's arguments, named as ``locker.locked``
  names its locks (default: the task's name, one copy of the task at a time whatever its
  arguments).
- ``on_busy``: ``"skip"`` (the task succeeds without running, its result a ``skipped()`` record,
  logged at INFO), ``"retry"`` (Celery's own ``retry``, after ``lock_retry_countdown`` seconds,
  else the task's ``default_retry_delay``, up to its ``max_retries``; then ``LockBusy``) or
  ``"raise"`` (the task fails with ``LockBusy``).
- ``lock_wait``, ``lock_expires``: ``lock()``'s ``wait`` and ``expires``.
- ``lock_hold_at_least``: ``lock()``'s ``hold_at_least`` in seconds, or ``"schedule"``: three
  quarters of the period of the task's entry in ``beat_schedule`` (see ``schedule_window``).
"""

from __future__ import annotations

import copy
import inspect
import logging
import math
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime, timedelta
from typing import Any

from celery import Task
from celery.exceptions import Ignore
from celery.schedules import BaseSchedule
from celery.schedules import schedule as celery_schedule

from .decorators import LockstringTemplate
from .errors import LockBusy, LockError, LockValueError
from .lock import Lock
from .locker import Locker
from .validation import check_hold_at_least, check_seconds, check_wait

logger = logging.getLogger("sqllocker.celery")

ON_BUSY = ("skip", "retry", "raise")
SCHEDULE = "schedule"

_current: ContextVar[Lock | None] = ContextVar("sqllocker_celery_lock", default=None)


def skipped(lockstring: str, busy: LockBusy) -> dict[str, Any]:
    """The result of a task skipped because its lock was held: JSON, so any result backend
    keeps it."""
    return {"sqllocker": "skipped", "lockstring": lockstring, "holder": busy.holder}


def is_skipped(result: object) -> bool:
    """Whether a task's result says it was skipped because its lock was held."""
    return isinstance(result, Mapping) and result.get("sqllocker") == "skipped"


def current_lock() -> Lock:
    """The lock the running ``LockedTask`` holds (for its fencing token, ``lock_id``)."""
    lock = _current.get()
    if lock is None:
        raise LockError("current_lock() is for the body of a LockedTask while it runs")
    return lock


class LockedTask(Task[Any, Any]):
    """A Celery task that runs under a lock: see the module's documentation."""

    locker: Locker | Callable[[], Locker] | None = None
    lock: str | None = None
    on_busy: str = "skip"
    lock_wait: float | None = 0
    lock_expires: float | None = None
    lock_hold_at_least: float | str | None = None
    lock_retry_countdown: float | None = None

    _sqllocker_setup = threading.Lock()
    _sqllocker_template: LockstringTemplate | None = None
    _sqllocker_locker: Locker | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Celery makes each task a subclass, with the decorator's options: they are checked
        here, when the task is made, before any SQL."""
        super().__init_subclass__(**kwargs)
        if cls.on_busy not in ON_BUSY:
            raise LockValueError(f"on_busy must be 'skip', 'retry' or 'raise', not {cls.on_busy!r}")
        hold = cls.lock_hold_at_least
        if isinstance(hold, str) and hold != SCHEDULE:
            raise LockValueError(f"lock_hold_at_least must be seconds or 'schedule', not {hold!r}")
        if not isinstance(hold, str):
            check_hold_at_least(hold)
        check_wait(cls.lock_wait)
        if hold is not None and (cls.on_busy == "retry" or cls.lock_wait != 0):
            raise LockValueError(
                "lock_hold_at_least keeps a run's lock for a window so that other copies of the "
                "task in it are skipped; with on_busy='retry' or a lock_wait, a copy waits for "
                "the window to end and runs, so every copy runs: use on_busy='skip' (or "
                "'raise') and lock_wait=0 with it"
            )
        if cls.lock_expires is not None:
            check_seconds(cls.lock_expires, "lock_expires")
        countdown = cls.lock_retry_countdown
        if countdown is not None and (
            isinstance(countdown, bool)
            or not isinstance(countdown, int | float)
            or not 0 <= countdown < math.inf
        ):
            raise LockValueError(
                f"lock_retry_countdown must be None or seconds >= 0, not {countdown!r}"
            )
        run = cls.__dict__.get("run")
        if cls.lock is not None and run is not None:
            LockstringTemplate(cls.lock, getattr(run, "__func__", run))  # names its arguments

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        lockstring = self._lockstring(args, kwargs)
        locker = self._locker()
        try:
            lock = locker.lock(
                lockstring,
                wait=self.lock_wait,
                expires=self.lock_expires,
                keep_alive=True,
                hold_at_least=self._hold_at_least(locker),
                locked_by={"celery_task": self.name, "celery_id": self.request.id},
            )
        except LockBusy as busy:
            return self._when_busy(lockstring, busy)
        with lock, _holding(lock):
            try:
                return super().__call__(*args, **kwargs)
            except Ignore:
                raise  # control flow after the work (replace() ends so): the window stands
            except BaseException:
                # A run that failed, asks to be retried, or was rejected did not do its work:
                # its window would keep its own retry (and every copy) from doing it.
                lock._state.hold_at_least = None
                raise

    def _when_busy(self, lockstring: str, busy: LockBusy) -> Any:
        behaviour = self.on_busy
        # Called directly, or run eagerly (where retry() runs the task again at once, and again,
        # until the recursion gives out): no worker to retry it later.
        in_place = self.request.called_directly or self.request.is_eager
        if behaviour == "raise" or (behaviour == "retry" and in_place):
            raise busy
        if behaviour == "retry":
            raise self.retry(exc=busy, countdown=self.lock_retry_countdown)
        logger.info("skipped %s[%s]: %s", self.name, self.request.id, busy)
        return skipped(lockstring, busy)

    def _lockstring(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        # Each task's own, never a base class's: a task may be made on another task's class.
        template: LockstringTemplate | None = type(self).__dict__.get("_sqllocker_template")
        if template is None:
            template = LockstringTemplate(self.lock or self.name, self.run)
            type(self)._sqllocker_template = template
        return template.render(args, kwargs)

    def _locker(self) -> Locker:
        made: Locker | None = type(self).__dict__.get("_sqllocker_locker")
        if made is not None:
            return made
        with LockedTask._sqllocker_setup:
            made = type(self).__dict__.get("_sqllocker_locker")
            if made is None:
                # The decorator's function is a class attribute: read it unbound.
                given = inspect.getattr_static(self, "locker")
                if isinstance(given, staticmethod):
                    given = given.__func__
                if given is None:
                    raise LockValueError(
                        f"{self.name}: a LockedTask needs a locker: "
                        "@app.task(base=LockedTask, locker=Locker(...), ...)"
                    )
                made = given if isinstance(given, Locker) else given()
                if not isinstance(made, Locker):
                    raise LockValueError(
                        f"{self.name}: locker must be a Locker or a function returning one"
                    )
                type(self)._sqllocker_locker = made
            return made

    def _hold_at_least(self, locker: Locker) -> float | None:
        hold = self.lock_hold_at_least
        if isinstance(hold, str):  # 'schedule', as __init_subclass__ checked
            beat_schedule = self.app.conf.beat_schedule or {}
            return schedule_window(beat_schedule, self.name, self.app.now(), locker.grace)
        return hold


# How far a worker's clock may be behind the beat's for a run to count as the fire time it is
# a moment before (see schedule_window).
CLOCK_SKEW = timedelta(seconds=5)


def schedule_window(
    beat_schedule: Mapping[str, Any], task_name: str, now: Any, grace: float
) -> float:
    """Three quarters of the time from ``now`` to the next run of ``task_name``'s one entry in
    ``beat_schedule`` (for a run that has just been sent), less the locker's ``grace``.

    Each run keeps the lock for that window, and nobody takes it over for a further ``grace``:
    so runs are more than three quarters of a period apart and, since each beat process sends
    one copy a period, at most a period apart. Once per period, then, whatever the phase between
    two beat processes (an interval schedule counts from when its beat process started); the
    quarter left over is the room for a run that started late."""
    entries = [entry for entry in beat_schedule.values() if entry.get("task") == task_name]
    if len(entries) != 1:
        raise LockValueError(
            f"{task_name}: lock_hold_at_least='schedule' needs exactly one beat_schedule entry "
            f"for the task, and it has {len(entries)}: give the window in seconds"
        )
    given = entries[0]["schedule"]
    if isinstance(given, int | float):
        given = timedelta(seconds=given)
    schedule = given if isinstance(given, BaseSchedule) else celery_schedule(run_every=given)
    left = _gap_after(schedule, now)
    following = _gap_after(schedule, now + left)
    if left < min(CLOCK_SKEW, following / 4):
        # This worker's clock is behind the beat's that sent the run (a crontab's next fire
        # time, counted from this clock, is that run's own, a moment away): the next run is
        # the one after it.
        left += following
    period = left.total_seconds()
    window = period * 0.75 - grace
    if window <= 0:
        raise LockValueError(
            f"{task_name}: its beat schedule's period ({period:g} s) is too short for a window "
            f"that outlasts the locker's grace ({grace:g} s): give the window in seconds"
        )
    return window


def _gap_after(schedule: BaseSchedule, at: datetime) -> timedelta:
    """The time from ``at`` (a run of ``schedule``, or now) to its next run, as the schedule
    reckons it at that moment (a copy of it, whose clock says ``at``)."""
    probe = copy.copy(schedule)
    probe.nowfun = lambda: at  # type: ignore[attr-defined]  # every schedule has it
    gap: timedelta = probe.remaining_estimate(at)
    return gap


@contextmanager
def _holding(lock: Lock) -> Iterator[None]:
    token = _current.set(lock)
    try:
        yield
    finally:
        _current.reset(token)
