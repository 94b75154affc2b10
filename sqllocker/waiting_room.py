"""PostgreSQL: waiters of one lockstring queue in the server, first come, first served.

A release's NOTIFY reaches every listening Locker. If every waiter tried for the row on every
release, all but one would be refused (load for nothing), and which one won would be chance:
some waiters would wait far longer than others. So a waiter that has been refused queues on a
session advisory lock keyed by table and lockstring, which the server grants in the order it
was asked for; only the waiter holding it (the head of the queue) tries for the row on each
release. Once the head has the row it leaves the queue and the next waiter becomes head; that
round trip is made by a background thread, so that lock() returns as soon as the row is ours.
A waiter's first attempt is refused while anyone holds or waits in the queue
(``Statements.acquire_unless_queued``): a newcomer joins the queue rather than taking the row
between a release and the head's INSERT. A queued wait lasts at most QUEUE_PATIENCE, so a head
that stopped (its process suspended, its connection alive) holds the others up only that long,
and so does a session outside sqllocker that holds a queue's key. The wait runs in the table's
``_queue_for_hand_off`` function, which ends it without an ERROR in the server's log.

A waiter (sync or async) that becomes the head of the queue leaves a *request* in the same
statement (``Request``), and a release hands it the row in the release's own transaction (see
the migration): the head has the lock when the release commits. The release's NOTIFY tells it
the new row's id, never its guid, and the head reads its row back by id and guid before it
believes it: anyone who can connect can send a NOTIFY. A head that stops waiting withdraws its
request, giving back a row granted meanwhile, in the statement that leaves the queue; one that
got the row by its own INSERT withdraws it before lock() returns, so that no later release can
hand a row to a request nobody waits on.

The advisory lock decides only who *tries*; who *holds* is decided by the row alone, as
always. A queue connection that drops, or a hash shared by two lockstrings, costs fairness,
never safety.

A queued waiter holds a connection of its own while it waits: not one of the pool's, which
holders need to release their locks. A Locker queues at most ``capacity`` waiters at once;
further waiters wait unqueued (woken by NOTIFY, backing off), as they would without the room.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from sqlalchemy.engine import Engine

from . import forks
from .statements import Statements

logger = logging.getLogger("sqllocker")

T = TypeVar("T")

DEFAULT_CAPACITY = 8
# The longest a waiter stays queued before trying the row again. A head whose process stopped
# (Ctrl-Z, a debugger) keeps its place while its connection lives; those behind it would wait
# for it however free the row was. After this long they try the row themselves and, if it is
# still held, queue again (mostly in the same order: they run out of patience in turn).
QUEUE_PATIENCE = 1.0
# Connections kept open between waits, so that the next wait does not pay for a new one.
KEEP_IDLE = 2

# A head that was handed the row leaves by releasing every advisory lock of its session: the
# queue's and the one its request's liveness is told by. A queue connection serves one waiter at
# a time and holds no others.
LEAVE = "SELECT pg_catalog.pg_advisory_unlock_all()"


def patience_ms(timeout: float | None) -> int:
    """How long one queued wait may last, in milliseconds: the caller's remaining ``timeout``
    (None: none) or QUEUE_PATIENCE, whichever is shorter."""
    patience = QUEUE_PATIENCE if timeout is None else min(timeout, QUEUE_PATIENCE)
    return max(1, round(patience * 1000))


@dataclass(frozen=True)
class Request:
    """What a release needs to hand the row to a waiter at the head of the queue: the row it
    would insert itself (guid, holder details, expiry period)."""

    lockstring: str
    guid: str
    holder: dict[str, Any]
    ttl: float


class QueueWait:
    """The statements one table's waiters queue and leave by (psycopg parameters, for the
    thread and the asyncio rooms alike): the table's own functions, called by their full
    names with their exact argument types."""

    def __init__(self, statements: Statements) -> None:
        self._table_key = statements.table_key
        self._wait = (
            f"SELECT {statements.function('queue_for_hand_off')}(%s::bigint, %s::integer, "
            "%s::varchar, %s::varchar, %s::jsonb, %s::double precision)"
        )
        self._leave = (
            f"SELECT {statements.function('queue_leave')}"
            "(%s::bigint, %s::varchar, %s::varchar, %s::boolean)"
        )

    def key(self, lockstring: str) -> int:
        """The advisory lock key of ``lockstring``'s queue in this table."""
        return queue_key(self._table_key, lockstring)

    def statement(
        self, key: int, timeout: float | None, request: Request
    ) -> tuple[str, tuple[Any, ...]]:
        """The statement (and parameters) that waits, at most ``timeout`` seconds, to head the
        queue of ``key``, and leaves ``request`` once it does; its one value says whether it
        heads the queue."""
        holder = json.dumps(request.holder)
        return self._wait, (
            key,
            patience_ms(timeout),
            request.lockstring,
            request.guid,
            holder,
            request.ttl,
        )

    def granted(self, row: Any) -> bool:
        """Whether ``statement``'s row says the queue is ours (else the wait ran out)."""
        return bool(row[0])

    def leave_statement(
        self, key: int, request: Request | None, give_back: bool
    ) -> tuple[str, tuple[Any, ...]]:
        """The statement that leaves the queue of ``key``: withdrawing ``request`` if it still
        stands (and with ``give_back``, deleting a row granted to it); its one value says
        whether a row had been granted."""
        if request is not None:
            return self._leave, (key, request.lockstring, request.guid, give_back)
        return LEAVE, ()


@dataclass(frozen=True)
class Entry(Generic[T]):
    """What came of trying to queue: the Turn if we head the queue now; whether the caller
    must try for the row again at once (it stopped listening to queue, so it may have missed
    a release); and whether the room may be used again (not when full or failing)."""

    turn: T | None
    try_again: bool
    usable: bool


def timed_out(error: BaseException) -> bool:
    """Whether ``error`` is the server giving up a lock wait at lock_timeout (the caller's
    deadline), rather than a failure."""
    return getattr(error, "sqlstate", None) == "55P03"


def queue_key(table: str, lockstring: str) -> int:
    """The advisory lock key of ``lockstring``'s queue: a 64-bit hash, so it is all but certain
    not to meet another lockstring's, nor the small integers applications pick for their own
    advisory locks."""
    digest = hashlib.blake2b(
        f"{table}\0{lockstring}".encode(), digest_size=8, person=b"sqllocker"
    ).digest()
    return int.from_bytes(digest, "big", signed=True)


class Seats:
    """How many waiters of one room are queued, and the connections kept for the next ones:
    the bookkeeping shared by the thread and the asyncio rooms (never held across I/O)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self.idle: list[Any] = []
        self._in_use = 0
        self._pid = forks.pid
        self._closed = False

    def take(self) -> tuple[bool, Any | None]:
        """(whether a seat is free, a kept connection to use or None to open one)."""
        with self._lock:
            if self._pid != forks.pid:
                # A forked child must not touch its parent's sockets, not even to close them.
                self._pid, self.idle, self._in_use = forks.pid, [], 0
            if self._closed or self._in_use >= self.capacity:
                return False, None
            self._in_use += 1
            return True, self.idle.pop() if self.idle else None

    def give_back(self, connection: Any | None) -> Any | None:
        """Free a seat, keeping ``connection`` for the next waiter if there is room; returns
        it if the caller must close it instead (None for a connection of the parent's)."""
        with self._lock:
            if self._pid != forks.pid:
                return None
            self._in_use -= 1
            if connection is not None and not self._closed and len(self.idle) < KEEP_IDLE:
                self.idle.append(connection)
                return None
            return connection

    def close(self) -> list[Any]:
        """No more seats; returns the kept connections, to be closed."""
        with self._lock:
            self._closed = True
            idle, self.idle = self.idle, []
            return idle


class Turn:
    """The head of one lockstring's queue: ``leave()`` once the row is ours, or the wait ends.

    ``request``: the Request it left for a release to grant (None once a release took it).
    """

    def __init__(
        self,
        room: WaitingRoom,
        connection: Any,
        key: int,
        request: Request | None = None,
    ) -> None:
        self._room = room
        self._connection: Any = connection
        self._key = key
        self.request = request

    def leave(self, in_background: bool = False, give_back: bool = True) -> bool:
        """Leave the queue; returns whether a row had been granted to our request (given back
        with ``give_back``; without, it is the caller's).

        ``in_background`` once the row is ours, so the caller has its lock without waiting for
        this round trip (the next waiter could not have the row anyway). Not with a request
        still standing: that must be withdrawn before the caller has its lock, or a release of
        some later holder's row could grant one to a waiter that is gone.
        """
        connection, self._connection = self._connection, None
        if connection is None:
            return False
        if in_background:
            assert self.request is None, "a standing request is withdrawn in the foreground"
            self._room.leave_soon(connection, self._key)
            return False
        return self._room.leave(connection, self._key, self.request, give_back)

    def granted(self) -> None:
        """Leave the queue in the background after a release handed us the row (which took
        our request with it)."""
        self.request = None
        self.leave(in_background=True)


class WaitingRoom:
    """One Locker's queues, and the connections its queued waiters wait on."""

    def __init__(
        self, engine: Engine, statements: Statements, capacity: int = DEFAULT_CAPACITY
    ) -> None:
        self._engine = engine
        self.seats = Seats(capacity)
        self.queue_wait = QueueWait(statements)
        self._leaving: queue.SimpleQueue[tuple[Any, int] | None] = queue.SimpleQueue()
        self._leaver: threading.Thread | None = None
        self._leaver_lock = threading.Lock()
        self._leaver_pid = forks.pid

    def key(self, lockstring: str) -> int:
        """The advisory lock key of ``lockstring``'s queue in this room's table."""
        return self.queue_wait.key(lockstring)

    def enter(
        self,
        lockstring: str,
        timeout: float | None,
        before_blocking: Callable[[], None],
        request: Request,
    ) -> Entry[Turn]:
        """Become the head of ``lockstring``'s queue, waiting at most ``timeout`` seconds (and
        at most QUEUE_PATIENCE), and leave ``request`` for a release to grant.

        ``before_blocking`` is called before queueing: a waiter stops listening for the row's
        releases while it queues (the head of the queue in this process may need them).
        """
        connection = self._checkout()
        if connection is None:
            return Entry(None, try_again=False, usable=False)
        key = self.key(lockstring)
        before_blocking()
        try:
            row = connection.execute(*self.queue_wait.statement(key, timeout, request)).fetchone()
            if self.queue_wait.granted(row):
                turn = Turn(self, connection, key, request)
                return Entry(turn, try_again=True, usable=True)
            self._checkin(connection)  # the caller's deadline, or our patience, came first
            return Entry(None, try_again=True, usable=True)
        except BaseException as error:
            if timed_out(error):
                self._checkin(connection)  # the caller's deadline, or our patience, came first
                return Entry(None, try_again=True, usable=True)
            self._discard(connection)
            if not isinstance(error, Exception):
                raise  # KeyboardInterrupt: psycopg has cancelled the wait
            logger.warning("could not queue for %r (%s); waiting unqueued", lockstring, error)
            return Entry(None, try_again=True, usable=False)

    def leave(
        self, connection: Any, key: int, request: Request | None = None, give_back: bool = True
    ) -> bool:
        """Leave the queue of ``key`` (see ``Turn.leave``); never raises."""
        statement = self.queue_wait.leave_statement(key, request, give_back)
        try:
            row = connection.execute(*statement).fetchone()
        except BaseException as error:
            # Closing the connection ends the queue lock too, and a request left standing is
            # never granted once its session no longer heads the queue.
            self._discard(connection)
            if not isinstance(error, Exception):
                raise  # KeyboardInterrupt: still nothing left standing
            logger.warning("could not leave a lock queue (%s); closing its connection", error)
            return False
        self._checkin(connection)
        return request is not None and bool(row[0])

    def leave_soon(self, connection: Any, key: int) -> None:
        """``leave`` on the room's leaving thread."""
        with self._leaver_lock:
            if self._leaver_pid != forks.pid:  # a forked child starts a thread of its own
                self._leaver_pid, self._leaver = forks.pid, None
                self._leaving = queue.SimpleQueue()
            if self._leaver is None or not self._leaver.is_alive():
                self._leaver = threading.Thread(
                    target=self._leave_queued, name="sqllocker-queue-leaver", daemon=True
                )
                self._leaver.start()
            self._leaving.put((connection, key))

    def _leave_queued(self) -> None:
        while (item := self._leaving.get()) is not None:
            self.leave(*item)  # never raises: a failure closes the connection

    def close(self) -> None:
        with self._leaver_lock:
            leaver = self._leaver if self._leaver_pid == forks.pid else None
            if leaver is not None:
                self._leaving.put(None)  # after the leaves already asked for
        if leaver is not None:
            leaver.join(10)
        for connection in self.seats.close():
            with contextlib.suppress(Exception):
                connection.close()

    # -- connections ----------------------------------------------------------------------------

    def _checkout(self) -> Any | None:
        free, connection = self.seats.take()
        if not free or connection is not None:
            return connection
        opened: Any = None
        try:
            fairy = self._engine.raw_connection()
            opened = fairy.driver_connection
            fairy.detach()  # ours: it never goes back to the pool
            opened.autocommit = True
            return opened
        except Exception as error:
            self._discard(opened)
            logger.warning("could not open a connection to queue on (%s)", error)
            return None

    def _checkin(self, connection: Any) -> None:
        extra = self.seats.give_back(connection)
        if extra is not None:
            with contextlib.suppress(Exception):
                extra.close()

    def _discard(self, connection: Any | None) -> None:
        self.seats.give_back(None)
        if connection is not None:
            with contextlib.suppress(Exception):
                connection.close()
