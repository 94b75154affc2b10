"""Read-write locks: readers together, one writer alone, writers not starved, tokens ordered."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sqllocker import Lock, LockBusy, Locker, LockError, LockLost, LockValueError
from sqllocker.asyncio import AsyncLocker
from tests import forked_cli
from tests.fleet import Fleet
from tests.helpers import (
    FRONTS,
    Front,
    Proxied,
    abandon,
    count_rows,
    stop_outside_a_write,
    wait_until,
)
from tests.workers import async_url


def test_readers_share_and_a_writer_excludes_everyone(locker: Locker) -> None:
    rw = locker.rwlock("catalog")
    readers = [rw.read(), rw.read(), rw.read()]
    assert len({reader.lockstring for reader in readers}) == 3
    assert all(reader.lockstring.startswith("catalog (reader ") for reader in readers)
    assert all(reader.locked_by["rwlock"] == "reader" for reader in readers)
    with pytest.raises(LockBusy, match="readers hold it"):
        rw.write()
    assert count_rows(locker) == 3  # the refused writer gave its row back
    for reader in readers:
        reader.unlock()
    writer = rw.write()
    assert writer.lockstring == "catalog"
    assert writer.locked_by["rwlock"] == "writer"
    assert writer.lock_id > max(reader.lock_id for reader in readers)
    with pytest.raises(LockBusy, match="a writer holds or waits"):
        rw.read()
    with pytest.raises(LockBusy):
        rw.write()
    assert [(info.lockstring, info.locked_by["rwlock"]) for info in rw.holders()] == [
        ("catalog", "writer")
    ]
    fence = [info for info in locker.locks() if info.lock_id == writer.lock_id]
    assert fence[0].lockstring.startswith("catalog (writer ")
    assert fence[0].locked_by["rwlock"] == "writer's fence"
    assert writer.claim.lock_id < writer.lock_id
    writer.unlock()
    assert rw.holders() == []


def test_a_plain_lock_of_the_name_and_a_writer_exclude_each_other(locker: Locker) -> None:
    rw = locker.rwlock("catalog")
    plain = locker.lock("catalog")
    with pytest.raises(LockBusy):
        rw.write()
    with pytest.raises(LockBusy):
        rw.read()  # a plain holder of the name counts as a writer
    plain.unlock()
    writer = rw.write()
    with pytest.raises(LockBusy):
        locker.lock("catalog")
    writer.unlock()


def test_a_waiting_writer_refuses_new_readers_and_readers_behind_it_enter_together(
    make_locker: Callable[..., Locker],
) -> None:
    locker = make_locker()
    rw = locker.rwlock("catalog")
    first = rw.read()
    got: dict[str, Lock] = {}
    writer_thread = threading.Thread(target=lambda: got.update(writer=rw.write(wait=30)))
    writer_thread.start()
    deadline = time.monotonic() + 10
    while not any(info.lockstring == "catalog" for info in rw.holders()):
        assert time.monotonic() < deadline, "the writer never put its row in"
        time.sleep(0.01)
    with pytest.raises(LockBusy):
        rw.read()  # the writer waits: a new reader is refused
    inside = threading.Barrier(4, timeout=20)  # three readers behind it, and this test
    readers: list[Lock] = []

    def reader() -> None:
        lock = make_locker().rwlock("catalog").read(wait=30)
        readers.append(lock)
        inside.wait()  # every reader holds at once

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for thread in threads:
        thread.start()
    time.sleep(0.3)
    assert readers == []  # behind the writer
    first.unlock()
    writer_thread.join(20)
    writer = got["writer"]
    assert writer.lock_id > first.lock_id
    time.sleep(0.3)
    assert readers == []  # still behind the writer, which holds
    writer.unlock()
    inside.wait()
    for thread in threads:
        thread.join(10)
    assert len(readers) == 3
    assert min(lock.lock_id for lock in readers) > writer.lock_id
    for lock in readers:
        lock.unlock()


def test_a_writer_is_not_starved_by_a_stream_of_overlapping_readers(
    make_locker: Callable[..., Locker],
) -> None:
    stop = threading.Event()
    errors: list[BaseException] = []

    def reader(offset: float) -> None:
        rw = make_locker().rwlock("catalog")
        time.sleep(offset)
        try:
            while not stop.is_set():
                lock = rw.read(wait=60)
                time.sleep(0.3)  # four readers, each holding 0.3 s, staggered: never none
                lock.unlock()
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=reader, args=(i * 0.08,)) for i in range(4)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(0.8)
        rw = make_locker().rwlock("catalog")
        assert len(rw.holders()) >= 1
        writer = rw.write(wait=20)  # a starved writer would give up after 20 s
        assert [info.lockstring for info in rw.holders()] == ["catalog"]
        writer.unlock()
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    assert errors == []


def test_a_crashed_reader_blocks_a_writer_only_until_it_expires(locker: Locker) -> None:
    rw = locker.rwlock("catalog")
    # Not less: a reader whose row would expire before it has looked for writers after taking
    # it gives it back, and a loaded machine took longer than a 0.5 s lock's 0.45 s of life.
    crashed = abandon(rw.read(expires=2))
    with pytest.raises(LockBusy):
        rw.write()
    writer = rw.write(wait=10)
    assert writer.lock_id > crashed.lock_id
    writer.unlock()


def test_a_crashed_writer_is_taken_over_by_a_writer_and_passed_by_readers(
    locker: Locker,
) -> None:
    rw = locker.rwlock("catalog")
    crashed = rw.write(expires=0.5)
    abandon(crashed.claim)
    abandon(crashed)
    with pytest.raises(LockBusy):
        rw.read()
    reader = rw.read(wait=10)  # once expired, its row refuses nobody
    reader.unlock()
    writer = rw.write(wait=10)  # and is taken over
    assert writer.lock_id > crashed.lock_id
    writer.unlock()


@pytest.mark.parametrize("side", ["read", "write"])
def test_a_sigkilled_holder_is_taken_over_after_it_expires(
    url: str, locker: Locker, table_name: str, side: str
) -> None:
    holder = forked_cli.Popen(  # a process of its own, forked from one that imported sqllocker
        [
            "-c",
            "import time; from sqllocker import Locker\n"
            f"lock = Locker({url!r}, table={table_name!r}).rwlock('catalog').{side}(expires=1)\n"
            "print(lock.lock_id, flush=True); time.sleep(60)",
        ],
        program="python",
    )
    assert holder.stdout is not None
    killed_id = int(holder.stdout.readline())
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    rw = locker.rwlock("catalog")
    with pytest.raises(LockBusy):
        rw.write()
    writer = rw.write(wait=10)
    assert writer.lock_id > killed_id
    writer.unlock()


@pytest.mark.slow
def test_a_kept_alive_reader_outlasts_its_expiry(locker: Locker) -> None:
    rw = locker.rwlock("catalog")
    reader = rw.read(expires=1, keep_alive=True)
    with pytest.raises(LockBusy, match="gave up after waiting"):
        rw.write(wait=2)
    assert reader.is_valid()
    assert count_rows(locker) == 1
    reader.unlock()


@pytest.mark.parametrize("name", ["", "x" * 129])
def test_bad_names_are_refused_before_any_sql(locker: Locker, name: str) -> None:
    with pytest.raises(LockValueError):
        locker.rwlock(name)
    assert count_rows(locker) == 0


def test_a_long_name_is_written_as_any_lockstring_but_read_only_if_the_suffix_fits(
    locker: Locker,
) -> None:
    longest = locker.rwlock("x" * 128)  # the writer's row is the name itself
    with pytest.raises(LockValueError, match="at most 102 characters"):
        longest.read()
    assert count_rows(locker) == 0
    longest.write().unlock()
    fits = locker.rwlock("x" * 102)
    fits.read().unlock()


def test_wildcards_in_the_name_count_only_its_own_readers(locker: Locker) -> None:
    star = locker.rwlock("a*")
    underscore = locker.rwlock("a_")
    reader = locker.rwlock("ab").read()
    star.write().unlock()
    underscore.write().unlock()
    reader.unlock()


def test_a_reader_whose_row_runs_out_before_it_is_confirmed_says_so(locker: Locker) -> None:
    """A reader whose own row is no longer valid once it has found no writer gives it back
    and is refused: for want of time, not for a writer, which the message must not claim."""
    rw = locker.rwlock("catalog")
    with pytest.raises(LockBusy, match="no writer holds it, but its reader's row") as refused:
        rw.read(expires=1e-6)
    assert "a writer holds" not in str(refused.value)
    assert count_rows(locker) == 0  # its row given back
    writer = rw.write()
    with pytest.raises(LockBusy, match="a writer holds or waits"):
        rw.read(expires=1e-6)
    writer.unlock()


async def test_async_readers_and_writers_meet_sync_ones(
    url: str, make_locker: Callable[..., Locker], table_name: str
) -> None:
    sync = make_locker().rwlock("catalog")
    alocker = AsyncLocker(async_url(url), table=table_name, grace=0)
    rw = alocker.rwlock("catalog")
    reader = await rw.read()
    other = sync.read()
    with pytest.raises(LockBusy):
        await rw.write()
    assert len(await rw.holders()) == 2
    await reader.unlock()
    other.unlock()
    async with await rw.write() as writer:
        assert writer.lock_id > other.lock_id
        with pytest.raises(LockBusy):
            sync.read()
    await alocker.aclose()


@pytest.mark.slow
@pytest.mark.parametrize("front_end", ["sync", "asyncio"])
def test_many_processes_readers_overlap_and_no_writer_overlaps_anyone(
    url: str, make_locker: Callable[..., Locker], table_name: str, tmp_path: Path, front_end: str
) -> None:
    make_locker()  # the table
    fleet = Fleet(
        "tests.rw_workers",
        [
            [
                f"--url={url}",
                f"--table={table_name}",
                f"--state={tmp_path}",
                "--seconds=6",
                *(["--asyncio"] if front_end == "asyncio" else []),
            ]
            for _ in range(8)
        ],
        tmp_path / "workers",
    )
    try:
        outcomes = fleet.wait(timeout=120)
    finally:
        fleet.kill()
    for outcome in outcomes:
        assert outcome.returncode == 0, outcome.err
    violations = tmp_path / "violations"
    assert not violations.exists(), violations.read_text()
    log = [json.loads(line) for line in (tmp_path / "log").read_text().splitlines()]
    kinds = {entry["kind"] for entry in log}
    assert kinds == {"reader", "writer"}
    assert int((tmp_path / "most_readers").read_text()) >= 2  # readers did share
    newest = 0
    for entry in log:
        if entry["kind"] == "writer":
            assert entry["id"] > newest, f"writer token {entry['id']} after token {newest}"
        newest = max(newest, entry["id"])
    assert len({entry["id"] for entry in log}) == len(log)


@pytest.mark.slow
def test_a_writer_stopped_past_its_expiry_while_it_waits_starts_again(
    url: str, locker: Locker, table_name: str
) -> None:
    rw = locker.rwlock("catalog")
    first = rw.read(keep_alive=True)
    writer = forked_cli.Popen(  # a process of its own, forked from one that imported sqllocker
        [
            "-c",
            "from sqllocker import Locker\n"
            f"locker = Locker({url!r}, table={table_name!r}, grace=0)\n"
            "lock = locker.rwlock('catalog').write(wait=60, expires=1)\n"
            "print(lock.lock_id, lock.is_valid(), flush=True); lock.unlock()",
        ],
        program="python",
    )
    try:
        deadline = time.monotonic() + 20
        while locker.lock_info("catalog") is None:
            assert time.monotonic() < deadline, "the writer never put its row in"
            time.sleep(0.02)
        stop_outside_a_write(writer.pid, url)
        second = rw.read(wait=10)  # once the stopped writer's row expired
        first.unlock()
        os.kill(writer.pid, signal.SIGCONT)
        time.sleep(1.5)
        assert writer.poll() is None  # it waits for the second reader, which holds
        second.unlock()
        out, _ = writer.communicate(timeout=30)
    finally:
        if writer.poll() is None:
            os.kill(writer.pid, signal.SIGCONT)
            writer.kill()
            writer.wait()
    token, valid = out.split()
    assert valid == "True"
    assert int(token) > second.lock_id


@pytest.mark.parametrize("backend", ["postgresql", "mysql"])
@pytest.mark.parametrize("kind", ["writer", "leader"])
def test_a_writer_held_up_before_its_token_is_refused_not_handed_a_higher_one(
    make_locker: Callable[..., Locker], table_name: str, proxied: Proxied, kind: str
) -> None:
    """A writer (or a candidate) whose claim was valid when it sent its token row's INSERT, held
    up in the network past the claim's expiry: another writer takes the claim over and draws
    its token, and then the first INSERT lands, with a higher id. A resource fenced by the
    token would take the stale writer's writes and refuse the valid one's: the stale writer
    must be refused, its rows given back."""
    other = make_locker(grace=0)  # creates the table
    locker = Locker(proxied.url, table=table_name, grace=0)
    outcome: dict[str, Any] = {}

    def stale_writer() -> None:
        try:
            if kind == "writer":
                outcome["lock"] = locker.rwlock("catalog").write(wait=0, expires=2)
            else:
                outcome["lock"] = locker.election("catalog").campaign(wait=0, expires=2).lock
        except LockBusy as error:
            outcome["refused"] = error

    try:
        locker.locks()  # a connection through the proxy, before it stalls
        proxied.proxy.stall_before(b"(writer ")
        thread = threading.Thread(target=stale_writer)
        thread.start()
        assert proxied.proxy.stalled_before.wait(10)
        if kind == "writer":
            valid = other.rwlock("catalog").write(wait=30, expires=30)
        else:
            valid = other.election("catalog").campaign(wait=30, expires=30).lock
        proxied.proxy.resume()
        thread.join(30)
        assert "refused" in outcome, outcome.get("lock")
        assert valid.is_valid()
        assert [info.lock_id for info in other.locks()] == [valid.claim.lock_id, valid.lock_id]
        valid.unlock()
    finally:
        locker.close()


def test_a_refused_reader_or_writer_leaves_no_row_for_its_window(locker: Locker) -> None:
    """A read or write side refused (a writer by a reader, a reader by a writer that came
    first) gives its row back at once: never held, it is kept for no ``hold_at_least``."""
    rw = locker.rwlock("catalog")
    reader = rw.read()
    with pytest.raises(LockBusy):
        rw.write(hold_at_least=3600)
    reader.unlock()
    assert count_rows(locker) == 0
    writer = rw.write()
    with pytest.raises(LockBusy):
        rw.read(hold_at_least=3600)
    writer.unlock()
    assert count_rows(locker) == 0
    rw.write().unlock()


def test_a_writer_whose_claim_runs_out_at_once_stops_by_its_wait(locker: Locker) -> None:
    """A claim too short to outlive the look for readers is given back and tried again: until
    ``wait`` is out, not for ever."""
    started = time.monotonic()
    with pytest.raises(LockBusy):
        locker.rwlock("catalog").write(wait=0.5, expires=0.0001)
    assert time.monotonic() - started < 30
    assert count_rows(locker) == 0


@pytest.mark.parametrize("front", FRONTS, ids=str)
@pytest.mark.parametrize("backend", ["postgresql"])
def test_a_writers_release_is_not_held_up_by_a_frozen_notice_to_observers(
    make_locker: Callable[..., Locker], table_name: str, proxied: Proxied, front: Front
) -> None:
    """A writer's release deletes its rows, then tells an election's observers (a NOTIFY): a
    hint, whose connection freezing (the proxy holds it for ever) kept unlock() from returning
    for as long as the driver waited, past the lock's expiry. It returns within a second or two,
    its rows gone."""
    make_locker()  # creates the table
    outcome: dict[str, Any] = {}

    async def scenario() -> None:
        locker = front.locker(proxied.url, table=table_name)
        try:
            writer = await front.call(locker.rwlock("catalog").write, expires=30)
            proxied.proxy.freeze_connection_before(b"pg_notify")
            started = time.monotonic()
            await front.call(writer.unlock)
            outcome["took"] = time.monotonic() - started
            outcome["rows"] = await front.call(locker.locks)
        finally:
            proxied.proxy.close()  # ends the frozen connection
            with contextlib.suppress(LockError):
                await front.close(locker)

    asyncio.run(scenario())
    assert outcome["took"] < 10, outcome
    assert outcome["rows"] == []


@pytest.mark.parametrize("backend", ["postgresql", "mysql"])
@pytest.mark.parametrize(
    ("kind", "given"), [("writer", "to the call"), ("leader", "to the locker")]
)
def test_a_writer_whose_rows_are_both_lost_is_told_once(
    make_locker: Callable[..., Locker], table_name: str, proxied: Proxied, kind: str, given: str
) -> None:
    """A kept-alive writer (or leader) whose database falls silent loses both its rows, the
    claim and the token: ``on_lost`` (the call's, or the locker's) is called once, as for any
    lock, not once a row."""
    make_locker()  # creates the table
    calls: list[LockError] = []
    to_locker = given == "to the locker"
    locker = Locker(proxied.url, table=table_name, on_lost=calls.append if to_locker else None)
    told = {} if to_locker else {"on_lost": calls.append}
    try:
        held: Any
        if kind == "writer":
            held = locker.rwlock("catalog").write(expires=2, keep_alive=True, **told)
        else:
            held = locker.election("catalog").campaign(expires=2, **told)
        proxied.proxy.stall()
        wait_until(lambda: len(calls) >= 1, timeout=30)
        time.sleep(2)  # the other row's renewal has failed too by now
        assert len(calls) == 1, calls
        assert not held.is_valid()
    finally:
        proxied.proxy.close()
        with contextlib.suppress(LockError):
            locker.close()


@pytest.mark.parametrize("backend", ["sqlite"])  # the handles' doing: any backend
@pytest.mark.parametrize("kind", ["writer", "leader"])
@pytest.mark.parametrize("given", ["to the call", "to the locker"])
def test_a_writer_whose_token_row_alone_is_lost_is_told(
    make_locker: Callable[..., Locker], kind: str, given: str
) -> None:
    """Its token row broken (its claim still renewed): ``on_lost`` is called all the same."""
    calls: list[LockError] = []
    to_locker = given == "to the locker"
    locker = make_locker(on_lost=calls.append if to_locker else None)
    told = {} if to_locker else {"on_lost": calls.append}
    held: Any
    if kind == "writer":
        held = locker.rwlock("catalog").write(expires=2, keep_alive=True, **told)
    else:
        held = locker.election("catalog").campaign(expires=2, **told)
    token = held._state.lockstring if kind == "writer" else held.lock._state.lockstring
    assert locker.break_lock(token) is not None
    wait_until(lambda: len(calls) == 1, timeout=10)
    assert not held.is_valid()


def test_bad_options_of_a_side_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    """A read, write or campaign with a bad option is refused with a LockError before the
    table is made or read (it was made first, and a bad ``locked_by`` was a TypeError)."""
    database = tmp_path / "fresh.db"
    locker = Locker(f"sqlite:///{database}")
    rw, election = locker.rwlock("catalog"), locker.election("catalog")
    calls: list[Callable[[], object]] = [
        lambda: rw.read(expires=-1),
        lambda: rw.read(hold_at_least=-5),
        lambda: rw.read(locked_by=["not", "a", "mapping"]),  # type: ignore[arg-type]
        lambda: rw.write(on_lost=3),  # type: ignore[arg-type]
        lambda: rw.write(expires=float("nan")),
        lambda: election.campaign(locked_by="x"),  # type: ignore[arg-type]
        lambda: election.campaign(expires=0),
        lambda: next(iter(election.observe(float("nan")))),
    ]
    try:
        for call in calls:
            with pytest.raises(LockError):
                call()
        if database.exists():
            with contextlib.closing(sqlite3.connect(database)) as conn:
                assert conn.execute("SELECT name FROM sqlite_master").fetchall() == []
    finally:
        locker.close()


def test_a_claim_lost_while_waiting_for_readers_tells_nobody_and_the_real_loss_is_told(
    make_locker: Callable[..., Locker],
) -> None:
    """A writer's claim broken while it waits for a reader to leave is taken again: it was never
    handed out, so ``on_lost`` is not called for it (and not used up by it): the loss of the
    lock handed out later is the one told."""
    locker = make_locker(grace=0)
    calls: list[LockError] = []
    rw = locker.rwlock("catalog")
    reader = rw.read()
    outcome: dict[str, Any] = {}

    def writer() -> None:
        outcome["lock"] = rw.write(wait=30, expires=3, keep_alive=True, on_lost=calls.append)

    thread = threading.Thread(target=writer)
    thread.start()
    wait_until(lambda: locker.lock_info("catalog") is not None)
    locker.break_lock("catalog")  # the waiting writer's claim
    time.sleep(1.5)  # its renewal while waiting finds it gone, and claims again
    reader.unlock()
    thread.join(30)
    lock = outcome["lock"]
    assert calls == []
    for info in locker.locks():
        locker.break_lock(info.lockstring)
    wait_until(lambda: len(calls) >= 1, timeout=30)
    time.sleep(2)
    assert len(calls) == 1
    assert not lock.is_valid()


@pytest.mark.parametrize("backend", ["sqlite"])  # the keep-alive's, the same on every backend
@pytest.mark.parametrize("lost", ["claim", "token", "group member"])
def test_a_lock_of_two_rows_one_lost_keeps_the_other_no_longer(
    make_locker: Callable[..., Locker], lost: str
) -> None:
    """A writer's lock is two rows, kept alive together (a group, one row a member): one of
    them broken by an operator, the lock was lost and told so, but the other was renewed on
    for as long as its handle lived, keeping every other writer (or holder of the member's
    name) out. It now expires."""
    locker, other = make_locker(), make_locker()
    told: list[LockLost] = []
    if lost == "group member":
        held: Any = locker.lock_all(["a", "b"], expires=1.5, keep_alive=True, on_lost=told.append)
        rows = [lock.lockstring for lock in held.locks]
    else:
        held = locker.rwlock("catalog").write(expires=1.5).keep_alive(told.append)
        claim, token = held.claim.lockstring, held._state.lockstring
        rows = [claim, token] if lost == "claim" else [token, claim]
    broken, survivor = rows
    assert locker.break_lock(broken) is not None
    wait_until(lambda: bool(told), 5)
    try:
        other.lock(survivor, wait=6).unlock()  # once it has expired
    finally:
        with contextlib.suppress(LockLost):
            held.unlock()
