"""Worker processes for the read-write lock tests: ``python -m tests.rw_workers ...``.

Each worker takes the read or the write side of one read-write lock again and again until
``--seconds`` have passed (with ``--asyncio``, through an AsyncLocker). A writer creates the
marker file ``writer`` with O_EXCL on entry (a second writer is caught the instant it enters)
and finds the shared reader count at 0; a reader adds itself to that count (under an flock, so
the count is exact) and finds no writer marker. Every entry appends one line to the shared
``log`` (kind and fencing token, in the order the holds began) for the token-order check;
``violations`` collects what went wrong.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import json
import os
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqllocker import Locker
from sqllocker.asyncio import AsyncLocker
from tests.workers import async_url


class Section:
    def __init__(self, state: Path) -> None:
        self.state = state
        self.readers = state / "readers"
        self.writer = state / "writer"

    @contextmanager
    def _counted(self) -> Iterator[None]:
        with open(self.state / "count.lock", "a") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)
            yield

    def _violation(self, text: str) -> None:
        with open(self.state / "violations", "a") as out:
            out.write(text + "\n")

    def _log(self, kind: str, lock_id: int) -> None:
        line = json.dumps({"kind": kind, "id": lock_id, "pid": os.getpid()}) + "\n"
        descriptor = os.open(self.state / "log", os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            os.write(descriptor, line.encode())
        finally:
            os.close(descriptor)

    def enter_reader(self, lock_id: int) -> None:
        with self._counted():
            now = (int(self.readers.read_text()) if self.readers.exists() else 0) + 1
            self.readers.write_text(str(now))
            most = self.state / "most_readers"
            if now > (int(most.read_text()) if most.exists() else 0):
                most.write_text(str(now))
            if self.writer.exists():
                self._violation(f"reader {lock_id} entered while a writer held")
            self._log("reader", lock_id)

    def leave_reader(self) -> None:
        with self._counted():
            self.readers.write_text(str(int(self.readers.read_text()) - 1))

    def enter_writer(self, lock_id: int) -> None:
        try:
            os.close(os.open(self.writer, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            self._violation(f"writer {lock_id} entered while another writer held")
            return
        with self._counted():
            if self.readers.exists() and int(self.readers.read_text()) != 0:
                self._violation(f"writer {lock_id} entered while readers held")
            self._log("writer", lock_id)

    def leave_writer(self) -> None:
        self.writer.unlink(missing_ok=True)


def _hold() -> float:
    return random.uniform(0.005, 0.04)


def sync_worker(args: argparse.Namespace) -> int:
    locker = Locker(args.url, table=args.table, grace=args.grace)
    rw = locker.rwlock(args.name)
    section = Section(Path(args.state))
    deadline = time.monotonic() + args.seconds
    while time.monotonic() < deadline:
        if random.random() < args.write_share:
            lock = rw.write(wait=None, expires=args.expires)
            section.enter_writer(lock.lock_id)
            time.sleep(_hold())
            section.leave_writer()
        else:
            lock = rw.read(wait=None, expires=args.expires)
            section.enter_reader(lock.lock_id)
            time.sleep(_hold())
            section.leave_reader()
        lock.unlock()
    locker.close()
    return 0


async def async_worker(args: argparse.Namespace) -> int:
    locker = AsyncLocker(async_url(args.url), table=args.table, grace=args.grace)
    rw = locker.rwlock(args.name)
    section = Section(Path(args.state))
    deadline = time.monotonic() + args.seconds
    while time.monotonic() < deadline:
        if random.random() < args.write_share:
            lock = await rw.write(wait=None, expires=args.expires)
            section.enter_writer(lock.lock_id)
            await asyncio.sleep(_hold())
            section.leave_writer()
        else:
            lock = await rw.read(wait=None, expires=args.expires)
            section.enter_reader(lock.lock_id)
            await asyncio.sleep(_hold())
            section.leave_reader()
        await lock.unlock()
    await locker.aclose()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.rw_workers")
    parser.add_argument("--url", required=True)
    parser.add_argument("--table", required=True)
    parser.add_argument("--state", required=True)
    parser.add_argument("--name", default="catalog")
    parser.add_argument("--seconds", type=float, default=5)
    parser.add_argument("--write-share", type=float, default=0.3)
    parser.add_argument("--expires", type=float, default=60)
    parser.add_argument("--grace", type=float, default=1.0)
    parser.add_argument("--asyncio", action="store_true")
    args = parser.parse_args(argv)
    if args.asyncio:
        return asyncio.run(async_worker(args))
    return sync_worker(args)


if __name__ == "__main__":
    raise SystemExit(main())
