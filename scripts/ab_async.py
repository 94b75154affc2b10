"""Compare the uncontended async cycle of two or more source trees, interleaved.

Each round, every tree (in a fresh interpreter, from that tree) measures the async floor
(``scripts.bench.async_raw_floor_cycle``: sqllocker's statements through the async driver on one
held connection) and its own ``AsyncLocker``, back to back in one event loop, best of three runs
each, and counts the turns of the event loop a cycle takes. ``--busy N`` runs N other tasks
beside, each doing 20 us of work a turn, as an application's would: a turn then costs what
they do. Make the other tree with
``git worktree add /tmp/base HEAD``, then:

    .venv/bin/python scripts/ab_async.py --rounds 6 --backend postgresql new=. base=/tmp/base
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts import bench
from scripts.interleaved import print_medians, run_rounds, trees_of

_ONE_ROUND = """
import asyncio, json, sys, time
from scripts import bench

url, count, busy = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])


async def busy_task(stop):
    while not stop:
        started = time.perf_counter()
        while time.perf_counter() - started < 20e-6:
            pass
        await asyncio.sleep(0)


async def main():
    loop = asyncio.get_running_loop()
    turns = [0]
    run_once = loop._run_once

    def counted():
        turns[0] += 1
        run_once()

    loop._run_once = counted
    stop = []
    others = [asyncio.ensure_future(busy_task(stop)) for _ in range(busy)]
    best, turns_per_cycle = {}, {}
    for repeat in range(3):
        for name, make in (
            ("floor", lambda: bench.async_raw_floor_cycle(url)),
            ("sqllocker", lambda: bench.async_sqllocker_cycle(url)),
        ):
            cycle, close = await make()
            for n in range(100):  # warm up
                await cycle(10**7 + repeat * 1000 + n)
            before, started = turns[0], time.perf_counter()
            for n in range(count):
                await cycle(repeat * 10**6 + n)
            us = (time.perf_counter() - started) / count * 1e6
            turns_per_cycle[name] = (turns[0] - before) / count
            await close()
            best[name] = min(best.get(name, us), us)
    stop.append(True)
    await asyncio.gather(*others)
    print(json.dumps({
        "floor_us": round(best["floor"], 1), "sqllocker_us": round(best["sqllocker"], 1),
        "x_floor": round(best["floor"] / best["sqllocker"], 3),
        "floor_turns": round(turns_per_cycle["floor"], 2),
        "sqllocker_turns": round(turns_per_cycle["sqllocker"], 2),
    }))


asyncio.run(main())
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--cycles", type=int, default=1000)
    parser.add_argument("--backend", choices=["sqlite", "postgresql", "mysql"], default="sqlite")
    parser.add_argument("--busy", type=int, default=0, help="other tasks on the event loop")
    parser.add_argument("trees", nargs="+", help="name=path of a checkout, two or more")
    args = parser.parse_args()
    trees = trees_of(parser, args.trees)
    url = bench.URLS[args.backend]
    if args.backend == "sqlite":
        url = "sqlite:///" + str(Path(url.removeprefix("sqlite:///")).resolve())
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    bench.fresh_table(url)
    try:
        arguments = (url, str(args.cycles), str(args.busy))
        print_medians(run_rounds(trees, args.rounds, _ONE_ROUND, *arguments))
    finally:
        bench.drop_table(url, bench.TABLE)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
