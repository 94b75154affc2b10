"""bench.py's purge row, several times over: how far one run's figure can be trusted.

One run of bench.py measures a worker's cycle p99 during a purge of 1,000,000 expired rows once,
and on this kind of machine that ratio moves between runs by more than the 3x it is judged by.
This repeats the row (fill the table with expired rows, let a worker cycle for a quiet stretch,
purge beside it) ``--rounds`` times for each batch size and pause ratio given (the purge rests
that many times each batch's duration after it), interleaved, and prints each round and then
each setting's median, lowest and highest ratio.

    .venv/bin/python scripts/purge_rounds.py --backend postgresql --rounds 3 \
        --batch-sizes 5000,20000 [--pause-ratios 3,6]

A round takes about two minutes on PostgreSQL.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts import bench
from sqllocker.locker import DEFAULT_PURGE_BATCH, DEFAULT_PURGE_PAUSE_RATIO

# Twice bench.py's quiet stretch (FULL.scale_seconds): the README's figures from here used it.
QUIET_SECONDS = 10.0


def one_round(url: str, batch_size: int, pause_ratio: float) -> float:
    bench.fresh_table(url)
    bench.fill(url, bench.FULL.other_rows, expired=True)
    quiet, busy, purged, seconds = bench.purge_beside_a_worker(
        url, QUIET_SECONDS, batch_size, pause_ratio
    )
    quiet_p99, busy_p99 = bench.percentile(quiet, 0.99), bench.percentile(busy, 0.99)
    print(
        f"batch {batch_size:>6}, pause x{pause_ratio:g}: "
        f"p99 {quiet_p99 * 1000:.2f} -> {busy_p99 * 1000:.2f} ms, "
        f"ratio {busy_p99 / quiet_p99:.2f}; purged {purged:,} in {seconds:.1f} s",
        flush=True,
    )
    return busy_p99 / quiet_p99


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="postgresql", choices=sorted(bench.URLS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-sizes", default=str(DEFAULT_PURGE_BATCH))
    parser.add_argument("--pause-ratios", default=f"{DEFAULT_PURGE_PAUSE_RATIO:g}")
    args = parser.parse_args()
    url = bench.URLS[args.backend]
    settings = [
        (int(size), float(pause))
        for size in args.batch_sizes.split(",")
        for pause in args.pause_ratios.split(",")
    ]
    ratios: dict[tuple[int, float], list[float]] = {setting: [] for setting in settings}
    try:
        for _round in range(args.rounds):
            for size, pause in settings:
                ratios[size, pause].append(one_round(url, size, pause))
    finally:
        bench.drop_table(url, bench.TABLE)
    for (size, pause), measured in ratios.items():
        print(
            f"batch {size:>6}, pause x{pause:g}: median {statistics.median(measured):.2f}, "
            f"lowest {min(measured):.2f}, highest {max(measured):.2f} over {len(measured)} rounds"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
