"""A deadline for the statements of a lock operation, whatever the driver's own timeouts.

A held lock's release and renewal must not outlive the lock (docs/reliability.md): on a frozen
server or pooler, whose kernel still acknowledges, a statement waits for the driver's read
timeout (MariaDB: a minute) or for ever (libpq has none), and neither TCP keepalives nor
``tcp_user_timeout`` notice. Within ``statements_end_by(deadline)``, every statement a lock
operation sends on this thread is interrupted at the deadline by the backend
(``Backend.interrupt``: the connection's socket shut down, SQLite's ``interrupt()``), which
the driver reports as a lost connection, and a lost connection or a contention is then not
tried again (``passed``); a connection opened within the block gives up by the deadline too.
A wait that no interrupt ends (SQLite's for another connection's write lock) is cut to the
deadline before the statements start (``Backend.bound_waits``). The async front end bounds
its awaits with ``asyncio.wait_for`` instead, within ``waits_end_by`` (the cut, no watcher).
Within ``connections_by(deadline)`` (a lock's wait), a new connection's own timeout is cut to
the deadline (``Backend.cap_connect``).

One watcher thread serves every deadline of the process: it looks at the statements in flight
ten times a second, and ends when it has had none for a while.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, Protocol

from . import clock

logger = logging.getLogger("sqllocker")

# How often the watcher looks, and how long it lingers with nothing to watch.
TICK = 0.1
IDLE_SECONDS = 5.0

# The bounds of the block this runs in: (the statements' deadline, a new connection's deadline,
# the thread or task the latter is for, whether the watcher interrupts the statements), each
# deadline None if there is none. One variable for both, as every release enters a block of
# both.
_bounds: ContextVar[tuple[float | None, float | None, object, bool] | None] = ContextVar(
    "sqllocker_deadlines", default=None
)

# Every lock operation's release enters these blocks, and every statement of one looks at them:
# plain classes, not generator context managers, and no exception raised and caught on the way
# (asyncio.current_task() outside an event loop), as each was a few percent of an SQLite cycle.


class statements_end_by:
    """Within the block, statements of lock operations are interrupted at ``deadline`` (on
    ``clock.now()``), and a new connection gives up by then too (``connections_by``)."""

    __slots__ = ("_deadline", "_token")

    def __init__(self, deadline: float) -> None:
        self._deadline = deadline

    def __enter__(self) -> None:
        self._token = _bounds.set((self._deadline, self._deadline, _owner(), True))

    def __exit__(self, *_exc: object) -> None:
        _bounds.reset(self._token)


class waits_end_by:
    """The async front end's ``statements_end_by``, whose caller stops awaiting at ``deadline``
    (``asyncio.wait_for``): within the block, no statement's wait for another connection's
    lock outlasts the deadline (``Backend.bound_waits``), nor is a contention tried again past
    it; no watcher interrupts them, and new connections keep their own timeout."""

    __slots__ = ("_deadline", "_token")

    def __init__(self, deadline: float) -> None:
        self._deadline = deadline

    def __enter__(self) -> None:
        outer = _bounds.get()
        connections, owner = (None, None) if outer is None else (outer[1], outer[2])
        self._token = _bounds.set((self._deadline, connections, owner, False))

    def __exit__(self, *_exc: object) -> None:
        _bounds.reset(self._token)


class connections_by:
    """Within the block, a new connection gives up at ``deadline`` (on ``clock.now()``), or
    sooner, as the driver's connect timeout says (``Backend.cap_connect``): a wait for a lock
    ends with its ``wait``, whatever a server that accepts and never answers does."""

    __slots__ = ("_deadline", "_token")

    def __init__(self, deadline: float | None) -> None:
        self._deadline = deadline

    def __enter__(self) -> None:
        outer = _bounds.get()
        statements, watched = (None, True) if outer is None else (outer[0], outer[3])
        deadline = self._deadline
        owner = None if deadline is None else _owner()
        self._token = _bounds.set((statements, deadline, owner, watched))

    def __exit__(self, *_exc: object) -> None:
        _bounds.reset(self._token)


def connect_within() -> float | None:
    """Seconds left for a new connection (``connections_by``), or None: the driver's own. A
    task started within the block (a lock's keep-alive, a listener) inherits the context but
    not the deadline: it is the block's own thread's or task's."""
    bounds = _bounds.get()
    if bounds is None or bounds[1] is None or bounds[2] != _owner():
        return None
    return bounds[1] - clock.now()


def _owner() -> object:
    """The task running (asyncio), else the thread."""
    # Asked of the running loop first: current_task() raises outside one, at a cost.
    task = None if asyncio._get_running_loop() is None else asyncio.current_task()
    return task if task is not None else threading.get_ident()


def current() -> float | None:
    """The deadline of the ``statements_end_by`` block this runs in, or None."""
    bounds = _bounds.get()
    return None if bounds is None else bounds[0]


def passed() -> bool:
    """Whether the block's deadline (if any) has passed."""
    deadline = current()
    return deadline is not None and clock.now() >= deadline


class interrupting:
    """Run the block (one statement or a few on ``connection``, a connection of ``backend``'s)
    so that it ends by the deadline of ``statements_end_by``: its waits for other connections'
    locks cut to the deadline (``backend.bound_waits``, undone when it ends, unless it was
    cancelled: the connection is then discarded), and if the deadline passes before it ends,
    ``backend.interrupt(connection)`` called once, from the watcher (never after the block has
    ended). Outside such a block it costs a look at the context, no more.

    ``connection_ended`` says, once the block has ended, whether the watcher interrupted it
    where ``interrupt`` ends the connection (``backend.interrupt_ends_connection``): the
    connection must not serve again, however the block ended. The watcher may fire after the
    block's statements have ended and before the block has: what they did stands."""

    __slots__ = ("_backend", "_connection", "_key", "_undo", "connection_ended")

    def __init__(self, backend: Interruptible, connection: Any) -> None:
        self._backend = backend
        self._connection = connection

    def __enter__(self) -> None:
        self.connection_ended = False
        bounds = _bounds.get()
        deadline = None if bounds is None else bounds[0]
        if deadline is None:
            self._key = self._undo = None
            return
        watched = bounds[3]  # type: ignore[index]  # a deadline: bounds were set
        self._undo = self._backend.bound_waits(self._connection, deadline - clock.now())
        self._key = (
            _watcher.arm(deadline, self._backend.interrupt, self._connection) if watched else None
        )

    def __exit__(self, kind: type[BaseException] | None, *_exc: object) -> None:
        # The watcher first: no interrupt may fall on the restoring statement.
        if self._key is not None and not _watcher.disarm(self._key):
            self.connection_ended = self._backend.interrupt_ends_connection
        if self.connection_ended:
            return  # nothing more is sent on it: its user discards it
        if self._undo is not None and (kind is None or issubclass(kind, Exception)):
            self._backend.unbound_waits(self._connection, self._undo)


class Interruptible(Protocol):
    """What ``interrupting`` asks of a backend (``sqllocker.backends.base.Backend``)."""

    @property
    def interrupt_ends_connection(self) -> bool: ...

    def interrupt(self, dbapi_connection: Any) -> None: ...

    def bound_waits(self, dbapi_connection: Any, seconds: float) -> object | None: ...

    def unbound_waits(self, dbapi_connection: Any, undo: object) -> None: ...


class _Watcher:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed: dict[int, tuple[float, Callable[[Any], None], Any]] = {}
        self._keys = itertools.count()
        self._thread: threading.Thread | None = None

    def arm(self, deadline: float, interrupt: Callable[[Any], None], connection: Any) -> int:
        """Watch a block on ``connection`` until ``disarm(key)``: past ``deadline``, the watcher
        calls ``interrupt(connection)``. Returns the key."""
        key = next(self._keys)
        with self._lock:
            self._armed[key] = (deadline, interrupt, connection)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._watch, name="sqllocker-deadlines", daemon=True
                )
                self._thread.start()
        return key

    def disarm(self, key: int) -> bool:
        """Stop watching; False if the watcher has interrupted the block's connection."""
        # Under the lock: once this returns, the watcher cannot be interrupting this block's
        # connection (which may be closed, and its descriptor reused, right after).
        with self._lock:
            return self._armed.pop(key, None) is not None

    def _watch(self) -> None:
        idle_since: float | None = None
        while True:
            time.sleep(TICK)
            now = clock.now()
            with self._lock:
                if not self._armed:
                    idle_since = idle_since or now
                    if now - idle_since >= IDLE_SECONDS:
                        self._thread = None
                        return
                    continue
                idle_since = None
                for key, (deadline, interrupt, connection) in list(self._armed.items()):
                    if now < deadline:
                        continue
                    del self._armed[key]
                    try:
                        interrupt(connection)
                    except Exception:
                        logger.exception("could not interrupt a statement past its deadline")

    def reset(self) -> None:
        """In a forked child: the parent's watcher thread does not exist here."""
        self._lock = threading.Lock()
        self._armed = {}
        self._thread = None


_watcher = _Watcher()

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_watcher.reset)
