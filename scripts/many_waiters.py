"""Many waiters on one lockstring: every waiter served, in what order, on how many connections.

    .venv/bin/python scripts/many_waiters.py --backend postgresql
    .venv/bin/python scripts/many_waiters.py --backend mysql --asyncio

``--processes`` processes (10) each run ``--waiters`` threads, or asyncio tasks (50), that take
one lockstring ``--turns`` times (5), holding it ``--hold`` seconds (1 ms) each time. Prints,
per run: whether every waiter was served and no two held at once; the connections each process
had open at most, to the database's server (or, for SQLite, to its file), beside what its pool
allows; how many others were served between a waiter's asking and its getting, against its place
in line when it asked (how many had asked before it and were still waiting); and the wait's
distribution. Uses the bench's URLs and table (``scripts/bench.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import collections
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


from sqlalchemy.pool import QueuePool

from scripts.bench import (
    TABLE,
    URLS,
    Turn,
    drop_table,
    fresh_table,
    percentile,
    processes_context,
    turn_figures,
)
from sqllocker import Locker
from sqllocker.asyncio import AsyncLocker
from sqllocker.sqlalchemy_internals import most_connections

LOCKSTRING = "many waiters"
SAMPLE_SECONDS = 0.02


def _socket_inodes() -> set[str]:
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def open_connections(url: str) -> int:
    """This process's connections to ``url``'s server now (TCP sockets to its port), or for an
    SQLite database, its open descriptors of the database file."""
    if url.startswith("sqlite"):
        database = url.removeprefix("sqlite:///")
        count = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            count += target.endswith(os.path.basename(database))
        return count
    port = 5432 if url.startswith("postgresql") else 3306
    mine = _socket_inodes()
    count = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as lines:
            next(lines)
            for line in lines:
                fields = line.split()
                remote_port = int(fields[2].rsplit(":", 1)[1], 16)
                established = fields[3] == "01"
                count += established and remote_port == port and fields[9] in mine
    return count


class Sampler:
    """The most connections this process had open, sampled every SAMPLE_SECONDS."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.most = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_SECONDS):
            self.most = max(self.most, open_connections(self.url))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.most


def _pool_allows(locker: Locker | AsyncLocker) -> int | None:
    pool = locker._operations.engine.pool
    return most_connections(pool) if isinstance(pool, QueuePool) else None


def _threads_process(
    url: str, waiters: int, turns: int, hold: float, most: int | None, ready: Any
) -> Any:
    locker = Locker(url, table=TABLE, grace=1, max_connections=most)
    records: list[Turn] = []
    errors: list[str] = []

    def waiter() -> None:
        for turn in range(turns):
            asked = time.monotonic()
            try:
                lock = locker.lock(LOCKSTRING, wait=None, expires=60)
            except Exception as error:
                errors.append(f"{type(error).__name__}: {error}")
                continue
            got = time.monotonic()
            time.sleep(hold)
            left = time.monotonic()
            lock.unlock()
            records.append((asked, got, left, time.monotonic()))
            if turn == 0:
                firsts.append(asked)

    firsts: list[float] = []
    ready.wait()
    sampler = Sampler(url)
    threads = [threading.Thread(target=waiter) for _ in range(waiters)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    most = sampler.stop()
    allows = _pool_allows(locker)
    locker.close()
    return records, errors, most, allows, firsts


def _tasks_process(
    url: str, waiters: int, turns: int, hold: float, most: int | None, ready: Any
) -> Any:
    ready.wait()
    sampler = Sampler(url)

    async def run() -> Any:
        locker = AsyncLocker(url, table=TABLE, grace=1, max_connections=most)
        records: list[Turn] = []
        errors: list[str] = []
        firsts: list[float] = []

        async def waiter() -> None:
            for turn in range(turns):
                asked = time.monotonic()
                try:
                    lock = await locker.lock(LOCKSTRING, wait=None, expires=60)
                except Exception as error:
                    errors.append(f"{type(error).__name__}: {error}")
                    continue
                got = time.monotonic()
                await asyncio.sleep(hold)
                left = time.monotonic()
                await lock.unlock()
                records.append((asked, got, left, time.monotonic()))
                if turn == 0:
                    firsts.append(asked)

        await asyncio.gather(*(waiter() for _ in range(waiters)))
        allows = _pool_allows(locker)
        await locker.aclose()
        return records, errors, allows, firsts

    records, errors, allows, firsts = asyncio.run(run())
    return records, errors, sampler.stop(), allows, firsts


def _process(
    mode: str,
    url: str,
    waiters: int,
    turns: int,
    hold: float,
    most: int | None,
    ready: Any,
    results: Any,
) -> None:
    run = _tasks_process if mode == "asyncio" else _threads_process
    results.put(run(url, waiters, turns, hold, most, ready))


def figures(turns: list[Turn], firsts: set[float]) -> dict[str, Any]:
    """The bench's overlaps (must be 0) and most passes; for each acquisition, the others served
    between its asking and its getting beyond its place in line when it asked, of all of them
    and of those after each waiter's first (``firsts``: when those were asked: every waiter
    asks at once as the run starts, and who reaches the server first among them is the
    processes' own scheduling); the wait's distribution."""
    bench_figures = turn_figures(turns)
    gots = sorted(turn[1] for turn in turns)
    askeds = sorted(turn[0] for turn in turns)
    beyond, later = [], []
    for asked, got, _, _ in turns:
        served_between = bisect.bisect_left(gots, got) - bisect.bisect_right(gots, asked)
        # In line ahead of it: asked before it, and not yet served when it asked.
        in_line = bisect.bisect_left(askeds, asked) - bisect.bisect_right(gots, asked)
        beyond.append(served_between - in_line)
        if asked not in firsts:
            later.append(served_between - in_line)
    waits = sorted(got - asked for asked, got, _, _ in turns)
    return {
        "overlaps": bench_figures["violations"],
        "passed_max": bench_figures["overtaken_max"],
        "beyond_place_p999": percentile([float(b) for b in beyond], 0.999),
        "beyond_place_max": max(beyond),
        "beyond_place_over_3": sum(b > 3 for b in beyond),
        "later_count": len(later),
        "later_p999": percentile([float(b) for b in later], 0.999) if later else None,
        "later_max": max(later) if later else None,
        "later_over_3": sum(b > 3 for b in later),
        "wait_ms": {f"p{int(q * 100)}": percentile(waits, q) * 1000 for q in (0.5, 0.9, 0.99, 1.0)},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=sorted(URLS), default="sqlite")
    parser.add_argument("--asyncio", action="store_true", help="tasks rather than threads")
    parser.add_argument("--processes", type=int, default=10)
    parser.add_argument("--waiters", type=int, default=50)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--hold", type=float, default=0.001)
    parser.add_argument(
        "--max-connections", type=int, help="each Locker's max_connections (default: 15)"
    )
    args = parser.parse_args()
    url = URLS[args.backend]
    if url.startswith("sqlite"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    fresh_table(url)
    try:
        mode = "asyncio" if args.asyncio else "threads"
        context = processes_context()
        ready, results = context.Barrier(args.processes + 1), context.Queue()
        workers = [
            context.Process(
                target=_process,
                args=(
                    mode,
                    url,
                    args.waiters,
                    args.turns,
                    args.hold,
                    args.max_connections,
                    ready,
                    results,
                ),
            )
            for _ in range(args.processes)
        ]
        for worker in workers:
            worker.start()
        ready.wait(timeout=120)
        started = time.monotonic()
        outcomes = [results.get(timeout=1800) for _ in workers]
        elapsed = time.monotonic() - started
        for worker in workers:
            worker.join()
        turns = [turn for records, _, _, _, _ in outcomes for turn in records]
        firsts = {asked for _, _, _, _, process_firsts in outcomes for asked in process_firsts}
        errors = collections.Counter(error for _, errs, _, _, _ in outcomes for error in errs)
        expected = args.processes * args.waiters * args.turns
        print(
            f"{args.backend}, {args.processes} processes x {args.waiters} {mode}, "
            f"{args.turns} turns each, {args.hold * 1000:g} ms holds: {elapsed:.1f} s"
        )
        print(f"served {len(turns)} of {expected}; errors: {dict(errors) or 'none'}")
        print(
            "connections per process, most open at once: "
            + ", ".join(str(most) for _, _, most, _, _ in outcomes)
            + f" (its pool allows {outcomes[0][3]})"
        )
        if turns:
            result = figures(turns, firsts)
            waits = ", ".join(f"{name} {ms:.1f}" for name, ms in result["wait_ms"].items())
            print(f"overlaps (two holders at once): {result['overlaps']}")
            print(
                f"served ahead of a waiter beyond its place in line: p99.9 "
                f"{result['beyond_place_p999']:.0f}, max {result['beyond_place_max']}, "
                f"more than 3 in {result['beyond_place_over_3']} of {len(turns)} acquisitions"
            )
            if result["later_count"]:
                print(
                    f"  after each waiter's first turn: p99.9 {result['later_p999']:.0f}, max "
                    f"{result['later_max']}, more than 3 in {result['later_over_3']} of "
                    f"{result['later_count']}"
                )
            print(f"wait (ms): {waits}")
        return 0 if len(turns) == expected and not errors else 1
    finally:
        drop_table(url, TABLE)  # nothing left on a shared server


if __name__ == "__main__":
    sys.exit(main())
