"""The async front end's lock operations run to their end whoever stops waiting for them
(``sqllocker.asyncio.concurrency.InFlight``): what a cancelled caller would have got is undone,
however the cancellation and the work's end fall, and nothing is undone that a caller got.

Each case is timed by the event loop's own order (no sleeps): a future that the work waits on
is resolved, and a callback scheduled after it cancels the caller at the chosen turn."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from sqllocker.asyncio.concurrency import InFlight, shielded


def _work(gate: asyncio.Future[None], steps: list[str]) -> Any:
    async def work() -> str:
        steps.append("started")
        await gate
        steps.append("finished")
        return "won"

    return work()


async def test_the_work_starts_in_the_callers_step_and_its_result_is_returned() -> None:
    gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    steps: list[str] = []
    undone: list[str] = []
    caller = asyncio.ensure_future(shielded(_work(gate, steps), "test", undone.append))
    await asyncio.sleep(0)  # the caller's first step
    assert steps == ["started"]
    gate.set_result(None)
    assert await caller == "won"
    assert undone == []


async def test_work_that_never_waits_needs_no_task() -> None:
    async def work() -> str:
        return "at once"

    tasks_before = len(asyncio.all_tasks())
    flight: InFlight[str] = InFlight("test")
    flight.start(work())
    assert flight.done
    assert len(asyncio.all_tasks()) == tasks_before
    assert await flight.wait() == "at once"


async def test_a_caller_cancelled_while_the_work_runs_has_it_undone_when_it_ends() -> None:
    gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    steps: list[str] = []
    undone: list[str] = []
    caller = asyncio.ensure_future(shielded(_work(gate, steps), "test", undone.append))
    await asyncio.sleep(0)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert undone == []  # not yet: the work goes on
    gate.set_result(None)
    for _ in range(5):
        await asyncio.sleep(0)
    assert steps == ["started", "finished"]
    assert undone == ["won"]


async def test_a_caller_cancelled_as_the_result_reaches_it_has_it_undone() -> None:
    """The work ends and sets the caller's future; the caller is cancelled in the same turn,
    before it runs: asyncio then throws CancelledError into it, and the result it was sent
    would be lost with a row nobody holds."""
    loop = asyncio.get_running_loop()
    gate: asyncio.Future[None] = loop.create_future()
    steps: list[str] = []
    undone: list[str] = []
    caller = asyncio.ensure_future(shielded(_work(gate, steps), "test", undone.append))
    await asyncio.sleep(0)
    gate.set_result(None)  # the work's task runs next turn, and sets the caller's future...
    loop.call_soon(caller.cancel)  # ...and this runs right after it, in the same turn
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert steps == ["started", "finished"]
    assert undone == ["won"]


async def test_the_works_error_reaches_its_caller_and_nothing_is_undone() -> None:
    gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    undone: list[object] = []

    async def work() -> str:
        await gate
        raise RuntimeError("refused")

    caller = asyncio.ensure_future(shielded(work(), "test", undone.append))
    await asyncio.sleep(0)
    gate.set_result(None)
    with pytest.raises(RuntimeError, match="refused"):
        await caller
    assert undone == []


async def test_every_caller_waiting_gets_the_end_of_one_run_and_a_cancelled_one_stops_alone() -> (
    None
):
    gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    steps: list[str] = []
    flight: InFlight[str] = InFlight("test")
    flight.start(_work(gate, steps))
    first = asyncio.ensure_future(flight.wait())
    second = asyncio.ensure_future(flight.wait())
    await asyncio.sleep(0)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    gate.set_result(None)
    assert await second == "won"
    assert await flight.wait() == "won"  # a caller after the end gets it at once
    assert steps == ["started", "finished"]  # one run for all of them


async def test_cancelling_the_works_task_cancels_its_waiters() -> None:
    """At the loop's end asyncio cancels every task left, the work's among them."""
    gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    flight: InFlight[str] = InFlight("test")
    flight.start(_work(gate, []))
    waiting = asyncio.ensure_future(flight.wait())
    await asyncio.sleep(0)
    (task,) = [t for t in asyncio.all_tasks() if t.get_name() == "sqllocker: test"]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
