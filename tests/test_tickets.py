"""PostgreSQL waiters take tickets (``sqllocker.tickets``): served in the order they came, each
Locker's first waiter alone trying the row, and a refusal costs the holder nothing."""

from __future__ import annotations

import asyncio
import contextlib
import re
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa

from sqllocker import LockBusy, Locker, LockLost
from sqllocker import tickets as ticketing
from sqllocker.asyncio import AsyncLock, AsyncLocker
from sqllocker.engine import resolve_url
from sqllocker.errors import DatabaseError
from sqllocker.operations import LockOperations, Refused
from sqllocker.timeouts import DEAD_PEER_SECONDS
from tests.helpers import (
    FRONTS,
    Front,
    Proxied,
    RawTicket,
    abandon,
    end_listener_session,
    ended_within,
    figure,
    in_line,
    in_line_async,
    listener_pid,
    migrate,
    through_proxy,
    tickets,
    wait_in_thread,
    wait_until,
    wait_until_async,
)
from tests.workers import async_url


@pytest.mark.parametrize("lockers", [5, 1], ids=["a Locker each", "one Locker"])
@pytest.mark.slow
def test_waiters_get_the_lock_in_the_order_they_came(
    migrated_postgres: str, table_name: str, admin: sa.Engine, slow_polling: None, lockers: int
) -> None:
    """With a Locker (and a listener) each, as separate processes would have, every release
    notifies all of them, and without tickets whichever reacted first would win; with one
    Locker, its waiters are in one line of its own as well."""

    def none_left() -> None:
        assert tickets(admin, table_name) == []

    def in_line() -> int:
        return len(tickets(admin, table_name))

    served_in_the_order_they_came(migrated_postgres, table_name, lockers, in_line, none_left)


def served_in_the_order_they_came(
    url: str, table: str, lockers: int, in_line: Callable[[], int], none_left: Callable[[], None]
) -> None:
    """Five waiters on ``lockers`` Lockers, each come once ``in_line()`` counts the tickets of
    those before it: the held lock, released, goes to them in the order they came, and
    ``none_left()`` checks that no ticket stands after them, before their Lockers close."""
    holder = Locker(url, table=table)
    held = holder.lock("report")
    order: list[int] = []
    waiting = [Locker(url, table=table) for _ in range(lockers)]

    def wait(number: int) -> None:
        with waiting[number % lockers].lock("report", wait=60):
            order.append(number)
            time.sleep(0.05)

    threads = []
    for number in range(5):
        threads.append(threading.Thread(target=wait, args=(number,)))
        threads[-1].start()
        wait_until(lambda: in_line() == number + 1)
    held.unlock()
    for thread in threads:
        thread.join(30)
    assert order == [0, 1, 2, 3, 4]
    none_left()
    for locker in [holder, *waiting]:
        locker.close()


def test_a_waiter_gives_up_at_its_deadline_and_its_ticket_with_it(
    migrated_postgres: str, table_name: str, admin: sa.Engine
) -> None:
    def in_line() -> int:
        return len(tickets(admin, table_name))

    def none_left() -> None:
        wait_until(lambda: tickets(admin, table_name) == [])

    gives_up_at_its_deadline(migrated_postgres, table_name, in_line, none_left)


def gives_up_at_its_deadline(
    url: str, table: str, in_line: Callable[[], int], none_left: Callable[[], None]
) -> None:
    """A waiter behind another (``in_line()`` counts the tickets) gives up at its deadline,
    still naming the holder, and its ticket goes with it; the one ahead is served, and
    ``none_left()`` checks that no ticket stands after it, before the Lockers close."""
    holder, first, behind = (Locker(url, table=table) for _ in range(3))
    held = holder.lock("report")
    thread, result = wait_in_thread(first, wait=30)
    wait_until(lambda: in_line() == 1)
    started = time.monotonic()
    with pytest.raises(LockBusy) as busy:
        behind.lock("report", wait=0.5)
    assert 0.4 < time.monotonic() - started < 5
    assert busy.value.lock_id == held.lock_id  # it still names the holder
    assert in_line() == 1  # only the first waiter's is left
    held.unlock()
    thread.join(10)
    assert "lock" in result
    result["lock"].unlock()
    none_left()
    for locker in (holder, first, behind):
        locker.close()


def counting_attempts(
    locker: Locker | AsyncLocker, monkeypatch: pytest.MonkeyPatch
) -> list[tuple[str, float]]:
    """The thread names and monotonic times of ``locker``'s attempts at a row from now on."""
    attempts: list[tuple[str, float]] = []
    try_acquire = locker._operations.try_acquire

    def counted(*args: Any, **kwargs: Any) -> Any:
        attempts.append((threading.current_thread().name, time.monotonic()))
        return try_acquire(*args, **kwargs)

    monkeypatch.setattr(locker._operations, "try_acquire", counted)
    return attempts


def test_only_the_first_waiter_of_a_locker_tries_the_row_and_the_next_once_it_is_first(
    migrated_postgres: str, table_name: str, admin: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hundreds of waiters in a process would each poll the row; the ones behind the first
    of their Locker send nothing at all while they wait."""

    def none_left() -> None:
        assert tickets(admin, table_name) == []

    tried = tried_while_in_line(
        migrated_postgres,
        table_name,
        monkeypatch,
        lambda waiters: in_line(admin, table_name, waiters=waiters),
        none_left,
    )
    assert tried <= {"1st"}, tried


def tried_while_in_line(
    url: str,
    table: str,
    monkeypatch: pytest.MonkeyPatch,
    in_line: Callable[[int], None],
    none_left: Callable[[], None],
) -> set[str]:
    """Three waiters of one Locker behind a held lock, the first ("1st") alone in line
    (``in_line(1)``, then ``in_line(3)``): which of them tried the row during a second they
    all stood in line. Then the lock is released, each is served, and ``none_left()`` checks
    that no ticket stands after them, before their Locker closes."""
    holder, waiters = (Locker(url, table=table) for _ in range(2))
    held = holder.lock("report")
    attempts = counting_attempts(waiters, monkeypatch)
    first = threading.Thread(target=lambda: waiters.lock("report", wait=60).unlock(), name="1st")
    first.start()
    in_line(1)
    later = [
        threading.Thread(target=lambda: waiters.lock("report", wait=60).unlock(), name=name)
        for name in ("2nd", "3rd")
    ]
    for thread in later:
        thread.start()
    in_line(3)
    since = time.monotonic()
    time.sleep(1.0)
    tried = {name for name, moment in attempts if moment >= since}
    held.unlock()
    for thread in [first, *later]:
        thread.join(20)
    none_left()
    holder.close()
    waiters.close()
    return tried


def test_a_newcomer_does_not_take_a_free_row_ahead_of_a_live_ticket(
    migrated_postgres: str, table_name: str, admin: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A live ticket stands while the row is free (its waiter about to be handed it, or, as
    here, stopped): a waiting newcomer takes a ticket behind it rather than the row, and takes
    the row past it only after PATIENCE; try_lock, which never waits, still takes a free row
    at once."""
    monkeypatch.setattr(ticketing, "PATIENCE", 0.5)
    stopped = RawTicket(migrated_postgres, table_name)
    newcomer = Locker(migrated_postgres, table=table_name)
    started = time.monotonic()
    lock = newcomer.lock("report", wait=10)
    assert time.monotonic() - started >= 0.45  # it waited its turn, as long as its patience
    lock.unlock()  # handed to the stopped ticket, which is still live
    assert stopped.leave(give_back=True) is True
    taken = newcomer.try_lock("report")
    assert taken is not None
    taken.unlock()
    stopped.die()
    newcomer.close()


@pytest.mark.slow
def test_a_stopped_waiter_handed_the_row_keeps_those_behind_it_one_expiry_at_most(
    migrated_postgres: str, table_name: str, admin: sa.Engine
) -> None:
    """A waiter whose process stopped while its Locker's listener lives is handed the row like
    any other; the waiter behind it takes the row over once it expires (1 s, and 1 s grace)."""
    holder = Locker(migrated_postgres, table=table_name)
    held = holder.lock("report")
    stopped = RawTicket(migrated_postgres, table_name, ttl=1.0)
    waiter = Locker(migrated_postgres, table=table_name, grace=1)
    thread, result = wait_in_thread(waiter, wait=30)
    in_line(admin, table_name, waiters=2)
    released = time.monotonic()
    held.unlock()
    thread.join(10)
    assert "lock" in result, result
    assert 1.5 < result["returned"] - released < 5  # its expiry and grace, not the 30 s
    result["lock"].unlock()
    stopped.die()
    waiter.close()
    holder.close()


def test_a_first_attempt_refused_at_the_gate_does_not_wait_for_anothers_insert(
    migrated_postgres: str, table_name: str, admin: sa.Engine
) -> None:
    """An INSERT waits for the lockstring's other INSERTs to finish (its turn to draw an id,
    ``Statements._new_row_in_id_order``), which lasts until their commits reach the disk. A
    waiter's first attempt that a live ticket refuses inserts nothing, so it must not wait for
    that turn either: while it waited, the INSERT of the waiter next in line would wait behind
    it. (PostgreSQL 15's planner checks the gate first even when it is written outside the
    subquery that waits; the statement now says so itself.)"""
    locker = Locker(migrated_postgres, table=table_name)
    locker.lock("warm-up").unlock()
    inserting = admin.connect()  # another acquirer, in the middle of its INSERT
    inserting.execute(
        sa.text("SELECT pg_advisory_xact_lock(hashtext(:table), hashtext('report'))"),
        {"table": f"public.{table_name}"},
    )
    waiting = RawTicket(migrated_postgres, table_name)
    outcomes: list[object] = []
    attempt = threading.Thread(
        target=lambda: outcomes.append(
            locker._operations.try_acquire(
                "report", str(uuid.uuid4()), 60.0, {}, queue_key=ticketing.NEWCOMER
            )
        )
    )
    attempt.start()
    attempt.join(3)
    finished = not attempt.is_alive()
    inserting.rollback()  # lets it finish either way
    attempt.join(10)
    assert finished, "the refused attempt waited for the other INSERT's turn"
    assert isinstance(outcomes[0], Refused)
    assert locker.lock_info("report") is None
    inserting.close()
    waiting.die()
    locker.close()


def test_a_refused_attempt_leaves_the_holders_row_untouched(
    migrated_postgres: str, table_name: str, admin: sa.Engine
) -> None:
    """An upsert that decides not to update still locks the row it met, so the holder's release
    would wait for the refused acquirer's commit: the row's xmax would name the refuser."""
    locker = Locker(migrated_postgres, table=table_name)
    held = locker.lock("report")
    for _ in range(3):
        assert locker.try_lock("report") is None
    with admin.connect() as conn:
        xmax = conn.execute(
            sa.text(f"SELECT xmax::text FROM {table_name} WHERE lockstring = 'report'")
        ).scalar_one()
    assert xmax == "0"
    held.unlock()
    locker.close()


def test_a_waiter_whose_giving_up_fails_keeps_the_row_its_own_insert_took(
    migrated_postgres: str,
    table_name: str,
    admin: sa.Engine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A waiter that took the row by its own INSERT (the holder crashed; its row expired) gives
    up its ticket before lock() returns. If that fails, it still has the lock: the row is
    its own, and only its ticket is left (a later release may hand it a row, which expires)."""
    holder, waiter = (Locker(migrated_postgres, table=table_name, grace=0) for _ in range(2))
    dead = abandon(holder.lock("report", expires=0.5))

    def fail(*args: Any) -> bool:
        raise DatabaseError("the database went away")

    monkeypatch.setattr(waiter._operations, "leave_line", fail)
    lock = waiter.lock("report", wait=10)
    assert lock.lock_id > dead.lock_id
    info = waiter.lock_info("report")
    assert info is not None
    assert info.lock_id == lock.lock_id
    assert len(tickets(admin, table_name)) == 1  # left behind, as the warning says
    lock.unlock()
    holder.close()
    waiter.close()


def test_lock_operations_join_and_leave_a_line(
    migrated_postgres: str, table_name: str, admin: sa.Engine
) -> None:
    """The statements under a ticket: taking one says whether the row is held, and tickets
    come in the order they were taken."""
    locker = Locker(migrated_postgres, table=table_name)
    operations: LockOperations = locker._operations
    locker.lock("warm-up").unlock()
    held = locker.lock("report")
    first = operations.join_line("report", "a" * 36, 30.0, {}, 1)
    second = operations.join_line("other", "b" * 36, 30.0, {}, 1)
    assert first[1] is True  # "report" is held
    assert second[1] is False  # "other" is free
    assert second[0] > first[0]
    assert operations.leave_line("report", first[0], "a" * 36, give_back=True) is False
    assert operations.leave_line("other", second[0], "b" * 36, give_back=True) is False
    assert tickets(admin, table_name) == []
    # Without a number: every ticket of that guid for that lockstring, and no one else's.
    for guid in ("a" * 36, "a" * 36, "b" * 36):
        operations.join_line("report", guid, 30.0, {}, 1)
    operations.join_line("other", "a" * 36, 30.0, {}, 1)
    assert operations.leave_line("report", None, "a" * 36, give_back=False) is False
    assert tickets(admin, table_name) == [("report", "b" * 36), ("other", "a" * 36)]
    operations.join_line("report", "b" * 36, 30.0, {}, 1, replacing=True)
    assert tickets(admin, table_name) == [("other", "a" * 36), ("report", "b" * 36)]
    # ... and with give_back, a row of that guid (handed to one of them) goes back too.
    guid = held._state.guid
    assert operations.leave_line("report", None, guid, give_back=True) is True
    assert locker.lock_info("report") is None
    assert operations.leave_line("other", None, "a" * 36, give_back=True) is False
    assert tickets(admin, table_name) == []  # the give-back's release passed dead key 1 over
    with pytest.raises(LockLost):
        held.unlock()  # its row went back
    locker.close()


async def test_sync_and_async_waiters_share_one_line(
    migrated_postgres: str, table_name: str, admin: sa.Engine, slow_polling: None
) -> None:
    holder = Locker(migrated_postgres, table=table_name)
    held = holder.lock("report")
    first, third = (AsyncLocker(async_url(migrated_postgres), table=table_name) for _ in range(2))
    second = Locker(migrated_postgres, table=table_name)
    order: list[str] = []

    async def wait_async(name: str, locker: AsyncLocker) -> None:
        async with locker.lock("report", wait=60):
            order.append(name)
            await asyncio.sleep(0.05)

    def wait_sync() -> None:
        with second.lock("report", wait=60):
            order.append("second")
            time.sleep(0.05)

    tasks = [asyncio.create_task(wait_async("first", first))]
    await wait_until_async(lambda: len(tickets(admin, table_name)) == 1)
    thread = threading.Thread(target=wait_sync)
    thread.start()
    await wait_until_async(lambda: len(tickets(admin, table_name)) == 2)
    tasks.append(asyncio.create_task(wait_async("third", third)))
    await wait_until_async(lambda: len(tickets(admin, table_name)) == 3)
    held.unlock()
    await asyncio.gather(*tasks)
    await asyncio.to_thread(thread.join, 20)
    assert order == ["first", "second", "third"]
    assert tickets(admin, table_name) == []
    holder.close()
    second.close()
    await first.aclose()
    await third.aclose()


async def test_an_async_waiter_behind_a_stopped_ticket_takes_a_free_row(
    migrated_postgres: str, table_name: str, admin: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ticketing, "PATIENCE", 0.3)
    stopped = RawTicket(migrated_postgres, table_name)
    waiter = AsyncLocker(async_url(migrated_postgres), table=table_name)
    started = time.monotonic()
    lock = await waiter.lock("report", wait=20)
    assert 0.3 <= time.monotonic() - started < 5  # its patience, not the 20 s
    assert tickets(admin, table_name) == [("report", stopped.guid)]
    await lock.unlock()
    stopped.die()
    await waiter.aclose()


async def test_a_cancelled_async_waiter_gives_up_its_ticket(
    migrated_postgres: str, table_name: str, admin: sa.Engine, slow_polling: None
) -> None:
    holder = Locker(migrated_postgres, table=table_name)
    waiter = AsyncLocker(async_url(migrated_postgres), table=table_name)
    held = holder.lock("report")

    async def take() -> AsyncLock:
        return await waiter.lock("report", wait=30)

    waiting = [asyncio.create_task(take()) for _ in range(2)]
    await in_line_async(admin, table_name, waiters=2)
    for task in waiting:
        task.cancel()
    for task in waiting:
        with pytest.raises(asyncio.CancelledError):
            await task
    assert tickets(admin, table_name) == []
    assert len(waiter._tickets.line) == 0
    held.unlock()
    assert holder.lock_info("report") is None  # handed to nobody
    await waiter.aclose()
    holder.close()


async def test_an_async_waiter_cancelled_as_it_takes_its_ticket_leaves_none_behind(
    migrated_postgres: str, table_name: str, admin: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled while the statement that takes its ticket runs: the statement runs to its
    end, and the ticket it took is given up, or a release would hand the row to nobody."""
    holder = Locker(migrated_postgres, table=table_name)
    waiter = AsyncLocker(async_url(migrated_postgres), table=table_name)
    held = holder.lock("report")
    joining, joined = threading.Event(), threading.Event()
    join_line = waiter._operations.join_line

    def slow_join(*args: Any) -> tuple[int, bool]:
        joining.set()
        time.sleep(0.3)
        try:
            return join_line(*args)
        finally:
            joined.set()

    monkeypatch.setattr(waiter._operations, "join_line", slow_join)

    async def take() -> AsyncLock:
        return await waiter.lock("report", wait=30)

    task = asyncio.create_task(take())
    await asyncio.to_thread(joining.wait, 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.to_thread(joined.wait, 10)  # the statement ran to its end: a ticket taken
    await wait_until_async(lambda: tickets(admin, table_name) == [])
    held.unlock()
    assert holder.lock_info("report") is None  # handed to nobody, it would stay an hour
    await waiter.aclose()
    holder.close()


# -- Giving a ticket up on a frozen connection, or late ------------------------------------

GRACE = 1.0
# The give-up's patience in the tests that wait it out (5 s): shorter, the same bound.
GIVE_UP_PATIENCE = 2.0


@pytest.mark.parametrize("front", FRONTS, ids=str)
@pytest.mark.parametrize("backend", ["postgresql"])
@pytest.mark.slow  # stalls of seconds behind a proxy
def test_a_waiter_whose_ticket_give_up_freezes_goes_on_and_gives_it_up_later(
    proxied: Proxied, url: str, table_name: str, front: Front, monkeypatch: pytest.MonkeyPatch
) -> None:
    """lock(wait=1) behind a holder takes a ticket; its wait over, it gives the ticket up on a
    connection that then froze. It waited for that give-up for ever (asyncio: the connection
    never answers; sync: the acquire's deadline, its wait and 65 s); it now goes on after
    GIVE_UP_PATIENCE with its LockBusy, and the ticket is given up in the background (on
    another connection), not left standing to be handed the next release's row."""
    monkeypatch.setattr(ticketing, "GIVE_UP_PATIENCE", GIVE_UP_PATIENCE)
    migrate(url, table_name)
    holder = Locker(url, table=table_name, grace=GRACE)
    admin = sa.create_engine(resolve_url(url))
    held = holder.lock("busy job")
    outcome: dict[str, Any] = {}
    standing: list[list[tuple[str, str]]] = []

    async def scenario(locker: Any) -> None:
        await front.call((await front.call(locker.lock, "warm")).unlock)  # the listener too
        proxied.proxy.freeze_connection_before(b"queue_leave")
        outcome.update(await front.timed(locker.lock, "busy job", wait=1.0))
        # Given up in the background within a few tries (each a second apart).
        given_up = ticketing.GIVE_UP_AGAIN * 5
        await asyncio.to_thread(wait_until, lambda: not tickets(admin, table_name), given_up)
        standing.append(await asyncio.to_thread(tickets, admin, table_name))

    try:
        through_proxy(front, proxied, table_name, scenario, GRACE)
    finally:
        held.unlock()
        holder.close()
        admin.dispose()
    assert proxied.proxy.connections_frozen == 1, outcome
    ended_within(outcome, 1.0 + ticketing.GIVE_UP_PATIENCE + 3.0, LockBusy)
    assert standing == [[]], standing
    figure(
        "ticket give-up on a frozen connection",
        f"postgresql {front}",
        f"lock(wait=1) ended in {outcome['took']:.1f}s, {type(outcome['error']).__name__}",
    )


@pytest.mark.parametrize("backend", ["postgresql"])
@pytest.mark.slow  # stalls of seconds behind a proxy
def test_a_cancelled_waiter_whose_ticket_give_up_freezes_is_not_held_up(
    proxied: Proxied, url: str, table_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """asyncio: lock() (waiting for ever) behind a holder, cancelled by the caller's timeout;
    its ticket's give-up goes out on a connection that then froze. The cancellation came once,
    and the give-up awaited that connection for ever: the caller's timeout never returned."""
    monkeypatch.setattr(ticketing, "GIVE_UP_PATIENCE", GIVE_UP_PATIENCE)
    migrate(url, table_name)
    holder = Locker(url, table=table_name, grace=GRACE)
    held = holder.lock("busy job")
    took: list[float] = []

    async def scenario(locker: Any) -> None:
        await (await locker.lock("warm")).unlock()  # the listener too
        proxied.proxy.freeze_connection_before(b"queue_leave")
        started = time.monotonic()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(locker.lock("busy job", wait=None), 1.0)
        took.append(time.monotonic() - started)

    try:
        through_proxy(FRONTS[1], proxied, table_name, scenario, GRACE)
    finally:
        held.unlock()
        holder.close()
    assert proxied.proxy.connections_frozen == 1
    assert took[0] < 1.0 + ticketing.GIVE_UP_PATIENCE + 3.0, took


async def waiting_in_line(
    front: Front, locker: Any, admin: sa.Engine, table_name: str
) -> asyncio.Future[dict[str, Any]]:
    """``locker``'s listener up, and a call of ``front.timed(locker.lock, "job", wait=30)``
    started and holding its ticket (the sync front's call, which blocks, on a thread of its
    own with a loop of its own): its outcome, once it ends."""
    await front.call((await front.call(locker.lock, "warm")).unlock)
    waiting = asyncio.ensure_future(
        front.timed(locker.lock, "job", wait=30.0, expires=60)
        if front.is_async
        else asyncio.to_thread(asyncio.run, front.timed(locker.lock, "job", wait=30.0))
    )
    await asyncio.to_thread(wait_until, lambda: len(tickets(admin, table_name)) == 1)
    return waiting


@pytest.mark.parametrize(
    ("front", "cut_client"),
    [(FRONTS[0], False), (FRONTS[0], True), (FRONTS[1], True)],
    ids=["sync held up", "sync sent again", "asyncio sent again"],
)
@pytest.mark.parametrize("backend", ["postgresql"])
@pytest.mark.slow  # stalls of seconds behind a proxy
def test_a_waiters_dead_ticket_given_up_late_deletes_nothing_it_won(
    proxied: Proxied,
    url: str,
    table_name: str,
    front: Front,
    cut_client: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A waiter's listener session ends (its ticket dead with it). Its give-up of that ticket
    reaches the server late: held up past its patience, or sent again on a new connection as
    the first one's was reset (``cut_client``), the first copy delivered later. The waiter
    meanwhile takes a new ticket under the same guid and is handed the row as the holder lets
    go. The give-up gave back a row handed to the dead ticket, by guid: arriving late, it
    deleted the row the waiter held, and a second Locker took the lockstring beside it."""
    monkeypatch.setattr(ticketing, "GIVE_UP_PATIENCE", GIVE_UP_PATIENCE)
    migrate(url, table_name)
    admin = sa.create_engine(resolve_url(url), isolation_level="AUTOCOMMIT")
    holder = Locker(url, table=table_name, grace=GRACE)
    other = Locker(url, table=table_name, grace=GRACE)
    held = holder.lock("job", expires=120)
    outcome: dict[str, Any] = {}

    async def scenario(locker: Any) -> None:
        waiting = await waiting_in_line(front, locker, admin, table_name)
        proxied.proxy.deliver_late(b"queue_leave", cut_client=cut_client)
        key = locker._tickets.listener.liveness_key
        end_listener_session(admin, locker)

        # The dead ticket's give-up held by the proxy (or sent again), the waiter's new ticket
        # stands, under the listener's new key.
        def new_ticket() -> bool:
            with admin.connect() as conn:
                keys = conn.exec_driver_sql(f"SELECT liveness_key FROM {table_name}_requests")
                return any(found != key for (found,) in keys)

        await asyncio.to_thread(wait_until, new_ticket, ticketing.GIVE_UP_PATIENCE + 10)
        await asyncio.to_thread(held.unlock)
        outcome.update(await waiting)
        proxied.proxy.deliver_held()
        await asyncio.to_thread(proxied.proxy.held_delivered.wait, 5)
        await asyncio.sleep(0.5)
        try:
            second = await asyncio.to_thread(other.lock, "job")
        except LockBusy:
            outcome["second"] = "refused"
        else:
            outcome["second"] = second.lock_id
            second.unlock()
        won = outcome.get("result")
        if won is not None:
            await front.call(won.unlock)  # still its row: no LockLost

    try:
        through_proxy(front, proxied, table_name, scenario, GRACE)
    finally:
        holder.close()
        other.close()
        admin.dispose()
    assert "result" in outcome, outcome  # served in its turn
    assert outcome["second"] == "refused", outcome  # one holder


@pytest.mark.parametrize("front", FRONTS, ids=str)
@pytest.mark.parametrize("backend", ["postgresql"])
@pytest.mark.slow  # a proxy, and a hold that expires
def test_a_dead_ticket_that_lives_on_in_its_old_session_is_given_up_all_the_same(
    proxied: Proxied, url: str, table_name: str, front: Front
) -> None:
    """A waiter's listener connection is lost while the server's session of it lives on (a
    partition the server has not noticed yet): the old liveness key still held there, the
    ticket the waiter takes for dead is live. Its give-up failed (its connection cut twice).
    It was not tried again (the retry stops once the listener's key has changed); the waiter
    won the row by its own INSERT (the holder's row expired), and the next release but its
    own handed the row to that ticket: under the waiter's guid, after its call, held by nobody
    until it expired (an hour). Every ticket of the call's guid is now given up as its wait
    ends (in the background, once it has the lock)."""
    migrate(url, table_name)
    admin = sa.create_engine(resolve_url(url), isolation_level="AUTOCOMMIT")
    holder = Locker(url, table=table_name, grace=GRACE)
    other = Locker(url, table=table_name, grace=GRACE)
    held = holder.lock("job", expires=3)
    zombie = admin.connect()  # the listener's old session, as a partition leaves it
    outcome: dict[str, Any] = {}

    def keys() -> set[int]:
        with admin.connect() as conn:
            found = conn.exec_driver_sql(f"SELECT liveness_key FROM {table_name}_requests")
            return {key for (key,) in found}

    async def scenario(locker: Any) -> None:
        waiting = await waiting_in_line(front, locker, admin, table_name)
        proxied.proxy.cut_before(b"queue_leave", 2)  # the first try and its retry
        old_key = locker._tickets.listener.liveness_key
        end_listener_session(admin, locker)
        zombie.execute(sa.text("SELECT pg_advisory_lock(:key)"), {"key": old_key})
        # The dead ticket's give-up failed; the new ticket stands beside it.
        await asyncio.to_thread(wait_until, lambda: len(keys()) == 2, 10)
        outcome.update(await waiting)
        won = outcome.get("result")
        if won is not None:
            await front.call(won.unlock)  # a release hands nothing to its own guid's tickets
        await asyncio.to_thread(wait_until, lambda: not keys(), 5)  # given up in the background
        for turn in ("first", "second"):  # the first one's release hands to a live ticket
            try:
                taken = await asyncio.to_thread(other.lock, "job")
            except LockBusy as busy:
                outcome[turn] = str(busy)
            else:
                outcome[turn] = "taken"
                await asyncio.to_thread(taken.unlock)
        outcome["tickets"] = await asyncio.to_thread(tickets, admin, table_name)

    try:
        through_proxy(front, proxied, table_name, scenario, GRACE)
    finally:
        with contextlib.suppress(LockLost):  # expired and taken over
            held.unlock()
        zombie.close()
        holder.close()
        other.close()
        admin.dispose()
    assert "result" in outcome, outcome
    assert outcome["first"] == outcome["second"] == "taken", outcome  # none handed to the dead
    assert outcome["tickets"] == [], outcome


@pytest.mark.parametrize("front", FRONTS, ids=str)
@pytest.mark.parametrize("backend", ["postgresql"])
def test_the_server_soon_ends_a_listeners_session_whose_client_is_gone(
    url: str, table_name: str, front: Front
) -> None:
    """The session of a Locker's listener keeps its tickets alive: where its client is gone
    without a word (a partition, its host lost), the server ends it by its own keepalives, in
    seconds (``LISTENER_SESSION``), not the kernel's two hours, which a dead ticket lived on
    (the tests above). Read off the kernel: the server's keepalive timer of the connection."""
    migrate(url, table_name)
    admin = sa.create_engine(resolve_url(url))
    port = sa.engine.make_url(url).port or 5432

    async def scenario() -> str:
        locker = front.locker(url, table=table_name)
        try:
            # A call that may wait starts the listener.
            await front.call((await front.call(locker.lock, "warm", wait=5)).unlock)
            listening = lambda: locker._tickets.listener.liveness_key is not None  # noqa: E731
            await asyncio.to_thread(wait_until, listening)
            pid = await asyncio.to_thread(listener_pid, admin, locker)
            with admin.connect() as conn:
                client_port = conn.execute(
                    sa.text("SELECT client_port FROM pg_stat_activity WHERE pid = :pid"),
                    {"pid": pid},
                ).scalar_one()
            sockets = ["ss", "-tnoH", "state", "established"]
            sockets.append(f"( sport = :{port} and dport = :{client_port} )")
            for _look in range(50):  # idle: while data is unacknowledged, another timer shows
                listed = subprocess.run(sockets, capture_output=True, text=True, check=True)
                if "keepalive" in listed.stdout:
                    break
                await asyncio.sleep(0.1)
            return listed.stdout
        finally:
            await front.close(locker)

    try:
        listed = asyncio.run(scenario())
    finally:
        admin.dispose()
    timer = re.search(r"timer:\(keepalive,([\d.]+)(ms|sec|min)", listed)
    assert timer is not None, listed
    number, unit = float(timer[1]), timer[2]
    seconds = number / 1000 if unit == "ms" else number * 60 if unit == "min" else number
    assert seconds <= DEAD_PEER_SECONDS // 3, listed  # the kernel's default: 7,200 s
