"""Waiting for a held lock: PostgreSQL waiters wake on NOTIFY; the others back off and retry."""

from __future__ import annotations

import threading
import time
import types
from typing import Any

import pytest
import sqlalchemy as sa

from sqllocker import Locker
from sqllocker import backoff as backoff_module
from sqllocker.backoff import FIRST_DELAY, HEAD_FIRST_DELAY, HEAD_POLL_SHARE, MAX_DELAY, Backoff
from sqllocker.engine import resolve_url


@pytest.mark.parametrize("freed_by", ["release", "purge", "operator's DELETE"])
def test_postgres_waiter_wakes_on_notify(
    migrated_postgres: str, table_name: str, slow_polling: None, freed_by: str
) -> None:
    holder = Locker(migrated_postgres, table=table_name, grace=0)
    waiter = Locker(migrated_postgres, table=table_name, grace=0)
    held = holder.lock("job", expires=600 if freed_by != "purge" else 1)
    acquired: list[float] = []

    def wait() -> None:
        with waiter.lock("job", wait=60):
            acquired.append(time.monotonic())

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.5)  # the waiter has tried, been refused, and is sleeping
    assert acquired == []
    if freed_by == "release":
        held.unlock()
    elif freed_by == "purge":
        time.sleep(1.2)
        held._finalizer.detach()
        assert holder.purge_expired_locks() == 1
    else:
        with sa.create_engine(resolve_url(migrated_postgres)).begin() as conn:
            conn.execute(sa.text(f"DELETE FROM {table_name} WHERE lockstring = 'job'"))
    freed = time.monotonic()
    thread.join(20)
    assert acquired, "the waiter was not woken"
    assert acquired[0] - freed < 10  # far sooner than its 30 s poll: the notification woke it
    assert waiter._tickets.listener is not None
    assert waiter._tickets.listener.notifications >= 1
    holder.close()
    waiter.close()


def test_one_release_wakes_one_waiter_of_a_process(
    migrated_postgres: str, table_name: str, slow_polling: None
) -> None:
    holder = Locker(migrated_postgres, table=table_name, grace=0)
    waiter = Locker(migrated_postgres, table=table_name, grace=0)
    held = holder.lock("job")
    woke: list[str] = []
    release_next = threading.Event()

    def wait(name: str) -> None:
        with waiter.lock("job", wait=60):
            woke.append(name)
            release_next.wait(20)

    threads = [threading.Thread(target=wait, args=(f"waiter {n}",)) for n in range(3)]
    for thread in threads:
        thread.start()
    time.sleep(0.5)
    held.unlock()
    time.sleep(1.0)
    assert len(woke) == 1  # not a stampede: the others were not woken to be refused
    release_next.set()
    for thread in threads:
        thread.join(20)
    assert sorted(woke) == ["waiter 0", "waiter 1", "waiter 2"]  # each release woke the next
    holder.close()
    waiter.close()


@pytest.mark.parametrize("backend", ["sqlite", "mysql"])
def test_other_backends_wait_by_backing_off(make_locker: Any, backend: str) -> None:
    holder, waiter = make_locker(), make_locker()
    held = holder.lock("job")
    threading.Timer(0.3, held.unlock).start()
    with waiter.lock("job", wait=10) as lock:
        assert lock.is_locked
    assert waiter._tickets.release_listener() is None


def test_a_waiter_awaiting_a_hand_off_waits_the_longest_delay_but_not_past_a_takeover() -> None:
    """A head whose request stands polls only as a guard against a lost notification; it still
    wakes when the holder's row can be taken over."""
    backoff = Backoff.for_wait(None)
    assert backoff.next_delay() <= FIRST_DELAY
    backoff.await_hand_off()
    delays = [backoff.next_delay() for _ in range(50)]
    assert all(MAX_DELAY / 2 <= delay <= MAX_DELAY for delay in delays)
    soon = backoff.next_delay(until_takeable=0.01)
    assert soon <= 0.01 + FIRST_DELAY


def test_a_wait_without_limit_backs_off_at_the_longest_delay_however_long_it_lasts() -> None:
    """Over 192 s (1,025 attempts) of a waiter backing off, the doubling of its first delay
    overflowed a float and raised OverflowError out of its lock()."""
    backoff = Backoff.for_wait(None)
    delays = [backoff.next_delay() for _ in range(3000)]
    assert all(MAX_DELAY / 2 <= delay <= MAX_DELAY for delay in delays[-1000:])


def test_a_polling_head_polls_at_a_share_of_the_time_it_has_headed_the_queue(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Doubling its delay from 0.5 ms, a head could learn of a release 1 ms after it began
    heading up to 2.5 ms late (its second poll as early as 0.75 ms, its third as late as 3.5).
    Its delay follows the time it has headed the queue instead, however many polls it made."""
    now = [1000.0]
    clock = types.SimpleNamespace(monotonic=lambda: now[0], sleep=time.sleep)
    monkeypatch.setattr(backoff_module, "time", clock)
    backoff = Backoff.for_wait(None)
    backoff.heading()
    early = [backoff.next_delay() for _ in range(20)]
    assert all(HEAD_FIRST_DELAY / 2 <= delay <= HEAD_FIRST_DELAY for delay in early)
    now[0] += 0.1
    later = [backoff.next_delay() for _ in range(20)]
    assert all(0.1 * HEAD_POLL_SHARE / 2 <= delay <= 0.1 * HEAD_POLL_SHARE for delay in later)
    now[0] += 60
    assert all(MAX_DELAY / 2 <= backoff.next_delay() <= MAX_DELAY for _ in range(20))
