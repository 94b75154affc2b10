"""An event loop that ran lock cycles is freed once closed (asyncio.run called again and
again, as a worker that runs a job per loop does)."""

from __future__ import annotations

import asyncio
import gc
import weakref
from pathlib import Path

from sqllocker.asyncio import AsyncLocker


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
