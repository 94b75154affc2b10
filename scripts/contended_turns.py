"""Where a contended turn's time goes: bench.py's contended rows, taken apart turn by turn.

Runs bench.py's contenders (4 processes, one lockstring, each holding ~1 ms and stepping back
2 ms) for sqllocker and blocking advisory locks on PostgreSQL, alternately, and prints the
medians of: a turn (one acquisition's return to the next's), the holding, the release (the
holder's release call), and the hand-off (the release's return to the next acquisition's); and
the wait (asking to getting) at p50 and p99, beside the p50 that the other medians predict for
four processes served in turn (``wait_model_ms``). Before each round it times a durable commit
on the server (``bench.commit_flush``): a granting release waits for one, and this machine's
disk answers a flush in ~0.2 ms most of the time, 3-4 ms for some minutes of 2026-11-25.

    .venv/bin/python scripts/contended_turns.py --rounds 2

With ``--ballast 0,1000,5000`` it measures sqllocker only, while another session holds that
many advisory locks: until migration 0007 a release that handed the row over looked its waiter
up in ``pg_locks``, which lists every lock of the server, and this showed what a busy lock
table cost a hand-off (now nothing: the release asks for the waiter's own key).

With ``--flush-delay-ms 4`` it runs in a scratch database whose sessions wait that long before
each flush of the server's log (``commit_delay``), as if the disk were that much slower, as
this machine's was for some minutes of 2026-11-25. Advisory locks never flush; every sqllocker
hand-off waits for one (the grant's), so the rows show what a slow disk costs each.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts import bench
from sqllocker.engine import resolve_url


def turns_of(system: str, url: str, seconds: float) -> dict[str, float]:
    if system == "sqllocker":
        bench.fresh_table(url)
    turns = sorted(bench.contend(system, url, 4, seconds), key=lambda turn: turn[1])
    if system == "sqllocker":
        bench.drop_table(url, bench.TABLE)
    pairs = list(itertools.pairwise(turns))
    hold = statistics.median(left - got for _, got, left, _ in turns) * 1000
    release = statistics.median(done - left for _, _, left, done in turns) * 1000
    handoff = (
        statistics.median(after[1] - before[3] for before, after in pairs if after[0] < before[3])
        * 1000
    )
    waits = [(got - asked) * 1000 for asked, got, _, _ in turns]
    return {
        "turn_ms": statistics.median(after[1] - before[1] for before, after in pairs) * 1000,
        "hold_ms": hold,
        "release_ms": release,
        "handoff_ms": handoff,
        "wait_p50_ms": bench.percentile(waits, 0.5),
        "wait_p99_ms": bench.percentile(waits, 0.99),
        # Four processes served in turn: a process's round (wait, hold, release, step back) is
        # four turns of hold + release + hand-off, so its wait is what is left of them.
        "wait_model_ms": 3 * (hold + release) + 4 * handoff - bench.STEP_BACK_SECONDS * 1000,
    }


@contextlib.contextmanager
def slow_flush(url: str, delay_ms: float) -> Iterator[str]:
    """A scratch database on ``url``'s server whose sessions wait ``delay_ms`` before every
    flush of the log, as on a disk that much slower; yields its URL, and drops it after.

    ``commit_delay`` applies only while ``commit_siblings`` other transactions are active;
    with 0 it applies to every flush. Set on the database, it reaches every session the
    contenders open there (the library's own startup settings included) and no other
    database's: a run beside this one, or the tests, keep the server's real flush.
    """
    database = f"sqllocker_slow_flush_{os.getpid()}"
    admin = bench.postgres_connection(url)
    try:
        admin.execute(f"CREATE DATABASE {database}")
        admin.execute(f"ALTER DATABASE {database} SET commit_delay = {round(delay_ms * 1000)}")
        admin.execute(f"ALTER DATABASE {database} SET commit_siblings = 0")
        yield resolve_url(url).set(database=database).render_as_string(hide_password=False)
    finally:
        admin.execute(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")
        admin.close()


@contextlib.contextmanager
def ballast(url: str, count: int) -> Iterator[int]:
    """A session holding ``count`` advisory locks (keys no contender uses) meanwhile; yields how
    many entries ``pg_locks`` then lists."""
    connection = bench.postgres_connection(url)
    try:
        connection.execute(
            "SELECT count(pg_advisory_lock(2147483647, g)) FROM generate_series(1, %s) AS g",
            (count,),
        )
        row = connection.execute("SELECT count(*) FROM pg_locks").fetchone()
        yield int(row[0]) if row else 0
    finally:
        connection.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument(
        "--ballast",
        help="comma-separated counts of advisory locks another session holds (sqllocker only)",
    )
    parser.add_argument(
        "--flush-delay-ms",
        type=float,
        help="wait this long before each flush of the server's log (a slower disk)",
    )
    args = parser.parse_args()
    url = bench.URLS["postgresql"]
    if args.flush_delay_ms:
        with slow_flush(url, args.flush_delay_ms) as slow_url:
            return measure(args, slow_url)
    return measure(args, url)


def measure(args: argparse.Namespace, url: str) -> int:
    if args.ballast:
        counts = [int(count) for count in args.ballast.split(",")]
        for number in range(args.rounds):
            for count in counts if number % 2 == 0 else reversed(counts):
                with ballast(url, count) as listed:
                    figures = turns_of("sqllocker", url, args.seconds)
                shown = "  ".join(f"{name} {value:.3f}" for name, value in figures.items())
                print(number, f"pg_locks {listed:>6}", shown, flush=True)
        return 0
    for number in range(args.rounds):
        # Each sqllocker hand-off waits for one durable commit (the grant's); an advisory lock
        # for none. What one costs now says which kind of hour the round ran in.
        flush = bench.commit_flush("postgresql", url)
        print(
            number,
            f"{'commit':<14}",
            f"flush_p50_ms {flush['commit_p50_ms']:.3f}  "
            f"round_trip_p50_ms {flush['round_trip_p50_ms']:.3f}",
            flush=True,
        )
        for system in ("sqllocker", "advisory lock"):
            figures = turns_of(system, url, args.seconds)
            shown = "  ".join(f"{name} {value:.3f}" for name, value in figures.items())
            print(number, f"{system:<14}", shown, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
