"""Who is taking a lock: the ``locked_by`` JSON that lets an operator find the holder."""

from __future__ import annotations

import getpass
import os
import socket
import sys
import threading
from functools import lru_cache
from typing import Any


@lru_cache(maxsize=1)
def _static_identity() -> tuple[str, str, str]:
    """Host, program and user: these cannot change for the life of a process (fork keeps them)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry, as in some containers
        user = str(os.getuid()) if hasattr(os, "getuid") else "?"
    program = sys.argv[0] if sys.argv and sys.argv[0] else sys.executable
    return socket.gethostname(), program, user


def holder_details(guid: str, extra: dict[str, Any], task: str | None = None) -> dict[str, Any]:
    """The standard keys (host, pid, thread, program, user, guid; ``task``, the asyncio task's
    name, for async holders) plus the caller's own."""
    host, program, user = _static_identity()
    details: dict[str, Any] = {
        "host": host,
        "pid": os.getpid(),
        "thread": threading.current_thread().name,
        "program": program,
        "user": user,
        "guid": guid,
    }
    if task is not None:
        details["task"] = task
    details.update(extra)
    return details
