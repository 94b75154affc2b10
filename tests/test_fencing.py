"""Fencing tokens (lock ids) grow in the order the lock is held, whatever the timing.

PostgreSQL draws a row's id from its sequence when the INSERT forms the row, before the unique
index is checked: an acquirer that drew id n and was then delayed could insert after a later
acquirer (id n + 1) had held and released the lock, and hold it with the smaller token. The
8-process contention test saw this once (one token inversion, no overlap). Here a BEFORE
INSERT trigger, which runs after the id is drawn and before the unique check, stretches that
moment to a second for one acquirer, so the race is won by the other every time.
"""

from __future__ import annotations

import threading
import time

import pytest
import sqlalchemy as sa

from sqllocker import Locker, lock_table
from sqllocker.engine import resolve_url
from tests.conftest import figure

SLOW_SECONDS = 1.0


@pytest.fixture
def slow_inserts(postgresql_url: str, table_name: str) -> str:
    """The test's table, whose inserts of rows with locked_by's 'slow' key take a second
    between drawing the id and the unique check."""
    engine = sa.create_engine(resolve_url(postgresql_url))
    lock_table(table_name).create(engine)
    with engine.begin() as conn:
        conn.exec_driver_sql(
            f"CREATE FUNCTION {table_name}_slow() RETURNS trigger LANGUAGE plpgsql AS $$ "
            f"BEGIN IF NEW.locked_by ? 'slow' THEN PERFORM pg_sleep({SLOW_SECONDS}); END IF; "
            "RETURN NEW; END $$"
        )
        conn.exec_driver_sql(
            f"CREATE TRIGGER {table_name}_slow BEFORE INSERT ON {table_name} "
            f"FOR EACH ROW EXECUTE FUNCTION {table_name}_slow()"
        )
    engine.dispose()
    return postgresql_url


def test_a_delayed_acquirers_earlier_id_is_never_held_after_a_later_one(
    slow_inserts: str, table_name: str
) -> None:
    slow = Locker(slow_inserts, table=table_name, grace=0)
    quick = Locker(slow_inserts, table=table_name, grace=0)
    held: list[tuple[float, str, int]] = []  # (when acquired, by whom, lock id)
    failures: list[BaseException] = []

    def take(locker: Locker, who: str, **options: object) -> None:
        try:
            lock = locker.lock("fenced", wait=10, **options)  # type: ignore[arg-type]
            held.append((time.monotonic(), who, lock.lock_id))
            lock.unlock()
        except BaseException as error:
            failures.append(error)

    delayed = threading.Thread(target=take, args=(slow, "slow"), kwargs={"locked_by": {"slow": 1}})
    delayed.start()
    time.sleep(SLOW_SECONDS / 3)  # the slow acquirer has drawn its id and sleeps in the trigger
    take(quick, "quick")
    delayed.join()
    slow.close()
    quick.close()

    assert failures == []
    ids_in_holding_order = [lock_id for _, _, lock_id in sorted(held)]
    figure(
        "acquirer delayed between drawing its id and the unique check",
        "postgresql",
        f"ids in holding order {ids_in_holding_order} ({', '.join(w for _, w, _ in sorted(held))})",
    )
    assert ids_in_holding_order == sorted(set(ids_in_holding_order)), held
