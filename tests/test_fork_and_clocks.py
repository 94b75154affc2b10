"""Fork safety, and independence from the client's clock and time zone."""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa
import time_machine

from sqllocker import LockBusy, Locker, LockError, LockLost
from sqllocker.engine import resolve_url
from sqllocker.holding import CLOCK_DRIFT, TIMESTAMP_SLACK, safety_margin
from tests.conftest import IN_CI
from tests.helpers import abandon, collector_paused

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_in_child(body: Callable[[], None]) -> int:
    """Fork; run ``body`` in the child; return the child's exit code (0 if body returned)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 1
        try:
            body()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_a_child_forked_while_another_thread_sets_up_sets_up_on_its_own(
    locker: Locker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fork while another thread holds the Locker's set-up lock (here the release of a lock
    the collector freed, on sqllocker's own thread, setting up again as after a lost
    connection): the child, which has no such thread, takes a set-up lock of its own instead
    of waiting for that one for ever."""
    import sqllocker.operations.database as database

    set_up = database.set_up
    setting_up = threading.Event()

    def slow_set_up(*args: object, **options: object) -> object:
        setting_up.set()
        time.sleep(1.0)  # a slow server
        return set_up(*args, **options)  # type: ignore[arg-type]

    with collector_paused():
        dropped = locker.lock("dropped")
        dropped.itself = dropped  # type: ignore[attr-defined]  # only the collector frees it
        del dropped
        monkeypatch.setattr(database, "set_up", slow_set_up)
        locker._operations.database.needs_setup = True
        gc.collect()  # its release sets up, slowly, on a thread of sqllocker's own
        assert setting_up.wait(10)

        def child() -> None:
            signal.alarm(20)  # a hung child ends, and fails the test
            database.set_up = set_up
            with locker.lock("child's own"):
                pass
            locker.engine.dispose()

        assert run_in_child(child) == 0


def test_child_after_fork_never_releases_the_parents_lock(
    locker: Locker, caplog: pytest.LogCaptureFixture
) -> None:
    lock = locker.lock("parent's")

    def child() -> None:
        lock.__exit__(None, None, None)  # the child leaving the parent's `with` block
        lock._finalizer()  # what garbage collection or interpreter exit would run
        gc.collect()
        # The child's engine works, on connections of its own.
        with locker.lock("child's own"):
            pass
        locker.engine.dispose()  # closes the child's pool, not the parent's sockets

    assert run_in_child(child) == 0
    assert lock.is_locked
    assert [row.lockstring for row in locker.locks()] == ["parent's"]  # parent's pool still works
    lock.unlock()
    assert locker.locks() == []
    # Had the child used (and closed) the parent's pooled connection, the parent would have had
    # to reconnect.
    assert not [r for r in caplog.records if "connection was lost" in r.getMessage()]


def _record_holder_pid(locker: Locker, lockstring: str) -> None:
    with locker.lock(lockstring) as lock:
        assert lock.locked_by["pid"] == os.getpid()
        row = locker.lock_info(lockstring)
        assert row is not None
        assert row.locked_by["pid"] == os.getpid()


@pytest.mark.parametrize("how", ["os.fork", "multiprocessing fork"])
def test_a_forked_childs_locks_name_the_child(locker: Locker, how: str) -> None:
    """sqllocker keeps its pid without a system call per operation (``sqllocker.forks``): a
    child must still know it is not its parent, in what it writes as in what it refuses."""
    with locker.lock("parent's first"):  # the parent's pid is in use before the fork
        pass
    if how == "os.fork":
        assert run_in_child(lambda: _record_holder_pid(locker, "child's")) == 0
    else:
        child = multiprocessing.get_context("fork").Process(
            target=_record_holder_pid, args=(locker, "child's")
        )
        child.start()
        child.join(60)
        assert child.exitcode == 0
    with locker.lock("parent's again") as lock:
        assert lock.locked_by["pid"] == os.getpid()


# -- client clocks and time zones ----------------------------------------------------------------


@pytest.fixture
def far_east_locker(url: str, table_name: str, make_locker: Any) -> Iterator[Locker]:
    """A locker on the caller's own engine whose process and database session both think they
    are at UTC+14 (Pacific/Kiritimati), while the holders run at UTC-5."""
    make_locker()  # creates the table
    options: dict[str, Any] = {}
    backend = resolve_url(url).get_backend_name()
    if backend == "postgresql":
        options["connect_args"] = {"options": "-c timezone=Pacific/Kiritimati"}
    engine = sa.create_engine(resolve_url(url), **options)
    if backend == "mysql":
        sa.event.listen(
            engine,
            "connect",
            lambda dbapi_connection, _: dbapi_connection.cursor().execute(
                "SET time_zone = '+13:00'"  # MariaDB's furthest east
            ),
        )
    old_tz = os.environ.get("TZ")
    os.environ["TZ"] = "Pacific/Kiritimati"
    time.tzset()
    try:
        yield Locker(engine, table=table_name, grace=0)
    finally:
        if old_tz is None:
            del os.environ["TZ"]
        else:
            os.environ["TZ"] = old_tz
        time.tzset()
        engine.dispose()


def hold_in_other_time_zone(url: str, table: str, lockstring: str, expires: float) -> None:
    """A holder process at UTC-5 that takes ``lockstring`` and exits without releasing it."""
    code = (
        "import os, sys; from sqllocker import Locker\n"
        f"lock = Locker({url!r}, table={table!r}).lock({lockstring!r}, expires={expires})\n"
        "sys.stdout.flush(); os._exit(0)  # die holding it\n"
    )
    env = dict(os.environ, TZ="America/New_York", PGTZ="America/New_York")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, check=True, timeout=60)


def test_other_time_zone_neither_takes_over_nor_purges_a_live_lock(
    url: str, table_name: str, far_east_locker: Locker
) -> None:
    hold_in_other_time_zone(url, table_name, "report", expires=60)
    assert far_east_locker.try_lock("report") is None
    assert far_east_locker.purge_expired_locks() == 0
    (row,) = far_east_locker.locks()
    assert not row.expired
    remaining = row.expires - datetime.now(timezone.utc)
    assert timedelta(seconds=50) < remaining < timedelta(seconds=61)


@pytest.mark.slow
def test_other_time_zone_takes_over_an_expired_lock_on_time(
    url: str, table_name: str, far_east_locker: Locker
) -> None:
    hold_in_other_time_zone(url, table_name, "report", expires=0.5)
    time.sleep(0.7)
    with far_east_locker.lock("report") as lock:
        assert lock.is_locked


@pytest.mark.parametrize("skew", [timedelta(minutes=10), timedelta(minutes=-10)])
def test_client_clock_skew_changes_nothing(locker: Locker, skew: timedelta) -> None:
    live = locker.lock("live", expires=60)
    dying = abandon(locker.lock("dying", expires=0.3))
    real_now = datetime.now(timezone.utc)
    with time_machine.travel(real_now + skew, tick=True):
        assert abs(datetime.now(timezone.utc) - real_now - skew) < timedelta(seconds=5)
        assert abs(time.time() - real_now.timestamp() - skew.total_seconds()) < 5
        # No early takeover, no live row purged.
        assert locker.try_lock("live") is None
        assert locker.purge_expired_locks() == 0
        assert "live" in [row.lockstring for row in locker.locks() if not row.expired]
        # And an expired row is still taken over on time.
        time.sleep(0.5)
        taken = locker.lock("dying", wait=2)
        assert taken.lock_id > dying.lock_id
        taken.unlock()
    live.unlock()


def test_a_forked_childs_unlock_of_its_parents_lock_is_refused(locker: Locker) -> None:
    """A child forked from a holder shares its handle, not its lock: it may neither release
    nor renew nor guard it, and is told the lock is not valid, not locked by it."""
    lock = locker.lock("parent's")

    def child() -> None:
        for action in (lock.unlock, lock.extend):
            with pytest.raises(LockError, match="forked from"):
                action()
        assert not lock.is_valid()
        assert not lock.is_locked
        with pytest.raises(LockLost, match="forked from"):
            lock.check()
        with locker.engine.begin() as conn, pytest.raises(LockError, match="forked from"):
            lock.guard(conn)
        locker.engine.dispose()  # the child's pool, not the parent's sockets

    assert run_in_child(child) == 0
    assert lock.is_valid()
    assert [row.lock_id for row in locker.locks()] == [lock.lock_id]  # the parent's row stands
    lock.unlock()


def test_the_validity_deadline_counts_time_the_machine_spends_suspended(tmp_path: Any) -> None:
    """A suspended machine's monotonic clock stops, its CLOCK_BOOTTIME does not. In a time
    namespace whose boot-time clock runs an hour ahead of its monotonic clock, a lock's deadline
    must be an expiry period ahead of the boot-time clock: on the monotonic clock it would look
    an hour further off, as it does to a machine resumed from an hour's sleep."""
    if not hasattr(time, "CLOCK_BOOTTIME"):
        pytest.skip("CLOCK_BOOTTIME is Linux's")
    script = (
        "import time; from sqllocker import Locker\n"
        f"lock = Locker('sqlite:///{tmp_path / 'locks.db'}').lock('job', expires=60)\n"
        "print(lock._state.valid_until - time.clock_gettime(time.CLOCK_BOOTTIME))\n"
        "lock.unlock()\n"
    )
    try:
        done = subprocess.run(
            ["unshare", "--time", "--boottime", "3600", sys.executable, "-c", script],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
    except (FileNotFoundError, subprocess.CalledProcessError) as error:
        if IN_CI:
            raise
        pytest.skip(f"no time namespace here (unshare --time needs root): {error}")
    left = float(done.stdout)
    assert 60 - safety_margin(60) - 5 < left <= 60 - safety_margin(60)


@pytest.mark.parametrize("ttl", [0.5, 10, 60, 3600, 86400, 30 * 86400])
def test_the_safety_margin_grows_with_the_expiry_period(ttl: float) -> None:
    margin = safety_margin(ttl)
    assert margin <= ttl / 10 + TIMESTAMP_SLACK  # valid for most of its period
    assert margin >= min(ttl / 10, ttl * CLOCK_DRIFT)  # and allows for a day's drift on a day
    if ttl >= 86400:
        assert margin > 60


def test_a_lock_of_a_few_milliseconds_is_never_taken_over_while_its_holder_counts_on_it(
    make_locker: Callable[..., Locker],
) -> None:
    """A holder counts on its lock until a safety margin before the row's expiry, a tenth of a
    short period. SQLite's clock and timestamps are in milliseconds: its ``now`` is up to a
    millisecond behind the moment, so a row of a 3 ms lock expired up to a millisecond before
    its holder's deadline (22 of 300 takeovers met a holder still valid, by up to 0.44 ms).
    The margin allows for the coarsest timestamps of any backend."""
    first, second = make_locker(grace=0), make_locker(grace=0)
    met_valid = 0
    for n in range(150):
        holder = first.lock(f"short {n}", expires=0.003)
        while (taker := second.try_lock(f"short {n}")) is None:
            pass
        met_valid += holder.is_valid()
        abandon(holder)  # its row is the taker's
        taker.unlock()
    assert met_valid == 0


def summer_time_began_within_the_hour() -> str:
    """A POSIX time zone (PostgreSQL reads them) whose summer time began at the start of this
    hour, UTC: for the next day, its calendar's day is 23 hours long."""
    now = time.gmtime()
    return f"SQT0SQS,{now.tm_yday - 1}/{now.tm_hour},{(now.tm_yday + 180) % 365}/0"


def test_a_session_on_a_day_that_changes_to_summer_time_keeps_every_expiry_exact(
    postgresql_url: str, table_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL adds an interval's day part by the session's calendar. The grace (-1 s, a
    day part of -1 as a timedelta) and expiries of a day or more were sent so: in a zone on the
    day it changed to summer time, the grace came out as an hour ahead, so a live lock was
    taken over (and purged, and not counted by a read-write lock or a semaphore), and a lock
    of a day expired an hour short while its holder trusted it."""
    holder = Locker(postgresql_url, table=table_name)  # the default grace, 1 s
    holder.create_table()
    held = holder.lock("report", expires=600)
    permit = holder.semaphore("pool", limit=1).acquire(expires=600)
    zone = summer_time_began_within_the_hour()
    monkeypatch.setenv("PGTZ", zone)
    summer = Locker(postgresql_url, table=table_name)
    try:
        with summer.engine.connect() as conn:
            shift = conn.exec_driver_sql(
                "SELECT extract(epoch FROM clock_timestamp() + interval '-1 day 23:59:59' "
                "- clock_timestamp()), current_setting('TimeZone')"
            ).one()
        assert shift[1] == zone
        assert shift[0] > 3000  # what went wrong: the grace's day, 23 hours long
        assert summer.try_lock("report") is None
        assert summer.purge_expired_locks() == 0
        with pytest.raises(LockBusy):
            summer.semaphore("pool", limit=1).acquire()
        day = 86460.0
        with summer.lock("day", expires=day) as lock:
            assert (lock.expires - lock.created).total_seconds() == pytest.approx(day, abs=1)
            extended = lock.extend(day)
            (row,) = [info for info in summer.locks() if info.lockstring == "day"]
            assert row.seconds_left == pytest.approx(day, abs=5)
            assert extended == row.expires
        window = summer.lock("window", hold_at_least=day)
        window.unlock()
        (kept,) = [info for info in summer.locks() if info.lockstring == "window"]
        assert (kept.expires - kept.created).total_seconds() >= day - 1
        summer.break_lock("window")
    finally:
        held.unlock()
        permit.unlock()
        summer.close()
        holder.close()
