"""What the library's layers cost an uncontended cycle: sqllocker against the same duties done
flat, in one function per acquire and per release.

Issue 5 asks for 0.85x of the raw floor. The library's Python is spread thin (no piece of it
above a few microseconds), so the question left is whether any Python around these statements
could reach the goal. Interleaved rounds, in one process, on one Locker's connections, each
system's cycle timed in turn (the order reversed every other round):

- ``floor``: bench.py's raw floor, the statements alone on one held cursor;
- ``flat``: acquire and release each as one function doing what a lock cycle must: check the
  lockstring, a new guid, the holder's details, a connection from the Locker's stack, the same
  statements (compiled from ``sqllocker.statements``), a plain object with a finaliser for the
  caller, and the release's rowcount checked;
- ``flat + Lock``: the same, but handing out the library's own ``Lock`` (its state, deadline
  and finaliser) and releasing it as ``Lock.unlock`` does (under the state's lock, leaving the
  keep-alive registry);
- ``sqllocker``: ``locker.lock(name).unlock()``.

What ``flat`` leaves out, sqllocker must do: retries after a lost connection or contention,
errors translated and named, taking over an expired row, the options of ``lock()``. So ``flat``
is a bound for Python with these statements, not a design.

    .venv/bin/python scripts/flat_cycle.py --rounds 10        # SQLite; --url for a server's

A backend whose acquire returns no row (MySQL 8, without RETURNING; MariaDB has it) has no
flat cycle.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts import bench
from sqllocker import Locker, LockLost
from sqllocker.execution import Prepared
from sqllocker.identity import _static_identity
from sqllocker.lock import Lock, LockState

SYSTEMS = ("floor", "flat", "flat + Lock", "sqllocker")


class FlatCycles:
    """The two flat cycles, on ``locker``'s connection stack and statements."""

    def __init__(self, locker: Locker) -> None:
        locker.lock("compile").unlock()  # connect, learn the backend
        table = locker._table
        if not table.backend.insert_returning:
            raise SystemExit(f"{table.backend.name}: the acquire returns no row; no flat cycle")
        stack = table._stack
        if stack is None:
            raise SystemExit("the Locker has no connection stack (an in-memory database?)")
        self.locker, self.stack = locker, stack
        dialect = table.engine.dialect
        self.acquire = Prepared(table.statements.acquire, dialect)
        self.release = Prepared(table.statements.release, dialect)
        self.ttl = locker.expires
        self.ttl_value = table.backend.seconds_value(locker.expires)
        self.minus_grace = table.backend.seconds_value(-locker.grace)
        self.run = os.getpid()

    def _insert(self, lockstring: str) -> tuple[Any, str, dict[str, Any], float]:
        """The acquire's work up to its row: (row, guid, holder details, monotonic time sent)."""
        if not isinstance(lockstring, str) or not 0 < len(lockstring) <= 128:
            raise ValueError(f"bad lockstring {lockstring!r}")
        guid = os.urandom(16).hex()
        host, program, user = _static_identity()
        details = {
            "host": host,
            "pid": os.getpid(),
            "thread": threading.current_thread().name,
            "program": program,
            "user": user,
            "guid": guid,
        }
        values = {
            "ls": lockstring,
            "lock_guid": guid,
            "ttl": self.ttl_value,
            "minus_grace": self.minus_grace,
            "holder": details,
        }
        held = self.stack.take()
        try:
            sent_at = time.monotonic()
            held.cursor.execute(self.acquire.sql, self.acquire.parameters(values))
            rows = held.cursor.fetchall()
        finally:
            self.stack.give_back(held)
        if not rows:
            raise RuntimeError(f"{lockstring!r} is held: the flat cycles use fresh names")
        return rows[0], guid, details, sent_at

    def _delete(self, lockstring: str, lock_id: int, guid: str) -> None:
        held = self.stack.take()
        try:
            values = {"lock_id": lock_id, "lock_guid": guid}
            held.cursor.execute(self.release.sql, self.release.parameters(values))
            deleted = held.cursor.rowcount
        finally:
            self.stack.give_back(held)
        if deleted != 1:
            raise LockLost(f"{lockstring!r} was no longer ours", lockstring, lock_id)

    def flat(self, n: int) -> None:
        row, guid, details, _sent_at = self._insert(f"flat {self.run} {n}")
        held = _Bare(row[0], guid, details)
        self._delete(f"flat {self.run} {n}", held.lock_id, held.guid)
        held.finalizer.detach()

    def flat_lock(self, n: int) -> None:
        lockstring = f"flat lock {self.run} {n}"
        row, guid, details, sent_at = self._insert(lockstring)
        state = LockState(self.locker, lockstring, row[0], guid, self.ttl, sent_at, None)
        lock = Lock(state, created=row[1], expires=row[2], locked_by=details)
        with state.op_lock:
            state.held = False
            self.locker._forget_kept_alive(state)
            self._delete(lockstring, state.lock_id, state.guid)
        lock._finalizer.detach()


class _Bare:
    """The least a caller's handle can be: the row's id and guid, and a finaliser for a handle
    dropped while held (here one that does nothing)."""

    __slots__ = ("__weakref__", "details", "finalizer", "guid", "lock_id")

    def __init__(self, lock_id: int, guid: str, details: dict[str, Any]) -> None:
        self.lock_id, self.guid, self.details = lock_id, guid, details
        self.finalizer = weakref.finalize(self, _abandoned, lock_id)


def _abandoned(_lock_id: int) -> None:
    pass


def rounds(url: str, count: int, how_many: int) -> dict[str, list[float]]:
    """Each system's microseconds per cycle, per round."""
    floor, close_floor = bench.raw_floor_cycle(url)
    library, close_library = bench.sqllocker_cycle(url)
    locker = Locker(url, table=bench.TABLE)
    flat = FlatCycles(locker)
    cycles: dict[str, Callable[[int], None]] = {
        "floor": floor,
        "flat": flat.flat,
        "flat + Lock": flat.flat_lock,
        "sqllocker": library,
    }
    took: dict[str, list[float]] = {name: [] for name in SYSTEMS}
    try:
        for cycle in cycles.values():
            for n in range(200):  # warm up
                cycle(-n - 1)
        for number in range(how_many):
            order = SYSTEMS if number % 2 == 0 else tuple(reversed(SYSTEMS))
            for name in order:
                first = (number + 1) * count
                started = time.perf_counter()
                for n in range(first, first + count):
                    cycles[name](n)
                took[name].append((time.perf_counter() - started) / count * 1e6)
    finally:
        close_floor()
        close_library()
        locker.close()
    return took


def report(took: dict[str, list[float]]) -> None:
    floor = took["floor"]
    print("floor us/cycle: " + " ".join(f"{us:.0f}" for us in floor))
    for name in SYSTEMS[1:]:
        ratios = [f / us for f, us in zip(floor, took[name], strict=True)]
        print(
            f"{name:12s} x floor: "
            + " ".join(f"{ratio:.3f}" for ratio in ratios)
            + f"   median {statistics.median(ratios):.3f}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--cycles", type=int, default=4000, help="per system and round")
    parser.add_argument("--url", help="a server's URL (default: a scratch SQLite file)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        url = args.url or f"sqlite:///{scratch}/flat.db"
        bench.fresh_table(url)
        try:
            report(rounds(url, args.cycles, args.rounds))
        finally:
            bench.drop_table(url, bench.TABLE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
