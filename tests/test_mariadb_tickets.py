"""MariaDB/MySQL waiters take tickets (``sqllocker.tickets``): served in the order they came,
each Locker's first waiter alone polling the row, a ticket alive only while its Locker's
listener holds the ``GET_LOCK`` name of its liveness key."""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections.abc import Iterator
from typing import Any

import pymysql
import pytest
import sqlalchemy as sa

from sqllocker import Locker
from sqllocker import tickets as ticketing
from sqllocker.asyncio import AsyncLocker
from sqllocker.backends.mysql import liveness_name
from sqllocker.engine import resolve_url
from tests.helpers import migrate, served_in_turn, wait_in_thread, wait_until
from tests.test_tickets import (
    gives_up_at_its_deadline,
    served_in_the_order_they_came,
    tried_while_in_line,
)
from tests.workers import async_url


@pytest.fixture
def migrated_mysql(mysql_url: str, table_name: str) -> str:
    """A table made by the migrations, so it has its requests table."""
    migrate(mysql_url, table_name)
    return mysql_url


@pytest.fixture
def admin(migrated_mysql: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(resolve_url(migrated_mysql), isolation_level="AUTOCOMMIT")
    yield engine
    engine.dispose()


def standing(admin: sa.Engine, table: str) -> list[tuple[str, int]]:
    """The standing tickets, lowest first: (lockstring, liveness key)."""
    with admin.connect() as conn:
        rows = conn.exec_driver_sql(
            f"SELECT lockstring, liveness_key FROM {table}_requests ORDER BY ticket"
        )
        return [(str(row[0]), int(row[1])) for row in rows]


def session(url: str) -> pymysql.connections.Connection[Any]:
    target = sa.make_url(resolve_url(url))
    return pymysql.connect(
        host=target.host or "127.0.0.1",
        port=target.port or 3306,
        user=target.username or "root",
        database=target.database,
        autocommit=True,
    )


class StrangerTicket:
    """A ticket inserted by a session of its own that holds its liveness key's name (unless
    ``live`` is False: a Locker that is gone), and then does nothing: a waiter whose process
    stopped while its Locker's listener lives on."""

    def __init__(self, url: str, table: str, live: bool = True) -> None:
        self.connection = session(url)
        self.key = secrets.randbits(62)
        with self.connection.cursor() as cursor:
            if live:
                cursor.execute("SELECT GET_LOCK(%s, 0)", (liveness_name(self.key),))
            cursor.execute(
                f"INSERT INTO {table}_requests (lockstring, guid_sha256, liveness_key) "
                "VALUES (%s, %s, %s)",
                ("report", secrets.token_hex(32), self.key),
            )

    def die(self) -> None:
        self.connection.close()


@pytest.mark.parametrize("lockers", [5, 1], ids=["a Locker each", "one Locker"])
def test_waiters_get_the_lock_in_the_order_they_came(
    migrated_mysql: str, table_name: str, admin: sa.Engine, lockers: int
) -> None:
    """With a Locker each, as separate processes would have, each Locker's first waiter polls
    the row, and without tickets whichever polled first after a release would win."""

    def none_left() -> None:
        wait_until(lambda: standing(admin, table_name) == [])  # given up in the background

    def in_line() -> int:
        return len(standing(admin, table_name))

    served_in_the_order_they_came(migrated_mysql, table_name, lockers, in_line, none_left)


@pytest.mark.slow
async def test_async_waiters_get_the_lock_in_the_order_they_came(
    migrated_mysql: str, table_name: str, admin: sa.Engine
) -> None:
    holder = Locker(migrated_mysql, table=table_name)
    held = holder.lock("report")
    waiting = [AsyncLocker(async_url(migrated_mysql), table=table_name) for _ in range(3)]
    order: list[int] = []

    async def wait(number: int) -> None:
        async with waiting[number % len(waiting)].lock("report", wait=60):
            order.append(number)
            await asyncio.sleep(0.05)

    tasks = []
    for number in range(6):
        tasks.append(asyncio.create_task(wait(number)))
        deadline = time.monotonic() + 10
        while len(await asyncio.to_thread(standing, admin, table_name)) < number + 1:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
    await asyncio.to_thread(held.unlock)
    await asyncio.wait_for(asyncio.gather(*tasks), 30)
    assert order == list(range(6))
    wait_until(lambda: standing(admin, table_name) == [])  # given up in the background
    for locker in waiting:
        await locker.aclose()
    holder.close()


@pytest.mark.slow
def test_a_waiter_gives_up_at_its_deadline_and_its_ticket_with_it(
    migrated_mysql: str, table_name: str, admin: sa.Engine
) -> None:
    def in_line() -> int:
        return len(standing(admin, table_name))

    def none_left() -> None:
        wait_until(lambda: standing(admin, table_name) == [])  # given up in the background

    gives_up_at_its_deadline(migrated_mysql, table_name, in_line, none_left)


def test_only_the_first_waiter_of_a_locker_polls_the_row(
    migrated_mysql: str, table_name: str, admin: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hundreds of waiters in a process would each poll the row; the ones behind the first
    of their Locker send nothing at all while they wait."""

    def none_left() -> None:
        wait_until(lambda: standing(admin, table_name) == [])  # given up in the background

    def in_line(waiters: int) -> None:
        wait_until(lambda: len(standing(admin, table_name)) == waiters)

    tried = tried_while_in_line(migrated_mysql, table_name, monkeypatch, in_line, none_left)
    assert tried == {"1st"}, tried  # and it does poll: nothing hands the row over


def test_a_newcomer_does_not_take_a_free_row_ahead_of_a_live_ticket(
    migrated_mysql: str, table_name: str, admin: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A live ticket stands while the row is free (its waiter stopped): a waiting newcomer
    takes a ticket behind it rather than the row, and takes the row past it only after
    PATIENCE; try_lock, which never waits, takes a free row at once."""
    monkeypatch.setattr(ticketing, "PATIENCE", 0.5)
    stopped = StrangerTicket(migrated_mysql, table_name)
    newcomer = Locker(migrated_mysql, table=table_name)
    started = time.monotonic()
    lock = newcomer.lock("report", wait=10)
    assert time.monotonic() - started >= 0.45  # it waited its turn, as long as its patience
    assert newcomer._tickets.line.passed == 1
    lock.unlock()
    taken = newcomer.try_lock("report")
    assert taken is not None
    taken.unlock()
    stopped.die()
    newcomer.close()


def test_a_dead_ticket_keeps_nobody_waiting_and_the_purge_sweeps_it(
    migrated_mysql: str, table_name: str, admin: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ticket whose liveness name nobody holds (its Locker's process died) is passed over at
    once, and the purge deletes it; a live one it leaves."""
    # Long, so that a first connection slowed by a loaded machine is not taken for it.
    monkeypatch.setattr(ticketing, "PATIENCE", 5.0)
    dead = StrangerTicket(migrated_mysql, table_name, live=False)
    locker = Locker(migrated_mysql, table=table_name)
    started = time.monotonic()
    locker.lock("report", wait=10).unlock()
    # Not PATIENCE (a second): the dead ticket did not count.
    assert time.monotonic() - started < 0.9 * ticketing.PATIENCE
    assert locker._tickets.line.passed == 0
    live = StrangerTicket(migrated_mysql, table_name)
    assert len(standing(admin, table_name)) == 2
    locker.purge_expired_locks()
    assert standing(admin, table_name) == [("report", live.key)]
    for stranger in (dead, live):
        stranger.die()
    locker.close()


@pytest.mark.slow
def test_waiters_whose_listener_lost_its_session_take_new_tickets_and_are_served(
    migrated_mysql: str, table_name: str, admin: sa.Engine
) -> None:
    """The listener's session ends (a server restart, a KILL): its tickets die with its
    liveness name, and its waiters take new ones once it has reconnected, with a new key, in
    the order of their old ones, and are served in that order."""
    holder, waiters = (Locker(migrated_mysql, table=table_name) for _ in range(2))
    held = holder.lock("report")
    results = []
    for number in range(4):
        results.append(wait_in_thread(waiters, wait=30))
        wait_until(lambda: len(standing(admin, table_name)) == number + 1)
    listener = waiters._tickets.listener
    assert listener is not None
    assert listener.liveness_key is not None
    old_key = listener.liveness_key
    with admin.connect() as conn:
        session_id = conn.exec_driver_sql(
            "SELECT IS_USED_LOCK(%(name)s)", {"name": liveness_name(old_key)}
        ).scalar()
        assert session_id is not None
        conn.exec_driver_sql(f"KILL {int(session_id)}")
    wait_until(  # each waiter, with the new key
        lambda: (
            len(rows := standing(admin, table_name)) == 4 and all(key != old_key for _, key in rows)
        ),
        timeout=20,
    )
    held.unlock()
    assert served_in_turn(results) == [0, 1, 2, 3]
    wait_until(lambda: standing(admin, table_name) == [])  # given up in the background
    holder.close()
    waiters.close()


async def test_a_listener_that_loses_a_cancellation_still_stops(
    migrated_mysql: str, table_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """aclose() ends even when the listener's task lets a cancellation go by, as Python 3.11's
    wait_for does with one that comes as the liveness look it waits for ends: the task is
    cancelled again. Before, aclose() waited for it for ever (a many-process test's worker
    stood still at its end)."""
    from sqllocker.asyncio.listener import AsyncReleaseListener

    listen = AsyncReleaseListener._listen
    lost: list[bool] = []

    async def deaf_once(self: AsyncReleaseListener) -> None:
        try:
            await listen(self)
        except asyncio.CancelledError:
            lost.append(True)  # the cancellation lost: it listens on
            await listen(self)

    monkeypatch.setattr(AsyncReleaseListener, "_listen", deaf_once)
    holder = Locker(migrated_mysql, table=table_name)
    held = holder.lock("report")
    locker = AsyncLocker(async_url(migrated_mysql), table=table_name)
    try:
        threading.Timer(0.5, held.unlock).start()
        await (await locker.lock("report", wait=30)).unlock()  # a waiter: the listener runs
        assert locker._tickets.listener is not None
    finally:
        closing = asyncio.create_task(locker.aclose())
        closed, _ = await asyncio.wait({closing}, timeout=20)
        holder.close()
    assert closed, "aclose() still waits for its listener"
    assert lost == [True]
