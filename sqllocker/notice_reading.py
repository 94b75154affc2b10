"""Reading a sync listener's PostgreSQL connection from the thread that waits on it (see
``sqllocker.listener``).

A waiting thread reads the listening connection itself while it waits (it *leads*), so that a
release that hands it the row wakes it at once, without the listener's thread reading the
notice and then waking it: that hand from one thread to another was most of a hand-off's
latency. One thread reads at a time, and every notice read is handed on as before (the
listener's ``_heard``), so the Locker's other waiting threads (followers) are woken as they
always were: by the leader, or, while none leads, by the listener's thread, which reads as
notices come while anyone follows. While nobody waits, the listener's thread reads only what
has come, once a second (the server keeps every notice for its slowest listener), and a waiter
to come takes the lead without waking it.

Signals: a leader may be the main thread, where signal handlers run, and what one of them
raises can come between any two steps of Python code. So no thread waits on a lock or
condition shared with another: the state's lock is taken only by ``with`` on a C lock (no
Python frame between taking and releasing it) around a few steps, and threads wait by polling
pipes. Who leads, asks or follows is kept by thread, and forgotten once that thread is no
longer in the call that made it so (``_prune``): an exception that skipped a call's last step
would otherwise hold every other thread off for good.
"""

from __future__ import annotations

import contextlib
import io
import os
import select
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

from .errors import LockError

# libpq's CONNECTION_OK: a session that has not failed.
_CONNECTION_OK = 0


class _Pipe:
    """A pipe to wake a poll with: ``ring`` from any thread, ``silence`` by the one woken.
    Never closed but by the garbage collector, once nothing can ring it any more: a thread
    could otherwise ring a number that another file has been given since."""

    def __init__(self) -> None:
        read, write = os.pipe()
        os.set_blocking(read, False)
        os.set_blocking(write, False)
        self._read = io.FileIO(read, "r")
        self._write = io.FileIO(write, "w")
        self.fd = read

    def wait(self, seconds: float) -> None:
        """Until it is rung, or ``seconds`` have passed. By a poll object of the call's own
        (one is not for two threads at once), not select() (fds past 1,023)."""
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        poller.poll(seconds * 1000)

    def ring(self) -> None:
        with contextlib.suppress(BlockingIOError):  # rung already, and not yet heard
            self._write.write(b"\0")

    def silence(self) -> None:
        while self._read.read(512):  # None once empty (non-blocking)
            pass

    def take_one(self) -> None:
        """One ring heard, of as many as were rung (one for each thread that waits)."""
        self._read.read(1)


class NoticeReader:
    """The reads of one listening session's ``connection`` (psycopg's), whose notices go to
    ``hear(channel, payload)``; ``seconds``: the longest one read or wait blocks."""

    def __init__(self, connection: Any, hear: Callable[[str, str], None], seconds: float) -> None:
        import psycopg  # the connection's driver, imported already

        self._lost: type[Exception] = psycopg.Error  # what a lost connection raises
        self._pgconn = connection.pgconn
        self._encoding = connection.info.encoding
        self._hear = hear
        self._seconds = seconds
        self._alarm = _Pipe()  # to whoever reads: look at the state now
        self._bell = _Pipe()  # to the listener's thread, while it does not read: likewise
        self._yielded = _Pipe()  # to each waiter asking for the lead: the listener stopped
        self._reading = select.poll()
        self._reading.register(self._pgconn.socket, select.POLLIN)
        self._reading.register(self._alarm.fd, select.POLLIN)
        self._lock = threading.Lock()  # the state's; only ``with``, around assignments
        self._listener_reads = False  # the listener's thread is in a read
        self._leader: int | None = None  # the thread that reads while it waits
        self._leading: threading.Event | None = None  # what it waits for
        self._askers: set[int] = set()  # threads waiting for the listener's thread to stop
        self._followers: set[int] = set()  # threads waiting while another reads
        self._ending = False  # the session ends: nobody takes the lead again
        self._failure: Exception | None = None  # a leader's read that failed
        self._pruned_at = 0.0
        self._deferred: deque[threading.Event] = deque()  # to set (``wake``)

    # -- the listener's thread ----------------------------------------------------------------

    def listen(self, listening: Callable[[], bool]) -> None:
        """The listener thread's reads, while ``listening()``: as notices come while waiters
        that do not lead wait (followers); what has come, every ``seconds``, while nobody
        waits (a waiter to come reads for itself, but the server keeps every notice for its
        slowest listener); never while a waiter leads or asks to. Raises LockError once the
        connection is lost (found by either thread), and, whatever ends it, waits for a
        leader to put the lead down."""
        try:
            idle_since = time.monotonic()
            while listening():
                self._set_deferred()
                with self._lock:
                    failure = self._failure
                    turn = None if failure is not None else self._turn(idle_since)
                    self._listener_reads = turn is not None
                if failure is not None:
                    raise failure
                if turn is None:
                    self._wait_for_the_bell()
                    continue
                try:
                    self._read(self._seconds if turn else 0)
                finally:
                    with self._lock:
                        self._listener_reads = False
                        asking = len(self._askers)
                    for _ in range(asking):  # a ring for each, each taking one
                        self._yielded.ring()
                idle_since = time.monotonic()
        finally:
            self.end()
            self._set_deferred()

    def _turn(self, idle_since: float) -> bool | None:
        """Under the lock: whether the listener's thread reads now as notices come (True:
        followers wait), only what has come (False: nobody has for ``seconds``), or not at
        all (None: a waiter leads or asks to, or nobody waits and a read is not due)."""
        self._prune()
        if self._leader is not None or self._askers:
            return None
        if self._followers:
            return True
        if time.monotonic() - idle_since >= self._seconds:
            return False
        return None

    def _wait_for_the_bell(self) -> None:
        self._bell.wait(self._seconds)
        self._bell.silence()

    def end(self) -> None:
        """No lead taken from now on, and once a leader has put it down, nobody reads."""
        with self._lock:
            self._ending = True
        while True:
            with self._lock:
                self._prune(now=True)
                leader = self._leader
            if leader is None:
                return
            self._alarm.ring()
            self._wait_for_the_bell()

    # -- waiting threads ----------------------------------------------------------------------

    def wait(self, event: threading.Event, seconds: float | None) -> None:
        """Until ``event`` is set or ``seconds`` (None: no bound) have passed, reading the
        connection meanwhile if no other thread does (else following)."""
        if event.is_set() or (seconds is not None and seconds <= 0):
            return
        deadline = time.monotonic() + (float("inf") if seconds is None else seconds)
        self._lead(event, deadline)
        left = deadline - time.monotonic()
        if not event.is_set() and left > 0:  # another reads, or the session ended first
            self._follow(event, None if seconds is None else left)

    def catch_up(self) -> None:
        """Hand on what has come while nobody read (while nobody waited): before a waiter
        registers, so that it is not woken by notices older than its registration, as it
        was not while the listener's thread read them as they came."""
        self._lead(None, 0.0)

    def wake(self, event: threading.Event) -> None:
        """Set a waiter's ``event``, from whichever thread reads or leaves the Locker's line.
        The main thread, where signal handlers run, sets none but its own: ``Event.set`` is
        Python code, and a handler's exception between its taking the event's lock and its
        releasing it would leave the lock held, and the event's thread waiting for good; the
        listener's thread sets the others (a hand from one thread to another). If the event's
        waiter reads, the alarm rings too, or it would not hear of it before its read's end."""
        if event is not self._leading and threading.current_thread() is threading.main_thread():
            self._deferred.append(event)
            self._bell.ring()
            self._alarm.ring()
            return
        event.set()
        if self._leading is event:
            self._alarm.ring()

    def _set_deferred(self) -> None:
        """The listener's thread: set the events the main thread left to it (``wake``)."""
        while self._deferred:
            self._deferred.popleft().set()

    def _lead(self, event: threading.Event | None, deadline: float) -> bool:
        """Read until ``event`` is set or ``deadline`` (monotonic) passes, if this thread may
        lead (``_may_lead``); None: only what has come. Whether it led."""
        if not self._may_lead(threading.get_ident(), event, deadline):
            return False
        try:
            if event is None:
                self._read(0)
            else:
                while not event.is_set() and not self._ending:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._read(min(left, self._seconds))
        except LockError as error:  # the connection is lost: the listener's thread reconnects
            self._failure = error
        finally:
            with self._lock:
                self._leader = self._leading = None
                needed = bool(self._followers or self._ending or self._failure)
            if needed:
                self._bell.ring()  # the listener's thread reads for the followers, or ends
        return True

    def _may_lead(self, me: int, event: threading.Event | None, deadline: float) -> bool:
        """Whether this thread, waiting for ``event``, leads now (then it is the leader): at
        once if nobody reads, else once the listener's thread has, alarmed, stopped reading
        (or, without an event, not at all: it reads as notices come). Not while another
        leads, nor once the session ends: it follows."""
        while True:
            with self._lock:
                if self._ending or self._failure is not None:
                    return False
                if self._leader is not None:
                    self._prune()
                if self._leader is not None:
                    return False
                if not self._listener_reads:
                    self._leader, self._leading = me, event
                    self._askers.discard(me)
                    return True
                if event is None or time.monotonic() >= deadline:
                    self._askers.discard(me)
                    return False
                self._askers.add(me)
            self._alarm.ring()
            # One ring is ours (a ring left by an asker that has gone costs a look more).
            self._yielded.wait(self._seconds)
            self._yielded.take_one()

    def _follow(self, event: threading.Event, seconds: float | None) -> None:
        """Wait for ``event`` while another thread reads: the leader, or, if none, the
        listener's thread, which a follower calls to read as notices come."""
        me = threading.get_ident()
        with self._lock:
            self._followers.add(me)
            alone = self._leader is None and not self._askers
        try:
            if alone:
                self._bell.ring()
            event.wait(seconds)
        finally:
            with self._lock:
                self._followers.discard(me)

    def _prune(self, now: bool = False) -> None:
        """Under the lock, once a ``seconds`` at most (or ``now``): forget the leader, askers
        and followers that are no longer in the calls that made them so."""
        if not (now or time.monotonic() >= self._pruned_at + self._seconds):
            return
        self._pruned_at = time.monotonic()
        if self._leader is None and not self._askers and not self._followers:
            return
        frames = sys._current_frames()
        if self._leader is not None and not _inside(frames.get(self._leader), _LEADING):
            self._leader = self._leading = None
        self._askers = {t for t in self._askers if _inside(frames.get(t), _ASKING)}
        self._followers = {t for t in self._followers if _inside(frames.get(t), _FOLLOWING)}

    # -- reading --------------------------------------------------------------------------------

    def _read(self, seconds: float) -> None:
        """Hand on every notice come, waiting up to ``seconds`` for one or for the alarm. A
        lost connection raises LockError; what a signal handler raises goes through."""
        pgconn = self._pgconn
        self._hand_on()
        for fd, _ in self._reading.poll(seconds * 1000):
            if fd == self._alarm.fd:
                self._alarm.silence()
                continue
            try:
                pgconn.consume_input()
            except self._lost as error:  # not what a signal handler raised: that goes on
                raise LockError(f"the listening connection failed ({error})") from error
            if pgconn.status != _CONNECTION_OK:
                raise LockError("the listening connection was closed")
            self._hand_on()

    def _hand_on(self) -> None:
        """The notices libpq has read, to ``hear``: read from libpq itself, as psycopg's
        ``notifies()`` costs about as much again, and every listener hears every grant."""
        pgconn, encoding = self._pgconn, self._encoding
        while (notice := pgconn.notifies()) is not None:
            self._hear(notice.relname.decode(encoding), notice.extra.decode(encoding))


def _inside(frame: FrameType | None, code: CodeType) -> bool:
    """Whether a thread whose innermost frame is ``frame`` is inside a call of ``code``."""
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


_LEADING = NoticeReader._lead.__code__
_ASKING = NoticeReader._may_lead.__code__
_FOLLOWING = NoticeReader._follow.__code__
