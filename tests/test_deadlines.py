"""The deadlines of a lock operation's statements and connections (``sqllocker.deadlines``):
which block's deadline a statement or a new connection sees, and when the watcher is armed."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from sqllocker import LockBusy, Locker, LockError, LockLost, clock, deadlines
from sqllocker.asyncio import greenlets
from sqllocker.backends.sqlite import SQLiteBackend
from sqllocker.engine import create_async_locker_engine, create_locker_engine, resolve_url
from sqllocker.timeouts import SQLITE_BUSY_TIMEOUT_SECONDS


def test_a_connections_block_inside_a_statements_block_keeps_the_statements_deadline() -> None:
    assert deadlines.current() is None
    assert deadlines.connect_within() is None
    far = clock.now() + 1000
    with deadlines.statements_end_by(far):
        assert deadlines.current() == far
        left = deadlines.connect_within()
        assert left is not None
        assert 999 < left <= 1000
        with deadlines.connections_by(clock.now() + 10):
            assert deadlines.current() == far
            left = deadlines.connect_within()
            assert left is not None
            assert left <= 10
        with deadlines.connections_by(None):
            assert deadlines.current() == far
            assert deadlines.connect_within() is None
        left = deadlines.connect_within()
        assert left is not None
        assert left > 999
    assert deadlines.current() is None
    assert deadlines.connect_within() is None
    assert not deadlines.passed()


def test_a_thread_given_the_blocks_context_has_its_statements_deadline_not_its_connections() -> (
    None
):
    seen: list[Any] = []
    far = clock.now() + 1000
    with deadlines.statements_end_by(far):
        context = contextvars.copy_context()

    def look() -> None:
        seen.extend([deadlines.current(), deadlines.connect_within()])

    thread = threading.Thread(target=context.run, args=(look,))
    thread.start()
    thread.join()
    assert seen == [far, None]


class Interrupted:
    """A backend whose statements only an interrupt ends: the connections it interrupted."""

    interrupt_ends_connection = True

    def __init__(self) -> None:
        self.calls: list[object] = []
        self.event = threading.Event()

    def interrupt(self, connection: object) -> None:
        self.calls.append(connection)
        self.event.set()

    def bound_waits(self, connection: object, seconds: float) -> object | None:
        return None

    def unbound_waits(self, connection: object, undo: object) -> None:
        raise AssertionError("nothing was cut")


def test_a_deadline_passed_interrupts_the_block_once_and_never_after_it() -> None:
    backend = Interrupted()
    with (
        deadlines.statements_end_by(clock.now() + 0.05),
        deadlines.interrupting(backend, "the connection"),
    ):
        assert backend.event.wait(5)
    with deadlines.statements_end_by(clock.now() - 1), deadlines.interrupting(backend, "later"):
        pass
    assert backend.calls == ["the connection"]


def _statement_then(pause: float, then: Callable[[], None] = lambda: None) -> Any:
    """An operation: a statement, then ``pause`` seconds (past a deadline, the watcher
    interrupts the connection meanwhile), then ``then()``; "done"."""

    def operation(session: Any) -> str:
        session.cursor.execute("SELECT 1")
        session.cursor.fetchall()
        time.sleep(pause)
        then()
        return "done"

    return operation


def _refused() -> None:
    """The operation's own verdict (a LockError), after its statements ended."""
    raise LockError("refused after its statement")


def _database_refused() -> None:
    """A database's error that is no lost connection (a constraint, say)."""
    raise sa.exc.IntegrityError("INSERT ...", {}, Exception("refused after its statement"))


ENDINGS = {
    "returns": lambda: None,
    "raises": _refused,
    "raises a database error": _database_refused,
}


@pytest.mark.parametrize("ending", list(ENDINGS))
@pytest.mark.parametrize("engine", ["its own", "the caller's"])
def test_a_connection_interrupted_as_its_statements_ended_serves_no_more(
    url: str, table_name: str, make_locker: Callable[..., Locker], engine: str, ending: str
) -> None:
    """The watcher fires once the deadline has passed: at times after the block's statements
    have ended and before the block has. What they did stands; the connection, its socket
    shut down on the servers, is not given back for the next operation (it was: a renewal's
    give-back of the row it revived then failed on it, and the row stayed), however the
    operation ends. (SQLite's interrupt ends nothing more than a running statement: its
    connection serves on.)"""
    make_locker()  # the table
    callers = sa.create_engine(resolve_url(url)) if engine == "the caller's" else None
    locker = Locker(callers or url, table=table_name)
    try:
        locker.lock("connected").unlock()
        database = locker._operations.database
        operation = _statement_then(0.5, ENDINGS[ending])
        with deadlines.statements_end_by(clock.now() + 0.05):
            if ending == "returns":
                assert database.run(None, operation) == "done"
            else:
                with pytest.raises(LockError, match="refused"):
                    database.run(None, operation)
        # The connection the next operation gets: the one given back last, were it given back.
        stack = database.pool.stack
        held = stack.take() if stack is not None else None
        raw = held.connection if held is not None else locker.engine.raw_connection()
        try:
            cursor = raw.cursor()
            cursor.execute("SELECT 1")
            assert list(cursor.fetchall()) == [(1,)]
            cursor.close()
        finally:
            if stack is not None and held is not None:
                stack.give_back(held)
            else:
                raw.close()
        locker.lock("after").unlock()
    finally:
        locker.close()
        if callers is not None:
            callers.dispose()


def test_an_in_memory_database_keeps_its_locks_through_an_interrupt_after_its_statements() -> None:
    """``sqlite://`` lives in its one connection: an interrupt that came as an operation's
    statements ended must not close it, which would drop every lock row and let a second
    holder in."""
    locker = Locker("sqlite://", table="in_memory")
    held = locker.lock("held", expires=600)
    with deadlines.statements_end_by(clock.now() + 0.05):
        assert locker._operations.database.run(None, _statement_then(0.5)) == "done"
    with pytest.raises(LockBusy):
        locker.lock("held", wait=0)
    held.unlock()
    locker.close()


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_sqlite_gives_the_busy_timeout_back_after_an_interrupt_after_its_statements(
    tmp_path: Path, ending: str
) -> None:
    """An operation that must end within 50 ms cuts its connection's busy timeout to that;
    the watcher interrupts it as its statements have ended. The connection serves on (an
    interrupt ends no more than a running statement on SQLite), its busy timeout given back,
    not left cut for every later operation on it."""
    locker = Locker(f"sqlite:///{tmp_path / 'locks.db'}", table="t")
    try:
        locker.lock("connected").unlock()
        database = locker._operations.database
        stack = database.pool.stack
        assert stack is not None
        (connection,) = stack._idle
        operation = _statement_then(0.5, ENDINGS[ending])
        with (
            deadlines.statements_end_by(clock.now() + 0.05),
            contextlib.suppress(LockError),
        ):
            database.run(None, operation)
        held = stack.take()
        try:
            assert held is connection  # kept
            timeout = held.connection.execute("PRAGMA busy_timeout").fetchall()[0][0]
            assert timeout == SQLITE_BUSY_TIMEOUT_SECONDS * 1000
        finally:
            stack.give_back(held)
    finally:
        locker.close()


def armed_during(locker: Locker, monkeypatch: pytest.MonkeyPatch, expires: float) -> list[float]:
    """The deadlines the watcher was armed with while a lock of ``expires`` seconds was taken
    and released."""
    armed: list[float] = []
    arm = deadlines._watcher.arm

    def spy(deadline: float, *args: Any) -> int:
        armed.append(deadline)
        return arm(deadline, *args)

    monkeypatch.setattr(deadlines._watcher, "arm", spy)
    locker.lock("watched", expires=expires).unlock()
    return armed


def test_sqlite_arms_the_watcher_only_for_a_release_its_busy_timeout_may_outlast(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite's statements wait for nothing but another connection's write lock, and no longer
    than the busy timeout: a release whose deadline is further off than the longest an
    operation can wait needs no watcher; a shorter lock's release is watched."""
    locker = Locker(f"sqlite:///{tmp_path / 'locks.db'}")
    try:
        assert armed_during(locker, monkeypatch, 20 * SQLITE_BUSY_TIMEOUT_SECONDS) == []
        assert len(armed_during(locker, monkeypatch, 10)) == 1
    finally:
        locker.close()


def busy_timeouts(locker: Locker) -> list[int]:
    """The busy timeout (ms) of each connection the Locker's operations keep."""
    stack = locker._operations.database.pool.stack
    assert stack is not None
    return [held.connection.execute("PRAGMA busy_timeout").fetchone()[0] for held in stack._idle]


def test_sqlite_gives_a_connection_its_busy_timeout_back_after_a_short_locks_statements(
    tmp_path: Path,
) -> None:
    """A lock shorter than the busy timeout has its release's wait for the write lock cut to
    its expiry; the connection goes back to the Locker with its own busy timeout, after a
    release that waited in vain too."""
    path = tmp_path / "locks.db"
    locker = Locker(f"sqlite:///{path}", grace=0.5)
    own = SQLITE_BUSY_TIMEOUT_SECONDS * 1000
    try:
        locker.lock("quick", expires=5).unlock()
        assert busy_timeouts(locker) == [own]
        lock = locker.lock("blocked", expires=1)
        writer = sqlite3.connect(path, isolation_level=None)
        writer.execute("BEGIN IMMEDIATE")
        try:
            with pytest.raises(LockLost):
                lock.unlock()
        finally:
            writer.execute("COMMIT")
            writer.close()
        assert busy_timeouts(locker) == [own]
    finally:
        locker.close()


def _pending_update(dbapi_connection: Any) -> Any:
    """An UPDATE ... RETURNING on ``dbapi_connection`` (an engine's, sync or under aiosqlite),
    stepped once and its row left unread, as a cancellation between a statement and its fetch
    leaves it: the change made, its write lock held, its commit pending. The cursor."""
    sql = "UPDATE counter SET n = n + 1 RETURNING n"
    cursor = dbapi_connection.cursor()
    if isinstance(dbapi_connection, sqlite3.Connection):
        cursor.execute(sql)
    else:  # SQLAlchemy's cursor reads every row at once: aiosqlite's own, under it
        kept = getattr(cursor, "_cursor", None)
        if kept is None:  # SQLAlchemy 2.0 (the oldest declared, run by .ci/run on its own)
            pytest.skip("SQLAlchemy 2.0's aiosqlite cursor leaves no statement unfinished")
        dbapi_connection.run_async(lambda _driver: kept.execute(sql))
    return cursor


@pytest.mark.parametrize("driver", ["sqlite3", "aiosqlite"])
def test_sqlite_abandons_a_connection_with_its_unfinished_statement_rolled_back(
    tmp_path: Path, driver: str
) -> None:
    """A connection discarded in the middle of an operation (``Backend.abandon``, then closed):
    its unfinished statement is rolled back and SQLite's write lock is free at once, though the
    statement's cursor is still referenced (as a reference cycle keeps it until a garbage
    collection); closed as it was, SQLite kept the connection and the lock until the cursor
    was freed, and then committed the statement."""
    path = tmp_path / "locks.db"
    with sqlite3.connect(path, isolation_level=None) as setup:
        setup.execute("CREATE TABLE counter (n INTEGER)")
        setup.execute("INSERT INTO counter VALUES (0)")
    url = resolve_url(f"sqlite:///{path}", asynchronous=driver == "aiosqlite")
    kept: list[Any] = []

    def abandon(dbapi_connection: Any) -> None:
        cursor = _pending_update(dbapi_connection)
        kept.append(cursor)
        SQLiteBackend.abandon(dbapi_connection, cursor)
        dbapi_connection.close()

    def detached(engine: Any) -> Any:
        fairy = engine.raw_connection()
        fairy.detach()  # the pool's no more, as a ConnectionStack's are
        return fairy.dbapi_connection

    if driver == "sqlite3":
        engine = create_locker_engine(url)
        abandon(detached(engine))
        engine.dispose()
    else:

        async def run() -> None:
            async_engine = create_async_locker_engine(url)
            await greenlets.run(lambda: abandon(detached(async_engine.sync_engine)))
            await async_engine.dispose()

        asyncio.run(run())
    probe = sqlite3.connect(path, isolation_level=None, timeout=0.5)
    try:
        probe.execute("BEGIN IMMEDIATE")  # "database is locked" while the statement lingers
        assert probe.execute("SELECT n FROM counter").fetchone() == (0,)
        probe.execute("COMMIT")
    finally:
        probe.close()
    assert kept


def test_sqlite_a_wait_cut_to_a_deadline_ends_after_it(tmp_path: Path) -> None:
    """A wait for another connection's write lock, cut to a deadline (``bound_waits``), ends
    no sooner than the deadline, whatever fraction of a millisecond it falls on, so that its
    error is judged as the deadline's. (Waits of 1.5 to 1.9 ms: rounded down, each would be
    cut to 1 ms, and SQLite's busy handler sleeps little longer than it is told.)"""
    path = tmp_path / "locks.db"
    writer = sqlite3.connect(path, isolation_level=None)
    waiter = sqlite3.connect(path, isolation_level=None, timeout=SQLITE_BUSY_TIMEOUT_SECONDS)
    writer.execute("BEGIN IMMEDIATE")
    try:
        for n in range(20):
            seconds = 0.0015 + (n % 5) / 10_000
            deadline = clock.now() + seconds
            undo = SQLiteBackend.bound_waits(waiter, seconds)
            assert undo is not None
            with pytest.raises(sqlite3.OperationalError, match="database is locked"):
                waiter.execute("BEGIN IMMEDIATE")
            ended = clock.now()
            SQLiteBackend.unbound_waits(waiter, undo)
            assert ended >= deadline, (n, ended - deadline)
    finally:
        writer.close()
        waiter.close()
