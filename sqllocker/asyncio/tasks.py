"""Background tasks that must outlive the caller who started them (a release whose caller was
cancelled, an async on_lost callback): kept referenced until done, their errors logged."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

logger = logging.getLogger("sqllocker")

T = TypeVar("T")

# The event loop keeps only weak references to tasks; a task nobody else holds may vanish. So
# each loop's are kept in a set of its own, on the loop: a loop closed with one still pending
# (by hand, without asyncio.run's cancelling them) goes with its set, not kept for good.
_KEPT = "_sqllocker_tasks"
# The tasks of loops that take no attribute of ours (a loop written in C may not).
_kept_elsewhere: set[asyncio.Task[Any]] = set()


def running(loop: asyncio.AbstractEventLoop) -> set[asyncio.Task[Any]]:
    """The tasks spawned on ``loop`` that have not ended."""
    kept: set[asyncio.Task[Any]] | None = getattr(loop, _KEPT, None)
    if kept is not None:
        return kept
    return {task for task in _kept_elsewhere if task.get_loop() is loop}


def spawn(coroutine: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
    """A task of ``coroutine``'s, kept until done."""
    loop = asyncio.get_running_loop()
    task = loop.create_task(coroutine, name=f"sqllocker: {name}")
    _kept(loop).add(task)
    task.add_done_callback(_finished)
    return task


def _kept(loop: asyncio.AbstractEventLoop) -> set[asyncio.Task[Any]]:
    kept: set[asyncio.Task[Any]] | None = getattr(loop, _KEPT, None)
    if kept is None:
        kept = set()
        try:
            setattr(loop, _KEPT, kept)
        except AttributeError:
            return _kept_elsewhere
    return kept


def _finished(task: asyncio.Task[Any]) -> None:
    _kept(task.get_loop()).discard(task)
    if task.cancelled():
        return
    error = task.exception()  # retrieved here, so asyncio does not warn if its caller was gone
    if error is not None:
        logger.debug("%s ended with %r", task.get_name(), error)
