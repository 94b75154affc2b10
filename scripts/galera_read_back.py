"""What a lone acquire's read-back costs on a Galera node: one Locker's cycles with it and
without it, in interleaved rounds, on a three-node cluster of the tests' own
(``tests/galera_cluster.py``, which needs the galera-4 package).

sqllocker's own connections turn the node's autocommit retries off, so they need no read-back;
the other Locker is made to read back as it does through a caller's Engine (where the node may
still run an INSERT again), so that the two differ in that statement alone:

    .venv/bin/python scripts/galera_read_back.py --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sqllocker import Locker, UnsafeDatabaseWarning
from tests.galera_cluster import running_galera_cluster


def cycles_per_second(locker: Locker, name: str, count: int) -> float:
    started = time.perf_counter()
    for number in range(count):
        locker.lock(f"{name} {number}").unlock()
    return count / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cycles", type=int, default=600)
    args = parser.parse_args()
    # A three-node cluster is reported as one whose tokens may come out of order; not timed.
    warnings.simplefilter("ignore", UnsafeDatabaseWarning)
    with running_galera_cluster() as cluster:
        url = cluster.urls()[0]
        without, reading = Locker(url), Locker(url)
        without.create_table()
        for locker in (without, reading):
            locker.lock("set up").unlock()
        reading._operations._lone_inserts_retried = True  # as through a caller's Engine
        figures: dict[str, list[float]] = {"no read-back": [], "read-back": []}
        for round_number in range(args.rounds):
            for name, locker in (("no read-back", without), ("read-back", reading)):
                rate = cycles_per_second(locker, f"{name} {round_number}", args.cycles)
                figures[name].append(rate)
        for name, rates in figures.items():
            shown = ", ".join(f"{rate:.0f}" for rate in rates)
            print(f"{name}: {shown} cycles/s (median {statistics.median(rates):.0f})")
        ratios = [a / b for a, b in zip(*figures.values(), strict=True)]
        print("no read-back / read-back, per round:", ", ".join(f"{r:.2f}" for r in ratios))
        without.close()
        reading.close()


if __name__ == "__main__":
    main()
