"""How the lock operations wait, as the front end that runs them does: for threads (the
defaults), or, in the greenlets of an AsyncLocker, for the tasks of its event loop."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Waits:
    """``connection_changes``: what callers of a ConnectionStack wait on for a connection to
    come free (a ``threading.Condition``). ``one_operation_at_a_time``: what keeps the
    operations on an in-memory database's one connection apart, each whole, a transaction's
    awaits included (reentrant: an operation may use it again). ``sleep``: a retry's pause
    after contention."""

    connection_changes: Callable[[], Any] = threading.Condition
    one_operation_at_a_time: Callable[[], AbstractContextManager[Any]] = threading.RLock
    sleep: Callable[[float], None] = time.sleep


THREADS = Waits()
