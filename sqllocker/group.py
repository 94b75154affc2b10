"""Several locks taken together: every one of them, or none (``Locker.lock_all``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import datetime
from types import TracebackType
from typing import Any, Generic, TypeVar

from .errors import LockError, LockLost, LockValueError
from .lock import Lock, LockHandle
from .validation import check_lockstring

HandleT = TypeVar("HandleT", bound=LockHandle[Any])


def canonical_order(lockstrings: object) -> list[str]:
    """``lockstrings`` checked (a non-empty sequence of distinct valid lockstrings) and in the
    one order every group takes its rows in, so that two groups that overlap never wait for
    each other in a circle: by code point, which is also the order of their UTF-8 bytes."""
    if isinstance(lockstrings, str) or not isinstance(lockstrings, Iterable):
        raise LockValueError(
            f"lock_all takes a list of lockstrings, not {type(lockstrings).__name__}"
        )
    checked = [check_lockstring(lockstring) for lockstring in lockstrings]
    if not checked:
        raise LockValueError("lock_all needs at least one lockstring")
    duplicates = sorted({name for name in checked if checked.count(name) > 1})
    if duplicates:
        raise LockValueError(
            f"lock_all was given {', '.join(map(repr, duplicates))} more than once", duplicates[0]
        )
    return sorted(checked)


class GroupBase(Generic[HandleT]):
    """What the sync and async groups share: the member locks, in canonical order."""

    def __init__(self, locks: Sequence[HandleT]) -> None:
        self.locks = list(locks)

    def __iter__(self) -> Iterator[HandleT]:
        return iter(self.locks)

    def __len__(self) -> int:
        return len(self.locks)

    def is_valid(self) -> bool:
        """Whether every member may still be acted on (see ``Lock.is_valid``)."""
        return all(lock.is_valid() for lock in self.locks)

    def check(self) -> None:
        """Raise LockLost unless every member is valid."""
        for lock in self.locks:
            lock.check()

    @staticmethod
    def _first_error(errors: list[BaseException]) -> None:
        """Raise the first of the errors met releasing the members (each was tried)."""
        if errors:
            lost = [error for error in errors if isinstance(error, LockLost)]
            raise (lost or errors)[0]

    def __repr__(self) -> str:
        names = ", ".join(repr(lock.lockstring) for lock in self.locks)
        return f"<{type(self).__name__} {names}>"


class LockGroup(GroupBase[Lock]):
    """Locks taken together by ``Locker.lock_all``: use it as a context manager, or call
    :meth:`unlock`. ``locks`` are the member Locks, in canonical order."""

    def unlock(self) -> None:
        """Release every member (each is tried); the first LockLost (or other error) met is
        raised after."""
        self._each(Lock.unlock)

    def extend(self, seconds: float | None = None) -> list[datetime]:
        """Extend every member (see ``Lock.extend``); LockLost if any is no longer ours."""
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
