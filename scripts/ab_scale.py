"""Compare two or more source trees' throughput with several processes, interleaved.

A change to the statements can cost nothing in one process and still serialise many (a lock
that lasts the statement, say). Each round, every tree (in a fresh interpreter, from that tree)
runs bench.py's scale row (1, 2 and 4 processes cycling on distinct lockstrings, cycles/s in
all) and its contended row (4 processes taking turns on one lockstring) on one backend,
reversing the order of the trees every other round, and prints one JSON line per tree and
round, then each tree's medians. Make the other tree with ``git worktree add /tmp/base HEAD``:

    .venv/bin/python scripts/ab_scale.py --backend mysql --rounds 3 new=. base=/tmp/base
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

_ONE_ROUND = """
import json, sys
from scripts import bench

backend, seconds = sys.argv[1], float(sys.argv[2])
url = bench.URLS[backend]
context = bench.processes_context()
bench.fresh_table(url)
figures = {}
for processes in (1, 2, 4):
    queue = context.Queue()
    workers = [
        context.Process(target=bench._cycler, args=(url, seconds, queue))
        for _ in range(processes)
    ]
    for worker in workers:
        worker.start()
    total = sum(len(queue.get(timeout=seconds + 120)) for _ in workers)
    for worker in workers:
        worker.join()
    figures[f"cycles_per_s_{processes}"] = round(total / seconds)
(ours,) = bench.contended([(backend, "sqllocker", url)], 4, seconds)
figures["contended_per_s"] = round(ours["acquisitions_per_s"], 1)
figures["handoff_p50_ms"] = round(ours["handoff_p50_ms"], 3)
figures["handoff_p99_ms"] = round(ours["handoff_p99_ms"], 3)
figures["overlaps"] = ours["violations"]
bench.drop_table(url, bench.TABLE)
print(json.dumps(figures))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0, help="per row")
    parser.add_argument("--backend", choices=["postgresql", "mysql"], default="mysql")
    parser.add_argument("trees", nargs="+", help="name=path of a checkout, two or more")
    args = parser.parse_args()
    if len(args.trees) < 2 or not all("=" in tree for tree in args.trees):
        parser.error("give two or more trees, each as name=path")
    trees = [tuple(tree.split("=", 1)) for tree in args.trees]
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name, _ in trees}
    for number in range(args.rounds):
        for name, path in trees if number % 2 == 0 else trees[::-1]:
            done = subprocess.run(
                [sys.executable, "-c", _ONE_ROUND, args.backend, str(args.seconds)],
                cwd=path,
                capture_output=True,
                text=True,
                check=False,
            )
            lines = done.stdout.strip().splitlines()
            if done.returncode != 0 or not lines:
                print(number, name, done.stderr[-2000:], flush=True)
                continue
            rounds[name].append(json.loads(lines[-1]))
            print(number, name, lines[-1], flush=True)
    for name, measured in rounds.items():
        if measured:
            medians = {key: statistics.median(m[key] for m in measured) for key in measured[0]}
            print(name, "median", json.dumps(medians))
    return 0


if __name__ == "__main__":
    sys.exit(main())
