"""Compare the uncontended cycle of two or more source trees, interleaved: the A/B tool.

One run moves by more than a change to the library's own Python is worth, so a change is
judged against the code before it in alternating rounds: each round, every tree (a fresh
interpreter in that tree's directory, importing that tree's code) times the raw floor and its
own ``Locker`` back to back, best of two runs each, the trees' order reversed every other
round; each tree's medians come last. Every tree runs the same floor (``bench.raw_floor_cycle``
of the bench.py beside this file) with that tree's statements: a change to them shows in
``floor_us``, and ``x_floor`` is against the floor of what the tree sends. With the other tree
made by ``git worktree add /tmp/base HEAD``:

    .venv/bin/python scripts/ab_uncontended.py --rounds 4 new=. base=/tmp/base

``--asyncio`` times each tree's ``AsyncLocker`` against the async floor instead
(``bench.async_raw_floor_cycle``), in one event loop, best of three.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts import bench

BENCH = str(Path(bench.__file__).resolve())

# One run in a tree, of this tool's bench.py (its floor) on that tree's sqllocker: the floor and
# its Locker (or the async floor and its AsyncLocker, in one event loop), each in turn, best of
# ``repeats``; as microseconds a cycle.
_ROUND = """
import asyncio, functools, importlib.util, json, os, sys

spec = importlib.util.spec_from_file_location("bench", sys.argv[1])
bench = sys.modules["bench"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
url, count, repeats, mode = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
if url.endswith("/"):  # SQLite: a new file each run, its table made as the tree makes it
    url += f"{os.getpid()}.db"
    bench.fresh_table(url)
if mode == "async":
    rounds = asyncio.run(bench.async_figures(url, count, repeats, layers=False))
    floor, library = "async raw floor", "sqllocker.asyncio"
else:
    floor, library = "raw floor", "sqllocker"
    systems = [(floor, functools.partial(bench.raw_floor_cycle, url)),
               (library, functools.partial(bench.sqllocker_cycle, url))]
    rounds = bench.rounds_in_turn(systems, count, repeats)
best = {name: 1e6 / max(r[name]["cycles_per_s"] for r in rounds) for name in (floor, library)}
print(json.dumps({"floor_us": round(best[floor], 1), "sqllocker_us": round(best[library], 1),
                  "x_floor": round(best[floor] / best[library], 3)}))
"""


def run_rounds(trees: list[tuple[str, str]], rounds: int, *arguments: str) -> None:
    """Run ``_ROUND`` in each tree, ``rounds`` times, interleaved, printing each run's figures
    (its last line of output, as JSON) as it comes and then each tree's medians."""
    results: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in trees}
    for number in range(rounds):
        for name, path in trees if number % 2 == 0 else trees[::-1]:
            command = [sys.executable, "-c", _ROUND, *arguments]
            done = subprocess.run(command, cwd=path, capture_output=True, text=True, check=False)
            lines = done.stdout.strip().splitlines()
            if done.returncode != 0 or not lines:
                print(number, name, done.stderr[-2000:], flush=True)
                continue
            results[name].append(json.loads(lines[-1]))
            print(number, name, lines[-1], flush=True)
    for name, measured in results.items():
        if measured:
            medians = {key: statistics.median(m[key] for m in measured) for key in measured[0]}
            print(name, "median", json.dumps(medians))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--cycles", type=int, help="a run's cycles: 3000, async 1000")
    parser.add_argument("--backend", choices=["sqlite", "postgresql", "mysql"], default="sqlite")
    parser.add_argument("--asyncio", action="store_true", help="the async cycle")
    parser.add_argument("trees", nargs="+", help="name=path of a checkout, two or more")
    args = parser.parse_args()
    if len(args.trees) < 2 or not all("=" in tree for tree in args.trees):
        parser.error("give two or more trees, each as name=path")
    trees = [(name, path) for name, path in (tree.split("=", 1) for tree in args.trees)]
    mode = "async" if args.asyncio else "sync"
    cycles = args.cycles or (1000 if args.asyncio else 3000)
    arguments = [str(cycles), "3" if args.asyncio else "2", mode]
    with tempfile.TemporaryDirectory() as scratch:
        url = f"sqlite:///{scratch}/" if args.backend == "sqlite" else bench.URLS[args.backend]
        if args.backend != "sqlite":
            bench.fresh_table(url)
        try:
            run_rounds(trees, args.rounds, BENCH, url, *arguments)
        finally:
            if args.backend != "sqlite":
                bench.drop_table(url, bench.TABLE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
