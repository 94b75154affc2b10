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


# The watches open in this process. A forked child closes its copies at once: its parent's
# reader threads are not forked with it, and each copy would keep an inotify instance (a
# per-user limit, fs.inotify.max_user_instances) for as long as the child lives.
_watches: set[int] = set()


def _close_in_child() -> None:
    for fd in _watches:
        with contextlib.suppress(OSError):
            os.close(fd)
    _watches.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_child)


class FileWatch:
    """Writes to one file: ``wait(timeout)`` returns after the next one (at once if one came
    since the last call), or after ``timeout`` seconds."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        _watches.add(fd)

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
        _watches.discard(self._fd)
        with contextlib.suppress(OSError):
            os.close(self._fd)
