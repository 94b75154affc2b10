"""MySQL/MariaDB: waiters of one lockstring queue in the server, first come, first served, in
``GET_LOCK`` on a name of the table and lockstring, which the server grants in the order it was
asked for. Only the waiter holding it (the head of the queue) polls the row, quickly at first
(``Backoff.heading``), alone; once it has the row it leaves the queue and the next waiter
becomes head, a round trip made in the background, so that lock() returns as soon as the row is
ours. A waiter's first attempt is refused while anyone holds or waits in the queue
(``Statements.acquire_unless_queued``): a newcomer joins the queue rather than taking the row
between a release and the head's INSERT. (PostgreSQL waiters take tickets instead:
``sqllocker.tickets``.)

A waiter keeps its place however long the row is held: giving it up to look at the row would
put it behind everyone who came after it. Instead the room's watch (``Watch``) looks at the
rows of the lockstrings its waiters queue for; a queue that stands still on a free (or
takeable) row under one head for QUEUE_PATIENCE (a head whose process stopped while its
connection lives, or a session outside sqllocker holding the queue's name) has its waits ended
by the server (``KILL QUERY``), and those waiters try the row themselves.

The queue decides only who *tries*; who *holds* is decided by the row alone, as always. A queue
connection that drops, or a name shared by two lockstrings, costs fairness, never safety.

A queued waiter holds a connection of its own while it waits, checked out of the Locker's pool
for that long. A Locker queues at most ``capacity`` waiters at once (``seats_within``: at most
half its connections, so that holders can always release their locks); further waiters wait in
line for a seat, in the order they came (``Seats``).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from . import forks
from .statements import Statements

T = TypeVar("T")
# A queue's key: MySQL's GET_LOCK name, or (PostgreSQL) the ticket ahead of which nobody may
# wait (``sqllocker.tickets``).
QueueKey = int | str

DEFAULT_CAPACITY = 8
# How long a queue may stand still on a free (or takeoverable) row under one head before the
# waiters behind that head try the row themselves. A head whose process stopped (Ctrl-Z, a
# debugger) keeps its place while its connection lives; those behind it would wait for it
# however free the row was.
QUEUE_PATIENCE = 1.0
# MySQL/MariaDB: a GET_LOCK wait without a deadline (a year: the server takes no "for ever").
GET_LOCK_FOREVER = 365 * 24 * 3600.0
# Connections kept open between waits, so that the next wait does not pay for a new one.
KEEP_IDLE = 2

# A queue is stuck when this many looks in a row, QUEUE_PATIENCE from first to last, find its
# row takeable under one head (see Watch).
STUCK_LOOKS = 5


def seats_within(budget: int | None, listening: bool) -> int:
    """How many waiters a Locker queues at once when its pool allows ``budget`` connections in
    all (None: no limit) and, with ``listening``, one goes to the release listener: at most
    DEFAULT_CAPACITY, and at most half of what is left, so that the lock operations (releases
    among them) always have the other half. 0: waiters do not queue."""
    if budget is None:
        return DEFAULT_CAPACITY
    return max(0, min(DEFAULT_CAPACITY, (budget - listening) // 2))


def look_interval() -> float:
    """How often the watch looks at a queue (QUEUE_PATIENCE read when called, so that tests can
    shorten it)."""
    return QUEUE_PATIENCE / (STUCK_LOOKS - 1)


class GetLockQueueWait:
    """MySQL/MariaDB: waiters queue in ``GET_LOCK`` on a name of the table and lockstring,
    which the server grants in the order it was asked for. Nothing is handed over: the head
    polls the row, quickly at first (``Backoff.heading``), alone.

    The names are the server's, not the database's: two tables of one name in two databases
    share their lockstrings' queues, which costs fairness, never safety."""

    def __init__(self, statements: Statements) -> None:
        self._table_key = statements.table_key

    def key(self, lockstring: str) -> QueueKey:
        """The ``GET_LOCK`` name of ``lockstring``'s queue (64 characters at most)."""
        digest = hashlib.blake2b(
            f"{self._table_key}\0{lockstring}".encode(), digest_size=16, person=b"sqllocker"
        ).hexdigest()
        return f"sqllocker:{digest}"

    def statement(self, key: QueueKey, timeout: float | None) -> tuple[str, tuple[Any, ...]]:
        """The statement (and parameters) that waits, at most ``timeout`` seconds, to head the
        queue of ``key``."""
        seconds = GET_LOCK_FOREVER if timeout is None else max(timeout, 0.001)
        return "SELECT GET_LOCK(%s, %s)", (key, seconds)

    def granted(self, row: Any) -> bool:
        """Whether ``statement``'s row says the queue is ours (else the wait ran out)."""
        return row is not None and row[0] == 1

    # Run once on each new queue connection: the server's id of its session, which the watch
    # ends a wait by.
    session_statement = "SELECT CONNECTION_ID()"

    @staticmethod
    def prepare(connection: Any) -> None:
        """Make a new queue connection (the driver's) wait as long as its callers do."""
        from .backends.mysql import wait_patiently

        wait_patiently(connection)

    def leave_statement(self, key: QueueKey) -> tuple[str, tuple[Any, ...]]:
        """The statement that leaves the queue of ``key``."""
        return "SELECT RELEASE_LOCK(%s)", (key,)


AnyQueueWait = GetLockQueueWait


@dataclass(frozen=True)
class Entry(Generic[T]):
    """What came of trying to queue: the Turn if we head the queue now, and whether the room
    may be used again (not when full or failing). Either way the caller tries the row again at
    once: the row may have been released while it queued."""

    turn: T | None
    usable: bool


@dataclass(eq=False)
class InLine:
    """A waiter in a room's line for a seat: ``wake`` is called once it is ``seated``, with
    the ``connection`` its seat comes with (None: open one)."""

    wake: Callable[[], None]
    seated: bool = field(default=False, init=False)
    connection: Any | None = field(default=None, init=False)


class Seats:
    """How many waiters of one room are queued, the waiters in line for a seat when all are
    taken, and the connections kept for the next ones: the bookkeeping shared by the thread
    and the asyncio rooms (never held across I/O).

    A waiter that finds every seat taken waits in line, and a seat given back goes to the
    first in line with its connection: the waiters of one Locker reach the server's queue in
    the order they asked, rather than whichever backed off least."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self.idle: list[Any] = []
        self._line: collections.deque[InLine] = collections.deque()
        self._in_use = 0
        self._pid = forks.pid
        self._closed = False

    def take(self, wake: Callable[[], None]) -> tuple[bool, Any | None, InLine | None]:
        """(whether a seat is ours now, a kept connection to use or None to open one, our
        place in line while every seat is taken); nothing at all once closed."""
        with self._lock:
            if self._pid != forks.pid:
                # A forked child must not touch its parent's sockets, not even to close them.
                self._pid, self.idle, self._in_use = forks.pid, [], 0
                self._line = collections.deque()
            if self._closed:
                return False, None, None
            if self._in_use >= self.capacity or self._line:
                in_line = InLine(wake)
                self._line.append(in_line)
                return False, None, in_line
            self._in_use += 1
            return True, self.idle.pop() if self.idle else None, None

    @property
    def closed(self) -> bool:
        return self._closed

    def leave_line(self, in_line: InLine) -> tuple[bool, Any | None]:
        """Stop waiting in line: (whether a seat became ours meanwhile, its connection)."""
        with self._lock:
            if not in_line.seated:
                with contextlib.suppress(ValueError):
                    self._line.remove(in_line)
            return in_line.seated, in_line.connection

    def give_back(self, connection: Any | None) -> Any | None:
        """Free a seat: to the first waiter in line, with ``connection``; else keeping
        ``connection`` for the next waiter if there is room. Returns it if the caller must
        close it instead (None for a connection of the parent's)."""
        with self._lock:
            if self._pid != forks.pid:
                return None
            if self._line and not self._closed:
                in_line = self._line.popleft()
                in_line.seated, in_line.connection = True, connection
                in_line.wake()
                return None
            self._in_use -= 1
            if connection is not None and not self._closed and len(self.idle) < KEEP_IDLE:
                self.idle.append(connection)
                return None
            return connection

    def close(self) -> list[Any]:
        """No more seats (those in line are woken, unseated); returns the kept connections, to
        be closed."""
        with self._lock:
            self._closed = True
            idle, self.idle = self.idle, []
            line, self._line = self._line, collections.deque()
        for in_line in line:
            in_line.wake()
        return idle


@dataclass(eq=False)
class Blocked:
    """A waiter of a room queued behind the head of ``lockstring``'s queue, in the server session
    ``session``; ``ended`` once the watch has ended its wait."""

    lockstring: str
    key: QueueKey
    session: Any
    ended: bool = field(default=False, init=False)


class Watch:
    """The waits of one room queued behind a head, and what the last look at each of their
    lockstrings found (whether the row was takeable, and the session heading the queue): the
    bookkeeping shared by the thread and the asyncio rooms (never held across I/O).

    A queue is stuck when STUCK_LOOKS looks in a row, ``look_interval()`` apart, find its row
    free (or takeoverable) under the same head: a live head takes a free row within one poll.
    A queue that moves changes heads (sessions are reused, so it may come back to one) and has
    a held row at most looks, so it is all but never mistaken for a stuck one; if it were, its
    waiters would only lose their places."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._blocked: dict[str, list[Blocked]] = {}
        self._seen: dict[str, tuple[Any, int]] = {}  # head, takeable looks in a row
        self._running = False
        self._closed = False
        self._pid = forks.pid
        self.ended = 0  # waits ended, in all

    def add(self, blocked: Blocked) -> bool:
        """Watch ``blocked``; returns whether the caller must start the watching loop."""
        with self._lock:
            if self._pid != forks.pid:  # the parent's loop does not run in a child
                self._pid, self._blocked, self._seen, self._running = forks.pid, {}, {}, False
            self._blocked.setdefault(blocked.lockstring, []).append(blocked)
            start = not self._running and not self._closed
            self._running = self._running or start
            return start

    def remove(self, blocked: Blocked) -> bool:
        """Stop watching ``blocked``; returns whether the watch ended its wait meanwhile."""
        with self._lock:
            waits = self._blocked.get(blocked.lockstring, [])
            if blocked in waits:
                waits.remove(blocked)
                if not waits:
                    del self._blocked[blocked.lockstring]
                    self._seen.pop(blocked.lockstring, None)
            return blocked.ended

    def watched(self) -> list[tuple[str, QueueKey]] | None:
        """The lockstrings to look at now, with their queues' keys; None: the loop stops (no
        wait left to watch, or the room closed)."""
        with self._lock:
            if not self._blocked or self._closed:
                self._running = False
                return None
            return [(lockstring, waits[0].key) for lockstring, waits in self._blocked.items()]

    def saw(self, lockstring: str, takeable: bool, head: Any) -> list[Any]:
        """Record a look at ``lockstring``'s queue; returns the sessions whose waits to end
        (marked ended), if the queue is stuck."""
        with self._lock:
            previous_head, looks = self._seen.get(lockstring, (None, 0))
            looks = 0 if not takeable else looks + 1 if looks and previous_head == head else 1
            self._seen[lockstring] = (head, looks)
            if looks < STUCK_LOOKS:
                return []
            del self._seen[lockstring]
            ending = [b for b in self._blocked.get(lockstring, []) if not b.ended]
            for blocked in ending:
                blocked.ended = True
            self.ended += len(ending)
            return [blocked.session for blocked in ending]

    def close(self) -> None:
        with self._lock:
            self._closed = True
