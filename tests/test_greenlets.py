"""Sync code run on the event loop in greenlets kept for the next call
(``sqllocker.asyncio.greenlets.run``): every lock operation of the async front end runs there,
so each call must behave as in SQLAlchemy's ``greenlet_spawn``, whatever its greenlet ran before:
its awaits reach the event loop, its value and its errors come back, a cancellation reaches it
where it waits, it sees its caller's context, and calls in flight at once never share a greenlet.
"""

from __future__ import annotations

import asyncio
import contextvars
import gc
import threading
import weakref
from typing import Any

import pytest
from greenlet import getcurrent
from sqlalchemy.util import greenlet_spawn

from sqllocker.asyncio import greenlets
from sqllocker.asyncio.greenlets import run

try:
    from sqlalchemy.util import await_
except ImportError:  # SQLAlchemy 2.0 calls it await_only
    from sqlalchemy.util import await_only as await_

_caller_name: contextvars.ContextVar[str] = contextvars.ContextVar("caller_name")


def _slept_and_returned(value: Any) -> tuple[Any, Any]:
    """Awaits the event loop once; its value, and the greenlet it ran in."""
    await_(asyncio.sleep(0))
    return value, getcurrent()


async def test_a_call_awaits_on_the_loop_and_returns_its_value() -> None:
    value, _ = await run(_slept_and_returned, "won")
    assert value == "won"


async def test_calls_one_after_another_reuse_one_greenlet() -> None:
    _, first = await run(_slept_and_returned, 1)
    _, second = await run(_slept_and_returned, 2)
    assert first is second
    # greenlet_spawn's, for contrast: a new greenlet each call (what this module saves).
    _, third = await greenlet_spawn(_slept_and_returned, 3)
    _, fourth = await greenlet_spawn(_slept_and_returned, 4)
    assert third is not fourth


async def test_calls_in_flight_at_once_each_have_a_greenlet_of_their_own() -> None:
    gate = asyncio.Event()
    inside: list[Any] = []

    def waits_for_the_gate(number: int) -> int:
        inside.append(getcurrent())
        await_(gate.wait())
        return number

    calls = [asyncio.ensure_future(run(waits_for_the_gate, number)) for number in range(5)]
    while len(inside) < 5:
        await asyncio.sleep(0)
    assert len({id(worker) for worker in inside}) == 5
    gate.set()
    assert await asyncio.gather(*calls) == [0, 1, 2, 3, 4]


async def test_an_error_comes_back_as_raised_and_the_greenlet_serves_again() -> None:
    def fails() -> None:
        await_(asyncio.sleep(0))
        raise KeyError("the row")

    with pytest.raises(KeyError, match="the row"):
        await run(fails)
    value, _ = await run(_slept_and_returned, "after")
    assert value == "after"


class _Held:
    """What a call's frames hold (a lock operation's connection)."""


async def test_an_error_raised_leaves_no_reference_cycle_holding_the_calls_frames() -> None:
    """What the frames an error came through hold is freed once the error is, without a
    garbage collection: a connection abandoned by a cancelled operation is closed at once."""

    def fails(held: _Held) -> None:
        await_(asyncio.sleep(0))
        raise KeyError("the row")

    held = _Held()
    freed = weakref.ref(held)
    gc.disable()
    try:
        with pytest.raises(KeyError):
            await run(fails, held)
        del held
        assert freed() is None, "held by a reference cycle until a garbage collection"
    finally:
        gc.enable()


async def test_a_cancellation_is_thrown_in_where_the_call_awaits() -> None:
    seen: list[str] = []
    started = asyncio.Event()

    def waits_forever() -> None:
        started.set()
        try:
            await_(asyncio.Event().wait())
        except asyncio.CancelledError:
            seen.append("cancelled inside")
            raise

    call = asyncio.ensure_future(run(waits_forever))
    await started.wait()
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert seen == ["cancelled inside"]
    value, _ = await run(_slept_and_returned, "next")  # and its greenlet serves again
    assert value == "next"


async def test_a_call_sees_its_callers_context_whichever_greenlet_runs_it() -> None:
    def name_seen() -> str:
        await_(asyncio.sleep(0))
        return _caller_name.get("none")

    async def caller(name: str) -> str:
        _caller_name.set(name)
        return await run(name_seen)

    # One after another (one greenlet serves both), then at once.
    assert await asyncio.ensure_future(caller("first")) == "first"
    assert await asyncio.ensure_future(caller("second")) == "second"
    assert await asyncio.gather(caller("a"), caller("b"), caller("c")) == ["a", "b", "c"]
    assert await run(name_seen) == "none"


def test_each_thread_runs_its_calls_in_greenlets_of_its_own() -> None:
    async def two_calls() -> tuple[Any, Any]:
        _, first = await run(_slept_and_returned, None)
        _, second = await run(_slept_and_returned, None)
        return first, second

    found: dict[str, tuple[Any, Any]] = {}

    def in_thread(name: str) -> None:
        found[name] = asyncio.run(two_calls())

    threads = [threading.Thread(target=in_thread, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert found["a"][0] is found["a"][1]
    assert found["b"][0] is found["b"][1]
    assert found["a"][0] is not found["b"][0]


async def test_no_more_idle_greenlets_are_kept_than_the_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(greenlets, "KEPT_PER_THREAD", 2)
    # An empty pool: the tests before this one on the same thread may have left some.
    monkeypatch.setattr(greenlets, "_idle", greenlets._Idle())
    gate = asyncio.Event()

    def waits_for_the_gate() -> None:
        await_(gate.wait())

    calls = [asyncio.ensure_future(run(waits_for_the_gate)) for _ in range(4)]
    await asyncio.sleep(0)
    gate.set()
    await asyncio.gather(*calls)
    assert len(greenlets._idle.workers) <= 2
