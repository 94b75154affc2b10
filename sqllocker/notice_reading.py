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

A waiter that finds the listener's thread reading rings a bell (a pipe) that it polls beside
the connection, and leads once that thread has put the reading down. A leader that finds the
connection lost leaves that to the listener's thread, which reconnects; a listener that ends
(stopped, or its connection lost) waits for its leader to put the lead down before the
connection is closed.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
import time
from collections.abc import Callable
from typing import Any

from .errors import LockError

# libpq's CONNECTION_OK: a session that has not failed.
_CONNECTION_OK = 0


class NoticeReader:
    """The reads of one listening session's ``connection`` (psycopg's), whose notices go to
    ``hear(channel, payload)``; ``seconds``: the longest one read blocks (the listener's
    thread looks between reads whether it should stop)."""

    def __init__(self, connection: Any, hear: Callable[[str, str], None], seconds: float) -> None:
        self._pgconn = connection.pgconn
        self._encoding = connection.info.encoding
        self._hear = hear
        self._seconds = seconds
        self._bell, self._ringer = os.pipe()
        os.set_blocking(self._bell, False)
        os.set_blocking(self._ringer, False)
        self._poller = select.poll()
        self._poller.register(self._pgconn.socket, select.POLLIN)
        self._poller.register(self._bell, select.POLLIN)
        self._changed = threading.Condition()
        self._listener_reads = False  # the listener's thread is in a read
        self._asking = 0  # waiters waiting for the listener's thread to put the lead down
        self._led = False  # a waiter reads
        self._following = 0  # waiters waiting while another thread reads
        self._ending = False  # the session ends: nobody takes the lead again
        self._failure: Exception | None = None  # a leader's read that failed

    def listen(self, listening: Callable[[], bool]) -> None:
        """The listener thread's reads, while ``listening()``: as notices come while waiters
        that do not lead wait (followers); what has come, every ``seconds``, while nobody
        waits (a waiter to come reads for itself, but the server keeps every notice for its
        slowest listener); never while a waiter leads. Raises LockError once the connection
        is lost (found by either thread), and, whatever ends it, waits for a leader to put
        the lead down."""
        try:
            while True:
                with self._changed:
                    as_they_come = self._await_turn(listening)
                    if as_they_come is None:
                        return
                    self._listener_reads = True
                try:
                    self._read(self._seconds if as_they_come else 0)
                finally:
                    with self._changed:
                        self._listener_reads = False
                        self._changed.notify_all()
        finally:
            self._end()

    def _await_turn(self, listening: Callable[[], bool]) -> bool | None:
        """Under ``_changed``: until the listener's thread reads, whether as notices come
        (followers wait) or only what has come (nobody waits, for ``seconds``); None once
        it should stop."""
        idle_since = time.monotonic()
        while True:
            if self._failure is not None:
                raise self._failure
            if not listening():
                return None
            if not (self._led or self._asking):
                if self._following:
                    return True
                if time.monotonic() - idle_since >= self._seconds:
                    return False
            self._changed.wait(self._seconds)

    def wait(self, event: threading.Event, seconds: float | None) -> None:
        """Until ``event`` is set or ``seconds`` (None: no bound) have passed, reading the
        connection meanwhile if no other waiter does."""
        if seconds is not None and seconds <= 0:
            return
        deadline = time.monotonic() + (float("inf") if seconds is None else seconds)
        if not self._take_lead():
            self._follow(event, seconds)
            return
        try:
            while not event.is_set() and not self._ending:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._read(min(left, self._seconds))
        except LockError as error:  # the connection is lost: the listener's thread reconnects
            self._failure = error
        finally:
            with self._changed:
                self._led = False
                if self._following or self._asking or self._ending or self._failure:
                    self._changed.notify_all()  # they need the listener's thread now
        left = deadline - time.monotonic()
        if not event.is_set() and left > 0:  # the session ended first: the listener wakes us
            self._follow(event, None if seconds is None else left)

    def catch_up(self) -> None:
        """Hand on what has come while nobody read (while nobody waited): before a waiter
        registers, so that it is not woken by notices older than its registration, as it
        was not while the listener's thread read them as they came."""
        with self._changed:
            if self._led or self._asking or self._listener_reads or self._ending:
                return  # another reads as notices come, or the session ends
            if self._failure is not None:
                return
            self._led = True
        try:
            self._read(0)
        except LockError as error:  # the connection is lost: the listener's thread reconnects
            self._failure = error
        finally:
            with self._changed:
                self._led = False
                if self._following or self._asking or self._ending or self._failure:
                    self._changed.notify_all()

    def _take_lead(self) -> bool:
        """Whether this thread now leads: at once if the listener's thread is not reading,
        else once it has, rung, put the lead down; not while another waiter leads (it
        follows), nor once the session ends."""
        with self._changed:
            if self._led or self._ending or self._failure is not None:
                return False
            if self._listener_reads:
                self._asking += 1
                try:
                    while self._listener_reads and not self._ending:
                        self._ring()
                        self._changed.wait(self._seconds)
                except BaseException:  # a signal handler's: the listener's thread reads on
                    self._changed.notify_all()
                    raise
                finally:
                    self._asking -= 1
                if self._led or self._ending or self._failure is not None:
                    self._changed.notify_all()  # the listener's thread reads on
                    return False
            self._led = True
            return True

    def _follow(self, event: threading.Event, seconds: float | None) -> None:
        """Wait for ``event`` while another thread reads: the leader, or, if none, the
        listener's thread, which a follower calls to read as notices come."""
        with self._changed:
            self._following += 1
            if not (self._led or self._asking):
                self._changed.notify_all()
        try:
            event.wait(seconds)
        finally:
            with self._changed:
                self._following -= 1

    def _read(self, seconds: float) -> None:
        """Hand on every notice come, waiting up to ``seconds`` for one or for the bell. A
        lost connection raises LockError; what a signal handler raises goes through."""
        pgconn = self._pgconn
        self._hand_on()
        for fd, _ in self._poller.poll(seconds * 1000):
            if fd == self._bell:
                self._silence()
                continue
            try:
                pgconn.consume_input()
            except Exception as error:
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

    def _ring(self) -> None:
        with contextlib.suppress(BlockingIOError):  # rung already, and not yet heard
            os.write(self._ringer, b"\0")

    def _silence(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._bell, 512):
                pass

    def _end(self) -> None:
        """No lead taken from now on; once a leader has put it down, the bell goes."""
        with self._changed:
            self._ending = True
            while self._led:
                self._ring()
                self._changed.wait(self._seconds)
            self._changed.notify_all()
        os.close(self._bell)
        os.close(self._ringer)
