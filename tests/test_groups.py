"""``lock_all``: several locks taken together, every one or none."""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from sqllocker import LockBusy, Locker, LockGroup, LockLost, LockTypeError, LockValueError
from sqllocker.asyncio import AsyncLocker
from tests.fleet import Fleet
from tests.helpers import abandon, count_rows, figure
from tests.workers import async_url

ACCOUNTS = ["account 1", "account 2", "account 3", "account 4", "account 5"]


def test_every_lock_or_none(locker: Locker) -> None:
    held = locker.lock("account 2")
    with pytest.raises(LockBusy) as busy:
        locker.lock_all(["account 3", "account 1", "account 2"])
    assert busy.value.lockstring == "account 2"
    assert busy.value.lock_id == held.lock_id
    assert [info.lockstring for info in locker.locks()] == ["account 2"]  # nothing taken
    held.unlock()
    with locker.lock_all(["account 3", "account 1", "account 2"]) as group:
        assert isinstance(group, LockGroup)
        assert [lock.lockstring for lock in group.locks] == ["account 1", "account 2", "account 3"]
        assert len({lock.lock_id for lock in group}) == 3
        assert group.is_valid()
        group.extend(120)
        assert locker.try_lock("account 3") is None
    assert count_rows(locker) == 0


def test_a_group_waits_like_one_lock_and_takes_over_expired_members(locker: Locker) -> None:
    blocker = locker.lock("account 1")
    abandon(locker.lock("account 2", expires=0.3))  # a crashed holder's row
    threading.Timer(0.5, blocker.unlock).start()
    started = time.monotonic()
    group = locker.lock_all(["account 1", "account 2"], wait=10)
    assert 0.4 < time.monotonic() - started < 5
    assert all(lock.lock_id > blocker.lock_id for lock in group)
    group.unlock()
    assert locker.locks() == []


def test_unlock_releases_every_member_and_reports_a_lost_one(locker: Locker) -> None:
    group = locker.lock_all(["account 1", "account 2"])
    locker.break_lock("account 1")
    with pytest.raises(LockLost):
        group.unlock()
    assert locker.locks() == []  # the other member was released all the same


def test_a_groups_on_lost_is_called_once_however_many_members_are_lost(locker: Locker) -> None:
    lost: list[LockLost] = []
    group = locker.lock_all(
        ["account 1", "account 2", "account 3"], keep_alive=True, on_lost=lost.append
    )
    for name in ("account 1", "account 2", "account 3"):
        locker.break_lock(name)
    with pytest.raises(LockLost):
        group.unlock()
    assert [error.lockstring for error in lost] == ["account 1"]


@pytest.mark.parametrize(
    ("lockstrings", "error"),
    [
        ([], LockValueError),
        (["a", "b", "a"], LockValueError),
        ("account 1", LockValueError),
        (["ok", ""], LockValueError),
        (["ok", 7], LockTypeError),
        (None, LockValueError),
    ],
)
def test_bad_groups_are_refused_before_any_sql(
    locker: Locker, lockstrings: object, error: type[Exception]
) -> None:
    with pytest.raises(error):
        locker.lock_all(lockstrings)  # type: ignore[arg-type]
    assert count_rows(locker) == 0


async def test_an_async_group(
    url: str, make_locker: Callable[..., Locker], table_name: str
) -> None:
    sync = make_locker()
    alocker = AsyncLocker(async_url(url), table=table_name, grace=0)
    async with await alocker.lock_all(["b", "a"]) as group:
        assert [lock.lockstring for lock in group.locks] == ["a", "b"]
        assert sync.try_lock("a") is None
    held = sync.lock("b")
    with pytest.raises(LockBusy):
        await alocker.lock_all(["a", "b"])
    assert [info.lockstring for info in sync.locks()] == ["b"]
    held.unlock()
    await alocker.aclose()


@pytest.mark.slow
def test_eight_processes_taking_overlapping_pairs_never_overlap_nor_deadlock(
    url: str, make_locker: Callable[..., Locker], table_name: str, backend: str, tmp_path: Path
) -> None:
    locker = make_locker()
    processes, count = 8, 200
    started = time.monotonic()
    fleet = Fleet(
        "tests.workers",
        [
            [
                "pairs",
                "--url",
                url,
                "--table",
                table_name,
                "--state",
                str(tmp_path),
                "--lockstrings",
                ",".join(ACCOUNTS),
                "--count",
                str(count),
            ]
            for _ in range(processes)
        ],
        tmp_path / "workers",
    )
    try:
        outcomes = fleet.wait(timeout=240)  # a deadlock would hang here
    finally:
        fleet.kill()
    reports = []
    for outcome in outcomes:
        assert outcome.returncode == 0, outcome.err
        reports.append(json.loads(outcome.out.splitlines()[-1]))
    records = [
        json.loads(line)
        for log in tmp_path.glob("log-*.jsonl")
        for line in log.read_text().splitlines()
    ]
    assert len(records) == processes * count * 2
    interval_overlaps = token_inversions = lost_updates = 0
    for lockstring in ACCOUNTS:
        mine = sorted((r for r in records if r["ls"] == lockstring), key=lambda r: r["in"])
        for before, after in itertools.pairwise(mine):
            interval_overlaps += after["in"] < before["out"]
            token_inversions += after["id"] <= before["id"]
        counted = tmp_path / f"{lockstring}.count"
        lost_updates += len(mine) - (int(counted.read_text()) if counted.exists() else 0)
    overlaps = sum(report["overlaps"] for report in reports)
    figure(
        "lock_all, 8 processes x 200 random pairs of 5 lockstrings",
        backend,
        f"overlaps {overlaps} (markers) / {interval_overlaps} (intervals), lost updates "
        f"{lost_updates}, token inversions {token_inversions}; "
        f"{time.monotonic() - started:.1f} s",
    )
    assert overlaps == 0
    assert interval_overlaps == 0
    assert lost_updates == 0
    assert token_inversions == 0
    assert locker.locks() == []
