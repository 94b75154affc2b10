"""bench.py's purge row, several times over: how far one run's figure can be trusted.

One run of bench.py measures a worker's cycle p99 during a purge of 1,000,000 expired rows once,
and on this kind of machine that ratio moves between runs by more than the 3x it is judged by.
This repeats the row (fill the table with expired rows, let a worker cycle for a quiet stretch,
purge beside it) ``--rounds`` times for each batch size given, interleaved, and prints each
round and then each batch size's median, lowest and highest ratio.

    .venv/bin/python scripts/purge_rounds.py --backend postgresql --rounds 3 \
        --batch-sizes 5000,20000

A round takes about two minutes on PostgreSQL.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts import bench
from sqllocker.locker import DEFAULT_PURGE_BATCH

# Twice bench.py's quiet stretch (FULL.scale_seconds): the README's figures from here used it.
QUIET_SECONDS = 10.0


def one_round(url: str, batch_size: int) -> float:
    bench.fresh_table(url)
    bench.fill(url, bench.FULL.other_rows, expired=True)
    quiet, busy, purged, seconds = bench.purge_beside_a_worker(url, QUIET_SECONDS, batch_size)
    quiet_p99, busy_p99 = bench.percentile(quiet, 0.99), bench.percentile(busy, 0.99)
    print(
        f"batch {batch_size:>6}: p99 {quiet_p99 * 1000:.2f} -> {busy_p99 * 1000:.2f} ms, "
        f"ratio {busy_p99 / quiet_p99:.2f}; purged {purged:,} in {seconds:.1f} s",
        flush=True,
    )
    return busy_p99 / quiet_p99


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="postgresql", choices=sorted(bench.URLS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-sizes", default=str(DEFAULT_PURGE_BATCH))
    args = parser.parse_args()
    url = bench.URLS[args.backend]
    sizes = [int(size) for size in args.batch_sizes.split(",")]
    ratios: dict[int, list[float]] = {size: [] for size in sizes}
    try:
        for _round in range(args.rounds):
            for size in sizes:
                ratios[size].append(one_round(url, size))
    finally:
        bench.drop_table(url, bench.TABLE)
    for size, measured in ratios.items():
        print(
            f"batch {size:>6}: median {statistics.median(measured):.2f}, "
            f"lowest {min(measured):.2f}, highest {max(measured):.2f} over {len(measured)} rounds"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
