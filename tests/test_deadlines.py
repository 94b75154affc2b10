"""The deadlines of a lock operation's statements and connections (``sqllocker.deadlines``):
which block's deadline a statement or a new connection sees, and when the watcher is armed."""

from __future__ import annotations

import contextvars
import threading
from pathlib import Path
from typing import Any

import pytest

from sqllocker import Locker, clock, deadlines
from sqllocker.timeouts import SQLITE_BUSY_TIMEOUT_SECONDS


def test_a_connections_block_inside_a_statements_block_keeps_the_statements_deadline() -> None:
    assert deadlines.current() is None
    assert deadlines.connect_within() is None
    far = clock.now() + 1000
    with deadlines.statements_end_by(far):
        assert deadlines.current() == far
        left = deadlines.connect_within()
        assert left is not None
        assert 999 < left <= 1000
        with deadlines.connections_by(clock.now() + 10):
            assert deadlines.current() == far
            left = deadlines.connect_within()
            assert left is not None
            assert left <= 10
        with deadlines.connections_by(None):
            assert deadlines.current() == far
            assert deadlines.connect_within() is None
        left = deadlines.connect_within()
        assert left is not None
        assert left > 999
    assert deadlines.current() is None
    assert deadlines.connect_within() is None
    assert not deadlines.passed()


def test_a_thread_given_the_blocks_context_has_its_statements_deadline_not_its_connections() -> (
    None
):
    seen: list[Any] = []
    far = clock.now() + 1000
    with deadlines.statements_end_by(far):
        context = contextvars.copy_context()

    def look() -> None:
        seen.extend([deadlines.current(), deadlines.connect_within()])

    thread = threading.Thread(target=context.run, args=(look,))
    thread.start()
    thread.join()
    assert seen == [far, None]


def test_a_deadline_passed_interrupts_the_block_once_and_never_after_it() -> None:
    interrupted = threading.Event()
    calls: list[object] = []

    def interrupt(connection: object) -> None:
        calls.append(connection)
        interrupted.set()

    with (
        deadlines.statements_end_by(clock.now() + 0.05),
        deadlines.interrupting(interrupt, "the connection"),
    ):
        assert interrupted.wait(5)
    with deadlines.statements_end_by(clock.now() - 1), deadlines.interrupting(interrupt, "later"):
        pass
    assert calls == ["the connection"]


def armed_during(locker: Locker, monkeypatch: pytest.MonkeyPatch, expires: float) -> list[float]:
    """The deadlines the watcher was armed with while a lock of ``expires`` seconds was taken
    and released."""
    armed: list[float] = []
    arm = deadlines._watcher.arm

    def spy(deadline: float, *args: Any) -> int:
        armed.append(deadline)
        return arm(deadline, *args)

    monkeypatch.setattr(deadlines._watcher, "arm", spy)
    locker.lock("watched", expires=expires).unlock()
    return armed


def test_sqlite_arms_the_watcher_only_for_a_release_its_busy_timeout_may_outlast(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite's statements wait for nothing but another connection's write lock, and no longer
    than the busy timeout: a release whose deadline is further off than the longest an
    operation can wait needs no watcher; a shorter lock's release is watched."""
    locker = Locker(f"sqlite:///{tmp_path / 'locks.db'}")
    try:
        assert armed_during(locker, monkeypatch, 20 * SQLITE_BUSY_TIMEOUT_SECONDS) == []
        assert len(armed_during(locker, monkeypatch, 10)) == 1
    finally:
        locker.close()
