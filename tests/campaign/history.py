"""The history: one JSON line per event, appended with O_APPEND by every process of a campaign,
stamped with CLOCK_MONOTONIC, which all processes on one host share.

Each line has ``t`` (monotonic seconds), ``pid``, ``w`` (the worker, or ``nemesis``/``command``),
``type`` and what the event says. Types: ``invoke``/``ok``/``fail``/``info`` for an operation
(``op``, with the lockstring ``ls`` and the fencing token ``id`` where known), ``valid`` for an
``is_valid()`` observation (``v``; stamped *before* the call, so a True one is a moment the lock
was valid), ``fault``/``fault_end`` for the nemesis, ``cmd`` for a ``run`` command's process
(``phase``: start, tick or stop).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

Event = dict[str, Any]


def now() -> float:
    return time.clock_gettime(time.CLOCK_MONOTONIC)


class History:
    """Appends events to the history file; one write per line, so lines never interleave."""

    def __init__(self, path: Path | str, who: str) -> None:
        self.who = who
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def record(self, type: str, at: float | None = None, **fields: Any) -> float:
        """Append one event; return its timestamp (``at``, or now)."""
        stamp = now() if at is None else at
        event = {"t": stamp, "pid": os.getpid(), "w": self.who, "type": type, **fields}
        os.write(self._fd, (json.dumps(event, default=str) + "\n").encode())
        return stamp

    def close(self) -> None:
        os.close(self._fd)


def read(path: Path) -> list[Event]:
    """Every event, in timestamp order (a line torn by a SIGKILL mid-write is skipped)."""
    events: list[Event] = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    events.sort(key=lambda event: event["t"])
    return events
