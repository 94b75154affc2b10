"""Read-write locks: any number of readers together, or one writer alone (see ``rwlocks.py``).

Written once for asyncio; the sync ``sqllocker/rwlock.py`` is generated from it
(``tests/unasync.py``).
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any

from ..backoff import Backoff
from ..errors import LockError, LockLost
from ..holding import OnLost
from ..rwlocks import (
    READER,
    WRITER,
    check_reader_name,
    reader_lockstring,
    reader_pattern,
    refused,
    writer_pattern,
)
from ..validation import check_lockstring, check_wait
from . import concurrency

if TYPE_CHECKING:
    from ..operations import LockInfo, LockOperations
    from .lock import AsyncLock, Run
    from .locker import AsyncLocker


class AsyncRWLock:
    """Readers together or one writer alone on ``name`` (see ``sqllocker.rwlocks``); from the
    locker's ``rwlock()``."""

    def __init__(
        self, locker: AsyncLocker, operations: LockOperations, run: Run, name: str
    ) -> None:
        self.locker = locker
        self._operations = operations
        self._run = run
        self.name = check_lockstring(name)

    async def read(
        self,
        *,
        wait: float | None = 0,
        expires: float | None = None,
        keep_alive: bool = False,
        on_lost: OnLost | None = None,
        locked_by: dict[str, Any] | None = None,
        hold_at_least: float | None = None,
    ) -> AsyncLock:
        """A reader's lock (a row of its own, ``lock_id`` its fencing token), released as any
        lock is. Waits while a writer holds the name or waits for it; ``wait``, ``expires``,
        ``keep_alive``, ``on_lost``, ``locked_by`` and ``hold_at_least`` are the locker's
        ``lock()``'s. Raises LockBusy once ``wait`` has passed."""
        check_reader_name(self.name)
        backoff = Backoff.for_wait(check_wait(wait, self.name))
        details = {**(locked_by or {}), "rwlock": READER}
        while True:
            if not await self._writers():
                reader = await self.locker.lock(
                    reader_lockstring(self.name),
                    expires=expires,
                    locked_by=details,
                    on_lost=on_lost,
                    hold_at_least=hold_at_least,
                )
                try:
                    writers = await self._writers()
                except BaseException:
                    await _give_back(reader)
                    raise
                if not writers and reader.is_valid():
                    return reader.keep_alive() if keep_alive else reader
                # A writer came in first (it goes before us), or we were held up so long that
                # our row may have expired before we looked: try again.
                await _give_back(reader)
            if backoff.expired():
                raise refused(self.name, READER, wait)
            await concurrency.sleep(backoff.next_delay())

    async def write(
        self,
        *,
        wait: float | None = 0,
        expires: float | None = None,
        keep_alive: bool = False,
        on_lost: OnLost | None = None,
        locked_by: dict[str, Any] | None = None,
        hold_at_least: float | None = None,
    ) -> AsyncLock:
        """The writer's lock (the row ``name`` itself, which also excludes a plain lock of the
        name), once no reader is left; ``lock_id``, its fencing token, is greater than every
        token handed out before it. New readers are refused from the moment it waits. Raises
        LockBusy once ``wait`` has passed (its row given back). With ``hold_at_least``, a row
        given back to take a new token is kept until its window ends, as any release is, and
        the new one waits for it within ``wait``."""
        backoff = Backoff.for_wait(check_wait(wait, self.name))
        details = {**(locked_by or {}), "rwlock": WRITER}
        while True:
            writer = await self.locker.lock(
                self.name,
                expires=expires,
                wait=backoff.remaining(),
                locked_by=details,
                on_lost=on_lost,
                hold_at_least=hold_at_least,
            )
            try:
                newest_reader = await self._wait_out_readers(writer, backoff, wait)
            except LockLost:
                # Held up past its expiry while it waited for readers: the row may have been
                # taken, or readers let in. Start again.
                await _give_back(writer)
                continue
            except BaseException:
                await _give_back(writer)
                raise
            # Valid after the readers were found gone: our row was live when they were read,
            # so no reader can have come in since but through its expiry, as with any lock.
            if newest_reader < writer.lock_id and writer.is_valid():
                return writer.keep_alive() if keep_alive else writer
            # A reader we waited out drew its token after ours (take a new, greater one), or
            # we were held up past our own deadline: try again.
            await _give_back(writer)

    async def holders(self) -> list[LockInfo]:
        """The live readers and writer, ordered by lockstring (``locked_by["rwlock"]`` says
        which is which)."""
        await self._run(self._operations.ensure_setup)
        readers: list[LockInfo] = await self._run(
            self._operations.permits, *reader_pattern(self.name)
        )
        writers: list[LockInfo] = await self._run(
            self._operations.permits, *writer_pattern(self.name)
        )
        return writers + readers

    async def _writers(self) -> int:
        # The count's pattern needs the backend: set up first, as a lock operation would.
        await self._run(self._operations.ensure_setup)
        count: int = await self._run(self._operations.count_live, *writer_pattern(self.name))
        return count

    async def _wait_out_readers(
        self, writer: AsyncLock, backoff: Backoff, wait: float | None
    ) -> int:
        """Hold ``writer`` (renewing it) until no live reader is left; the greatest reader id
        met (0 if none)."""
        newest = 0
        renewed = time.monotonic()
        while True:
            readers: list[LockInfo] = await self._run(
                self._operations.permits, *reader_pattern(self.name)
            )
            if not readers:
                return newest
            newest = max([newest, *(info.lock_id for info in readers)])
            if backoff.expired():
                raise refused(self.name, WRITER, wait)
            if time.monotonic() - renewed > writer.ttl / 3:
                await writer.extend()  # waiting readers out may outlast the writer's expiry
                renewed = time.monotonic()
            await concurrency.sleep(backoff.next_delay())

    def __repr__(self) -> str:
        return f"<AsyncRWLock {self.name!r}>"


async def _give_back(lock: AsyncLock) -> None:
    """Release a row we will not hold after all; if that fails, it expires."""
    with contextlib.suppress(LockError):
        await lock.unlock()
