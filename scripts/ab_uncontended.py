"""Compare the uncontended cycle of two or more source trees, interleaved: the A/B tool.

The library's own Python is a few tens of microseconds a cycle, and one run moves by more
than a single change to it is worth, so a change is judged against the code before it in
alternating rounds: each round, every tree (in a fresh interpreter, in that tree's directory,
so that it imports that tree's code) measures a raw floor and its own ``Locker``, back to back,
best of two runs each, reversing the order of the trees every other round; the medians per
tree come last. The floor's code is defined here, not in the trees, so that every tree runs
the very same floor: sqllocker's acquire and release statements on one held driver
connection, with values of the size sqllocker sends. The statements are that tree's
(``sqllocker.statements``), so a change to them shows in ``floor_us``, and ``x_floor`` is
against the floor of the statements the tree sends. Make the other tree with
``git worktree add /tmp/base HEAD``, then:

    .venv/bin/python scripts/ab_uncontended.py --rounds 4 new=. base=/tmp/base

``--asyncio`` does the same for the async cycle: each tree's ``AsyncLocker`` against the async
floor (that tree's ``scripts.bench.async_raw_floor_cycle``: the statements through the async
driver on one held connection) in one event loop, best of three.

A change worth a few microseconds of Python is lost in that noise (a round's ratio moves by
0.1, about 20 us of an SQLite cycle). ``--stub-driver`` times the library's own Python alone:
each tree's ``Locker`` on SQLite with its connection's cursor replaced by a stub that answers
at once as the database would (the acquire's row, the release's rowcount), best of five runs
per round, as ``library_us``; and the floor's own Python (its guid, parameters and JSON) on the
same stub, as ``floor_us``.
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

# Both programs: the tree's Locker, and the floor's cycle on whatever ``cursor`` is then.
_SETUP = """
import json, os, sys, time
from sqllocker import Locker
from sqllocker.execution import Prepared
from sqllocker.identity import holder_details

url, table, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
if url.endswith("/"):  # SQLite: a new file each run, made as the tree makes it
    url += f"{os.getpid()}.db"
locker = Locker(url, table=table, auto_create=True)
locker.lock("compile").unlock()
lock_table = locker._operations
dialect = lock_table.engine.dialect
acquire = Prepared(lock_table.statements.acquire, dialect)
release = Prepared(lock_table.statements.release, dialect)
ttl, minus_grace = lock_table.backend.seconds_value(3600), lock_table.backend.seconds_value(-1)
holder = holder_details({})
run = os.getpid()


def floor(n):
    guid = os.urandom(16).hex()
    values = {"ls": f"floor {run} {n}", "lock_guid": guid, "ttl": ttl,
              "minus_grace": minus_grace, "holder": {**holder, "guid": guid}}
    cursor.execute(acquire.sql, acquire.parameters(values))
    lock_id = cursor.fetchall()[0][0]
    cursor.execute(release.sql, release.parameters({"lock_id": lock_id, "lock_guid": guid}))


def library(n):
    locker.lock(f"lib {run} {n}").unlock()
"""

_ONE_ROUND = (
    _SETUP
    + """
raw = locker.engine.raw_connection()
cursor = raw.driver_connection.cursor()
if lock_table.backend.name == "sqlite":
    cursor.execute("PRAGMA wal_autocheckpoint=1000")  # as bench.FLOOR_SETTINGS: its own log
best = {}
for repeat in range(2):
    for name, cycle in (("floor", floor), ("sqllocker", library)):
        for n in range(200):  # warm up
            cycle(10**7 + repeat * 1000 + n)
        started = time.perf_counter()
        for n in range(count):
            cycle(repeat * 10**6 + n)
        us = (time.perf_counter() - started) / count * 1e6
        best[name] = min(best.get(name, us), us)
cursor.close()
raw.close()
locker.close()
print(json.dumps({"floor_us": round(best["floor"], 1), "sqllocker_us": round(best["sqllocker"], 1),
                  "x_floor": round(best["floor"] / best["sqllocker"], 3)}))
"""
)

# The floor's own Python too (``floor_us``: its guid, parameters and JSON), on the same stub.
_STUB_ROUND = (
    _SETUP
    + """

class StubCursor:
    # What SQLite answers in an uncontended cycle, without SQLite.
    rowcount, lastrowid, description = 1, None, None
    rows = []

    def execute(self, sql, parameters):
        inserting = sql.startswith("INSERT")
        self.rows = [(1, "2026-11-25 00:00:00.000", "2026-11-25 01:00:00.000")] if inserting else []

    def fetchall(self):
        return self.rows


cursor = StubCursor()
for held in locker._operations.database.pool.stack._idle:
    held.cursor, held.session = StubCursor(), None
best = {}
for repeat in range(5):
    for name, cycle in (("floor", floor), ("library", library)):
        started = time.perf_counter()
        for n in range(count):
            cycle(repeat * 10**6 + n)
        us = (time.perf_counter() - started) / count * 1e6
        best[name] = min(best.get(name, us), us)
locker.close()
print(json.dumps({"library_us": round(best["library"], 2), "floor_us": round(best["floor"], 2)}))
"""
)


# The async cycle: the tree's own async floor (scripts/bench.py) and its AsyncLocker, best of
# three, in one event loop.
_ASYNC_ROUND = """
import asyncio, json, sys, time
from scripts import bench

url, count = sys.argv[1], int(sys.argv[2])


async def main():
    best = {}
    for repeat in range(3):
        for name, make in (("floor", bench.async_raw_floor_cycle),
                           ("sqllocker", bench.async_sqllocker_cycle)):
            cycle, close = await make(url)
            for n in range(100):  # warm up
                await cycle(10**7 + repeat * 1000 + n)
            started = time.perf_counter()
            for n in range(count):
                await cycle(repeat * 10**6 + n)
            us = (time.perf_counter() - started) / count * 1e6
            await close()
            best[name] = min(best.get(name, us), us)
    floor, library = best["floor"], best["sqllocker"]
    print(json.dumps({"floor_us": round(floor, 1), "sqllocker_us": round(library, 1),
                      "x_floor": round(floor / library, 3)}))


asyncio.run(main())
"""


def run_rounds(
    trees: list[tuple[str, str]], rounds: int, program: str, *arguments: str
) -> dict[str, list[dict[str, Any]]]:
    """Run ``python -c program arguments...`` in each tree, ``rounds`` times, interleaved; each
    run's last line of output is its JSON figures. Prints each round's figures as it comes."""
    results: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in trees}
    for number in range(rounds):
        for name, path in trees if number % 2 == 0 else trees[::-1]:
            done = subprocess.run(
                [sys.executable, "-c", program, *arguments],
                cwd=path,
                capture_output=True,
                text=True,
                check=False,
            )
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
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--cycles", type=int, help="a run's cycles: 3000, async 1000")
    parser.add_argument("--backend", choices=["sqlite", "postgresql", "mysql"], default="sqlite")
    parser.add_argument("--asyncio", action="store_true", help="the async cycle")
    parser.add_argument(
        "--stub-driver", action="store_true", help="time the library's Python alone (SQLite)"
    )
    parser.add_argument("trees", nargs="+", help="name=path of a checkout, two or more")
    args = parser.parse_args()
    if len(args.trees) < 2 or not all("=" in tree for tree in args.trees):
        parser.error("give two or more trees, each as name=path")
    trees = [(name, path) for name, path in (tree.split("=", 1) for tree in args.trees)]
    if args.stub_driver and (args.backend != "sqlite" or args.asyncio):
        parser.error("--stub-driver stubs SQLite's sync answers: use it with --backend sqlite")
    if args.asyncio:
        return async_rounds(trees, args.rounds, args.backend, args.cycles or 1000)
    program = _STUB_ROUND if args.stub_driver else _ONE_ROUND
    cycles = str((args.cycles or 3000) * (5 if args.stub_driver else 1))
    table = "ab_uncontended"
    with tempfile.TemporaryDirectory() as scratch:
        url = f"sqlite:///{scratch}/" if args.backend == "sqlite" else bench.URLS[args.backend]
        try:
            run_rounds(trees, args.rounds, program, url, table, cycles)
        finally:
            if args.backend != "sqlite":
                bench.drop_table(url, table)
    return 0


def async_rounds(trees: list[tuple[str, str]], rounds: int, backend: str, cycles: int) -> int:
    """The async cycle's rounds, on the bench's table (each tree's bench uses its own name)."""
    with tempfile.TemporaryDirectory() as scratch:
        url = f"sqlite:///{scratch}/ab.db" if backend == "sqlite" else bench.URLS[backend]
        bench.fresh_table(url)
        try:
            run_rounds(trees, rounds, _ASYNC_ROUND, url, str(cycles))
        finally:
            bench.drop_table(url, bench.TABLE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
