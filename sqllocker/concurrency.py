"""Threads: what the generated sync front end does where the asyncio one awaits.

The front end (the locker, the lock handle, the group, the semaphore and the release
listener) is written once, for asyncio, in ``sqllocker/asyncio/``, and its sync twin in
``sqllocker/`` is generated from it (``tests/unasync.py``). Where the async code imports
``sqllocker/asyncio/concurrency.py``, the generated code imports this module: the same names,
for threads.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy.engine import URL, Engine

from . import clock, deadlines
from .decorators import refuse_deferred_work
from .engine import create_locker_engine, resolve_url
from .errors import DatabaseError, LockTypeError
from .operations.waits import THREADS

T = TypeVar("T")

Event = threading.Event
# Reentrant: an on_lost callback, called while an extend holds the lock, may unlock().
OpLock = threading.RLock


class turn_within:
    """``lock`` (an OpLock), held while the block runs if it came free within ``patience()``
    seconds (asked only if it is not free at once); the block is told whether it did. (In
    asyncio the wait is plain: the caller bounds the whole release instead, see
    ``AsyncLockState.release``.)"""

    __slots__ = ("_acquired", "_lock", "_patience")

    def __init__(self, lock: Any, patience: Callable[[], float]) -> None:
        self._lock = lock
        self._patience = patience
        self._acquired = False

    def __enter__(self) -> bool:
        lock = self._lock
        self._acquired = lock.acquire(blocking=False) or lock.acquire(
            timeout=max(0.0, self._patience())
        )
        return self._acquired

    def __exit__(self, *exc_info: object) -> None:
        if self._acquired:
            self._lock.release()


class answered_by:
    """Within the block, the lock statements this thread sends end by ``deadline`` (on
    ``clock.now()``; ``deadlines.statements_end_by``: interrupted), and a lost connection past it
    becomes ``timed_out()``, which says why. (In asyncio the task is cancelled at the deadline.)
    """

    __slots__ = ("_bound", "_deadline", "_timed_out")

    def __init__(self, deadline: float, timed_out: Callable[[], BaseException]) -> None:
        self._bound = deadlines.statements_end_by(deadline)
        self._deadline = deadline
        self._timed_out = timed_out

    def __enter__(self) -> None:
        self._bound.__enter__()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, _tb: Any
    ) -> None:
        self._bound.__exit__()
        if isinstance(error, DatabaseError) and error.outage and clock.now() >= self._deadline:
            raise self._timed_out() from error


# How the lock operations of a Locker wait: for threads.
WAITS = THREADS


def create_engine(
    url: str | URL | None, *, transaction_pooling: bool, max_connections: int | None
) -> Engine:
    return create_locker_engine(
        resolve_url(url), transaction_pooling=transaction_pooling, max_connections=max_connections
    )


def wrong_engine_hint(kind: str) -> str:
    return "; for an AsyncEngine use sqllocker.asyncio.AsyncLocker" if kind == "AsyncEngine" else ""


def check_decorated(function: Callable[..., Any]) -> None:
    """A function that does its work when called: not a coroutine function (nor one marked as
    such, as Django marks an async view's ``as_view()``), nor a generator function."""
    if inspect.iscoroutinefunction(function) or asyncio.iscoroutinefunction(function):
        raise LockTypeError(
            f"{function.__qualname__} is a coroutine function: decorate it with "
            "sqllocker.asyncio.AsyncLocker.locked"
        )
    refuse_deferred_work(function)


def task_name() -> str | None:
    """No task: ``holder_details`` records the thread."""
    return None


def run(operation: Callable[..., T], *args: Any) -> T:
    return operation(*args)


def sleep(seconds: float) -> None:
    if seconds > 0:
        time.sleep(seconds)


def wait(event: threading.Event, timeout: float | None) -> None:
    """Until ``event`` is set or ``timeout`` (seconds) has passed."""
    event.wait(timeout)


def woken_from_thread() -> tuple[threading.Event, Callable[[], None]]:
    """An event to ``wait`` for, and a function that sets it from any thread."""
    event = threading.Event()
    return event, event.set


class PooledConnection:
    """A driver connection (``driver``) checked out of the engine's pool for as long as it is
    needed (queued waits, the release listener), so that it counts toward the pool's limit;
    ``close`` closes it rather than giving it back, as its session's settings are not the
    pool's."""

    def __init__(self, fairy: Any) -> None:
        self._fairy = fairy
        self.driver: Any = fairy.driver_connection
        self.session: Any = None  # the server's id of its session, once asked

    def close(self) -> None:
        self._fairy.invalidate()


def pooled_connection(engine: Engine, autocommit: bool = True) -> PooledConnection:
    """A PooledConnection of ``engine``'s, in autocommit (psycopg's: ``autocommit``)."""
    connection = PooledConnection(engine.raw_connection())
    if not autocommit:
        return connection
    try:
        connection.driver.autocommit = True
    except BaseException:
        connection.close()
        raise
    return connection


class Background:
    """Calls that must not hold up their caller, each run as soon as it is asked for, as
    asyncio's each run in a task of its own: on an idle thread of this Background's, or on a
    new one while every thread is busy (a forget of a failed acquire's rows looks for them
    again for up to 30 s; a ticket's give-up asked for meanwhile must not wait behind it).
    A thread idle for ``KEEP_IDLE`` seconds ends. A forked child starts afresh, its lock new
    (a thread of the parent's, which does not exist in the child, may have held it as it
    forked): the parent's calls and threads are not the child's. The calls must not raise:
    the tickets' give-up (``_leave_line``) logs a failure instead."""

    KEEP_IDLE = 30.0

    def __init__(self, name: str) -> None:
        self._name = name
        self._start_afresh()
        _backgrounds.add(self)

    def _start_afresh(self) -> None:
        self._turn = threading.Condition(threading.Lock())
        self._pending: collections.deque[tuple[Callable[..., Any], tuple[Any, ...]]]
        self._pending = collections.deque()
        self._idle = 0  # threads waiting for a call
        self._threads: set[threading.Thread] = set()
        self._closing = False

    def call_soon(self, function: Callable[..., Any], *args: Any) -> None:
        with self._turn:
            self._pending.append((function, args))
            if len(self._pending) > self._idle:
                thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
                self._threads.add(thread)
                thread.start()
            else:
                self._turn.notify()

    def _serve(self) -> None:
        with self._turn:
            try:
                while True:
                    while self._pending:
                        function, args = self._pending.popleft()
                        self._turn.release()
                        try:
                            function(*args)
                        finally:
                            function = args = None  # type: ignore[assignment]
                            self._turn.acquire()
                    if self._closing:
                        return
                    self._idle += 1
                    called = self._turn.wait(self.KEEP_IDLE)
                    self._idle -= 1
                    if not called and not self._pending:
                        return
            finally:
                self._threads.discard(threading.current_thread())

    def close(self) -> None:
        """Wait (a while) for the calls already asked for."""
        with self._turn:
            self._closing = True
            self._turn.notify_all()
            threads = list(self._threads)
        until = time.monotonic() + 10
        for thread in threads:
            thread.join(max(0.0, until - time.monotonic()))


_backgrounds: weakref.WeakSet[Background] = weakref.WeakSet()


def _start_afresh_in_child() -> None:
    for background in list(_backgrounds):
        background._start_afresh()


os.register_at_fork(after_in_child=_start_afresh_in_child)
