"""The connections a Locker's lock operations run on, for an engine sqllocker made.

A lock cycle is two statements, each on a connection checked out for it alone (holding a lock
holds no connection). SQLAlchemy's pool builds a proxy with a ``weakref.finalize`` for every
checkout, and on a small VM whatever runs right after a round trip runs several times slower
than in a tight loop (the CPU idled while the server worked). So the lock operations
keep driver connections of their own on a stack instead, each with its one cursor. An
AsyncLocker's stack holds its engine's adapted connections, taken and given back in the greenlets
its lock operations run in; its callers wait for one at the limit as tasks do
(``sqllocker.asyncio.concurrency.ConnectionChanges``), not as threads do.

They come from the engine's pool (``raw_connection()``, so its connect-time settings apply:
AUTOCOMMIT, SQLite's WAL, PostgreSQL's synchronous_commit) and are detached from it for good:
the pool's idle set-up connection becomes the stack's first. The pool's limits still hold: at
most ``pool_size`` connections are kept idle, at most ``pool_size + max_overflow`` are open at
once (less the one the Locker reserves for its listener), and a caller beyond
that waits up to the pool's timeout, as the pool would make it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.pool import QueuePool

from . import forks
from .execution import DriverSession
from .sqlalchemy_internals import most_connections

logger = logging.getLogger("sqllocker")


class StackedConnection:
    """One connection of the stack, the cursor every operation on it uses, and ``session``:
    the lock operations' wrapper of the two, made on the connection's first operation and kept
    for the rest."""

    __slots__ = ("connection", "cursor", "session")

    def __init__(self, connection: Any) -> None:
        self.connection = connection
        self.cursor = connection.cursor()
        self.session: DriverSession | None = None


class ConnectionStack:
    """Driver connections for lock operations, most recently used first.

    Taking and giving back is a list pop and append, atomic in CPython; a lock is taken only to
    open a connection, or to wait for one at the limit (``threading.BoundedSemaphore``, pure
    Python, cost more than the pop and append on every operation).
    """

    def __init__(self, engine: Engine, changes: Callable[[], Any] = threading.Condition) -> None:
        pool = engine.pool
        if not isinstance(pool, QueuePool):
            raise TypeError(f"ConnectionStack needs a QueuePool, not {type(pool).__name__}")
        self._engine = engine
        self._keep = pool.size()
        self._limit = most_connections(pool)  # less those reserved for others (``reserve``)
        self._timeout = pool.timeout()
        self._parents: list[StackedConnection] = []
        self._idle: list[StackedConnection] = []
        self._new_changes = changes
        self._reset()
        sa.event.listen(engine, "engine_disposed", self._engine_disposed)

    def _reset(self) -> None:
        """Start empty: at creation, and in a forked child, which must not use its parent's
        connections, nor close them: they are kept referenced, so that no driver's finaliser
        can close (or, worse, log off) a connection the parent is still using."""
        self._pid = forks.pid
        self._parents += self._idle
        self._start_empty()

    def _start_empty(self) -> None:
        self._idle = []
        self._open = 0  # idle and in use; changed only under _changes
        self._waiting = 0  # callers in _open_or_wait; changed only under _changes
        self._changes = self._new_changes()

    def take(self) -> StackedConnection:
        """A connection for one operation; give it back, or discard it, when done.

        Raises the driver's (or SQLAlchemy's) error if a new connection cannot be opened, and
        ``sqlalchemy.exc.TimeoutError`` if the limit is reached and none is given back within
        the pool's timeout.
        """
        if self._pid != forks.pid:
            self._reset()
        try:
            return self._idle.pop()
        except IndexError:
            return self._open_or_wait()

    def _open_or_wait(self) -> StackedConnection:
        deadline: float | None = None
        with self._changes:
            # Counted before looking at the idle list: a connection given back after the look
            # is given back by someone who then sees a waiter, and wakes it.
            self._waiting += 1
            try:
                while True:
                    if self._idle:
                        with contextlib.suppress(IndexError):  # another thread was quicker
                            return self._idle.pop()
                        continue
                    if self._limit is None or self._open < self._limit:
                        self._open += 1
                        break
                    now = time.monotonic()
                    deadline = now + self._timeout if deadline is None else deadline
                    if now >= deadline:
                        raise sa.exc.TimeoutError(
                            f"all {self._limit} lock connections were in use for "
                            f"{self._timeout:g} s"
                        )
                    self._changes.wait(deadline - now)
            finally:
                self._waiting -= 1
        try:
            fairy = self._engine.raw_connection()
            held = StackedConnection(fairy.dbapi_connection)
            fairy.detach()  # ours for good: it never goes back to the pool
        except BaseException:
            self._forget_one()
            raise
        return held

    def reserve(self, count: int) -> None:
        """Leave ``count`` more of the pool's connections to others (the Locker's queued
        waiters and release listener, checked out of the pool itself): the stack opens that
        many fewer, so that together they stay within the pool's limit. Called before the
        stack has opened any."""
        with self._changes:
            if self._limit is not None:
                self._limit -= count

    def give_back(self, held: StackedConnection) -> None:
        """An operation ended with the connection in a known, reusable state."""
        if self._pid != forks.pid:
            return  # taken before a fork: the parent's
        if self._waiting or len(self._idle) < self._keep:
            self._idle.append(held)
            if self._waiting:
                with self._changes:
                    self._changes.notify()
        else:
            self._close(held)

    def discard(self, held: StackedConnection) -> None:
        """An operation ended with the connection dead or in an unknown state: close it."""
        if self._pid != forks.pid:
            return
        self._close(held)

    def forget(self) -> None:
        """Drop every connection without closing it: an AsyncLocker's, made on an event loop
        that has ended, which alone could close them. Unlike a forked child's, they are not
        kept: nobody else uses them, and the garbage collector may end them."""
        self._start_empty()

    def _engine_disposed(self, _engine: Engine) -> None:
        """The engine was disposed of, to drop every connection (by sqllocker after a lost one
        or at close, or by its user): the idle ones here go too. In a forked child, whose
        engine is disposed of without closing anything, they are only dropped."""
        if self._pid != forks.pid:
            self._reset()
            return
        while True:
            try:
                held = self._idle.pop()
            except IndexError:
                return
            self._close(held)

    @property
    def open(self) -> int:
        """Connections open now, idle or in use."""
        return self._open

    @property
    def in_use(self) -> int:
        return max(0, self._open - len(self._idle))

    def _close(self, held: StackedConnection) -> None:
        self._forget_one()
        with contextlib.suppress(Exception):
            held.connection.close()

    def _forget_one(self) -> None:
        """One connection fewer is open: a waiter at the limit may open one now."""
        with self._changes:
            self._open -= 1
            self._changes.notify()
