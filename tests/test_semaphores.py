"""Counting semaphores: at most ``limit`` holders, each a lock row of its own."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest

from sqllocker import Lock, LockBusy, Locker, LockTypeError, LockValueError
from sqllocker.asyncio import AsyncLocker
from tests import forked_cli
from tests.fleet import Fleet
from tests.helpers import abandon, count_rows, figure
from tests.workers import async_url


def test_at_most_limit_permits_each_a_lock_with_its_own_token(locker: Locker) -> None:
    permits = locker.semaphore("api quota", limit=3)
    held = [permits.acquire() for _ in range(3)]
    assert len({permit.lock_id for permit in held}) == 3
    assert sorted(permit.lockstring for permit in held) == [
        f"api quota (permit {slot})" for slot in range(3)
    ]
    with pytest.raises(LockBusy, match="all 3 permits are held"):
        permits.acquire()
    assert [info.lockstring for info in permits.holders()] == sorted(p.lockstring for p in held)
    held[1].unlock()
    again = permits.acquire()
    assert again.lockstring == held[1].lockstring
    assert again.lock_id > max(permit.lock_id for permit in held)
    for permit in (held[0], held[2], again):
        permit.unlock()
    assert permits.holders() == []


def test_a_smaller_limit_admits_no_newcomer_until_enough_permits_are_released(
    locker: Locker,
) -> None:
    wide = locker.semaphore("pool", limit=5)
    held = [wide.acquire() for _ in range(4)]
    narrow = locker.semaphore("pool", limit=3)
    with pytest.raises(LockBusy):
        narrow.acquire()  # four held, whatever slots they are in
    held[0].unlock()
    with pytest.raises(LockBusy):
        narrow.acquire()  # three held: a fourth would be one too many for the smaller limit
    assert len(narrow.holders()) == 3
    held[1].unlock()
    got = narrow.acquire()  # two held: it fits
    assert len(narrow.holders()) == 3
    for permit in (got, held[2], held[3]):
        permit.unlock()


def test_a_crashed_permit_holders_slot_is_taken_over_after_it_expires(locker: Locker) -> None:
    permits = locker.semaphore("worker", limit=1)
    crashed = abandon(permits.acquire(expires=0.5))
    with pytest.raises(LockBusy):
        permits.acquire()
    started = time.monotonic()
    taken = permits.acquire(wait=10)
    assert 0.3 < time.monotonic() - started < 5
    assert taken.lock_id > crashed.lock_id
    taken.unlock()


def test_a_sigkilled_permit_holders_slot_is_taken_over_after_it_expires(
    url: str, locker: Locker, table_name: str
) -> None:
    holder = forked_cli.Popen(  # a process of its own, forked from one that imported sqllocker
        [
            "-c",
            "import sys, time; from sqllocker import Locker\n"
            f"permit = Locker({url!r}, table={table_name!r}).semaphore('worker', 1)"
            ".acquire(expires=4)\n"
            "print(permit.lock_id, flush=True); time.sleep(60)",
        ],
        program="python",
    )
    assert holder.stdout is not None
    killed_id = int(holder.stdout.readline())
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    # Its expiry outlasts what this Locker's first operation may take on a loaded machine.
    permits = locker.semaphore("worker", limit=1)
    with pytest.raises(LockBusy):
        permits.acquire()
    taken = permits.acquire(wait=20)
    assert taken.lock_id > killed_id
    taken.unlock()


def test_a_permit_can_be_kept_alive_and_waited_for(locker: Locker) -> None:
    permits = locker.semaphore("job", limit=1)
    held = permits.acquire(expires=1, keep_alive=True)
    with pytest.raises(LockBusy, match="gave up after waiting"):
        permits.acquire(wait=1.5)  # renewed meanwhile: never taken over
    assert held.is_valid()
    held.unlock()


@pytest.mark.parametrize(
    ("name", "limit", "error"),
    [
        ("quota", 0, LockValueError),
        ("quota", 1001, LockValueError),
        ("quota", 2.5, LockTypeError),
        ("quota", True, LockTypeError),
        ("", 3, LockValueError),
        ("x" * 120, 3, LockValueError),
    ],
)
def test_bad_semaphores_are_refused_before_any_sql(
    locker: Locker, name: str, limit: object, error: type[Exception]
) -> None:
    with pytest.raises(error):
        locker.semaphore(name, limit)  # type: ignore[arg-type]
    assert count_rows(locker) == 0


def test_names_with_wildcards_count_only_their_own_permits(locker: Locker) -> None:
    star = locker.semaphore("a*", limit=1)
    other = locker.semaphore("ab", limit=1)
    percent = locker.semaphore("a%_", limit=1)
    held = [star.acquire(), other.acquire(), percent.acquire()]
    assert [len(s.holders()) for s in (star, other, percent)] == [1, 1, 1]
    for permit in held:
        permit.unlock()


async def test_async_permits(url: str, make_locker: Callable[..., Locker], table_name: str) -> None:
    sync = make_locker()
    alocker = AsyncLocker(async_url(url), table=table_name, grace=0)
    permits = alocker.semaphore("api quota", limit=2)
    held = [await permits.acquire(), sync.semaphore("api quota", 2).acquire()]
    with pytest.raises(LockBusy):
        await permits.acquire()
    assert len(await permits.holders()) == 2
    await held[0].unlock()
    held[1].unlock()
    await alocker.aclose()


class Run(NamedTuple):
    """What semaphore workers (``tests.workers semaphore``) did: permits taken by each, with
    its limit; the most holders at once; overlaps on a slot and token inversions; breaches of
    a worker's own limit."""

    taken: list[tuple[int, int]]
    most: int
    slot_overlaps: int
    token_inversions: int
    violations: list[str]


def run_semaphore_workers(
    url: str, table_name: str, tmp_path: Path, limits: list[int], seconds: float
) -> Run:
    """One worker process per limit in ``limits``, on one semaphore, for ``seconds``."""
    fleet = Fleet(
        "tests.workers",
        [
            [
                "semaphore",
                "--url",
                url,
                "--table",
                table_name,
                "--state",
                str(tmp_path),
                "--name",
                "api quota",
                "--limit",
                str(limit),
                "--seconds",
                str(seconds),
            ]
            for limit in limits
        ],
        tmp_path / "workers",
    )
    try:
        outcomes = fleet.wait(timeout=seconds + 120)
    finally:
        fleet.kill()
    taken = []
    for outcome, limit in zip(outcomes, limits, strict=True):
        assert outcome.returncode == 0, outcome.err
        taken.append((limit, json.loads(outcome.out.splitlines()[-1])["taken"]))
    records = [
        json.loads(line)
        for log in tmp_path.glob("log-*.jsonl")
        for line in log.read_text().splitlines()
    ]
    slot_overlaps = token_inversions = 0
    for slot in {record["ls"] for record in records}:
        mine = sorted((r for r in records if r["ls"] == slot), key=lambda r: r["in"])
        for before, after in itertools.pairwise(mine):
            slot_overlaps += after["in"] < before["out"]
            token_inversions += after["id"] <= before["id"]
    violations = tmp_path / "violations"
    return Run(
        taken,
        int((tmp_path / "most").read_text()),
        slot_overlaps,
        token_inversions,
        violations.read_text().splitlines() if violations.exists() else [],
    )


@pytest.mark.slow
def test_sixteen_processes_never_hold_more_permits_than_the_limit(
    url: str, make_locker: Callable[..., Locker], table_name: str, backend: str, tmp_path: Path
) -> None:
    make_locker()  # the table
    started = time.monotonic()
    run = run_semaphore_workers(url, table_name, tmp_path, [3] * 16, 6)
    taken = [count for _, count in run.taken]
    figure(
        "semaphore, 16 processes, limit 3, 6 s",
        backend,
        f"most holders at once {run.most}; permits taken {sum(taken)} "
        f"(overlaps on a slot {run.slot_overlaps}, token inversions {run.token_inversions}) "
        f"({min(taken)}-{max(taken)} a process); {time.monotonic() - started:.1f} s",
    )
    assert run.most == 3
    assert run.slot_overlaps == 0
    assert run.token_inversions == 0
    assert run.violations == []
    assert all(count > 0 for count in taken)  # every waiter was served
    assert count_rows(make_locker()) == 0


@pytest.mark.slow
def test_mixed_limits_serve_the_smaller_in_turn_and_admit_no_more_than_it_allows(
    url: str, make_locker: Callable[..., Locker], table_name: str, backend: str, tmp_path: Path
) -> None:
    """Four processes with limit 4 beside two with limit 2: the smaller limit is served in
    turn, and never admits a newcomer beyond it (each worker checks its own)."""
    make_locker()  # the table
    run = run_semaphore_workers(url, table_name, tmp_path, [4, 4, 4, 4, 2, 2], 15)
    small = [count for limit, count in run.taken if limit == 2]
    large = [count for limit, count in run.taken if limit == 4]
    figure(
        "semaphore, 4 processes with limit 4 beside 2 with limit 2, 15 s",
        backend,
        f"permits taken {large} (limit 4), {small} (limit 2); most holders at once {run.most}; "
        f"breaches {len(run.violations)}",
    )
    assert run.violations == []
    assert run.most <= 4
    assert run.slot_overlaps == 0
    assert run.token_inversions == 0
    # Served in turn: each limit-2 process takes permits at no less than a fifth of the rate
    # of a limit-4 one (without turns, about a hundredth).
    assert min(small) * 5 >= sum(large) / len(large)
    assert count_rows(make_locker()) == 0


def _two_held_in_the_upper_slots(locker: Locker) -> list[Lock]:
    """Four permits of limit 4 taken, those in slots 0 and 1 given back: two held, in slots 2
    and 3, which a limit-2 caller never tries."""
    wide = locker.semaphore("pool", limit=4)
    held = [wide.acquire() for _ in range(4)]
    for permit in held:
        if permit.lockstring.endswith(("(permit 0)", "(permit 1)")):
            permit.unlock()
    return [permit for permit in held if permit.is_locked]


def test_a_refused_newcomer_with_hold_at_least_leaves_no_phantom_permit(locker: Locker) -> None:
    upper = _two_held_in_the_upper_slots(locker)
    narrow = locker.semaphore("pool", limit=2)
    with pytest.raises(LockBusy):
        narrow.acquire(hold_at_least=60)  # its row goes in, then 3 > 2: refused
    # Never granted, so given back at once, not kept for the window held by nobody.
    assert sorted(info.lockstring for info in narrow.holders()) == sorted(
        permit.lockstring for permit in upper
    )
    granted = locker.semaphore("pool", limit=3).acquire(hold_at_least=60)  # 3 <= 3: it fits
    granted.unlock()  # granted, so kept for its window
    assert len(narrow.holders()) == 3
    for permit in upper:
        permit.unlock()


async def test_an_async_refused_newcomer_with_hold_at_least_leaves_no_phantom_permit(
    url: str, make_locker: Callable[..., Locker], table_name: str
) -> None:
    upper = _two_held_in_the_upper_slots(make_locker())
    async with AsyncLocker(async_url(url), table=table_name, grace=0) as alocker:
        narrow = alocker.semaphore("pool", limit=2)
        with pytest.raises(LockBusy):
            await narrow.acquire(hold_at_least=60)
        assert len(await narrow.holders()) == 2
        granted = await alocker.semaphore("pool", limit=3).acquire(hold_at_least=60)
        await granted.unlock()
        assert len(await narrow.holders()) == 3
    for permit in upper:
        permit.unlock()


def test_a_waiter_refused_for_its_smaller_limit_takes_the_turn_and_is_served_next(
    make_locker: Callable[..., Locker],
) -> None:
    locker = make_locker()
    upper = _two_held_in_the_upper_slots(locker)
    wide = locker.semaphore("pool", limit=4)
    third = wide.acquire()  # in slot 0 or 1
    served: list[Lock] = []
    waiter = threading.Thread(
        target=lambda: served.append(make_locker().semaphore("pool", limit=2).acquire(wait=60))
    )
    waiter.start()  # refused for its limit (3 held, its own makes 4): it takes the turn
    deadline = time.monotonic() + 30
    while locker.lock_info("pool (turn)") is None:
        assert time.monotonic() < deadline, "the waiter took no turn"
        time.sleep(0.05)
    with pytest.raises(LockBusy):
        wide.acquire()  # 4 would fit its own limit, but leave no room for the waiter's
    third.unlock()
    upper[0].unlock()  # one held: the waiter's permit fits
    waiter.join(60)
    assert len(served) == 1
    assert locker.lock_info("pool (turn)") is None  # given up once served
    newcomer = wide.acquire()  # no turn any more: 3 held, within 4
    for permit in (newcomer, served[0], upper[1]):
        permit.unlock()


def test_a_waiter_whose_every_slot_a_larger_limit_holds_takes_the_turn_too(
    make_locker: Callable[..., Locker],
) -> None:
    locker = make_locker()
    wide = locker.semaphore("pool", limit=4)
    held = {permit.lockstring[-2]: permit for permit in (wide.acquire() for _ in range(4))}
    held.pop("3").unlock()  # slots 0, 1 and 2 held: none free for a limit of 2
    served: list[Lock] = []
    waiter = threading.Thread(
        target=lambda: served.append(make_locker().semaphore("pool", limit=2).acquire(wait=60))
    )
    waiter.start()
    deadline = time.monotonic() + 30
    while locker.lock_info("pool (turn)") is None:
        assert time.monotonic() < deadline, "the waiter took no turn"
        time.sleep(0.05)
    with pytest.raises(LockBusy):
        wide.acquire()  # slot 3 is free, and 4 fits its own limit, but not the waiter's
    held.pop("0").unlock()
    held.pop("2").unlock()
    waiter.join(60)
    assert len(served) == 1
    assert locker.lock_info("pool (turn)") is None
    for permit in (served[0], *held.values()):
        permit.unlock()


def test_a_waiter_whose_turn_was_broken_takes_it_again(
    make_locker: Callable[..., Locker],
) -> None:
    locker = make_locker()
    upper = _two_held_in_the_upper_slots(locker)
    third = locker.semaphore("pool", limit=4).acquire()
    served: list[Lock] = []
    waiter = threading.Thread(
        target=lambda: served.append(make_locker().semaphore("pool", limit=2).acquire(wait=60))
    )
    waiter.start()

    def turn() -> int:
        deadline = time.monotonic() + 30
        while (info := locker.lock_info("pool (turn)")) is None:
            assert time.monotonic() < deadline, "the waiter took no turn"
            time.sleep(0.05)
        return info.lock_id

    broken = locker.break_lock("pool (turn)", turn())  # an operator's `release --force`
    assert broken is not None
    assert turn() > broken.lock_id  # its renewal found it lost, and it took the turn again
    third.unlock()
    upper[0].unlock()
    waiter.join(60)
    assert len(served) == 1
    assert locker.lock_info("pool (turn)") is None
    for permit in (served[0], upper[1]):
        permit.unlock()


async def test_an_async_waiter_takes_the_turn_and_gives_it_up_when_cancelled(
    url: str, make_locker: Callable[..., Locker], table_name: str
) -> None:
    locker = make_locker()
    upper = _two_held_in_the_upper_slots(locker)
    third = locker.semaphore("pool", limit=4).acquire()
    async with AsyncLocker(async_url(url), table=table_name, grace=0) as alocker:
        waiting = asyncio.ensure_future(alocker.semaphore("pool", limit=2).acquire(wait=60))
        deadline = time.monotonic() + 30
        while await alocker.lock_info("pool (turn)") is None:
            assert time.monotonic() < deadline, "the waiter took no turn"
            await asyncio.sleep(0.05)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        # Given up as it was cancelled: at once, or, cancelled while its statement was still on
        # its way, as that statement ends (in the background, as the guide says).
        # So is a permit its count found one too many, inserted as it was cancelled.
        deadline = time.monotonic() + 5
        while await alocker.lock_info("pool (turn)") is not None or (
            len(await alocker.semaphore("pool", limit=2).holders()) != 3
        ):
            assert time.monotonic() < deadline, "the cancelled waiter's turn or permit was kept"
            await asyncio.sleep(0.02)
    for permit in (third, *upper):
        permit.unlock()


def test_a_turn_row_that_says_no_limit_or_has_expired_holds_nobody_back(locker: Locker) -> None:
    wide = locker.semaphore("pool", limit=4)
    odd = locker.lock("pool (turn)", locked_by={"semaphore_limit": "two"})  # an operator's
    wide.acquire().unlock()  # not a turn: nothing to make room for
    odd.unlock()
    dead = abandon(locker.lock("pool (turn)", expires=1, locked_by={"semaphore_limit": 1}))
    with pytest.raises(LockBusy):
        wide.acquire()  # a live turn for a limit of 1: nobody else until it is served
    permit = wide.acquire(wait=30)  # its waiter died: the turn expires, and holds nobody back
    assert permit.lock_id > dead.lock_id
    permit.unlock()
