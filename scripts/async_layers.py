"""Where the async front end's uncontended cycle goes beyond its floor, layer by layer.

``sqllocker.asyncio`` runs the sync front end's operations in a greenlet (SQLAlchemy's
``greenlet_spawn``) on the AsyncEngine's adapted driver connections, and puts each acquire and
release in a task of its own, shielded from the caller's cancellation. bench.py puts it at
0.5-0.7 of the async floor. Interleaved rounds, in one process, on one AsyncLocker's engine,
each system's cycle timed in turn (the order reversed every other round):

- ``floor``: bench.py's async raw floor, sqllocker's statements awaited on the driver's own
  cursor, one held connection;
- ``greenlet``: the same statements through SQLAlchemy's adapted cursor (what the lock
  operations run on), each statement in a ``greenlet_spawn`` of its own, one held connection;
- ``greenlet + pool``: the same, each statement on a connection checked out of the engine's
  pool and given back, with its kept cursor (as ``LockTable`` runs an operation);
- ``sqllocker.asyncio``: ``await (await locker.lock(name)).unlock()``.

    .venv/bin/python scripts/async_layers.py --rounds 4        # SQLite; --url for a server's
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from sqlalchemy.util import greenlet_spawn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts import bench
from sqllocker.asyncio import AsyncLocker
from sqllocker.execution import kept_cursor

SYSTEMS = ("floor", "greenlet", "greenlet + pool", "sqllocker.asyncio")


class Layers:
    """One cycle of each system, on one AsyncLocker's engine; ``await open()`` first."""

    def __init__(self, locker: AsyncLocker) -> None:
        self.locker = locker
        self._engine = locker.engine.sync_engine
        self._run = os.getpid()

    async def open(self) -> None:
        """Connect, learn the backend (by a first cycle) and hold the floors' connection."""
        await (await self.locker.lock(f"layers {self._run} compile")).unlock()
        self.floor_statements = bench.FloorStatements(self.locker._table)
        self._held: Any = await greenlet_spawn(self._engine.raw_connection)
        cursor = self._held.driver_connection.cursor()
        if inspect.isawaitable(cursor):  # aiosqlite and aiomysql; psycopg's is plain
            cursor = await cursor
        self._driver_cursor = cursor
        self._adapted_cursor = await greenlet_spawn(self._held.dbapi_connection.cursor)

    async def close(self) -> None:
        await self._driver_cursor.close()
        await greenlet_spawn(self._held.close)

    def cycles(self) -> dict[str, Callable[[int], Awaitable[None]]]:
        own = (self.floor, self.greenlet, self.pooled, self.sqllocker)
        return dict(zip(SYSTEMS, own, strict=True))

    async def floor(self, n: int) -> None:
        statements, cursor = self.floor_statements, self._driver_cursor
        guid = os.urandom(16).hex()
        await cursor.execute(statements.acquire.sql, statements.acquire_parameters(n, guid))
        lock_id = (await cursor.fetchall())[0][0]
        await cursor.execute(statements.release.sql, statements.release_parameters(lock_id, guid))

    async def greenlet(self, n: int) -> None:
        guid = os.urandom(16).hex()
        lock_id = await greenlet_spawn(self._acquire_on, self._adapted_cursor, n, guid)
        await greenlet_spawn(self._release_on, self._adapted_cursor, lock_id, guid)

    async def pooled(self, n: int) -> None:
        guid = os.urandom(16).hex()
        lock_id = await greenlet_spawn(self._checked_out, self._acquire_on, n, guid)
        await greenlet_spawn(self._checked_out, self._release_on, lock_id, guid)

    async def sqllocker(self, n: int) -> None:
        await (await self.locker.lock(f"layers {self._run} {n}")).unlock()

    def _acquire_on(self, cursor: Any, n: int, guid: str) -> int:
        statements = self.floor_statements
        cursor.execute(statements.acquire.sql, statements.acquire_parameters(n, guid))
        return int(cursor.fetchall()[0][0])

    def _release_on(self, cursor: Any, lock_id: int, guid: str) -> None:
        statements = self.floor_statements
        cursor.execute(statements.release.sql, statements.release_parameters(lock_id, guid))

    def _checked_out(self, statement: Callable[..., Any], *args: Any) -> Any:
        pooled = self._engine.raw_connection()
        try:
            return statement(kept_cursor(pooled), *args)
        finally:
            pooled.close()


async def rounds(url: str, rounds_wanted: int, count: int) -> dict[str, list[float]]:
    """Microseconds per cycle of each system, one figure per round."""
    locker = AsyncLocker(url, table=bench.TABLE)
    layers = Layers(locker)
    await layers.open()
    cycles = list(layers.cycles().items())
    figures: dict[str, list[float]] = {name: [] for name in SYSTEMS}
    serial = 0
    try:
        for number in range(rounds_wanted):
            for name, cycle in cycles if number % 2 == 0 else reversed(cycles):
                started = time.perf_counter()
                for _ in range(count):
                    await cycle(serial)
                    serial += 1
                figures[name].append((time.perf_counter() - started) / count * 1e6)
    finally:
        await layers.close()
        await locker.aclose()
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a database URL (default: an SQLite file made here)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--count", type=int, default=2000, help="cycles per system per round")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        url = args.url or f"sqlite:///{scratch}/layers.db"
        bench.fresh_table(url)
        try:
            figures = asyncio.run(rounds(url, args.rounds, args.count))
        finally:
            bench.drop_table(url, bench.TABLE)
    floor = statistics.median(figures["floor"])
    for name in SYSTEMS:
        each = " / ".join(f"{figure:.0f}" for figure in figures[name])
        median = statistics.median(figures[name])
        print(f"{name:18} {median:8.1f} us a cycle (x floor {floor / median:.2f}; rounds {each})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
