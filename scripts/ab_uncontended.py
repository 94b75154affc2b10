"""Compare the uncontended sync cycle of two or more source trees, interleaved.

The library's own Python is a few tens of microseconds a cycle, and one run moves by more
than a single change to it is worth, so a change is judged against the code before it in
alternating rounds: each round, every tree (in a fresh interpreter, from that tree) measures
a raw floor and its own ``Locker``, back to back, best of two runs each, reversing the order
of the trees every other round. The floor's code is defined here, not in the trees, so that
every tree runs the very same floor: sqllocker's acquire and release statements on one held
driver connection, with values of the size sqllocker sends. The statements are that tree's
(``sqllocker.statements``), so a change to them shows in ``floor_us``, and ``x_floor`` is
against the floor of the statements the tree sends. Make the other tree with
``git worktree add /tmp/base HEAD``, then:

    .venv/bin/python scripts/ab_uncontended.py --rounds 4 new=. base=/tmp/base

A change worth a few microseconds of Python is lost in that noise (a round's ratio moves by
0.1, about 20 us of an SQLite cycle). ``--stub-driver`` times the library's own Python alone:
each tree's ``Locker`` on SQLite with its connection's cursor replaced by a stub that answers
at once as the database would (the acquire's row, the release's rowcount), best of five runs
per round, as ``library_us``; and the floor's own Python (its guid, parameters and JSON) on the
same stub, as ``floor_us``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts import bench
from scripts.interleaved import print_medians, run_rounds, trees_of

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
for held in locker._operations._stack._idle:
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--cycles", type=int, default=3000)
    parser.add_argument("--backend", choices=["sqlite", "postgresql", "mysql"], default="sqlite")
    parser.add_argument(
        "--stub-driver", action="store_true", help="time the library's Python alone (SQLite)"
    )
    parser.add_argument("trees", nargs="+", help="name=path of a checkout, two or more")
    args = parser.parse_args()
    trees = trees_of(parser, args.trees)
    if args.stub_driver and args.backend != "sqlite":
        parser.error("--stub-driver stubs SQLite's answers: use it with --backend sqlite")
    program = _STUB_ROUND if args.stub_driver else _ONE_ROUND
    cycles = str(args.cycles * 5 if args.stub_driver else args.cycles)
    table = "ab_uncontended"
    with tempfile.TemporaryDirectory() as scratch:
        sqlite_url = f"sqlite:///{scratch}/"
        url = sqlite_url if args.backend == "sqlite" else bench.URLS[args.backend]
        try:
            results = run_rounds(trees, args.rounds, program, url, table, cycles)
        finally:
            if args.backend != "sqlite":
                bench.drop_table(url, table)
    print_medians(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
