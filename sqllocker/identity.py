"""Who is taking a lock: the ``locked_by`` JSON that lets an operator find the holder."""

from __future__ import annotations

import getpass
import json
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


# What json.dumps writes for a str (ensure_ascii, its default): the same C function.
_encode_str = json.encoder.encode_basestring_ascii


class HolderDetails(dict[str, Any]):
    """A holder's ``locked_by``, and (``json``, None if the caller added keys of its own) the
    JSON text sent for it, written without ``json.dumps``: encoding the dict on every acquire
    was the largest single cost of the library's own Python in a lock cycle."""

    __slots__ = ("json",)
    json: str | None


@lru_cache(maxsize=4)
def _standard_json(pid: int) -> tuple[str, str]:
    """The standard keys' JSON text before the thread's name and after it (per pid: a forked
    child has its own)."""
    host, program, user = _static_identity()
    before = f'{{"host": {_encode_str(host)}, "pid": {pid}, "thread": '
    after = f', "program": {_encode_str(program)}, "user": {_encode_str(user)}'
    return before, after


def holder_details(extra: dict[str, Any], task: str | None = None) -> HolderDetails:
    """The standard keys (host, pid, thread, program, user; ``task``, the asyncio task's name,
    for async holders) plus the caller's own. The acquisition's guid is not among them: it is
    the secret that proves the row ours, and ``locked_by`` is for anyone to read."""
    host, program, user = _static_identity()
    pid, thread = forks.pid, threading.current_thread().name
    details = HolderDetails(host=host, pid=pid, thread=thread, program=program, user=user)
    if task is not None:
        details["task"] = task
    if extra:
        details.update(extra)
        details.json = None  # the engine's own serialiser, which may know the caller's types
        return details
    before, after = _standard_json(pid)
    task_json = "}" if task is None else f', "task": {_encode_str(task)}}}'
    details.json = before + _encode_str(thread) + after + task_json
    return details


def public_details(locked_by: object) -> dict[str, Any]:
    """A row's ``locked_by`` as it may be shown to anyone: without the ``guid`` key that rows
    written before it was taken out still carry (it is the row's secret)."""
    if not isinstance(locked_by, dict):
        return {}
    if "guid" not in locked_by:
        return locked_by
    return {key: value for key, value in locked_by.items() if key != "guid"}
