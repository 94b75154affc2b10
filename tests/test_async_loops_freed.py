"""An event loop that ran lock cycles is freed once closed (asyncio.run called again and
again, as a worker that runs a job per loop does)."""

from __future__ import annotations

import asyncio
import gc
import weakref
from pathlib import Path
from typing import Any

import pytest

from sqllocker.asyncio import AsyncLocker, alarm, concurrency


def test_closed_loops_that_released_locks_are_freed(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/loops.db"
    loops: list[weakref.ref[asyncio.AbstractEventLoop]] = []

    async def job() -> None:
        loops.append(weakref.ref(asyncio.get_running_loop()))
        locker = AsyncLocker(url)
        async with locker.lock("job", expires=30):
            pass
        await locker.aclose()

    for _ in range(5):
        asyncio.run(job())
    gc.collect()
    # The last one may be remembered as the alarm asked for last; none before it.
    assert sum(loop() is not None for loop in loops[:-1]) == 0


class _NoHandleRefs:
    """The weakref module, as seen by the alarm where timer handles take no weak reference."""

    WeakKeyDictionary = weakref.WeakKeyDictionary

    @staticmethod
    def ref(target: Any) -> Any:
        if isinstance(target, asyncio.TimerHandle):
            raise TypeError("cannot create weak reference")
        return weakref.ref(target)


def test_deadlines_ring_where_timer_handles_take_no_weak_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(alarm, "weakref", _NoHandleRefs)

    async def bounded() -> list[str]:
        ended = []
        for seconds in (0.2, 0.05, 0.1):
            try:
                await concurrency.within(asyncio.sleep(5), seconds, "sleep")
            except asyncio.TimeoutError:
                ended.append("timeout")
        return ended

    assert asyncio.run(asyncio.wait_for(bounded(), 5)) == ["timeout"] * 3
