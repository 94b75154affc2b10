"""MariaDB/MySQL waiters queue in the server, in ``GET_LOCK`` on a name of the table and
lockstring: first come, first served, and only the head polls the row
(``sqllocker.queueing.GetLockQueueWait``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pymysql
import pytest
import sqlalchemy as sa

from sqllocker import LockBusy, Locker, lock_table
from sqllocker.engine import resolve_url
from tests.helpers import wait_in_thread, wait_until
from tests.test_hand_off import counting_attempts


@pytest.fixture
def lockers(mysql_url: str, table_name: str) -> Iterator[Callable[[], Locker]]:
    engine = sa.create_engine(resolve_url(mysql_url))
    lock_table(table_name).create(engine)
    engine.dispose()
    made: list[Locker] = []

    def make() -> Locker:
        locker = Locker(mysql_url, table=table_name, grace=0)
        made.append(locker)
        return locker

    yield make
    for locker in made:
        locker.close()


def session(url: str) -> Any:
    parsed = sa.make_url(url)
    return pymysql.connect(
        host=parsed.host, port=parsed.port or 3306, user=parsed.username, database=parsed.database
    )


def queue_name(locker: Locker, lockstring: str) -> Any:
    queue_wait = locker._operations.queue_wait
    assert queue_wait is not None
    return queue_wait.key(lockstring)


def queued_behind(connection: Any, name: str) -> bool:
    """Whether anyone holds the queue's name (its head, or a waiter granted it)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT IS_USED_LOCK(%s)", (name,))
        return cursor.fetchone()[0] is not None


@pytest.mark.parametrize("run", range(3))
def test_waiters_of_different_lockers_get_the_lock_in_the_order_they_came(
    lockers: Callable[[], Locker], run: int
) -> None:
    """Backing off, the waiter that asked last had the shortest delay and most often won."""
    holder = lockers()
    held = holder.lock("report", expires=30)
    order: list[str] = []
    threads = []
    for name in "ABC":
        locker = lockers()

        def wait(locker: Locker = locker, name: str = name) -> None:
            with locker.lock("report", wait=30, expires=30):
                order.append(name)
                time.sleep(0.05)

        thread = threading.Thread(target=wait)
        thread.start()
        threads.append(thread)
        time.sleep(0.2)
    held.unlock()
    for thread in threads:
        thread.join(30)
    assert order == ["A", "B", "C"]


def test_a_newcomer_does_not_take_a_free_row_while_anyone_queues(
    lockers: Callable[[], Locker], mysql_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session holding the queue's name stands for a head about to insert: the newcomer's
    first attempt is refused at the gate (IS_FREE_LOCK), and it queues behind; at its
    deadline it makes one full attempt."""
    newcomer = lockers()
    attempts = counting_attempts(newcomer, monkeypatch)
    head = session(mysql_url)
    try:
        with head.cursor() as cursor:
            cursor.execute("SELECT GET_LOCK(%s, 0)", (queue_name(newcomer, "report"),))
            assert cursor.fetchone()[0] == 1
        with newcomer.lock("report", wait=0.5, expires=30) as lock:
            assert lock.is_valid()
        assert len(attempts) == 2
    finally:
        head.close()


def test_a_queued_waiter_leaves_the_queue_once_it_has_the_row(
    lockers: Callable[[], Locker], mysql_url: str
) -> None:
    """Holding a lock holds no connection: the head gives the queue's name up once the row
    is its, and the next newcomer finds the gate open."""
    holder, waiter = lockers(), lockers()
    observer = session(mysql_url)
    name = queue_name(waiter, "report")
    try:
        held = holder.lock("report", expires=30)
        thread, result = wait_in_thread(waiter, wait=30, expires=30)
        wait_until(lambda: queued_behind(observer, name))
        held.unlock()
        thread.join(10)
        lock = result["lock"]
        wait_until(lambda: not queued_behind(observer, name))
        lock.unlock()
        with holder.lock("report", wait=0) as again:
            assert again.is_valid()
    finally:
        observer.close()


def test_waiters_beyond_the_queue_wait_within_the_deadline_and_leave_nothing_behind(
    lockers: Callable[[], Locker], mysql_url: str
) -> None:
    holder, waiter = lockers(), lockers()
    observer = session(mysql_url)
    try:
        with holder.lock("report", expires=30):
            thread, result = wait_in_thread(waiter, wait=0.3, expires=30)
            thread.join(10)
            assert isinstance(result.get("error"), LockBusy)
        wait_until(lambda: not queued_behind(observer, queue_name(waiter, "report")))
    finally:
        observer.close()
