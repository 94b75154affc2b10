"""A scheduler process for tests/test_apscheduler.py:
``python -m tests.apscheduler_worker URL TABLE STATE SECONDS [catch-up]``.

A BackgroundScheduler with sqllocker's executor runs the job ``tick`` every second for SECONDS;
each run records its fire time and this pid as a JSON line in STATE/runs.jsonl, and holds an
O_EXCL marker file while it runs (a second holder of one fire time records an overlap). With
``catch-up`` the job neither coalesces nor drops missed fire times (``misfire_grace_time``
30 s): a scheduler stopped for a while runs each of them when it resumes. The executor's skips
are logged to stderr."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

from apscheduler.schedulers.background import BackgroundScheduler

from sqllocker import Locker
from sqllocker.apscheduler import LockedThreadPoolExecutor, current_lock, scheduled_run_time


def main() -> int:
    url, table, state, seconds = sys.argv[1], sys.argv[2], Path(sys.argv[3]), float(sys.argv[4])
    catch_up = sys.argv[5:] == ["catch-up"]
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    logging.getLogger("sqllocker.apscheduler").setLevel(logging.INFO)
    locker = Locker(url, table=table)

    def tick() -> None:
        fire_time = scheduled_run_time().isoformat()
        marker = state / f"{fire_time}.holder"
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            event = "run"
        except FileExistsError:
            event = "overlap"
        line = {
            "fire_time": fire_time,
            "pid": os.getpid(),
            "event": event,
            "lock_id": current_lock().lock_id,
            "at": time.time(),
        }
        descriptor = os.open(state / "runs.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.write(descriptor, (json.dumps(line) + "\n").encode())
        os.close(descriptor)
        time.sleep(0.3)

    scheduler = BackgroundScheduler(
        executors={"default": LockedThreadPoolExecutor(locker, hold_at_least=10)}
    )
    options = {"coalesce": False, "misfire_grace_time": 30, "max_instances": 5} if catch_up else {}
    scheduler.add_job(tick, "cron", second="*", id="tick", **options)
    scheduler.start()
    print("ready", flush=True)
    time.sleep(seconds)
    scheduler.shutdown()
    locker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
