"""Running an AsyncLocker's clean-up while its event loop shuts down, and not after.

A driver connection made on a loop can be closed only on that loop. asyncio offers no hook for
a loop's end, but ``asyncio.run`` (and pytest-asyncio, and anyone who shuts a loop down
properly) calls ``loop.shutdown_asyncgens()`` while the loop still runs: every async generator
first iterated on the loop is closed there, and its ``finally`` may still await. So an async
generator left suspended at its ``yield`` is that hook. Without it, the connections of a loop
that ended were closed by the garbage collector after the loop had closed: a ResourceWarning
from every driver, and from aiomysql a traceback ("Event loop is closed").
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncGenerator, Awaitable, Callable

from ..errors import LockError


async def _until_loop_end(
    clean_up: weakref.WeakMethod[Callable[[], Awaitable[None]]],
) -> AsyncGenerator[None, None]:
    try:
        yield
    finally:
        method = clean_up()  # weak: watching a locker must not keep it alive
        if method is not None:
            await method()


def at_loop_end(clean_up: Callable[[], Awaitable[None]]) -> AsyncGenerator[None, None]:
    """Await ``clean_up`` (a bound method) when the running loop shuts down its async
    generators. Keep the returned generator referenced: the loop holds it only weakly, and
    once it is gone the loop's end calls nothing."""
    watcher = _until_loop_end(weakref.WeakMethod(clean_up))
    # Started by hand up to its yield, without awaiting: calling asend() hands the generator to
    # the running loop's first-iteration hook, which records it for shutdown_asyncgens().
    first_step = watcher.asend(None)
    try:
        first_step.send(None)
    except StopIteration:
        pass
    else:  # pragma: no cover - the body awaits nothing before its yield
        raise RuntimeError("the loop-end watcher suspended before its yield")
    return watcher


class LoopBinding:
    """The event loop an AsyncLocker's connections, events and tasks belong to, and the watcher
    that cleans up as it shuts down (``at_loop_end``)."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self._loop_end: AsyncGenerator[None, None] | None = None

    def bind(self, owner: object, clean_up: Callable[[], Awaitable[None]]) -> bool:
        """Make the running loop ``owner``'s, whose ``clean_up`` (a bound method) runs as it
        shuts down: whether ``owner`` moves to it from an earlier loop, whose connections,
        events and tasks it must then drop. A LockError if that loop is still running."""
        loop = asyncio.get_running_loop()
        previous = self.loop
        if previous is loop:
            return False
        if previous is not None and previous.is_running():
            raise LockError(
                f"{owner!r} is in use on another event loop that is still running (in "
                "another thread); its connections belong to that loop: make one "
                "AsyncLocker per loop"
            )
        self.loop = loop
        self._loop_end = at_loop_end(clean_up)
        return previous is not None

    def is_running(self) -> bool:
        """Whether the bound loop is the one running now."""
        return self.loop is asyncio.get_running_loop()
