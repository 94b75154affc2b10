"""SQLite: the write-ahead log is copied back into the database file by a thread of sqllocker's
own, never by a lock operation.

Left to SQLite, the copy (a checkpoint, with its flushes to disk) runs in whichever connection
next commits past the log's limit: under contention a release, which then took milliseconds
instead of a tenth of one, and every waiter behind it waited as long (the 99th percentile of a
contended wait, three times over). So the connections sqllocker makes turn SQLite's automatic
checkpoint off, and every ``CHECK_EVERY`` releases a process looks at the log's size; past
``LOG_LIMIT`` it asks its checkpoint thread to copy the log back.

A passive checkpoint waits for nobody and holds up nobody, but copies only what was written
before it began; the log starts over from its beginning only once a writer finds all of it
copied, and under writes without a pause that never happens (the log grew to 100 MB in the
benchmark's contended 5 s). So the thread follows the passive checkpoint with a restarting
one, which holds writers back only while it copies what came in meanwhile. The first release
of a process looks too, so that short-lived processes (cron jobs) keep the log in check.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading

from . import forks
from .timeouts import SQLITE_BUSY_TIMEOUT_SECONDS

logger = logging.getLogger("sqllocker")

CHECK_EVERY = 64
# SQLite's own automatic checkpoint limit: 1000 pages of 4 KiB.
LOG_LIMIT = 1000 * 4096
# The statement each connection sqllocker makes runs, so that no lock operation checkpoints.
NO_AUTOMATIC_CHECKPOINT = "PRAGMA wal_autocheckpoint=0"


class Checkpointer:
    """Passive checkpoints of the SQLite database at ``path``, on a thread of their own."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._log = path + "-wal"
        self._releases = CHECK_EVERY - 1  # the first release looks
        self._wanted = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pid = forks.pid
        self._closed = False

    def released(self) -> None:
        """A release committed: every CHECK_EVERY of them, look at the log's size."""
        self._releases += 1
        if self._releases < CHECK_EVERY:
            return
        self._releases = 0
        try:
            size = os.stat(self._log).st_size
        except OSError:
            return  # no log (yet, or any more)
        if size > LOG_LIMIT:
            self._ask()

    def close(self) -> None:
        """Stop the thread, letting a checkpoint under way finish."""
        with self._lock:
            self._closed = True
            thread = self._thread if self._pid == forks.pid else None
        self._wanted.set()
        if thread is not None:
            thread.join(SQLITE_BUSY_TIMEOUT_SECONDS)

    def _ask(self) -> None:
        with self._lock:
            if self._closed:
                return
            if self._thread is None or self._pid != forks.pid:
                # First use, or a forked child, which has none of its parent's threads.
                self._pid = forks.pid
                self._wanted = threading.Event()
                self._thread = threading.Thread(
                    target=self._run, name="sqllocker-checkpoint", daemon=True
                )
                self._thread.start()
        self._wanted.set()

    def _run(self) -> None:
        connection: sqlite3.Connection | None = None
        try:
            while True:
                self._wanted.wait()
                self._wanted.clear()
                if self._closed:
                    return
                try:
                    if connection is None:
                        connection = sqlite3.connect(
                            self._path, timeout=SQLITE_BUSY_TIMEOUT_SECONDS, isolation_level=None
                        )
                    for mode in ("PASSIVE", "RESTART"):
                        connection.execute(f"PRAGMA wal_checkpoint({mode})").fetchall()
                except sqlite3.Error as error:  # another checkpoint under way does the job
                    logger.debug("checkpoint of %s: %s", self._path, error)
        finally:
            if connection is not None:
                with contextlib.suppress(sqlite3.Error):
                    connection.close()
