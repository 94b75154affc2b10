"""PostgreSQL: a release hands the row to the head of the queue (migration 0005), and never to a
waiter that is no longer there."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

from sqllocker import Lock, Locker, notifications
from sqllocker.asyncio import AsyncLocker
from sqllocker.backoff import Backoff
from sqllocker.engine import resolve_url
from sqllocker.holding import safety_margin
from sqllocker.queueing import queue_key
from tests.helpers import (
    abandon,
    head_is_waiting,
    head_is_waiting_async,
    head_the_queue,
    leave_the_queue,
    queued,
    requests,
    row_guid,
    wait_in_thread,
    wait_until,
    wait_until_async,
)
from tests.workers import async_url


@dataclass(frozen=True)
class HandOff:
    held: Lock  # the holder's lock, released
    lock: Lock  # what the waiter got
    released: float  # monotonic: the holder's unlock() returned
    returned: float  # monotonic: the waiter's lock() returned


def hand_off(holder: Locker, waiter: Locker, admin: sa.Engine, table: str) -> HandOff:
    """The holder takes "report"; the waiter waits for it (expiry 20 s) until it heads the
    queue; the holder releases it."""
    held = holder.lock("report")
    thread, result = wait_in_thread(waiter, wait=60, expires=20)
    head_is_waiting(admin, table)
    held.unlock()
    released = time.monotonic()
    thread.join(10)
    return HandOff(held, result["lock"], released, result["returned"])


@pytest.fixture
def holder_and_waiter(migrated_postgres: str, table_name: str) -> Iterator[tuple[Locker, Locker]]:
    lockers = (
        Locker(migrated_postgres, table=table_name),
        Locker(migrated_postgres, table=table_name),
    )
    yield lockers
    for locker in lockers:
        locker.close()


class RawHead:
    """A session that heads ``lockstring``'s queue and leaves a request through migration 0005's
    functions, as a waiter does, but acts only when told: the waiter's moves, one at a time."""

    def __init__(self, url: str, table: str, lockstring: str = "report", ttl: float = 30.0) -> None:
        self.table, self.lockstring = table, lockstring
        self.key = queue_key(f"public.{table}", lockstring)
        self.guid = str(uuid.uuid4())
        target = sa.make_url(resolve_url(url))
        self.connection = psycopg.connect(
            host=target.host,
            port=target.port,
            user=target.username,
            dbname=target.database,
            autocommit=True,
        )
        self.ttl = ttl
        self.head_the_queue()

    def head_the_queue(self) -> None:
        row = self.connection.execute(
            f"SELECT {self.table}_queue_for_hand_off(%s, %s, %s, %s, %s, %s)",
            (
                self.key,
                10_000,
                self.lockstring,
                self.guid,
                json.dumps({"job": "raw head"}),
                self.ttl,
            ),
        ).fetchone()
        assert row == (True,)

    def leave(self, give_back: bool) -> bool:
        row = self.connection.execute(
            f"SELECT {self.table}_queue_leave(%s, %s, %s, %s)",
            (self.key, self.lockstring, self.guid, give_back),
        ).fetchone()
        assert row is not None
        return bool(row[0])


def test_a_release_hands_the_row_to_the_head_of_the_queue(
    holder_and_waiter: tuple[Locker, Locker], table_name: str, admin: sa.Engine, slow_polling: None
) -> None:
    """The head has the lock when the release commits, by the grant's NOTIFY alone (its own
    attempts would come only after 30 s here), and counts the lock's validity from before the
    release returned: the row's expiry period began inside the release."""
    holder, waiter = holder_and_waiter
    done = hand_off(holder, waiter, admin, table_name)
    held, lock, released = done.held, done.lock, done.released
    assert done.returned - released < 5  # not the 30 s poll
    assert waiter._listener is not None
    assert waiter._listener.grants == 1
    info = waiter.lock_info("report")
    assert info is not None
    assert info.lock_id == lock.lock_id
    assert lock.lock_id > held.lock_id  # the fencing token still grows
    assert lock.expires == info.expires
    assert lock.created == info.created
    assert lock._state.valid_until <= released + 20 - safety_margin(20)
    wait_until(lambda: queued(admin, table_name, "report") == (0, 0))  # it left the queue
    assert requests(admin, table_name) == []
    lock.unlock()
    assert waiter.lock_info("report") is None  # and nobody was handed the row again


def test_a_hand_off_heard_late_counts_from_the_release_not_from_the_hearing(
    holder_and_waiter: tuple[Locker, Locker],
    table_name: str,
    admin: sa.Engine,
    monkeypatch: pytest.MonkeyPatch,
    slow_polling: None,
) -> None:
    """The row's expiry period began inside the release; a head that hears of it later (its
    listener thread starved of CPU, say) must not count its validity from then."""
    hand_over = notifications.WaiterQueues.hand_over

    def late(self: notifications.WaiterQueues, grant: notifications.Grant) -> bool:
        time.sleep(0.5)
        return hand_over(self, grant)

    monkeypatch.setattr(notifications.WaiterQueues, "hand_over", late)
    holder, waiter = holder_and_waiter
    done = hand_off(holder, waiter, admin, table_name)
    lock, released = done.lock, done.released
    assert done.returned - released > 0.4  # heard late, by the NOTIFY
    assert lock._state.valid_until <= released + 20 - safety_margin(20)
    lock.unlock()


def test_a_lost_hand_off_notification_is_found_by_the_heads_next_attempt(
    holder_and_waiter: tuple[Locker, Locker],
    table_name: str,
    admin: sa.Engine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without the grant's NOTIFY (its listener reconnecting, say), the head finds the row under
    its own guid at its next attempt, and counts its validity from the row's creation."""
    monkeypatch.setattr(notifications.WaiterQueues, "hand_over", lambda self, grant: False)
    holder, waiter = holder_and_waiter
    done = hand_off(holder, waiter, admin, table_name)
    lock, released = done.lock, done.released
    info = waiter.lock_info("report")
    assert info is not None
    assert info.lock_id == lock.lock_id
    assert lock._state.valid_until <= released + 20 - safety_margin(20)
    lock.unlock()
    wait_until(lambda: queued(admin, table_name, "report") == (0, 0))
    assert requests(admin, table_name) == []


def counting_attempts(locker: Locker | AsyncLocker, monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The monotonic times of ``locker``'s attempts at a row from now on."""
    attempts: list[float] = []
    try_acquire = locker._operations.try_acquire

    def counted(*args: Any, **kwargs: Any) -> Any:
        attempts.append(time.monotonic())
        return try_acquire(*args, **kwargs)

    monkeypatch.setattr(locker._operations, "try_acquire", counted)
    return attempts


# A head with its request standing, for this long: backing off from 2 ms it made 8 or more
# attempts; at the longest delay (0.125-0.25 s) at most four, and one more on heading the queue.
HEADS_FOR = 0.6
AT_MOST_WHILE_HEADING = 5


def test_a_head_with_its_request_in_waits_for_the_release_not_for_a_poll_timer(
    holder_and_waiter: tuple[Locker, Locker],
    table_name: str,
    admin: sa.Engine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Once its request stands, the release hands the head the row and its NOTIFY says so, so
    the head's timer only guards against a lost notification (and the holder's expiry). Polling
    from 2 ms up cost a round trip each time, and an attempt that met the release held the
    lockstring's id-order lock just then: the trigger left the row to that INSERT instead of
    handing it over (under contention, most turns once holds lasted a few ms)."""
    holder, waiter = holder_and_waiter
    attempts = counting_attempts(waiter, monkeypatch)
    held = holder.lock("report")
    thread, result = wait_in_thread(waiter, wait=60, expires=20)
    wait_until(lambda: len(requests(admin, table_name)) == 1)
    queued_at = time.monotonic()
    time.sleep(HEADS_FOR)
    heading = [moment for moment in attempts if moment >= queued_at]
    held.unlock()
    thread.join(10)
    assert len(heading) <= AT_MOST_WHILE_HEADING, heading
    lock = result["lock"]
    info = waiter.lock_info("report")
    assert info is not None
    assert info.lock_id == lock.lock_id
    lock.unlock()


def test_a_head_takes_over_a_crashed_holders_row_when_it_can_be_taken_over(
    holder_and_waiter: tuple[Locker, Locker], table_name: str, admin: sa.Engine
) -> None:
    """No release comes from a holder that crashed: the head's timer, however long it waits
    for a hand-off, still wakes it when the row can be taken over (expiry plus grace, 1 s)."""
    holder, waiter = holder_and_waiter
    dead = abandon(holder.lock("report", expires=0.5))
    started = time.monotonic()
    thread, result = wait_in_thread(waiter, wait=60, expires=20)
    wait_until(lambda: len(requests(admin, table_name)) == 1)  # it heads the queue
    thread.join(10)
    lock = result["lock"]
    assert 1.3 <= result["returned"] - started < 3.0
    assert lock.lock_id > dead.lock_id
    lock.unlock()


def test_a_head_that_took_the_row_itself_withdraws_its_request_before_it_has_the_lock(
    holder_and_waiter: tuple[Locker, Locker], table_name: str, admin: sa.Engine
) -> None:
    """A head whose own INSERT won the row (it was free when the head came to the front) must
    not leave its request standing: a later release of another holder's row would hand that
    row to a waiter that is gone, and nobody could have the lock until it expired."""
    holder, waiter = holder_and_waiter
    held = holder.lock("report")
    blocker = head_the_queue(admin, table_name)  # a head that leaves no request
    thread, result = wait_in_thread(waiter, wait=60)
    wait_until(lambda: queued(admin, table_name, "report") == (1, 1))
    held.unlock()  # no request stands: the row is simply free
    leave_the_queue(blocker, table_name)  # the waiter heads the queue and inserts the row itself
    thread.join(10)
    lock: Lock = result["lock"]
    assert waiter._listener is not None
    assert waiter._listener.grants == 0
    assert requests(admin, table_name) == []  # withdrawn before lock() returned
    lock.unlock()
    again = holder.lock("report")  # someone else's row, released with the waiter gone
    again.unlock()
    assert holder.lock_info("report") is None
    blocker.close()


def test_a_head_whose_wait_ends_in_an_error_gives_back_a_row_handed_to_it(
    holder_and_waiter: tuple[Locker, Locker],
    table_name: str,
    admin: sa.Engine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The sync twin of the cancelled async head: the release hands the row over, the head has
    not heard (its NOTIFY lost), and its next attempt fails (the database went away, say).
    Leaving the queue, it gives the row back: nobody is left waiting for a holder that is
    gone."""
    monkeypatch.setattr(notifications.WaiterQueues, "hand_over", lambda self, grant: False)
    # No attempt of its own until woken below: none can be under way when the release lands.
    monkeypatch.setattr(Backoff, "for_wait", classmethod(lambda cls, wait: cls(None, 30.0, 30.0)))
    try_acquire = Locker._try_acquire

    def fail_once_handed_the_row(
        self: Locker, lockstring: str, guid: str, *args: Any, **kwargs: Any
    ) -> Any:
        if row_guid(admin, table_name, lockstring) == guid:  # this attempt would find it ours
            raise RuntimeError("the database went away")
        return try_acquire(self, lockstring, guid, *args, **kwargs)

    holder, waiter = holder_and_waiter
    held = holder.lock("report")
    monkeypatch.setattr(Locker, "_try_acquire", fail_once_handed_the_row)
    thread, result = wait_in_thread(waiter, wait=60)
    head_is_waiting(admin, table_name)
    held.unlock()
    assert waiter._listener is not None
    waiter._listener._waiters.wake_everyone()  # as a dropped listening connection does
    thread.join(10)
    assert isinstance(result.get("error"), RuntimeError)  # it was handed the row, then failed
    assert holder.lock_info("report") is None  # given back
    assert requests(admin, table_name) == []
    wait_until(lambda: queued(admin, table_name, "report") == (0, 0))


def test_no_row_is_handed_to_a_head_whose_session_ended(
    migrated_postgres: str, table_name: str, admin: sa.Engine
) -> None:
    """A head whose process died leaves its request behind; its session no longer holds the
    queue, so the release does not hand it the row, and the next acquirer has it at once."""
    locker = Locker(migrated_postgres, table=table_name)
    held = locker.lock("report")
    head = RawHead(migrated_postgres, table_name)
    head.connection.close()  # the process died: its request stays, its queue lock goes
    wait_until(lambda: queued(admin, table_name, "report") == (0, 0))
    held.unlock()
    assert locker.lock_info("report") is None
    assert requests(admin, table_name) == [("report", head.guid)]  # stale, never granted
    with locker.lock("report"):
        pass
    locker.close()


def advisory_locks_of(admin: sa.Engine, backend_pid: int) -> int:
    """How many advisory locks the session ``backend_pid`` holds."""
    with admin.connect() as conn:
        held = conn.execute(
            sa.text(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted "
                "AND pid = :pid"
            ),
            {"pid": backend_pid},
        ).scalar_one()
    return int(held)


def test_a_dead_heads_request_is_not_granted_while_the_next_head_holds_the_queue(
    migrated_postgres: str, table_name: str, admin: sa.Engine
) -> None:
    """The moment after a head died and the next one took the queue's lock, before it has
    written its own request: the dead head's request still stands, and the queue's lock is
    held. A release must tell the two heads apart (migration 0007: by the dead head's own key,
    which nobody holds), or it hands the row to nobody until it expires."""
    locker = Locker(migrated_postgres, table=table_name)
    held = locker.lock("report")
    dead = RawHead(migrated_postgres, table_name)
    dead.connection.close()
    wait_until(lambda: queued(admin, table_name, "report") == (0, 0))
    next_head = head_the_queue(admin, table_name)  # the queue's lock, no request yet
    held.unlock()
    assert locker.lock_info("report") is None  # not handed to the dead head
    assert requests(admin, table_name) == [("report", dead.guid)]
    leave_the_queue(next_head, table_name)
    next_head.close()
    locker.close()


def test_a_head_holds_a_key_of_its_own_and_leaves_with_every_lock_given_up(
    holder_and_waiter: tuple[Locker, Locker],
    migrated_postgres: str,
    table_name: str,
    admin: sa.Engine,
    slow_polling: None,
) -> None:
    """A head holds the queue's lock and its request's own (migration 0007), and gives both
    up when it leaves: by withdrawing its request, and after a release handed it the row (a
    lock left behind on a kept connection would stay in the server's lock table)."""
    head = RawHead(migrated_postgres, table_name)
    pid = head.connection.info.backend_pid
    assert advisory_locks_of(admin, pid) == 2
    with admin.connect() as conn:
        key = conn.exec_driver_sql(f"SELECT request_key FROM {table_name}_requests").scalar()
    assert key is not None
    assert head.leave(give_back=True) is False
    assert advisory_locks_of(admin, pid) == 0
    head.connection.close()

    holder, waiter = holder_and_waiter
    done = hand_off(holder, waiter, admin, table_name)
    assert waiter._listener is not None
    assert waiter._listener.grants == 1
    with admin.connect() as conn:
        wait_until(
            lambda: (
                conn.exec_driver_sql(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND database = "
                    "(SELECT oid FROM pg_database WHERE datname = current_database())"
                ).scalar()
                == 0
            )
        )
    done.lock.unlock()


def test_purge_sweeps_the_requests_of_heads_that_are_gone_and_keeps_a_live_heads(
    migrated_postgres: str, table_name: str, admin: sa.Engine
) -> None:
    """A dead head's request would stay until the next head of its lockstring replaced it:
    for a lockstring never contended again, for ever, and every release of it would test
    the request's head again. purge-expired sweeps those; a request whose session still
    heads its queue is kept, and is still granted."""
    locker = Locker(migrated_postgres, table=table_name)
    held = locker.lock("report")
    dead = [RawHead(migrated_postgres, table_name, lockstring=f"gone {n}") for n in range(3)]
    for head in dead:
        head.connection.close()
    live = RawHead(migrated_postgres, table_name)
    wait_until(lambda: all(queued(admin, table_name, f"gone {n}") == (0, 0) for n in range(3)))
    assert len(requests(admin, table_name)) == 4

    assert locker.purge_expired_locks() == 0  # no expired rows: only requests were swept
    assert requests(admin, table_name) == [("report", live.guid)]

    held.unlock()
    assert row_guid(admin, table_name, "report") == live.guid  # the live head's was granted
    assert live.leave(give_back=True) is True
    live.connection.close()
    locker.close()


def test_a_release_of_the_heads_own_row_does_not_hand_it_back(
    migrated_postgres: str, table_name: str, admin: sa.Engine
) -> None:
    """The row of a head that won it by its own INSERT carries its request's guid; a release
    of that row before the request is withdrawn must not insert it again."""
    locker = Locker(migrated_postgres, table=table_name)
    head = RawHead(migrated_postgres, table_name)
    with admin.begin() as conn:
        conn.exec_driver_sql(
            f"INSERT INTO {table_name} (lockstring, guid, created, expires, locked_by) "
            "VALUES ('report', %(guid)s, now(), now() + interval '30 s', '{}')",
            {"guid": head.guid},
        )
        conn.exec_driver_sql(f"DELETE FROM {table_name} WHERE guid = %(guid)s", {"guid": head.guid})
    assert locker.lock_info("report") is None
    assert head.leave(give_back=False) is False  # the request was still there to withdraw
    locker.close()


@pytest.mark.parametrize("give_back", [True, False])
def test_leaving_the_queue_says_whether_the_row_was_handed_over_and_can_give_it_back(
    migrated_postgres: str, table_name: str, admin: sa.Engine, give_back: bool
) -> None:
    """A head that stops waiting (its deadline, an error) leaves with give_back: a row handed
    to it meanwhile is deleted in the same statement, so nobody is kept waiting for a lock
    whose holder has gone. A head that keeps the row leaves without it."""
    locker = Locker(migrated_postgres, table=table_name)
    held = locker.lock("report")
    head = RawHead(migrated_postgres, table_name)
    held.unlock()
    info = locker.lock_info("report")
    assert info is not None
    assert row_guid(admin, table_name, "report") == head.guid
    assert info.lock_id > held.lock_id
    assert head.leave(give_back=give_back) is True  # it had been handed the row
    assert (locker.lock_info("report") is None) is give_back
    assert requests(admin, table_name) == []
    head.connection.close()
    locker.close()


def test_break_lock_and_purge_hand_the_row_to_the_head_too(
    holder_and_waiter: tuple[Locker, Locker], table_name: str, admin: sa.Engine, slow_polling: None
) -> None:
    holder, waiter = holder_and_waiter
    held = holder.lock("report")
    thread, result = wait_in_thread(waiter, wait=60)
    head_is_waiting(admin, table_name)
    holder.break_lock("report", held.lock_id)
    thread.join(10)
    assert result["lock"].lock_id > held.lock_id
    result["lock"].unlock()

    purger = Locker(holder.engine, table=table_name, grace=0)
    expiring = purger.lock("report", expires=0.3)
    thread, result = wait_in_thread(waiter, wait=60)  # it would take over at expiry + 1 s
    head_is_waiting(admin, table_name)
    time.sleep(0.4)
    assert purger.purge_expired_locks() == 1
    thread.join(10)
    assert result["lock"].lock_id > expiring.lock_id
    result["lock"].unlock()
    assert waiter._listener is not None
    assert waiter._listener.grants == 2


async def test_an_async_head_is_handed_the_row_too(
    migrated_postgres: str, table_name: str, admin: sa.Engine, slow_polling: None
) -> None:
    holder = Locker(migrated_postgres, table=table_name)
    waiter = AsyncLocker(async_url(migrated_postgres), table=table_name)
    held = holder.lock("report")
    task = asyncio.ensure_future(waiter.lock("report", wait=60, expires=20))
    await head_is_waiting_async(admin, table_name)
    await asyncio.to_thread(held.unlock)
    released = time.monotonic()
    lock = await asyncio.wait_for(task, 10)
    assert time.monotonic() - released < 5  # not the 30 s poll
    assert waiter._listener is not None
    assert waiter._listener.grants == 1
    info = holder.lock_info("report")
    assert info is not None
    assert info.lock_id == lock.lock_id
    assert lock._state.valid_until <= released + 20 - safety_margin(20)
    await lock.unlock()
    await wait_until_async(lambda: queued(admin, table_name, "report") == (0, 0))
    assert requests(admin, table_name) == []
    assert holder.lock_info("report") is None
    holder.close()
    await waiter.aclose()


async def test_an_async_head_with_its_request_in_waits_for_the_release_too(
    migrated_postgres: str, table_name: str, admin: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    holder = Locker(migrated_postgres, table=table_name)
    waiter = AsyncLocker(async_url(migrated_postgres), table=table_name)
    attempts = counting_attempts(waiter, monkeypatch)
    held = holder.lock("report")
    task = asyncio.ensure_future(waiter.lock("report", wait=60, expires=20))
    await wait_until_async(lambda: len(requests(admin, table_name)) == 1)
    queued_at = time.monotonic()
    await asyncio.sleep(HEADS_FOR)
    heading = [moment for moment in attempts if moment >= queued_at]
    await asyncio.to_thread(held.unlock)
    lock = await asyncio.wait_for(task, 10)
    assert len(heading) <= AT_MOST_WHILE_HEADING, heading
    info = holder.lock_info("report")
    assert info is not None
    assert info.lock_id == lock.lock_id
    await lock.unlock()
    holder.close()
    await waiter.aclose()


async def test_an_async_purge_sweeps_the_requests_of_heads_that_are_gone(
    migrated_postgres: str, table_name: str, admin: sa.Engine
) -> None:
    locker = AsyncLocker(async_url(migrated_postgres), table=table_name)
    dead = RawHead(migrated_postgres, table_name, lockstring="gone")
    dead.connection.close()
    live = RawHead(migrated_postgres, table_name)
    await wait_until_async(lambda: queued(admin, table_name, "gone") == (0, 0))
    assert await locker.purge_expired_locks() == 0
    assert requests(admin, table_name) == [("report", live.guid)]
    live.connection.close()
    await locker.aclose()


async def test_a_cancelled_async_head_leaves_no_request_and_no_row_behind(
    migrated_postgres: str, table_name: str, admin: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled just as a release handed it the row (the NOTIFY not yet heard), the head
    gives the row back as it leaves the queue: nobody is left waiting for a holder that is
    gone."""
    monkeypatch.setattr(notifications.WaiterQueues, "hand_over", lambda self, grant: False)
    monkeypatch.setattr(Backoff, "for_wait", classmethod(lambda cls, wait: cls(None, 30.0, 30.0)))
    holder = Locker(migrated_postgres, table=table_name)
    waiter = AsyncLocker(async_url(migrated_postgres), table=table_name)
    held = holder.lock("report")
    task = asyncio.ensure_future(waiter.lock("report", wait=60))
    await head_is_waiting_async(admin, table_name)
    await asyncio.to_thread(held.unlock)
    info = holder.lock_info("report")
    assert info is not None  # handed to the waiter, which has not heard of it
    assert info.lock_id > held.lock_id
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_until_async(lambda: queued(admin, table_name, "report") == (0, 0))
    assert requests(admin, table_name) == []
    assert holder.lock_info("report") is None  # given back
    holder.close()
    await waiter.aclose()
