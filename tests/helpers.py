"""What the tests share besides fixtures: reading the table, crashing a holder, PostgreSQL's
tickets seen from outside, waiting for a condition, printing a figure, a scenario written once
for both front ends, and a stalling proxy in front of the test's server."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import json
import os
import secrets
import signal
import sqlite3
import subprocess
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy as sa

from sqllocker import Lock, Locker, LockError
from sqllocker.asyncio import AsyncLocker
from sqllocker.engine import resolve_url
from sqllocker.migrations import upgrade
from tests.stall_proxy import StallProxy


def migrate(url: str | sa.URL, table: str) -> None:
    """``table`` (and its companions) made by the migrations on ``url``'s database."""
    engine = sa.create_engine(resolve_url(url))
    upgrade(engine, table)
    engine.dispose()


def apply_sql(url: str, script: str) -> None:
    """Run ``script`` as a DBA applies what ``migrate --sql`` prints: by psql or the mariadb
    client, stopping at the first error; SQLite's by sqlite3's own script runner."""
    parsed = sa.make_url(url)
    if parsed.get_backend_name() == "postgresql":
        target = parsed.set(drivername="postgresql").render_as_string(hide_password=False)
        applied = subprocess.run(
            ["psql", "-q", "-v", "ON_ERROR_STOP=1", "-d", target],
            input=script,
            text=True,
            check=False,
            capture_output=True,
        )
        assert applied.returncode == 0, applied.stderr
    elif parsed.get_backend_name() in {"mysql", "mariadb"}:
        command = ["mariadb", "-h", str(parsed.host), "-P", str(parsed.port or 3306)]
        applied = subprocess.run(
            [*command, "-u", str(parsed.username), str(parsed.database)],
            input=script,
            text=True,
            check=False,
            capture_output=True,
        )
        assert applied.returncode == 0, applied.stderr
    else:
        assert parsed.get_backend_name() == "sqlite", url
        with contextlib.closing(sqlite3.connect(str(parsed.database))) as conn:
            conn.executescript(script)


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


# -- PostgreSQL tickets (tests/test_tickets.py, tests/test_hand_off.py) ----------------------


class RawTicket:
    """A ticket taken through the table's functions by a session of its own, which holds the
    ticket's liveness key as a Locker's listener does (unless ``live`` is False: a Locker that
    is gone), but that acts only when told: a waiter's moves, one at a time."""

    def __init__(
        self,
        url: str,
        table: str,
        lockstring: str = "report",
        ttl: float = 30.0,
        live: bool = True,
    ) -> None:
        self.url, self.table, self.lockstring = url, table, lockstring
        self.guid = str(uuid.uuid4())
        self.connection = connect(url)
        self.key = secrets.randbits(62)
        if live:
            self.connection.execute("SELECT pg_advisory_lock(%s)", (self.key,))
        row = self.connection.execute(
            f"SELECT ticket, held FROM {table}_queue_join(%s, %s, %s, %s, %s)",
            (lockstring, self.guid, json.dumps({"job": "raw ticket"}), ttl, self.key),
        ).fetchone()
        assert row is not None
        self.number = int(row[0])

    def die(self) -> None:
        """Its Locker's process died: the session that held the liveness key ends."""
        self.connection.close()

    def leave(self, give_back: bool) -> bool:
        with connect(self.url) as connection:
            row = connection.execute(
                f"SELECT {self.table}_queue_leave(%s, %s, %s, %s)",
                (self.number, self.lockstring, self.guid, give_back),
            ).fetchone()
        assert row is not None
        return bool(row[0])


def connect(url: str) -> psycopg.Connection[Any]:
    target = sa.make_url(resolve_url(url))
    return psycopg.connect(
        host=target.host,
        port=target.port,
        user=target.username,
        dbname=target.database,
        autocommit=True,
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


def stop_outside_a_write(pid: int, url: str | sa.URL, tries: int = 100) -> None:
    """SIGSTOP ``pid``, at a moment it holds no write lock of ``url``'s database.

    On SQLite a process stopped inside a write (a renewal, say) keeps the database's write
    lock: nobody else can write until it goes on. That is SQLite's, and the scenarios that
    stop a holder are about the lock's row, not about it; so the stop is tried again until a
    probe can take the write lock (it may also be held by another writer for a moment). A
    server ends a stopped client's statement by itself: there the stop is at once."""
    os.kill(pid, signal.SIGSTOP)
    url = resolve_url(url)
    if url.get_backend_name() != "sqlite" or not url.database:
        return
    for _ in range(tries):
        probe = sqlite3.connect(url.database, timeout=0, isolation_level=None)
        try:
            probe.execute("BEGIN IMMEDIATE")
            probe.execute("ROLLBACK")
            return
        except sqlite3.OperationalError:  # locked: the stopped process may be inside a write
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.02)
            os.kill(pid, signal.SIGSTOP)
        finally:
            probe.close()
    raise AssertionError(f"{url.database}'s write lock stayed held while {pid} was stopped")


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No automatic garbage collection within the block: what a test frees in a reference
    cycle is freed only by its own ``gc.collect()``."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


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


def tickets(admin: sa.Engine, table: str) -> list[tuple[str, str]]:
    """The standing tickets, lowest first: (lockstring, guid)."""
    with admin.connect() as conn:
        return [
            tuple(row)
            for row in conn.exec_driver_sql(
                f"SELECT lockstring, guid FROM {table}_requests ORDER BY ticket"
            )
        ]  # type: ignore[misc]


def in_line(admin: sa.Engine, table: str, waiters: int = 1) -> None:
    """Until ``waiters`` hold tickets and no statement on ``table`` runs: the first one's
    attempt after taking its ticket (if the row looked free) must be over before a release, or
    that INSERT holds the lockstring's id-order lock just then and the trigger, rather than wait
    for it, leaves the row to that INSERT (which takes it, by the waiter's own hand). A loaded
    machine can take longer than the moment given for the attempt to start."""
    wait_until(lambda: len(tickets(admin, table)) == waiters)
    time.sleep(0.3)
    wait_until(lambda: statements_running_on(admin, table) == 0)


async def in_line_async(admin: sa.Engine, table: str, waiters: int = 1) -> None:
    await wait_until_async(lambda: len(tickets(admin, table)) == waiters)
    await asyncio.sleep(0.3)
    await wait_until_async(lambda: statements_running_on(admin, table) == 0)


def statements_running_on(admin: sa.Engine, table: str) -> int:
    """How many other sessions run a statement naming ``table`` (or one of its functions), or
    sit in a transaction after one, as the server's own list of sessions shows them."""
    if admin.dialect.name == "postgresql":
        sql = (
            "SELECT count(*) FROM pg_catalog.pg_stat_activity WHERE pid <> pg_backend_pid() "
            "AND state <> 'idle' AND strpos(query, %(table)s) > 0"
        )
    else:
        sql = (
            "SELECT count(*) FROM information_schema.processlist WHERE id <> CONNECTION_ID() "
            "AND command <> 'Sleep' AND LOCATE(%(table)s, info) > 0"
        )
    with admin.connect() as conn:
        return int(conn.exec_driver_sql(sql, {"table": table}).scalar_one())


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


def unlock_in_turn(waiting: list[tuple[threading.Thread, dict[str, Any]]]) -> None:
    """Unlock each waiter's lock as it gets it (``wait_in_thread``), whatever their order."""
    served_in_turn(waiting)


def served_in_turn(waiting: list[tuple[threading.Thread, dict[str, Any]]]) -> list[int]:
    """Unlock each waiter's lock as it gets it (``wait_in_thread``): their positions in
    ``waiting``, in the order they were served."""
    left = list(enumerate(waiting))
    order = []
    deadline = time.monotonic() + 20
    while left:
        assert time.monotonic() < deadline, "a waiter was not served"
        for position, (thread, result) in list(left):
            if "error" in result:
                raise result["error"]
            if "lock" in result:
                order.append(position)
                result["lock"].unlock()
                thread.join(10)
                left.remove((position, (thread, result)))
        time.sleep(0.01)
    return order


# What an acquire's read-back of its row (Statements.holder_for_acquirer), and only it, sends:
# the marker a proxy waits for.
READ_BACK = b"AS ours"


def break_and_take_when_stalled(
    proxy: StallProxy, locker: Locker, lockstring: str
) -> tuple[threading.Thread, list[Lock]]:
    """A thread (not started) that, once ``proxy`` has stalled before a statement
    (``StallProxy.stall_before``), breaks ``lockstring``'s row through ``locker``, which does
    not go through the proxy, and takes the lockstring; then it resumes the proxy, whatever
    happened. The lock it took, if it took one, is in the list."""
    taken: list[Lock] = []

    def break_and_take() -> None:
        try:
            if proxy.stalled_before.wait(30) and locker.break_lock(lockstring) is not None:
                taken.append(locker.lock(lockstring))
        finally:
            proxy.resume()

    return threading.Thread(target=break_and_take), taken


def async_url(url: str) -> str:
    """The async driver's URL for one of the test fixtures' (sync) URLs."""
    for sync, asynchronous in (
        ("mysql+pymysql://", "mysql+aiomysql://"),
        ("sqlite://", "sqlite+aiosqlite://"),
    ):
        if url.startswith(sync):
            return asynchronous + url[len(sync) :]
    return url


class Front:
    """The sync or the asyncio front end, for a scenario written once as a coroutine:
    ``await front.call(lock.extend)`` awaits what an AsyncLocker's call returns and takes a
    Locker's result as it is (the sync call blocks the scenario's loop, which has nothing else
    to run)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.is_async = name == "asyncio"

    def __str__(self) -> str:
        return self.name

    def locker(self, url: str, **options: Any) -> Any:
        """A Locker, or an AsyncLocker on the async driver, with ``options``."""
        if self.is_async:
            return AsyncLocker(async_url(url), **options)
        return Locker(url, **options)

    async def call(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        result = method(*args, **kwargs)
        if self.is_async:
            return await result
        assert not isinstance(result, Awaitable), f"{method} is the asyncio front's"
        return result

    async def timed(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
        """What ``call`` returned (``result``) or the LockError it raised (``error``), and how
        long it took (``took``)."""
        outcome: dict[str, Any] = {}
        started = time.monotonic()
        try:
            outcome["result"] = await self.call(method, *args, **kwargs)
        except LockError as error:
            outcome["error"] = error
        outcome["took"] = time.monotonic() - started
        return outcome

    def in_background(
        self, method: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> asyncio.Task[Any]:
        """``call`` as a task: the sync front's on a thread, so that the scenario goes on."""
        if self.is_async:
            return asyncio.ensure_future(method(*args, **kwargs))
        return asyncio.ensure_future(asyncio.to_thread(method, *args, **kwargs))

    async def close(self, locker: Any) -> None:
        await self.call(locker.aclose if self.is_async else locker.close)


FRONTS = [Front("sync"), Front("asyncio")]


class Proxied:
    """A StallProxy in front of the server of ``url`` (PostgreSQL or MariaDB), the URL through
    it (``target``, and ``url`` rendered with its password), and a rescue that closes the proxy
    after 90 s, which ends every stuck statement if the code under test never does (libpq has
    no read timeout)."""

    def __init__(self, url: str | sa.URL) -> None:
        direct = resolve_url(url)
        default_port = 5432 if direct.get_backend_name() == "postgresql" else 3306
        self.proxy = StallProxy(direct.port or default_port)
        self.target = direct.set(host="127.0.0.1", port=self.proxy.port)
        self.url = self.target.render_as_string(hide_password=False)
        self._rescue = threading.Timer(90, self.proxy.close)
        self._rescue.daemon = True
        self._rescue.start()

    def close(self) -> None:
        self._rescue.cancel()
        self.proxy.close()


def through_proxy(
    front: Front,
    proxied: Proxied,
    table_name: str,
    scenario: Callable[[Any], Awaitable[None]],
    grace: float,
) -> None:
    """Run ``scenario`` with a Locker (or AsyncLocker) through the proxy; the proxy is closed
    before the Locker, so that no statement it left stuck holds the closing up."""

    async def run() -> None:
        locker = front.locker(proxied.url, table=table_name, grace=grace)
        try:
            await scenario(locker)
        finally:
            proxied.close()
            await front.close(locker)

    asyncio.run(run())


def ended_within(outcome: dict[str, Any], bound: float, error: type[LockError]) -> None:
    """``Front.timed``'s ``outcome``: ``error`` raised, within ``bound`` seconds."""
    assert outcome["took"] < bound, outcome
    assert isinstance(outcome.get("error"), error), outcome


def listener_pid(admin: sa.Engine, locker: Locker | AsyncLocker) -> int:
    """The server session of ``locker``'s listener: the one holding its liveness key."""
    assert locker._tickets.listener is not None
    key = locker._tickets.listener.liveness_key
    assert key is not None
    with admin.connect() as conn:
        return int(
            conn.execute(
                sa.text(
                    "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted "
                    "AND objsubid = 1 AND classid = :high AND objid = :low"
                ),
                {"high": (key >> 32) & 0xFFFFFFFF, "low": key & 0xFFFFFFFF},
            ).scalar_one()
        )


def end_listener_session(admin: sa.Engine, locker: Locker | AsyncLocker) -> None:
    """End ``locker``'s listener session on the server (a failover, a DBA's
    ``pg_terminate_backend``): its liveness key, and its tickets' lives, go with it."""
    pid = listener_pid(admin, locker)
    with admin.connect() as conn:
        conn.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
