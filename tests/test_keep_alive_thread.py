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


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["postgresql"])
def test_renewals_that_each_take_their_time_do_not_fall_behind(
    locker: Locker, table_name: str
) -> None:
    """A slow server that still answers (each renewal takes 0.3 s: a trigger sleeps): eight
    kept-alive locks of 3 s need 2.4 s of renewals a second, more than one worker can send, and
    none of them may be lost for want of a worker."""
    lost: list[LockLost] = []
    locks = [
        locker.lock(f"slow {n}", expires=3, keep_alive=True, on_lost=lost.append) for n in range(8)
    ]
    with locker.engine.begin() as conn:
        conn.exec_driver_sql(
            f"CREATE FUNCTION {table_name}_slow() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN PERFORM pg_sleep(0.3); RETURN NEW; END $$"
        )
        conn.exec_driver_sql(
            f"CREATE TRIGGER {table_name}_slow BEFORE UPDATE ON {table_name} "
            f"FOR EACH ROW EXECUTE FUNCTION {table_name}_slow()"
        )
    try:
        time.sleep(8)
        assert lost == []
        assert all(lock.is_valid() for lock in locks)
    finally:
        with locker.engine.begin() as conn:
            conn.exec_driver_sql(f"DROP TRIGGER {table_name}_slow ON {table_name}")
            conn.exec_driver_sql(f"DROP FUNCTION {table_name}_slow()")
        for lock in locks:
            with contextlib.suppress(LockLost):
                lock.unlock()
