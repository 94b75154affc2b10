"""Who is taking a lock: the ``locked_by`` JSON that lets an operator find the holder."""

from __future__ import annotations

import getpass
import os
import socket
import sys
import threading
from functools import lru_cache
from typing import Any

from . import forks


@lru_cache(maxsize=1)
def _static_identity() -> tuple[str, str, str]:
    """Host, program and user: these cannot change for the life of a process (fork keeps them)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry, as in some containers
        user = str(os.getuid()) if hasattr(os, "getuid") else "?"
    program = sys.argv[0] if sys.argv and sys.argv[0] else sys.executable
    return socket.gethostname(), program, user


def new_guid() -> str:
    """A fresh acquisition's secret: 128 bits from the OS's CSPRNG, as 32 hex digits.

    It proves the row ours in every later statement, so it must be unguessable, not just unique.
    ``str(uuid.uuid4())`` reads the same 16 random bytes, then builds an object and formats it,
    several times the cost of this.
    """
    return os.urandom(16).hex()


def holder_details(extra: dict[str, Any], task: str | None = None) -> dict[str, Any]:
    """The standard keys (host, pid, thread, program, user; ``task``, the asyncio task's name,
    for async holders) plus the caller's own. The acquisition's guid is not among them: it is
    the secret that proves the row ours, and ``locked_by`` is for anyone to read."""
    host, program, user = _static_identity()
    details: dict[str, Any] = {
        "host": host,
        "pid": forks.pid,
        "thread": threading.current_thread().name,
        "program": program,
        "user": user,
    }
    if task is not None:
        details["task"] = task
    details.update(extra)
    return details


def public_details(locked_by: object) -> dict[str, Any]:
    """A row's ``locked_by`` as it may be shown to anyone: without the ``guid`` key that rows
    written before it was taken out still carry (it is the row's secret)."""
    if not isinstance(locked_by, dict):
        return {}
    if "guid" not in locked_by:
        return locked_by
    return {key: value for key, value in locked_by.items() if key != "guid"}
