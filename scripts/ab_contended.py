"""Compare the contended PostgreSQL rows of two or more source trees, interleaved.

One run of bench.py moves by ±10% from the next, more than most changes to the hand-off are
worth, so a change is judged against the code before it in alternating rounds: each round
runs every tree's sqllocker and advisory-lock rows back to back (in a fresh interpreter, from
that tree), reversing the order of the trees every other round, and prints one JSON line per
tree and round. Make the other tree with ``git worktree add /tmp/base HEAD``, for example:

    .venv/bin/python scripts/ab_contended.py --rounds 4 --seconds 8 new=. base=/tmp/base

Each line also gives ``commit_flush_ms``, a durable commit's p50 on the server just before the
round (``bench.commit_flush``): every hand-off waits for one. On this machine it is ~0.2 ms
most of the time and was 3-4 ms for some minutes of 2026-11-25 (cause unknown), so rounds are
comparable only where it was alike.

``--hold-ms`` sets how long each contender holds the lock (bench.py's 1 ms by default). Each
tree's own ``scripts/bench.py`` runs the contenders; one from before that option existed needs
this tree's ``scripts/`` copied into it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.interleaved import print_medians, run_rounds, trees_of

_ONE_ROUND = """
import json
from scripts import bench
url = bench.URLS["postgresql"]
# A tree from before commit_flush existed times no commit (see the module's docstring).
flush = getattr(bench, "commit_flush", None)
flush_ms = round(flush("postgresql", url)["commit_p50_ms"], 3) if flush else None
ours, advisory = bench.contended(
    [("postgresql", "sqllocker", url), ("postgresql", "advisory lock", url)], 4, {seconds}, {hold}
)
bench.drop_table(url, bench.TABLE)
print(json.dumps({{
    "x_advisory": round(ours["acquisitions_per_s"] / advisory["acquisitions_per_s"], 3),
    "acquisitions_per_s": ours["acquisitions_per_s"],
    "advisory_per_s": advisory["acquisitions_per_s"],
    "handoff_p50_ms": ours["handoff_p50_ms"],
    "handoff_p99_ms": ours["handoff_p99_ms"],
    "wait_p99_x_advisory": round(ours["wait_p99_ms"] / advisory["wait_p99_ms"], 2),
    "passed_by": ours["overtaken_max"],
    "overlaps": ours["violations"],
    "commit_flush_ms": flush_ms,
}}))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--hold-ms", type=float, default=1.0)
    parser.add_argument("trees", nargs="+", help="name=path of a checkout, two or more")
    args = parser.parse_args()
    trees = trees_of(parser, args.trees)
    one_round = _ONE_ROUND.format(seconds=args.seconds, hold=args.hold_ms / 1000)
    print_medians(run_rounds(trees, args.rounds, one_round))
    return 0


if __name__ == "__main__":
    sys.exit(main())
