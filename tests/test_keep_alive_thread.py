"""The keep-alive thread survives a lock taken out of it while another's on_lost runs."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import pytest

from sqllocker import Lock, Locker, LockLost


@pytest.mark.slow
def test_an_entry_removed_while_on_lost_runs_does_not_stop_the_renewals(locker: Locker) -> None:
    keep_alives = locker._keep_alives
    renewed = locker.lock("renewed meanwhile", expires=2, keep_alive=True)
    first, second = locker.lock("first", expires=0.3), locker.lock("second", expires=0.3)
    time.sleep(0.5)  # both past their deadlines

    def forget(other: Lock) -> Callable[[LockLost], object]:
        return lambda lost: keep_alives.remove(other._state)  # as its unlock() would

    with keep_alives._condition:  # the scheduler sees both at once, in this order
        first.keep_alive(on_lost=forget(second))
        second.keep_alive(on_lost=forget(first))
    time.sleep(3)  # past the renewed lock's own expiry: only renewals keep it
    assert renewed.is_valid()
    renewed.unlock()
    for lock in (first, second):
        assert not lock.is_valid()
        with contextlib.suppress(LockLost):
            lock.unlock()
