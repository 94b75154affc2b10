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
import contextlib
import inspect
import logging
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

logger = logging.getLogger("sqllocker")

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


def wait(event: threading.Event | Wakeup, timeout: float | None) -> None:
    """Until ``event`` is set or ``timeout`` (seconds) has passed."""
    event.wait(timeout)


class Wakeup:
    """What ``woken_from_thread`` gives: ``set()``, from any thread and any number of times,
    ends the one ``wait``. A bare lock, released by the first ``set()``: a thread woken by a
    ``threading.Event`` must then take the Event's own lock, which the setter may still hold,
    and sleep and wake once more; a contended SQLite turn waits on one of these."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()

    def set(self) -> None:
        with contextlib.suppress(RuntimeError):  # set already
            self._lock.release()

    def wait(self, timeout: float | None) -> None:
        # Taken, and not given back: a later set() would find it free and raise.
        self._lock.acquire(True, -1 if timeout is None else max(timeout, 0.0))


def woken_from_thread() -> tuple[Wakeup, Callable[[], None]]:
    """Something to ``wait`` for once, and a function that ends that wait from any thread."""
    wakeup = Wakeup()
    return wakeup, wakeup.set


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
    asyncio's each run in a task of its own: on the thread of this Background's that came
    idle last, or on a new one while every thread is busy (a forget of a failed acquire's rows
    looks for them again for up to 30 s; a ticket's give-up asked for meanwhile must not wait
    behind it), up to ``MOST`` threads, beyond which a call waits for one to come free. A
    thread idle for ``KEEP_IDLE`` seconds ends. A forked child starts afresh, with a lock of
    its own (a thread of the parent's, which does not exist in the child, may have held the
    old one as it forked): the parent's calls and threads are not the child's. A call that
    raises is logged; the calls' own errors are their business (the tickets' give-up,
    ``_leave_line``, logs a failure itself)."""

    KEEP_IDLE = 30.0
    MOST = 16

    def __init__(self, name: str) -> None:
        self._name = name
        self._start_afresh()
        _backgrounds.add(self)

    def _start_afresh(self) -> None:
        self._lock = threading.Lock()
        self._pending: collections.deque[tuple[Callable[..., Any], tuple[Any, ...]]]
        self._pending = collections.deque()
        self._idle: list[threading.Event] = []  # each idle thread's wake-up, the last idle last
        self._threads: set[threading.Thread] = set()
        self._closing = False

    def call_soon(self, function: Callable[..., Any], *args: Any) -> None:
        lock = self._lock
        with lock:
            self._pending.append((function, args))
            if self._idle:
                self._idle.pop().set()
                return
            if len(self._threads) >= self.MOST:
                return  # run by the first thread to come free
            thread = threading.Thread(
                target=self._serve, args=(lock,), name=self._name, daemon=True
            )
            self._threads.add(thread)
            try:
                thread.start()
            except RuntimeError:  # no thread can start (a limit of the process's)
                self._threads.discard(thread)
                if self._threads:
                    return  # run by the first thread to come free
                self._pending.pop()
            else:
                return
        function(*args)  # nobody else to run it: run here rather than never

    def _serve(self, lock: threading.Lock) -> None:
        """Run calls while there are any, then wait for more. ``lock``: the lock this thread
        was started under; forked within a call, this thread is the child's, whose Background
        has a lock of its own: it leaves both alone and ends once the call returns."""
        wake = threading.Event()
        try:
            while self._lock is lock:
                with lock:
                    if self._pending:
                        function, args = self._pending.popleft()
                    elif self._closing:
                        return
                    else:
                        wake.clear()
                        self._idle.append(wake)
                        function = None
                if function is not None:
                    try:
                        function(*args)
                    except Exception:
                        logger.exception("a background call of %s failed", self._name)
                    function = args = None  # type: ignore[assignment]  # hold nothing idle
                elif not wake.wait(self.KEEP_IDLE) and self._lock is lock:
                    with lock:
                        if wake in self._idle:  # idle for KEEP_IDLE, nobody asked: it ends
                            return
                    # Woken as it timed out: a call was handed to it.
        finally:
            if self._lock is lock:
                with lock:
                    self._threads.discard(threading.current_thread())
                    if wake in self._idle:
                        self._idle.remove(wake)

    def close(self) -> None:
        """Wait (a while) for the calls already asked for."""
        with self._lock:
            self._closing = True
            for wake in self._idle:
                wake.set()
            self._idle.clear()
            threads = [
                thread for thread in self._threads if thread is not threading.current_thread()
            ]
        until = time.monotonic() + 10
        for thread in threads:
            thread.join(max(0.0, until - time.monotonic()))


_backgrounds: weakref.WeakSet[Background] = weakref.WeakSet()


def _start_afresh_in_child() -> None:
    for background in list(_backgrounds):
        background._start_afresh()


os.register_at_fork(after_in_child=_start_afresh_in_child)
