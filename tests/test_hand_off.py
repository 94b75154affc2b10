"""PostgreSQL: a release hands the row to the first live ticket (``sqllocker.tickets``), and
never to a waiter that is no longer there."""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import hmac
import threading
import time
from dataclasses import dataclass
from typing import Any

import pytest
import sqlalchemy as sa

from sqllocker import Lock, LockBusy, Locker, clock, notifications
from sqllocker import listener as listening
from sqllocker import tickets as ticketing
from sqllocker.asyncio import AsyncLocker
from sqllocker.attempts import Attempts
from sqllocker.backoff import Backoff
from sqllocker.engine import resolve_url
from sqllocker.holding import safety_margin
from sqllocker.migrations import current_revision, downgrade, upgrade
from tests.helpers import (
    RawTicket,
    abandon,
    end_listener_session,
    in_line,
    in_line_async,
    listener_pid,
    row_guid,
    served_in_turn,
    tickets,
    unlock_in_turn,
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
    """The holder takes "report"; the waiter waits for it (expiry 20 s) until it holds a
    ticket; the holder releases it."""
    held = holder.lock("report")
    thread, result = wait_in_thread(waiter, wait=60, expires=20)
    in_line(admin, table)
    held.unlock()
    released = time.monotonic()
    thread.join(10)
    return HandOff(held, result["lock"], released, result["returned"])


def test_a_release_hands_the_row_to_the_waiter_with_the_first_ticket(
    holder_and_waiter: tuple[Locker, Locker], table_name: str, admin: sa.Engine, slow_polling: None
) -> None:
    """The waiter has the lock when the release commits, by the grant's NOTIFY alone (its own
    attempts would come only after 30 s here), and counts the lock's validity from before the
    release returned: the row's expiry period began inside the release."""
    holder, waiter = holder_and_waiter
    done = hand_off(holder, waiter, admin, table_name)
    held, lock, released = done.held, done.lock, done.released
    assert done.returned - released < 5  # not the 30 s poll
    assert waiter._tickets.listener is not None
    assert waiter._tickets.listener.grants == 1
    info = waiter.lock_info("report")
    assert info is not None
    assert info.lock_id == lock.lock_id
    assert lock.lock_id > held.lock_id  # the fencing token still grows
    assert lock.expires == info.expires
    assert lock.created == info.created
    assert lock._state.valid_until <= released + 20 - safety_margin(20)
    assert tickets(admin, table_name) == []  # the release took the ticket with it
    assert len(waiter._tickets.line) == 0
    lock.unlock()
    assert waiter.lock_info("report") is None  # and nobody was handed the row again


def test_a_hand_off_heard_late_counts_from_the_release_not_from_the_hearing(
    holder_and_waiter: tuple[Locker, Locker],
    table_name: str,
    admin: sa.Engine,
    monkeypatch: pytest.MonkeyPatch,
    slow_polling: None,
) -> None:
    """The row's expiry period began inside the release; a waiter that hears of it later (its
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


def test_a_lost_hand_off_notification_is_found_by_the_waiters_next_attempt(
    holder_and_waiter: tuple[Locker, Locker],
    table_name: str,
    admin: sa.Engine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without the grant's NOTIFY (its listener reconnecting, say), the first waiter of its
    Locker finds the row under its own guid at its next attempt, and renews it before it
    counts: the row's expiry and the lock's validity both count from that attempt."""
    monkeypatch.setattr(notifications.WaiterQueues, "hand_over", lambda self, grant: False)
    holder, waiter = holder_and_waiter
    done = hand_off(holder, waiter, admin, table_name)
    lock = done.lock
    info = waiter.lock_info("report")
    assert info is not None
    assert info.lock_id == lock.lock_id
    assert info.expires == lock.expires  # renewed by the attempt that found it
    assert lock._state.valid_until <= done.returned + 20 - safety_margin(20)
    lock.unlock()
    assert tickets(admin, table_name) == []


def counting_attempts(locker: Locker | AsyncLocker, monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The monotonic times of ``locker``'s attempts at a row from now on."""
    attempts: list[float] = []
    try_acquire = locker._operations.try_acquire

    def counted(*args: Any, **kwargs: Any) -> Any:
        attempts.append(time.monotonic())
        return try_acquire(*args, **kwargs)

    monkeypatch.setattr(locker._operations, "try_acquire", counted)
    return attempts


# A waiter with its ticket, for this long: backing off from 2 ms it made 8 or more attempts; at
# the longest delay (0.125-0.25 s) at most four, and one more on taking its ticket.
IN_LINE_FOR = 0.6
AT_MOST_IN_LINE = 5


def test_a_waiter_with_a_ticket_waits_for_the_release_not_for_a_poll_timer(
    holder_and_waiter: tuple[Locker, Locker],
    table_name: str,
    admin: sa.Engine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Once its ticket stands, the release hands the waiter the row and its NOTIFY says so, so
    the waiter's timer only guards against a lost notification (and the holder's expiry). Polling
    from 2 ms up cost a round trip each time, and an attempt that met the release held the
    lockstring's id-order lock just then: the trigger left the row to that INSERT instead of
    handing it over (under contention, most turns once holds lasted a few ms)."""
    holder, waiter = holder_and_waiter
    attempts = counting_attempts(waiter, monkeypatch)
    held = holder.lock("report")
    thread, result = wait_in_thread(waiter, wait=60, expires=20)
    wait_until(lambda: len(tickets(admin, table_name)) == 1)
    queued_at = time.monotonic()
    time.sleep(IN_LINE_FOR)
    heading = [moment for moment in attempts if moment >= queued_at]
    held.unlock()
    thread.join(10)
    assert len(heading) <= AT_MOST_IN_LINE, heading
    lock = result["lock"]
    info = waiter.lock_info("report")
    assert info is not None
    assert info.lock_id == lock.lock_id
    lock.unlock()


def test_a_waiter_takes_over_a_crashed_holders_row_when_it_can_be_taken_over(
    holder_and_waiter: tuple[Locker, Locker], table_name: str, admin: sa.Engine
) -> None:
    """No release comes from a holder that crashed: the first waiter's timer, however long it waits
    for a hand-off, still wakes it when the row can be taken over (expiry plus grace, 1 s)."""
    holder, waiter = holder_and_waiter
    dead = abandon(holder.lock("report", expires=0.5))
    started = time.monotonic()
    thread, result = wait_in_thread(waiter, wait=60, expires=20)
    wait_until(lambda: len(tickets(admin, table_name)) == 1)  # in line
    thread.join(10)
    lock = result["lock"]
    assert 1.3 <= result["returned"] - started < 3.0
    assert lock.lock_id > dead.lock_id
    lock.unlock()


def test_a_waiter_that_took_the_row_itself_gives_up_its_ticket_before_it_has_the_lock(
    holder_and_waiter: tuple[Locker, Locker],
    migrated_postgres: str,
    table_name: str,
    admin: sa.Engine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A waiter whose own INSERT won the row must not leave its ticket standing: a later
    release of another holder's row would hand that row to a waiter that is gone, and nobody
    could have the lock until it expired. Here a live ticket ahead never acts (its process
    stopped) while the row is free: the waiter takes the row past it after PATIENCE."""
    monkeypatch.setattr(ticketing, "PATIENCE", 0.3)
    holder, waiter = holder_and_waiter
    stopped = RawTicket(migrated_postgres, table_name)  # never acts; the row is free
    started = time.monotonic()
    lock = waiter.lock("report", wait=60)
    assert 0.3 <= time.monotonic() - started < 5  # its patience, not the minute
    assert waiter._tickets.listener is not None
    assert waiter._tickets.listener.grants == 0  # its own INSERT
    assert tickets(admin, table_name) == [("report", stopped.guid)]  # its own given up
    lock.unlock()  # handed to the stopped ticket, still live
    assert row_guid(admin, table_name, "report") == stopped.guid
    assert stopped.leave(give_back=True) is True
    again = holder.lock("report")  # someone else's row, released with the waiter gone
    again.unlock()
    assert holder.lock_info("report") is None  # handed to nobody
    stopped.die()


def test_a_waiter_whose_wait_ends_in_an_error_gives_back_a_row_handed_to_it(
    holder_and_waiter: tuple[Locker, Locker],
    table_name: str,
    admin: sa.Engine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The sync twin of the cancelled async waiter: the release hands the row over, the waiter
    has not heard (its NOTIFY lost), and its next attempt fails (the database went away, say).
    Giving up its ticket, it gives the row back: nobody is left waiting for a holder that is
    gone."""
    monkeypatch.setattr(notifications.WaiterQueues, "hand_over", lambda self, grant: False)
    # No attempt of its own until woken below: none can be under way when the release lands.
    monkeypatch.setattr(Backoff, "for_wait", classmethod(lambda cls, wait: cls(None, 30.0, 30.0)))
    try_acquire = Attempts.try_acquire

    def fail_once_handed_the_row(
        self: Attempts, winnings: Any, lockstring: str, guid: str, *args: Any, **kwargs: Any
    ) -> Any:
        if row_guid(admin, table_name, lockstring) == guid:  # this attempt would find it ours
            raise RuntimeError("the database went away")
        return try_acquire(self, winnings, lockstring, guid, *args, **kwargs)

    holder, waiter = holder_and_waiter
    held = holder.lock("report")
    monkeypatch.setattr(Attempts, "try_acquire", fail_once_handed_the_row)
    thread, result = wait_in_thread(waiter, wait=60)
    in_line(admin, table_name)
    held.unlock()
    assert waiter._tickets.listener is not None
    waiter._tickets.listener._waiters.wake_everyone()  # as a dropped listening connection does
    thread.join(10)
    assert isinstance(result.get("error"), RuntimeError)  # it was handed the row, then failed
    assert holder.lock_info("report") is None  # given back
    assert tickets(admin, table_name) == []


def test_no_row_is_handed_to_a_ticket_whose_locker_is_gone_and_the_next_live_one_has_it(
    holder_and_waiter: tuple[Locker, Locker],
    migrated_postgres: str,
    table_name: str,
    admin: sa.Engine,
    slow_polling: None,
) -> None:
    """A Locker whose process died leaves its tickets behind, but nobody holds their liveness
    key: a release passes over them (deleting them) to the first live ticket."""
    holder, waiter = holder_and_waiter
    held = holder.lock("report")
    dead = [RawTicket(migrated_postgres, table_name) for _ in range(2)]
    for ticket in dead:
        ticket.die()
    thread, result = wait_in_thread(waiter, wait=60)
    in_line(admin, table_name, waiters=3)
    assert [guid for _, guid in tickets(admin, table_name)][:2] == [t.guid for t in dead]
    held.unlock()
    thread.join(10)
    assert result["lock"].lock_id > held.lock_id  # handed over at once, not polled for
    assert waiter._tickets.listener is not None
    assert waiter._tickets.listener.grants == 1
    assert tickets(admin, table_name) == []  # the dead ones passed over, and deleted
    result["lock"].unlock()


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


def test_a_lockers_tickets_live_by_its_listeners_one_key_given_up_with_its_session(
    holder_and_waiter: tuple[Locker, Locker], table_name: str, admin: sa.Engine
) -> None:
    """The listener holds one advisory lock, its liveness key, which every ticket of its
    Locker carries; closing the Locker ends the session and with it the key: its tickets are
    dead from then on, and no lock is left behind in the server's lock table."""
    holder, waiter = holder_and_waiter
    held = holder.lock("report")
    threads = [wait_in_thread(waiter, wait=60) for _ in range(2)]
    in_line(admin, table_name, waiters=2)
    pid = listener_pid(admin, waiter)
    assert advisory_locks_of(admin, pid) == 1
    with admin.connect() as conn:
        keys = conn.exec_driver_sql(f"SELECT liveness_key FROM {table_name}_requests").all()
    assert waiter._tickets.listener is not None
    assert {key for (key,) in keys} == {waiter._tickets.listener.liveness_key}
    held.unlock()
    unlock_in_turn(threads)
    waiter.close()
    wait_until(lambda: advisory_locks_of(admin, pid) == 0)


@pytest.mark.slow
def test_a_listener_that_reconnects_has_its_waiters_take_new_tickets_and_be_served(
    holder_and_waiter: tuple[Locker, Locker], table_name: str, admin: sa.Engine
) -> None:
    """The listener's session ends (a failover, a DBA's pg_terminate_backend): its key goes
    with it, so its tickets are dead. Its waiters take new tickets under the new key once it
    reconnects, in the order of their old ones, and are served in that order."""
    holder, waiter = holder_and_waiter
    held = holder.lock("report")
    threads = []
    for number in range(4):
        threads.append(wait_in_thread(waiter, wait=60))
        in_line(admin, table_name, waiters=number + 1)
    assert waiter._tickets.listener is not None
    old_key = waiter._tickets.listener.liveness_key
    end_listener_session(admin, waiter)
    wait_until(
        lambda: (
            waiter._tickets.listener is not None
            and waiter._tickets.listener.liveness_key not in (None, old_key)
        )
    )
    new_key = waiter._tickets.listener.liveness_key
    with admin.connect() as conn:
        wait_until(
            lambda: (
                conn.exec_driver_sql(
                    f"SELECT count(*) FILTER (WHERE liveness_key = {new_key}), count(*) "
                    f"FROM {table_name}_requests"
                ).one()
                == (4, 4)
            )
        )
    held.unlock()
    assert served_in_turn(threads) == [0, 1, 2, 3]
    assert tickets(admin, table_name) == []


def test_purge_sweeps_the_tickets_of_lockers_that_are_gone_and_keeps_the_live_ones(
    migrated_postgres: str, table_name: str, admin: sa.Engine
) -> None:
    """A dead Locker's ticket would stay until a release of its lockstring passed over it: for
    a lockstring never contended again, for ever. purge-expired sweeps those; a live ticket
    is kept, and is still granted."""
    locker = Locker(migrated_postgres, table=table_name)
    held = locker.lock("report")
    dead = [RawTicket(migrated_postgres, table_name, lockstring=f"gone {n}") for n in range(3)]
    for ticket in dead:
        ticket.die()
    live = RawTicket(migrated_postgres, table_name)
    assert len(tickets(admin, table_name)) == 4

    assert locker.purge_expired_locks() == 0  # no expired rows: only tickets were swept
    assert tickets(admin, table_name) == [("report", live.guid)]

    held.unlock()
    assert row_guid(admin, table_name, "report") == live.guid  # the live ticket was granted
    assert live.leave(give_back=True) is True
    live.die()
    locker.close()


def test_a_release_of_a_waiters_own_row_does_not_hand_it_back(
    migrated_postgres: str, table_name: str, admin: sa.Engine
) -> None:
    """The row of a waiter that won it by its own INSERT carries its ticket's guid; a release
    of that row before the ticket is given up must not insert it again."""
    locker = Locker(migrated_postgres, table=table_name)
    head = RawTicket(migrated_postgres, table_name)
    with admin.begin() as conn:
        conn.exec_driver_sql(
            f"INSERT INTO {table_name} (lockstring, guid, created, expires, locked_by) "
            "VALUES ('report', %(guid)s, now(), now() + interval '30 s', '{}')",
            {"guid": head.guid},
        )
        conn.exec_driver_sql(f"DELETE FROM {table_name} WHERE guid = %(guid)s", {"guid": head.guid})
    assert locker.lock_info("report") is None
    assert tickets(admin, table_name) == [("report", head.guid)]  # still there to give up
    assert head.leave(give_back=True) is False
    head.die()
    locker.close()


@pytest.mark.parametrize("give_back", [True, False])
def test_giving_up_a_ticket_gives_back_a_row_handed_to_it(
    migrated_postgres: str, table_name: str, admin: sa.Engine, give_back: bool
) -> None:
    """A waiter that stops waiting (its deadline, an error) gives up its ticket with
    give_back: a row handed to it meanwhile is deleted in the same statement, so nobody is kept
    waiting for a lock whose holder has gone. Without give_back the row stays."""
    locker = Locker(migrated_postgres, table=table_name)
    held = locker.lock("report")
    head = RawTicket(migrated_postgres, table_name)
    held.unlock()
    info = locker.lock_info("report")
    assert info is not None
    assert row_guid(admin, table_name, "report") == head.guid
    assert info.lock_id > held.lock_id
    assert head.leave(give_back=give_back) is give_back  # it had been handed the row
    assert (locker.lock_info("report") is None) is give_back
    assert tickets(admin, table_name) == []
    head.die()
    locker.close()


def test_break_lock_and_purge_hand_the_row_to_the_first_ticket_too(
    holder_and_waiter: tuple[Locker, Locker], table_name: str, admin: sa.Engine, slow_polling: None
) -> None:
    holder, waiter = holder_and_waiter
    held = holder.lock("report")
    thread, result = wait_in_thread(waiter, wait=60)
    in_line(admin, table_name)
    holder.break_lock("report", held.lock_id)
    thread.join(10)
    assert result["lock"].lock_id > held.lock_id
    result["lock"].unlock()

    purger = Locker(holder.engine, table=table_name, grace=0)
    expiring = purger.lock("report", expires=0.3)
    thread, result = wait_in_thread(waiter, wait=60)  # it would take over at expiry + 1 s
    in_line(admin, table_name)
    time.sleep(0.4)
    assert purger.purge_expired_locks() == 1
    thread.join(10)
    assert result["lock"].lock_id > expiring.lock_id
    result["lock"].unlock()
    assert waiter._tickets.listener is not None
    assert waiter._tickets.listener.grants == 2


async def test_an_async_waiter_is_handed_the_row_too(
    migrated_postgres: str, table_name: str, admin: sa.Engine, slow_polling: None
) -> None:
    holder = Locker(migrated_postgres, table=table_name)
    waiter = AsyncLocker(async_url(migrated_postgres), table=table_name)
    held = holder.lock("report")
    task = asyncio.ensure_future(waiter.lock("report", wait=60, expires=20))
    await in_line_async(admin, table_name)
    await asyncio.to_thread(held.unlock)
    released = time.monotonic()
    lock = await asyncio.wait_for(task, 10)
    assert time.monotonic() - released < 5  # not the 30 s poll
    assert waiter._tickets.listener is not None
    assert waiter._tickets.listener.grants == 1
    info = holder.lock_info("report")
    assert info is not None
    assert info.lock_id == lock.lock_id
    assert lock._state.valid_until <= released + 20 - safety_margin(20)
    await lock.unlock()
    assert tickets(admin, table_name) == []
    assert holder.lock_info("report") is None
    holder.close()
    await waiter.aclose()


async def test_an_async_waiter_with_a_ticket_waits_for_the_release_too(
    migrated_postgres: str, table_name: str, admin: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    holder = Locker(migrated_postgres, table=table_name)
    waiter = AsyncLocker(async_url(migrated_postgres), table=table_name)
    attempts = counting_attempts(waiter, monkeypatch)
    held = holder.lock("report")
    task = asyncio.ensure_future(waiter.lock("report", wait=60, expires=20))
    await wait_until_async(lambda: len(tickets(admin, table_name)) == 1)
    queued_at = time.monotonic()
    await asyncio.sleep(IN_LINE_FOR)
    heading = [moment for moment in attempts if moment >= queued_at]
    await asyncio.to_thread(held.unlock)
    lock = await asyncio.wait_for(task, 10)
    assert len(heading) <= AT_MOST_IN_LINE, heading
    info = holder.lock_info("report")
    assert info is not None
    assert info.lock_id == lock.lock_id
    await lock.unlock()
    holder.close()
    await waiter.aclose()


async def test_an_async_purge_sweeps_the_tickets_of_lockers_that_are_gone(
    migrated_postgres: str, table_name: str, admin: sa.Engine
) -> None:
    locker = AsyncLocker(async_url(migrated_postgres), table=table_name)
    dead = RawTicket(migrated_postgres, table_name, lockstring="gone")
    dead.die()
    live = RawTicket(migrated_postgres, table_name)
    assert await locker.purge_expired_locks() == 0
    assert tickets(admin, table_name) == [("report", live.guid)]
    live.die()
    await locker.aclose()


async def test_a_cancelled_async_waiter_leaves_no_ticket_and_no_row_behind(
    migrated_postgres: str, table_name: str, admin: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled just as a release handed it the row (the NOTIFY not yet heard), the waiter
    gives the row back as it gives up its ticket: nobody is left waiting for a holder that is
    gone."""
    monkeypatch.setattr(notifications.WaiterQueues, "hand_over", lambda self, grant: False)
    monkeypatch.setattr(Backoff, "for_wait", classmethod(lambda cls, wait: cls(None, 30.0, 30.0)))
    holder = Locker(migrated_postgres, table=table_name)
    waiter = AsyncLocker(async_url(migrated_postgres), table=table_name)
    held = holder.lock("report")
    task = asyncio.ensure_future(waiter.lock("report", wait=60))
    await in_line_async(admin, table_name)
    await asyncio.to_thread(held.unlock)
    info = holder.lock_info("report")
    assert info is not None  # handed to the waiter, which has not heard of it
    assert info.lock_id > held.lock_id
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert tickets(admin, table_name) == []
    assert holder.lock_info("report") is None  # given back
    holder.close()
    await waiter.aclose()


def statements_of(engine: sa.Engine) -> list[str]:
    """The statements sent through ``engine`` from now on (until the test ends)."""
    sent: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        sent.append(statement)

    sa.event.listen(engine, "before_cursor_execute", record)
    return sent


def no_read_back(locker: Locker | AsyncLocker, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The ids of the grants ``locker`` reads back from the table from now on."""
    read_back: list[int] = []
    claim_grant = locker._operations.claim_grant

    def counted(lockstring: str, lock_id: int, guid: str) -> Any:
        read_back.append(lock_id)
        return claim_grant(lockstring, lock_id, guid)

    monkeypatch.setattr(locker._operations, "claim_grant", counted)
    return read_back


def test_a_signed_grant_is_believed_without_a_statement(
    holder_and_waiter: tuple[Locker, Locker],
    table_name: str,
    admin: sa.Engine,
    monkeypatch: pytest.MonkeyPatch,
    slow_polling: None,
) -> None:
    """The release signs its grant with the key the waiter gave with its ticket, which only
    the trigger can read: the waiter has its lock from the notification alone, without reading
    its row back (one round trip per hand-off), and its lock is the row the table holds."""
    holder, waiter = holder_and_waiter
    read_back = no_read_back(waiter, monkeypatch)
    held = holder.lock("report")
    thread, result = wait_in_thread(waiter, wait=60, expires=20)
    in_line(admin, table_name)
    sent = statements_of(waiter.engine)
    held.unlock()
    thread.join(10)
    handed = list(sent)
    lock = result["lock"]
    assert read_back == []
    assert handed == []  # no statement at all between the release and lock() returning
    assert waiter._tickets.listener is not None
    assert waiter._tickets.listener.grants == 1
    info = waiter.lock_info("report")
    assert info is not None
    assert (info.lock_id, info.created, info.expires) == (lock.lock_id, lock.created, lock.expires)
    lock.unlock()
    assert waiter.lock_info("report") is None


def test_a_grant_whose_release_commits_late_counts_from_the_rows_creation(
    holder_and_waiter: tuple[Locker, Locker],
    table_name: str,
    admin: sa.Engine,
    monkeypatch: pytest.MonkeyPatch,
    slow_polling: None,
) -> None:
    """The trigger inserts the waiter's row when the release DELETEs; its notification is heard
    when the release commits, here half a second later. The waiter, which no longer reads its
    row back, counts its validity from no later than the row's creation (by what the signed
    grant says of the server's clock), so its deadline is never later than the row's expiry."""
    holder, waiter = holder_and_waiter
    read_back = no_read_back(waiter, monkeypatch)
    held = holder.lock("report")
    thread, result = wait_in_thread(waiter, wait=60, expires=20)
    in_line(admin, table_name)
    with admin.begin() as conn:
        conn.exec_driver_sql(f"DELETE FROM {table_name} WHERE id = %(id)s", {"id": held.lock_id})
        conn.exec_driver_sql("SELECT pg_sleep(0.5)")
    thread.join(10)
    lock = result["lock"]
    assert read_back == []
    asked = clock.now()
    with admin.connect() as conn:
        row = conn.exec_driver_sql(
            f"SELECT created, expires, clock_timestamp() AS server_now FROM {table_name} "
            "WHERE id = %(id)s",
            {"id": lock.lock_id},
        ).one()
    answered = clock.now()
    assert (lock.created, lock.expires) == (row.created, row.expires)
    # On our clock, the row was created no later than ``answered`` less its age then, and
    # expires no later than ``answered`` plus what it had left.
    created_by = answered - (row.server_now - row.created).total_seconds()
    expires_by = answered + (row.expires - row.server_now).total_seconds()
    state = lock._state
    assert state.valid_until <= expires_by - safety_margin(20)
    start = state.valid_until - 20 + safety_margin(20)
    assert start <= created_by, (start - created_by, answered - asked)
    held._state.held = False  # its row went with the DELETE above
    lock.unlock()


def signed_payload(key: notifications.GrantKey, lock_id: int, digest: str) -> str:
    """A grant's notification as the release trigger writes it, signed with ``key``."""
    times = "2030-01-01T00:00:00.000001 2030-01-01T00:00:01.000002 2030-01-01T00:00:21.000002"
    said = f"{lock_id} {digest} {times}"
    return f"{said} {hmac.new(key._key, said.encode(), hashlib.sha256).hexdigest()}"


def test_a_grant_is_believed_only_as_signed_and_under_its_own_key() -> None:
    """What the waiter checks a signed grant by: the HMAC of everything it says, under the key
    of its own ticket. A payload with any field changed, one signed under another waiter's
    key, and a MAC that is not even hex are refused (and raise nothing)."""
    key, other = notifications.GrantKey(0.0), notifications.GrantKey(0.0)
    assert len(key.pads) == 128
    digest = notifications.guid_digest("guid")
    payload = signed_payload(key, 7, digest)
    grant = notifications.parse_grant(payload)
    assert grant is not None
    assert grant.signed is not None
    assert (grant.lock_id, grant.digest) == (7, digest)
    assert key.signed(grant.signed)
    assert not other.signed(grant.signed)
    fields = payload.split(" ")
    mac = fields[-1]
    for changed in (
        payload.replace("7 ", "8 ", 1),
        payload.replace(digest, notifications.guid_digest("another")),
        payload.replace("00:00:21", "00:00:59"),
        payload[:-1] + ("0" if mac[-1] != "0" else "1"),
        " ".join([*fields[:-1], "é" * 64]),
    ):
        forged = notifications.parse_grant(changed)
        assert forged is not None
        assert forged.signed is not None
        assert not key.signed(forged.signed), changed
    for malformed in (" ".join(fields[:-1]), " ".join([*fields[:2], "yesterday", *fields[3:]])):
        assert notifications.parse_grant(malformed) is None
    unsigned = notifications.parse_grant(f"7 {digest}")
    assert unsigned == notifications.Grant(7, digest)
    # The times, UTC to the microsecond, and a text with an offset of its own refused.
    utc = datetime.timezone.utc
    assert grant.signed.joined == datetime.datetime(2030, 1, 1, 0, 0, 0, 1, tzinfo=utc)
    assert grant.signed.expires == datetime.datetime(2030, 1, 1, 0, 0, 21, 2, tzinfo=utc)
    assert notifications.parse_grant(payload.replace(".000001 ", ".000001+02:00 ")) is None
    # The pads are HMAC's: the key padded to SHA-256's block, XOR ipad, then XOR opad.
    padded = key._key.ljust(64, b"\0")
    assert key.pads == bytes(b ^ 0x36 for b in padded) + bytes(b ^ 0x5C for b in padded)


def test_a_listener_parses_only_the_grants_that_name_a_waiter_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every listener hears every grant: one naming another's waiter is passed over unparsed,
    and one naming ours is parsed and handed to it (which believes it only if signed)."""
    parsed: list[str] = []
    parse = notifications.parse_grant

    def counted(payload: str) -> notifications.Grant | None:
        parsed.append(payload)
        return parse(payload)

    monkeypatch.setattr(listening, "parse_grant", counted)
    listener = listening.ReleaseListener(sa.create_engine("sqlite://"), "locks")
    ours = notifications.guid_digest("ours")
    waiter = listener._waiters.add(
        notifications.Waiter("report", threading.Event(), ours, releases=False)
    )
    key = notifications.GrantKey(0.0)
    others = signed_payload(key, 7, notifications.guid_digest("another"))
    for payload in (others, "garbage", ""):
        listener._received(Notice(listener.grants_channel, payload))
    assert parsed == []
    assert waiter.grant is None
    assert not waiter.event.is_set()
    mine = signed_payload(key, 8, ours)
    listener._received(Notice(listener.grants_channel, mine))
    assert parsed == [mine]
    assert waiter.grant is not None
    assert waiter.grant.lock_id == 8
    assert waiter.event.is_set()
    assert listener.grants == 1


@dataclass
class Notice:
    """A notification as psycopg gives it to the listener."""

    channel: str
    payload: str


async def test_an_async_waiter_believes_a_signed_grant_without_a_statement(
    migrated_postgres: str,
    table_name: str,
    admin: sa.Engine,
    monkeypatch: pytest.MonkeyPatch,
    slow_polling: None,
) -> None:
    holder = Locker(migrated_postgres, table=table_name)
    waiter = AsyncLocker(async_url(migrated_postgres), table=table_name)
    read_back = no_read_back(waiter, monkeypatch)
    held = holder.lock("report")
    task = asyncio.ensure_future(waiter.lock("report", wait=60, expires=20))
    await in_line_async(admin, table_name)
    sent = statements_of(waiter.engine.sync_engine)
    await asyncio.to_thread(held.unlock)
    lock = await asyncio.wait_for(task, 10)
    handed = list(sent)
    assert read_back == []
    assert handed == []
    info = holder.lock_info("report")
    assert info is not None
    assert (info.lock_id, info.created, info.expires) == (lock.lock_id, lock.created, lock.expires)
    await lock.unlock()
    holder.close()
    await waiter.aclose()


def test_a_table_behind_revision_0003_hands_over_unsigned_grants_read_back(
    postgresql_url: str,
    table_name: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    slow_polling: None,
) -> None:
    """A table migrated before revision 0003 has a ``queue_join`` that takes no key: a waiter
    takes its ticket without one (told once that the table is behind), and its grant, told
    unsigned, is read back from the table before it is believed, as before."""
    engine = sa.create_engine(resolve_url(postgresql_url))
    upgrade(engine, table_name, "0002")
    holder = Locker(postgresql_url, table=table_name, auto_create=False)
    waiter = Locker(postgresql_url, table=table_name, auto_create=False)
    read_back = no_read_back(waiter, monkeypatch)
    try:
        done = hand_off(holder, waiter, engine, table_name)
        lock = done.lock
        assert read_back == [lock.lock_id]
        assert "behind revision 0003" in caplog.text
        info = waiter.lock_info("report")
        assert info is not None
        assert (info.lock_id, info.expires) == (lock.lock_id, lock.expires)
        assert lock._state.valid_until <= done.released + 20 - safety_margin(20)
        lock.unlock()
        assert current_revision(engine, table_name) == "0002"
    finally:
        holder.close()
        waiter.close()
        downgrade(engine, table_name)
        engine.dispose()


@pytest.mark.parametrize("deadline", ["after the next attempt", "before the next attempt"])
def test_a_row_handed_to_a_ticket_whose_session_ended_is_taken_or_given_back(
    migrated_postgres: str,
    table_name: str,
    admin: sa.Engine,
    monkeypatch: pytest.MonkeyPatch,
    deadline: str,
) -> None:
    """A release hands the row to a waiter's ticket, unheard (no NOTIFY), and the waiter's
    listener session then ends: its ticket is dead, the row under its guid. The waiter gives
    the dead ticket up and takes a new one; its next attempt finds the row its own and takes
    it. Its wait over before that attempt (a slow give-up), the row goes back as the wait
    ends: it stood, held by nobody, until it expired."""
    from sqllocker import ticket_wait
    from sqllocker.errors import DatabaseError

    holder, waiter, other = (Locker(migrated_postgres, table=table_name) for _ in range(3))
    held = holder.lock("job", expires=120)
    waiter.lock("warm").unlock()  # its listener up
    slow = deadline == "before the next attempt"
    outage = threading.Event()
    tried = waiter._acquirer.attempts.try_acquire

    def try_acquire(*args: Any, **kwargs: Any) -> Any:
        if outage.is_set():  # its attempts fail until the listener has its new key
            raise DatabaseError("an outage", "job", outage=True)
        return tried(*args, **kwargs)

    given_up = ticket_wait.TicketWait._give_up

    def give_up(self: Any, ticket: Any, guid: str, give_back: bool, wake_next: bool = True) -> None:
        if slow and not give_back and not wake_next:  # the dead ticket's
            time.sleep(3)
        given_up(self, ticket, guid, give_back, wake_next)

    monkeypatch.setattr(waiter._acquirer.attempts, "try_acquire", try_acquire)
    monkeypatch.setattr(ticket_wait.TicketWait, "_give_up", give_up)
    outcome = wait_in_thread(waiter, "job", wait=4.0 if slow else 30.0)
    try:
        in_line(admin, table_name)
        assert waiter._tickets.listener is not None
        key = waiter._tickets.listener.liveness_key
        outage.set()
        with admin.begin() as conn:  # the holder's release, its NOTIFY never sent
            conn.exec_driver_sql("SET LOCAL sqllocker.notify_queue_limit = '0'")
            conn.exec_driver_sql(f"DELETE FROM {table_name} WHERE id = {held.lock_id}")
        held._state.held = False
        assert row_guid(admin, table_name, "job") is not None  # handed to the waiter's ticket
        end_listener_session(admin, waiter)
        listener = waiter._tickets.listener
        wait_until(lambda: listener.liveness_key not in (None, key))
        outage.clear()
        thread, result = outcome
        thread.join(30)
        if slow:
            assert isinstance(result.get("error"), LockBusy), result
            second = other.lock("job")  # the row went back as the wait ended
            second.unlock()
        else:
            won = result["lock"]
            assert row_guid(admin, table_name, "job") == won._state.guid
            with pytest.raises(LockBusy):
                other.lock("job")
            won.unlock()
    finally:
        for locker in (holder, waiter, other):
            locker.close()
