"""What the tests share besides fixtures: reading the table, crashing a holder, the
PostgreSQL queue seen from outside, waiting for a condition, and printing a figure."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from sqllocker import Lock, Locker
from sqllocker.queueing import queue_key


def count_rows(locker: Locker) -> int:
    with locker.engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(locker.table)).scalar_one())


def figure(scenario: str, backend: str, text: str) -> None:
    """Print one figure of the reliability suite (README.md quotes them; run with -s)."""
    print(f"\n[reliability] {scenario} [{backend}]: {text}")


def abandon(lock: Lock) -> Lock:
    """Make ``lock`` behave like a holder that crashed: its row stays until it expires."""
    lock._finalizer.detach()
    lock._state.held = False
    lock._state.leave_place()  # as the kernel does for a process that died (SQLite's queue)
    return lock


# -- PostgreSQL lock queues (tests/test_waiting_room.py, tests/test_hand_off.py) -------------


def queued(admin: sa.Engine, table: str, lockstring: str) -> tuple[int, int]:
    """(granted, waiting) sessions on ``lockstring``'s queue, as pg_locks shows them."""
    key = queue_key(f"public.{table}", lockstring) & 0xFFFFFFFFFFFFFFFF
    with admin.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT granted, count(*) FROM pg_locks WHERE locktype = 'advisory' "
                "AND classid = :high AND objid = :low AND objsubid = 1 GROUP BY granted"
            ),
            {"high": key >> 32, "low": key & 0xFFFFFFFF},
        ).all()
    counts: dict[bool, int] = {granted: count for granted, count in rows}
    return counts.get(True, 0), counts.get(False, 0)


def head_the_queue(admin: sa.Engine, table: str, lockstring: str = "report") -> sa.Connection:
    """A session that heads ``lockstring``'s queue (holds its advisory lock) and never tries
    for the row, as a waiter whose process was stopped would; ``leave_the_queue`` or closing
    it ends that."""
    connection = admin.connect()
    connection.execute(
        sa.text("SELECT pg_advisory_lock(:key)"), {"key": queue_key(f"public.{table}", lockstring)}
    )
    return connection


def leave_the_queue(connection: sa.Connection, table: str, lockstring: str = "report") -> None:
    connection.execute(
        sa.text("SELECT pg_advisory_unlock(:key)"),
        {"key": queue_key(f"public.{table}", lockstring)},
    )


def wait_in_thread(
    locker: Locker, lockstring: str = "report", **options: Any
) -> tuple[threading.Thread, dict[str, Any]]:
    """``locker.lock(lockstring, **options)`` on a thread of its own; the result holds the Lock
    (or the error) and the monotonic time lock() returned."""
    result: dict[str, Any] = {}

    def wait() -> None:
        try:
            result["lock"] = locker.lock(lockstring, **options)
        except BaseException as error:
            result["error"] = error
        result["returned"] = time.monotonic()

    thread = threading.Thread(target=wait)
    thread.start()
    return thread, result


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


async def wait_until_async(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """``wait_until`` that lets the event loop run the waiting tasks meanwhile."""
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(condition):
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def row_guid(admin: sa.Engine, table: str, lockstring: str) -> str | None:
    """The guid of ``lockstring``'s row, as only the table (and its owner) may show it."""
    with admin.connect() as conn:
        return conn.exec_driver_sql(
            f"SELECT guid FROM {table} WHERE lockstring = %(ls)s", {"ls": lockstring}
        ).scalar()


def requests(admin: sa.Engine, table: str) -> list[tuple[str, str]]:
    """The standing requests: (lockstring, guid)."""
    with admin.connect() as conn:
        return [
            tuple(row)
            for row in conn.exec_driver_sql(f"SELECT lockstring, guid FROM {table}_requests")
        ]  # type: ignore[misc]


def head_is_waiting(admin: sa.Engine, table: str) -> None:
    """Until a waiter heads the queue with its request, and a moment more: its first attempt at
    the head (an INSERT, refused) must be over before the release, or that INSERT holds the
    lockstring's id-order lock just then and the trigger, rather than wait for it, leaves the
    row to that INSERT (which takes it, by the waiter's own hand)."""
    wait_until(lambda: len(requests(admin, table)) == 1)
    time.sleep(0.3)


async def head_is_waiting_async(admin: sa.Engine, table: str) -> None:
    await wait_until_async(lambda: len(requests(admin, table)) == 1)
    await asyncio.sleep(0.3)


def worker_records(state: Path) -> list[dict[str, Any]]:
    """Every line the workers (tests/workers.py) logged in ``state``."""
    return [
        json.loads(line)
        for path in sorted(state.glob("log-*.jsonl"))
        for line in path.read_text().splitlines()
    ]


def holding_faults(
    records: list[dict[str, Any]], lockstrings: list[str], state: Path
) -> dict[str, int]:
    """What the workers' acquisitions of ``lockstrings`` show: two holders at once (intervals
    that overlap), fencing tokens out of holding order, and updates of the counter files lost."""
    faults = {"double holders": 0, "fencing inversions": 0, "lost updates": 0}
    for lockstring in lockstrings:
        mine = sorted(
            (r for r in records if r.get("ls") == lockstring and "out" in r), key=lambda r: r["in"]
        )
        for before, after in itertools.pairwise(mine):
            faults["double holders"] += after["in"] < before["out"]
            faults["fencing inversions"] += after["id"] <= before["id"]
        counter = state / f"{lockstring}.count"
        faults["lost updates"] += len(mine) - (int(counter.read_text()) if counter.exists() else 0)
    return faults
