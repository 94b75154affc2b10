"""Background tasks that must outlive the caller who started them (a release whose caller was
cancelled, an async on_lost callback): kept referenced until done, their errors logged."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

logger = logging.getLogger("sqllocker")

T = TypeVar("T")

# The event loop keeps only weak references to tasks; a task nobody else holds may vanish.
_running: set[asyncio.Task[Any]] = set()


def spawn(coroutine: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
    """A task of ``coroutine``'s, kept until done."""
    task = asyncio.get_running_loop().create_task(coroutine, name=f"sqllocker: {name}")
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
