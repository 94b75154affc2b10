"""Worker processes for the multi-process tests: ``python -m tests.workers counter ...``.

Each worker takes random lockstrings from a shared set, and under each lock does a
read-sleep-write of a per-lockstring counter file. It also creates a marker file with O_EXCL on
entry and removes it on exit, so a second holder is caught the instant it enters, and logs every
acquisition (lockstring, lock id, monotonic entry and exit times) as a JSON line for the checker.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

from sqllocker import Locker, LockLost


def counter(args: argparse.Namespace) -> int:
    locker = Locker(args.url, table=args.table, grace=args.grace)
    state = Path(args.state)
    lockstrings = args.lockstrings.split(",")
    overlaps = 0
    lost = 0
    with open(state / f"log-{os.getpid()}.jsonl", "w") as log:
        for _ in range(args.count):
            lockstring = random.choice(lockstrings)
            lock = locker.lock(lockstring, wait=None, expires=args.expires)
            try:
                entered = time.monotonic()
                marker = state / f"{lockstring}.holder"
                try:
                    os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                except FileExistsError:
                    overlaps += 1
                counter_file = state / f"{lockstring}.count"
                try:
                    value = int(counter_file.read_text()) if counter_file.exists() else 0
                except ValueError:  # torn read: another holder is writing it right now
                    overlaps += 1
                    value = 0
                time.sleep(args.hold)
                counter_file.write_text(str(value + 1))
                marker.unlink(missing_ok=True)
                left = time.monotonic()
            finally:
                try:
                    lock.unlock()
                except LockLost:
                    lost += 1
            record = {"ls": lockstring, "id": lock.lock_id, "in": entered, "out": left}
            log.write(json.dumps(record) + "\n")
    print(json.dumps({"pid": os.getpid(), "overlaps": overlaps, "lost": lost}))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.workers")
    commands = parser.add_subparsers(dest="command", required=True)
    work = commands.add_parser("counter", help="read-sleep-write a shared counter under locks")
    work.add_argument("--url", required=True)
    work.add_argument("--table", required=True)
    work.add_argument("--state", required=True, help="directory shared by the workers")
    work.add_argument("--lockstrings", required=True, help="comma-separated")
    work.add_argument("--count", type=int, default=200)
    work.add_argument("--hold", type=float, default=0.001)
    work.add_argument("--expires", type=float, default=60)
    work.add_argument("--grace", type=float, default=1.0)
    args = parser.parse_args(argv)
    return counter(args)


if __name__ == "__main__":
    sys.exit(main())
