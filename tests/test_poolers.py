"""PostgreSQL through a transaction-pooling PgBouncer: ``transaction_pooling=True``.

Such a pooler gives each transaction whichever server session is free, so nothing that lives in
a session survives from one statement to the next: startup parameters (which PgBouncer refuses),
psycopg's prepared statements, LISTEN, session advisory locks. A Locker told so keeps none of
them, and waiters back off as on MariaDB. The row decides who holds, so mutual exclusion and
fencing must hold through it as directly.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import create_async_engine

from sqllocker import (
    DatabaseError,
    Lock,
    Locker,
    LockTypeError,
    LockValueError,
    UnsafeDatabase,
)
from sqllocker.asyncio import AsyncLocker
from sqllocker.engine import resolve_url
from tests.helpers import tickets, wait_until
from tests.private_servers import running_pgbouncer
from tests.test_mutual_exclusion import ABANDONING, OUTLIVING, TRYING, contend

pytestmark = pytest.mark.slow  # a private PgBouncer: not in the quick subset

REPO = Path(__file__).resolve().parent.parent
POOLED = ("--transaction-pooling",)


@pytest.fixture(scope="module")
def pooler_url(postgresql_url: str) -> Iterator[str]:
    with running_pgbouncer(postgresql_url) as url:
        yield url


@pytest.fixture
def direct(migrated_postgres: str, table_name: str) -> Iterator[Locker]:
    """A Locker straight to the server, on a table made by the migrations."""
    locker = Locker(migrated_postgres, table=table_name, grace=0)
    yield locker
    locker.close()


@pytest.fixture
def pooled(pooler_url: str, direct: Locker) -> Iterator[Locker]:
    locker = Locker(pooler_url, table=direct.table_name, grace=0, transaction_pooling=True)
    yield locker
    locker.close()


def session_state(direct: Locker, lockstring: str) -> tuple[int, int]:
    """What waiting on ``lockstring`` through a transaction pooler must not leave on whatever
    server session ran it: tickets (whose liveness key a listener's session holds), and
    sessions listening for the table's releases. Only this test's table counts: a
    Locker of another test may still be listening on its own."""
    with direct.engine.connect() as conn:
        listening = conn.execute(
            sa.text(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE query ILIKE 'LISTEN%' AND query LIKE :channel"
            ),
            {"channel": f"%{direct.table_name}%"},
        ).scalar_one()
    return queued_waiters(direct, lockstring), int(listening)


def queued_waiters(direct: Locker, lockstring: str) -> int:
    """Tickets standing for ``lockstring``."""
    return sum(ls == lockstring for ls, _ in tickets(direct.engine, direct.table_name))


def test_a_locker_not_told_of_the_pooler_is_refused_with_what_to_pass(
    pooler_url: str, direct: Locker
) -> None:
    locker = Locker(pooler_url, table=direct.table_name)
    try:
        with pytest.raises(DatabaseError, match=r"transaction_pooling=True") as raised:
            locker.lock("report")
        assert "unsupported startup parameter" in str(raised.value)
    finally:
        locker.close()
    assert direct.locks() == []


def test_cycles_from_many_threads_through_the_pooler(pooled: Locker, direct: Locker) -> None:
    """More cycles per connection than psycopg's prepare threshold (5), from threads whose
    statements the pooler spreads over its two server sessions: a prepared statement would be
    missing from the other session ("prepared statement ... does not exist")."""
    errors: list[BaseException] = []

    def cycles(thread: int) -> None:
        try:
            for n in range(40):
                with pooled.lock(f"thread {thread} job {n}") as lock:
                    assert lock.is_valid()
                    lock.extend(30)
                shared = pooled.try_lock("shared")  # refused now and then: another has it
                if shared is not None:
                    shared.unlock()
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=cycles, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert direct.locks() == []


def test_a_waiter_through_the_pooler_keeps_no_session_state(pooled: Locker, direct: Locker) -> None:
    """It backs off instead of LISTENing and queueing on a session advisory lock (which the
    pooler would leave behind on whatever server session ran it), and still gets the lock."""
    held = direct.lock("report")
    got: list[Lock] = []
    waiter = threading.Thread(target=lambda: got.append(pooled.lock("report", wait=30)))
    waiter.start()
    try:
        wait_until(lambda: pooled._operations.connections()[0] > 0)
        for _ in range(20):  # through a few of its attempts
            assert session_state(direct, "report") == (0, 0)
            threading.Event().wait(0.02)
        assert not got
    finally:
        held.unlock()
        waiter.join(30)
    assert got
    assert got[0].lock_id > held.lock_id
    row = direct.lock_info("report")
    assert row is not None
    assert row.lock_id == got[0].lock_id
    got[0].unlock()


def test_a_callers_engine_that_prepares_statements_is_refused(
    pooler_url: str, direct: Locker
) -> None:
    """psycopg prepares a statement on its fifth run by default, which fails through PgBouncer
    before 1.21: sqllocker cannot change a caller's connections, so it says what to change."""
    url = resolve_url(pooler_url)
    engine = sa.create_engine(url)
    locker = Locker(engine, table=direct.table_name, transaction_pooling=True)
    with pytest.raises(LockValueError, match=r"prepare_threshold.*None"):
        locker.lock("report")
    assert direct.locks() == []
    engine.dispose()

    engine = sa.create_engine(url, connect_args={"prepare_threshold": None})
    locker = Locker(engine, table=direct.table_name, transaction_pooling=True)
    for n in range(20):
        locker.lock(f"job {n}").unlock()
    engine.dispose()


def test_async_locker_through_the_pooler(pooler_url: str, direct: Locker) -> None:
    async def main() -> None:
        locker = AsyncLocker(pooler_url, table=direct.table_name, transaction_pooling=True)
        try:
            for n in range(20):
                async with await locker.lock(f"job {n}"):
                    pass
            held = direct.lock("report")
            waiting = asyncio.ensure_future(locker.lock("report", wait=30))
            await asyncio.sleep(0.3)
            assert not waiting.done()
            assert session_state(direct, "report") == (0, 0)
            held.unlock()
            lock = await waiting
            assert lock.lock_id > held.lock_id
            await lock.unlock()
        finally:
            await locker.aclose()

        engine = create_async_engine(resolve_url(pooler_url, asynchronous=True))
        refused = AsyncLocker(engine, table=direct.table_name, transaction_pooling=True)
        with pytest.raises(LockValueError, match=r"prepare_threshold"):
            await refused.lock("report")
        await engine.dispose()

    asyncio.run(main())
    assert direct.locks() == []


def test_the_command_line_through_the_pooler(pooler_url: str, direct: Locker) -> None:
    def sqllocker(*arguments: str) -> subprocess.CompletedProcess[str]:
        command = [str(Path(sys.executable).parent / "sqllocker"), "--url", pooler_url]
        command += ["--table", direct.table_name, *arguments]
        return subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=REPO)

    refused = sqllocker("run", "nightly", "--", "true")
    assert refused.returncode == 2
    assert "--transaction-pooling" in refused.stderr

    migrated = sqllocker("--transaction-pooling", "--table", f"{direct.table_name}_m", "migrate")
    assert migrated.returncode == 0, migrated.stderr
    ran = sqllocker("--transaction-pooling", "run", "nightly", "--wait", "5", "--", "true")
    assert ran.returncode == 0, ran.stderr
    assert sqllocker("--transaction-pooling", "purge-expired").returncode == 0
    assert direct.locks() == []


def test_through_the_pooler_the_servers_synchronous_commit_is_checked(
    pooler_url: str, postgresql_url: str, table_name: str
) -> None:
    """Directly, sqllocker turns synchronous_commit on for its sessions; through the pooler it
    cannot, so a database whose default is off must be reported (strict: refused)."""
    name = f"{make_url(postgresql_url).database}_async_commit"
    admin = sa.create_engine(resolve_url(postgresql_url), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f"CREATE DATABASE {name}")
        conn.exec_driver_sql(f"ALTER DATABASE {name} SET synchronous_commit = off")
    try:
        server = make_url(postgresql_url).set(database=name)
        Locker(server, table=table_name).create_table()
        through = make_url(pooler_url).set(database=name)
        locker = Locker(through, table=table_name, transaction_pooling=True, strict=True)
        with pytest.raises(UnsafeDatabase, match="synchronous_commit=off"):
            locker.lock("report")
        locker.close()
        locker = Locker(server, table=table_name, strict=True)
        locker.lock("report").unlock()
        locker.close()
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        admin.dispose()


@pytest.mark.parametrize(
    "options",
    [POOLED, (*POOLED, *TRYING), (*POOLED, *ABANDONING), (*POOLED, *OUTLIVING)],
    ids=["waiting", "trying", "taking over abandoned rows", "outliving expiry by keep-alive"],
)
def test_many_processes_through_the_pooler(
    pooler_url: str, direct: Locker, tmp_path: Path, options: tuple[str, ...]
) -> None:
    """The contention tests of test_mutual_exclusion, every worker through the pooler: no
    overlap, no lost update, no token inversion, no lock lost; with takeovers of abandoned
    rows, and with locks kept alive past their expiry by renewals through the pooler."""
    locker = Locker(pooler_url, table=direct.table_name, grace=0, transaction_pooling=True)
    try:
        contend(locker, tmp_path, 0, False, options, ", through PgBouncer (transaction pooling)")
    finally:
        locker.close()


@pytest.mark.usefixtures("slow_polling")
def test_in_session_pooling_mode_waiters_still_wake_on_the_release(
    postgresql_url: str, direct: Locker
) -> None:
    """A session-pooling PgBouncer told to drop the ``options`` startup parameter: a client
    keeps its server session, so waiters LISTEN and take tickets as directly. They poll only every
    30 s here: a waiter served within the test's time was woken by the release."""
    with running_pgbouncer(postgresql_url, "session", ignore_options=True) as url:
        locker = Locker(url, table=direct.table_name)
        try:
            held = locker.lock("report")
            got: list[Lock] = []
            waiter = threading.Thread(target=lambda: got.append(locker.lock("report", wait=60)))
            waiter.start()
            wait_until(lambda: queued_waiters(direct, "report") == 1)
            held.unlock()
            waiter.join(10)
            assert got
            assert got[0].lock_id > held.lock_id
            got[0].unlock()
        finally:
            locker.close()
    assert direct.locks() == []


def test_transaction_pooling_must_be_a_bool() -> None:
    with pytest.raises(LockTypeError, match="transaction_pooling must be True or False"):
        Locker("sqlite://", transaction_pooling="yes")  # type: ignore[arg-type]
    with pytest.raises(LockTypeError, match="transaction_pooling must be True or False"):
        AsyncLocker("sqlite://", transaction_pooling=1)  # type: ignore[arg-type]
