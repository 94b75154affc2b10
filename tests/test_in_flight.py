"""The async front end's lock operations run to their end whoever stops waiting for them
(``sqllocker.asyncio.concurrency.InFlight``): what a cancelled caller would have got is undone,
however the cancellation and the work's end fall, and nothing is undone that a caller got.
A held lock's statements end by a deadline (``within``): the caller stops waiting at once,
and the work is cancelled and left to end by itself.

Each case is timed by the event loop's own order (no sleeps): a future that the work waits on
is resolved, and a callback scheduled after it cancels the caller at the chosen turn."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import pytest

from sqllocker import DatabaseError, LockError, LockLost, TableMissing
from sqllocker.asyncio import concurrency
from sqllocker.asyncio.concurrency import InFlight, shielded, within


def _work(gate: asyncio.Future[None], steps: list[str]) -> Any:
    async def work() -> str:
        steps.append("started")
        await gate
        steps.append("finished")
        return "won"

    return work()


def _tasks_named(name: str) -> list[asyncio.Task[Any]]:
    return [task for task in asyncio.all_tasks() if task.get_name() == f"sqllocker: {name}"]


async def test_the_work_runs_in_the_callers_task_and_its_result_is_returned() -> None:
    gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    steps: list[str] = []
    undone: list[str] = []
    caller = asyncio.ensure_future(shielded(_work(gate, steps), "test", undone.append))
    await asyncio.sleep(0)  # the caller's first step
    assert steps == ["started"]
    assert _tasks_named("test") == []
    gate.set_result(None)
    assert await caller == "won"
    assert undone == []


async def test_the_caller_has_the_result_in_the_turn_the_works_wait_ends() -> None:
    """A task of the work's own would hand its result over one turn of the event loop later
    (and, unless eager, start one turn late): two turns an operation, in every lock cycle."""
    gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    caller = asyncio.ensure_future(shielded(_work(gate, []), "test", lambda _: None))
    await asyncio.sleep(0)
    gate.set_result(None)  # wakes the caller in the next turn...
    await asyncio.sleep(0)  # ...which runs before this one
    assert caller.done()
    assert caller.result() == "won"


async def test_work_that_never_waits_needs_no_task() -> None:
    async def work() -> str:
        return "at once"

    tasks_before = len(asyncio.all_tasks())
    flight: InFlight[str] = InFlight("test")
    assert await flight.run(work()) == "at once"
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
        await caller  # at once: the work's wait has not ended
    assert not gate.cancelled()
    assert undone == []  # not yet: the work goes on, in a task of its own
    assert len(_tasks_named("test")) == 1
    gate.set_result(None)
    for _ in range(5):
        await asyncio.sleep(0)
    assert steps == ["started", "finished"]
    assert undone == ["won"]


async def test_a_caller_cancelled_after_the_works_wait_ended_has_it_undone() -> None:
    """The work's future is done and the caller is to go on with it in the next turn, but is
    cancelled first: asyncio then throws CancelledError into the caller instead, and what the
    work would have gone on to win would be a row nobody holds."""
    gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    steps: list[str] = []
    undone: list[str] = []
    caller = asyncio.ensure_future(shielded(_work(gate, steps), "test", undone.append))
    await asyncio.sleep(0)
    gate.set_result(None)
    caller.cancel()  # the same step: before the caller runs again
    with pytest.raises(asyncio.CancelledError):
        await caller
    for _ in range(5):
        await asyncio.sleep(0)
    assert steps == ["started", "finished"]
    assert undone == ["won"]


async def test_the_works_own_future_cancelled_is_the_works_to_handle() -> None:
    """Not the caller's cancellation: the work is told, as it would be in a task of its own,
    and the caller gets what the work makes of it."""
    gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    undone: list[str] = []

    async def work() -> str:
        try:
            await gate
        except asyncio.CancelledError:
            return "told"
        return "not told"

    caller = asyncio.ensure_future(shielded(work(), "test", undone.append))
    await asyncio.sleep(0)
    gate.cancel()
    assert await caller == "told"
    assert undone == []


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


async def test_every_caller_gets_the_end_of_one_run_and_a_cancelled_one_stops_alone() -> None:
    gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    steps: list[str] = []
    undone: list[str] = []
    flight: InFlight[str] = InFlight("test", undone.append)
    first = asyncio.ensure_future(flight.run(_work(gate, steps)))
    second = asyncio.ensure_future(flight.wait())
    await asyncio.sleep(0)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    gate.set_result(None)
    assert await second == "won"
    assert await flight.wait() == "won"  # a caller after the end gets it at once
    assert steps == ["started", "finished"]  # one run for all of them
    assert undone == []  # a caller got it


async def test_cancelling_the_works_task_cancels_its_waiters() -> None:
    """At the loop's end asyncio cancels every task left, the work's among them (once its first
    caller was cancelled, it runs in a task of its own)."""
    gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    flight: InFlight[str] = InFlight("test")
    first = asyncio.ensure_future(flight.run(_work(gate, [])))
    waiting = asyncio.ensure_future(flight.wait())
    await asyncio.sleep(0)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    (task,) = _tasks_named("test")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting


# -- within: a deadline, the work in the caller's own task ---------------------------------------


def _slow_to_cancel(gate: asyncio.Future[None], steps: list[str]) -> Any:
    """Work that, cancelled, still waits for ``gate`` before it ends (as psycopg's cancel
    request waits for a frozen server)."""

    async def work() -> str:
        steps.append("started")
        try:
            await asyncio.get_running_loop().create_future()  # never done
        except asyncio.CancelledError:
            steps.append("cancelled")
            await gate
            steps.append("ended")
            raise
        return "never"

    return work()


async def test_within_runs_the_work_in_the_callers_task() -> None:
    gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    steps: list[str] = []
    caller = asyncio.ensure_future(within(_work(gate, steps), 60, "test"))
    await asyncio.sleep(0)
    assert steps == ["started"]
    assert _tasks_named("test") == []
    gate.set_result(None)
    await asyncio.sleep(0)  # the caller has the result in the turn the work's wait ends
    assert caller.done()
    assert caller.result() == "won"
    assert _tasks_named("test") == []


async def _turns_until(done: Any, turns: int = 10) -> None:
    """Let the event loop run until ``done()``, a few turns at most."""
    for _ in range(turns):
        if done():
            return
        await asyncio.sleep(0)


async def test_within_raises_timeout_at_the_deadline_and_leaves_the_work_cancelled() -> None:
    gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    steps: list[str] = []
    with pytest.raises(asyncio.TimeoutError):
        await within(_slow_to_cancel(gate, steps), 0.01, "test")
    # At once, though the work is still ending, in a task of its own.
    (task,) = _tasks_named("test")
    await _turns_until(lambda: "cancelled" in steps)
    assert steps == ["started", "cancelled"]
    gate.set_result(None)
    with pytest.raises(asyncio.CancelledError):
        await task
    assert steps == ["started", "cancelled", "ended"]


async def test_within_ends_at_the_deadline_however_long_a_task_it_awaits_takes_to_end() -> None:
    """Work that waits on a task: cancelled, the task may take its time to end (here until
    ``gate``); the caller has its TimeoutError at once all the same."""
    gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    steps: list[str] = []

    async def work() -> str:
        return await asyncio.ensure_future(_slow_to_cancel(gate, steps))

    with pytest.raises(asyncio.TimeoutError):
        await within(work(), 0.01, "test")
    await _turns_until(lambda: "cancelled" in steps)
    assert steps == ["started", "cancelled"]
    (task,) = _tasks_named("test")  # the work, until the task it waits on has ended
    gate.set_result(None)
    with pytest.raises(asyncio.CancelledError):
        await task
    assert steps == ["started", "cancelled", "ended"]


async def test_within_gives_the_callers_cancellation_to_the_caller_at_once() -> None:
    gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    steps: list[str] = []
    caller = asyncio.ensure_future(within(_slow_to_cancel(gate, steps), 60, "test"))
    await asyncio.sleep(0)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    (task,) = _tasks_named("test")
    await _turns_until(lambda: "cancelled" in steps)
    assert steps == ["started", "cancelled"]
    gate.set_result(None)
    with pytest.raises(asyncio.CancelledError):
        await task
    assert steps == ["started", "cancelled", "ended"]


async def test_within_a_flight_the_deadline_holds_after_the_flights_caller_left() -> None:
    """A release runs to its end (``InFlight``) and its statement ends by the lock's expiry
    (``within``): a caller that stops waiting leaves the deadline in force."""
    gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    steps: list[str] = []
    flight: InFlight[str] = InFlight("flight")

    async def bounded() -> str:
        try:
            return await within(_slow_to_cancel(gate, steps), 0.05, "test")
        except asyncio.TimeoutError:
            steps.append("timed out")
            raise

    caller = asyncio.ensure_future(flight.run(bounded()))
    await asyncio.sleep(0)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert len(_tasks_named("flight")) == 1  # the flight goes on without its caller
    with pytest.raises(asyncio.TimeoutError):
        await flight.wait()
    (task,) = _tasks_named("test")
    await _turns_until(lambda: "cancelled" in steps)
    assert steps == ["started", "timed out", "cancelled"]
    gate.set_result(None)
    with pytest.raises(asyncio.CancelledError):
        await task
    assert steps[-1] == "ended"


@pytest.mark.parametrize("first", ["caller", "deadline"])
async def test_within_a_flight_the_callers_cancellation_and_the_deadline_in_one_turn(
    monkeypatch: pytest.MonkeyPatch, first: str
) -> None:
    """The flight's caller cancelled in the very turn the deadline comes, before or after it:
    the flight's work still ends by the deadline (its statement cancelled), wherever it goes
    on."""
    gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    steps: list[str] = []
    flight: InFlight[str] = InFlight("flight")
    callers: list[asyncio.Future[str]] = []
    expire = concurrency._Bounded.expire

    def in_one_turn(bounded: Any) -> None:
        if first == "caller":
            callers[0].cancel()
            expire(bounded)
        else:
            expire(bounded)
            callers[0].cancel()

    monkeypatch.setattr(concurrency._Bounded, "expire", in_one_turn)
    callers.append(
        asyncio.ensure_future(flight.run(within(_slow_to_cancel(gate, steps), 0.01, "test")))
    )
    with pytest.raises((asyncio.CancelledError, asyncio.TimeoutError)):
        await callers[0]
    await _turns_until(lambda: "cancelled" in steps)  # the statement, cut off by its deadline
    assert steps == ["started", "cancelled"]
    gate.set_result(None)
    await _turns_until(lambda: flight.done)
    assert flight.done
    for task in _tasks_named("test") + _tasks_named("flight"):
        with contextlib.suppress(asyncio.CancelledError, asyncio.TimeoutError):
            await task


async def test_within_a_flight_the_deadline_reaches_the_flights_caller() -> None:
    gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    steps: list[str] = []
    flight: InFlight[str] = InFlight("flight")
    with pytest.raises(asyncio.TimeoutError):
        await flight.run(within(_slow_to_cancel(gate, steps), 0.01, "test"))
    (task,) = _tasks_named("test")
    await _turns_until(lambda: "cancelled" in steps)
    assert steps == ["started", "cancelled"]
    gate.set_result(None)
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.skipif(not hasattr(asyncio.Task, "cancelling"), reason="Python 3.11's cancelling()")
async def test_within_a_cancellation_in_the_deadlines_turn_is_the_callers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The caller cancelled after the deadline woke it, before it runs again: CancelledError,
    as for a cancellation before the deadline, not TimeoutError."""
    gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    steps: list[str] = []
    callers: list[asyncio.Future[str]] = []
    expire = concurrency._Bounded.expire

    def expire_then_cancel(bounded: Any) -> None:
        expire(bounded)
        callers[0].cancel()

    monkeypatch.setattr(concurrency._Bounded, "expire", expire_then_cancel)
    callers.append(asyncio.ensure_future(within(_slow_to_cancel(gate, steps), 0.01, "test")))
    with pytest.raises(asyncio.CancelledError):
        await callers[0]
    gate.set_result(None)
    (task,) = _tasks_named("test")
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_within_work_that_never_waits_needs_no_task() -> None:
    async def work() -> str:
        return "at once"

    tasks_before = len(asyncio.all_tasks())
    assert await within(work(), 0, "test") == "at once"
    assert len(asyncio.all_tasks()) == tasks_before


async def test_within_bounded_works_share_one_timer_each_ending_at_its_own_deadline() -> None:
    """The loop's bounded works share one timer (``alarm``): set for the earliest deadline,
    then for the earliest still waiting; a work that ends first leaves no deadline behind."""
    loop = asyncio.get_running_loop()
    gates: list[asyncio.Future[None]] = []
    ended: list[str] = []

    async def bounded(name: str, seconds: float) -> None:
        gates.append(loop.create_future())
        try:
            await within(gates[-1], seconds, name)
            ended.append(f"{name} done")
        except asyncio.TimeoutError:
            ended.append(f"{name} timed out")

    def timers() -> int:
        return sum(not timer.cancelled() for timer in loop._scheduled)  # type: ignore[attr-defined]

    timers_before = timers()
    works = [
        asyncio.ensure_future(bounded(name, seconds))
        for name, seconds in [("late", 0.3), ("early", 0.05), ("never", 30), ("first", 0.0)]
    ]
    await asyncio.sleep(0)
    assert timers() == timers_before + 1
    await asyncio.wait_for(asyncio.shield(works[1]), 2)
    assert ended == ["first timed out", "early timed out"]
    await asyncio.wait_for(asyncio.shield(works[0]), 2)
    assert ended[-1] == "late timed out"
    for gate in gates:
        if not gate.done():
            gate.set_result(None)
    await asyncio.gather(*works)
    assert ended[-1] == "never done"
    assert not concurrency.alarm.of(loop)._due
    for _ in range(50):
        await within(asyncio.sleep(0), 30, "quick")
    assert not concurrency.alarm.of(loop)._due


async def test_a_caller_cancelled_at_a_bare_yield_of_the_work_leaves_it_to_go_on() -> None:
    """A work that yields nothing to wait on (``asyncio.sleep(0)``) when its caller is
    cancelled goes on without it."""
    steps: list[str] = []

    async def work() -> str:
        steps.append("started")
        await asyncio.sleep(0)
        steps.append("finished")
        return "won"

    flight: InFlight[str] = InFlight("flight")
    caller = asyncio.ensure_future(flight.run(work()))
    await asyncio.sleep(0)  # the caller's first step: the work's bare yield
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert await flight.wait() == "won"
    assert steps == ["started", "finished"]


async def test_within_on_a_loop_that_cannot_be_referred_to_weakly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bound on a loop that takes no weak reference gets a timer of its own, and its deadline
    holds as well."""

    class NoWeakReference:
        def get(self, _loop: object) -> object:
            raise TypeError("cannot create weak reference")

    monkeypatch.setattr(concurrency.alarm, "_last", None)
    monkeypatch.setattr(concurrency.alarm, "_alarms", NoWeakReference())
    gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    with pytest.raises(asyncio.TimeoutError):
        await within(gate, 0.01, "test")
    assert await within(asyncio.sleep(0, "done"), 30, "test") == "done"


async def test_a_failing_expiry_keeps_no_other_work_past_its_deadline(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Works due at the same ring: one whose expiry fails is logged, and the others still
    expire."""
    loop = asyncio.get_running_loop()
    expired: list[str] = []

    class Work:
        def __init__(self, name: str, fails: bool) -> None:
            self.name, self.fails = name, fails

        def expire(self) -> None:
            expired.append(self.name)
            if self.fails:
                raise RuntimeError("expiry failed")

    alarm = concurrency.alarm.of(loop)
    when = loop.time() + 0.01
    for work in (Work("first", True), Work("second", False)):
        alarm.set(work, when)
    await asyncio.sleep(0.05)
    assert sorted(expired) == ["first", "second"]
    assert "a deadline's expiry failed" in caplog.text


@pytest.mark.parametrize(
    "error",
    [DatabaseError("database is locked"), LockLost("gone"), TableMissing("no table")],
    ids=str,
)
async def test_within_a_database_error_after_the_deadline_is_the_deadlines(
    error: LockError,
) -> None:
    """The work's wait ends with an error in the deadline's turn or later (the loop was busy
    meanwhile): a database error is then the deadline's (what ``timed_out`` makes, caused by
    it), as the sync front end judges it by the clock; another LockError stays what it says."""
    loop = asyncio.get_running_loop()
    gate: asyncio.Future[None] = loop.create_future()

    async def work() -> None:
        await gate

    def fail_and_stall() -> None:
        gate.set_exception(error)
        time.sleep(0.05)  # past the deadline, before the work's task resumes

    loop.call_later(0.01, fail_and_stall)
    timed_out = LockLost("the deadline's")
    with pytest.raises(LockError) as raised:
        await within(work(), 0.03, "test", lambda: timed_out)
    if not isinstance(error, DatabaseError):
        assert raised.value is error
    else:
        assert raised.value is timed_out
        assert raised.value.__cause__ is error
