"""Fencing tokens (lock ids) grow in the order the lock is held, whatever the timing.

PostgreSQL and MariaDB both draw a row's id when the INSERT forms the row, before the unique
index is checked: an acquirer that drew id n and was then delayed could insert after a later
acquirer (id n + 1) had held and released the lock, and hold it with the smaller token. The
8-process contention test saw this once on each (one token inversion, no overlap). Here one
acquirer is stopped in that moment for a second, so the race is won by the other every time:
on PostgreSQL by a BEFORE INSERT trigger, which runs after the id is drawn; on MariaDB, where
no trigger runs there, by gdb (tests/gdb_pause_after_draw.py) on a private server.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from sqllocker import Locker, lock_table
from sqllocker.engine import resolve_url
from tests.conftest import IN_CI
from tests.helpers import figure
from tests.private_servers import running_private_server

pytestmark = pytest.mark.slow  # a private MariaDB paused under gdb: not in the quick subset

SLOW_SECONDS = 1.0
GDB_SCRIPT = Path(__file__).with_name("gdb_pause_after_draw.py")


class Holdings:
    """Who held the lock when, with which id, from several threads."""

    def __init__(self) -> None:
        self.held: list[tuple[float, str, int]] = []  # (when acquired, by whom, lock id)
        self.failures: list[BaseException] = []

    def take(self, locker: Locker, who: str, **options: object) -> None:
        try:
            lock = locker.lock("fenced", wait=10, **options)  # type: ignore[arg-type]
            self.held.append((time.monotonic(), who, lock.lock_id))
            lock.unlock()
        except BaseException as error:
            self.failures.append(error)

    def in_thread(self, locker: Locker, who: str, **options: object) -> threading.Thread:
        thread = threading.Thread(target=self.take, args=(locker, who), kwargs=options)
        thread.start()
        return thread

    def check_ids_grow_in_holding_order(self, backend: str) -> None:
        assert self.failures == []
        in_order = sorted(self.held)
        ids = [lock_id for _, _, lock_id in in_order]
        figure(
            "acquirer delayed between drawing its id and the unique check",
            backend,
            f"ids in holding order {ids} ({', '.join(who for _, who, _ in in_order)})",
        )
        assert ids == sorted(set(ids)), in_order


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
    holdings = Holdings()
    delayed = holdings.in_thread(slow, "slow", locked_by={"slow": 1})
    time.sleep(SLOW_SECONDS / 3)  # the slow acquirer has drawn its id and sleeps in the trigger
    holdings.take(quick, "quick")
    delayed.join()
    slow.close()
    quick.close()
    holdings.check_ids_grow_in_holding_order("postgresql")


class PausedDraw:
    """gdb attached to a running mariadbd with tests/gdb_pause_after_draw.py: the next thread
    to draw an auto-increment value stops just after drawing it, until ``release``."""

    def __init__(self, pid: int, signals: Path) -> None:
        if shutil.which("gdb") is None:
            if IN_CI:
                pytest.fail("needs gdb (Debian's gdb package)")
            pytest.skip("needs gdb")
        self.signals = signals
        self.log = signals / "gdb.log"
        self.gdb = subprocess.Popen(
            [
                "gdb",
                "-nx",
                "-q",
                *("-ex", "set pagination off", "-ex", "set confirm off", "-ex", "set non-stop on"),
                *("-ex", f"attach {pid}", "-ex", f"source {GDB_SCRIPT}"),
            ],
            stdin=subprocess.PIPE,
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
            env={**os.environ, "PAUSE_DIR": str(signals)},
            text=True,
        )
        self.wait_for("armed")

    def wait_for(self, signal: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not (self.signals / signal).exists():
            assert self.gdb.poll() is None, self.log.read_text()[-3000:]
            assert time.monotonic() < deadline, (
                f"gdb: no {signal!r}: {self.log.read_text()[-3000:]}"
            )
            time.sleep(0.005)

    def command(self, line: str) -> None:
        assert self.gdb.stdin is not None
        self.gdb.stdin.write(line + "\n")
        self.gdb.stdin.flush()

    def release(self) -> None:
        self.command("python release_paused()")

    def close(self) -> None:
        if self.gdb.poll() is None:
            self.command("detach")
            self.command("quit")
        try:
            self.gdb.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.gdb.kill()
            self.gdb.wait()


@pytest.mark.parametrize(
    "autoinc_lock_mode",
    [
        pytest.param((), id="default autoinc lock mode"),
        # MySQL 8's default: no AUTO-INC table lock for any INSERT.
        pytest.param(("--innodb-autoinc-lock-mode=2",), id="autoinc lock mode 2"),
    ],
)
def test_mariadb_acquirer_paused_after_drawing_its_id_never_holds_after_a_later_one(
    tmp_path: Path, table_name: str, autoinc_lock_mode: tuple[str, ...]
) -> None:
    with running_private_server("mysql", *autoinc_lock_mode) as server:
        slow = Locker(server.url, table=table_name, grace=0)
        quick = Locker(server.url, table=table_name, grace=0)
        slow.create_table()
        for locker in (slow, quick):
            # Connected and set up before the pause, so that nothing else draws an id and no
            # new server thread has to start while gdb holds one.
            locker.lock_info("fenced")
        paused = PausedDraw(server.pid, tmp_path)  # type: ignore[union-attr]
        holdings = Holdings()
        try:
            delayed = holdings.in_thread(slow, "slow")
            paused.wait_for("drawn")
            quicker = holdings.in_thread(quick, "quick")
            quicker.join(timeout=SLOW_SECONDS)
            paused.release()
            delayed.join(timeout=60)
            quicker.join(timeout=60)
        finally:
            paused.close()
        slow.close()
        quick.close()
    holdings.check_ids_grow_in_holding_order("mysql")
