"""SQLite under a mixed fleet: forked processes, each with an inherited Locker and Lockers of
its own, sync threads and asyncio tasks, locks taken at once (no place, ``Unplaced``) and
waits in the kernel's queue, one process stopped now and then and one killed while it holds:
never two holders of the lockstring, fencing tokens in the order of the holds, and every
worker served."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from sqllocker import LockBusy, Locker, LockLost
from sqllocker.asyncio import AsyncLocker
from sqllocker.file_queue import AVAILABLE

pytestmark = pytest.mark.skipif(not AVAILABLE, reason="open file description locks are Linux's")

PROCESSES = 5
TURNS = 60
EXPIRES = 3.0


def _inside(shared: dict[str, Any], lock_id: int) -> None:
    with shared["inside"].get_lock():
        shared["inside"].value += 1
        if shared["inside"].value != 1:
            shared["overlaps"].value += 1
    with shared["ids"].get_lock():
        if lock_id <= shared["ids"].value:
            shared["overlaps"].value += 1
        shared["ids"].value = lock_id
    time.sleep(random.uniform(0, 0.003))
    with shared["inside"].get_lock():
        shared["inside"].value -= 1
    with shared["turns"].get_lock():
        shared["turns"].value += 1


def _sync_turns(locker: Locker, at_once: bool, shared: dict[str, Any]) -> None:
    for _ in range(TURNS):
        while True:
            try:
                lock = locker.lock("report", wait=0 if at_once else 20, expires=EXPIRES)
                break
            except LockBusy:
                time.sleep(random.uniform(0, 0.002))
        _inside(shared, lock.lock_id)
        with contextlib.suppress(LockLost):
            lock.unlock()


async def _async_turns(url: str, shared: dict[str, Any]) -> None:
    locker = AsyncLocker(url.replace("sqlite://", "sqlite+aiosqlite://"), grace=0)

    async def turns(at_once: bool) -> None:
        for _ in range(TURNS):
            while True:
                try:
                    lock = await locker.lock("report", wait=0 if at_once else 20, expires=EXPIRES)
                    break
                except LockBusy:
                    await asyncio.sleep(random.uniform(0, 0.002))
            await asyncio.to_thread(_inside, shared, lock.lock_id)
            with contextlib.suppress(LockLost):
                await lock.unlock()

    try:
        await asyncio.gather(turns(True), turns(False))
    finally:
        await locker.aclose()


def _worker(url: str, inherited: Locker, shared: dict[str, Any]) -> None:
    own = [Locker(url, grace=0) for _ in range(2)]
    threads = [
        threading.Thread(target=_sync_turns, args=(inherited, False, shared)),
        threading.Thread(target=_sync_turns, args=(own[0], True, shared)),
        threading.Thread(target=_sync_turns, args=(own[1], False, shared)),
    ]
    for thread in threads:
        thread.start()
    asyncio.run(_async_turns(url, shared))
    for thread in threads:
        thread.join()
    for locker in own:
        locker.close()


def _victim(url: str, holding: Any) -> None:
    locker = Locker(url, grace=0)
    locker.lock("report", wait=30, expires=EXPIRES, keep_alive=True)
    holding.set()
    time.sleep(60)


@pytest.mark.slow
def test_a_mixed_fleet_never_overlaps_and_is_served(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'locks.db'}"
    context = multiprocessing.get_context("fork")
    shared = {
        "inside": context.Value("i", 0),
        "overlaps": context.Value("i", 0),
        "ids": context.Value("q", 0),
        "turns": context.Value("i", 0),
    }
    parent = Locker(url, grace=0)
    # The parent's queue has its looker, its spares and its bell's reader before the fork.
    parent.lock("report", expires=EXPIRES).unlock()
    blocker = parent.lock("report", expires=EXPIRES)
    listener_started = threading.Event()

    def parent_waits() -> None:
        listener_started.set()
        parent.lock("report", wait=20, expires=EXPIRES).unlock()

    waiting = threading.Thread(target=parent_waits)
    waiting.start()
    listener_started.wait()
    time.sleep(0.3)
    workers = [
        context.Process(target=_worker, args=(url, parent, shared)) for _ in range(PROCESSES)
    ]
    for worker in workers:
        worker.start()
    blocker.unlock()
    waiting.join(30)
    holding = context.Event()
    victim = context.Process(target=_victim, args=(url, holding))
    victim.start()
    assert holding.wait(60)
    assert victim.pid is not None
    os.kill(victim.pid, signal.SIGKILL)  # its row is taken over once expired
    victim.join()
    stopped = workers[0].pid
    assert stopped is not None
    deadline = time.monotonic() + 240
    while any(worker.is_alive() for worker in workers) and time.monotonic() < deadline:
        # Stopped and resumed while it runs: done first, it has been reaped (is_alive).
        if workers[0].is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped, signal.SIGSTOP)
                time.sleep(0.2)
                os.kill(stopped, signal.SIGCONT)
        time.sleep(1.0)
    for worker in workers:
        worker.join(5)
        assert worker.exitcode == 0, worker.exitcode
    parent.close()
    assert shared["overlaps"].value == 0
    assert shared["turns"].value == PROCESSES * 5 * TURNS
