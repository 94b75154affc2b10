"""The connections lock operations run on: a Locker's ConnectionStack on an engine it made
(an AsyncLocker's tasks wait for one as tasks do), and a caller's Engine's pool. What is
checked: one connection and one cursor serve one operation after another; a dead or
interrupted connection is never reused; the pool's limits hold; a forked child never touches
its parent's connections."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import sqlite3
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import (
    AsyncAdaptedQueuePool,
    NullPool,
    Pool,
    QueuePool,
    SingletonThreadPool,
    StaticPool,
)
from sqlalchemy.util import greenlet_spawn

from sqllocker import (
    Lock,
    LockBusy,
    Locker,
    LockLost,
    UnsafeDatabase,
    UnsafeDatabaseWarning,
    execution,
)
from sqllocker.asyncio import AsyncLock, AsyncLocker
from sqllocker.asyncio import concurrency as async_concurrency
from sqllocker.backends import sqlite as sqlite_backend
from sqllocker.connections import ConnectionStack, StackedConnection
from sqllocker.engine import create_async_locker_engine, create_locker_engine, resolve_url
from tests.private_servers import running_private_server
from tests.test_fork_and_clocks import run_in_child


def stack_of(locker: Locker) -> ConnectionStack:
    stack = locker._operations.database.pool.stack
    assert stack is not None, "a Locker on a URL runs its lock operations on a ConnectionStack"
    return stack


def test_one_connection_and_one_cursor_serve_operation_after_operation(locker: Locker) -> None:
    locker.lock("warm up").unlock()
    stack = stack_of(locker)
    (held,) = stack._idle
    cursor = held.cursor
    for n in range(20):
        with locker.lock(f"job {n}") as lock:
            lock.extend(60)
    assert stack._idle == [held]
    assert held.cursor is cursor
    assert locker._operations.connections() == (1, 0)


def test_connections_closed_under_the_stack_are_replaced_and_the_idle_ones_dropped(
    locker: Locker, caplog: pytest.LogCaptureFixture
) -> None:
    stack = stack_of(locker)
    first, second = stack.take(), stack.take()
    stack.give_back(first)
    stack.give_back(second)
    assert locker._operations.connections() == (2, 0)
    for held in (first, second):  # as when the server restarts
        held.connection.close()

    with locker.lock("after the restart"):
        pass

    assert "connection was lost" in caplog.text
    assert locker._operations.connections() == (1, 0)
    (replacement,) = stack._idle
    assert replacement.connection not in (first.connection, second.connection)


def test_disposing_of_the_engine_closes_the_idle_connections(locker: Locker) -> None:
    locker.lock("warm up").unlock()
    (held,) = stack_of(locker)._idle
    locker.engine.dispose()  # what a user does to drop every connection
    assert locker._operations.connections() == (0, 0)
    locker.lock("next").unlock()
    assert stack_of(locker)._idle[0] is not held


def test_an_interrupted_operations_connection_is_never_reused(
    locker: Locker, monkeypatch: pytest.MonkeyPatch
) -> None:
    locker.lock("warm up").unlock()
    (interrupted,) = stack_of(locker)._idle

    def interrupt(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(execution.DriverSession, "_send", interrupt)
        with pytest.raises(KeyboardInterrupt):
            locker.lock("interrupted")
    assert locker._operations.connections() == (0, 0)
    locker.lock("next").unlock()
    assert locker._operations.connections() == (1, 0)
    assert stack_of(locker)._idle[0] is not interrupted


@pytest.fixture
def small_engine(tmp_path: Path) -> Iterator[sa.Engine]:
    engine = sa.create_engine(
        f"sqlite:///{tmp_path / 'small.db'}", pool_size=1, max_overflow=1, pool_timeout=0.2
    )
    yield engine
    engine.dispose()


def test_the_stack_keeps_the_pools_limits(small_engine: sa.Engine) -> None:
    stack = ConnectionStack(small_engine)
    first, second = stack.take(), stack.take()  # pool_size + max_overflow
    with pytest.raises(sa.exc.TimeoutError, match=r"in use for 0\.2 s"):
        stack.take()
    assert (stack.open, stack.in_use) == (2, 2)
    stack.give_back(first)
    stack.give_back(second)  # beyond pool_size idle: closed
    assert (stack.open, stack.in_use) == (1, 0)
    assert stack.take() is first


def test_a_caller_at_the_limit_gets_the_next_connection_given_back(tmp_path: Path) -> None:
    engine = sa.create_engine(
        f"sqlite:///{tmp_path / 'small.db'}", pool_size=1, max_overflow=1, pool_timeout=30
    )
    stack = ConnectionStack(engine)
    first, second = stack.take(), stack.take()
    got: list[StackedConnection | BaseException] = []

    def wait_for_one() -> None:
        try:
            got.append(stack.take())
        except BaseException as error:
            got.append(error)

    waiter = threading.Thread(target=wait_for_one)
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive(), "it should be waiting: both connections are in use"
    stack.give_back(second)
    waiter.join(10)  # far less than the pool's 30 s timeout
    assert got == [second]
    assert (stack.open, stack.in_use) == (2, 2)
    stack.give_back(first)
    stack.give_back(second)
    engine.dispose()


async def test_a_task_at_the_limit_waits_as_a_task_for_the_next_connection_given_back(
    tmp_path: Path,
) -> None:
    """An AsyncLocker's stack: a task that finds every connection in use waits without stopping
    the event loop (the other tasks go on, and one of them gives a connection back), and gets
    the connection given back; past the pool's timeout it is told so, the loop still running."""
    engine = create_async_engine(
        f"sqlite+aiosqlite:///{tmp_path / 'small.db'}",
        poolclass=AsyncAdaptedQueuePool,  # older SQLAlchemy gives aiosqlite files a NullPool
        pool_size=1,
        max_overflow=1,
        pool_timeout=30,
    )
    stack = ConnectionStack(engine.sync_engine, async_concurrency.ConnectionChanges)
    first, second = await greenlet_spawn(stack.take), await greenlet_spawn(stack.take)
    waiter = asyncio.create_task(greenlet_spawn(stack.take))
    await asyncio.sleep(0.3)  # returns only if the loop runs while the waiter waits
    assert not waiter.done(), "it should be waiting: both connections are in use"
    stack.give_back(second)
    assert await asyncio.wait_for(waiter, 10) is second  # far less than the pool's 30 s
    stack._timeout = 0.2
    started = time.monotonic()
    late = asyncio.create_task(greenlet_spawn(stack.take))
    await asyncio.sleep(0.05)
    assert not late.done()
    with pytest.raises(sa.exc.TimeoutError, match=r"in use for 0\.2 s"):
        await late
    assert 0.2 <= time.monotonic() - started < 5
    stack.give_back(first)
    stack.give_back(second)
    await engine.dispose()


def test_a_failed_connect_frees_its_place(tmp_path: Path) -> None:
    engine = sa.create_engine(
        f"sqlite:///{tmp_path / 'missing dir' / 'x.db'}", pool_size=1, max_overflow=0
    )
    stack = ConnectionStack(engine)
    for _ in range(3):  # would time out on the second try if the first kept its place
        with pytest.raises(Exception, match="unable to open database file"):
            stack.take()
    assert stack.open == 0


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "asyncio"])
@pytest.mark.parametrize(
    "url", ["sqlite://", "sqlite:///file:shared-memory?mode=memory&cache=shared&uri=true"]
)
def test_a_database_in_memory_keeps_the_pool_it_lives_in(url: str, asynchronous: bool) -> None:
    """SQLAlchemy 2.1 warns that a later release will give a ``mode=memory`` URL a QueuePool,
    whose connections come and go: sqllocker names the pool that its locks (the database
    itself, if unshared) live in, so no such change reaches them, nor the warning its users."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", sa.exc.SADeprecationWarning)
        if asynchronous:
            engine = create_async_locker_engine(resolve_url(url, asynchronous=True)).sync_engine
        else:
            engine = create_locker_engine(resolve_url(url))
    assert type(engine.pool) is StaticPool
    engine.dispose()


@pytest.mark.parametrize(
    "url", ["sqlite://", "sqlite:///file:shared-memory?mode=memory&cache=shared&uri=true"]
)
def test_the_threads_of_a_locker_on_a_database_in_memory_share_its_locks(url: str) -> None:
    """A database in memory is one connection's: every thread of the Locker works on that
    one, one operation at a time. With a connection (so a database) of each thread's own, a
    second thread took a lock the first held, its renewals and releases missed the row."""
    locker = Locker(url, grace=0)
    try:
        held = locker.lock("report")
        taken: list[object] = []

        def take() -> None:
            try:
                taken.append(locker.lock("report"))
            except LockBusy as busy:
                taken.append(busy)

        other = threading.Thread(target=take)
        other.start()
        other.join(30)
        assert len(taken) == 1
        assert isinstance(taken[0], LockBusy)
        # Kept alive by the keep-alive's thread, released by another thread.
        kept = locker.lock("kept", expires=1.2, keep_alive=True)
        time.sleep(2.5)
        assert kept.is_valid()
        releasing = threading.Thread(target=kept.unlock)
        releasing.start()
        releasing.join(30)
        assert not kept.is_locked
        threads = [
            threading.Thread(target=lambda n=n: locker.lock(f"many {n}").unlock()) for n in range(8)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        held.unlock()
        assert locker.locks() == []
    finally:
        locker.close()


def test_a_callers_pool_that_splits_a_database_in_memory_is_reported_or_refused() -> None:
    """A caller's Engine on ``sqlite://`` keeps a connection per thread (SingletonThreadPool),
    each a database of its own: a lock held on one thread is free on another. sqllocker
    cannot change a caller's pool: it says so, as of a setting that breaks the locks, and
    with strict=True refuses the database before writing anything."""
    engine = sa.create_engine("sqlite://")
    try:
        locker = Locker(engine)
        with pytest.warns(UnsafeDatabaseWarning, match="SingletonThreadPool .* poolclass=Static"):
            held = locker.lock("report")
        taken: list[object] = []
        thread = threading.Thread(target=lambda: taken.append(locker.lock("report")))
        thread.start()
        thread.join(30)
        assert len(taken) == 1  # what the warning is about: a second holder
        held.unlock()
        del taken[:]  # its database is its thread's, gone with it: nothing left to release
        with pytest.raises(UnsafeDatabase, match="SingletonThreadPool"):
            Locker(engine, strict=True).lock("refused")
        assert "refused" not in {info.lockstring for info in locker.locks()}
    finally:
        engine.dispose()
    shared = sa.create_engine("sqlite://", poolclass=StaticPool)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            Locker(shared).lock("report").unlock()
        # (Not a warning of anything else: a garbage collection meanwhile may say what it freed.)
        assert not [w for w in caught if issubclass(w.category, UnsafeDatabaseWarning)]
    finally:
        shared.dispose()


@pytest.mark.parametrize(
    ("url", "pool"),
    [
        ("sqlite:///:memory:", SingletonThreadPool),
        ("sqlite:///file:private?mode=memory&uri=true", SingletonThreadPool),  # no shared cache
        ("sqlite:///file:shared?mode=memory&cache=shared&uri=True", NullPool),
        ("sqlite:///file::memory:?uri=yes", QueuePool),
    ],
    ids=str,
)
def test_every_spelling_of_a_split_database_in_memory_is_refused_when_strict(
    url: str, pool: type[Pool]
) -> None:
    engine = sa.create_engine(url, poolclass=pool)
    try:
        with pytest.raises(UnsafeDatabase, match=f"a {pool.__name__} gives connections"):
            Locker(engine, strict=True).lock("refused")
    finally:
        engine.dispose()


@pytest.mark.parametrize(
    "url",
    [
        "sqlite://",
        "sqlite:///file:settings-memory?mode=memory&cache=shared&uri=true",
        "sqlite+aiosqlite://",
    ],
)
def test_a_database_in_memory_is_not_reported_for_its_journal(url: str) -> None:
    """A database in memory keeps its journal in memory, and a crash takes it whole, with every
    process that could hold its locks: nothing a second holder could meet outlives it. So
    neither a warning for every ``Locker("sqlite://")`` nor a refusal with strict=True; a
    file journalled in memory still is reported, and refused."""

    async def in_memory_async() -> None:
        locker = AsyncLocker(url, strict=True)
        await (await locker.lock("report")).unlock()
        await locker.aclose()

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if "aiosqlite" in url:
            asyncio.run(in_memory_async())
        else:
            locker = Locker(url, strict=True)
            locker.lock("report").unlock()
            locker.close()
            shared = sa.create_engine(url, poolclass=StaticPool)
            Locker(shared, strict=True).lock("report").unlock()
            shared.dispose()


def test_a_file_opened_by_a_callers_creator_on_sqlite_url_is_still_checked(
    tmp_path: Path,
) -> None:
    """The URL says ``sqlite://``, the caller's ``creator`` opens a file that syncs nothing:
    what is checked is the database the connection has, not what the URL says."""
    path = tmp_path / "locks.db"

    def unsynced() -> sqlite3.Connection:
        connection = sqlite3.connect(path, check_same_thread=False)
        connection.execute("PRAGMA synchronous=OFF")
        return connection

    engine = sa.create_engine("sqlite://", creator=unsynced, poolclass=StaticPool)
    try:
        with pytest.raises(UnsafeDatabase, match="synchronous=OFF"):
            Locker(engine, strict=True).lock("refused")
    finally:
        engine.dispose()


def test_a_file_journalled_in_memory_is_reported_or_refused(tmp_path: Path) -> None:
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'locks.db'}")
    sa.event.listen(engine, "connect", lambda dbapi, _: dbapi.execute("PRAGMA journal_mode=MEMORY"))
    try:
        with pytest.raises(UnsafeDatabase, match=r"journal_mode=MEMORY .*refused \(strict=True\)"):
            Locker(engine, strict=True).lock("refused")
        with pytest.warns(UnsafeDatabaseWarning, match="journal_mode=MEMORY .*pass strict=True"):
            Locker(engine).lock("report").unlock()
    finally:
        engine.dispose()


@pytest.mark.parametrize(
    "url",
    [
        "sqlite+aiosqlite://",
        "sqlite+aiosqlite:///file:shared-memory-tasks?mode=memory&cache=shared&uri=true",
    ],
)
async def test_the_tasks_of_an_async_locker_on_a_database_in_memory_run_one_operation_at_a_time(
    url: str,
) -> None:
    """An AsyncLocker's in-memory database is its one connection, shared by every task: a
    task's operation that awaits the driver mid-transaction (a group's BEGIN .. ROLLBACK) must
    not let another task's statements into that transaction. Let in, a lone acquire's row was
    rolled back with a refused group, and its holder held a lock nobody else could see."""
    locker = AsyncLocker(url, grace=0)
    seen_held = 0
    try:
        blocker = await locker.lock("held")

        async def refused_groups() -> None:
            for n in range(150):
                with pytest.raises(LockBusy):
                    await locker.lock_all([f"group {n}", "held"])

        async def lone_holders(k: int) -> None:
            nonlocal seen_held
            for n in range(150):
                lock = await locker.lock(f"lone {k} {n}")
                with pytest.raises(LockBusy):
                    await locker.lock(f"lone {k} {n}")  # a second holder
                await asyncio.sleep(0)  # the groups run meanwhile
                assert lock.lock_id in {info.lock_id for info in await locker.locks()}
                seen_held += 1
                await lock.unlock()  # LockLost if its row went with a rolled-back group

        await asyncio.gather(refused_groups(), refused_groups(), lone_holders(1), lone_holders(2))
        await blocker.unlock()
        assert await locker.locks() == []
        assert seen_held == 300
    finally:
        await locker.aclose()


async def test_operations_cut_short_on_a_database_in_memory_leave_its_locks_in_it() -> None:
    """An AsyncLocker's database in memory is its one connection: an operation cancelled
    mid-statement must not close that connection, as it would a server's, for the database
    and every lock in it would go with it (and the ids start again at 1). Its statement is
    ended, its transaction rolled back, and the connection serves on."""
    locker = AsyncLocker("sqlite+aiosqlite://", grace=0)
    try:
        held = await locker.lock("held")
        operations = [
            lambda: locker.locks(),
            lambda: locker.lock_all(["group a", "group b"]),
            lambda: locker.lock("lone"),
        ]
        for n in range(60):
            task = asyncio.ensure_future(operations[n % 3]())
            for _ in range(n // 3 % 6):
                await asyncio.sleep(0)  # cut short at a different step each time
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, LockBusy):
                won = await task
                if not isinstance(won, list):
                    await won.unlock()
            with pytest.raises(LockBusy):
                await locker.lock("held")  # a second holder, if the database went
        assert [info.lock_id for info in await locker.locks()] == [held.lock_id]
        later = await locker.lock_all(["group a", "group b"])  # no transaction left open
        assert min(lock.lock_id for lock in later.locks) > held.lock_id
        await later.unlock()
        await held.unlock()
    finally:
        await locker.aclose()


def test_locks_held_in_a_database_in_memory_are_lost_with_it() -> None:
    """A database in memory goes with its connection: when a Locker closes it, or an
    AsyncLocker's loop ends (it is closed then) or it moves to another loop, the locks still
    held in it are gone, and the same lockstrings free in the empty database that follows.
    Their holders are told first: each lock is lost (``on_lost`` called, no longer valid),
    before anyone can take it again."""
    lost: list[LockLost] = []
    locker = Locker("sqlite://", grace=0, on_lost=lost.append)
    held = locker.lock("report")
    locker.close()
    assert not held.is_valid()
    assert [error.lock_id for error in lost] == [held.lock_id]
    assert locker.lock("report").lock_id == held.lock_id  # the database is a new one
    locker.close()

    # However the connection goes: closed by SQLAlchemy's pool, say, as an interrupt landed
    # in its checkout. The next connection is a new database.
    lost.clear()
    locker = Locker("sqlite://", grace=0, on_lost=lost.append)
    held = locker.lock("report")
    with locker.engine.connect() as connection:
        connection.invalidate()
    again = locker.lock("report")
    assert [error.lock_id for error in lost] == [held.lock_id]
    assert not held.is_valid()
    assert again.is_valid()
    locker.close()

    # And on an Engine of the caller's that keeps the database's one connection.
    lost.clear()
    engine = sa.create_engine("sqlite://", poolclass=StaticPool)
    locker = Locker(engine, grace=0, on_lost=lost.append)
    held = locker.lock("report")
    with engine.connect() as connection:
        connection.invalidate()
    locker.lock("report")
    assert [error.lock_id for error in lost] == [held.lock_id]
    engine.dispose()

    alocker = AsyncLocker("sqlite+aiosqlite://", grace=0)

    async def hold() -> AsyncLock:
        return await alocker.lock("report")

    first = asyncio.run(hold())  # the loop ends with the lock held

    async def next_loop() -> None:
        assert not first.is_valid()  # before this loop takes the lock again
        again = await alocker.lock("report")
        with pytest.raises(LockLost):
            await first.unlock()
        await again.unlock()
        await alocker.aclose()

    asyncio.run(next_loop())


def test_an_on_lost_interrupted_as_a_database_in_memory_goes_leaves_no_lock_valid() -> None:
    calls: list[str] = []

    def interrupted(lost: LockLost) -> None:
        calls.append(lost.lockstring)
        if len(calls) == 1:
            raise KeyboardInterrupt

    locker = Locker("sqlite://", grace=0, on_lost=interrupted)
    held = [locker.lock(f"job {n}") for n in range(3)]
    with pytest.raises(KeyboardInterrupt):
        locker.close()
    assert sorted(calls) == ["job 0", "job 1", "job 2"]
    assert not [lock for lock in held if lock.is_valid()]


def test_a_lock_whose_database_in_memory_went_as_it_was_taken_is_never_handed_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The acquire's statement done, the Locker closed (by another thread, say) before the
    acquire hands the lock over: its database is gone, so the lock is refused (LockLost),
    not handed over valid while the same lockstring is free in the next database."""
    locker = Locker("sqlite://", grace=0)
    attempts = locker._acquirer.attempts
    handle = attempts.handle

    def closed_meanwhile(*args: Any) -> Lock:
        locker.close()
        return handle(*args)

    monkeypatch.setattr(attempts, "handle", closed_meanwhile)
    with pytest.raises(LockLost, match="before its acquire could hand it over"):
        locker.lock("job")
    monkeypatch.undo()
    locker.lock("job").unlock()
    locker.close()


def test_closing_a_locker_in_memory_waits_for_its_threads_operations() -> None:
    """Closing the one connection under another thread's statement crashed the interpreter;
    close() waits for the operation, the locks taken before are lost with the database (or
    refused, if it went as they were taken), and those taken after are held in the next."""
    script = """
import threading, warnings
warnings.simplefilter("ignore")
from sqllocker import Locker, LockError
for trial in range(40):
    locker = Locker("sqlite://")
    locker.lock("warm").unlock()
    taken, stop = [], threading.Event()
    def take():
        n = 0
        while not stop.is_set():
            try:
                taken.append(locker.lock(f"n{n}"))
            except LockError:
                pass
            n += 1
    thread = threading.Thread(target=take)
    thread.start()
    locker.close()
    stop.set()
    thread.join()
    for lock in taken:
        if lock.is_valid():  # taken in the next database: held there
            try:
                locker.lock(lock.lockstring)
            except LockError:
                continue
            raise AssertionError(f"two holders of {lock.lockstring!r}")
    locker.close()
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert (done.returncode, done.stdout.strip()) == (0, "ok"), done.stderr[-2000:]


def test_threads_share_the_stack_without_sharing_a_connection(locker: Locker) -> None:
    stack = stack_of(locker)
    in_use: set[int] = set()
    clashes = []
    guard = threading.Lock()
    real_take, real_give_back = stack.take, stack.give_back

    def take() -> StackedConnection:
        held = real_take()
        with guard:
            if id(held) in in_use:
                clashes.append(held)
            in_use.add(id(held))
        return held

    def give_back(held: StackedConnection) -> None:
        with guard:
            in_use.discard(id(held))
        real_give_back(held)

    stack.take, stack.give_back = take, give_back  # type: ignore[method-assign]

    def work(n: int) -> None:
        for m in range(40):
            locker.lock(f"thread {n} job {m}").unlock()

    threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert clashes == []
    assert locker.locks() == []
    assert locker._operations.connections()[1] == 0


def test_a_forked_child_opens_connections_of_its_own(locker: Locker) -> None:
    locker.lock("warm up").unlock()
    stack = stack_of(locker)
    (parents,) = stack._idle

    def child() -> None:
        with locker.lock("child's own"):
            pass
        assert stack._idle[0] is not parents
        assert stack._parents == [parents]  # kept, never closed by the child
        locker.engine.dispose()  # closes the child's connections, never the parent's
        assert stack._idle == []

    assert run_in_child(child) == 0
    assert stack._idle == [parents]
    locker.lock("parent's, on the same connection as before").unlock()
    assert stack._idle == [parents]


def test_a_callers_engine_keeps_its_pool_and_never_reuses_a_replaced_connections_cursor(
    url: str, table_name: str
) -> None:
    """A caller's Engine runs lock operations through its pool, one cursor per pooled
    connection; a connection that was replaced is never handed its old cursor."""
    engine = create_locker_engine(resolve_url(url))
    locker = Locker(engine, table=table_name, auto_create=True)
    assert locker._operations.database.pool.stack is None
    locker.lock("warm up").unlock()

    def kept() -> tuple[object, object]:
        fairy = engine.raw_connection()
        try:
            return fairy.info[execution._CURSOR_KEY]  # type: ignore[no-any-return]
        finally:
            fairy.close()

    first = kept()
    locker.lock("a").unlock()
    assert kept()[1] is first[1]

    fairy = engine.raw_connection()
    fairy.invalidate()  # replaced at its next checkout, as after a server restart
    fairy = engine.raw_connection()
    replacement = fairy.dbapi_connection
    fairy.info[execution._CURSOR_KEY] = first  # as if the old cursor were still on record
    fairy.close()
    locker.lock("b").unlock()
    assert kept()[1] is not first[1]
    # On the replacement itself: the old cursor did not fail it into yet another reconnect.
    assert kept()[0] is replacement
    locker.close()
    engine.dispose()


@contextlib.contextmanager
def a_rollback_journal_file_being_written(path: Path) -> Iterator[str]:
    """A lock table's file in rollback-journal mode (as other tools make one), which another
    connection, mid-write, holds for 0.3 s more; yields its path for a URL."""
    maker = Locker(f"sqlite:///{path}", table="semaphores")
    maker.create_table()
    maker.close()
    writer = sa.create_engine(f"sqlite:///{path}", isolation_level="AUTOCOMMIT")
    with writer.connect() as conn:
        conn.exec_driver_sql("PRAGMA journal_mode=DELETE")
        conn.exec_driver_sql("BEGIN IMMEDIATE")  # another process, mid-write
        conn.exec_driver_sql("CREATE TABLE other (x)")
        committer = threading.Timer(0.3, lambda: conn.exec_driver_sql("COMMIT"))
        committer.start()
        try:
            yield str(path)
        finally:
            committer.join()  # before the block closes the connection it commits on
    writer.dispose()


def test_a_first_connection_waits_while_another_process_writes_to_a_rollback_journal_file(
    tmp_path: Path,
) -> None:
    """Switching an SQLite file to WAL needs it to itself, and SQLite refuses at once, without
    its busy handler, while another connection writes. A file made by other tools starts in
    rollback-journal mode, so processes starting together on it met "database is locked" on
    connecting (seen in the contention test: its table is made by a plain engine)."""
    with a_rollback_journal_file_being_written(tmp_path / "locks.db") as path:
        locker = Locker(f"sqlite:///{path}", table="semaphores")
        try:
            with locker.lock("job"):
                pass
            with locker.engine.connect() as own:
                assert own.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        finally:
            locker.close()


async def test_an_async_first_connection_waits_there_without_blocking_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same wait under aiosqlite sleeps with asyncio: a blocking sleep there would stall
    every task of the application for up to the busy timeout."""

    def blocking_sleep(seconds: float) -> None:
        raise AssertionError(f"time.sleep({seconds}) on the event loop")

    monkeypatch.setattr(
        sqlite_backend, "time", SimpleNamespace(monotonic=time.monotonic, sleep=blocking_sleep)
    )
    with a_rollback_journal_file_being_written(tmp_path / "locks.db") as path:
        locker = AsyncLocker(f"sqlite+aiosqlite:///{path}", table="semaphores")
        try:
            started = time.monotonic()
            async with locker.lock("job"):
                pass
            assert time.monotonic() - started >= 0.25  # it did wait for the writer
        finally:
            await locker.aclose()


def _page_size(path: Path) -> int:
    with sqlite3.connect(path) as plain:
        return int(plain.execute("PRAGMA page_size").fetchone()[0])


@pytest.mark.parametrize("front_end", ["sync", "asyncio"])
def test_a_new_sqlite_file_gets_small_pages_and_an_existing_one_keeps_its_own(
    tmp_path: Path, front_end: str
) -> None:
    """Every commit writes whole pages to the log, and a cycle dirties seven (the row, two
    indexes, the id sequence): a file sqllocker makes has pages of NEW_FILE_PAGE_SIZE bytes.
    A file that already holds something keeps the page size it was made with, as SQLite only
    changes it by rewriting the whole file."""
    new, existing = tmp_path / "new.db", tmp_path / "existing.db"
    with sqlite3.connect(existing) as plain:
        plain.execute("CREATE TABLE other (x)")  # made by another tool, with SQLite's default
    default = _page_size(existing)
    assert default != sqlite_backend.NEW_FILE_PAGE_SIZE
    for path in (new, existing):
        if front_end == "sync":
            locker = Locker(f"sqlite:///{path}", table="semaphores")
            with locker.lock("job"):
                pass
            locker.close()
        else:

            async def cycle(path: Path = path) -> None:
                locker = AsyncLocker(f"sqlite+aiosqlite:///{path}", table="semaphores")
                async with locker, locker.lock("job"):
                    pass

            asyncio.run(cycle())
    assert _page_size(new) == sqlite_backend.NEW_FILE_PAGE_SIZE
    assert _page_size(existing) == default


def _session_cipher(pooled: Any) -> str:
    """The TLS cipher of a pooled MariaDB connection's session ('' without TLS)."""
    cursor = pooled.driver_connection.cursor()
    cursor.execute("SHOW SESSION STATUS LIKE 'Ssl_cipher'")
    return str(cursor.fetchone()[1])


@pytest.mark.slow
def test_pymysql_connections_share_one_tls_context_and_still_speak_tls() -> None:
    """PyMySQL builds a TLS context for every connection, given no TLS options, at a cost far
    above the connection's own (``backends/pymysql_tls.py``): a Locker's connections share
    one, built as PyMySQL builds it, and still speak TLS to a server that offers it; a URL's
    own TLS options, and PyMySQL's connections made outside sqllocker, keep a context of their
    own."""
    import pymysql

    certificates = Path(tempfile.mkdtemp(prefix="sqllocker-tls-"))
    try:
        certificates.chmod(0o755)  # the server runs as mysql
        cert, key = certificates / "cert.pem", certificates / "key.pem"
        subprocess.run(
            [
                *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
                *("-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"),
                *("-keyout", str(key), "-out", str(cert)),
            ],
            check=True,
            capture_output=True,
        )
        key.chmod(0o644)
        tls = (f"--ssl-cert={cert}", f"--ssl-key={key}")
        with running_private_server("mysql", *tls) as server:
            locker = Locker(server.url, table="semaphores", auto_create=True)
            with locker.lock("over tls"):
                pass
            first, second = locker.engine.raw_connection(), locker.engine.raw_connection()
            shared = first.driver_connection.ctx
            assert second.driver_connection.ctx is shared
            assert _session_cipher(first)
            assert _session_cipher(second)
            # What PyMySQL's preferred mode builds: TLS if offered, nothing verified.
            assert shared.verify_mode == ssl.CERT_NONE
            assert not shared.check_hostname
            first.close()
            second.close()
            locker.close()

            own = Locker(f"{server.url}?ssl_ca={cert}", table="semaphores")
            with own.lock("over tls, verified"):
                pass
            verified = own.engine.raw_connection()
            assert verified.driver_connection.ctx is not shared
            assert verified.driver_connection.ctx.verify_mode == ssl.CERT_REQUIRED
            assert _session_cipher(verified)
            verified.close()
            own.close()

            plain = pymysql.connect(host="127.0.0.1", port=server.port, user="root")
            assert plain.ctx is not shared
            plain.close()
    finally:
        shutil.rmtree(certificates, ignore_errors=True)


@pytest.mark.parametrize(
    "option", ["nolock=1", "nolock=yes", "nolock=2", "nolock=01", "nolock=1x", "vfs=unix-none"]
)
def test_an_sqlite_uri_that_takes_no_file_locks_is_reported_or_refused(
    tmp_path: Path, option: str
) -> None:
    """``nolock=1`` (or a VFS without locks) in an SQLite URI: two processes may write the
    database at once, and each take the lock. It was taken as any file. Every spelling SQLite
    reads as true counts (a number by its leading digits)."""
    url = f"sqlite:///file:{tmp_path / 'locks.db'}?uri=true&{option}"
    with pytest.raises(UnsafeDatabase, match=rf"{option} .*refused \(strict=True\)"):
        Locker(url, strict=True).lock("refused")
    locker = Locker(url)
    try:
        with pytest.warns(UnsafeDatabaseWarning, match=rf"{option} .*pass strict=True"):
            locker.lock("report").unlock()
    finally:
        locker.close()
