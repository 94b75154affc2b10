"""A worker for the decorator's multi-process tests: ``python -m tests.decorated_worker``, or
forked from ``tests.fleet`` (``main(argv)``).

It calls ``job(a, b)``, decorated with ``@locker.locked("job {a}-{b}", wait=None)``, ``--count``
times. Under the lock it creates ``<state>/<marker>.holder`` with O_EXCL (a second holder of
the lock that ``--marker`` stands for is caught the instant it enters) and, with ``--meet``,
says it is inside (``<state>/<a>,<b>.inside``) and waits for the worker named by ``--meet`` to
be inside too: two calls whose locks differ must be able to run at once. It prints a JSON line:
how many calls ran, how many overlapped another holder, whether it met the other.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from sqllocker import Locker
from sqllocker.asyncio import AsyncLocker
from tests.workers import CriticalSection, async_url

MEET_TIMEOUT = 20.0


class Work:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.state = Path(args.state)
        self.section = CriticalSection(self.state)
        self.ran = 0
        self.met = False

    def inside(self, a: str, b: str) -> None:
        value = self.section.enter(self.args.marker)
        self.ran += 1
        if self.args.meet is not None:
            (self.state / f"{a},{b}.inside").touch()
            deadline = time.monotonic() + MEET_TIMEOUT
            while time.monotonic() < deadline and not self.met:
                self.met = (self.state / f"{self.args.meet}.inside").exists()
                time.sleep(0.01)
        else:
            time.sleep(self.args.hold)
        self.section.leave(self.args.marker, value)

    def report(self) -> None:
        print(json.dumps({"ran": self.ran, "overlaps": self.section.overlaps, "met": self.met}))


def run_sync(args: argparse.Namespace) -> None:
    work = Work(args)
    locker = Locker(args.url, table=args.table)

    @locker.locked("job {a}-{b}", wait=None)
    def job(a: str, b: str) -> None:
        work.inside(a, b)

    for _ in range(args.count):
        job(args.a, args.b)
    locker.close()
    work.report()


async def run_async(args: argparse.Namespace) -> None:
    work = Work(args)
    locker = AsyncLocker(async_url(args.url), table=args.table)

    @locker.locked("job {a}-{b}", wait=None)
    async def job(a: str, b: str) -> None:
        await asyncio.to_thread(work.inside, a, b)

    for _ in range(args.count):
        await job(args.a, args.b)
    await locker.aclose()
    work.report()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.decorated_worker")
    parser.add_argument("--url", required=True)
    parser.add_argument("--table", required=True)
    parser.add_argument("--state", required=True)
    parser.add_argument("--a", required=True)
    parser.add_argument("--b", required=True)
    parser.add_argument("--marker", required=True, help="the name of the O_EXCL marker file")
    parser.add_argument("--meet", help="'<a>,<b>' of the worker to be inside with")
    parser.add_argument("--count", type=int, default=1)
    parser.add_argument("--hold", type=float, default=0.005)
    parser.add_argument("--asyncio", action="store_true")
    args = parser.parse_args(argv)
    if args.asyncio:
        asyncio.run(run_async(args))
    else:
        run_sync(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
