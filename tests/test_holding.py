"""Holding safely: keep-alive, validity deadlines, on_lost, guard() and the settings check."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import gc
import logging
import pickle
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from sqllocker import (
    DatabaseError,
    Lock,
    Locker,
    LockError,
    LockLost,
    TableMissing,
    UnsafeDatabase,
    UnsafeDatabaseWarning,
    clock,
    lock_table,
)
from sqllocker.asyncio import AsyncLocker
from sqllocker.engine import resolve_url
from sqllocker.execution import DriverSession
from sqllocker.holding import safety_margin
from sqllocker.identity import holder_details, new_guid
from sqllocker.migrations import upgrade
from sqllocker.operations import Acquired, Refused
from sqllocker.schema import ID_ORDER_STRIPES
from tests.helpers import count_rows, figure, wait_until
from tests.private_servers import PrivateMariaDB, running_private_server
from tests.workers import async_url


def threads_of(locker: Locker) -> list[str]:
    prefix = locker._keep_alives.name
    return [t.name for t in threading.enumerate() if t.name.startswith(prefix)]


class LostCalls:
    """An on_lost callback that records its calls, their thread and time."""

    def __init__(self) -> None:
        self.calls: list[tuple[LockLost, str, float]] = []
        self.event = threading.Event()

    def __call__(self, lost: LockLost) -> None:
        self.calls.append((lost, threading.current_thread().name, clock.now()))
        self.event.set()


@pytest.mark.slow
def test_keep_alive_holds_a_short_lock_for_many_expiry_periods(make_locker: Any) -> None:
    holder, contender = make_locker(), make_locker()
    lost = LostCalls()
    # A renewal every third of a second, each with nearly 0.6 s to spare before the deadline
    # (at 0.6 s, a loaded machine's MariaDB round trip sometimes outlasted the 0.34 s spare).
    lock = holder.lock("job", expires=1.0, keep_alive=True, on_lost=lost)
    until = time.monotonic() + 8  # eight expiry periods
    while time.monotonic() < until:
        assert contender.try_lock("job") is None  # grace=0: any lapse would let it in
        assert lock.is_valid()
        time.sleep(0.1)
    assert lost.calls == []
    lock.unlock()
    assert count_rows(holder) == 0


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sqlite"])  # the keep-alive's doing: any backend
def test_a_lock_kept_alive_late_in_its_life_is_renewed_before_its_deadline(
    make_locker: Any,
) -> None:
    """``keep_alive()`` with less than a renewal's interval (a third of the period) left: the
    first renewal comes before the deadline, not a third of the period from now."""
    holder, contender = make_locker(), make_locker()
    lost = LostCalls()
    lock = holder.lock("job", expires=3.0)
    time.sleep(2.3)
    lock.keep_alive(on_lost=lost)
    until = time.monotonic() + 3  # past the deadline it had
    while time.monotonic() < until:
        assert contender.try_lock("job") is None
        assert lock.is_valid()
        time.sleep(0.1)
    assert lost.calls == []
    lock.unlock()


def test_one_keep_alive_thread_serves_all_of_a_lockers_locks(locker: Locker) -> None:
    # (A period of 3 s: a renewal is late, and starts another worker, once it has waited half
    # a second, or a quarter of its lock's time to spare; 20 renewals on one worker took more
    # than a 1 s lock's 0.17 s when MariaDB was slow under the suite's load.)
    locks = [locker.lock(f"job {n}", expires=3, keep_alive=True) for n in range(20)]
    time.sleep(1.5)  # the first renewals (at 0.7 s) done
    names = threads_of(locker)
    assert names.count(locker._keep_alives.name) == 1  # the scheduler
    assert len(names) <= 2  # and at most one worker for the statements
    assert all(lock.is_valid() for lock in locks)
    for lock in locks:
        lock.unlock()


def test_on_lost_is_called_once_from_the_renewal_thread_when_the_lock_is_broken(
    locker: Locker,
) -> None:
    lost = LostCalls()
    lock = locker.lock("job", expires=0.6, keep_alive=True, on_lost=lost)
    assert locker.break_lock("job") is not None
    assert lost.event.wait(5)
    time.sleep(0.5)
    assert len(lost.calls) == 1
    error, thread, _ = lost.calls[0]
    assert thread.startswith("sqllocker")
    assert error.lockstring == "job"
    assert not lock.is_valid()
    assert not lock.is_locked
    with pytest.raises(LockLost):
        lock.check()
    with pytest.raises(LockLost):
        lock.extend()


def test_a_lock_whose_row_an_operator_renamed_is_lost_to_its_holder(
    locker: Locker, make_locker: Any
) -> None:
    """An operator renames the row (``UPDATE ... SET lockstring``): the lock is anyone's under
    its name, and its holder, renewing the renamed row, never learnt it had lost the lock (a
    second holder), nor when its release deleted the renamed row."""
    lost = LostCalls()
    lock = locker.lock("job", expires=0.6, keep_alive=True, on_lost=lost)
    with locker.engine.begin() as conn:
        conn.execute(
            sa.text(f"UPDATE {locker.table_name} SET lockstring = 'job old' WHERE id = :id"),
            {"id": lock.lock_id},
        )
    other = make_locker().lock("job")
    assert lost.event.wait(5), "the holder was not told"
    assert not lock.is_valid()
    with pytest.raises(LockLost):
        lock.extend()
    with pytest.raises(LockLost):
        lock.unlock()
    other.unlock()
    held = make_locker().lock("job old", wait=10)  # the renamed row, nobody's: once it expires
    held.unlock()


def test_a_renamed_row_is_not_released_as_its_holders_lock(locker: Locker) -> None:
    lock = locker.lock("job")
    with locker.engine.begin() as conn:
        conn.execute(
            sa.text(f"UPDATE {locker.table_name} SET lockstring = 'job old' WHERE id = :id"),
            {"id": lock.lock_id},
        )
    with pytest.raises(LockLost):
        lock.unlock()


def test_on_lost_fires_at_the_deadline_when_renewals_keep_failing(
    locker: Locker, monkeypatch: pytest.MonkeyPatch
) -> None:
    lost = LostCalls()
    lock = locker.lock("job", expires=1.0, keep_alive=True, on_lost=lost)
    # The acquire's sending time plus the expiry, less the safety margin: before the row can
    # expire on the server, let alone be taken over.
    deadline = lock._state.valid_until

    def database_down(*_: object) -> None:
        raise DatabaseError("simulated outage")

    monkeypatch.setattr(locker._operations, "extend", database_down)
    assert lost.event.wait(5)
    _, _, when = lost.calls[0]
    assert when >= deadline  # told at the deadline (the margin is for a late thread), not before
    assert not lock.is_valid()


def test_a_slow_on_lost_delays_no_other_locks_on_lost(
    locker: Locker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two kept-alive locks whose renewals fail: the first one's on_lost does not return until
    the second's has been called. Called on the keep-alive's scheduler, it kept the second lock
    from being declared lost at its deadline, and its on_lost came after the lock could be
    taken over (or never)."""
    second_told = threading.Event()
    first_saw: list[bool] = []

    def first_on_lost(_error: LockLost) -> None:
        first_saw.append(second_told.wait(30))

    first = locker.lock("first", expires=1.0, keep_alive=True, on_lost=first_on_lost)
    second = locker.lock(
        "second", expires=1.5, keep_alive=True, on_lost=lambda _error: second_told.set()
    )

    def database_down(*_: object) -> None:
        raise DatabaseError("simulated outage")

    monkeypatch.setattr(locker._operations, "extend", database_down)
    assert second_told.wait(30)
    wait_until(lambda: bool(first_saw))
    assert first_saw == [True]  # the second was told while the first's on_lost still ran
    assert not first.is_valid()
    assert not second.is_valid()


@pytest.mark.parametrize("answer", ["given", "lost"])
def test_a_kept_alive_lock_given_a_shorter_expiry_is_renewed_by_it(
    locker: Locker, monkeypatch: pytest.MonkeyPatch, answer: str
) -> None:
    """extend(2) on a kept-alive lock of 30 s: the keep-alive renews it every two thirds of a
    second from then on, not after the ten seconds the longer period gave (it ran out between
    two renewals). If the extend's answer is lost, the lock's deadline is the shorter one, and
    the keep-alive renews it by then, not told lost; and by the shorter period from then on:
    the extend may yet reach the server after a renewal, and leave the row no more."""
    lost = LostCalls()
    lock = locker.lock("job", expires=30, keep_alive=True, on_lost=lost)
    if answer == "lost":
        monkeypatch.setattr(
            locker._operations, "extend", _then_answer_lost(locker._operations.extend)
        )
        with pytest.raises(DatabaseError):
            lock.extend(2)
        monkeypatch.undo()
    else:
        lock.extend(2)
    time.sleep(3)  # past the deadline extend(2) set: renewed meanwhile
    assert lock.is_valid()
    assert lost.calls == []
    row = locker.lock_info("job")
    assert row is not None
    assert row.seconds_left < 2.5
    lock.unlock()


@pytest.mark.slow
def test_transient_renewal_errors_are_retried(
    locker: Locker, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    lost = LostCalls()
    lock = locker.lock("job", expires=1.5, keep_alive=True, on_lost=lost)
    real_extend = locker._operations.extend
    first_deadline = lock._state.valid_until
    failures = {"left": 2}
    renewals: list[object] = []
    renewed = threading.Event()

    def flaky(*args: Any) -> Any:
        if failures["left"]:
            failures["left"] -= 1
            raise DatabaseError("simulated hiccup")
        result = real_extend(*args)
        renewals.append(result)
        if len(renewals) == 2:
            renewed.set()
        return result

    monkeypatch.setattr(locker._operations, "extend", flaky)
    # Two renewals after the two failures: retried, and kept on its schedule after. One too
    # late would have found the lock lost instead.
    assert renewed.wait(10)
    assert failures["left"] == 0
    assert lock._state.valid_until > first_deadline
    assert lost.calls == []
    assert lock.is_valid()
    assert any("could not renew" in record.getMessage() for record in caplog.records)
    lock.unlock()


def test_is_valid_and_check_follow_the_local_deadline(locker: Locker) -> None:
    lock = locker.lock("job", expires=0.5)
    assert lock.is_valid()
    lock.check()
    time.sleep(0.5)
    assert not lock.is_valid()  # the deadline is before the server's expiry
    with pytest.raises(LockLost, match="deadline"):
        lock.check()
    lock.unlock()  # nobody took it over: the row is still ours to delete


def test_leaving_a_with_block_whose_lock_lapsed_raises_lock_lost(locker: Locker) -> None:
    with pytest.raises(LockLost), locker.lock("job", expires=0.3):
        time.sleep(0.4)
    assert count_rows(locker) == 0  # and the row was still cleaned up

    def lapse_then_fail() -> None:
        with locker.lock("job", expires=0.3):
            time.sleep(0.4)
            raise ValueError("the body's own error")

    with pytest.raises(LockLost) as caught:
        lapse_then_fail()
    assert isinstance(caught.value.__cause__, ValueError)


@pytest.mark.slow
def test_release_racing_renewal_leaves_no_row_and_no_late_write(
    make_locker: Any, caplog: pytest.LogCaptureFixture
) -> None:
    locker = make_locker(keep_alive_fraction=0.05)  # renew every 1.5 ms: many races
    locker.lock("warm up").unlock()
    caplog.set_level(logging.DEBUG, logger="sqllocker.sql")
    released_at: dict[int, float] = {}
    rounds = 1000
    for n in range(rounds):
        lock = locker.lock("job", expires=0.03, keep_alive=True)
        time.sleep((n % 7) * 0.002)
        lock.unlock()
        released_at[lock.lock_id] = time.time()
    time.sleep(0.1)
    renewals = [
        (record.created, record.sqllocker_values["lock_id"])  # type: ignore[attr-defined]
        for record in caplog.records
        if record.name == "sqllocker.sql" and record.getMessage().startswith("UPDATE")
    ]
    late = [(when, lock_id) for when, lock_id in renewals if when > released_at[lock_id]]
    figure(
        "release racing renewal",
        locker.engine.dialect.name,
        f"{rounds} releases under renewal every 1.5 ms, {len(renewals)} renewals; "
        f"writes after release {len(late)}, rows left {count_rows(locker)}",
    )
    assert late == []
    assert count_rows(locker) == 0
    assert len(renewals) > 0  # the race was real: renewals did run


def test_locks_dropped_while_kept_alive_stop_being_renewed(locker: Locker) -> None:
    lock = locker.lock("job", expires=0.6, keep_alive=True)
    del lock  # garbage collection releases it, and the keep-alive lets go of it
    time.sleep(0.3)
    assert count_rows(locker) == 0
    assert len(locker._keep_alives) == 0


def test_a_lock_is_neither_copied_nor_pickled(locker: Locker) -> None:
    """A shallow copy shared the handle's finaliser: dropping the original released the row
    under the copy, which went on as if it held the lock."""
    lock = locker.lock("job")
    for copying in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError):
            copying(lock)
    lock.unlock()


def test_a_dropped_lock_whose_on_lost_refers_to_it_is_released(locker: Locker) -> None:
    """Its ``on_lost`` closes over the lock: the keep-alive and the finaliser, which hold the
    lock's state, must not keep the lock itself from being collected (and so renewed for
    ever, its row never given back)."""
    told: list[str] = []

    class Alarm:
        lock: Lock

        def __call__(self, lost: LockLost) -> None:
            told.append(self.lock.lockstring)

    alarm = Alarm()
    alarm.lock = locker.lock("job", expires=0.6, keep_alive=True, on_lost=alarm)
    del alarm
    gc.collect()  # a cycle: the lock, its state, its on_lost
    wait_until(lambda: count_rows(locker) == 0, timeout=5)
    wait_until(lambda: len(locker._keep_alives) == 0, timeout=5)
    assert told == []


def test_a_kept_alive_lock_whose_locker_is_closed_is_lost_and_its_holder_told(
    make_locker: Any,
) -> None:
    """Nothing renews it any more: it expires, and its holder, which counts on on_lost to
    stop its work, must hear of it."""
    locker = make_locker()
    lost = LostCalls()
    lock = locker.lock("job", expires=5, keep_alive=True, on_lost=lost)
    locker.close()
    assert [call[0].lockstring for call in lost.calls] == ["job"]
    assert "its locker was closed" in str(lost.calls[0][0])
    assert not lock.is_valid()
    with contextlib.suppress(LockError):  # its row, still there, given back
        lock.unlock()


# -- guard -----------------------------------------------------------------------------------------


@pytest.fixture
def app_engine(url: str) -> Iterator[sa.Engine]:
    """The application's own engine on the lock's database, for its own transactions."""
    engine = sa.create_engine(resolve_url(url))
    yield engine
    engine.dispose()


def test_guard_holds_off_takeover_until_the_transaction_ends(
    locker: Locker, make_locker: Any, app_engine: sa.Engine
) -> None:
    contender = make_locker()
    lock = locker.lock("job", expires=0.5)
    taken: list[float] = []
    with app_engine.connect() as conn, conn.begin():
        lock.guard(conn)
        time.sleep(0.7)  # the lock expires while the guarded transaction is open

        def take() -> None:
            with contender.lock("job", wait=30):
                taken.append(time.monotonic())

        thread = threading.Thread(target=take)
        thread.start()
        time.sleep(0.5)
        assert taken == []  # the takeover waits for the guarded transaction
        committed = time.monotonic()
    thread.join(30)
    assert taken
    assert taken[0] > committed


def test_guard_refuses_a_stale_holder(locker: Locker, app_engine: sa.Engine) -> None:
    stale = locker.lock("job", expires=0.2)
    time.sleep(0.4)
    fresh = locker.lock("job")
    with app_engine.connect() as conn:
        conn.begin()
        with pytest.raises(LockLost, match="roll this transaction back"):
            stale.guard(conn)
        conn.rollback()
        conn.begin()
        fresh.guard(conn)
        conn.commit()
    fresh.unlock()


@pytest.mark.parametrize("backend", ["postgresql"])
@pytest.mark.parametrize("snapshot", ["before the renewal", "before the acquire"])
def test_guard_in_a_snapshot_older_than_the_row_is_a_lock_error_and_no_loss(
    locker: Locker, app_engine: sa.Engine, snapshot: str
) -> None:
    """PostgreSQL under REPEATABLE READ reads the snapshot its transaction took first: a row
    renewed since cannot be share-locked (a serialization failure, which escaped as
    SQLAlchemy's own error), and a row made since is not seen (the live lock was declared lost,
    on_lost called). Either way guard() cannot prove the lock: a LockError that says why,
    with the lock left valid."""
    lost = LostCalls()
    lock = None if snapshot == "before the acquire" else locker.lock("job", on_lost=lost)
    with app_engine.connect() as conn:
        conn.begin()
        conn.exec_driver_sql("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        conn.exec_driver_sql("SELECT 1")  # the snapshot
        if lock is None:
            lock = locker.lock("job", on_lost=lost)
        else:
            lock.extend()
        with pytest.raises(LockError, match="snapshot it took first") as caught:
            lock.guard(conn)
        assert not isinstance(caught.value, LockLost)
        conn.rollback()
    assert lock.is_valid()
    assert lost.calls == []
    with app_engine.connect() as conn, conn.begin():
        lock.guard(conn)  # READ COMMITTED: proven
    # A lock truly gone is lost, whatever the snapshot: the row is read again outside it.
    locker.break_lock("job")
    with app_engine.connect() as conn:
        conn.begin()
        conn.exec_driver_sql("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        with pytest.raises(LockLost):
            lock.guard(conn)
        conn.rollback()
    assert len(lost.calls) == 1


# How long the server lets the session sit silent in a transaction (0: for ever), as it says.
SILENCE_SETTING = {
    "postgresql": "SHOW idle_in_transaction_session_timeout",
    "mysql": "SELECT @@session.idle_transaction_timeout",
}


@pytest.mark.parametrize("ending", ["commit", "rollback"])
def test_guard_leaves_a_healthy_transaction_and_its_pooled_connection_as_they_were(
    locker: Locker, url: str, backend: str, table_name: str, ending: str
) -> None:
    """guard() bounds how long the server keeps the transaction of a client that falls
    silent; a client that is not silent commits as before, and the connection goes back to
    the pool with the session's own setting."""
    engine = sa.create_engine(resolve_url(url), pool_size=1, max_overflow=0)
    work = f"{table_name}_work"
    setting = SILENCE_SETTING.get(backend)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql(f"CREATE TABLE {work} (n INTEGER)")
        with engine.connect() as conn:
            before = conn.exec_driver_sql(setting).scalar() if setting else None
            conn.rollback()
        lock = locker.lock("job", expires=30)
        longer = locker.lock("other job", expires=600)
        with engine.connect() as conn:
            conn.begin()
            longer.guard(conn)
            if setting:
                longer_limit = conn.exec_driver_sql(setting).scalar()
                assert longer_limit not in {"0", 0, before}
            lock.guard(conn)  # the lock with less life left shortens it
            if setting:
                limit = conn.exec_driver_sql(setting).scalar()
                assert limit != longer_limit
            longer.guard(conn)  # and the shorter limit stands
            if setting:
                assert conn.exec_driver_sql(setting).scalar() == limit
            conn.exec_driver_sql(f"INSERT INTO {work} (n) VALUES (1)")
            time.sleep(0.3)
            getattr(conn, ending)()
            if setting:
                assert conn.exec_driver_sql(setting).scalar() == before
                conn.rollback()
        with engine.connect() as conn:  # the same pooled connection
            if setting:
                assert conn.exec_driver_sql(setting).scalar() == before
            written = list(conn.exec_driver_sql(f"SELECT n FROM {work}").scalars())
        assert written == ([1] if ending == "commit" else [])
        lock.unlock()
        longer.unlock()
    finally:
        engine.dispose()


@pytest.mark.parametrize("backend", ["postgresql", "mysql"])
def test_guard_keeps_a_shorter_silence_limit_the_session_has(
    locker: Locker, app_engine: sa.Engine, backend: str
) -> None:
    """A session that ends silent transactions sooner than the lock's life keeps its limit."""
    own = {"postgresql": "'7s'", "mysql": "7"}[backend]
    variable = {
        "postgresql": "idle_in_transaction_session_timeout",
        "mysql": "idle_transaction_timeout",
    }[backend]
    lock = locker.lock("job", expires=600)
    with app_engine.connect() as conn:
        conn.exec_driver_sql(f"SET SESSION {variable} = {own}")
        conn.commit()
        shown = conn.exec_driver_sql(SILENCE_SETTING[backend]).scalar()
        conn.rollback()
        conn.begin()
        lock.guard(conn)
        assert conn.exec_driver_sql(SILENCE_SETTING[backend]).scalar() == shown
        conn.commit()
        assert conn.exec_driver_sql(SILENCE_SETTING[backend]).scalar() == shown
        conn.rollback()
    lock.unlock()


@pytest.mark.parametrize("backend", ["postgresql", "mysql"])
def test_guard_bounds_the_silence_before_it_locks_the_row(
    locker: Locker, app_engine: sa.Engine, backend: str
) -> None:
    """The server's limit on a silent guarded transaction is in place before the row is locked
    for it: set after, a client cut off between the two statements held the row, and the
    lock from anyone else, for as long as TCP took to give up."""
    seen: list[str] = []

    def record(_conn: object, _cursor: object, statement: str, *_: object) -> None:
        if "FOR SHARE" in statement or "SHARE MODE" in statement:
            seen.append("the row locked")
        elif "idle_" in statement and ("SET" in statement or "set_config" in statement):
            seen.append("the silence bounded")

    lock = locker.lock("job", expires=600)
    sa.event.listen(app_engine, "before_cursor_execute", record)
    try:
        with app_engine.begin() as conn:
            lock.guard(conn)
    finally:
        sa.event.remove(app_engine, "before_cursor_execute", record)
    assert seen[:2] == ["the silence bounded", "the row locked"], seen
    lock.unlock()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["postgresql", "mysql"])
def test_breaking_a_guarded_lock_fails_soon_and_says_why(
    make_locker: Any, app_engine: sa.Engine, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A guard's row lock holds off break_lock (`release --force`) too, until the guarded
    transaction ends: never by ending another role's session, which needs privileges. The
    break gives up after one lock wait (and one retry), with an error that names the cause,
    rather than retrying lock waits for a minute and more."""
    # The sessions' row-lock timeout, read when the locker's engine is made: the claim is the
    # number of waits, not their length (the servers' shortest, 1 s, rather than 10 s each).
    monkeypatch.setattr(f"sqllocker.backends.{backend}.ROW_LOCK_TIMEOUT_SECONDS", 1)
    locker = make_locker()
    waits: list[BaseException] = []
    affected = DriverSession.affected

    def counted(session: DriverSession, statement: Any, values: Any) -> int:
        try:
            return affected(session, statement, values)
        except BaseException as error:
            waits.append(error)
            raise

    monkeypatch.setattr(DriverSession, "affected", counted)
    lock = locker.lock("job", expires=600)
    with app_engine.connect() as conn:
        conn.begin()
        lock.guard(conn)
        with pytest.raises(LockError, match="transaction still open"):
            locker.break_lock("job")
        assert len(waits) == 2  # two lock waits, not nine
        conn.commit()
    lock.unlock()


def test_guard_needs_a_transaction(locker: Locker, app_engine: sa.Engine, url: str) -> None:
    """A transaction that commits with the work: not none, not AUTOCOMMIT's (whose
    ``begin()`` commits each statement, the row lock with it: the work would commit later
    under nothing), not a savepoint's (rolled back, it lets the row lock go, and the
    transaction around it may still commit)."""
    with (
        locker.lock("job") as lock,
        app_engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn,
    ):
        with pytest.raises(LockError, match="inside a transaction"):
            lock.guard(conn)
        with conn.begin(), pytest.raises(LockError, match="not in AUTOCOMMIT"):
            lock.guard(conn)
    with locker.lock("job") as lock, app_engine.begin() as conn:
        with conn.begin_nested(), pytest.raises(LockError, match="savepoint"):
            lock.guard(conn)
        lock.guard(conn)  # the transaction itself
    # Autocommit for every connection: SQLAlchemy's, and the driver's, which SQLAlchemy does
    # not see.
    sqlite = make_url(url).get_backend_name() == "sqlite"
    driver_autocommit = {"isolation_level": None} if sqlite else {"autocommit": True}
    for options, refusal in [
        ({"isolation_level": "AUTOCOMMIT"}, "not in AUTOCOMMIT"),
        ({"connect_args": driver_autocommit}, "driver commits each statement"),
    ]:
        committing = sa.create_engine(resolve_url(url), **options)
        try:
            with (
                locker.lock("job") as lock,
                committing.begin() as conn,
                pytest.raises(LockError, match=refusal),
            ):
                lock.guard(conn)
        finally:
            committing.dispose()


# -- server settings ------------------------------------------------------------------------------


@contextlib.contextmanager
def unsafe_database(url: str, table: str) -> Iterator[tuple[sa.Engine, str]]:
    """An engine whose sessions (or table ``table``, made here) can lose acknowledged rows,
    and the URL of its database."""
    backend = make_url(url).get_backend_name()
    if backend == "mysql":
        # A server-wide setting: a private server started with it, never the shared server.
        with running_private_server("mysql", "--innodb-flush-log-at-trx-commit=2") as server:
            engine = sa.create_engine(resolve_url(server.url))
            try:
                lock_table(table).create(engine)
                yield engine, server.url
            finally:
                engine.dispose()
        return
    engine = sa.create_engine(resolve_url(url))
    try:
        lock_table(table).create(engine)
        if backend == "postgresql":
            with engine.begin() as conn:
                conn.exec_driver_sql(f"ALTER TABLE {table} SET UNLOGGED")
        else:
            engine.dispose()  # its connections from now on lose rows
            sa.event.listen(
                engine, "connect", lambda dbapi, _: dbapi.execute("PRAGMA synchronous=OFF")
            )
        yield engine, url
    finally:
        engine.dispose()


def test_settings_that_lose_rows_warn_or_refuse(url: str, table_name: str) -> None:
    with unsafe_database(url, table_name) as (engine, database_url):
        with pytest.warns(UnsafeDatabaseWarning) as caught:
            Locker(engine, table=table_name).lock("job").unlock()
        messages = [str(w.message) for w in caught if w.category is UnsafeDatabaseWarning]
        assert any(
            name in message
            for message in messages
            for name in ("UNLOGGED", "innodb_flush_log_at_trx_commit=2", "synchronous=OFF")
        ), messages
        with pytest.raises(UnsafeDatabase):
            Locker(engine, table=table_name, strict=True).lock("job")
        assert count_rows(Locker(database_url, table=table_name)) == 0  # strict wrote nothing


def test_a_mariadb_session_whose_clock_is_set_is_reported_or_refused(
    mysql_url: str, table_name: str
) -> None:
    """MariaDB's NOW() and UTC_TIMESTAMP(), the statements' clock, follow a session's
    ``timestamp`` once something sets it (an init_command, a test's frozen clock): 100 s
    behind, a holder's rows are written expired already, and taken at once by anyone else."""
    Locker(mysql_url, table=table_name).create_table()
    behind = {"init_command": "SET timestamp = UNIX_TIMESTAMP() - 100"}
    engine = sa.create_engine(resolve_url(mysql_url), connect_args=behind)
    try:
        with pytest.raises(UnsafeDatabase, match="SET timestamp gives this session a clock"):
            Locker(engine, table=table_name, strict=True).lock("refused")
        with pytest.warns(UnsafeDatabaseWarning, match="SET timestamp"):
            Locker(engine, table=table_name).lock("warned").unlock()
        assert count_rows(Locker(mysql_url, table=table_name)) == 0  # strict wrote nothing
    finally:
        engine.dispose()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnsafeDatabaseWarning)
        Locker(mysql_url, table=table_name).lock("the server's clock").unlock()
        # sqllocker's own connections set the clock back, whatever the URL's init_command:
        # even one frozen at the moment of connecting, which the check cannot tell.
        for frozen in ("UNIX_TIMESTAMP() - 100", "UNIX_TIMESTAMP()"):
            url = make_url(mysql_url).update_query_dict(
                {"init_command": f"SET timestamp = {frozen}"}
            )
            locker = Locker(url, table=table_name, strict=True)
            time.sleep(1.1)  # a clock frozen at connect is now a second behind
            with locker.lock("own connections") as lock:
                assert (lock.expires - lock.created).total_seconds() == pytest.approx(3600, abs=2)
                row = Locker(mysql_url, table=table_name).lock_info("own connections")
                assert row is not None
                assert row.seconds_left > 3590  # by the server's own clock
            locker.close()


@pytest.mark.slow
def test_mariadb_autoinc_lock_mode_2_is_safe_only_with_the_id_order_table(
    table_name: str,
) -> None:
    """With innodb_autoinc_lock_mode=2 (MySQL 8's default) only the stripes table the
    migration makes keeps lock ids in holding order (see test_fencing.py): a table without it
    warns, or with strict refuses, naming the command that makes it; once it is there, neither."""
    # A server setting (read-only while it runs), so a private server started with it.
    with running_private_server("mysql", "--innodb-autoinc-lock-mode=2") as server:
        engine = sa.create_engine(resolve_url(server.url))
        upgrade(engine, table_name)
        with engine.begin() as conn:  # as on a table whose stripes were dropped
            conn.exec_driver_sql(f"DROP TABLE {table_name}_id_order")
        reorders = (
            f"innodb_autoinc_lock_mode=2 with lock table {table_name} lacking "
            f"{table_name}_id_order \\(run `sqllocker --url URL --table "
            f"{table_name} migrate`\\) can hand out lock ids out of holding order"
        )
        warned = Locker(server.url, table=table_name)
        with pytest.warns(UnsafeDatabaseWarning, match=reorders):
            warned.lock("job").unlock()
        assert warned._operations.statements.id_order is None
        with pytest.raises(UnsafeDatabase, match=reorders):
            Locker(server.url, table=table_name, strict=True).lock("job")
        assert count_rows(Locker(server.url, table=table_name)) == 0  # strict wrote nothing
        with engine.begin() as conn:  # the stripes back, as the migration makes them
            conn.exec_driver_sql(
                f"CREATE TABLE {table_name}_id_order (stripe SMALLINT PRIMARY KEY) ENGINE=InnoDB"
            )
            stripes = ", ".join(f"({n})" for n in range(ID_ORDER_STRIPES))
            conn.exec_driver_sql(f"INSERT INTO {table_name}_id_order VALUES {stripes}")
        warned.create_table()  # up to date already; the settings are read again after it
        with warnings.catch_warnings():
            warnings.simplefilter("error", UnsafeDatabaseWarning)
            warned.lock("job").unlock()  # the locker that migrated takes the stripe lock now
            assert warned._operations.statements.id_order is not None
            migrated = Locker(server.url, table=table_name, strict=True)
            migrated.lock("job").unlock()
        statements = migrated._operations.statements
        assert statements.id_order is not None
        assert "FOR UPDATE" in str(statements.acquire.compile(dialect=engine.dialect))
        # Without its stripe's row an acquire would insert nothing, silently, for ever.
        with engine.begin() as conn:
            conn.exec_driver_sql(
                f"DELETE FROM {table_name}_id_order "
                f"WHERE stripe = CRC32('job') %% {ID_ORDER_STRIPES}"
            )
        with pytest.raises(TableMissing, match=f"{table_name}_id_order lacks the row of 'job'"):
            migrated.lock("job")
        assert migrated.locks() == []
        migrated.lock("another job").unlock()  # another stripe
        migrated.close()
        engine.dispose()


@pytest.mark.slow
def test_a_server_restarted_with_other_settings_is_checked_again(table_name: str) -> None:
    """A Locker reads the settings when it first connects, and again once it finds its
    connection lost, as a restart shows: a server restarted in MySQL 8's autoinc mode then gets
    the stripe lock, and one restarted with an unsafe setting the warning, while the
    application runs on."""
    with running_private_server("mysql") as server:
        assert isinstance(server, PrivateMariaDB)
        engine = sa.create_engine(resolve_url(server.url))
        upgrade(engine, table_name)
        engine.dispose()
        locker = Locker(server.url, table=table_name)
        with warnings.catch_warnings():
            warnings.simplefilter("error", UnsafeDatabaseWarning)
            locker.lock("job").unlock()
        assert locker._operations.statements.id_order is None  # mode 1: the AUTO-INC lock orders
        server.stop(crash=False)
        server.options = ("--innodb-autoinc-lock-mode=2", "--innodb-flush-log-at-trx-commit=2")
        server.start()
        with pytest.warns(UnsafeDatabaseWarning, match="innodb_flush_log_at_trx_commit=2"):
            locker.lock("job").unlock()
        assert locker._operations.statements.id_order is not None
        statement = str(
            locker._operations.statements.acquire.compile(dialect=locker.engine.dialect)
        )
        assert "FOR UPDATE" in statement
        locker.close()


def test_safe_database_gives_no_warning(locker: Locker) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnsafeDatabaseWarning)
        Locker(locker.url, table=locker.table_name, strict=True).lock("job").unlock()


# -- contention the database resolves by failing a statement ---------------------------------------


def impatient_engine(url: str) -> sa.Engine:
    """An engine whose statements give up waiting for a row lock after one second."""
    target = resolve_url(url)
    backend = target.get_backend_name()
    if backend == "postgresql":
        return sa.create_engine(target, connect_args={"options": "-c lock_timeout=1000"})
    if backend == "mysql":
        return sa.create_engine(
            target, connect_args={"init_command": "SET SESSION innodb_lock_wait_timeout = 1"}
        )
    return sa.create_engine(target, connect_args={"timeout": 1})


@pytest.mark.slow
def test_release_and_extend_outlast_a_lock_wait_timeout(
    url: str, table_name: str, make_locker: Any, app_engine: sa.Engine
) -> None:
    make_locker()  # the table
    engine = impatient_engine(url)
    locker = Locker(engine, table=table_name, grace=0)
    lock = locker.lock("job", expires=60)
    for operation in (lock.extend, lock.unlock):
        with app_engine.connect() as blocker:
            blocker.begin()
            if blocker.dialect.name == "sqlite":
                blocker.exec_driver_sql("BEGIN IMMEDIATE")  # SQLite locks the whole database
            else:
                blocker.execute(
                    sa.select(locker.table.c.id)
                    .where(locker.table.c.id == lock.lock_id)
                    .with_for_update()
                )
            letting_go = threading.Timer(2.5, blocker.rollback)
            letting_go.start()
            started = time.monotonic()
            operation()  # times out waiting twice, then succeeds once the blocker lets go
            assert time.monotonic() - started >= 2
            # The timer's thread may still be reading the ROLLBACK's answer: leaving the block
            # meanwhile would send another on the same connection.
            letting_go.join()
    assert count_rows(locker) == 0
    engine.dispose()


def test_failed_release_leaves_the_lock_held_for_another_try(
    locker: Locker, monkeypatch: pytest.MonkeyPatch
) -> None:
    lock = locker.lock("job", expires=30, keep_alive=True)
    real_release = locker._operations.release
    failures = {"left": 1}

    def flaky(*args: Any) -> None:
        if failures["left"]:
            failures["left"] -= 1
            raise DatabaseError("simulated outage", "job")
        real_release(*args)

    monkeypatch.setattr(locker._operations, "release", flaky)
    with pytest.raises(DatabaseError):
        lock.unlock()
    assert lock.is_locked  # the row is still there, and unlock() can be tried again...
    assert len(locker._keep_alives) == 0  # ...but it is no longer renewed
    assert locker.lock_info("job") is not None
    lock.unlock()
    assert not lock.is_locked
    assert locker.lock_info("job") is None
    # A lock dropped after a failed release is still released by its finaliser.
    dropped = locker.lock("dropped")
    failures["left"] = 1
    with pytest.raises(DatabaseError):
        dropped.unlock()
    del dropped
    gc.collect()
    assert locker.lock_info("dropped") is None


# -- what each statement waits for: PostgreSQL's commit flush -------------------------------------


@pytest.fixture
def commit_modes(postgresql_url: str, table_name: str) -> str:
    """The test's table, with a trigger that notes each write's ``synchronous_commit``: the
    setting its transaction commits under."""
    engine = sa.create_engine(resolve_url(postgresql_url))
    lock_table(table_name).create(engine)
    with engine.begin() as conn:
        conn.exec_driver_sql(
            f"CREATE TABLE {table_name}_modes (n serial, op text, lockstring text, mode text)"
        )
        conn.exec_driver_sql(
            f"CREATE FUNCTION {table_name}_mode() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            f"INSERT INTO {table_name}_modes (op, lockstring, mode) VALUES (TG_OP, "
            "COALESCE(NEW.lockstring, OLD.lockstring), current_setting('synchronous_commit')); "
            "RETURN NULL; END $$"
        )
        conn.exec_driver_sql(
            f"CREATE TRIGGER {table_name}_mode AFTER INSERT OR UPDATE OR DELETE ON {table_name} "
            f"FOR EACH ROW EXECUTE FUNCTION {table_name}_mode()"
        )
    engine.dispose()
    return postgresql_url


def test_only_a_release_commits_before_its_flush_on_postgresql(
    commit_modes: str, table_name: str
) -> None:
    """A release lost in a server crash leaves the lock held until it expires: no second holder
    (an acquirer's own flush covers every earlier commit). A lost acquire or extend would let
    one in, so those, the takeover, an operator's break and the purge wait for the flush."""
    locker = Locker(commit_modes, table=table_name, grace=0)
    lock = locker.lock("job", expires=60)
    lock.extend(60)
    lock.unlock()
    again = locker.lock("job", expires=60)  # on the release's connection: its setting is gone
    locker.break_lock("job", again.lock_id)
    expiring = locker.lock("expiring", expires=0.2)
    purged = locker.lock("purged", expires=0.2)
    time.sleep(0.5)
    taken_over = locker.lock("expiring", expires=60)
    assert locker.purge_expired_locks() == 1
    taken_over.unlock()
    del again, expiring, purged  # each already gone from the table: their finalisers write nothing
    locker.close()
    with sa.create_engine(resolve_url(commit_modes)).connect() as conn:
        modes = conn.exec_driver_sql(
            f"SELECT op, lockstring, mode FROM {table_name}_modes ORDER BY n"
        ).all()
    assert [tuple(row) for row in modes] == [
        ("INSERT", "job", "on"),
        ("UPDATE", "job", "on"),
        ("DELETE", "job", "off"),  # the release
        ("INSERT", "job", "on"),
        ("DELETE", "job", "on"),  # broken by an operator
        ("INSERT", "expiring", "on"),
        ("INSERT", "purged", "on"),
        ("UPDATE", "expiring", "on"),  # taken over in place
        ("DELETE", "purged", "on"),
        ("DELETE", "expiring", "off"),  # the release
    ]


# -- on_lost, when the holder's own unlock() meets the loss ---------------------------------------


def _paused_keep_alive(locker: Locker) -> Any:
    """The keep-alive's condition, held by the test's thread: its scheduler cannot run (as in a
    process stopped past its lock's expiry), while the test's own calls still pass (reentrant)."""
    return locker._keep_alives._condition


@pytest.mark.parametrize("front", ["sync", "asyncio"])
def test_on_lost_is_called_when_unlock_finds_a_kept_alive_lock_broken(
    make_locker: Any, url: str, table_name: str, front: str
) -> None:
    """Broken by an operator between two renewals, the lock is found lost by its holder's
    unlock() before its keep-alive looks: on_lost is called once all the same."""
    operator = make_locker()
    lost = LostCalls()
    if front == "sync":
        lock = make_locker().lock("job", expires=60, keep_alive=True, on_lost=lost)
        assert operator.break_lock("job") is not None
        with pytest.raises(LockLost):
            lock.unlock()
    else:

        async def hold_and_unlock() -> None:
            locker = AsyncLocker(async_url(url), table=table_name, grace=0)
            try:
                lock = await locker.lock("job", expires=60, keep_alive=True, on_lost=lost)
                assert operator.break_lock("job") is not None
                with pytest.raises(LockLost):
                    await lock.unlock()
                await asyncio.sleep(0.3)
            finally:
                await locker.aclose()

        asyncio.run(hold_and_unlock())
    time.sleep(0.3)
    assert len(lost.calls) == 1
    assert lost.calls[0][0].lockstring == "job"


@pytest.mark.parametrize("first", ["unlock", "keep-alive"])
@pytest.mark.parametrize("front", ["sync", "asyncio"])
def test_on_lost_is_called_once_for_a_holder_stopped_past_expiry_and_taken_over(
    make_locker: Any, url: str, table_name: str, front: str, first: str
) -> None:
    """The holder stops (its keep-alive too) past its lock's expiry, another takes the lock
    over, and the holder resumes: whichever of its unlock() and its keep-alive meets the loss
    first, on_lost is called once, and unlock() raises LockLost. Sync, the keep-alive is
    paused by holding its condition; in asyncio, the event loop itself is frozen."""
    contender = make_locker()
    lost = LostCalls()
    expires = 1.0
    if front == "sync":
        holder = make_locker()
        lock = holder.lock("job", expires=expires, keep_alive=True, on_lost=lost)
        paused = _paused_keep_alive(holder)
        with paused:
            time.sleep(expires + 0.2)
            taken = contender.lock("job", wait=30)
            if first == "unlock":
                with pytest.raises(LockLost):
                    lock.unlock()
        if first == "keep-alive":
            assert lost.event.wait(5)
            with pytest.raises(LockLost):
                lock.unlock()
    else:

        async def hold_freeze_and_unlock() -> Any:
            locker = AsyncLocker(async_url(url), table=table_name, grace=0)
            try:
                lock = await locker.lock("job", expires=expires, keep_alive=True, on_lost=lost)
                time.sleep(expires + 0.2)  # the whole event loop stopped past the expiry
                taken = contender.lock("job", wait=30)
                if first == "keep-alive":
                    await asyncio.sleep(0.5)
                    assert len(lost.calls) == 1
                with pytest.raises(LockLost):
                    await lock.unlock()
                await asyncio.sleep(0.3)
                return taken
            finally:
                await locker.aclose()

        taken = asyncio.run(hold_freeze_and_unlock())
    time.sleep(0.3)
    assert len(lost.calls) == 1
    assert taken.is_valid()
    taken.unlock()


# -- an acquire that finds its own row (its earlier attempt's answer lost) ------------------------


def test_an_acquire_counts_its_own_row_only_while_it_is_live(make_locker: Any) -> None:
    """An attempt whose INSERT committed and whose answer was lost leaves a row under the
    acquire's guid, which its next attempt finds. Live, it is the lock. Expired, it is no
    longer anyone's: within grace it refuses the acquire (which, waiting, tries again), and
    beyond grace it is taken over, with a new id, as anyone else's would be; taken as the
    lock, it could be taken over by another at the same moment."""
    locker, contender = make_locker(grace=2.0), make_locker(grace=2.0)
    operations = locker._operations
    guid = new_guid()
    first = operations.try_acquire("job", guid, 1.0, holder_details({}))
    assert isinstance(first, Acquired)
    again = operations.try_acquire("job", guid, 1.0, holder_details({}))
    assert isinstance(again, Acquired)  # live: ours, as it stands
    assert again.lock_id == first.lock_id
    time.sleep(1.5)  # expired, within grace
    refused = operations.try_acquire("job", guid, 1.0, holder_details({}))
    assert isinstance(refused, Refused)
    time.sleep(2.0)  # beyond grace
    taken = operations.try_acquire("job", guid, 30.0, holder_details({}))
    assert isinstance(taken, Acquired)
    assert taken.lock_id > first.lock_id
    assert contender.try_lock("job") is None
    [row] = locker.locks()
    assert row.lock_id == taken.lock_id
    assert not row.expired


def _then_answer_lost(operation: Any) -> Any:
    """``operation``, run to its end on the database, and then its answer lost."""

    def answered_lost(*args: Any) -> Any:
        operation(*args)
        raise DatabaseError("the connection was lost before the answer came", outage=True)

    return answered_lost


def test_unlock_tried_again_after_a_failure_has_the_patience_of_the_rows_own_expiry(
    postgresql_url: str, table_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first unlock() failed before its DELETE reached the server (the row is still ours);
    the one tried again waits behind another session's row lock (2.5 s) as long as the row
    lives, not the second a lock past its deadline gets, and releases it: the lock was never
    lost, and on_lost is not called."""
    locker = Locker(postgresql_url, table=table_name)
    locker.create_table()
    lost = LostCalls()
    lock = locker.lock("job", expires=30, on_lost=lost)

    def unreachable(*_: object) -> None:
        raise DatabaseError("cannot connect", outage=True)

    monkeypatch.setattr(locker._operations, "release", unreachable)
    with pytest.raises(DatabaseError):
        lock.unlock()
    assert not lock.is_valid()  # its DELETE might have run, for all the holder knows
    monkeypatch.undo()
    engine = sa.create_engine(resolve_url(postgresql_url))
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql(f"SELECT id FROM {table_name} WHERE lockstring = 'job' FOR UPDATE")
            errors: list[BaseException] = []

            def unlock() -> None:
                try:
                    lock.unlock()
                except LockError as error:
                    errors.append(error)

            unlocking = threading.Thread(target=unlock)
            unlocking.start()
            time.sleep(2.5)  # the row lock held, past the second a lock out of time gets
        unlocking.join(30)
        assert not unlocking.is_alive()
        assert errors == []
    finally:
        engine.dispose()
    assert locker.lock_info("job") is None
    assert not lock.is_locked
    assert lost.calls == []
    locker.close()


def test_a_shorter_extend_behind_a_renewal_in_flight_waits_as_long_as_the_row_lives(
    postgresql_url: str, table_name: str
) -> None:
    """extend(3) behind an extend(30) held up 4 s by another session's row lock: nothing of
    the shorter one is sent while it waits, and the row lives on by the longer one's answer,
    so it waits for its turn as long as that, and succeeds (it gave up at 3 s, the lock
    declared lost and its live row deleted)."""
    locker = Locker(postgresql_url, table=table_name)
    locker.create_table()
    lock = locker.lock("job", expires=30)
    engine = sa.create_engine(resolve_url(postgresql_url))
    errors: list[BaseException] = []

    def extend(seconds: float) -> None:
        try:
            lock.extend(seconds)
        except LockError as error:
            errors.append(error)

    extends = [threading.Thread(target=extend, args=(seconds,)) for seconds in (30, 3)]
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql(f"SELECT id FROM {table_name} WHERE lockstring = 'job' FOR UPDATE")
            for thread in extends:
                thread.start()
                time.sleep(0.3)  # the long one first, then the shorter behind it
            time.sleep(3.7)  # the row lock held 4 s in all
        for thread in extends:
            thread.join(30)
        assert errors == []
        assert lock.is_valid()
    finally:
        engine.dispose()
    lock.unlock()
    locker.close()


def test_a_shorter_extend_whose_answer_is_lost_ends_the_lock_by_its_own_expiry(
    make_locker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """extend(2) on a lock of 30 s reached the server (the row now expires 2 s on) and its
    answer was lost: the holder kept the 30 s deadline, valid for 26 s more while anyone could
    take the row. A deadline never outlasts an extend sent, answered or not."""
    locker = make_locker()
    lock = locker.lock("job", expires=30)
    monkeypatch.setattr(locker._operations, "extend", _then_answer_lost(locker._operations.extend))
    sent = clock.now()
    with pytest.raises(DatabaseError):
        lock.extend(2)
    assert lock._state.valid_until <= sent + 2 - safety_margin(2) + (clock.now() - sent)
    row = locker.lock_info("job")
    assert row is not None
    assert row.seconds_left < 2.5  # what the server holds it for
    monkeypatch.undo()
    lock.unlock()


def test_an_unlock_whose_answer_is_lost_leaves_the_lock_no_longer_valid(
    make_locker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The DELETE ran and its answer was lost (the retry could not connect): the row is gone,
    anyone may hold the lockstring, and the lock must not say it is valid; it still counts as
    held, so that unlock() can be tried again, and that says it found the row gone."""
    locker = make_locker()
    lock = locker.lock("job", expires=30)
    monkeypatch.setattr(
        locker._operations, "release", _then_answer_lost(locker._operations.release)
    )
    with pytest.raises(DatabaseError):
        lock.unlock()
    assert locker.lock_info("job") is None
    assert not lock.is_valid()
    with pytest.raises(LockLost):
        lock.check()
    assert lock.is_locked
    monkeypatch.undo()
    with pytest.raises(LockLost):
        lock.unlock()
