"""Benchmark sqllocker against the raw floor and the alternatives, in one run.

    .venv/bin/pip install -e '.[bench]'
    .venv/bin/python scripts/bench.py --quick      # under a minute
    .venv/bin/python scripts/bench.py --out docs   # the performance page's figures

Every ratio compares figures of the same run, against the *raw floor*: sqllocker's own
statements, straight through the driver (``FloorStatements``). The rows, and what each means,
are on the page this writes: bench.json, bench.png and performance.md in --out
(bench-results/); ``--render-only`` rewrites the page and chart from the bench.json there.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import collections
import contextlib
import fcntl
import functools
import importlib.metadata
import inspect
import itertools
import json
import multiprocessing as mp
import os
import sqlite3
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from sqllocker import Locker, lock_table
from sqllocker.engine import create_locker_engine, resolve_url
from sqllocker.migrations import current_revision, downgrade, upgrade

try:
    from sqllocker.schema import version_table_for
except ImportError:  # a tree from before schema held it (the A/B tool runs this file on others)
    from sqllocker.migrations import version_table_for  # type: ignore[attr-defined]

if TYPE_CHECKING:  # the A/B tool runs this file on other trees, whose internals may differ
    from sqllocker.operations import LockOperations

URLS = {
    "sqlite": "sqlite:///bench-results/bench.db",
    "postgresql": os.environ.get(
        "SQLLOCKER_BENCH_POSTGRES_URL", "postgresql://postgres@127.0.0.1/test"
    ),
    "mysql": os.environ.get("SQLLOCKER_BENCH_MYSQL_URL", "mysql://root@127.0.0.1/test"),
}
REDIS_URL = os.environ.get("SQLLOCKER_BENCH_REDIS_URL", "redis://127.0.0.1:6379/15")
TABLE = "sqllocker_bench"
FULL_TABLE = "sqllocker_bench_full"  # the scale row's table with a million other rows


# Where the benchmark's worker processes come from: a fork server that has imported the drivers
# and sqllocker once, holding no connection. Each worker is a fork of it, with nothing of the
# parent's (as with spawn), without the second or two of imports a spawned interpreter pays,
# which made up most of a --quick run's contended and scale rows.
PROCESSES = mp.get_context("forkserver")
PROCESSES.set_forkserver_preload(["sqlalchemy", "psycopg", "pymysql", "redis", "sqllocker"])


def start_processes(
    processes: int, target: Callable[..., None], *args: Any
) -> Callable[[float], list[Any]]:
    """``processes`` processes each running ``target(*args, queue)``; what is returned, given a
    timeout in seconds, returns what each put on ``queue``, once they have all ended."""
    queue = PROCESSES.Queue()
    workers = [PROCESSES.Process(target=target, args=(*args, queue)) for _ in range(processes)]
    for worker in workers:
        worker.start()

    def collect(timeout: float) -> list[Any]:
        results = [queue.get(timeout=timeout) for _ in workers]
        for worker in workers:
            worker.join()
        return results

    return collect


@dataclass(frozen=True)
class Profile:
    """How much one run measures: the page's figures, or a smoke run's (``--quick``)."""

    cycles: int  # uncontended cycles per system and round, and the scale row's
    uncontended_rounds: int  # rounds in which each uncontended system runs in turn
    contended_seconds: float  # each contended row's every round
    contended_rounds: int  # rounds in which each contended system runs in turn
    other_rows: int  # rows beside the scale row's cycles, and the purge's backlog
    scale_seconds: float  # each processes row, and the purge row's quiet stretch
    scale_rounds: int  # rounds of the empty and the full table, best of
    kept_alive: int  # locks held and kept alive by the connections row
    kept_alive_expires: float  # their expiry period: each is renewed at a third of it
    sampled_seconds: float  # how long the connections row samples, every 0.1 s


FULL = Profile(5000, 5, 5.0, 3, 1_000_000, 5.0, 3, 1000, 30.0, 15.0)
QUICK = Profile(500, 1, 1.0, 1, 20_000, 0.5, 1, 100, 3.0, 3.0)


def percentile(values: Sequence[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


Cycle = tuple[Callable[[int], None], Callable[[], None]]  # (a cycle of lockstring n, close)
AsyncCycle = tuple[Callable[[int], Awaitable[None]], Callable[[], Awaitable[None]]]


def timed_cycles(make: Callable[[], Cycle], count: int) -> dict[str, float]:
    """The figures of ``count`` cycles of what ``make`` makes, after a warm-up (of caches,
    prepared statements, pools); it is closed after them."""
    cycle, close = make()
    for n in range(min(200, count // 10)):
        cycle(-n - 1)
    latencies = []
    started = time.perf_counter()
    for n in range(count):
        t0 = time.perf_counter()
        cycle(n)
        latencies.append(time.perf_counter() - t0)
    figures = cycle_figures(latencies, time.perf_counter() - started)
    close()
    return figures


async def timed_async_cycles(
    make: Callable[[], Awaitable[AsyncCycle]], count: int
) -> dict[str, float]:
    """``timed_cycles`` of an async cycle."""
    cycle, close = await make()
    for n in range(min(200, count // 10)):
        await cycle(-n - 1)
    latencies = []
    started = time.perf_counter()
    for n in range(count):
        t0 = time.perf_counter()
        await cycle(n)
        latencies.append(time.perf_counter() - t0)
    figures = cycle_figures(latencies, time.perf_counter() - started)
    await close()
    return figures


def cycle_figures(latencies: list[float], elapsed: float) -> dict[str, float]:
    return {
        "cycles_per_s": len(latencies) / elapsed,
        "p50_ms": percentile(latencies, 0.5) * 1000,
        "p99_ms": percentile(latencies, 0.99) * 1000,
    }


def plain_connection(url: str) -> Any:
    """A plain driver connection (psycopg, PyMySQL) in autocommit mode, made with the arguments
    SQLAlchemy's dialect reads from ``url``: the alternatives' baseline."""
    engine = sa.create_engine(resolve_url(url))
    cargs, cparams = engine.dialect.create_connect_args(engine.url)
    return engine.dialect.connect(*cargs, **cparams, autocommit=True)


def fresh_table(url: str, table: str = TABLE) -> None:
    """An empty lock table made as users make it, by the migrations (on PostgreSQL they add the
    trigger whose NOTIFY wakes waiters), on an engine of sqllocker's: a new SQLite file gets
    the page size a Locker gives it."""
    drop_table(url, table)
    engine = create_locker_engine(resolve_url(url))
    upgrade(engine, table)
    engine.dispose()


def drop_table(url: str, table: str) -> None:
    """The lock table and what its migrations made beside it, gone (by the migrations
    themselves, where the table has its version table)."""
    engine = sa.create_engine(resolve_url(url))
    if current_revision(engine, table) is not None:
        downgrade(engine, table)
    with engine.begin() as conn:
        conn.exec_driver_sql(f"DROP VIEW IF EXISTS {table}_held")  # a table left by hand
        conn.exec_driver_sql(f"DROP TABLE IF EXISTS {table}")
        conn.exec_driver_sql(f"DROP TABLE IF EXISTS {version_table_for(table)}")
    engine.dispose()


# -- uncontended ----------------------------------------------------------------------------------


class FloorStatements:
    """sqllocker's acquire and release statements, compiled for one dialect, as SQL text and
    driver parameters: what the raw floors send, with values of the same size as sqllocker's."""

    def __init__(self, table: LockOperations) -> None:
        from sqllocker.execution import Prepared
        from sqllocker.identity import holder_details

        backend, statements, dialect = table.backend, table.statements, table.engine.dialect
        self.acquire = Prepared(statements.acquire, dialect)
        self.release = Prepared(statements.release, dialect)
        self._ttl, self._minus_grace = backend.seconds_value(3600), backend.seconds_value(-1)
        self._run = os.getpid()
        self._holder = holder_details({})  # made once: the floor's rows, not its work
        # What the floor's connection runs first, to be set up as a plain application's.
        # SQLite: its default checkpoint, which a Locker's connections leave to its releases; a
        # floor without one never copied its write-ahead log back, and the Locker timed after it
        # paid for all of it.
        self.settings = ["PRAGMA wal_autocheckpoint=1000"] if backend.name == "sqlite" else []

    def lockstring(self, n: int) -> str:
        return f"floor {self._run} {n}"

    def acquire_parameters(self, n: int, guid: str) -> Any:
        values = {
            "ls": self.lockstring(n),
            "lock_guid": guid,
            "ttl": self._ttl,
            "minus_grace": self._minus_grace,
            "holder": {**self._holder, "guid": guid},
        }
        return self.acquire.parameters(values)

    def release_parameters(self, lockstring: str, lock_id: int, guid: str) -> Any:
        values = {"ls": lockstring, "lock_id": lock_id, "lock_guid": guid}
        return self.release.parameters(values)


def raw_floor_cycle(url: str) -> Cycle:
    """sqllocker's own acquire and release statements, straight through the driver (on a
    connection made as sqllocker makes its own)."""
    locker = Locker(url, table=TABLE)
    locker.lock("compile").unlock()  # connect, learn the backend
    floor = FloorStatements(locker._operations)
    raw = locker.engine.raw_connection()
    connection: Any = raw.driver_connection
    cursor = connection.cursor()
    for setting in floor.settings:
        cursor.execute(setting)

    def cycle(n: int) -> None:
        guid = os.urandom(16).hex()  # as sqllocker.identity.new_guid
        cursor.execute(floor.acquire.sql, floor.acquire_parameters(n, guid))
        lock_id = cursor.fetchall()[0][0]
        released = floor.release_parameters(floor.lockstring(n), lock_id, guid)
        cursor.execute(floor.release.sql, released)

    def close() -> None:
        cursor.close()
        raw.close()
        locker.close()

    return cycle, close


FLAT = "flat cycle"
FLAT_CYCLES = {"sqlite"}  # where the uncontended goal is the sync cycle's


def flat_cycle(url: str) -> Cycle:
    """What any Python around the floor's statements must do for a lock cycle with the
    library's API, in one function per acquire and per release: a bound that a library of
    layers can approach, not pass (the design tried, where the uncontended goal is missed).

    The acquire checks the lockstring, makes a guid and the holder's details, runs the
    acquire statement on a connection of the Locker's own stack, and hands out the library's
    own ``Lock``: its state (validity deadline, the lock that orders its release after a
    renewal) and its finaliser, and on SQLite what its release rings for a waiter that queued
    meanwhile. The release deletes the row by id and guid under that lock, checks the count,
    rings, detaches the finaliser, and checkpoints SQLite's log as the Locker's releases do.

    Left out, which the library does: retries after a lost connection or contention, errors
    translated and named, the takeover of an expired row, the deadlines that end a statement
    on a frozen connection, telemetry, and ``lock()``'s options."""
    from sqllocker import LockLost, clock
    from sqllocker.identity import holder_details, new_guid
    from sqllocker.lock import Lock, LockState
    from sqllocker.validation import check_lockstring

    locker = Locker(url, table=TABLE)
    locker.lock("compile").unlock()  # connect, learn the backend
    operations = locker._operations
    stack = operations.database.pool.stack
    if stack is None or not operations.backend.insert_returning:
        raise SystemExit(f"{url}: no connection stack, or an acquire that returns no row")
    attempts = locker._acquirer.attempts
    file_queue, offset = attempts.file_queue, attempts._offset
    ttl, statements = locker.expires, FloorStatements(operations)
    run = os.getpid()

    def lock(lockstring: str) -> Lock:
        check_lockstring(lockstring)
        guid, details = new_guid(), holder_details({})
        parameters = statements.acquire.parameters(
            {
                "ls": lockstring,
                "lock_guid": guid,
                "ttl": statements._ttl,
                "minus_grace": statements._minus_grace,
                "holder": details,
            }
        )
        held = stack.take()
        try:
            sent_at = clock.now()
            held.cursor.execute(statements.acquire.sql, parameters)
            rows = held.cursor.fetchall()
        finally:
            stack.give_back(held)
        lock_id, created, expires = rows[0]
        state = LockState(
            operations, locker._call, locker._keep_alives, lockstring, lock_id, guid, ttl,
            sent_at, None,
        )  # fmt: skip
        if file_queue is not None:
            state.place = file_queue.unplaced(offset(lockstring))
        return Lock(locker, state, created=created, expires=expires, locked_by=details)

    def unlock(lock: Lock) -> None:
        state = lock._state
        with state.op_lock:
            held = stack.take()
            try:
                held.cursor.execute(
                    statements.release.sql,
                    statements.release_parameters(state.lockstring, state.lock_id, state.guid),
                )
                deleted = held.cursor.rowcount
            finally:
                stack.give_back(held)
            if deleted != 1:
                raise LockLost("no longer ours", state.lockstring, state.lock_id)
            state.held = False
            state.leave_place()
        lock._finalizer.detach()
        if operations.checkpoint_due():
            operations.checkpoint()

    def cycle(n: int) -> None:
        unlock(lock(f"flat {run} {n}"))

    return cycle, locker.close


def sqllocker_cycle(url: str, table: str = TABLE, **options: Any) -> Cycle:
    locker = Locker(url, table=table, **options)
    run = os.getpid()

    def cycle(n: int) -> None:
        locker.lock(f"lib {run} {n}").unlock()

    return cycle, locker.close


async def async_raw_floor_cycle(url: str, layer: str = "driver") -> AsyncCycle:
    """The same statements through the async driver (psycopg async, aiosqlite, aiomysql) on one
    held connection of the AsyncLocker's own engine, with no library around them; or, by
    ``layer``, in what ``sqllocker.asyncio`` runs its statements in (``ASYNC_LAYERS``): each
    operation in a greenlet through SQLAlchemy's adapted cursor (``"greenlet"``), and that run
    to its end whoever stops waiting for it (``"shielded"``), as the lock operations run."""
    from sqllocker.asyncio import AsyncLocker
    from sqllocker.asyncio.concurrency import shielded
    from sqllocker.asyncio.greenlets import run as in_greenlet

    locker = AsyncLocker(url, table=TABLE)
    await (await locker.lock("compile")).unlock()
    floor = FloorStatements(locker._operations)
    raw = await in_greenlet(locker.engine.sync_engine.raw_connection)
    connection: Any = raw.driver_connection
    cursor = connection.cursor()
    if inspect.isawaitable(cursor):  # aiosqlite and aiomysql; psycopg's is plain
        cursor = await cursor
    for setting in floor.settings:
        await cursor.execute(setting)
    adapted = await in_greenlet(raw.cursor)
    # aiosqlite: each statement as the library sends it, in one hop to its thread, or none
    # where it need not wait (the layers'; the floor's own hops every statement). Not asked
    # for the floor, which the A/B tool runs on trees of other versions too.
    backend = locker._operations.backend
    one_call = None if layer == "driver" else backend.in_one_call(raw.dbapi_connection, True)
    fetches_all = hasattr(connection, "execute_fetchall")  # aiosqlite's one call for the rows

    async def cycle(n: int) -> None:
        guid = os.urandom(16).hex()  # as sqllocker.identity.new_guid
        parameters = floor.acquire_parameters(n, guid)
        if fetches_all:
            rows = await connection.execute_fetchall(floor.acquire.sql, parameters)
            lock_id = next(iter(rows))[0]
        else:
            await cursor.execute(floor.acquire.sql, parameters)
            lock_id = (await cursor.fetchall())[0][0]
        released = floor.release_parameters(floor.lockstring(n), lock_id, guid)
        await cursor.execute(floor.release.sql, released)

    def acquire(n: int, guid: str) -> int:
        parameters = floor.acquire_parameters(n, guid)
        if one_call is not None:
            return int(one_call(floor.acquire.sql, parameters, True)[0][0][0])
        adapted.execute(floor.acquire.sql, parameters)
        return int(adapted.fetchall()[0][0])

    def release(n: int, lock_id: int, guid: str) -> None:
        parameters = floor.release_parameters(floor.lockstring(n), lock_id, guid)
        if one_call is not None:
            one_call(floor.release.sql, parameters, False)
        else:
            adapted.execute(floor.release.sql, parameters)

    async def in_greenlets(n: int) -> None:
        guid = os.urandom(16).hex()
        lock_id = await in_greenlet(acquire, n, guid)
        await in_greenlet(release, n, lock_id, guid)

    async def run_to_its_end(n: int) -> None:
        guid = os.urandom(16).hex()
        lock_id = await shielded(in_greenlet(acquire, n, guid), "bench acquire", _kept)
        await shielded(in_greenlet(release, n, lock_id, guid), "bench release", _kept)

    async def close() -> None:
        await in_greenlet(adapted.close)
        await cursor.close()
        await in_greenlet(raw.close)
        await locker.aclose()

    cycles = {"driver": cycle, "greenlet": in_greenlets, "shielded": run_to_its_end}
    return cycles[layer], close


def _kept(_outcome: object) -> None:
    """A cancelled bench cycle leaves its row: the table is dropped after the run."""


async def async_sqllocker_cycle(url: str) -> AsyncCycle:
    from sqllocker.asyncio import AsyncLocker

    locker = AsyncLocker(url, table=TABLE)
    run = os.getpid()

    async def cycle(n: int) -> None:
        await (await locker.lock(f"async lib {run} {n}")).unlock()

    return cycle, locker.aclose


# The async floor, then the layers sqllocker.asyncio runs the same statements in, one at a
# time, then the library: what each layer costs is its figure against the one before.
ASYNC_LAYERS = {
    "async raw floor": "driver",
    "async floor in greenlets": "greenlet",
    "async floor in shielded tasks": "shielded",
}


async def async_figures(
    url: str, count: int, rounds: int, layers: bool = True
) -> list[dict[str, dict[str, float]]]:
    """The async floor, its ``layers`` and AsyncLocker, taken in turn ``rounds`` times in one
    event loop: each round's figures."""
    systems: list[tuple[str, Callable[[], Awaitable[AsyncCycle]]]] = [
        (name, functools.partial(async_raw_floor_cycle, url, layer))
        for name, layer in list(ASYNC_LAYERS.items())[: None if layers else 1]
    ]
    systems.append(("sqllocker.asyncio", functools.partial(async_sqllocker_cycle, url)))
    return [
        {name: await timed_async_cycles(make, count) for name, make in systems}
        for _round in range(rounds)
    ]


def rounds_in_turn(
    systems: Sequence[tuple[str, Callable[[], Cycle]]], count: int, rounds: int
) -> list[dict[str, dict[str, float]]]:
    """Each round's figures of ``systems`` (name, maker of its cycle), each run in turn."""
    return [{name: timed_cycles(make, count) for name, make in systems} for _round in range(rounds)]


def paired_rows(
    backend: str, per_round: list[dict[str, dict[str, float]]], floor: str
) -> list[dict[str, Any]]:
    """Each system's row from rounds in which every system ran in turn: its median round's
    figures, and as its ratio the median over the rounds of its cycles/s over the floor's of
    the same round. A burst of load then weighs on both sides of a ratio, and no one round's
    luck (a best run) decides it: a cycle's disk flushes alone vary by more than the library's
    share of it from one run to the next."""
    rows = []
    for name in per_round[0]:
        ordered = sorted((figures[name] for figures in per_round), key=lambda f: f["cycles_per_s"])
        ratios = [run[name]["cycles_per_s"] / run[floor]["cycles_per_s"] for run in per_round]
        rows.append(
            {
                "backend": backend,
                "system": name,
                **ordered[(len(ordered) - 1) // 2],
                "ratio_to_floor": statistics.median(ratios),
                "ratio_range": [min(ratios), max(ratios)],
            }
        )
    return rows


# The servers' own locks of key(n), beside sqllocker's: row -> (take, give, key). A try-lock is
# in the uncontended rows (``TRY_LOCKS``), a blocking one in the contended rows.
PG_UNLOCK, MARIADB_UNLOCK = "SELECT pg_advisory_unlock(%s)", "SELECT RELEASE_LOCK(%s)"
SERVER_LOCKS: dict[str, tuple[str, str, Callable[[int], object]]] = {
    "advisory try-lock": ("SELECT pg_try_advisory_lock(%s)", PG_UNLOCK, int),
    "advisory lock": ("SELECT pg_advisory_lock(%s)", PG_UNLOCK, int),
    "GET_LOCK try-lock": ("SELECT GET_LOCK(%s, 0)", MARIADB_UNLOCK, "bench {}".format),
    "GET_LOCK": ("SELECT GET_LOCK(%s, 60)", MARIADB_UNLOCK, "bench {}".format),
}
TRY_LOCKS = {"sqlite": [], "postgresql": ["advisory try-lock"], "mysql": ["GET_LOCK try-lock"]}
BLOCKING_LOCKS = {"sqlite": "flock", "postgresql": "advisory lock", "mysql": "GET_LOCK"}
# sqllocker's contended protocol as bare statements: scripts/bench_floor.py, whose FIFO_FLOOR
# this is (that module is imported only where it is used: see ``floors``).
FIFO_FLOOR = "durable FIFO floor"
DOORBELL_FLOOR = "doorbell floor"  # a design tried on MariaDB: bench_floor.DOORBELL_FLOOR
# Redis: the floor (the bare SET NX and DEL of a key), and redis-py's Lock: row -> blocking.
REDIS_FLOOR = "raw SET NX + DEL"
REDIS_LOCKS = {"redis-py Lock (non-blocking)": False, "redis-py Lock": True}

LockCalls = tuple[Callable[[int], Any], Callable[[Any], Any], Callable[[], Any]]
"""(take lock n, returning what gives it back; give it back; close) of one system's lock."""


def lock_calls(system: str, url: str) -> LockCalls:
    """A row's lock, on a connection of its own: sqllocker's blocking lock of one lockstring
    (the contended rows'), a server's (``SERVER_LOCKS``), ``flock`` on a file beside the SQLite
    database (one machine's blocking lock, beside sqllocker's own queue file), redis-py's
    ``Lock`` (``REDIS_LOCKS``), ``REDIS_FLOOR``, ``FIFO_FLOOR`` or ``DOORBELL_FLOOR``."""
    if system in (FIFO_FLOOR, DOORBELL_FLOOR):
        floor: LockCalls = floors().fifo_floor_calls(url, TABLE, system)
        return floor
    if system == "sqllocker":
        locker = Locker(url, table=TABLE, grace=1)
        return (
            (lambda _: locker.lock("contended", wait=None, expires=60)),
            (lambda lock: lock.unlock()),
            locker.close,
        )
    if system == "flock":
        fd = os.open(url.removeprefix("sqlite:///") + "-flock", os.O_RDWR | os.O_CREAT, 0o644)
        return (
            (lambda _: fcntl.flock(fd, fcntl.LOCK_EX)),
            (lambda _: fcntl.flock(fd, fcntl.LOCK_UN)),
            (lambda: os.close(fd)),
        )
    if system in SERVER_LOCKS:
        take, give, key = SERVER_LOCKS[system]
        connection = plain_connection(url)
        cursor = connection.cursor()

        def run(statement: str, name: object) -> object:
            cursor.execute(statement, (name,))
            cursor.fetchone()
            return name

        return (lambda n: run(take, key(n))), functools.partial(run, give), connection.close
    import redis

    client = redis.Redis.from_url(REDIS_URL)

    def set_key(n: int) -> str:
        client.set(f"floor {n}", "token", nx=True, px=3_600_000)
        return f"floor {n}"

    def take_lock(n: int) -> Any:
        lock = client.lock(f"bench {n}", timeout=3600)
        lock.acquire(blocking=REDIS_LOCKS[system])
        return lock

    if system == REDIS_FLOOR:
        return set_key, client.delete, client.close
    return take_lock, lambda lock: lock.release(), client.close


def lock_cycle(system: str, url: str) -> Cycle:
    """``lock_calls(system, url)``'s lock n taken and given back."""
    take, give, close = lock_calls(system, url)
    return (lambda n: give(take(n))), close


def uncontended(
    backends: list[str], count: int, rounds: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The uncontended rows, and the async layers' (``ASYNC_LAYERS``)."""
    rows: list[dict[str, Any]] = []
    layers: list[dict[str, Any]] = []
    for backend in backends:
        url = URLS[backend]
        fresh_table(url)
        makers = [
            ("raw floor", functools.partial(raw_floor_cycle, url)),
            ("sqllocker", functools.partial(sqllocker_cycle, url)),
        ]
        if backend in FLAT_CYCLES:
            makers.append((FLAT, functools.partial(flat_cycle, url)))
        makers += [(name, functools.partial(lock_cycle, name, url)) for name in TRY_LOCKS[backend]]
        rows += paired_rows(backend, rounds_in_turn(makers, count, rounds), "raw floor")
        # The async rows' ratios are to the async floor: the same statements, the async driver.
        async_rounds = asyncio.run(async_figures(url, count, rounds))
        async_rows = paired_rows(backend, async_rounds, "async raw floor")
        layers += async_rows
        shown = ("async raw floor", "sqllocker.asyncio")  # the layers' rows have a section
        rows += [row for row in async_rows if row["system"] in shown]
    try:
        names = [REDIS_FLOOR, "redis-py Lock (non-blocking)"]
        redis_systems = [(name, functools.partial(lock_cycle, name, REDIS_URL)) for name in names]
        rows += paired_rows("redis", rounds_in_turn(redis_systems, count, rounds), REDIS_FLOOR)
    except Exception as error:  # Redis is optional: say so and go on
        print(f"redis skipped: {error}", file=sys.stderr)
    return rows, layers


OTEL_MODES = ("without OpenTelemetry", "API, no provider", "SDK provider")


def otel_cycle(url: str, mode: str) -> Cycle:
    """sqllocker's cycle as ``mode`` (``OTEL_MODES``) records it: as if ``opentelemetry-api``
    were not installed, with the API and no provider set, or into the SDK's in-memory metric
    reader and span exporter."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from sqllocker import telemetry

    installed, providers = telemetry._OPENTELEMETRY, dict[str, Any]()
    if mode == OTEL_MODES[0]:
        telemetry._OPENTELEMETRY = False  # what the module finds without the package
    elif mode == OTEL_MODES[2]:
        tracer_provider = TracerProvider()
        tracer_provider.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
        meter_provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
        providers = {"meter_provider": meter_provider, "tracer_provider": tracer_provider}
    cycle, close = sqllocker_cycle(url, **providers)

    def closing() -> None:
        close()
        telemetry._OPENTELEMETRY = installed

    return cycle, closing


def otel_rows(backends: list[str], count: int, rounds: int) -> list[dict[str, Any]]:
    """What recording costs the uncontended cycle: each mode against the first, in turn."""
    rows: list[dict[str, Any]] = []
    for backend in backends:
        fresh_table(URLS[backend])
        makers = [(mode, functools.partial(otel_cycle, URLS[backend], mode)) for mode in OTEL_MODES]
        rows += paired_rows(backend, rounds_in_turn(makers, count, rounds), OTEL_MODES[0])
    return rows


def _otel_section(results: dict[str, Any]) -> list[str]:
    rows = results.get("otel") or []
    if not rows:
        return []
    cells = [_paired_cells(row, "p50_ms") for row in rows]
    return [
        "",
        "## The cost of OpenTelemetry",
        "",
        "sqllocker's uncontended cycle as it records (see the observability page): as if",
        "`opentelemetry-api` were not installed, with it but no provider set (nothing is",
        "recorded), and into an SDK provider (metrics to an in-memory reader, spans to an",
        f"in-memory exporter), in {results['profile']['uncontended_rounds']} rounds in which",
        "each runs in turn; the ratio is to the first's cycles/s in the same round. Measured by",
        f"`scripts/bench.py --only otel{' --quick' if results.get('otel_quick') else ''}` on",
        f"{results.get('otel_measured_at', '?')}, a run of its own on a machine shared with",
        "other work: only the ratios compare.",
        *_table(
            "backend | OpenTelemetry | cycles/s | p50 ms | x without | rounds", "--::::", cells
        ),
    ]


# -- contended hand-off ---------------------------------------------------------------------------

HOLD_SECONDS = 0.001  # each contender holds the lock this long
STEP_BACK_SECONDS = 0.002  # and then pauses: the waiters, not the releaser, should get it next
WARM_UP_SECONDS = 0.5  # turns taken before the measured ones


def _contender(system: str, url: str, seconds: float, ready: Any, queue: Any) -> None:
    """One of the processes taking turns: it sets up its lock, waits at ``ready`` (a Barrier)
    until every other process and the parent have too, then asks, holds for HOLD_SECONDS,
    releases and steps back, for ``seconds``."""
    take, give, close = lock_calls(system, url)
    records = []
    ready.wait()
    # Turns before the clock starts count for nothing: a first use sets up the table's
    # statements and the connections (a waiter's first wait opens its queue's), and a process
    # done with that first would take many turns alone.
    started = time.monotonic()
    deadline = started + WARM_UP_SECONDS + seconds
    while time.monotonic() < deadline:
        asked = time.monotonic()
        token = take(0)
        got = time.monotonic()
        time.sleep(HOLD_SECONDS)
        left = time.monotonic()
        give(token)
        released = time.monotonic()
        if asked >= started + WARM_UP_SECONDS:
            records.append((asked, got, left, released))
        time.sleep(STEP_BACK_SECONDS)
    close()  # not left to the process's exit, which the server logs as a connection reset
    queue.put(records)


Turn = tuple[float, float, float, float]  # monotonic: asked, got, began releasing, released


def turn_figures(turns: list[Turn]) -> dict[str, Any]:
    """What the contended rows report of every process's turns together: hand-off latency,
    the wait, how unfair the order was, and overlaps (two holders at once; must be 0)."""
    turns = sorted(turns, key=lambda turn: turn[1])
    violations = sum(after[1] < before[2] for before, after in itertools.pairwise(turns))
    handoffs = [
        after[1] - before[3] for before, after in itertools.pairwise(turns) if after[0] < before[3]
    ]  # only when the next holder was already waiting
    waits = [got - asked for asked, got, _, _ in turns]
    gots = [turn[1] for turn in turns]
    # Fairness: how many acquisitions by others fell between each one's asking and its
    # getting. Served first come, first served, a process is passed at most once by each of the
    # others; a starved waiter would be passed many times.
    overtaken = [
        bisect.bisect_left(gots, got) - bisect.bisect_right(gots, asked)
        for asked, got, _, _ in turns
    ]
    return {
        "handoff_p50_ms": percentile(handoffs, 0.5) * 1000 if handoffs else None,
        "handoff_p99_ms": percentile(handoffs, 0.99) * 1000 if handoffs else None,
        "wait_p99_ms": percentile(waits, 0.99) * 1000,
        "overtaken_max": max(overtaken),
        # {passed by n others: how many acquisitions}
        "overtaken_counts": dict(sorted(collections.Counter(overtaken).items())),
        "violations": violations,
    }


def contend(system: str, url: str, processes: int, seconds: float) -> list[Turn]:
    """Every turn of ``processes`` contenders for ``seconds``, once all of them are ready."""
    ready = PROCESSES.Barrier(processes + 1)
    collect = start_processes(processes, _contender, system, url, seconds, ready)
    ready.wait(timeout=120)
    return [turn for turns in collect(seconds + 120) for turn in turns]


def contended(
    targets: list[tuple[str, str, str]],
    processes: int,
    seconds: float,
    rounds: int = 1,
) -> list[dict[str, Any]]:
    """Each target's row from ``rounds`` rounds of ``seconds`` in which every target runs in
    turn: its acquisitions/s the median round's (the lowest and highest beside it), the rest
    of every round's turns together. A contended row moved by a tenth and more from one run
    to the next, as the machine's load came and went."""
    turns: dict[tuple[str, str], list[Turn]] = {}
    rates: dict[tuple[str, str], list[float]] = {}
    for _round in range(rounds):
        for backend, system, url in targets:
            if system in ("sqllocker", FIFO_FLOOR, DOORBELL_FLOOR):
                fresh_table(url)
            records = contend(system, url, processes, seconds)
            turns.setdefault((backend, system), []).extend(records)
            rates.setdefault((backend, system), []).append(len(records) / seconds)
    return [
        {
            "backend": backend,
            "system": system,
            "processes": processes,
            "acquisitions_per_s": statistics.median(rates[backend, system]),
            "acquisitions_range": [min(rates[backend, system]), max(rates[backend, system])],
            "acquisitions_by_round": rates[backend, system],
            **turn_figures(turns[backend, system]),
        }
        for backend, system, _ in targets
    ]


# -- the server's durable commit ----------------------------------------------------------------

FLUSH_TABLE = f"{TABLE}_flush"  # commit_flush's scratch table


def commit_flush(backend: str, url: str, count: int = 200) -> dict[str, Any]:
    """What a durable commit costs the server now: the p50 of a one-row INSERT in autocommit,
    which the server answers only once its log is on disk, beside the p50 of a bare round trip
    (``SELECT 1``) on the same connection. A table lock's every acquisition and contended
    hand-off waits for one such flush, and advisory locks, ``GET_LOCK`` and Redis wait for none:
    a slow flush moves the contended rows far more than any change to the library did."""
    key = "bigserial" if backend == "postgresql" else "bigint AUTO_INCREMENT"
    create = f"CREATE TABLE {FLUSH_TABLE} (id {key} PRIMARY KEY, v integer)"
    connection = plain_connection(url)
    cursor = connection.cursor()
    try:
        cursor.execute(f"DROP TABLE IF EXISTS {FLUSH_TABLE}")
        cursor.execute(create)
        commits, round_trips = [], []
        for _ in range(count):
            started = time.perf_counter()
            cursor.execute(f"INSERT INTO {FLUSH_TABLE} (v) VALUES (1)")
            commits.append(time.perf_counter() - started)
            started = time.perf_counter()
            cursor.execute("SELECT 1")
            cursor.fetchall()
            round_trips.append(time.perf_counter() - started)
    finally:
        cursor.execute(f"DROP TABLE IF EXISTS {FLUSH_TABLE}")
        connection.close()
    return {
        "backend": backend,
        "commit_p50_ms": percentile(commits, 0.5) * 1000,
        "round_trip_p50_ms": percentile(round_trips, 0.5) * 1000,
    }


# -- scale ----------------------------------------------------------------------------------------


def fill(url: str, count: int, expired: bool, table_name: str = TABLE) -> None:
    """``count`` rows of other lockstrings, long expired or expiring far in the future."""
    moment = datetime(2000 if expired else 2999, 1, 1, tzinfo=timezone.utc)
    row = {"guid": "g", "created": moment, "expires": moment, "locked_by": {}}
    engine, insert = sa.create_engine(resolve_url(url)), lock_table(table_name).insert()
    with engine.begin() as conn:
        for start in range(0, count, 20_000):
            batch = range(start, min(count, start + 20_000))
            conn.execute(insert, [{**row, "lockstring": f"filler {n}"} for n in batch])
    engine.dispose()


def _cycler(url: str, seconds: float, stop: Any, queue: Any) -> None:
    """Cycles on distinct lockstrings for ``seconds``, or until ``stop`` (an Event) is set if
    there is one; each as (monotonic start, latency)."""
    cycle, close = sqllocker_cycle(url)
    samples = []
    deadline = time.monotonic() + seconds
    for n in itertools.count():
        started, t0 = time.monotonic(), time.perf_counter()
        if stop.is_set() if stop is not None else started >= deadline:
            break
        cycle(n)
        samples.append((started, time.perf_counter() - t0))
    close()
    queue.put(samples)


def purge_beside_a_worker(url: str, seconds: float) -> tuple[list[float], list[float], int, float]:
    """A worker cycling for ``seconds`` (quiet), then while the table's expired rows are purged
    with the defaults, as `sqllocker purge-expired` does: its latencies before and during the
    purge (one worker process, so both sides share its connection, cache and luck), the rows
    purged and how long the purge took."""
    stop = PROCESSES.Event()
    collect = start_processes(1, _cycler, url, 0.0, stop)
    time.sleep(seconds + 1.0)  # its first second (connecting, warming up) is left out below
    purger = Locker(url, table=TABLE)
    t0 = time.monotonic()
    purged = purger.purge_expired_locks()
    t1 = time.monotonic()
    purger.close()
    stop.set()
    [samples] = collect(120)
    quiet = [latency for started, latency in samples if t0 - seconds <= started < t0]
    busy = [latency for started, latency in samples if t0 <= started < t1]
    return quiet, busy, purged, t1 - t0


def scale(backends: list[str], profile: Profile) -> list[dict[str, Any]]:
    rows_in_table, count, seconds = profile.other_rows, profile.cycles, profile.scale_seconds
    rows: list[dict[str, Any]] = []
    for backend in backends:
        url = URLS[backend]
        fresh_table(url)
        fresh_table(url, FULL_TABLE)
        fill(url, rows_in_table, expired=False, table_name=FULL_TABLE)
        # The empty and the full table in turn, best of three each: measured once each, minutes
        # apart, this row moved between runs by more than the 20% it is judged by.
        tables = [("empty", TABLE), ("full", FULL_TABLE)]
        makers = [(name, functools.partial(sqllocker_cycle, url, table)) for name, table in tables]
        per_round = rounds_in_turn(makers, count, profile.scale_rounds)
        drop_table(url, FULL_TABLE)
        empty, full = (max(r[name]["cycles_per_s"] for r in per_round) for name, _ in tables)
        row = functools.partial(scale_row, backend)
        rows.append(
            row(f"cycle with {rows_in_table:,} other rows", full / empty,
                f"{empty:.0f}/s empty, {full:.0f}/s full")
        )  # fmt: skip
        fresh_table(url)
        for processes in (1, 2, 4):  # cycling on distinct lockstrings
            collect = start_processes(processes, _cycler, url, seconds, None)
            per_s = sum(len(samples) for samples in collect(seconds + 120)) / seconds
            rows.append(row(f"{processes} process(es), distinct names", per_s, "cycles/s in total"))
        # A worker's p99 quiet, and while a large purge runs beside it.
        fill(url, rows_in_table, expired=True)
        quiet, busy, purged, took = purge_beside_a_worker(url, seconds)
        before, during = percentile(quiet, 0.99), percentile(busy, 0.99)
        rows.append(
            row(f"p99 during purge of {purged:,} rows", during / before,
                f"quiet p99 {before * 1000:.2f} ms, during purge {during * 1000:.2f} ms; "
                f"purge took {took:.1f}s")
        )  # fmt: skip
    return rows


def scale_row(backend: str, row: str, value: float, detail: str) -> dict[str, Any]:
    return {"backend": backend, "row": row, "value": value, "detail": detail}


def connections_used(backend: str, profile: Profile) -> dict[str, Any]:
    url, held, expires = URLS[backend], profile.kept_alive, profile.kept_alive_expires
    fresh_table(url)
    locker = Locker(url, table=TABLE)
    # Renewed at a third of their expiry; the samples span renewals, to show whether a
    # connection stays checked out between them.
    locks = [locker.lock(f"kept {n}", expires=expires, keep_alive=True) for n in range(held)]
    samples = []
    for _ in range(round(profile.sampled_seconds * 10)):
        samples.append(locker._operations.connections()[1])  # in use by a lock operation now
        time.sleep(0.1)
    pool_size = locker.engine.pool.size()  # type: ignore[attr-defined]
    opened = locker._operations.connections()[0]
    for lock in locks:
        lock.unlock()
    locker.close()
    drop_table(url, TABLE)  # the last step of a run: nothing is left on the servers
    return scale_row(
        backend, f"{held} kept-alive locks", opened,
        f"connections open {opened} (pool size {pool_size}); "
        f"checked out: median {statistics.median(samples)}, most {max(samples)}",
    )  # fmt: skip


# -- report ---------------------------------------------------------------------------------------


def report(results: dict[str, Any], out: Path) -> None:
    """The run's JSON, page and chart in ``out``, and the page's tables on the terminal."""
    out.mkdir(exist_ok=True)
    (out / "bench.json").write_text(json.dumps(results, indent=2))
    try:
        chart(results, out / "bench.png")
    except ImportError:
        print("matplotlib is not installed: no chart (pip install -e '.[bench]')", file=sys.stderr)
    page = performance_page(results)
    (out / "performance.md").write_text(page)
    print("\n".join(line for line in page.splitlines() if line.startswith(("#", "|"))))
    print(f"\nwrote {out / 'bench.json'}, {out / 'bench.png'} and {out / 'performance.md'}")


# -- the documentation's performance page -------------------------------------------------------

BACKEND_NAMES = {"sqlite": "SQLite (WAL)", "postgresql": "PostgreSQL", "mysql": "MariaDB"}
BACKEND_NAMES["redis"] = "Redis"
SYSTEM_NAMES = {
    "sqllocker": "**sqllocker**",
    "sqllocker.asyncio": "**sqllocker.asyncio**",
    "advisory lock": "blocking `pg_advisory_lock`",
    "flock": "blocking `flock` (one machine)",
    "GET_LOCK": "blocking `GET_LOCK`",
    FIFO_FLOOR: "durable FIFO floor",
    DOORBELL_FLOOR: "doorbell floor (a design tried)",
    FLAT: "flat cycle (a design tried)",
    "GET_LOCK try-lock": "`GET_LOCK` try-lock (timeout 0)",
    "redis-py Lock": "redis-py `Lock` (blocking)",
    "redis-py Lock (non-blocking)": "redis-py `Lock` (non-blocking)",
}


def _async_layers_section(rows: list[dict[str, Any]], rounds: int) -> list[str]:
    """Where an async cycle's time goes beyond its floor, layer by layer (``ASYNC_LAYERS``)."""
    if not rows:
        return []
    lines = [
        "",
        "### Where the async cycle's time goes",
        "",
        "Each column runs the async floor's statements in one more of the layers",
        "`sqllocker.asyncio` runs them in, so each step is what that layer costs (microseconds a",
        f"cycle, the median of {rounds} rounds):",
        "",
        "- *in greenlets*: each operation in a greenlet, through SQLAlchemy's adapted cursor, as",
        "  the lock operations run: they are sync code, written once for both front ends (on",
        "  SQLite, each statement as they send it: on the event loop's thread unless it must",
        "  wait, see below);",
        "- *run to its end*: that, run to its end whoever stops waiting for it (`InFlight`), so",
        "  that a caller's cancellation cannot cut a statement off halfway and leave a row nobody",
        "  knows of;",
        "- *sqllocker.asyncio*: the library's own work around them: checking the arguments, a",
        "  connection of its stack for each operation, the lock objects and, on SQLite, a look",
        "  at the lockstring's place in the queue file at the release.",
        "",
        "A step of a few microseconds either way is within the run's noise.",
    ]
    cells, systems = [], [*ASYNC_LAYERS, "sqllocker.asyncio"]
    for backend in dict.fromkeys(row["backend"] for row in rows):
        by_system = {row["system"]: row for row in rows if row["backend"] == backend}
        us = [1e6 / by_system[system]["cycles_per_s"] for system in systems]
        steps = [f"{now:,.0f} ({now - before:+,.0f})" for before, now in itertools.pairwise(us)]
        cells.append([BACKEND_NAMES[backend], f"{us[0]:,.0f}", *steps])
    header = "backend | async floor | in greenlets | run to its end | sqllocker.asyncio"
    return [
        *lines,
        *_table(header, "-::::", cells),
        "",
        "On SQLite each call to aiosqlite is a trip to its thread and back, which wakes that",
        "thread and then the event loop: the floor makes two a cycle, one per statement. On",
        "the connections of its own engine `sqllocker.asyncio` runs a statement that need not",
        "wait on the event loop's thread instead (an acquire gives the loop a turn first), with",
        "no wait for another connection's write lock: a commit there writes the log without",
        "syncing it and runs no checkpoint (the releases checkpoint, in aiosqlite's thread). A",
        "statement that finds the database busy has written nothing, and goes to aiosqlite's",
        "thread to wait there, as every statement of a caller's engine does. So its",
        "uncontended cycle makes no trip at all, and runs faster than the floor's.",
    ]


def performance_page(results: dict[str, Any]) -> str:
    """The performance page, every figure from ``results`` (one run of this script): a rerun
    rewrites it, so nothing on it is older than its run."""
    rounds = results["profile"]["uncontended_rounds"]
    lines = [
        "# Performance",
        "",
        "<!-- Written by scripts/bench.py from bench.json; a rerun rewrites it. -->",
        "",
        f"Measured by one run of `scripts/bench.py{' --quick' if results.get('quick') else ''}`"
        f" on {_run_description(results)}:",
        "",
        "```sh",
        ".venv/bin/pip install -e '.[bench]' && .venv/bin/python scripts/bench.py --out docs",
        "```",
        "",
        "Every ratio compares figures of the same run: absolute figures move a lot between runs on",
        "shared machines, ratios much less. The *raw floor* is the very statements sqllocker sends",
        "for an uncontended acquire and release, run through the same driver on one held",
        "autocommit connection with nothing around them, with the values sqllocker sends: what a",
        "table lock cannot beat. On SQLite it copies its write-ahead log back into the database",
        "file as SQLite does by default, as any application must. What changed the figures is",
        "summarised in the project's `CHANGELOG.md` (*Performance changes*).",
        "",
        "![uncontended cycles and hand-off latency](bench.png)",
        "",
        *goals().section(results),
        "## Uncontended",
        "",
        f"Acquire + release of distinct lockstrings, one process, in {rounds} rounds in which",
        "each system runs in turn: a row's figures are its median round's, and its ratio the",
        "median over the rounds of its cycles/s over the floor's in the same round (the lowest",
        "and highest of those beside it: how far one round's ratio can stray). The async rows",
        "are measured against the *async* floor: the same statements through the async driver",
        "(psycopg's async connection, aiosqlite, aiomysql) on one held connection.",
    ]
    if any(row["system"] == FLAT for row in results["uncontended"]):
        lines += [
            "",
            "The *flat cycle* is a design tried: what a lock cycle must do around the floor's",
            "statements, in one function per acquire and per release. It checks the lockstring,",
            "makes a guid and the holder's details, takes a connection of the Locker's own",
            "stack, hands out the library's own `Lock` (its state, its deadline, its",
            "finaliser), and at the release checks the count, rings for a waiter that queued",
            "meanwhile and checkpoints the log as the Locker does. It leaves out what the",
            "library adds: retries after a lost connection or contention, errors translated,",
            "the takeover of an expired row, the deadlines of a frozen connection, telemetry",
            "and the options of `lock()`. No library of these statements in Python, with this",
            "API, does much better than it.",
        ]
    cells = [_paired_cells(row, "p50_ms", "p99_ms") for row in results["uncontended"]]
    lines += _table(
        "backend | system | cycles/s | p50 ms | p99 ms | x floor | rounds", "--:::::", cells
    )
    lines += _async_layers_section(results.get("async_layers") or [], rounds)
    contended_rows = results.get("contended") or []
    if contended_rows:
        processes, profile = contended_rows[0]["processes"], results["profile"]
        lines += [
            "",
            "## Contended",
            "",
            f"{processes} processes taking turns on one lockstring, each holding it about 1 ms and",
            f"then stepping back 2 ms; {profile['contended_rounds']} round(s) of "
            f"{profile['contended_seconds']:g} s, in",
            "which every system runs in turn. A row's acquisitions/s are its median round's (the",
            "lowest and highest beside them), its other figures those of every round's turns",
            "together. *Hand-off*: from the holder's release returning to the next,",
            "already waiting, holder's acquire returning. *Passed by*: how many acquisitions by",
            "others fell between one acquisition's asking and its getting (first come, first",
            f"served: at most {processes - 1}), at the 99.9th percentile of the acquisitions and",
            "at most. *Overlaps*: two holders at once, checked by the processes themselves.",
        ]
        cells = [
            [BACKEND_NAMES[row["backend"]], SYSTEM_NAMES.get(row["system"], row["system"]),
             f"{row['acquisitions_per_s']:,.0f}", _spread(row.get("acquisitions_range"), ",.0f"),
             _ms(row["handoff_p50_ms"]), _ms(row["handoff_p99_ms"]), _ms(row["wait_p99_ms"]),
             str(_passed_by_at(row, 0.999)), str(row["overtaken_max"]), str(row["violations"])]
            for row in contended_rows
        ]  # fmt: skip
        header = "backend | system | acquisitions/s | rounds | hand-off p50 | hand-off p99 "
        header += "| wait p99 | passed by (99.9%) | passed by (most) | overlaps"
        lines += [
            *_table(header, "--::::::::", cells),
            "",
            "Waiters queue on every backend. On PostgreSQL each takes a ticket, and the release",
            "hands the row to the first in its own transaction; that waiter believes the",
            "notification, signed with a key only the trigger can read, without a round trip.",
            "On MariaDB each takes a ticket too, and the",
            "first waiter of each process polls the row, so a turn pays the poll's lag and two",
            "durable commits (see the flushes below), where `GET_LOCK` itself pays none. On",
            "SQLite they queue in the kernel, on a byte of a file beside the database that a",
            "holder that waited keeps until its row is deleted, so the order is the kernel's,",
            "as for `flock`; a lock taken at once (the uncontended rows) takes no byte, and its",
            "release rings a bell for a waiter that took the byte meanwhile. A",
            "first-come-first-served wait is longer than a",
            "free-for-all's, where a process back from its step often finds the lock free.",
        ]
        lines += floors().page_section(contended_rows, BACKEND_NAMES)
    flushes = results.get("commit_flush") or []
    if flushes:
        lines += [
            "",
            "A contended turn waits for the disk: the release that hands the row over must be",
            "durable before the next holder may act on it. What a durable commit (a one-row",
            "INSERT) took, p50, just before and just after the contended rows:",
        ]
        cells = []
        for backend in dict.fromkeys(row["backend"] for row in flushes):
            rows = {row["when"]: row for row in flushes if row["backend"] == backend}
            commits = [_ms(rows[when]["commit_p50_ms"]) for when in ("before", "after")]
            round_trip = _ms(rows["before"]["round_trip_p50_ms"])
            cells.append([BACKEND_NAMES[backend], *commits, round_trip])
        lines += _table("backend | before | after | a bare round trip", "-:::", cells)
    scale_rows = results.get("scale") or []
    if scale_rows:
        lines += [
            "",
            "## Scale",
            "",
            "A table of many other rows against an empty one (timed in turn, best of three",
            "rounds), cycles/s as processes are added on distinct lockstrings, a worker's cycle",
            "p99 during a purge of many expired rows (with `sqllocker purge-expired`'s defaults)",
            "against just before it, and the connections of a process holding many kept-alive",
            "locks.",
        ]
        if results.get("scale_measured_at"):  # carried over from an earlier run
            lines += [
                "",
                f"Measured on {results['scale_measured_at']}, timing the code of commit",
                f"`{results.get('scale_commit') or '?'}`, by an earlier run than the rows above",
                "(`scripts/bench.py --skip scale` keeps them): compare them with each other only.",
            ]
        cells = [
            [BACKEND_NAMES[row["backend"]], row["row"],
             f"{row['value']:,.0f}" if row["value"] >= 100 else f"{row['value']:.2f}",
             row["detail"]]
            for row in scale_rows
        ]  # fmt: skip
        lines += _table("backend | measure | value | detail", "--:-", cells)
    lines += _otel_section(results)
    return "\n".join(lines) + "\n"


def _table(header: str, alignment: str, cells: list[list[str]]) -> list[str]:
    """A Markdown table after a blank line: ``alignment`` has a ``-`` (left) or ``:`` (right)
    for each column of ``header``."""
    rule = "|".join("---" if side == "-" else "---:" for side in alignment)
    return ["", f"| {header} |", f"|{rule}|", *(f"| {' | '.join(row)} |" for row in cells)]


def _paired_cells(row: dict[str, Any], *latencies: str) -> list[str]:
    """A row of ``paired_rows``: its system, cycles/s, ``latencies`` (ms), ratio (in bold for
    sqllocker's own) and the ratio's spread over the rounds."""
    ratio = f"{row['ratio_to_floor']:.2f}"
    return [
        BACKEND_NAMES[row["backend"]], SYSTEM_NAMES.get(row["system"], row["system"]),
        f"{row['cycles_per_s']:,.0f}", *(f"{row[latency]:.3f}" for latency in latencies),
        f"**{ratio}**" if row["system"].startswith("sqllocker") else ratio,
        _spread(row.get("ratio_range"), ".2f"),
    ]  # fmt: skip


def _passed_by_at(row: dict[str, Any], fraction: float) -> int:
    """How many others passed a waiter, at ``fraction`` of a contended row's acquisitions."""
    counts = row["overtaken_counts"].items()
    passed = [int(others) for others, acquisitions in counts for _ in range(acquisitions)]
    return int(percentile(passed, fraction))


def _spread(pair: list[float] | None, form: str) -> str:
    """A row's lowest and highest over its rounds, where its run kept them and they differ."""
    if not pair or pair[0] == pair[1]:
        return ""
    return f"{pair[0]:{form}}-{pair[1]:{form}}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} ms"


def _run_description(results: dict[str, Any]) -> str:
    versions = ", ".join(f"{name} {version}" for name, version in results["versions"].items())
    parts = [results["machine"], versions, f"on {results['measured_at']}"]
    if results["commit"]:  # empty where the run's tree was not a git checkout
        parts.append(f"timing the code of commit `{results['commit']}`")
    return "; ".join(parts)


def run_context(backends: list[str]) -> dict[str, Any]:
    """When, on what code, and against which versions the run measured."""
    versions = {"SQLite": sqlite3.sqlite_version}
    for backend, query in (("postgresql", "SHOW server_version"), ("mysql", "SELECT VERSION()")):
        if backend in backends:
            engine = sa.create_engine(resolve_url(URLS[backend]))
            with engine.connect() as conn:
                versions[BACKEND_NAMES[backend]] = str(conn.exec_driver_sql(query).scalar())
            engine.dispose()
    # The distributions' versions: PyMySQL's __version__ is the mysqlclient one it poses as.
    for distribution in ("psycopg", "PyMySQL", "redis"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[distribution] = importlib.metadata.version(distribution)
    try:
        describe = ["git", "describe", "--always", "--dirty"]
        here = Path(__file__).resolve().parent
        commit = subprocess.check_output(describe, text=True, cwd=here).strip()
    except (OSError, subprocess.CalledProcessError):
        commit = ""
    measured_at = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return {"versions": versions, "commit": commit, "measured_at": measured_at}


def chart(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, contended_rows = results["uncontended"], results.get("contended") or []
    height = max(5.0, 0.32 * len(rows) + 1.5)  # one readable line per bar
    panels = 3 if contended_rows else 1
    figure, axes = plt.subplots(1, panels, figsize=(7 * panels, height), squeeze=False)
    ours = {"sqllocker": "#d62728", "sqllocker.asyncio": "#ff7f0e"}

    def bars(panel: int, shown: list[dict[str, Any]], key: str, **options: Any) -> None:
        labels = [f"{r['backend']}: {r['system']}" for r in shown]
        colours = [ours.get(r["system"], "#7f7f7f") for r in shown]
        axes[0][panel].barh(labels, [r[key] for r in shown], **{"color": colours, **options})

    bars(0, rows, "cycles_per_s")
    axes[0][0].set_xlabel("uncontended acquire+release cycles/s (higher is better)")
    if contended_rows:
        shown = [r for r in contended_rows if r["handoff_p50_ms"] is not None]
        # p99 behind, p50 in front, both from the axis: stacking misleads on a log scale.
        bars(1, shown, "handoff_p99_ms", label="p99", color="#aec7e8")
        bars(1, shown, "handoff_p50_ms", label="p50", color="#1f77b4")
        axes[0][1].set_xscale("log")
        axes[0][1].set_xlabel("hand-off latency, ms (log; lower is better)")
        axes[0][1].legend()
        bars(2, contended_rows, "wait_p99_ms")
        axes[0][2].set_xlabel("contended wait p99, ms (lower is better)")
    for axis in axes[0]:
        axis.invert_yaxis()
    figure.suptitle(results["machine"])
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small counts: about a minute")
    parser.add_argument("--backends", default="sqlite,postgresql,mysql")
    parser.add_argument(
        "--skip", default="", help="comma-separated: contended,scale (scale: OUT/bench.json's kept)"
    )
    parser.add_argument("--out", default="bench-results")
    parser.add_argument("--render-only", action="store_true", help="from OUT/bench.json")
    parser.add_argument("--only", choices=["otel"], help="these rows alone, into OUT/bench.json")
    args = parser.parse_args()
    out = Path(args.out)
    if args.render_only:  # measure nothing: the page and chart again
        report(json.loads((out / "bench.json").read_text()), out)
        return 0
    backends = [b for b in args.backends.split(",") if b]
    profile = QUICK if args.quick else FULL
    URLS["sqlite"] = f"sqlite:///{out / 'bench.db'}"  # beside the results, wherever
    if args.only:  # measure these rows alone; the page keeps the rest of OUT/bench.json
        results: dict[str, Any] = json.loads((out / "bench.json").read_text())
        rounds = results["profile"]["uncontended_rounds"]
        results["otel"] = otel_rows(backends, profile.cycles, rounds)
        results["otel_measured_at"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        results["otel_quick"] = args.quick
    else:
        out.mkdir(parents=True, exist_ok=True)
        for leftover in out.glob("bench.db*"):
            leftover.unlink()  # a file of an earlier run keeps the page size it was made with
        skip = set(args.skip.split(","))
        earlier = out / "bench.json"
        kept = json.loads(earlier.read_text()) if earlier.exists() else {}
        results = carry_over(kept, measure(backends, profile, skip, args.quick), skip)
    for backend in backends:  # whatever was skipped, nothing is left on the servers
        drop_table(URLS[backend], TABLE)
    report(results, out)
    return 0


def carry_over(earlier: dict[str, Any], results: dict[str, Any], skip: set[str]) -> dict[str, Any]:
    """``results`` with what an earlier run's ``earlier`` measured that this run did not: the
    rows measured alone (``--only``), and the scale rows where ``skip`` has them, each with
    when and on what code they were measured."""
    carried = ["otel", "otel_measured_at", "otel_quick"]
    if "scale" in skip and earlier.get("scale"):
        earlier = dict(earlier)
        earlier.setdefault("scale_measured_at", earlier.get("measured_at"))
        earlier.setdefault("scale_commit", earlier.get("commit"))
        carried += ["scale", "scale_measured_at", "scale_commit"]
    return {**results, **{key: earlier[key] for key in carried if key in earlier}}


def measure(backends: list[str], profile: Profile, skip: set[str], quick: bool) -> dict[str, Any]:
    """Every row of the page but the OpenTelemetry ones, measured in one run."""
    machine = f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}, SQLAlchemy {sa.__version__}"
    results: dict[str, Any] = {"machine": machine, "quick": quick, "profile": asdict(profile)}
    results.update(run_context(backends))
    results["uncontended"], results["async_layers"] = uncontended(
        backends, profile.cycles, profile.uncontended_rounds
    )
    if "contended" not in skip:
        # Each backend's rows one after another: a burst of the machine's load weighs on
        # the systems compared with each other alike.
        systems = {
            b: ["sqllocker", FIFO_FLOOR] + ([DOORBELL_FLOOR] if b == "mysql" else [])
            for b in backends
        }
        targets = [(b, s, URLS[b]) for b in backends for s in (*systems[b], BLOCKING_LOCKS[b])]
        targets.append(("redis", "redis-py Lock", REDIS_URL))
        servers = [b for b in backends if b in {"postgresql", "mysql"}]
        flushes = [{"when": "before", **commit_flush(b, URLS[b])} for b in servers]
        results["contended"] = contended(
            targets, 4, profile.contended_seconds, profile.contended_rounds
        )
        flushes += [{"when": "after", **commit_flush(b, URLS[b])} for b in servers]
        results["commit_flush"] = flushes
    if "scale" not in skip:
        results["scale"] = scale(backends, profile)
        results["scale"] += [connections_used(b, profile) for b in backends]
    return results


def goals() -> ModuleType:
    """scripts/bench_goals.py, imported where it is used, as ``floors``."""
    from scripts import bench_goals

    return bench_goals


def floors() -> ModuleType:
    """scripts/bench_floor.py, imported where it is used: the A/B tool runs this file alone,
    from its path, in other trees."""
    from scripts import bench_floor

    return bench_floor


if __name__ == "__main__":
    # Run as a script: the repository's root on the path, as the tests and the A/B tool have
    # it, for ``floors()`` here and in the contenders' processes (which inherit the path).
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(main())
