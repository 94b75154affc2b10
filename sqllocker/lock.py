"""A held lock: the handle a caller keeps while its row exists, and gives back with unlock().

A Lock holds no connection and no transaction, only what identifies its row (``lock_id`` and
the secret ``guid``). Every later statement matches both, so a Lock whose row expired and was
taken over can never touch the new holder's row.
"""

from __future__ import annotations

import logging
import os
import weakref
from datetime import datetime
from types import TracebackType
from typing import TYPE_CHECKING, Any

from .errors import LockLost

if TYPE_CHECKING:
    from .locker import Locker

logger = logging.getLogger("sqllocker")


class _Row:
    """What the finaliser needs to release an abandoned lock, kept apart from the Lock itself
    (a finaliser that referred to the Lock would keep it alive forever)."""

    __slots__ = ("guid", "held", "lock_id", "locker", "lockstring", "pid")

    def __init__(self, locker: Locker, lockstring: str, lock_id: int, guid: str) -> None:
        self.locker = locker
        self.lockstring = lockstring
        self.lock_id = lock_id
        self.guid = guid
        self.pid = os.getpid()
        self.held = True


def _release_abandoned(row: _Row) -> None:
    """Runs when a held Lock is garbage-collected or the interpreter exits; never raises."""
    if not row.held or row.pid != os.getpid():
        return  # a forked child must not release its parent's lock
    row.held = False
    try:
        row.locker._release(row.lockstring, row.lock_id, row.guid)
        logger.warning(
            "lock %r (id %d) was released by garbage collection; unlock() it or use `with`",
            row.lockstring,
            row.lock_id,
        )
    except Exception:
        logger.exception("could not release abandoned lock %r (id %d)", row.lockstring, row.lock_id)


class Lock:
    """A lock this process holds. Use it as a context manager, or call :meth:`unlock`."""

    def __init__(
        self,
        locker: Locker,
        *,
        lockstring: str,
        lock_id: int,
        guid: str,
        created: datetime,
        expires: datetime,
        locked_by: dict[str, Any],
        ttl: float,
    ) -> None:
        self.locker = locker
        self.lockstring = lockstring
        self.lock_id = lock_id
        self.guid = guid
        self.created = created
        self.expires = expires
        self.locked_by = locked_by
        self.ttl = ttl
        self._row = _Row(locker, lockstring, lock_id, guid)
        self._finalizer = weakref.finalize(self, _release_abandoned, self._row)

    @property
    def is_locked(self) -> bool:
        """True until unlock() or the discovery that the lock was lost."""
        return self._row.held

    @property
    def fencing_token(self) -> int:
        """The lock id: strictly increasing across acquisitions, for protected resources."""
        return self.lock_id

    def unlock(self) -> None:
        """Delete our row. A second call is a no-op.

        Raises LockLost if the row was no longer ours (purged, taken over or broken after it
        expired): whatever the lock protected may have been touched by someone else meanwhile.
        """
        if not self._row.held:
            return
        self._row.held = False
        self._finalizer.detach()
        self.locker._release(self.lockstring, self.lock_id, self.guid)

    def extend(self, seconds: float | None = None) -> datetime:
        """Set expiry to the server's now + ``seconds`` (default: the lock's own expiry period).

        Raises LockLost, and the lock counts as no longer held, if the row is gone or has
        already expired: an expired lock is never revived, because someone may have acted on it.
        """
        if not self._row.held:
            raise LockLost(
                f"lock {self.lockstring!r} (id {self.lock_id}) is not held: it was released",
                self.lockstring,
                self.lock_id,
            )
        try:
            self.expires = self.locker._extend(self.lockstring, self.lock_id, self.guid, seconds)
        except LockLost:
            self._row.held = False
            self._finalizer.detach()
            raise
        return self.expires

    def __enter__(self) -> Lock:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._row.pid != os.getpid():
            logger.debug("not releasing %r in forked child %d", self.lockstring, os.getpid())
            return
        if exc_value is None:
            self.unlock()
            return
        # The body failed: its exception must reach the caller whatever happens to the release.
        try:
            self.unlock()
        except LockLost as lost:
            # Losing the lock is worth knowing about more than the body's error, which stays
            # attached as the cause.
            raise lost from exc_value
        except Exception:
            logger.exception(
                "could not release lock %r (id %d) after the body raised; it will expire",
                self.lockstring,
                self.lock_id,
            )

    def __repr__(self) -> str:
        state = "held" if self._row.held else "released"
        return (
            f"<Lock {self.lockstring!r} id={self.lock_id} {state} "
            f"expires={self.expires.isoformat(timespec='seconds')}>"
        )
