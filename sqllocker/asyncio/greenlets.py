"""Sync code run on the event loop, in greenlets kept for the next call.

The lock operations are sync code (``operations/``), written once for both front ends; in
asyncio each runs in a greenlet, where SQLAlchemy's ``await_`` hands every driver call to the
event loop. SQLAlchemy's ``greenlet_spawn`` makes a new greenlet for every call, and a new
greenlet's first run allocates a frame stack of its own: a measurable share of an async lock
cycle (CHANGELOG.md). So each thread keeps the greenlets whose call has ended, and runs the
next call in one of them.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from greenlet import GreenletExit, getcurrent, greenlet

from ..sqlalchemy_internals import lets_await

T = TypeVar("T")

# Idle greenlets kept per thread: about as many as a Locker runs operations at once; a
# greenlet beyond them is dropped when its call ends.
KEPT_PER_THREAD = 64


class _Ended:
    """What a worker switches back once its call has ended: its value, or what it raised."""

    __slots__ = ("error", "value")

    def __init__(self, value: Any, error: BaseException | None) -> None:
        self.value = value
        self.error = error


@lets_await
class _Worker(greenlet):  # type: ignore[misc]
    """A greenlet that runs one call after another, each started by a switch from its parent
    (the event loop's greenlet) with the function and its arguments."""

    def __init__(self, parent: greenlet) -> None:
        super().__init__(self._serve, parent)
        self.ended = _Ended(None, None)  # each call's, emptied by ``run`` as it reads it

    def _serve(self, function: Callable[..., Any], args: tuple[Any, ...]) -> None:
        ended = self.ended
        while True:
            try:
                ended.value = function(*args)
            except GreenletExit:
                raise  # the greenlet itself is being thrown away
            except BaseException as error:
                ended.error = error
            function = args = None  # type: ignore[assignment]  # hold nothing while idle
            function, args = self.parent.switch(ended)


class _Idle(threading.local):
    def __init__(self) -> None:
        self.workers: list[_Worker] = []


_idle = _Idle()


async def run(function: Callable[..., T], *args: Any) -> T:
    """``function(*args)`` in a greenlet, where its driver calls (``await_``) are awaited on the
    running event loop; what it returns, or raise what it raised. A cancellation while it
    awaits is thrown into it there, as ``greenlet_spawn`` does."""
    driver = getcurrent()
    idle = _idle.workers
    worker = idle.pop() if idle else None
    if worker is None or worker.parent is not driver:
        worker = _Worker(driver)
    # The caller's context (contextvars), as its own code would see it.
    worker.gr_context = driver.gr_context
    outcome = worker.switch(function, args)
    while type(outcome) is not _Ended:
        try:
            value = await outcome
        except BaseException:
            outcome = worker.throw(*sys.exc_info())
        else:
            outcome = worker.switch(value)
    value, outcome.value = outcome.value, None
    if len(idle) < KEPT_PER_THREAD:
        idle.append(worker)
    if outcome.error is not None:
        error, outcome.error = outcome.error, None
        try:
            raise error
        finally:
            # The error's traceback holds this frame: with the error in it too, the two would
            # keep each other, and every frame the error came through (the connection of the
            # operation it ended), until a garbage collection.
            del error
    return value  # type: ignore[no-any-return]
