"""Background tasks that must outlive the caller who started them (a release whose caller was
cancelled, an async on_lost callback): kept referenced until done, their errors logged."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

logger = logging.getLogger("sqllocker")

T = TypeVar("T")

# The event loop keeps only weak references to tasks; a task nobody else holds may vanish.
_running: set[asyncio.Task[Any]] = set()


def spawn(coroutine: Coroutine[Any, Any, T], name: str, eager: bool = False) -> asyncio.Task[T]:
    """A task of ``coroutine``'s, kept until done; ``eager`` (Python 3.12 on) runs its first
    step now, in the caller's, up to its first wait."""
    loop, name = asyncio.get_running_loop(), f"sqllocker: {name}"
    if sys.version_info >= (3, 12) and eager:
        task = asyncio.Task(coroutine, loop=loop, name=name, eager_start=True)
    else:
        task = loop.create_task(coroutine, name=name)
    _running.add(task)
    task.add_done_callback(_finished)
    return task


def _finished(task: asyncio.Task[Any]) -> None:
    _running.discard(task)
    if task.cancelled():
        return
    error = task.exception()  # retrieved here, so asyncio does not warn if its caller was gone
    if error is not None:
        logger.debug("%s ended with %r", task.get_name(), error)
