"""SQLite: a waiter holding its place while the row is held by a lock that holds neither its
place nor an ``Unplaced`` (whose release rings no bell) must still be served soon after that
release, not at its next look (``QUEUE_PATIENCE``)."""

from __future__ import annotations

import fcntl
import os
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sqllocker import Locker, LockLost, backoff
from sqllocker.file_queue import AVAILABLE, SUFFIX, FileQueue
from tests.helpers import wait_in_thread, wait_until

pytestmark = pytest.mark.skipif(not AVAILABLE, reason="open file description locks are Linux's")

LONG_PATIENCE = 6.0


def place_held(queue_file: str, offset: int) -> bool:
    """Whether anyone holds the place at ``offset`` (F_OFD_GETLK through a file of our own)."""
    try:
        fd = os.open(queue_file, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        flock = struct.pack("@hhqqixxxx", fcntl.F_WRLCK, os.SEEK_SET, offset, 1, 0)
        found = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, flock)
    finally:
        os.close(fd)
    return bool(struct.unpack("@h", found[:2])[0] != fcntl.F_UNLCK)


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'locks.db'}"


@pytest.fixture
def made(url: str) -> Iterator[list[Locker]]:
    lockers: list[Locker] = []
    yield lockers
    for locker in lockers:
        locker.close()


def test_a_placed_waiter_behind_a_row_won_by_a_look_is_served_at_its_release(
    url: str, made: list[Locker], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A queued waiter (X) whose look finds the holder's row expired takes it over, without
    the place (the stopped holder still has it). The holder then learns of its loss and
    leaves the place, which passes to the next waiter (W); W finds X's row. X's release rings
    nothing: W must not wait for its next look to be served."""
    monkeypatch.setattr(backoff, "QUEUE_PATIENCE", LONG_PATIENCE)
    holder, x, w = (Locker(url, grace=0) for _ in range(3))
    made.extend([holder, x, w])
    offset = FileQueue.offset(holder.table_name, "report")
    queue_file = str(tmp_path / "locks.db") + SUFFIX
    held = holder.lock("report", wait=1, expires=1, keep_alive=False)  # takes the place
    x_thread, x_result = wait_in_thread(x, wait=30, expires=60)
    x_thread.join(10)
    x_lock = x_result["lock"]  # took the expired row over, placeless
    w_thread, w_result = wait_in_thread(w, wait=30, expires=30)
    time.sleep(0.3)  # W queued behind the holder's place
    with pytest.raises(LockLost):
        held.unlock()  # the place passes on, to W
    wait_until(lambda: place_held(queue_file, offset))
    time.sleep(0.5)  # W has its place, refused by X's row
    assert "lock" not in w_result
    released = time.monotonic()
    x_lock.unlock()
    w_thread.join(LONG_PATIENCE + 5)
    waited = w_result["returned"] - released
    w_result["lock"].unlock()
    assert waited < 1.0, f"served {waited:.2f} s after the row was freed"


def test_a_placed_waiter_behind_a_group_member_is_served_at_the_groups_release(
    url: str, made: list[Locker], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``lock_all`` takes its rows without places: a waiter for one of them takes the place,
    and must be served when the group is released, not at its next look."""
    monkeypatch.setattr(backoff, "QUEUE_PATIENCE", LONG_PATIENCE)
    holder, waiter = Locker(url, grace=0), Locker(url, grace=0)
    made.extend([holder, waiter])
    offset = FileQueue.offset(holder.table_name, "report")
    queue_file = str(tmp_path / "locks.db") + SUFFIX
    group = holder.lock_all(["other", "report"], expires=60)
    thread, result = wait_in_thread(waiter, wait=30, expires=30)
    wait_until(lambda: place_held(queue_file, offset))
    time.sleep(0.5)  # refused by the group's row
    assert "lock" not in result
    released = time.monotonic()
    group.unlock()
    thread.join(LONG_PATIENCE + 5)
    waited = result["returned"] - released
    result["lock"].unlock()
    assert waited < 1.0, f"served {waited:.2f} s after the row was freed"


def test_a_ring_for_another_place_costs_a_placed_waiter_no_insert(
    url: str, made: list[Locker], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Waiters holding the places of five lockstrings, each behind a lock taken at once: a
    release rings for its own waiter. The others may look at their rows (reads), but each
    waiter tries its row (an INSERT, SQLite's one writer at a time) only at its first
    attempt and at its own turn, not at every ring in the process."""
    monkeypatch.setattr(backoff, "QUEUE_PATIENCE", LONG_PATIENCE)
    holder, waiter = Locker(url, grace=0), Locker(url, grace=0)
    made.extend([holder, waiter])
    tried: list[str] = []
    real = waiter._operations.try_acquire

    def counting(lockstring: str, *args: Any, **kwargs: Any) -> Any:
        tried.append(lockstring)
        return real(lockstring, *args, **kwargs)

    monkeypatch.setattr(waiter._operations, "try_acquire", counting)
    names = [f"job{number}" for number in range(5)]
    held = [holder.lock(name, expires=60) for name in names]
    waits = [wait_in_thread(waiter, name, wait=30, expires=60) for name in names]
    time.sleep(0.5)  # every waiter holds its place, refused once
    for lock in held:
        lock.unlock()
        time.sleep(0.1)
    for thread, result in waits:
        thread.join(LONG_PATIENCE + 5)
        result["lock"].unlock()
    assert max(tried.count(name) for name in names) <= 2, tried
