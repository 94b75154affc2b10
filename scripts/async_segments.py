"""Where an async SQLite cycle's time goes: on the event loop's thread, or in aiosqlite's.

Each call an aiosqlite connection makes to its thread is stamped as it is sent and as its answer
is back, so a cycle splits into the event loop's own work before the first call (*before*),
between the two (*between*) and after the second (*after*), and the two trips to the thread
(*trip 1*, *trip 2*: the statement, SQLite's work, and the hand-offs between threads). The
async floor (``bench.async_raw_floor_cycle``) and ``sqllocker.asyncio`` (``bench.
async_sqllocker_cycle``) run in turn in one event loop; medians of each, per round, in
microseconds:

    .venv/bin/python scripts/async_segments.py --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiosqlite.core

from scripts import bench

SEGMENTS = ("before", "trip 1", "between", "trip 2", "after", "cycle")


async def measure(url: str, rounds: int, cycles: int) -> list[dict[str, dict[str, float]]]:
    """Per round, per system: each segment's median (microseconds), and ``cycles split``, how
    many cycles made exactly the two calls (the others are left out)."""
    stamps: list[float] = []
    original: Any = aiosqlite.core.Connection._execute

    async def stamped(self: Any, function: Any, *args: Any, **kwargs: Any) -> Any:
        stamps.append(time.perf_counter())
        answer = await original(self, function, *args, **kwargs)
        stamps.append(time.perf_counter())
        return answer

    floor, close_floor = await bench.async_raw_floor_cycle(url)
    library, close_library = await bench.async_sqllocker_cycle(url)
    aiosqlite.core.Connection._execute = stamped  # type: ignore[method-assign,assignment]
    results: list[dict[str, dict[str, float]]] = []
    try:
        for round_number in range(rounds):
            results.append({})
            for name, cycle in (("async floor", floor), ("sqllocker.asyncio", library)):
                split: list[tuple[float, ...]] = []
                for n in range(cycles):
                    stamps.clear()
                    started = time.perf_counter()
                    await cycle(round_number * 10**6 + n)
                    ended = time.perf_counter()
                    if len(stamps) != 4:  # a cycle that checkpointed, or opened a connection
                        continue
                    sent_1, back_1, sent_2, back_2 = stamps
                    split.append(
                        (
                            sent_1 - started,
                            back_1 - sent_1,
                            sent_2 - back_1,
                            back_2 - sent_2,
                            ended - back_2,
                            ended - started,
                        )
                    )
                medians = [statistics.median(column) * 1e6 for column in zip(*split, strict=True)]
                results[-1][name] = {
                    **dict(zip(SEGMENTS, medians, strict=True)),
                    "cycles split": len(split),
                }
    finally:
        aiosqlite.core.Connection._execute = original  # type: ignore[method-assign]
        await close_floor()
        await close_library()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cycles", type=int, default=2000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        url = f"sqlite+aiosqlite:///{scratch}/segments.db"
        results = asyncio.run(measure(url, args.rounds, args.cycles))
    for round_number, systems in enumerate(results):
        for name, figures in systems.items():
            shown = ", ".join(f"{segment} {figures[segment]:.1f}" for segment in SEGMENTS)
            print(f"round {round_number} {name}: {shown} ({figures['cycles split']:.0f} cycles)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
