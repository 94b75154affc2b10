"""Leader election: one valid leader at any moment, terms increasing, observers told."""

from __future__ import annotations

import itertools
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from sqllocker import LockBusy, Locker, LockLost
from sqllocker.asyncio import AsyncLocker
from tests import forked_cli
from tests.fleet import Fleet
from tests.helpers import abandon, stop_outside_a_write, wait_until
from tests.workers import async_url


def test_one_leader_at_a_time_and_resign_hands_the_lead_on(
    make_locker: Callable[..., Locker],
) -> None:
    first, second = make_locker().election("scheduler"), make_locker().election("scheduler")
    assert first.leader() is None
    lead = first.campaign(expires=2)
    assert lead.is_valid()
    assert lead.term == lead.lock_id
    leader = second.leader()
    assert leader is not None
    assert (leader.pid, leader.term) == (os.getpid(), lead.term)
    assert leader.host
    assert leader.program
    with pytest.raises(LockBusy):
        second.campaign(wait=0.3)
    lead.resign()
    assert first.leader() is None
    after = second.campaign(wait=5)
    assert after.term > lead.term
    after.resign()


@pytest.mark.slow
def test_a_leadership_is_kept_alive_past_its_expiry(locker: Locker) -> None:
    # Two seconds, not one: on a machine as loaded as the whole suite's lanes make it, a
    # renewal a third of the way into a one-second lease can come too late.
    lead = locker.election("scheduler").campaign(expires=2)
    time.sleep(4.5)
    assert lead.is_valid()
    with pytest.raises(LockBusy):
        locker.election("scheduler").campaign(wait=0)
    lead.resign()


def test_a_lost_lead_is_told_and_its_term_refused_by_guard(
    make_locker: Callable[..., Locker],
) -> None:
    locker = make_locker()
    told: list[LockLost] = []
    lead = locker.election("scheduler").campaign(expires=1, on_lost=told.append)
    locker.break_lock("scheduler")  # an operator's doing, or a takeover
    deadline = time.monotonic() + 10
    while not told:
        assert time.monotonic() < deadline, "on_lost never called"
        time.sleep(0.05)
    assert not lead.is_valid()
    engine = sa.create_engine(locker._operations.engine.url)
    with engine.connect() as conn, conn.begin(), pytest.raises(LockLost):
        lead.guard(conn)
    engine.dispose()
    with pytest.raises(LockLost):
        lead.resign()


def test_a_crashed_leader_is_succeeded_after_its_expiry(locker: Locker) -> None:
    election = locker.election("scheduler")
    crashed = election.campaign(expires=0.5)
    abandon(crashed.lock.claim)
    abandon(crashed.lock)
    after = election.campaign(wait=10)
    assert after.term > crashed.term
    after.resign()


async def test_async_election_and_observer(
    url: str, make_locker: Callable[..., Locker], table_name: str
) -> None:
    alocker = AsyncLocker(async_url(url), table=table_name, grace=0)
    election = alocker.election("scheduler")
    changes = election.observe(interval=0.05)
    assert await changes.__anext__() is None
    lead = await election.campaign(expires=2)
    seen = await changes.__anext__()
    assert seen is not None
    assert seen.term == lead.term
    sync = make_locker().election("scheduler")
    await lead.resign()
    assert await changes.__anext__() is None
    other = sync.campaign(wait=5)
    seen = await changes.__anext__()
    assert seen is not None
    assert seen.term == other.term > lead.term
    other.resign()
    await changes.aclose()
    await alocker.aclose()


@pytest.mark.slow
def test_sqllocker_leader_names_the_holder_or_exits_1(
    url: str, locker: Locker, table_name: str
) -> None:
    # Each command forked from a process that imported the command line once
    # (``tests/forked_cli.py``): what ``leader`` says, not how the console script starts.
    command = ["--url", url, "--table", table_name]
    none = forked_cli.run([*command, "leader", "scheduler"])
    assert none.returncode == 1
    assert "has no leader" in none.stderr
    lead = locker.election("scheduler").campaign()
    shown = forked_cli.run([*command, "leader", "--json", "scheduler"])
    assert shown.returncode == 0, shown.stderr
    leader = json.loads(shown.stdout)
    assert (leader["pid"], leader["term"]) == (os.getpid(), lead.term)
    lead.resign()


def _records(state: Path, role: str) -> dict[int, list[dict[str, Any]]]:
    return {
        int(path.stem.split("-")[1]): [json.loads(line) for line in path.read_text().splitlines()]
        for path in state.glob(f"{role}-*.jsonl")
    }


def _leader_pid(locker: Locker, newer_than: int, timeout: float) -> tuple[int, int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        leader = locker.election("scheduler").leader()
        if leader is not None and leader.term > newer_than and leader.pid is not None:
            return leader.pid, leader.term
        time.sleep(0.05)
    raise AssertionError(f"no new leader after term {newer_than} within {timeout}s")


def _renewed(locker: Locker, term: int) -> None:
    """Wait until the lead of ``term`` has been renewed (its row's expiry moved on)."""
    info = locker.lock_info("scheduler")
    leader = locker.election("scheduler").leader()
    assert info is not None
    assert leader is not None
    assert leader.term == term

    def moved_on() -> bool:
        now = locker.lock_info("scheduler")
        assert now is not None
        assert now.lock_id == info.lock_id, "the lead changed hands"
        return now.expires > info.expires

    wait_until(moved_on, 30)


def _observed(state: Path) -> list[int | None]:
    return [
        record["term"] for records in _records(state, "observer").values() for record in records
    ]


def _was_valid(state: Path, term: int) -> bool:
    return any(
        record["event"] == "valid" and record["term"] == term
        for records in _records(state, "candidate").values()
        for record in records
    )


@pytest.mark.slow
@pytest.mark.parametrize("front_end", ["sync", "asyncio"])
def test_five_candidates_one_valid_leader_through_a_kill_and_a_stop(
    url: str, make_locker: Callable[..., Locker], table_name: str, tmp_path: Path, front_end: str
) -> None:
    locker = make_locker()
    options = [f"--url={url}", f"--table={table_name}", f"--state={tmp_path}"]
    options += ["--asyncio"] if front_end == "asyncio" else []
    # The observer and the five candidates, each a process of its own, forked from a launcher
    # that imported them once (``tests/fleet.py``); the candidates campaign once told to.
    go = tmp_path / "go"
    fleet = Fleet(
        "tests.election_workers",
        [["observer", *options], *(["candidate", *options, f"--go={go}"] for _ in range(5))],
        tmp_path / "workers",
    )
    expires, grace = 2.0, 0.5
    stopped: int | None = None
    try:
        # Watching before the first term begins (its first line says: no leader yet).
        wait_until(lambda: "\n" in "".join(p.read_text() for p in tmp_path.glob("observer-*")), 60)
        go.touch()
        killed_pid, killed_term = _leader_pid(locker, 0, 60)
        _renewed(locker, killed_term)  # killed with its lead kept alive past its start
        os.kill(killed_pid, signal.SIGKILL)
        started = time.monotonic()
        stopped, stopped_term = _leader_pid(locker, killed_term, 30)
        # A bound against "never": the takeover comes after expiry + grace.
        assert time.monotonic() - started < expires + grace + 15
        time.sleep(1.5)
        stop_outside_a_write(stopped, url)
        _, last_term = _leader_pid(locker, stopped_term, 30)
        # The next leader has been valid while the stopped one was still frozen.
        wait_until(lambda: _was_valid(tmp_path, last_term), 30)
        os.kill(stopped, signal.SIGCONT)
        wait_until(
            lambda: any(
                record["event"] == "lost" and record["term"] == stopped_term
                for record in _records(tmp_path, "candidate")[stopped]
            ),
            30,
        )  # the stopped leader found its lead lost
        # The observer reads at least every second: until it has shown the last term (if it
        # ever missed one, the check below says which).
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if {killed_term, stopped_term, last_term} <= set(_observed(tmp_path)):
                break
            time.sleep(0.05)
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        fleet.kill()  # the launcher, and with it every worker still running
    spans: dict[int, list[float]] = {}
    for records in _records(tmp_path, "candidate").values():
        for record in records:
            if record["event"] == "valid":
                term, at = int(record["term"]), float(record["at"])
                low, high = spans.get(term, [at, at])
                spans[term] = [min(low, at), max(high, at)]
    ordered = sorted(spans.items(), key=lambda item: item[1][0])
    assert len(ordered) >= 3
    for (term, (_, end)), (next_term, (start, _)) in itertools.pairwise(ordered):
        assert end < start, f"terms {term} and {next_term} were both valid at once"
        assert next_term > term
    assert {killed_term, stopped_term, last_term} <= set(spans)
    observed = _observed(tmp_path)
    for term in (killed_term, stopped_term, last_term):
        assert term in observed, f"the observer missed term {term}"


@pytest.fixture
def slow_observer_poll(monkeypatch: pytest.MonkeyPatch) -> float:
    """Observers that would read the leader again only every 5 minutes: a change they see
    sooner was pushed to them."""
    import sqllocker.asyncio.election
    import sqllocker.election

    monkeypatch.setattr(sqllocker.election, "OBSERVE_INTERVAL", 300.0)
    monkeypatch.setattr(sqllocker.asyncio.election, "OBSERVE_INTERVAL", 300.0)
    return 300.0


def _observe_in_thread(
    locker: Locker, interval: float
) -> tuple[list[tuple[float, int | None]], Callable[[], None]]:
    """A thread that observes ``locker``'s election ``scheduler``: each change as (when,
    term); it stops after the change that follows the call of the function returned."""
    import threading

    seen: list[tuple[float, int | None]] = []
    stopping = threading.Event()

    def observe() -> None:
        for leader in locker.election("scheduler").observe(interval=interval):
            seen.append((time.monotonic(), None if leader is None else leader.term))
            if stopping.is_set():
                break

    threading.Thread(target=observe, daemon=True).start()
    return seen, stopping.set


def test_a_postgresql_observer_is_told_at_once(
    migrated_postgres: str, table_name: str, slow_observer_poll: float
) -> None:
    observer = Locker(migrated_postgres, table=table_name)
    seen, stop = _observe_in_thread(observer, slow_observer_poll)
    deadline = time.monotonic() + 30
    while not seen:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert seen == [(seen[0][0], None)]
    candidate = Locker(migrated_postgres, table=table_name)
    lead = candidate.election("scheduler").campaign()
    started = time.monotonic()
    while len(seen) < 2:
        assert time.monotonic() - started < slow_observer_poll / 5, "the NOTIFY was not heard"
        time.sleep(0.02)
    assert seen[1][1] == lead.term
    stop()
    lead.resign()
    while len(seen) < 3:
        assert time.monotonic() - started < slow_observer_poll / 5, "the NOTIFY was not heard"
        time.sleep(0.02)
    assert seen[2][1] is None
    candidate.close()
    observer.close()


async def test_an_async_postgresql_observer_is_told_at_once(
    migrated_postgres: str, table_name: str, slow_observer_poll: float
) -> None:
    import asyncio

    async with AsyncLocker(async_url(migrated_postgres), table=table_name) as locker:
        changes = locker.election("scheduler").observe(interval=slow_observer_poll)
        assert await changes.__anext__() is None
        candidate = Locker(migrated_postgres, table=table_name)
        lead = await asyncio.to_thread(candidate.election("scheduler").campaign)
        seen = await asyncio.wait_for(changes.__anext__(), slow_observer_poll / 5)
        assert seen is not None
        assert seen.term == lead.term
        await asyncio.to_thread(lead.resign)
        assert await asyncio.wait_for(changes.__anext__(), slow_observer_poll / 5) is None
        await changes.aclose()
        candidate.close()


def test_elections_whose_long_names_share_a_prefix_keep_their_own_terms(locker: Locker) -> None:
    """A fence row's lockstring has room for the first 102 characters of a name only: two
    elections whose names share them read each other's fence rows. Each leader's term is its
    own, and a plain lock of one name leads nothing, whatever the other does."""
    a, b = "x" * 110 + " A", "x" * 110 + " B"
    plain = locker.lock(a)
    lead_b = locker.election(b).campaign(expires=30)
    assert locker.election(a).leader() is None
    plain.unlock()
    lead_a = locker.election(a).campaign(expires=30)
    lead_b.resign()
    lead_b = locker.election(b).campaign(expires=30)
    for lead, name in ((lead_a, a), (lead_b, b)):
        leader = locker.election(name).leader()
        assert leader is not None
        assert leader.term == lead.term
    lead_a.resign()
    lead_b.resign()


def test_rows_named_like_a_fence_row_are_no_term(locker: Locker) -> None:
    """An election's term is its fence row's id, a row named ``<name> (writer <16 hex>)``
    that a writer drew: a semaphore named ``<name> (writer`` (its permits ``<name> (writer
    (permit 0)``) or a read-write lock of that name made a plain lock of ``<name>`` a leader,
    and gave a real leader a term that was not its own."""
    name = "sched"
    plain = locker.lock(name)
    permit = locker.semaphore(f"{name} (writer", limit=2).acquire()  # a row drawn after it
    assert locker.election(name).leader() is None
    plain.unlock()
    lead = locker.election(name).campaign(expires=30)
    reading = locker.rwlock(f"{name} (writer").read()  # a row drawn after the fence row
    leader = locker.election(name).leader()
    assert leader is not None
    assert leader.term == lead.term
    reading.unlock()
    lead.resign()
    permit.unlock()
