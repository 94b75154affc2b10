"""What reaching PostgreSQL through a transaction-pooling PgBouncer costs, in interleaved rounds.

Starts a PgBouncer of its own in transaction mode in front of the benchmark's PostgreSQL (two
server connections, as tests/test_poolers.py does; it needs Debian's pgbouncer and root, to run
it as ``postgres``), then, each round, in alternating order:
- uncontended cycles, one process: the raw floor (bench.py's) and sqllocker, directly and
  through the pooler (``transaction_pooling=True``: nothing prepared, no session settings);
- bench.py's contended turns (4 processes on one lockstring): directly, waiters queue and are
  handed the row by the release; through the pooler they back off and retry.

    .venv/bin/python scripts/pooler_rounds.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts import bench
from tests.private_servers import running_pgbouncer


def uncontended(url: str, pooled: bool, count: int) -> dict[str, float]:
    figures: dict[str, float] = {}
    for name, make in (("floor", bench.raw_floor_cycle), ("sqllocker", bench.sqllocker_cycle)):
        cycle, close = make(url, transaction_pooling=pooled)
        try:
            figures[f"{name}_per_s"] = round(bench.timed_cycles(cycle, count)["cycles_per_s"])
        finally:
            close()
    figures["x_floor"] = round(figures["sqllocker_per_s"] / figures["floor_per_s"], 3)
    return figures


def contended(url: str, pooled: bool, seconds: float) -> dict[str, object]:
    system = bench.POOLED_SQLLOCKER if pooled else "sqllocker"
    turns = bench.contend(system, url, 4, seconds)
    figures = bench.turn_figures(turns)
    return {
        "acquisitions_per_s": round(len(turns) / seconds),
        "handoff_p50_ms": round(figures["handoff_p50_ms"], 2),
        "wait_p99_ms": round(figures["wait_p99_ms"], 1),
        "overlaps": figures["violations"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--count", type=int, default=3000, help="uncontended cycles per row")
    parser.add_argument("--seconds", type=float, default=6.0, help="per contended row")
    args = parser.parse_args()
    direct = bench.URLS["postgresql"]
    bench.fresh_table(direct)
    try:
        with running_pgbouncer(direct) as through:
            for number in range(args.rounds):
                for pooled in (False, True) if number % 2 == 0 else (True, False):
                    url = through if pooled else direct
                    row = {
                        "uncontended": uncontended(url, pooled, args.count),
                        "contended": contended(url, pooled, args.seconds),
                    }
                    route = "through PgBouncer" if pooled else "direct"
                    print(number, f"{route:<17}", json.dumps(row), flush=True)
    finally:
        bench.drop_table(direct, bench.TABLE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
