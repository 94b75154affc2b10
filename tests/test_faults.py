"""Fault injection with real processes and real servers on loopback.

Each scenario is bounded in count and time and prints its figures as ``[reliability]`` lines;
README.md's Reliability section quotes them from a run of::

    .venv/bin/python -m pytest tests/test_faults.py tests/test_mutual_exclusion.py \\
        tests/test_holding.py -s | grep reliability
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import random
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

from sqllocker import LockBusy, Locker, LockError, LockLost, lock_table
from sqllocker.asyncio import AsyncLocker
from sqllocker.engine import resolve_url
from tests import forked_cli
from tests.helpers import (
    FRONTS,
    Front,
    Proxied,
    count_rows,
    figure,
    in_line,
    migrate,
    stop_outside_a_write,
    wait_in_thread,
    wait_until,
    wait_until_async,
)
from tests.private_servers import running_private_server
from tests.workers import async_url

pytestmark = pytest.mark.slow  # private servers, stalls and frozen holders: not the quick subset

REPO = Path(__file__).resolve().parent.parent

GRACE = 1.0
POLL = 0.25  # the waiters' longest backoff step (sqllocker.backoff.MAX_DELAY)


class Holder:
    """A `python -m tests.workers hold` process, forked from a server that imported
    tests.workers once (``tests/forked_cli.py``): a process of its own, as if started alone."""

    def __init__(self, url: str, table: str, lockstring: str, *extra: str) -> None:
        self.process = forked_cli.Popen(
            [
                "hold",
                "--url",
                url,
                "--table",
                table,
                "--lockstring",
                lockstring,
                "--grace",
                str(GRACE),
                *extra,
            ],
            cwd=REPO,
        )

    def read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        assert line, self.process.stderr.read() if self.process.stderr else "holder died"
        return dict(json.loads(line))

    def send(self, command: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()

    def finish(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.communicate(timeout=30)


# -- 1. holder killed -----------------------------------------------------------------------------


def test_killed_holder_is_taken_over_on_time(url: str, make_locker: Any, backend: str) -> None:
    waiter = make_locker(grace=GRACE)
    expires = 1.0
    delays = []
    for round_number in range(3):
        holder = Holder(url, waiter.table_name, "job", "--expires", str(expires), "--keep-alive")
        try:
            acquired = holder.read()
            time.sleep(random.uniform(0, 1.5))  # a random point in the hold (renewals included)
            holder.process.send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            with waiter.lock("job", wait=30) as lock:
                delay = time.monotonic() - killed_at
                assert lock.lock_id > acquired["lock_id"]
            delays.append(delay)
        finally:
            holder.finish()
        assert delay <= expires + GRACE + POLL + 0.5, f"round {round_number}: {delay:.2f}s"
    figure(
        "SIGKILLed holder",
        backend,
        f"taken over after {', '.join(f'{d:.2f}s' for d in delays)} "
        f"(bound: expiry {expires}s + grace {GRACE}s + poll {POLL}s); overlaps 0",
    )


# -- 2. holder frozen past its expiry -------------------------------------------------------------


def test_frozen_holder_finds_its_lock_lost_and_its_writes_fenced(
    url: str, make_locker: Any, backend: str
) -> None:
    contender = make_locker(grace=GRACE)
    engine = sa.create_engine(resolve_url(url))
    with engine.begin() as conn:
        conn.exec_driver_sql("DROP TABLE IF EXISTS fenced")
        conn.exec_driver_sql(
            "CREATE TABLE fenced (name VARCHAR(64) PRIMARY KEY, fence BIGINT, value VARCHAR(16))"
        )
        conn.exec_driver_sql("INSERT INTO fenced VALUES ('job', 0, 'initial')")
    holder = Holder(url, contender.table_name, "job", "--expires", "1", "--keep-alive")
    try:
        stale_id = holder.read()["lock_id"]
        stop_outside_a_write(holder.process.pid, url)
        frozen_at = time.monotonic()
        new = contender.lock("job", wait=30)
        took_over_after = time.monotonic() - frozen_at
        with engine.begin() as conn:
            written = conn.execute(
                sa.text(
                    "UPDATE fenced SET fence = :f, value = 'new' WHERE name = 'job' AND fence < :f"
                ),
                {"f": new.lock_id},
            ).rowcount
        assert written == 1
        holder.process.send_signal(signal.SIGCONT)
        holder.send("check")
        report = holder.read()
    finally:
        holder.finish()
    assert new.lock_id > stale_id
    assert report["is_valid"] is False
    assert report["on_lost_called"] == 1
    assert report["check"] == report["extend"] == report["unlock"] == "LockLost"
    assert report["guard"] == "LockLost"
    assert report["fenced_rows_written"] == 0
    (row,) = contender.locks()
    assert (row.lock_id, row.expires) == (new.lock_id, new.expires)
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT value FROM fenced").scalar() == "new"
    new.unlock()
    with engine.begin() as conn:
        conn.exec_driver_sql("DROP TABLE fenced")
    engine.dispose()
    figure(
        "SIGSTOPped holder",
        backend,
        f"taken over {took_over_after:.2f}s after the freeze; on resume is_valid=False, "
        "check/extend/unlock/guard raised LockLost, on_lost called once, stale fenced writes "
        "accepted 0, new holder's row untouched",
    )


def test_a_holder_stopped_past_expiry_and_taken_over_is_told_once_whoever_finds_out(
    url: str, make_locker: Any, backend: str
) -> None:
    """The holder is stopped past its lock's expiry, another takes the lock over, and the
    holder's unlock() runs as soon as it resumes, racing its own keep-alive thread, which wakes
    at the same moment: whichever finds the loss first, on_lost is called once."""
    contender = make_locker(grace=GRACE)
    # Four trials, each on a lock of its own: their holders start, and are stopped past their
    # locks' expiry, together; each is then taken over and resumed in turn.
    holders = [
        Holder(url, contender.table_name, f"job {trial}", "--expires", "1", "--keep-alive")
        for trial in range(4)
    ]
    try:
        for holder in holders:
            holder.read()
        for holder in holders:
            stop_outside_a_write(holder.process.pid, url)
        for trial, holder in enumerate(holders):
            new = contender.lock(f"job {trial}", wait=30)
            holder.send("unlock")  # read the moment it resumes
            holder.process.send_signal(signal.SIGCONT)
            report = holder.read()
            assert report["unlock"] == "LockLost", f"trial {trial}"
            assert report["on_lost_called"] == 1, f"trial {trial}"
            new.unlock()
    finally:
        for holder in holders:
            with contextlib.suppress(ProcessLookupError):
                holder.process.send_signal(signal.SIGCONT)
            holder.finish()


# -- 3. database restarted ------------------------------------------------------------------------


@pytest.fixture(params=["postgresql", "mysql"])
def private_server(request: pytest.FixtureRequest) -> Iterator[Any]:
    with running_private_server(request.param) as server:
        yield server


@pytest.fixture(scope="module", params=["postgresql", "mysql"])
def restartable_server(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A private server that the tests restart as they go, started once for all of them: each
    leaves it running, and each has a table of its own."""
    with running_private_server(request.param) as server:
        yield server


@pytest.mark.parametrize("crash", [False, True], ids=["clean", "crash"])
def test_database_restart_never_gives_two_holders_or_reuses_an_id(
    restartable_server: Any, crash: bool, table_name: str
) -> None:
    private_server = restartable_server
    url = private_server.url
    engine = sa.create_engine(resolve_url(url))
    lock_table(table_name).create(engine)
    backend = engine.dialect.name
    engine.dispose()
    holder = Locker(url, table=table_name, grace=GRACE)
    contender = Locker(url, table=table_name, grace=GRACE)
    lost: list[str] = []
    locks = [
        holder.lock(
            f"job {n}", expires=3, keep_alive=True, on_lost=lambda e: lost.append(str(e.lockstring))
        )
        for n in range(3)
    ]
    highest_before = max(lock.lock_id for lock in locks)
    private_server.stop(crash=crash)
    down_at = time.monotonic()
    time.sleep(1.0)
    private_server.start()
    downtime = time.monotonic() - down_at
    # Until each lock has been renewed since the server came back, or its holder told it is
    # lost (at its deadline, less than an expiry period away).
    deadlines = [lock._state.valid_until for lock in locks]
    wait_until(
        lambda: all(
            lock.lockstring in lost or lock._state.valid_until > deadline
            for lock, deadline in zip(locks, deadlines, strict=True)
        )
    )
    survived = [lock for lock in locks if lock.is_valid()]
    for lock in locks:
        stolen = contender.try_lock(lock.lockstring)
        if lock.is_valid():
            assert stolen is None, "a second holder while the first is still valid"
        elif stolen is not None:
            stolen.unlock()
    assert len(survived) + len(lost) == len(locks)
    fresh = contender.lock("after restart")
    assert fresh.lock_id > highest_before  # ids are never reused
    fresh.unlock()
    for lock in survived:
        lock.unlock()
    holder.close()
    contender.close()
    figure(
        f"database {'crash' if crash else 'restart'}",
        backend,
        f"down {downtime:.1f}s; kept-alive locks surviving {len(survived)}/{len(locks)}, "
        f"holders told lost {len(lost)}, double holders 0, reused ids 0",
    )


def quiet_wal(url: str) -> None:
    """Leave a commit's WAL unflushed for seconds when it does not wait for the disk itself:
    nothing else writes, the WAL writer sleeps 10 s between rounds, and the background writer
    writes no pages (a page written would take the WAL before it to disk)."""
    engine = sa.create_engine(resolve_url(url))
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        quiet = ("wal_writer_delay = '10s'", "autovacuum = off", "bgwriter_lru_maxpages = 0")
        for setting in quiet:
            conn.exec_driver_sql(f"ALTER SYSTEM SET {setting}")
        conn.exec_driver_sql("SELECT pg_reload_conf()")
    engine.dispose()
    time.sleep(0.5)  # the settings reach the server's processes


@pytest.mark.parametrize("private_server", ["postgresql"], indirect=True)
def test_a_row_handed_over_is_durable_before_its_new_holder_has_it(private_server: Any) -> None:
    """A release hands its row to the first live ticket in its own transaction, which commits
    without waiting for the disk (Statements.release). Its waiter must not have the lock until
    that row is durable: a crash that took the hand-off back would bring the old row back, to
    be taken over at its expiry while the waiter still acts as its holder."""
    url = private_server.url
    holder, waiter = Locker(url, grace=GRACE), Locker(url, grace=GRACE)
    holder.create_table()
    quiet_wal(url)
    held = holder.lock("job", expires=30)
    thread, result = wait_in_thread(waiter, "job", wait=60, expires=30)
    admin = sa.create_engine(resolve_url(url))
    in_line(admin, "semaphores")
    listener = waiter._tickets.listener
    assert listener is not None
    # Its ticket's grant is for a waiter waiting for it: on a loaded machine one can still be
    # between its attempt and its wait, when the release hands the row over unheard and the
    # waiter's next attempt takes it by its own hand.
    wait_until(lambda: bool(listener._waiters._heads))
    held.unlock()
    thread.join(10)
    handed = result["lock"]
    assert listener.grants == 1  # handed over by the release, not taken by the waiter
    private_server.stop(crash=True)
    private_server.start()

    row = waiter.lock_info("job")
    assert row is not None
    assert row.lock_id == handed.lock_id, "the hand-off was lost in the crash, its head told not"
    handed.unlock()
    admin.dispose()
    holder.close()
    waiter.close()


@pytest.mark.parametrize("private_server", ["postgresql"], indirect=True)
def test_a_release_lost_in_a_crash_keeps_the_lock_held_until_it_expires(
    private_server: Any,
) -> None:
    """PostgreSQL commits a release without waiting for the disk (Statements.release): a crash
    right after one brings the row back. It must come back as the released acquisition, be
    held by nobody until it expires, and then go to an acquirer with a higher id."""
    url = private_server.url
    engine = sa.create_engine(resolve_url(url))
    lock_table("semaphores").create(engine)
    engine.dispose()
    quiet_wal(url)
    holder, contender = Locker(url, grace=GRACE), Locker(url, grace=GRACE)
    expires = 3.0
    lock = holder.lock("job", expires=expires)
    released_id = lock.lock_id
    lock.unlock()
    released_at = time.monotonic()
    private_server.stop(crash=True)
    private_server.start()

    back = contender.lock_info("job")
    assert back is not None, "the release survived the crash: no lost release to test"
    assert back.lock_id == released_id  # the released acquisition, no other
    assert contender.try_lock("job") is None  # held until it expires, by nobody
    taken = contender.lock("job", wait=expires + GRACE + 5)
    taken_at = time.monotonic()
    assert taken.lock_id > released_id
    taken.unlock()
    holder.close()
    contender.close()
    figure(
        "database crash right after a release",
        "postgresql",
        f"released lock back after restart (id {released_id}), free again "
        f"{taken_at - released_at:.1f}s after the release (expiry {expires:.0f}s + grace "
        f"{GRACE:.0f}s); double holders 0",
    )


# -- 4. network stall -----------------------------------------------------------------------------


# No network lies between an SQLite holder and its database; the same deadline logic is covered
# there by test_holding.test_on_lost_fires_at_the_deadline_when_renewals_keep_failing.
@pytest.mark.parametrize("backend", ["postgresql", "mysql"])
def test_network_stall_tells_the_holder_before_anyone_can_take_over(
    proxied: Proxied, table_name: str, make_locker: Any, backend: str
) -> None:
    contender = make_locker(grace=GRACE)
    proxy = proxied.proxy
    holder = Locker(proxied.target, table=table_name, grace=GRACE)
    told: list[float] = []
    expires = 2.0
    try:
        lock = holder.lock(
            "job", expires=expires, keep_alive=True, on_lost=lambda _: told.append(time.monotonic())
        )
        time.sleep(0.5)
        proxy.stall()
        stalled_at = time.monotonic()
        taken = contender.lock("job", wait=30)
        taken_at = time.monotonic()
        assert told, "the holder was not told before the takeover"
        assert told[0] <= taken_at
        assert not lock.is_valid()
        taken.unlock()
    finally:
        proxy.close()  # unblocks the holder's stalled renewal
        holder.close()
    figure(
        "network stall",
        backend,
        f"holder told {told[0] - stalled_at:.2f}s into the stall, takeover possible at "
        f"{taken_at - stalled_at:.2f}s (told {taken_at - told[0]:.2f}s before)",
    )


@pytest.fixture
def guarded_through_proxy(url: str, table_name: str) -> Iterator[GuardedThroughProxy]:
    through = GuardedThroughProxy(url, table_name)
    yield through
    through.close()


class GuardedThroughProxy:
    """An application's engine on the lock's database through a StallProxy, for guarded
    transactions whose client can fall silent, and a table ``work`` it writes to."""

    def __init__(self, url: str, table_name: str) -> None:
        self._proxied = Proxied(url)
        self.proxy = self._proxied.proxy
        self.app = sa.create_engine(self._proxied.target)
        self.direct = sa.create_engine(resolve_url(url))
        self.work = f"{table_name}_work"
        with self.direct.begin() as conn:
            conn.exec_driver_sql(f"CREATE TABLE {self.work} (n INTEGER)")

    def written(self) -> list[int]:
        with self.direct.connect() as conn:
            return [int(n) for n in conn.exec_driver_sql(f"SELECT n FROM {self.work}").scalars()]

    def close(self) -> None:
        self._proxied.close()
        self.app.dispose()
        self.direct.dispose()


@pytest.mark.parametrize("backend", ["postgresql", "mysql"])
def test_a_guarded_transaction_whose_client_falls_silent_holds_off_takeover_only_until_expiry(
    make_locker: Any, backend: str, guarded_through_proxy: GuardedThroughProxy
) -> None:
    """A partition with a guarded transaction open: the server sees a session idle in
    transaction, which it would keep (with the guard's row lock) until TCP gives up, hours
    later. The guard bounds it to the lock's remaining life: the server ends the transaction
    then, the next holder takes over, and the silent client's commit fails once it is heard
    again, so its write never lands under a lock it lost."""
    through = guarded_through_proxy
    holder, contender = make_locker(grace=GRACE), make_locker(grace=GRACE)
    lock = holder.lock("job", expires=2)
    conn = through.app.connect()
    try:
        conn.begin()
        lock.guard(conn)
        conn.exec_driver_sql(f"INSERT INTO {through.work} (n) VALUES (1)")
        through.proxy.stall()
        stalled_at = time.monotonic()
        taken = contender.lock("job", wait=30)
        taken_at = time.monotonic()
        assert taken_at - stalled_at < 25  # the row's expiry plus the margin, not TCP's hours
        through.proxy.resume()
        with pytest.raises(sa.exc.DBAPIError):
            conn.commit()
        assert through.written() == []
        assert taken.is_valid()
        taken.unlock()
    finally:
        through.proxy.close()
        with contextlib.suppress(sa.exc.DBAPIError):
            conn.close()
    figure(
        "silent guarded transaction",
        backend,
        f"taken over {taken_at - stalled_at:.2f}s into the stall",
    )


@pytest.mark.parametrize("backend", ["postgresql", "mysql"])
async def test_an_async_guarded_transaction_whose_client_falls_silent_ends_at_expiry(
    url: str,
    table_name: str,
    backend: str,
    make_locker: Any,
    guarded_through_proxy: GuardedThroughProxy,
) -> None:
    """The asyncio twin: the same bound through the async drivers, and the silent client's
    commit fails once it is heard again."""
    through = guarded_through_proxy
    make_locker()  # the table
    app = create_async_engine(async_url(through.app.url.render_as_string(hide_password=False)))
    holder = AsyncLocker(async_url(url), table=table_name, grace=GRACE)
    contender = AsyncLocker(async_url(url), table=table_name, grace=GRACE)
    conn = await app.connect()
    try:
        lock = await holder.lock("job", expires=2)
        await conn.begin()
        await lock.guard(conn)
        await conn.exec_driver_sql(f"INSERT INTO {through.work} (n) VALUES (1)")
        through.proxy.stall()
        stalled_at = time.monotonic()
        taken = await contender.lock("job", wait=30)
        assert time.monotonic() - stalled_at < 25
        through.proxy.resume()
        with pytest.raises(sa.exc.DBAPIError):
            await conn.commit()
        assert through.written() == []
        await taken.unlock()
    finally:
        through.proxy.close()
        with contextlib.suppress(sa.exc.DBAPIError):
            await conn.close()
        await app.dispose()
        await holder.aclose()
        await contender.aclose()


class TicketsThroughProxy:
    """A table made by the migrations (its tickets' table too), a StallProxy in front of its
    server (``url``: the URL through it), and the tickets standing, read directly."""

    def __init__(self, url: str, table_name: str) -> None:
        target = resolve_url(url)
        migrate(target, table_name)
        self._admin = sa.create_engine(target, isolation_level="AUTOCOMMIT")
        self._direct = target
        self._proxied = Proxied(target)
        self.proxy = self._proxied.proxy
        self.url = self._proxied.url
        self._table_name = table_name

    def run(self, front: Front, scenario: Callable[[Locker, Any], Awaitable[None]]) -> None:
        """Run ``scenario`` with a holder, a Locker on the server directly, and a waiter, a
        Locker (or an AsyncLocker) through the proxy."""

        async def run() -> None:
            holder = Locker(self._direct, table=self._table_name)
            waiter = front.locker(self.url, table=self._table_name)
            try:
                await scenario(holder, waiter)
            finally:
                await front.close(waiter)
                holder.close()

        asyncio.run(run())

    def standing(self) -> list[int]:
        with self._admin.connect() as conn:
            query = f"SELECT ticket FROM {self._table_name}_requests ORDER BY ticket"
            return [int(ticket) for ticket in conn.exec_driver_sql(query).scalars()]

    def close(self) -> None:
        self._proxied.close()
        self._admin.dispose()


@pytest.fixture
def tickets(url: str, table_name: str) -> Iterator[TicketsThroughProxy]:
    through = TicketsThroughProxy(url, table_name)
    yield through
    through.close()


@pytest.mark.parametrize("released", ["before", "after"])
@pytest.mark.parametrize("backend", ["postgresql", "mysql"])
def test_a_ticket_whose_answer_was_lost_leaves_none_behind(
    url: str, table_name: str, backend: str, released: str, tickets: TicketsThroughProxy
) -> None:
    """A waiter's ticket committed, and the connection dropped before its answer came back:
    taken again on a new connection, the ticket must replace the first, not stand beside it.
    Left standing and live (its Locker's listener holds its key), the first one is handed the
    next row nobody claims on PostgreSQL, which stays held until it expires; on MariaDB every
    waiter behind it finds the row free and refused for PATIENCE at each turn. The holder
    releases before the waiter takes its ticket again (on PostgreSQL the first ticket is then
    handed the row, and the waiter claims it holding the second) or after."""
    proxy, standing = tickets.proxy, tickets.standing
    holder = Locker(url, table=table_name)
    waiter = Locker(tickets.url, table=table_name)
    try:
        held = holder.lock("job")
        joining = (
            b"_queue_join("
            if backend == "postgresql"
            else b"INTO %s_requests" % (table_name.encode())
        )
        proxy.lose_answer_to(joining, then_stall=released == "before")
        thread, result = wait_in_thread(waiter, "job", wait=30)
        wait_until(lambda: proxy.answers_lost == 1)
        # The tickets of a new table are numbered from 1: the lost one's, then its successor.
        if released == "before":
            wait_until(lambda: standing() == [1])  # it commits as its answer is on the way
            held.unlock()
            proxy.resume()
        else:
            wait_until(lambda: 2 in standing())
            held.unlock()
        thread.join(30)
        assert "lock" in result, result.get("error")
        result["lock"].unlock()
        wait_until(lambda: standing() == [])  # the winner gives its ticket up in the background
    finally:
        waiter.close()
        holder.close()


@pytest.mark.parametrize("front", FRONTS, ids=str)
@pytest.mark.parametrize("backend", ["postgresql", "mysql"])
def test_a_ticket_whose_give_up_failed_is_given_up_again(
    table_name: str, backend: str, front: Front, tickets: TicketsThroughProxy
) -> None:
    """A waiter that stops waiting gives its ticket up; if that fails (its connection cut as it
    sends the statement, and again on the new one), the ticket stays, kept live by its
    Locker's listener. Left so, on PostgreSQL the next release hands the row to it, to stand
    held by nobody until it expires; on MariaDB every newcomer finds the free row refused for
    PATIENCE. So the Locker tries again in the background while the ticket lives: the ticket
    goes, and a newcomer takes the released row at once."""
    proxy, standing = tickets.proxy, tickets.standing
    leaving = (
        b"_queue_leave("
        if backend == "postgresql"
        else b"DELETE FROM %s_requests" % (table_name.encode())
    )

    async def scenario(holder: Locker, waiter: Any) -> None:
        held = holder.lock("job")
        proxy.cut_before(leaving, times=2)  # the give-up, and its retry on a new connection
        with pytest.raises(LockBusy):
            await front.call(waiter.lock, "job", wait=0.5)
        assert proxy.statements_cut == 2
        await wait_until_async(lambda: standing() == [])
        held.unlock()
        holder.lock("job", wait=0).unlock()

    tickets.run(front, scenario)


@pytest.mark.parametrize("front", FRONTS, ids=str)
@pytest.mark.parametrize("backend", ["postgresql", "mysql"])
def test_a_ticket_taken_by_a_failed_join_is_given_up_again(
    table_name: str, backend: str, front: Front, tickets: TicketsThroughProxy
) -> None:
    """A waiter's ticket committed as its connection dropped, and every give-up after it was
    cut off (the join's own retry gives up first, and so does the waiter as it stops): the
    waiter knows of no ticket, yet one of its stands, live. It is given up in the background,
    by guid, as a known ticket is, and a newcomer takes the released row at once."""
    proxy, standing = tickets.proxy, tickets.standing
    joining, leaving = (
        (b"_queue_join(", b"_queue_leave(")
        if backend == "postgresql"
        else (
            b"INTO %s_requests" % table_name.encode(),
            b"DELETE FROM %s_requests" % table_name.encode(),
        )
    )

    async def scenario(holder: Locker, waiter: Any) -> None:
        held = holder.lock("job")
        proxy.lose_answer_to(joining)
        proxy.cut_before(leaving, times=1000)
        with pytest.raises(LockError):
            await front.call(waiter.lock, "job", wait=0.5)
        proxy.cut_before(leaving, times=0)
        await wait_until_async(lambda: standing() == [])
        assert proxy.answers_lost == 1
        assert proxy.statements_cut >= 2
        held.unlock()
        holder.lock("job", wait=0).unlock()

    tickets.run(front, scenario)


@pytest.mark.parametrize("front", FRONTS, ids=str)
@pytest.mark.parametrize("backend", ["postgresql", "mysql"])
def test_a_connection_lost_while_the_settings_are_read_is_retried_then_a_lock_error(
    table_name: str, backend: str, front: Front, tickets: TicketsThroughProxy
) -> None:
    """A Locker's first lock operation reads the server's settings; an application that starts
    during a failover can lose that connection. Cut once, it is retried on a new connection, as
    any lost connection is; cut every time, the caller gets a LockError, never the driver's own
    error, which escapes a worker that handles LockError (a Patroni test's contender died so).
    Both by a waiter, which reads the settings before it takes a ticket, and by a try."""
    proxy = tickets.proxy
    reading = b"_anyone_ahead(" if backend == "postgresql" else b"@@innodb_flush_log_at_trx_commit"

    async def first_lock(wait: float | None) -> None:
        locker = front.locker(tickets.url, table=table_name)
        try:
            await front.call((await front.call(locker.lock, "job", wait=wait)).unlock)
        finally:
            await front.close(locker)

    async def scenario() -> None:
        for wait in (5.0, 0):
            proxy.cut_before(reading, times=1)
            await first_lock(wait)
            assert proxy.statements_cut == 1
            proxy.statements_cut = 0
            proxy.cut_before(reading, times=1000)
            with pytest.raises(LockError, match="database error"):
                await first_lock(wait)
            assert proxy.statements_cut >= 2
            proxy.cut_before(reading, times=0)
            proxy.statements_cut = 0

    asyncio.run(scenario())


# Every public operation, each given the lock it acts on where it needs one; on an AsyncLocker
# each returns what is to be awaited.
OPERATIONS: dict[str, Callable[[Any, Any], Any]] = {
    "lock": lambda locker, held: locker.lock("other"),
    "lock, waiting": lambda locker, held: locker.lock("other", wait=0.5),
    "try_lock": lambda locker, held: locker.try_lock("other"),
    "lock_all": lambda locker, held: locker.lock_all(["a", "b"], wait=0.5),
    "semaphore": lambda locker, held: locker.semaphore("seats", 2).acquire(),
    "semaphore holders": lambda locker, held: locker.semaphore("seats", 2).holders(),
    "purge_expired_locks": lambda locker, held: locker.purge_expired_locks(),
    "locks": lambda locker, held: locker.locks(),
    "lock_info": lambda locker, held: locker.lock_info("held"),
    "expired_locks": lambda locker, held: locker.expired_locks(),
    "break_lock": lambda locker, held: locker.break_lock("held"),
    "extend": lambda locker, held: held.extend(60),
    "unlock": lambda locker, held: held.unlock(),
}


@pytest.mark.parametrize("operation", list(OPERATIONS))
@pytest.mark.parametrize("front", FRONTS, ids=str)
@pytest.mark.parametrize("backend", ["postgresql", "mysql"])
def test_every_operation_whose_statement_is_cut_off_is_a_lock_error(
    table_name: str, backend: str, front: Front, operation: str, tickets: TicketsThroughProxy
) -> None:
    """Set up and holding a lock, a Locker whose every statement on its table is cut off (the
    connection closed as it is sent, on each new connection too) fails each operation with a
    LockError, never the driver's or SQLAlchemy's own error; an AsyncLocker too, whose
    operations run in greenlets on the async drivers."""
    proxy = tickets.proxy

    async def scenario() -> None:
        locker = front.locker(tickets.url, table=table_name)
        try:
            held = await front.call(locker.lock, "held")
            proxy.cut_before(table_name.encode(), times=10**6)
            with pytest.raises(LockError):
                await front.call(OPERATIONS[operation], locker, held)
        finally:
            proxy.cut_before(b"", times=0)
            await front.close(locker)

    asyncio.run(scenario())
    assert proxy.statements_cut >= 1


def test_unlock_is_not_held_up_for_ever_by_a_renewal_stuck_on_a_stalled_connection(
    mysql_url: str, table_name: str
) -> None:
    """A renewal whose answer never comes holds the lock's operations (release and renewal are
    serialised). The driver's read timeout (PyMySQL's read_timeout, set by sqllocker, shortened
    here through the URL) fails it, so that unlock() gets its turn and ends, with a LockError,
    within a bounded time. libpq has no read timeout: on PostgreSQL, keepalives and
    tcp_user_timeout end a connection to a peer that is gone, but not one that answers TCP
    and nothing more, as this proxy does."""
    engine = sa.create_engine(resolve_url(mysql_url))
    lock_table(table_name).create(engine)
    engine.dispose()
    proxied = Proxied(mysql_url)
    proxy = proxied.proxy
    through_proxy = proxied.target.set(
        query={"read_timeout": "1", "write_timeout": "1", "connect_timeout": "1"}
    )
    holder = Locker(through_proxy, table=table_name)
    try:
        lock = holder.lock("job", expires=3, keep_alive=True)
        proxy.stall()
        time.sleep(1.2)  # the first renewal (at 1 s) is stuck now
        started = time.monotonic()
        with pytest.raises(LockError):
            lock.unlock()
        assert time.monotonic() - started < 15
    finally:
        proxied.close()
        holder.close()


# -- 6. fork while holding a kept-alive lock ------------------------------------------------------


def test_fork_child_neither_renews_nor_releases_the_parents_kept_alive_lock(
    locker: Locker, backend: str
) -> None:
    lock = locker.lock("parent's", expires=1, keep_alive=True)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            threads = [t.name for t in threading.enumerate() if t.name.startswith("sqllocker")]
            lock.__exit__(None, None, None)
            lock._finalizer()
            gc.collect()
            state = {"threads": threads, "kept_alive": len(locker._keep_alives)}
            os.write(write_end, json.dumps(state).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    os.waitpid(pid, 0)
    child = json.loads(os.read(read_end, 4096))
    os.close(read_end)
    assert child == {"threads": [], "kept_alive": 0}
    time.sleep(3)  # three expiry periods: the parent's renewals carry on
    assert lock.is_valid()
    assert [row.lockstring for row in locker.locks()] == ["parent's"]
    lock.unlock()
    figure(
        "fork with a kept-alive lock",
        backend,
        "child threads 0, child renewals 0, child releases 0; parent still valid after 3s",
    )


# -- 7. soak --------------------------------------------------------------------------------------


def server_connections(locker: Locker) -> int:
    with locker.engine.connect() as conn:
        if locker.engine.dialect.name == "postgresql":
            return int(
                conn.exec_driver_sql(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                ).scalar_one()
            )
        if locker.engine.dialect.name == "mysql":
            return int(
                conn.exec_driver_sql(
                    "SELECT count(*) FROM information_schema.processlist WHERE db = DATABASE()"
                ).scalar_one()
            )
        return locker._operations.connections()[0]  # SQLite: the lock operations' open connections


# Cycles a soak runs: on a server each is two durable commits, which every other test of the
# suite waits behind on the machine's one disk; a leak per cycle shows within 2,000 as well.
SOAK_CYCLES = {"sqlite": 10_000, "postgresql": 2_000, "mysql": 2_000}


def test_a_soak_of_many_cycles_leaves_nothing_behind(locker: Locker, backend: str) -> None:
    cycles = SOAK_CYCLES[backend]
    # A cycle as the loop's: the threads a cycle starts (the keep-alive's, the deadline
    # watcher of a release that must end within the lock's 5 s) are there before the count.
    with locker.lock("warm up", expires=5, keep_alive=True):
        pass
    threads_before = threading.active_count()
    connections_before = server_connections(locker)
    started = time.monotonic()
    for n in range(cycles):
        with locker.lock(f"soak {n % 50}", expires=5, keep_alive=True) as lock:
            assert lock.is_valid()
    elapsed = time.monotonic() - started
    threads_after = threading.active_count()
    connections_after = server_connections(locker)
    assert count_rows(locker) == 0
    assert threads_after <= threads_before
    assert connections_after <= connections_before
    figure(
        "soak",
        backend,
        f"{cycles} acquire/keep-alive/release cycles in {elapsed:.1f}s; rows left 0, threads "
        f"{threads_before}->{threads_after}, connections {connections_before}->{connections_after}",
    )


def test_lost_is_never_silent_for_an_unlocked_lost_lock(locker: Locker) -> None:
    # The with-block form of scenario 2, in-process: the lock is broken under a running body.
    with pytest.raises(LockLost), locker.lock("job", expires=5, keep_alive=True):
        locker.break_lock("job")


# -- 8. an acquire's answer lost, and an outage past the row's expiry ----------------------------


class AcquirerThroughProxy:
    """A Locker (sync, or an AsyncLocker) that waits for a lock on a thread with an event loop
    of its own, reports it (``acquired``) and holds it until ``finish``."""

    def __init__(self, url: str, table_name: str, front: Front, **lock_options: Any) -> None:
        self.acquired = threading.Event()
        self.result: dict[str, Any] = {}
        self._done = threading.Event()
        self._url, self._table, self._front, self._options = url, table_name, front, lock_options
        self._thread = threading.Thread(target=self._in_thread)
        self._thread.start()

    async def _hold(self) -> None:
        front = self._front
        locker = front.locker(self._url, table=self._table, grace=GRACE)
        try:
            lock = await front.call(locker.lock, "job", **self._options)
            self.result.update(lock_id=lock.lock_id, valid=lock.is_valid())
            self.acquired.set()
            await asyncio.to_thread(self._done.wait, 60)
            await front.call(lock.unlock)
        finally:
            await front.close(locker)

    def _in_thread(self) -> None:
        try:
            asyncio.run(self._hold())
        except BaseException as error:
            self.result["error"] = error
        finally:
            self.acquired.set()

    def finish(self) -> None:
        self._done.set()
        self._thread.join(60)


@pytest.mark.parametrize("front", FRONTS, ids=str)
@pytest.mark.parametrize("backend", ["postgresql", "mysql"])
def test_an_acquire_whose_answer_was_lost_never_returns_its_own_expired_row(
    proxied: Proxied, table_name: str, make_locker: Any, backend: str, front: Front
) -> None:
    """A waiting acquire's INSERT commits and its answer is lost; the outage lasts past the
    row's expiry and grace. When the network comes back, the acquire finds its own row, by its
    guid, expired: taken as the lock, it would be held twice (anyone may take an expired row
    over). The acquire must take it over (a new id) or go on waiting: whatever it returns is a
    live row, which nobody else can take meanwhile."""
    contender = make_locker(grace=GRACE)
    proxy = proxied.proxy
    # Long enough that the taken-over lock is still valid by the time a loaded machine has
    # reconnected and answered (its deadline runs from the take-over's sending).
    expires = 3.0
    proxy.lose_answer_to(table_name.encode() + b" (lockstring", then_stall=True)
    acquirer = AcquirerThroughProxy(proxied.url, table_name, front, expires=expires, wait=60)
    try:
        wait_until(lambda: proxy.answers_lost == 1, timeout=30)
        [first] = contender.locks()  # committed, its answer lost
        time.sleep(expires + GRACE + 1.0)  # the outage outlasts its expiry and grace
        assert contender.locks()[0].expired
        proxy.resume()
        assert acquirer.acquired.wait(60)
        assert "error" not in acquirer.result, acquirer.result.get("error")
        # The acquirer holds the lock now: nobody else can take it.
        assert contender.try_lock("job") is None, "two holders at once"
        assert acquirer.result["valid"]
        assert acquirer.result["lock_id"] > first.lock_id  # taken over: a new fencing token
    finally:
        acquirer.finish()
        proxy.close()
    assert "error" not in acquirer.result, acquirer.result.get("error")


# -- 9. unlock() behind a renewal stuck on a frozen connection -----------------------------------


STUCK_EXPIRES = 4.0


def _unlock_behind_a_stuck_renewal(
    front: Front, url: str, table_name: str, stick: Callable[[], Any], unstick: Callable[[], Any]
) -> dict[str, Any]:
    """A kept-alive lock whose renewal ``stick`` leaves stuck, and unlock() behind it: what it
    returned or raised and how long it took. ``unstick`` lets the stuck statements end."""
    expires = STUCK_EXPIRES
    lost: list[LockLost] = []
    outcome: dict[str, Any] = {}

    async def scenario() -> None:
        locker = front.locker(url, table=table_name, grace=GRACE)
        try:
            lock = await front.call(
                locker.lock, "job", expires=expires, keep_alive=True, on_lost=lost.append
            )
            stick()
            await asyncio.sleep(expires / 3 + 0.5)  # the first renewal is stuck now
            outcome.update(await front.timed(lock.unlock))
        finally:
            unstick()
            await front.close(locker)

    asyncio.run(scenario())
    assert outcome["took"] < 30, outcome  # against the 60 s read, statement or busy timeout
    assert isinstance(outcome.get("error"), LockLost), outcome
    assert len(lost) == 1
    return outcome


@pytest.mark.parametrize("front", FRONTS, ids=str)
@pytest.mark.parametrize("backend", ["postgresql", "mysql"])
def test_unlock_behind_a_stuck_renewal_ends_within_the_locks_life(
    proxied: Proxied, table_name: str, make_locker: Any, backend: str, front: Front
) -> None:
    """A frozen server or pooler (the kernel still acknowledges; the proxy holds every byte)
    leaves a renewal with no answer until the driver's 60 s read or statement timeout. Neither
    the renewal nor an unlock() behind it may outlast the lock's own life (4 s here) by more
    than a few seconds: unlock() ends with a LockError (the lock could not be confirmed
    released, and has expired) or success, and the lock is lost either way once expired."""
    make_locker()  # creates the table
    outcome = _unlock_behind_a_stuck_renewal(
        front, proxied.url, table_name, proxied.proxy.stall, proxied.close
    )
    figure(
        "unlock behind a stuck renewal",
        f"{backend} {front}",
        f"expiry {STUCK_EXPIRES}s: unlock() ended in {outcome['took']:.1f}s, "
        f"{type(outcome.get('error')).__name__}",
    )


@pytest.mark.parametrize("front", FRONTS, ids=str)
@pytest.mark.parametrize("backend", ["sqlite"])
def test_unlock_behind_a_renewal_stuck_on_a_busy_sqlite_database_ends_within_the_locks_life(
    url: str, table_name: str, make_locker: Any, backend: str, front: Front
) -> None:
    """SQLite's twin of the frozen server: another process's write transaction left open (its
    process stopped, say) holds the renewal for the 60 s busy timeout; unlock() behind it ends
    with LockLost once the lock has expired."""
    make_locker()  # creates the table
    blocker = sa.create_engine(resolve_url(url)).connect()
    try:
        _unlock_behind_a_stuck_renewal(
            front,
            url,
            table_name,
            lambda: blocker.exec_driver_sql("BEGIN IMMEDIATE"),
            blocker.rollback,
        )
    finally:
        blocker.close()
        blocker.engine.dispose()


@pytest.mark.parametrize("front", FRONTS, ids=str)
@pytest.mark.parametrize("backend", ["sqlite"])
def test_a_renewal_that_lands_after_unlock_gave_up_revives_no_row(
    url: str, table_name: str, make_locker: Any, backend: str, front: Front
) -> None:
    """unlock() gives up on a renewal in flight once the lock has expired as its holder
    reckons it, which is earlier than the database's expiry by the time the last renewal took
    to reach it (here: a writer held it 1 s). A stuck renewal that reaches the database in
    between still finds the row live, and renewed it for a whole expiry period more: a row held
    by nobody, after unlock() said the lock was lost, and the renewal reported success. Its
    revived row must be given back, and the renewal report the loss. (SQLite's busy timeout
    is cut to the renewal's deadline, so here the renewal ends unanswered before the writer
    commits; the give-back is reached on the servers, in the test below.)"""
    make_locker()  # creates the table
    blocker = sa.create_engine(resolve_url(url)).connect()
    expires = 3.0
    outcome: dict[str, Any] = {}

    async def scenario() -> None:
        locker = front.locker(url, table=table_name, grace=GRACE)
        try:
            lock = await front.call(locker.lock, "job", expires=expires)
            blocker.exec_driver_sql("BEGIN IMMEDIATE")
            late = front.in_background(lock.extend, expires)
            await asyncio.sleep(1.0)
            blocker.commit()  # the renewal reaches the database 1 s after it was sent
            await late
            outcome["renewed_until"] = lock.expires  # the database's expiry, as renewed
            blocker.exec_driver_sql("BEGIN IMMEDIATE")
            stuck = front.in_background(lock.extend, expires)
            await asyncio.sleep(0.1)
            try:
                await front.call(lock.unlock)
            except LockError as error:
                outcome["unlock"] = error
            blocker.commit()  # before the database's expiry
            try:
                outcome["renewal"] = await stuck
            except LockError as error:
                outcome["renewal"] = error
            outcome["row"] = await front.call(locker.lock_info, "job")
        finally:
            await front.close(locker)

    try:
        asyncio.run(scenario())
    finally:
        blocker.rollback()
        blocker.close()
        blocker.engine.dispose()
    assert isinstance(outcome.get("unlock"), LockLost), outcome
    assert isinstance(outcome.get("renewal"), LockLost), outcome
    row = outcome["row"]
    # Given back, or left to expire when the renewal acquired last set: never renewed further.
    assert row is None or row.expires <= outcome["renewed_until"], outcome


@pytest.mark.parametrize("front", FRONTS, ids=str)
@pytest.mark.parametrize("backend", ["postgresql", "mysql"])
def test_a_renewal_held_up_by_a_row_lock_past_unlock_gives_the_revived_row_back(
    url: str, table_name: str, make_locker: Any, backend: str, front: Front
) -> None:
    """The servers' twin of the test above: another session's open transaction holds the
    lock's row (``SELECT ... FOR UPDATE``), and a renewal waits for it. unlock() gives up
    once the lock has expired as its holder reckons it, earlier than the database's expiry
    by the time the last renewal took to reach it (here: the row was held 1 s); the other
    transaction then commits, and the renewal lands on a row still live. The row it revived
    must be given back: gone, or expiring no later than the last renewal the holder was told
    of set it; and a second locker that takes the lock after unlock() returned gets it only
    once the first is no longer valid, with a higher fencing token."""
    contender = make_locker(grace=GRACE)  # creates the table
    table = lock_table(table_name)
    blocker = sa.create_engine(resolve_url(url)).connect()
    expires = 3.0
    outcome: dict[str, Any] = {}

    def hold_row(lock_id: int) -> None:
        blocker.execute(sa.select(table.c.id).where(table.c.id == lock_id).with_for_update())

    def take_over(first_valid: Callable[[], bool]) -> None:
        second = contender.lock("job", wait=30)
        try:
            outcome["first_valid_at_takeover"] = first_valid()
            outcome["second_id"] = second.lock_id
        finally:
            second.unlock()

    async def scenario() -> None:
        locker = front.locker(url, table=table_name, grace=GRACE)
        try:
            lock = await front.call(locker.lock, "job", expires=expires)
            outcome["first_id"] = lock.lock_id
            hold_row(lock.lock_id)
            late = front.in_background(lock.extend, expires)
            await asyncio.sleep(1.0)
            blocker.commit()  # the renewal reaches the database 1 s after it was sent
            await late
            outcome["renewed_until"] = lock.expires  # the database's expiry, as renewed
            hold_row(lock.lock_id)
            stuck = front.in_background(lock.extend, expires)
            await asyncio.sleep(0.1)
            try:
                await front.call(lock.unlock)
            except LockError as error:
                outcome["unlock"] = error
            blocker.commit()  # before the database's expiry
            second = asyncio.ensure_future(asyncio.to_thread(take_over, lock.is_valid))
            try:
                outcome["renewal"] = await stuck
            except LockError as error:
                outcome["renewal"] = error
            outcome["row"] = await front.call(locker.lock_info, "job")
            await second
        finally:
            await front.close(locker)

    try:
        asyncio.run(scenario())
    finally:
        blocker.rollback()
        blocker.close()
        blocker.engine.dispose()
    assert isinstance(outcome.get("unlock"), LockLost), outcome
    assert isinstance(outcome.get("renewal"), LockLost), outcome
    row = outcome["row"]
    # Given back, or left to expire when the renewal the holder was told of set it (a row of
    # another id is the second locker's, which may have taken the lock by then).
    if row is not None and row.lock_id == outcome["first_id"]:
        assert row.expires <= outcome["renewed_until"], outcome
    assert outcome["first_valid_at_takeover"] is False, outcome
    assert outcome["second_id"] > outcome["first_id"], outcome


class _TimeLimit(BaseException):
    """What a job's time limit raises from its signal handler (as gevent's Timeout does):
    not an Exception, so nothing on the way catches it."""


async def _interrupted(front: Front, method: Callable[[], Any], after: float) -> bool:
    """``method()`` cut short ``after`` seconds in: cancelled by ``asyncio.timeout`` (asyncio),
    or by an exception from SIGALRM's handler (sync); whether it was."""
    if front.is_async:
        try:
            async with asyncio.timeout(after):
                await method()
        except TimeoutError:
            return True
        return False

    def time_limit(*_: object) -> None:
        raise _TimeLimit

    previous = signal.signal(signal.SIGALRM, time_limit)
    signal.setitimer(signal.ITIMER_REAL, after)
    try:
        method()
    except _TimeLimit:
        return True
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    return False


async def _next_holder(contender: Locker, lock: Any, outcome: dict[str, Any]) -> None:
    """``contender`` waits for the lock ``lock`` holds ("job"), takes it and gives it back:
    whether ``lock`` said it was valid when the other had it, and both ids, in ``outcome``."""
    outcome["first_id"] = lock.lock_id
    second = await asyncio.to_thread(contender.lock, "job", wait=30)
    outcome["first_valid_at_takeover"] = lock.is_valid()
    outcome["second_id"] = second.lock_id
    second.unlock()


def _assert_one_holder_at_a_time(outcome: dict[str, Any]) -> None:
    assert outcome["second_id"] > outcome["first_id"]
    assert outcome["first_valid_at_takeover"] is False


@pytest.mark.parametrize("front", FRONTS, ids=str)
@pytest.mark.parametrize("backend", ["postgresql", "mysql"])
def test_an_extend_retried_on_a_new_connection_counts_on_no_more_than_its_first_try(
    url: str, table_name: str, make_locker: Any, front: Front, proxied: Proxied
) -> None:
    """``extend(2)`` loses its connection as it sends its statement, which the network still
    holds; it is tried again on a new connection, and succeeds; ``extend()`` by 10 s succeeds
    after it; then the first try reaches the server, and the row expires 2 s later. A retry
    after a lost connection leaves the first try's fate unknown: the holder must not count on
    more than 2 s from then, and is not valid when another process gets the lock."""
    contender = make_locker(grace=0)  # creates the table
    outcome: dict[str, Any] = {}

    async def scenario() -> None:
        locker = front.locker(proxied.url, table=table_name, grace=0)
        try:
            lock = await front.call(locker.lock, "job", expires=10)
            proxied.proxy.deliver_late(b"SET expires", cut_client=True)
            await front.call(lock.extend, 2)  # its retry succeeds
            await front.call(lock.extend, 10)
            proxied.proxy.deliver_held()
            assert await asyncio.to_thread(proxied.proxy.held_delivered.wait, 30)
            await _next_holder(contender, lock, outcome)
        finally:
            with contextlib.suppress(LockError):
                await front.close(locker)

    asyncio.run(scenario())
    _assert_one_holder_at_a_time(outcome)


@pytest.mark.parametrize("front", FRONTS, ids=str)
@pytest.mark.parametrize("backend", ["postgresql", "mysql"])
@pytest.mark.parametrize("step", ["shorter extend", "unlock"])
def test_a_statement_that_lands_after_a_later_extend_leaves_no_second_holder(
    url: str, table_name: str, make_locker: Any, front: Front, proxied: Proxied, step: str
) -> None:
    """A lock's ``extend(2)`` or ``unlock()`` is cut short (a job's time limit, a cancellation)
    while its statement is on its way to the server; the holder extends the lock by its 10 s,
    which succeeds (the sync front: asyncio's waits for the statement in flight, which runs to
    its end); then the first statement reaches the server, as TCP delivers what a client sent
    before it closed once a partition heals: the row now expires 2 s later, or is gone. The
    holder must count on no more than that: not valid when another process gets the lock (it
    counted on the 10 s, and a failed unlock was made good by the extend)."""
    contender = make_locker(grace=0)  # creates the table
    marker = b"DELETE FROM" if step == "unlock" else b"SET expires"
    outcome: dict[str, Any] = {}

    async def scenario() -> None:
        locker = front.locker(proxied.url, table=table_name, grace=0)
        try:
            lock = await front.call(locker.lock, "job", expires=10)
            proxied.proxy.deliver_late(marker)
            if step == "unlock":
                cut_short = await _interrupted(front, lock.unlock, 0.5)
            else:
                cut_short = await _interrupted(front, lambda: lock.extend(2), 0.5)
            assert cut_short
            # By its 10 s: the sync front's on a connection of its own at once; asyncio's after
            # the statement in flight, which runs to its end (or until the row's expiry).
            extending = front.in_background(lock.extend)
            await asyncio.sleep(1.0)
            proxied.proxy.deliver_held()
            assert await asyncio.to_thread(proxied.proxy.held_delivered.wait, 30)
            with contextlib.suppress(LockLost):
                await extending
            await _next_holder(contender, lock, outcome)
        finally:
            with contextlib.suppress(LockError):
                await front.close(locker)

    asyncio.run(scenario())
    _assert_one_holder_at_a_time(outcome)


@pytest.mark.parametrize("front", FRONTS, ids=str)
@pytest.mark.parametrize("backend", ["postgresql", "mysql"])
def test_a_lock_whose_release_is_under_way_is_valid_no_more(
    url: str, table_name: str, make_locker: Any, front: Front, proxied: Proxied
) -> None:
    """``unlock()`` runs in the background (another thread, or a task its caller stopped waiting
    for): its DELETE commits, its answer is lost and its retry stalls. Another process takes
    the lock meanwhile: the holder's work, still going, must not be told the lock is valid."""
    contender = make_locker(grace=0)  # creates the table
    outcome: dict[str, Any] = {}

    async def scenario() -> None:
        locker = front.locker(proxied.url, table=table_name, grace=0)
        try:
            lock = await front.call(locker.lock, "job", expires=10)
            proxied.proxy.lose_answer_to(b"DELETE FROM", then_stall=True)
            releasing = front.in_background(lock.unlock)
            await _next_holder(contender, lock, outcome)
            assert not lock.is_valid()
            with pytest.raises(LockLost, match="release is under way"):
                lock.check()
            proxied.proxy.resume()
            with contextlib.suppress(LockError):
                await releasing
        finally:
            with contextlib.suppress(LockError):
                await front.close(locker)

    asyncio.run(scenario())
    _assert_one_holder_at_a_time(outcome)


@pytest.mark.parametrize("front", FRONTS, ids=str)
@pytest.mark.parametrize("backend", ["postgresql", "mysql"])
def test_a_release_whose_answer_was_lost_says_its_first_try_may_have_deleted_the_row(
    url: str, table_name: str, make_locker: Any, front: Front, proxied: Proxied
) -> None:
    """The release's DELETE commits and its answer is lost with its connection; the retry on
    a new one finds no row. Nobody can tell the first try's DELETE from a break, so the lock
    is reported lost (fail closed), but the report says the first try may have deleted it
    rather than only that the lock was taken."""
    contender = make_locker(grace=0)  # creates the table

    async def scenario() -> None:
        locker = front.locker(proxied.url, table=table_name, grace=0)
        try:
            lock = await front.call(locker.lock, "job", expires=30)
            proxied.proxy.lose_answer_to(b"DELETE FROM")
            with pytest.raises(LockLost, match="first try, whose answer was lost") as lost:
                await front.call(lock.unlock)
            assert proxied.proxy.answers_lost == 1
            assert lost.value.lock_id == lock.lock_id
            assert contender.locks() == []  # the first try's DELETE did it
            again = await front.call(locker.lock, "job", expires=30)
            contender.break_lock("job")
            with pytest.raises(LockLost) as broken:  # a release sent once
                await front.call(again.unlock)
            assert "first try" not in str(broken.value)
        finally:
            with contextlib.suppress(LockError):
                await front.close(locker)

    asyncio.run(scenario())


class _SoftTimeLimit(Exception):
    """What Celery's soft time limit raises from its signal handler: an Exception."""


@pytest.mark.parametrize("backend", ["postgresql", "mysql"])
@pytest.mark.parametrize("engine", ["own", "caller's"])
def test_an_exception_from_a_signal_handler_mid_statement_leaves_no_connection_behind(
    url: str, table_name: str, make_locker: Any, proxied: Proxied, engine: str
) -> None:
    """An acquire cut short by an exception from a signal handler (Celery's soft time limit is
    an Exception, not a BaseException) while its statement is on its way: its connection has
    an answer still to come, or a command still in progress. Put back and used again, the next
    acquire read the old answer as its own (PyMySQL: it "got" a lock another process held) or
    failed for ever (psycopg: "another command is already in progress"). It must go."""
    contender = make_locker()  # creates the table
    held = contender.lock("held elsewhere")
    target: Any = proxied.url if engine == "own" else sa.create_engine(proxied.url)
    locker = Locker(target, table=table_name)
    try:
        locker.lock_info("warm up")  # the connection the acquire will take

        def soft_time_limit(*_: object) -> None:
            raise _SoftTimeLimit

        previous = signal.signal(signal.SIGALRM, soft_time_limit)
        proxied.proxy.stall_before(b"INSERT INTO")
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        try:
            with pytest.raises(_SoftTimeLimit):
                locker.lock("cut short")
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        proxied.proxy.resume()  # the statement reaches the server, and is answered
        time.sleep(0.5)
        with pytest.raises(LockBusy):
            locker.lock("held elsewhere")
        with locker.lock("free") as lock:
            assert lock.is_valid()
        assert held.is_valid()
    finally:
        locker.close()
        held.unlock()
        if engine != "own":
            target.dispose()


@pytest.mark.parametrize("backend", ["postgresql", "mysql"])
def test_a_late_extend_does_not_end_a_finished_holders_window(
    url: str, table_name: str, make_locker: Any, proxied: Proxied
) -> None:
    """``extend(2)`` cut short while the network holds its statement; the holder finishes its
    job and releases within its ``hold_at_least`` window, which keeps the row to the window's
    end; then the extend reaches the server. It must not move that row's expiry: the window
    holds, and the job does not run again in it."""
    contender = make_locker(grace=0)  # creates the table
    locker = Locker(proxied.url, table=table_name, grace=0)
    try:
        lock = locker.lock("nightly", expires=30, hold_at_least=10)
        proxied.proxy.deliver_late(b"SET expires")
        assert asyncio.run(_interrupted(FRONTS[0], lambda: lock.extend(2), 0.5))
        lock.unlock()  # the row is kept to the window's end
        proxied.proxy.deliver_held()
        assert proxied.proxy.held_delivered.wait(30)
        time.sleep(3)  # past the late extend's 2 s
        with pytest.raises(LockBusy):
            contender.lock("nightly")
    finally:
        locker.close()
