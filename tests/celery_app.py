"""The Celery app the Celery tests run real workers and beat processes of, configured from the
environment the test sets (``CELERY_TEST_*``): its own Redis key prefix and queue, so parallel
runs never see each other's messages, and its own lock table.

Every task body records its start and end as JSON lines in ``$CELERY_TEST_STATE/runs.jsonl`` and
holds an O_EXCL marker file per lockstring while it runs: a second copy that finds the marker of
a live process records an overlap (a marker left by a SIGKILLed worker is a crash's leftover).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from celery import Celery

from sqllocker import Locker
from sqllocker.celery import LockedTask, current_lock

PREFIX = os.environ.get("CELERY_TEST_PREFIX", "sqllocker-test:")
QUEUE = os.environ.get("CELERY_TEST_QUEUE", "sqllocker-test")
STATE = Path(os.environ.get("CELERY_TEST_STATE", "."))
BEAT_EVERY = float(os.environ.get("CELERY_TEST_BEAT_EVERY", "3"))
REDIS = os.environ.get("CELERY_TEST_REDIS", "redis://127.0.0.1:6379/0")
transport = {"global_keyprefix": PREFIX}

app = Celery("sqllocker_celery_test", broker=REDIS, backend=REDIS)
app.conf.update(
    broker_transport_options=transport,
    result_backend_transport_options=transport,
    task_default_queue=QUEUE,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    beat_schedule={"tick": {"task": "tests.celery_app.beat_tick", "schedule": BEAT_EVERY}},
)


def make_locker() -> Locker:
    return Locker(
        os.environ.get("CELERY_TEST_URL"), table=os.environ.get("CELERY_TEST_TABLE", "semaphores")
    )


def record(**fields: Any) -> None:
    line = json.dumps({"pid": os.getpid(), "at": time.time(), **fields}) + "\n"
    descriptor = os.open(STATE / "runs.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(descriptor, line.encode())
    finally:
        os.close(descriptor)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def critical(task: str, name: str, seconds: float, retries: int = 0) -> str:
    """The work: hold ``name``'s marker for ``seconds``."""
    marker = STATE / f"{name}.holder"
    try:
        descriptor = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        holder = int(marker.read_text() or 0)
        record(task=task, name=name, event="overlap" if _alive(holder) else "stale", of=holder)
        descriptor = os.open(marker, os.O_WRONLY | os.O_TRUNC)
    os.write(descriptor, str(os.getpid()).encode())
    os.close(descriptor)
    lock_id = current_lock().lock_id
    record(task=task, name=name, event="start", lock_id=lock_id, retries=retries)
    stop = STATE / f"{name}.stop"  # the test's signal to finish early
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not stop.exists():
        time.sleep(0.05)
    marker.unlink(missing_ok=True)
    record(task=task, name=name, event="end", lock_id=lock_id)
    return name


@app.task(base=LockedTask, locker=make_locker, lock="work {name}", on_busy="skip")
def work_skip(name: str, seconds: float) -> str:
    return critical("skip", name, seconds)


@app.task(
    bind=True,
    base=LockedTask,
    locker=make_locker,
    lock="work {name}",
    on_busy="retry",
    lock_retry_countdown=0.5,
    max_retries=None,
)
def work_retry(self: LockedTask, name: str, seconds: float) -> str:
    return critical("retry", name, seconds, self.request.retries)


@app.task(base=LockedTask, locker=make_locker, lock="work {name}", on_busy="raise")
def work_raise(name: str, seconds: float) -> str:
    return critical("raise", name, seconds)


@app.task(
    bind=True,
    base=LockedTask,
    locker=make_locker,
    lock="late {name}",
    on_busy="retry",
    lock_retry_countdown=0.5,
    max_retries=None,
    lock_expires=8,
    acks_late=True,
    reject_on_worker_lost=True,
)
def work_late(self: LockedTask, name: str, seconds: float) -> str:
    return critical("late", name, seconds, self.request.retries)


@app.task(base=LockedTask, locker=make_locker, lock="beat tick", lock_hold_at_least="schedule")
def beat_tick() -> str:
    return critical("tick", "tick", 0.2)
