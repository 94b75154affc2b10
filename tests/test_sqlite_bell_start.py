"""A listener hears every ring that follows its ``listen()``, also one that lands while the
bell's reader of its process is still being started by another listener."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from sqllocker import file_queue
from sqllocker.file_queue import AVAILABLE, BellListener, FileQueue

pytestmark = pytest.mark.skipif(not AVAILABLE, reason="open file description locks are Linux's")


def test_a_ring_after_listen_is_heard_while_another_listener_starts_the_reader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tmp_path / "locks.db")
    ringer, listening = FileQueue(path), FileQueue(path)
    ringer.ring()  # the queue file exists
    reading, go = threading.Event(), threading.Event()
    real = file_queue._read_bell

    def slow_first_read(fd: int) -> Any:
        if not reading.is_set():
            reading.set()
            go.wait(5)
        return real(fd)

    monkeypatch.setattr(file_queue, "_read_bell", slow_first_read)
    listeners: list[BellListener] = []
    starting = threading.Thread(target=lambda: listeners.append(listening.listen()))
    starting.start()
    reading.wait(5)  # the first listen() is about to read the bell as it is
    # A second waiter listens meanwhile; listen() must not return before the bell is read.
    second: list[BellListener] = []
    listening_too = threading.Thread(target=lambda: second.append(listening.listen()))
    listening_too.start()
    listening_too.join(0.3)
    rung_early = bool(second)
    if rung_early:  # listen() returned before the bell was read: a ring from now on counts
        ringer.ring()
    go.set()
    starting.join(5)
    listening_too.join(5)
    if not rung_early:
        ringer.ring()
    woken = threading.Event()
    second[0].when_rung(woken.set)
    assert woken.wait(2), "a ring after listen() returned was never heard"
    for listener in [*listeners, *second]:
        listener.close()
    for queue in (ringer, listening):
        queue.close()
