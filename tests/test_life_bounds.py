"""Operations on a held lock end within the lock's own life, whatever the driver's timeouts.

A frozen server or pooler (the kernel still acknowledges: ``tests/stall_proxy.py`` holds every
byte) leaves a statement without an answer for the driver's 60 s read or statement timeout
(MariaDB), or for ever (libpq has no read timeout); on SQLite, another connection that holds
the write lock (an operator's shell, a backup) leaves one waiting for the 60 s busy timeout. A
renewal, an ``extend()`` or an ``unlock()`` on such a connection must end in a ``LockError``
or success within about the lock's remaining life, and a second holder may come only after
the first was told.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from sqllocker import DatabaseError, LockBusy, Locker, LockError, LockLost, clock, timeouts
from sqllocker.connections import ConnectionStack
from sqllocker.engine import resolve_url
from tests.helpers import (
    FRONTS,
    Front,
    Proxied,
    abandon,
    count_rows,
    ended_within,
    figure,
    through_proxy,
)

pytestmark = pytest.mark.slow  # stalls of several seconds

GRACE = 1.0
EXPIRES = 4.0
# Far below the drivers' 60 s, far above the lock's 4 s life: a load spike cannot fail it.
WITHIN_LIFE = 25.0
SYNC = FRONTS[0]


class Told:
    """What a holder's on_lost saw: how many times, and when first."""

    def __init__(self) -> None:
        self.count = 0
        self.at: float | None = None

    def __call__(self, lost: LockLost) -> None:
        self.count += 1
        self.at = self.at or time.monotonic()


def _held_by(outcome: dict[str, Any], lock: Any) -> None:
    outcome.update(lock_id=lock.lock_id, still_valid=lock.is_valid)


def _takes_over_after(
    contender: Locker, lockstring: str, first: dict[str, Any], told: Told | None
) -> None:
    """A second holder waits for the lock: it gets it only after the first was told (is_valid
    False, on_lost called for a kept-alive lock), and with a higher fencing token."""
    second = contender.lock(lockstring, wait=30)
    acquired_at = time.monotonic()
    try:
        assert not first["still_valid"](), "two valid holders at once"
        assert second.lock_id > first["lock_id"], "fencing token went back"
        if told is not None:
            assert told.count == 1
            assert told.at is not None
            assert told.at < acquired_at, "told after the takeover"
    finally:
        second.unlock()


def _release_figure(
    scenario: str, call: str, backend: str, front: Front, outcome: dict[str, Any]
) -> None:
    figure(
        scenario,
        f"{backend} {front}",
        f"expiry {EXPIRES}s: {call} ended in {outcome['took']:.1f}s, "
        f"{type(outcome['error']).__name__}",
    )


@pytest.mark.parametrize("front", FRONTS, ids=str)
@pytest.mark.parametrize("backend", ["postgresql", "mysql"])
def test_extend_behind_a_stuck_renewal_ends_within_the_locks_life(
    proxied: Proxied, table_name: str, make_locker: Any, backend: str, front: Front
) -> None:
    """A caller's extend() issued while the keep-alive's renewal is stuck on a frozen
    connection does not queue behind it for the driver's timeout."""
    contender = make_locker(grace=GRACE)
    told = Told()
    outcome: dict[str, Any] = {}

    async def scenario(locker: Any) -> None:
        lock = await front.call(locker.lock, "job", expires=EXPIRES, keep_alive=True, on_lost=told)
        _held_by(outcome, lock)
        proxied.proxy.stall()
        await asyncio.sleep(EXPIRES / 3 + 0.5)  # the first renewal is stuck now
        outcome.update(await front.timed(lock.extend))
        await asyncio.to_thread(_takes_over_after, contender, "job", outcome, told)

    through_proxy(front, proxied, table_name, scenario, GRACE)
    ended_within(outcome, WITHIN_LIFE, LockLost)
    _release_figure("extend behind a stuck renewal", "extend()", backend, front, outcome)


@pytest.mark.parametrize("front", FRONTS, ids=str)
@pytest.mark.parametrize("backend", ["postgresql", "mysql"])
def test_unlock_on_a_frozen_connection_ends_within_the_locks_life(
    proxied: Proxied, table_name: str, make_locker: Any, backend: str, front: Front
) -> None:
    """unlock()'s DELETE on a frozen connection, no renewal in flight: it gives up once the
    lock has expired (nothing is left to release), with LockLost."""
    contender = make_locker(grace=GRACE)
    outcome: dict[str, Any] = {}

    async def scenario(locker: Any) -> None:
        lock = await front.call(locker.lock, "job", expires=EXPIRES)
        _held_by(outcome, lock)
        proxied.proxy.stall()
        outcome.update(await front.timed(lock.unlock))
        await asyncio.to_thread(_takes_over_after, contender, "job", outcome, None)

    through_proxy(front, proxied, table_name, scenario, GRACE)
    ended_within(outcome, WITHIN_LIFE, LockLost)
    _release_figure("unlock on a frozen connection", "unlock()", backend, front, outcome)


@pytest.mark.parametrize("backend", ["postgresql", "mysql"])
def test_unlock_that_must_connect_to_a_frozen_server_ends_within_the_locks_life(
    proxied: Proxied, table_name: str, make_locker: Any, backend: str
) -> None:
    """unlock() with no connection left to it (each was lost) opens one to a frozen server,
    which accepts and never answers: the new connection gives up by the lock's expiry, not
    after the driver's connect timeout (10 s), and nothing is left that a takeover meets."""
    contender = make_locker(grace=GRACE)
    outcome: dict[str, Any] = {}

    async def scenario(locker: Locker) -> None:
        lock = locker.lock("job", expires=EXPIRES)
        _held_by(outcome, lock)
        locker._operations.forget_connections()  # the release must open a connection
        proxied.proxy.stall()
        outcome.update(await SYNC.timed(lock.unlock))
        _takes_over_after(contender, "job", outcome, None)

    through_proxy(SYNC, proxied, table_name, scenario, GRACE)
    # The lock's life (EXPIRES) and the smallest connect timeout a driver takes (2 s), with
    # room for a loaded machine; the driver's own 10 s would be past it.
    ended_within(outcome, EXPIRES + 5.0, LockLost)


@pytest.mark.parametrize("front", FRONTS, ids=str)
@pytest.mark.parametrize("backend", ["postgresql", "mysql"])
def test_a_stuck_renewal_delays_no_other_locks_renewals(
    proxied: Proxied, table_name: str, make_locker: Any, backend: str, front: Front
) -> None:
    """One kept-alive lock's renewal stuck on a frozen connection (that connection alone) for
    several renewal periods: the Locker's other kept-alive lock is renewed all along, and the
    stuck one is lost at its deadline, told before anyone takes it over."""
    contender = make_locker(grace=GRACE)
    proxy = proxied.proxy
    expires = 3.0
    told_stuck, told_fine = Told(), Told()
    outcome: dict[str, Any] = {}

    def check(stuck: Any, fine: Any) -> None:
        assert proxy.connections_frozen == 1, "the stuck lock's renewal never came"
        assert fine.is_valid(), "a renewal waited behind another"
        assert told_fine.count == 0
        assert contender.try_lock("fine") is None, "two holders at once"
        _held_by(outcome, stuck)
        _takes_over_after(contender, "stuck", outcome, told_stuck)

    async def scenario(locker: Any) -> None:
        kept = {"expires": expires, "keep_alive": True}
        stuck = await front.call(locker.lock, "stuck", **kept, on_lost=told_stuck)
        fine = await front.call(locker.lock, "fine", **kept, on_lost=told_fine)
        proxy.freeze_connection_before(stuck.guid.encode())
        # Until the stuck lock was told lost at its deadline (its renewal stuck for several
        # renewal periods), and the other was renewed since: a renewal queued behind the stuck
        # one would never come, and the check below finds the other lapsed.
        deadline = time.monotonic() + 3 * expires
        while time.monotonic() < deadline:
            # valid_until is on sqllocker's clock, Told.at on time.monotonic()
            fine_until = fine._state.valid_until - clock.now() + time.monotonic()
            if told_stuck.at is not None and fine_until > told_stuck.at + expires / 2:
                break
            await asyncio.sleep(0.05)
        await asyncio.to_thread(check, stuck, fine)
        await front.call(fine.unlock)

    through_proxy(front, proxied, table_name, scenario, GRACE)


@pytest.mark.parametrize("front", FRONTS, ids=str)
@pytest.mark.parametrize("backend", ["postgresql", "mysql"])
def test_a_wait_against_an_unreachable_server_ends_with_the_wait(
    proxied: Proxied, table_name: str, make_locker: Any, backend: str, front: Front
) -> None:
    """A server that accepts connections and never answers (the kernel completes the
    handshake; nothing comes back): lock(wait=W) ends within about W, not after the driver's
    connect timeout (10 s) or read timeout (60 s)."""
    make_locker()  # creates the table
    wait = 1.0
    outcome: dict[str, Any] = {}
    proxied.proxy.stall()

    async def scenario(locker: Any) -> None:
        outcome.update(await front.timed(locker.lock, "job", wait=wait))

    through_proxy(front, proxied, table_name, scenario, GRACE)
    ended_within(outcome, 8, LockError)  # against the 10 s connect timeout
    figure(
        "a wait against an unreachable server",
        f"{backend} {front}",
        f"wait {wait}s: ended in {outcome['took']:.1f}s, {type(outcome['error']).__name__}",
    )


@pytest.mark.parametrize("front", FRONTS, ids=str)
@pytest.mark.parametrize("backend", ["postgresql", "mysql"])
def test_an_acquire_that_failed_after_its_insert_committed_leaves_no_row(
    proxied: Proxied, table_name: str, make_locker: Any, backend: str, front: Front
) -> None:
    """An acquire's INSERT commits and its answer is lost with the connection; the outage
    outlasts the wait, and the acquire fails. Its row, held by nobody, must not stand for its
    whole expiry (60 s here): it is deleted in the background once the database answers again,
    by its guid, and another process can take the lock then, with nobody else holding it."""
    contender = make_locker(grace=GRACE)
    proxy = proxied.proxy
    outcome: dict[str, Any] = {}
    proxy.lose_answer_to(table_name.encode() + b" (lockstring", then_stall=True)

    def taken_once_free() -> None:
        second = contender.lock("job", wait=20)
        outcome["second"] = second
        second.unlock()

    async def scenario(locker: Any) -> None:
        outcome.update(await front.timed(locker.lock, "job", expires=60, wait=1))
        outcome["rows"] = len(await asyncio.to_thread(contender.locks))
        proxy.resume()
        await asyncio.to_thread(taken_once_free)

    through_proxy(front, proxied, table_name, scenario, GRACE)
    assert proxy.answers_lost == 1
    assert isinstance(outcome.get("error"), LockError), outcome
    assert outcome["rows"] == 1, "the INSERT had committed"
    assert outcome["second"] is not None, "the row stood, held by nobody"


class Writer:
    """Another connection to an SQLite file, holding its write lock (``BEGIN IMMEDIATE``) from
    ``hold()`` until ``commit()``, or until a rescue 40 s on, which ends the test's stuck
    statements if the code under test never does (the busy timeout is 60 s)."""

    def __init__(self, path: Path) -> None:
        self._connection = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._mutex = threading.Lock()
        self._rescue = threading.Timer(40, self.commit)

    def hold(self) -> None:
        self._connection.execute("BEGIN IMMEDIATE")
        self._rescue.start()

    def commit(self) -> None:
        with self._mutex:
            if self._connection.in_transaction:
                self._connection.execute("COMMIT")

    def close(self) -> None:
        self._rescue.cancel()
        self.commit()
        self._connection.close()


def _beside_a_writer(
    front: Front, url: str, table_name: str, scenario: Callable[[Any, Writer], Awaitable[None]]
) -> None:
    """Run ``scenario`` with a Locker (or AsyncLocker) on the SQLite file of ``url`` and a
    Writer on it; the writer commits before the Locker closes."""
    writer = Writer(Path(url.removeprefix("sqlite:///")))

    async def run() -> None:
        locker = front.locker(url, table=table_name, grace=GRACE)
        try:
            await scenario(locker, writer)
        finally:
            writer.close()
            await front.close(locker)

    asyncio.run(run())


@pytest.mark.parametrize("front", FRONTS, ids=str)
@pytest.mark.parametrize("backend", ["sqlite"])
def test_unlock_behind_another_connections_write_lock_ends_within_the_locks_life(
    url: str, table_name: str, make_locker: Any, backend: str, front: Front
) -> None:
    """unlock() while another connection holds SQLite's write lock past the lock's expiry: the
    DELETE does not wait out the busy timeout; it gives up once the lock has expired, with
    LockLost, and a second holder comes only after that."""
    contender = make_locker(grace=GRACE)
    outcome: dict[str, Any] = {}

    async def scenario(locker: Any, writer: Writer) -> None:
        lock = await front.call(locker.lock, "job", expires=EXPIRES)
        _held_by(outcome, lock)
        writer.hold()
        outcome.update(await front.timed(lock.unlock))
        writer.commit()
        await asyncio.to_thread(_takes_over_after, contender, "job", outcome, None)

    _beside_a_writer(front, url, table_name, scenario)
    ended_within(outcome, WITHIN_LIFE, LockLost)
    _release_figure("unlock behind a writer", "unlock()", backend, front, outcome)


@pytest.mark.parametrize("first_use", [False, True], ids=["used", "first use"])
@pytest.mark.parametrize("wait", [0, 1.0])
@pytest.mark.parametrize("front", FRONTS, ids=str)
@pytest.mark.parametrize("backend", ["sqlite"])
def test_lock_behind_another_connections_write_lock_ends_by_its_wait_and_the_slack(
    url: str,
    table_name: str,
    make_locker: Any,
    backend: str,
    front: Front,
    wait: float,
    first_use: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """lock(wait=W) while another connection holds SQLite's write lock for longer: the acquire
    ends by W and ``timeouts.ACQUIRE_SLACK_SECONDS`` with a DatabaseError (the database is
    locked: no holder of the lock, which a LockBusy would name, or skip a job for), as it does
    on a server whose row lock another transaction holds, instead of waiting out one busy
    timeout (60 s) after another, each retried as contention. It leaves no row: once the
    writer commits, the lock is free. So does a Locker's first lock (the table made before)."""
    slack = 1.5  # the servers' 65 s, shortened for the test
    monkeypatch.setattr(timeouts, "ACQUIRE_SLACK_SECONDS", slack)
    make_locker().lock("warm up").unlock()  # the table and the file's settings
    outcome: dict[str, Any] = {}

    async def scenario(locker: Any, writer: Writer) -> None:
        if not first_use:
            await front.call((await front.call(locker.lock, "warm up")).unlock)
        writer.hold()
        outcome.update(await front.timed(locker.lock, "job", wait=wait))
        writer.commit()
        lock = await front.call(locker.lock, "job")  # free: wait=0
        await front.call(lock.unlock)

    _beside_a_writer(front, url, table_name, scenario)
    ended_within(outcome, wait + slack + 5.0, DatabaseError)
    assert outcome["took"] >= wait, outcome


@pytest.mark.parametrize("front", FRONTS, ids=str)
@pytest.mark.parametrize("backend", ["sqlite"])
def test_lock_all_behind_another_connections_write_lock_ends_by_its_wait_and_the_slack(
    url: str,
    table_name: str,
    make_locker: Any,
    backend: str,
    front: Front,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """lock_all(wait=W) behind SQLite's write lock held by another connection: as lock()'s,
    its attempts end by W and the slack (a DatabaseError: the database is locked), and leave
    no row; its keep-alive, started once the group is taken, renews it as ever."""
    slack = 1.5
    monkeypatch.setattr(timeouts, "ACQUIRE_SLACK_SECONDS", slack)
    make_locker().lock("warm up").unlock()
    outcome: dict[str, Any] = {}

    async def scenario(locker: Any, writer: Writer) -> None:
        writer.hold()
        outcome.update(await front.timed(locker.lock_all, ["a", "b"], wait=0.5))
        writer.commit()
        group = await front.call(locker.lock_all, ["a", "b"], expires=1.5, keep_alive=True)
        await asyncio.sleep(3 * slack)  # past the slack, and the expiry: renewed meanwhile
        assert all(lock.is_valid() for lock in group.locks)
        await front.call(group.unlock)

    _beside_a_writer(front, url, table_name, scenario)
    ended_within(outcome, 0.5 + slack + 5.0, DatabaseError)


@pytest.mark.parametrize("front", FRONTS, ids=str)
@pytest.mark.parametrize("backend", ["sqlite"])
def test_extend_behind_another_connections_write_lock_ends_within_the_locks_life(
    url: str, table_name: str, make_locker: Any, backend: str, front: Front
) -> None:
    """extend() of a kept-alive lock while another connection holds SQLite's write lock past
    the lock's expiry: LockLost within the lock's life, on_lost called once, and both before
    a second holder takes the lock once the writer commits."""
    contender = make_locker(grace=GRACE)
    told = Told()
    outcome: dict[str, Any] = {}

    async def scenario(locker: Any, writer: Writer) -> None:
        lock = await front.call(locker.lock, "job", expires=EXPIRES, keep_alive=True, on_lost=told)
        _held_by(outcome, lock)
        writer.hold()
        outcome.update(await front.timed(lock.extend))
        writer.commit()
        await asyncio.to_thread(_takes_over_after, contender, "job", outcome, told)

    _beside_a_writer(front, url, table_name, scenario)
    ended_within(outcome, WITHIN_LIFE, LockLost)
    _release_figure("extend behind a writer", "extend()", backend, front, outcome)


@pytest.mark.parametrize("front", FRONTS, ids=str)
@pytest.mark.parametrize("backend", ["sqlite"])
def test_a_renewal_behind_another_connections_write_lock_is_told_lost_within_the_locks_life(
    url: str,
    table_name: str,
    make_locker: Any,
    backend: str,
    front: Front,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A kept-alive lock whose renewals wait behind another connection's write lock past the
    lock's expiry: on_lost is called once within the lock's life, and the Locker's next
    lock, once the writer has committed, is not held up by the renewal that waited.

    An AsyncLocker's renewal is cancelled at the deadline, and its connection discarded while
    the statement still waits in aiosqlite's thread: closing it must end that statement, not
    leave it, and SQLite's write lock, to whenever its cursor is freed. The discarded
    connections are kept referenced here, as a reference cycle would keep them until a
    garbage collection."""
    discarded: list[Any] = []
    discard = ConnectionStack.discard

    def keeping(stack: ConnectionStack, held: Any) -> None:
        discarded.append(held)
        discard(stack, held)

    monkeypatch.setattr(ConnectionStack, "discard", keeping)
    contender = make_locker(grace=GRACE)
    told = Told()
    outcome: dict[str, Any] = {}

    async def scenario(locker: Any, writer: Writer) -> None:
        lock = await front.call(locker.lock, "job", expires=EXPIRES, keep_alive=True, on_lost=told)
        _held_by(outcome, lock)
        writer.hold()
        started = time.monotonic()
        while told.count == 0 and time.monotonic() - started < WITHIN_LIFE:
            await asyncio.sleep(0.1)
        outcome["took"] = time.monotonic() - started
        writer.commit()
        await asyncio.to_thread(_takes_over_after, contender, "job", outcome, told)
        again = await front.timed(locker.lock, "next", expires=EXPIRES)
        outcome["next"] = again
        await front.call(again["result"].unlock)

    _beside_a_writer(front, url, table_name, scenario)
    assert outcome["took"] < WITHIN_LIFE, outcome
    assert outcome["next"]["took"] < WITHIN_LIFE, outcome
    # The case above: the async renewal's connection was discarded mid-statement.
    assert discarded or front is SYNC


# The slack of the test's acquires (``timeouts.ACQUIRE_SLACK_SECONDS``: the statement timeout
# and 5 s, over a minute) cut to this.
TEST_SLACK = 5.0


@pytest.mark.parametrize(
    ("front", "wait"), [(FRONTS[0], 0), (FRONTS[0], 2.0), (FRONTS[1], 0)], ids=str
)
@pytest.mark.parametrize("backend", ["postgresql", "mysql"])
def test_an_acquire_on_a_frozen_connection_ends_with_its_wait(
    proxied: Proxied,
    table_name: str,
    make_locker: Any,
    backend: str,
    front: Front,
    wait: float,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """lock()'s INSERT on a pooled connection that froze (its server or pooler hung, the
    kernel still acknowledging): the acquire ends by its wait plus ACQUIRE_SLACK_SECONDS with
    an outage's DatabaseError that says so, not for ever (libpq); nothing it began is left
    holding the lockstring, and a second acquirer gets it at once."""
    monkeypatch.setattr(timeouts, "ACQUIRE_SLACK_SECONDS", TEST_SLACK)
    contender = make_locker(grace=GRACE)
    outcome: dict[str, Any] = {}

    async def scenario(locker: Any) -> None:
        await front.call((await front.call(locker.lock, "warm")).unlock)  # a pooled connection
        proxied.proxy.freeze_connection_before(b"frozen job")
        outcome.update(await front.timed(locker.lock, "frozen job", wait=wait))
        second = await asyncio.to_thread(contender.lock, "frozen job")
        second.unlock()

    through_proxy(front, proxied, table_name, scenario, GRACE)
    assert proxied.proxy.connections_frozen == 1, outcome
    ended_within(outcome, wait + TEST_SLACK + 3.0, DatabaseError)
    assert outcome["error"].outage, outcome
    assert "no answer from" in str(outcome["error"]), outcome
    figure(
        "acquire on a frozen connection",
        f"{backend} {front} wait={wait}",
        f"lock() ended in {outcome['took']:.1f}s, {type(outcome['error']).__name__}",
    )


@pytest.mark.parametrize(("front", "wait"), [(FRONTS[0], 0), (FRONTS[1], 1.0)], ids=str)
@pytest.mark.parametrize("backend", ["postgresql", "mysql"])
def test_a_lock_all_on_a_frozen_connection_ends_with_its_wait(
    proxied: Proxied,
    table_name: str,
    make_locker: Any,
    backend: str,
    front: Front,
    wait: float,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """lock_all()'s transaction on a pooled connection that froze: as lock()'s acquire, it
    ends by its wait plus ACQUIRE_SLACK_SECONDS with an outage's DatabaseError naming the
    group, not for ever; a second acquirer then gets every member at once."""
    monkeypatch.setattr(timeouts, "ACQUIRE_SLACK_SECONDS", TEST_SLACK)
    contender = make_locker(grace=GRACE)
    outcome: dict[str, Any] = {}
    members = ["frozen a", "frozen b"]

    async def scenario(locker: Any) -> None:
        await front.call((await front.call(locker.lock, "warm")).unlock)  # a pooled connection
        proxied.proxy.freeze_connection_before(b"frozen a")
        outcome.update(await front.timed(locker.lock_all, members, wait=wait))
        second = await asyncio.to_thread(contender.lock_all, members)
        second.unlock()

    through_proxy(front, proxied, table_name, scenario, GRACE)
    assert proxied.proxy.connections_frozen == 1, outcome
    ended_within(outcome, wait + TEST_SLACK + 3.0, DatabaseError)
    assert outcome["error"].outage, outcome
    assert "no answer from" in str(outcome["error"]), outcome
    assert "2 locks from 'frozen a'" in str(outcome["error"]), outcome
    figure(
        "lock_all on a frozen connection",
        f"{backend} {front} wait={wait}",
        f"lock_all() ended in {outcome['took']:.1f}s, {type(outcome['error']).__name__}",
    )


@contextlib.contextmanager
def sleeping_triggers(
    url: str, table_name: str, seconds: float, triggers: dict[str, str]
) -> Iterator[None]:
    """Within the block, PostgreSQL triggers on the lock table that sleep ``seconds`` where
    they fire: each of ``triggers`` by its name's suffix and the text between ``CREATE TRIGGER
    name`` and ``EXECUTE FUNCTION`` (with ``{table}``; one of a ``DEFERRABLE`` kind is made a
    constraint trigger, which fires at the commit)."""
    admin = sa.create_engine(resolve_url(url))
    function = f"{table_name}_slow"
    with admin.begin() as conn:
        conn.exec_driver_sql(
            f"CREATE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS "
            f"$$ BEGIN PERFORM pg_sleep({float(seconds)}); RETURN NEW; END $$"
        )
        for suffix, when in triggers.items():
            kind = "CONSTRAINT TRIGGER" if "DEFERRABLE" in when else "TRIGGER"
            conn.exec_driver_sql(
                f"CREATE {kind} {table_name}_{suffix} {when.format(table=table_name)} "
                f"EXECUTE FUNCTION {function}()"
            )
    try:
        yield
    finally:
        with admin.begin() as conn:
            for suffix in triggers:
                conn.exec_driver_sql(
                    f"DROP TRIGGER IF EXISTS {table_name}_{suffix} ON {table_name}"
                )
            conn.exec_driver_sql(f"DROP FUNCTION IF EXISTS {function}()")
        admin.dispose()


@pytest.mark.parametrize("backend", ["postgresql"])
def test_an_acquire_cut_while_its_commit_waits_leaves_no_row_for_long(
    url: str, table_name: str, make_locker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A commit that outlasts the acquire's cut (a synchronous standby gone; here a deferred
    trigger that sleeps at the commit, which no statement timeout ends): the sync front shuts
    its socket, the server commits the row anyway, after the forget's first DELETE found
    nothing to delete. The forget goes on looking through its window, and deletes the row once
    it is there: it was held by nobody for the lock's expiry."""
    monkeypatch.setattr(timeouts, "ACQUIRE_SLACK_SECONDS", 1.0)
    locker = make_locker(expires=120)
    late = "AFTER INSERT ON {table} DEFERRABLE INITIALLY DEFERRED FOR EACH ROW"
    with sleeping_triggers(
        url, table_name, 4, {"slow": f"{late} WHEN (NEW.lockstring = 'slow job')"}
    ):
        locker.lock("warm").unlock()
        started = time.monotonic()
        with pytest.raises(DatabaseError, match="no answer from"):
            locker.lock("slow job")
        assert time.monotonic() - started < 3.5
        contender = make_locker(expires=120)
        contender.lock("slow job", wait=20).unlock()  # by the forget, not by the row's expiry


@pytest.mark.parametrize("backend", ["postgresql"])
def test_cut_groups_forget_their_rows_without_waiting_on_each_other(
    url: str,
    table_name: str,
    make_locker: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two groups cut at the acquire's deadline: one whose first INSERT outlasts it (rolled
    back: nothing is ever committed), then one whose commit does (committed after the cut). The
    first's forget looks for its rows through its window (FORGET_FOR, 30 s) and finds none;
    the second's deletes both of its rows meanwhile (their commit takes 4 s), which a
    contender gets long before they expire. A forget that waited for the first's window to
    end would find them after 31 s."""
    monkeypatch.setattr(timeouts, "ACQUIRE_SLACK_SECONDS", 1.0)
    locker = make_locker(expires=120)
    triggers = {
        "never": "BEFORE INSERT ON {table} FOR EACH ROW WHEN (left(NEW.lockstring, 6) = 'never ')",
        "late": "AFTER INSERT ON {table} DEFERRABLE INITIALLY DEFERRED FOR EACH ROW "
        "WHEN (left(NEW.lockstring, 5) = 'late ')",
    }
    with sleeping_triggers(url, table_name, 2, triggers):
        locker.lock("warm").unlock()
        started, wall_started = time.monotonic(), time.time()
        with pytest.raises(DatabaseError, match="for 3 locks from 'never a'"):
            locker.lock_all(["never a", "never b", "never c"])
        with pytest.raises(DatabaseError, match="for 2 locks from 'late a'"):
            locker.lock_all(["late a", "late b"])
        assert time.monotonic() - started < 4
        contender = make_locker(expires=120)
        caplog.set_level(logging.INFO, logger="sqllocker")
        try:
            contender.lock_all(["late a", "late b"], wait=30).unlock()
        except LockBusy as refused:
            # The forget deletes the rows about 4 s in: a refusal for 30 s says what held the
            # contender off, and when the forget's rows went.
            heard = [(round(r.created - wall_started, 1), r.getMessage()) for r in caplog.records]
            took = time.monotonic() - started
            pytest.fail(f"refused after {took:.1f}s ({refused}); log: {heard}")
        took = time.monotonic() - started
        assert took < 20, took  # the second group's forget, not behind the first's 30 s
    figure("a cut group's forget", "postgresql", f"the late group's rows taken after {took:.1f}s")


def test_a_cut_groups_forget_deletes_every_row_though_a_try_finds_some(locker: Locker) -> None:
    """A forget's try deletes a cut group's rows one statement a lockstring, and the group's
    commit may land between two of them: the try finds one row of two. The other is there
    by the next try, and is deleted then; the forget ended at the first (deleting one
    counted as done), and left the other held by nobody until it expired. Here the second
    row, under the group's guid, comes a second and a half after the first."""
    guid = abandon(locker.lock("cut b", expires=60)).guid

    def commit_the_other() -> None:
        time.sleep(1.5)
        abandon(locker.lock("cut a", expires=60))
        with locker.engine.begin() as conn:
            rows = locker.table.update().where(locker.table.c.lockstring == "cut a")
            conn.execute(rows.values(guid=guid))

    other = threading.Thread(target=commit_the_other)
    other.start()
    try:
        locker._acquirer._forget_attempt([("cut a", guid), ("cut b", guid)], 60, cut=True)
    finally:
        other.join()
    assert count_rows(locker) == 0


def test_the_acquire_slack_outlasts_a_working_servers_own_timeouts() -> None:
    """A working server ends a slow acquire statement first, rolled back (nothing left behind):
    only a frozen one is cut by the acquire's own bound, which a slack of a few seconds put on
    slow INSERTs and MariaDB's row lock waits too."""
    assert (
        max(timeouts.STATEMENT_TIMEOUT_SECONDS, timeouts.ROW_LOCK_TIMEOUT_SECONDS)
        < timeouts.ACQUIRE_SLACK_SECONDS
    )
