"""A deadline for the statements of a lock operation, whatever the driver's own timeouts.

A held lock's release and renewal must not outlive the lock (docs/reliability.md): on a frozen
server or pooler, whose kernel still acknowledges, a statement waits for the driver's read
timeout (MariaDB: a minute) or for ever (libpq has none), and neither TCP keepalives nor
``tcp_user_timeout`` notice. Within ``statements_end_by(deadline)``, every statement a lock
operation sends on this thread is interrupted at the deadline by the backend
(``Backend.interrupt``: the connection's socket shut down, SQLite's ``interrupt()``), which
the driver reports as a lost connection, and a lost connection is then not tried again
(``passed``); a connection opened within the block gives up by the deadline too. The async
front end bounds its awaits with ``asyncio.wait_for`` instead.
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
from typing import Any

from . import clock

logger = logging.getLogger("sqllocker")

# How often the watcher looks, and how long it lingers with nothing to watch.
TICK = 0.1
IDLE_SECONDS = 5.0

_deadline: ContextVar[float | None] = ContextVar("sqllocker_statement_deadline", default=None)
_connect_deadline: ContextVar[tuple[float, object] | None] = ContextVar(
    "sqllocker_connect_deadline", default=None
)


class statements_end_by:
    """Within the block, statements of lock operations are interrupted at ``deadline`` (on
    ``clock.now()``), and a new connection gives up by then too (``connections_by``)."""

    __slots__ = ("_connections", "_deadline", "_token")

    def __init__(self, deadline: float) -> None:
        self._deadline = deadline
        self._connections = connections_by(deadline)

    def __enter__(self) -> None:
        self._token = _deadline.set(self._deadline)
        self._connections.__enter__()

    def __exit__(self, *exc_info: object) -> None:
        try:
            self._connections.__exit__()
        finally:
            _deadline.reset(self._token)


class connections_by:
    """Within the block, a new connection gives up at ``deadline`` (on ``clock.now()``), or
    sooner, as the driver's connect timeout says (``Backend.cap_connect``): a wait for a lock
    ends with its ``wait``, whatever a server that accepts and never answers does.

    (A class, not a generator: it is entered in every acquire.)"""

    __slots__ = ("_deadline", "_token")

    def __init__(self, deadline: float | None) -> None:
        self._deadline = deadline

    def __enter__(self) -> None:
        deadline = self._deadline
        self._token = _connect_deadline.set(None if deadline is None else (deadline, _owner()))

    def __exit__(self, *exc_info: object) -> None:
        _connect_deadline.reset(self._token)


def connect_within() -> float | None:
    """Seconds left for a new connection (``connections_by``), or None: the driver's own. A
    task started within the block (a lock's keep-alive, a listener) inherits the context but
    not the deadline: it is the block's own thread's or task's."""
    bound = _connect_deadline.get()
    if bound is None or bound[1] != _owner():
        return None
    return bound[0] - clock.now()


def _owner() -> object:
    """The task running (asyncio), else the thread."""
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no event loop in this thread
        task = None
    return task if task is not None else threading.get_ident()


def passed() -> bool:
    """Whether the block's deadline (if any) has passed."""
    deadline = _deadline.get()
    return deadline is not None and clock.now() >= deadline


class interrupting:
    """Run the block (one statement or a few on ``connection``); if the deadline of
    ``statements_end_by`` passes before it ends, call ``interrupt(connection)`` once, from the
    watcher. It is never called after the block has ended.

    (A class, not a generator: it is entered in every lock operation.)"""

    __slots__ = ("_connection", "_interrupt", "_key")

    def __init__(self, interrupt: Callable[[Any], None], connection: Any) -> None:
        self._interrupt = interrupt
        self._connection = connection

    def __enter__(self) -> None:
        deadline = _deadline.get()
        if deadline is None:
            self._key: int | None = None
            return
        interrupt, connection = self._interrupt, self._connection
        self._key = _watcher.arm(deadline, lambda: interrupt(connection))

    def __exit__(self, *exc_info: object) -> None:
        if self._key is not None:
            _watcher.disarm(self._key)


class _Watcher:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed: dict[int, tuple[float, Callable[[], None]]] = {}
        self._keys = itertools.count()
        self._thread: threading.Thread | None = None

    def arm(self, deadline: float, interrupt: Callable[[], None]) -> int:
        key = next(self._keys)
        with self._lock:
            self._armed[key] = (deadline, interrupt)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._watch, name="sqllocker-deadlines", daemon=True
                )
                self._thread.start()
        return key

    def disarm(self, key: int) -> None:
        # Under the lock: once this returns, the watcher cannot be interrupting this block's
        # connection (which may be closed, and its descriptor reused, right after).
        with self._lock:
            self._armed.pop(key, None)

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
                for key, (deadline, interrupt) in list(self._armed.items()):
                    if now < deadline:
                        continue
                    del self._armed[key]
                    try:
                        interrupt()
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
