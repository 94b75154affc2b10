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
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.interleaved import print_medians, run_rounds, trees_of

_ONE_ROUND = """
import json, sys
from scripts import bench

backend, seconds = sys.argv[1], float(sys.argv[2])
url = bench.URLS[backend]
bench.fresh_table(url)
figures = {}
for processes in (1, 2, 4):
    figures[f"cycles_per_s_{processes}"] = round(bench.cycles_per_s_of(url, processes, seconds))
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
    trees = trees_of(parser, args.trees)
    print_medians(run_rounds(trees, args.rounds, _ONE_ROUND, args.backend, str(args.seconds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
