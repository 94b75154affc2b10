"""Fixtures: every test that takes ``url`` runs on SQLite, PostgreSQL and MariaDB/MySQL.

Each test run creates a private database on each server (dropped at the end) and each test a
table of its own, so parallel runs and tests never see each other's rows. Under CI (``CI=true``)
a server that cannot be reached fails the run instead of skipping its tests.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from sqllocker import Lock, Locker, lock_table
from sqllocker.engine import resolve_url
from sqllocker.migrations import upgrade
from sqllocker.waiting import Backoff
from sqllocker.waiting_room import queue_key

POSTGRES_ADMIN_URL = os.environ.get(
    "SQLLOCKER_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
)
MYSQL_ADMIN_URL = os.environ.get("SQLLOCKER_TEST_MYSQL_URL", "mysql://root@127.0.0.1:3306/test")
BACKENDS = ["sqlite", "postgresql", "mysql"]
IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}

_table_numbers = itertools.count(1)
_RUN_ID = uuid.uuid4().hex[:10]


def _server_database(admin_url: str, kind: str) -> Iterator[str]:
    """Create ``sqllocker_test_<run>`` on the server; yield its URL; drop it afterwards."""
    name = f"sqllocker_test_{_RUN_ID}"
    admin = sa.create_engine(resolve_url(admin_url), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f"CREATE DATABASE {name}")
    except sa.exc.OperationalError as error:
        admin.dispose()
        message = f"{kind} server at {admin_url} is unreachable: {error.orig}"
        if IN_CI:
            pytest.fail(f"{message} (CI requires every backend)", pytrace=False)
        pytest.skip(message)
    url = make_url(resolve_url(admin_url)).set(database=name)
    try:
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            if kind == "postgresql":
                conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
            else:
                conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {name}")
        admin.dispose()


@pytest.fixture(scope="session")
def postgresql_url() -> Iterator[str]:
    yield from _server_database(POSTGRES_ADMIN_URL, "postgresql")


@pytest.fixture(scope="session")
def mysql_url() -> Iterator[str]:
    yield from _server_database(MYSQL_ADMIN_URL, "mysql")


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def url(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A database URL for this test's backend (SQLite: a file of its own)."""
    if backend == "sqlite":
        return f"sqlite:///{tmp_path / 'locks.db'}"
    return str(request.getfixturevalue(f"{backend}_url"))


@pytest.fixture
def table_name() -> str:
    return f"t{next(_table_numbers)}_{uuid.uuid4().hex[:6]}"


@pytest.fixture
def make_locker(url: str, table_name: str) -> Iterator[Callable[..., Locker]]:
    """Build Lockers on this test's table (created once, directly from the Table definition;
    the migration path has tests of its own). grace defaults to 0 here so expiry tests are quick."""
    lockers: list[Locker] = []
    engine = sa.create_engine(resolve_url(url))
    lock_table(table_name).create(engine)
    engine.dispose()

    def make(**options: object) -> Locker:
        options.setdefault("table", table_name)
        options.setdefault("grace", 0)
        locker = Locker(url, **options)  # type: ignore[arg-type]
        lockers.append(locker)
        return locker

    yield make
    for locker in lockers:
        locker.close()


@pytest.fixture
def locker(make_locker: Callable[..., Locker]) -> Locker:
    return make_locker()


@pytest.fixture
def migrated_postgres(postgresql_url: str, table_name: str) -> Iterator[str]:
    """A table made by the migrations, so it has the release-notifying trigger."""
    engine = sa.create_engine(resolve_url(postgresql_url))
    upgrade(engine, table_name)
    engine.dispose()
    return postgresql_url


@pytest.fixture
def slow_polling(monkeypatch: pytest.MonkeyPatch) -> None:
    """Waiters that would poll only every 30 s: if they come back sooner, NOTIFY woke them."""
    monkeypatch.setattr(Backoff, "for_wait", classmethod(lambda cls, wait: cls(None, 30.0, 30.0)))


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
    return lock


# -- PostgreSQL lock queues (tests/test_waiting_room.py, tests/test_hand_off.py) -------------


@pytest.fixture
def admin(migrated_postgres: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(resolve_url(migrated_postgres))
    yield engine
    engine.dispose()


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


def pytest_unconfigure(config: pytest.Config) -> None:
    # Locks that some tests deliberately leave held are released by their finalisers at exit,
    # after the per-run databases have been dropped; those warnings would only be noise.
    import logging

    logging.getLogger("sqllocker").setLevel(logging.CRITICAL)
