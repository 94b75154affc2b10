"""The lock lifecycle on every backend, starting with DBIx::Locker's own t/basic.t, ported."""

from __future__ import annotations

import gc
import json
import os
import sqlite3
import subprocess
import sys
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import sqlalchemy as sa

from sqllocker import Lock, LockBusy, Locker, LockLost, lock_table
from sqllocker.acquiring import Winnings
from sqllocker.engine import resolve_url
from sqllocker.identity import HolderDetails, holder_details
from tests.helpers import (
    READ_BACK,
    Proxied,
    abandon,
    break_and_take_when_stalled,
    collector_paused,
    count_rows,
    wait_until,
)
from tests.stall_proxy import StallProxy

# -- DBIx::Locker t/basic.t ---------------------------------------------------------------------


def test_lock_returns_a_lock_with_lockstring_numeric_id_and_future_expiry(locker: Locker) -> None:
    lock = locker.lock("Zombie Soup", expires=60)
    assert isinstance(lock, Lock)
    assert lock.lockstring == "Zombie Soup"
    assert isinstance(lock.lock_id, int)
    assert lock.lock_id > 0
    assert lock.expires > lock.created
    assert timedelta(seconds=59) < lock.expires - lock.created < timedelta(seconds=61)
    lock.unlock()


def test_second_lock_on_the_same_string_is_refused(locker: Locker) -> None:
    with locker.lock("Zombie Soup"), pytest.raises(LockBusy):
        locker.lock("Zombie Soup")


def test_unlock_flips_is_locked_and_a_second_unlock_is_a_no_op(locker: Locker) -> None:
    lock = locker.lock("Zombie Soup")
    assert lock.is_locked
    lock.unlock()
    assert not lock.is_locked
    lock.unlock()
    assert count_rows(locker) == 0


def test_a_row_found_under_our_own_guid_is_renewed_before_it_counts(locker: Locker) -> None:
    # An attempt that finds its own row (an earlier attempt's INSERT whose answer was lost, or
    # a release that handed the row over) renews it first: the row's expiry and the lock's
    # validity then both count from this attempt, never from a moment the holder cannot know.
    first = locker.lock("Zombie Soup", expires=30)
    time.sleep(1.5)
    again = locker._acquirer.attempts.try_acquire(
        Winnings(), first.lockstring, first.guid, first.locked_by, 30.0, None
    )
    assert isinstance(again, Lock)
    assert again.lock_id == first.lock_id
    assert again.expires - first.expires > timedelta(seconds=1)  # renewed on the server
    assert again._state.valid_until - first._state.valid_until > 1.0
    [row] = locker.locks()
    assert row.expires == again.expires
    again._finalizer.detach()
    first.unlock()


def test_an_unlock_interrupted_after_its_delete_leaves_the_lock_invalid(
    locker: Locker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KeyboardInterrupt between the release's DELETE and its bookkeeping: the row is gone
    and anyone may take the lockstring, so the handle must not stay valid. unlock() again
    finds the row gone (LockLost); it never deletes the next holder's."""
    lock = locker.lock("job")
    release = locker._operations.release

    def deleted_then_interrupted(*args: object) -> None:
        release(*args)  # type: ignore[arg-type]
        raise KeyboardInterrupt

    monkeypatch.setattr(locker._operations, "release", deleted_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        lock.unlock()
    monkeypatch.undo()
    assert not lock.is_valid()
    other = locker.lock("job")
    with pytest.raises(LockLost):
        lock.unlock()
    assert other.is_valid()
    other.unlock()


def test_relocking_after_unlock_gives_a_new_guid_and_a_higher_id(locker: Locker) -> None:
    first = locker.lock("Zombie Soup")
    first.unlock()
    second = locker.lock("Zombie Soup")
    assert second.guid != first.guid
    assert second.lock_id > first.lock_id
    second.unlock()


def test_two_strings_at_once_get_distinct_ids(locker: Locker) -> None:
    with locker.lock("Zombie Soup") as soup, locker.lock("Zombie Cola") as cola:
        assert soup.lock_id != cola.lock_id


def test_extend_updates_the_object_and_the_row(locker: Locker) -> None:
    with locker.lock("Zombie Soup", expires=10) as lock:
        before = lock.expires
        new_expires = lock.extend(600)
        assert new_expires == lock.expires
        assert new_expires > before + timedelta(seconds=500)
        (row,) = locker.locks()
        assert row.expires == lock.expires


def test_a_lock_nobody_keeps_is_released_at_once(locker: Locker) -> None:
    # DBIx::Locker dies when lock() is called in void context; in Python the unkept Lock is
    # garbage-collected, and its finaliser releases the row.
    locker.lock("Zombie Soup")
    gc.collect()
    assert count_rows(locker) == 0
    locker.lock("Zombie Soup", wait=0).unlock()


def test_a_dropped_lock_in_a_reference_cycle_is_released_by_the_collector(locker: Locker) -> None:
    # Reference counting never frees a lock that refers to itself; only the cycle collector
    # does, and it calls back only through weak references that something else keeps alive.
    # The release runs on a thread of sqllocker's own (see the next test).
    lock = locker.lock("Zombie Soup")
    lock.itself = lock  # type: ignore[attr-defined]
    with collector_paused():
        del lock
        assert count_rows(locker) == 1
        gc.collect()
        wait_until(lambda: count_rows(locker) == 0)


@pytest.mark.parametrize("callbacks", ["kept", "cleared"])
def test_a_lock_the_collector_frees_inside_an_operation_is_released_after_it(
    locker: Locker, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest, callbacks: str
) -> None:
    """The cycle collector runs at any allocation, sqllocker's own code included: here while
    an acquire sets up its connection again (as after a lost one) with the set-up lock held.
    A dropped lock it frees is released once that is done, not in its middle, where its
    release waited for the set-up lock for ever (seen in the fault campaign). sqllocker learns
    that the collector runs from ``gc.callbacks``, which another library may have cleared
    since it was imported."""
    import sqllocker.operations.database as database

    if callbacks == "cleared":
        kept = list(gc.callbacks)
        gc.callbacks.clear()  # before the lock is made, as at another library's import
        request.addfinalizer(lambda: gc.callbacks.extend(c for c in kept if c not in gc.callbacks))
    dropped = locker.lock("dropped")
    dropped.itself = dropped  # type: ignore[attr-defined]  # only the collector frees it
    set_up = database.set_up

    def set_up_collecting(*args: object, **options: object) -> object:
        gc.collect()
        return set_up(*args, **options)  # type: ignore[arg-type]

    with collector_paused():
        del dropped
        monkeypatch.setattr(database, "set_up", set_up_collecting)
        locker._operations.database.needs_setup = True
        other = threading.Thread(target=lambda: locker.lock("other").unlock(), daemon=True)
        other.start()
        other.join(30)
        assert not other.is_alive(), "the acquire never ended"
    wait_until(lambda: locker.lock_info("dropped") is None)


def _run_script(script: Path, url: str, table: str) -> subprocess.CompletedProcess[str]:
    """``python SCRIPT URL TABLE`` to its end: what it printed."""
    return subprocess.run(
        [sys.executable, str(script), url, table],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )


@pytest.mark.slow
def test_locks_the_collector_frees_just_before_exit_are_all_released(
    locker: Locker, url: str, tmp_path: Path
) -> None:
    """Releases the collector queued are run, or waited for, by the exit pass: none is left
    to expire, however many are queued (the thread that serves them may have taken one)."""
    script = tmp_path / "collects_then_ends.py"
    script.write_text(
        "import gc, sys\n"
        "from sqllocker import Locker\n"
        "locker = Locker(sys.argv[1], table=sys.argv[2], grace=0)\n"
        "gc.disable()\n"
        "for n in range(20):\n"
        "    lock = locker.lock(f'dropped {n}', expires=3600)\n"
        "    lock.itself = lock\n"
        "del lock\n"
        "print('holding', len(locker.locks()), flush=True)\n"
        "gc.collect()\n"
    )
    for _run in range(3):
        finished = _run_script(script, url, locker.table_name)
        assert finished.stdout.splitlines()[0] == "holding 20"
        assert count_rows(locker) == 0


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["postgresql", "mysql"])
def test_a_release_stuck_on_one_server_holds_up_no_other_the_collector_freed(
    locker: Locker, proxied: Proxied
) -> None:
    """Each release of a lock the collector freed runs on a thread of its own: one whose
    server has gone silent (here behind a stalled proxy) keeps the next, on another
    server's connection, waiting for nothing."""
    silent = Locker(proxied.url, table=locker.table_name, grace=0)
    try:
        with collector_paused():
            stuck = silent.lock("on the silent server", expires=20)
            stuck.itself = stuck  # type: ignore[attr-defined]
            del stuck
            proxied.proxy.stall()
            gc.collect()  # its release now waits on the stalled connection
            time.sleep(0.5)
            dropped = locker.lock("on the healthy one", expires=20)
            dropped.itself = dropped  # type: ignore[attr-defined]
            del dropped
            gc.collect()
            started = time.monotonic()
            wait_until(lambda: locker.lock_info("on the healthy one") is None, 10)
            assert time.monotonic() - started < 10
    finally:
        proxied.proxy.resume()
        silent.close()


@pytest.mark.slow
def test_a_lock_still_held_when_the_interpreter_exits_is_released(
    locker: Locker, url: str, tmp_path: Path
) -> None:
    # A script that ends without unlocking gives its rows back, newest first, rather than
    # leaving them to expire; a lock unlocked before the exit is not released a second time.
    # An exit hook registered before sqllocker's import runs after sqllocker's: by then the
    # rows must be gone, before module teardown (which frees what is left with half the
    # interpreter gone).
    script = tmp_path / "ends_holding.py"
    script.write_text(
        "import atexit, logging, sys\n"
        "atexit.register(lambda: print('after the exit pass', len(locker.locks()), flush=True))\n"
        "from sqllocker import Locker\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stdout, format='%(message)s')\n"
        "locker = Locker(sys.argv[1], table=sys.argv[2], grace=0)\n"
        "kept = [locker.lock(f'left {n}', expires=3600) for n in range(3)]\n"
        "locker.lock('unlocked', expires=3600).unlock()\n"
        "print('holding', len(locker.locks()), flush=True)\n"
    )
    finished = _run_script(script, url, locker.table_name)
    lines = finished.stdout.splitlines()
    assert lines[0] == "holding 3"
    released = [line for line in lines if "released by garbage collection" in line]
    assert [line.split("'")[1] for line in released] == ["left 2", "left 1", "left 0"]
    assert "already gone" not in finished.stdout
    assert lines[-1] == "after the exit pass 0"
    assert count_rows(locker) == 0


# -- the rest of the contract ---------------------------------------------------------------------


def test_with_block_releases_on_exit_and_when_the_body_raises(locker: Locker) -> None:
    with locker.lock("job") as lock:
        assert lock.is_locked
    assert not lock.is_locked
    assert count_rows(locker) == 0
    with pytest.raises(ZeroDivisionError), locker.lock("job"):
        1 / 0
    assert count_rows(locker) == 0


def test_try_lock_returns_none_instead_of_raising(locker: Locker) -> None:
    with locker.lock("job"):
        assert locker.try_lock("job") is None
    lock = locker.try_lock("job")
    assert lock is not None
    lock.unlock()


def test_busy_error_names_the_holder(locker: Locker) -> None:
    with (
        locker.lock("digest 42", locked_by={"job": "digest"}) as held,
        pytest.raises(LockBusy) as caught,
    ):
        locker.lock("digest 42")
    busy = caught.value
    assert busy.lockstring == "digest 42"
    assert busy.lock_id == held.lock_id
    assert busy.holder is not None
    assert busy.holder["job"] == "digest"
    assert busy.pid == held.locked_by["pid"]
    assert busy.host == held.locked_by["host"]
    assert busy.created == held.created
    assert busy.expires == held.expires
    message = str(busy)
    assert "digest 42" in message
    assert f"{busy.host}:{busy.pid}" in message
    assert "sqllocker release" in message


def test_locked_by_has_the_standard_keys_and_the_callers(locker: Locker) -> None:
    with locker.lock("job", locked_by={"job": "report", "n": [1, 2]}) as lock:
        (row,) = locker.locks()
    for key in ("host", "pid", "thread", "program", "user"):
        assert key in row.locked_by
    assert row.locked_by["thread"] == threading.current_thread().name
    assert row.locked_by["job"] == "report"
    assert row.locked_by["n"] == [1, 2]
    assert row.locked_by == lock.locked_by


# Thread and task names that JSON must escape: quotes, backslashes, control and non-ASCII.
AWKWARD_NAMES = ["plain", 'a "quoted" \\ name', "tab\there\x01", "naïve ☃ 𝄞"]


@pytest.mark.parametrize("task", [None, 'task "7" ☃'])
def test_a_holders_json_text_is_what_json_dumps_writes(task: str | None) -> None:
    """Without keys of the caller's own, locked_by's JSON text is written without json.dumps
    (see identity.HolderDetails): it must be the very text json.dumps writes."""
    for name in AWKWARD_NAMES:
        details: dict[str, object] = {}
        thread = threading.Thread(
            target=lambda: details.update(holder=holder_details({}, task)), name=name
        )
        thread.start()
        thread.join()
        holder = details["holder"]
        assert isinstance(holder, HolderDetails)
        assert holder.json == json.dumps(dict(holder))
        assert holder["thread"] == name
    assert holder_details({"job": "report"}, task).json is None  # the engine's serialiser


@pytest.mark.parametrize("encoding", ["UTF-8", "UTF-16le", "UTF-16be"])
def test_an_sqlite_database_in_any_encoding_lists_its_lockstrings_as_they_are(
    tmp_path: Path, encoding: str
) -> None:
    """The listings read a lockstring as its bytes on SQLite, where a Perl job may have written
    bytes that are no UTF-8; in a database made in UTF-16 those bytes are UTF-16, and read as
    UTF-8 they were garbage (and an election's leader, found by its rows' names, nobody)."""
    path = tmp_path / "locks.db"
    made = sqlite3.connect(path)
    made.execute(f"PRAGMA encoding = '{encoding}'")
    made.execute("CREATE TABLE made_by_someone_else (x)")
    made.commit()
    made.close()
    locker = Locker(f"sqlite:///{path}")
    try:
        names = ["job-1", "naïve ☃ 𝄞", "back\\slash"]
        held = [locker.lock(name) for name in names]
        assert [info.lockstring for info in locker.locks()] == sorted(names)
        assert locker.lock_info("naïve ☃ 𝄞").lockstring == "naïve ☃ 𝄞"  # type: ignore[union-attr]
        with locker.election("el").campaign(wait=5) as leadership:
            leader = locker.election("el").leader()
            assert leader is not None
            assert leader.term == leadership.term
        for lock in held:
            lock.unlock()
    finally:
        locker.close()


def test_an_acquire_sends_the_holders_own_json_text_and_serialises_only_the_callers_keys(
    url: str, table_name: str, locker: Locker
) -> None:
    """The acquire's statement sends a holder's JSON text as it is, without the engine's
    serialiser (``execution._sending_holder_json``): encoding the dict on every acquire was the
    largest single cost of the library's own Python in a lock cycle. With keys of the
    caller's own, the engine's serialiser writes it."""
    serialised: list[object] = []

    def serialiser(value: object) -> str:
        serialised.append(value)
        return json.dumps(value)

    engine = sa.create_engine(url, json_serializer=serialiser)
    mine = Locker(engine, table=table_name)
    try:
        with mine.lock("plain") as lock:
            assert lock.locked_by["pid"] == os.getpid()
        assert serialised == []
        with mine.lock("own keys", locked_by={"job": "report"}) as lock:
            assert mine.lock_info("own keys").locked_by["job"] == "report"  # type: ignore[union-attr]
        assert len(serialised) == 1
    finally:
        mine.close()
        engine.dispose()


def test_locked_by_reads_back_as_the_handle_has_it_whatever_the_threads_name(
    locker: Locker,
) -> None:
    for name in AWKWARD_NAMES:
        seen: dict[str, object] = {}

        def take() -> None:
            with locker.lock("job") as lock:
                (row,) = locker.locks()
                seen.update(row=row.locked_by, handle=lock.locked_by)

        thread = threading.Thread(target=take, name=name)
        thread.start()
        thread.join()
        assert seen["row"] == seen["handle"]
        assert isinstance(seen["row"], dict)
        assert seen["row"]["thread"] == name


def test_timestamps_are_aware_utc(locker: Locker) -> None:
    with locker.lock("job", expires=30) as lock:
        for value in (lock.created, lock.expires):
            assert value.tzinfo is not None
            assert value.utcoffset() == timedelta(0)
        # The server clock and this machine's agree here (same host); within a minute is enough.
        assert abs(lock.created - datetime.now(timezone.utc)) < timedelta(minutes=1)


def test_a_locks_times_are_its_rows_as_read_back(locker: Locker) -> None:
    """The acquire hands its times over as the driver read them (SQLite's text), and the Lock
    reads them into datetimes when asked: they must be the very instants the row holds, before
    and after an extend, for the SQL and the Python views of a lock to agree."""
    with locker.lock("job", expires=30) as lock:
        row = locker.lock_info("job")
        assert row is not None
        assert (lock.created, lock.expires) == (row.created, row.expires)
        assert lock.created.tzinfo is timezone.utc
        assert lock.expires.tzinfo is timezone.utc
        extended = lock.extend(60)
        row = locker.lock_info("job")
        assert row is not None
        assert lock.expires == extended == row.expires
        assert lock.created == row.created


def test_each_acquisition_has_its_own_secret(locker: Locker) -> None:
    """The guid proves a row ours in every later statement: 128 random bits, never repeated."""
    guids = set()
    for _ in range(50):
        with locker.lock("job") as lock:
            assert len(lock.guid) == 32
            int(lock.guid, 16)
            guids.add(lock.guid)
    assert len(guids) == 50


def test_wait_acquires_once_the_holder_releases(locker: Locker) -> None:
    held = locker.lock("job")
    threading.Timer(0.3, held.unlock).start()
    started = time.monotonic()
    with locker.lock("job", wait=10):
        assert time.monotonic() - started >= 0.25


def test_wait_none_waits_until_released(locker: Locker) -> None:
    held = locker.lock("job")
    threading.Timer(0.3, held.unlock).start()
    with locker.lock("job", wait=None) as lock:
        assert lock.is_locked


def test_wait_gives_up_after_the_given_time(locker: Locker) -> None:
    with locker.lock("job"):
        started = time.monotonic()
        with pytest.raises(LockBusy) as caught:
            locker.lock("job", wait=0.3)
        elapsed = time.monotonic() - started
    assert caught.value.waited == 0.3
    assert "waiting" in str(caught.value)
    assert 0.25 <= elapsed < 5


def test_a_wait_that_runs_out_at_once_still_names_the_holder(locker: Locker) -> None:
    # Where waiters take tickets, a waiter's first attempt does not ask who holds the row (it
    # takes a ticket, and asks when it next tries); if its time is up by then, the error must
    # still say.
    with locker.lock("job") as held, pytest.raises(LockBusy) as caught:
        locker.lock("job", wait=1e-9)
    assert caught.value.lock_id == held.lock_id
    assert caught.value.holder is not None
    assert caught.value.holder["pid"] == os.getpid()
    assert "unknown holder" not in str(caught.value)


def test_a_wait_that_runs_out_at_once_still_takes_over_an_expired_row(locker: Locker) -> None:
    stale = locker.lock("job", expires=0.2)
    time.sleep(0.4)
    fresh = locker.lock("job", wait=1e-9)
    assert fresh.lock_id > stale.lock_id
    assert count_rows(locker) == 1
    fresh.unlock()


def test_expired_row_is_taken_over_at_acquire_time_with_a_higher_id(locker: Locker) -> None:
    stale = locker.lock("job", expires=0.2)
    time.sleep(0.4)
    fresh = locker.lock("job")
    assert fresh.lock_id > stale.lock_id
    assert count_rows(locker) == 1
    fresh.unlock()


def test_takeover_waits_for_the_grace_period(make_locker: object) -> None:
    locker = make_locker(grace=1.0)  # type: ignore[operator]
    stale = locker.lock("job", expires=0.2)
    time.sleep(0.4)
    with pytest.raises(LockBusy):
        locker.lock("job")  # expired, but not for `grace` seconds yet
    fresh = locker.lock("job", wait=5)
    assert fresh.lock_id > stale.lock_id
    fresh.unlock()


def test_waiter_takes_over_an_expired_row_without_a_purge(locker: Locker) -> None:
    abandon(locker.lock("job", expires=0.5))  # a holder that died holding it
    started = time.monotonic()
    with locker.lock("job", wait=10):
        assert 0.3 <= time.monotonic() - started < 5


def test_stale_holder_cannot_unlock_the_new_holders_row(locker: Locker) -> None:
    stale = locker.lock("job", expires=0.2)
    time.sleep(0.4)
    fresh = locker.lock("job")
    with pytest.raises(LockLost) as caught:
        stale.unlock()
    assert caught.value.lockstring == "job"
    assert caught.value.lock_id == stale.lock_id
    assert not stale.is_locked
    (row,) = locker.locks()
    assert row.lock_id == fresh.lock_id
    fresh.unlock()


def test_stale_holder_cannot_extend_the_new_holders_row(locker: Locker) -> None:
    stale = locker.lock("job", expires=0.2)
    time.sleep(0.4)
    fresh = locker.lock("job", expires=60)
    with pytest.raises(LockLost):
        stale.extend(3600)
    (row,) = locker.locks()
    assert row.expires == fresh.expires
    fresh.unlock()


def test_extend_never_revives_an_expired_lock(locker: Locker) -> None:
    lock = locker.lock("job", expires=0.2)
    time.sleep(0.4)
    (before,) = locker.locks()
    assert before.expired
    with pytest.raises(LockLost):
        lock.extend(60)
    assert not lock.is_locked
    (after,) = locker.locks()
    assert after.expires == before.expires


def test_stale_holder_after_purge_and_reacquire_cannot_release(locker: Locker) -> None:
    # DBIx::Locker's bug: delete-by-id plus SQLite rowid reuse deleted the next holder's lock.
    stale = locker.lock("job", expires=0.2)
    time.sleep(0.4)
    assert locker.purge_expired_locks() == 1
    fresh = locker.lock("job")
    assert fresh.lock_id != stale.lock_id
    with pytest.raises(LockLost):
        stale.unlock()
    assert [row.lock_id for row in locker.locks()] == [fresh.lock_id]
    fresh.unlock()


def test_ids_are_never_reused_after_the_highest_row_is_deleted(locker: Locker) -> None:
    seen = []
    for _ in range(5):
        lock = locker.lock("job")
        seen.append(lock.lock_id)
        lock.unlock()  # the highest row is deleted each time
    assert seen == sorted(set(seen))


def test_purge_deletes_exactly_the_expired_rows(locker: Locker) -> None:
    live = [locker.lock(f"live {n}", expires=600) for n in range(5)]
    dead = [locker.lock(f"dead {n}", expires=0.2) for n in range(7)]
    for lock in dead:
        abandon(lock)
    time.sleep(0.4)
    assert locker.purge_expired_locks(batch_size=3) == 7
    assert sorted(row.lock_id for row in locker.locks()) == sorted(lock.lock_id for lock in live)
    assert locker.purge_expired_locks() == 0
    for lock in live:
        lock.unlock()


def test_locks_lists_rows_with_their_expired_flag(locker: Locker) -> None:
    live = locker.lock("b live", expires=600)
    dead = locker.lock("a dead", expires=0.2)
    time.sleep(0.4)
    rows = locker.locks()
    assert [(row.lockstring, row.expired) for row in rows] == [("a dead", True), ("b live", False)]
    assert rows[1].lock_id == live.lock_id
    live.unlock()
    with pytest.raises(LockLost):
        dead.extend()


def test_body_exception_survives_a_failing_release(locker: Locker) -> None:
    lock = locker.lock("job", expires=0.2)
    time.sleep(0.4)
    locker.lock("job").unlock()  # take over and release: our row is gone
    with pytest.raises(LockLost) as caught, lock:
        raise KeyError("the body's own error")
    assert isinstance(caught.value.__cause__, KeyError)


def test_lock_is_visible_at_once_and_survives_the_callers_rollback(
    url: str, table_name: str, make_locker: object
) -> None:
    import sqlalchemy as sa

    from sqllocker.engine import resolve_url

    engine = sa.create_engine(resolve_url(url))
    locker = Locker(engine, table=table_name, grace=0)
    other = make_locker()  # type: ignore[operator]
    with engine.connect() as conn:
        transaction = conn.begin()
        conn.execute(sa.select(1))
        lock = locker.lock("job")
        assert other.try_lock("job") is None  # visible to others at once
        transaction.rollback()
    assert other.try_lock("job") is None  # survived the caller's rollback
    lock.unlock()
    engine.dispose()


# -- MySQL, which has no INSERT ... RETURNING ------------------------------------------------------


def test_without_returning_the_acquire_reads_its_row_back(mysql_url: str, table_name: str) -> None:
    """MySQL has no INSERT ... RETURNING (MariaDB has): the acquire's id is the driver's
    lastrowid and its times are read back by id and guid. MariaDB stands in for MySQL here, its
    dialect told after connecting (which is when it learns the server's version) that it has
    none."""
    engine = sa.create_engine(resolve_url(mysql_url))
    with engine.connect():
        pass
    engine.dialect.insert_returning = False
    lock_table(table_name).create(engine)
    locker = Locker(engine, table=table_name, grace=0)
    try:
        first = locker.lock("no returning", expires=0.3)
        assert not locker._operations.backend.insert_returning
        row = locker.lock_info("no returning")
        assert row is not None
        assert row.lock_id == first.lock_id
        assert first.created < first.expires
        with pytest.raises(LockBusy):
            locker.lock("no returning")
        time.sleep(0.5)  # expired: the next acquire deletes the row and inserts its own
        second = locker.lock("no returning")
        assert second.lock_id > first.lock_id
        assert locker.lock_info("no returning").lock_id == second.lock_id  # type: ignore[union-attr]
        second.unlock()
        assert count_rows(locker) == 0
    finally:
        locker.close()
        engine.dispose()


def test_without_returning_an_acquire_whose_row_is_gone_when_read_back_is_refused(
    mysql_url: str, table_name: str
) -> None:
    """Without RETURNING the acquire reads its row's times back after the INSERT, in a statement
    of its own: the row may have been broken, and the lockstring taken by another, in between.
    The table says who holds it then: the acquire is refused (a LockBusy naming the other), not
    an error of its own, nor a lock nobody holds. A proxy holds the read back meanwhile."""
    url = sa.make_url(resolve_url(mysql_url))
    proxy = StallProxy(url.port or 3306)
    engine = sa.create_engine(url.set(port=proxy.port))
    with engine.connect():
        pass
    engine.dialect.insert_returning = False
    lock_table(table_name).create(engine)
    locker = Locker(engine, table=table_name)
    other = Locker(mysql_url, table=table_name)
    thief, taken = break_and_take_when_stalled(proxy, other, "gone")
    try:
        locker.lock_info("gone")  # set up before the proxy waits for the read-back
        proxy.stall_before(f"SELECT {table_name}.created, {table_name}.expires".encode())
        thief.start()
        with pytest.raises(LockBusy) as refused:
            locker.lock("gone")
        thief.join(30)
        assert len(taken) == 1, "the new row was not there to break while its read-back waited"
        assert refused.value.lock_id == taken[0].lock_id
        taken[0].unlock()
    finally:
        proxy.close()
        locker.close()
        other.close()
        engine.dispose()


@pytest.mark.parametrize("group", [False, True], ids=["one lock", "lock_all"])
def test_contention_met_by_a_read_back_is_tried_again_not_a_refusal(
    mysql_url: str, table_name: str, group: bool
) -> None:
    """Where the table has the last word on an acquire (a Galera node), the rows are read back
    after their commit. Contention the server reports on that read (a deadlock, here answered
    by a proxy in the server's stead) is tried again, as on any statement: the rows are ours,
    and the acquire finds them so. Taken for a refusal, a group would leave its committed rows
    held, by nobody, until they expired."""
    url = sa.make_url(resolve_url(mysql_url))
    proxy = StallProxy(url.port or 3306)
    locker = Locker(url.set(port=proxy.port), table=table_name, auto_create=True)
    names = ["read back a", "read back b"][: 2 if group else 1]
    try:
        locker.lock_info(names[0])  # set up, then read back as on a Galera node that retries
        locker._operations.database.inserts_replayed = True
        locker._operations.database.lone_inserts_retried = True
        proxy.answer_with_mysql_error(READ_BACK, 1213)
        held = locker.lock_all(names) if group else [locker.lock(names[0])]
        assert proxy.errors_answered == 1
        assert [locker.lock_info(name).lock_id for name in names] == [  # type: ignore[union-attr]
            lock.lock_id for lock in held
        ]
        for lock in held:
            lock.unlock()
        assert count_rows(locker) == 0
    finally:
        proxy.close()
        locker.close()


def test_a_server_without_galera_variables_still_connects(mysql_url: str, table_name: str) -> None:
    """sqllocker's connections turn a Galera node's own retries of aborted statements off
    (``wsrep_retry_autocommit``); a server that does not know the variable (MySQL, a MariaDB
    built without Galera) answers that it does not, here in a proxy's voice, and the
    connection is used as it is."""
    url = sa.make_url(resolve_url(mysql_url))
    proxy = StallProxy(url.port or 3306)
    proxy.answer_with_mysql_error(b"SET SESSION wsrep_retry_autocommit", 1193)
    locker = Locker(url.set(port=proxy.port), table=table_name, auto_create=True)
    try:
        locker.lock("job").unlock()
        assert proxy.errors_answered == 1
        assert count_rows(locker) == 0
    finally:
        proxy.close()
        locker.close()


def test_leaving_a_with_block_after_an_explicit_unlock_is_quiet(locker: Locker) -> None:
    with locker.lock("job") as lock:
        lock.unlock()
        with lock:  # a nested block on the same, already released, lock
            pass
    assert not lock.is_locked
    assert count_rows(locker) == 0


def test_no_guid_is_shown_to_anyone_but_the_holder(locker: Locker) -> None:
    lock = locker.lock("job", locked_by={"job": "nightly"})
    assert "guid" not in lock.locked_by
    info = locker.lock_info("job")
    assert info is not None
    assert "guid" not in info.locked_by
    assert not hasattr(info, "guid")
    with pytest.raises(LockBusy) as busy:
        locker.lock("job")
    assert busy.value.holder is not None
    assert "guid" not in busy.value.holder
    assert lock.guid not in str(busy.value)
    with locker.engine.connect() as conn:  # the row keeps it, in its own column
        stored = conn.execute(sa.select(locker.table.c.guid, locker.table.c.locked_by)).one()
    assert stored.guid == lock.guid
    assert "guid" not in stored.locked_by
    lock.unlock()


def test_a_guid_left_in_locked_by_by_an_older_version_is_not_shown(locker: Locker) -> None:
    lock = locker.lock("job")
    with locker.engine.begin() as conn:
        conn.execute(
            sa.update(locker.table).values(locked_by={"host": "old", "pid": 1, "guid": lock.guid})
        )
    info = locker.lock_info("job")
    assert info is not None
    assert info.locked_by == {"host": "old", "pid": 1}
    with pytest.raises(LockBusy) as busy:
        locker.lock("job")
    assert busy.value.holder == {"host": "old", "pid": 1}
    lock.unlock()


# -- hold_at_least: scheduled jobs run once per window --------------------------------------------


def test_a_lock_held_at_least_keeps_its_row_for_the_window_after_unlock(locker: Locker) -> None:
    lock = locker.lock("report", expires=60, hold_at_least=1.5)
    lock.unlock()  # the job was quick
    assert not lock.is_locked
    info = locker.lock_info("report")
    assert info is not None
    assert info.lock_id == lock.lock_id
    assert (info.expires - info.created).total_seconds() == pytest.approx(1.5, abs=0.01)
    assert "finished" in info.locked_by
    with pytest.raises(LockBusy, match="finished at") as busy:
        locker.lock("report")
    assert "hold_at_least" in str(busy.value)
    time.sleep(1.6)
    again = locker.lock("report")  # the window is over: taken over, with a higher id
    assert again.lock_id > lock.lock_id
    again.unlock()
    assert locker.lock_info("report") is None  # no window of its own: deleted


def test_an_unlock_after_the_window_deletes_the_row(locker: Locker) -> None:
    lock = locker.lock("report", hold_at_least=0.3)
    time.sleep(0.5)
    lock.unlock()
    assert locker.lock_info("report") is None


def test_a_lost_lock_held_at_least_is_still_lost_at_unlock(locker: Locker) -> None:
    lock = locker.lock("report", hold_at_least=30)
    locker.break_lock("report")
    with pytest.raises(LockLost):
        lock.unlock()
    assert locker.lock_info("report") is None  # never revived
