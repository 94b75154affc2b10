"""Every acquire hands its caller what it won, or gives it back: ``acquisition``.

An acquire may win rows before it is done with its caller: a semaphore's permit is in before
it is counted, a waiter wins the row before it gives up its ticket, a group takes several. If
the acquire ends with an exception instead (in asyncio, above all its cancellation at any
await: ``asyncio.wait_for`` and ``asyncio.timeout`` cancel it), nobody holds a handle to what
it won, and garbage collection would release it only once the handle goes, which a kept
exception (its frames hold the handle) can put off until the row expires.

So every acquire runs in an ``acquisition``, and every lock an acquire wins is made into a
handle only by way of its ``Winnings`` (the locker's ``_lock`` asks for them): what an acquire
that ends in an exception has won and still holds is released before the exception goes on.
A statement still running when its caller is cancelled is a step below this: it runs to its
end (``concurrency.InFlight``), and a row it then turns out to have won is released by the
attempt's own undo, since there is never a handle to hand over.

Written once for asyncio; the sync ``sqllocker/acquiring.py`` is generated from it
(``tests/unasync.py``): there an exception (a KeyboardInterrupt, a database error while a
semaphore counts) is what cuts an acquire short.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

if True:  # ASYNC
    import asyncio
    from collections.abc import Coroutine, Generator
    from types import TracebackType

    from .tasks import spawn

if TYPE_CHECKING:
    from .lock import AsyncLock

logger = logging.getLogger("sqllocker")

T = TypeVar("T")


class Winnings:
    """The locks one acquire has won: its caller's if the acquire returns, released if it
    raises (``acquisition``)."""

    __slots__ = ("_locks",)

    def __init__(self) -> None:
        self._locks: list[AsyncLock] = []

    def won(self, lock: AsyncLock) -> AsyncLock:
        """Record ``lock``, just won; returns it."""
        self._locks.append(lock)
        return lock

    async def give_back(self) -> None:
        """Release every lock won that is still held (in asyncio: each release runs to its
        end, whoever stops waiting for it); a failure is logged, not raised."""
        held = [lock for lock in self._locks if lock.is_locked]
        self._locks = []
        if True:  # ASYNC
            releases = [spawn(_give_back(lock), f"give back {lock.lockstring!r}") for lock in held]
            if releases:
                await asyncio.shield(asyncio.gather(*releases))
        else:
            for lock in held:
                _give_back(lock)


async def acquisition(acquire: Callable[..., Awaitable[T]], *args: Any) -> T:
    """What ``acquire(*args, winnings)`` returns, given Winnings of its own; if it raises (or,
    in asyncio, is cancelled), what it won is released before the exception goes on."""
    winnings = Winnings()
    try:
        return await acquire(*args, winnings)
    except BaseException:
        await winnings.give_back()
        raise


async def _give_back(lock: AsyncLock) -> None:
    logger.info(
        "releasing %r (id %d): its acquire ended before handing it over",
        lock.lockstring,
        lock.lock_id,
    )
    # Never handed over, so never held for a window: the row goes at once.
    lock._state.hold_at_least = None
    try:
        await lock.unlock()
    except Exception as error:
        logger.warning(
            "could not release %r (id %d), won by an acquire that ended before handing it "
            "over; it will expire: %s",
            lock.lockstring,
            lock.lock_id,
            error,
        )


if True:  # ASYNC

    class Acquiring:
        """What ``AsyncLocker.lock()`` returns: await it for the lock, or ``async with`` it to
        hold the lock for the block (released at its end, as ``async with lock:`` does)."""

        def __init__(self, acquire: Coroutine[Any, Any, AsyncLock]) -> None:
            self._acquire = acquire
            self._lock: AsyncLock | None = None

        def __await__(self) -> Generator[Any, None, AsyncLock]:
            return self._acquire.__await__()

        async def __aenter__(self) -> AsyncLock:
            self._lock = await self._acquire
            return self._lock

        def __aexit__(
            self,
            exc_type: type[BaseException] | None,
            exc_value: BaseException | None,
            traceback: TracebackType | None,
        ) -> Awaitable[None]:
            assert self._lock is not None
            return self._lock.__aexit__(exc_type, exc_value, traceback)  # no coroutine of its own
