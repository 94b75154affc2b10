"""Waking when a file is written: Linux's inotify, through libc, so that the reader of the SQLite
queue's bell (``sqllocker.file_queue``) hears a ring at once rather than at its next poll.

Where there is no inotify (not Linux, no libc to load, no watches left) there is no watch, and
the bell's reader polls alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import select
import sys
import time

logger = logging.getLogger("sqllocker")

_IN_MODIFY = 0x2
# Enough for the events of many writes at once: they are read only to be cleared.
_EVENTS_READ = 4096


class FileWatch:
    """Writes to one file: ``wait(timeout)`` returns after the next one (at once if one came
    since the last call), or after ``timeout`` seconds."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    @classmethod
    def of(cls, path: str) -> FileWatch | None:
        """A watch of the file at ``path``, or None where it cannot be watched."""
        if sys.platform != "linux":
            return None
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = libc.inotify_init1(os.O_CLOEXEC | os.O_NONBLOCK)
        except (OSError, AttributeError) as error:
            logger.debug("no inotify (%s); the bell is polled", error)
            return None
        if fd < 0:
            return None
        if libc.inotify_add_watch(fd, os.fsencode(path), _IN_MODIFY) < 0:
            os.close(fd)
            return None
        return cls(fd)

    def wait(self, timeout: float) -> None:
        try:
            readable, _, _ = select.select([self._fd], [], [], timeout)
            if readable:
                with contextlib.suppress(BlockingIOError):
                    while os.read(self._fd, _EVENTS_READ):
                        pass
        except OSError:
            time.sleep(timeout)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)
