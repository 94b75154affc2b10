# Generated from sqllocker/asyncio/group.py by tests/unasync.py: edit that file, then
# run `python -m tests.unasync`.
"""Several locks taken together: every one of them, or none (``lock_all``).

Written once for asyncio; the sync ``sqllocker/group.py`` is generated from it
(``tests/unasync.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from types import TracebackType

from .errors import LockError
from .holding import GroupBase
from .lock import Lock


class LockGroup(GroupBase[Lock]):
    """Locks taken together by ``lock_all``: ``with`` it, or ``group.unlock()``.
    ``locks`` are the member locks, in canonical order."""

    def unlock(self) -> None:
        """Release every member (each is tried); the first LockLost (or other error) met is
        raised after."""
        self._each(Lock.unlock)

    def extend(self, seconds: float | None = None) -> list[datetime]:
        """Extend every member (see ``extend`` of a lock); LockLost if any is no longer ours."""
        return [lock.extend(seconds) for lock in self.locks]

    def keep_alive(self) -> LockGroup:
        for lock in self.locks:
            lock.keep_alive()
        return self

    def __enter__(self) -> LockGroup:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._each(lambda lock: lock.__exit__(exc_type, exc_value, traceback))

    def _each(self, release: Callable[[Lock], None]) -> None:
        errors: list[BaseException] = []
        for lock in self.locks:
            try:
                release(lock)
            except LockError as error:
                errors.append(error)
        self._first_error(errors)
