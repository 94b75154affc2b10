"""Worker processes for the election tests: ``python -m tests.election_workers ...``.

A ``candidate`` campaigns without limit, and while it leads appends a line to its own file in
``--state`` for every moment it found its leadership valid (``CLOCK_MONOTONIC``, shared by the
processes of one machine), measured *before* the check, so that each line is a moment it was
a valid leader; once it finds the lead lost, it says so and campaigns again. An ``observer``
appends each change that ``observe()`` yields.

The tests fork them from a launcher (``tests/fleet.py``), which calls ``main(argv)``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import time
from pathlib import Path

from sqllocker import Locker, LockError
from sqllocker.asyncio import AsyncLocker
from tests.workers import async_url


def _writer(state: Path, role: str) -> _Lines:
    return _Lines(state / f"{role}-{os.getpid()}.jsonl")


class _Lines:
    def __init__(self, path: Path) -> None:
        self.out = open(path, "a")  # noqa: SIM115 (open for the process's life)

    def write(self, **fields: object) -> None:
        self.out.write(json.dumps(fields) + "\n")
        self.out.flush()


def _wait_for_go(args: argparse.Namespace) -> None:
    """With ``--go``, campaign only once that file exists: the processes start while the test
    waits for the observer, and campaign when told."""
    while args.go is not None and not Path(args.go).exists():
        time.sleep(0.01)


def candidate(args: argparse.Namespace) -> int:
    locker = Locker(args.url, table=args.table, grace=args.grace)
    election = locker.election(args.name)
    lines = _writer(Path(args.state), "candidate")
    _wait_for_go(args)
    while True:
        lead = election.campaign(expires=args.expires, on_lost=lambda lost: None)
        lines.write(event="lead", term=lead.term)
        while True:
            moment = time.monotonic()
            if not lead.is_valid():
                break
            lines.write(event="valid", term=lead.term, at=moment)
            time.sleep(0.02)
        lines.write(event="lost", term=lead.term)
        with contextlib.suppress(LockError):
            lead.resign()


async def async_candidate(args: argparse.Namespace) -> int:
    locker = AsyncLocker(async_url(args.url), table=args.table, grace=args.grace)
    election = locker.election(args.name)
    lines = _writer(Path(args.state), "candidate")
    _wait_for_go(args)
    while True:
        lead = await election.campaign(expires=args.expires, on_lost=lambda lost: None)
        lines.write(event="lead", term=lead.term)
        while True:
            moment = time.monotonic()
            if not lead.is_valid():
                break
            lines.write(event="valid", term=lead.term, at=moment)
            await asyncio.sleep(0.02)
        lines.write(event="lost", term=lead.term)
        with contextlib.suppress(LockError):
            await lead.resign()


def observer(args: argparse.Namespace) -> int:
    locker = Locker(args.url, table=args.table, grace=args.grace)
    lines = _writer(Path(args.state), "observer")
    for leader in locker.election(args.name).observe():
        lines.write(term=None if leader is None else leader.term, pid=leader and leader.pid)
    return 0


async def async_observer(args: argparse.Namespace) -> int:
    locker = AsyncLocker(async_url(args.url), table=args.table, grace=args.grace)
    lines = _writer(Path(args.state), "observer")
    async for leader in locker.election(args.name).observe():
        lines.write(term=None if leader is None else leader.term, pid=leader and leader.pid)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.election_workers")
    parser.add_argument("role", choices=["candidate", "observer"])
    parser.add_argument("--url", required=True)
    parser.add_argument("--table", required=True)
    parser.add_argument("--state", required=True)
    parser.add_argument("--name", default="scheduler")
    parser.add_argument("--expires", type=float, default=2.0)
    parser.add_argument("--grace", type=float, default=0.5)
    parser.add_argument("--asyncio", action="store_true")
    parser.add_argument("--go", help="a file to wait for before campaigning")
    args = parser.parse_args(argv)
    if args.asyncio:
        run = async_candidate if args.role == "candidate" else async_observer
        return asyncio.run(run(args))
    return (candidate if args.role == "candidate" else observer)(args)


if __name__ == "__main__":
    raise SystemExit(main())
