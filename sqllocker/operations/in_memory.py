"""A database in memory (SQLite's): it lives in its connection, and goes with it.

When it goes (its Locker closed, an AsyncLocker's loop ended or left, the connection closed by
SQLAlchemy's pool as an interrupt landed in it), the next connection opens a new database,
empty, where every lockstring is free. So each lock held in the one that went is lost first,
its holder told (``on_lost``), before a lock of the next can be taken: as the database goes,
as the next connection is made, or, for a lock whose acquire ended as it went, as the acquire
hands it over (refused then: ``LockLost``).
"""

from __future__ import annotations

import weakref
from typing import Protocol

from ..errors import LockLost


class HeldLock(Protocol):
    """What a lock held in a database in memory is asked."""

    held: bool
    lockstring: str
    lock_id: int

    def mark_lost(self, lost: LockLost) -> bool: ...


class DatabaseInMemory:
    """The databases an engine's connections opened one after another: ``number``, the one in
    use (counted from 1, by the connections made); the locks held in it."""

    def __init__(self) -> None:
        self.number = 0
        self._held: weakref.WeakSet[HeldLock] = weakref.WeakSet()

    def connected(self) -> None:
        """A new connection, and so a new database: the one before it (if any) is gone."""
        if self.number:
            self.gone("the connection was closed")
        self.number += 1

    def hold(self, lock: HeldLock, number: int) -> None:
        """Record ``lock``, acquired in database ``number``: lost as that database goes, or
        now (``LockLost``) if it has gone already."""
        if number == self.number:
            self._held.add(lock)
            return
        lost = self._lost(lock, "before its acquire could hand it over")
        lock.mark_lost(lost)
        raise lost

    def gone(self, why: str) -> None:
        """The database in use goes (``why``): every lock still held in it is lost, and so is
        any whose acquire ended in it and is yet to be handed over."""
        self.number += 1
        held = list(self._held)
        self._held.clear()
        interrupted: BaseException | None = None
        for lock in held:
            if not lock.held:
                continue
            try:
                lock.mark_lost(self._lost(lock, why))
            except BaseException as error:  # an on_lost interrupted: the others are told too
                interrupted = interrupted or error
        if interrupted is not None:
            raise interrupted

    @staticmethod
    def _lost(lock: HeldLock, why: str) -> LockLost:
        return LockLost(
            f"lock {lock.lockstring!r} (id {lock.lock_id}) is lost: it was held in a database "
            f"in memory, gone with its connection ({why})",
            lock.lockstring,
            lock.lock_id,
        )
