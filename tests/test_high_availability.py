"""PostgreSQL run highly available, on real servers of the tests' own: a URL naming several
hosts, a primary that stops taking writes, a server away for a while, and replication the locks
cannot rely on. (The Patroni + etcd and Galera clusters are in tests/test_patroni.py and
tests/test_galera.py.)
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import warnings
from typing import Any

import pytest
import sqlalchemy as sa

from sqllocker import DatabaseError, Locker, UnsafeDatabase, UnsafeDatabaseWarning
from sqllocker.engine import resolve_url
from sqllocker.migrations import upgrade
from tests.helpers import wait_in_thread
from tests.private_servers import PrivatePostgres, running_private_server, running_standby

pytestmark = pytest.mark.slow  # private primaries and standbys: not in the quick subset


def two_hosts(first: str, second: str) -> str:
    """libpq's form of a URL naming two servers, as an HA cluster's clients write it."""
    a, b = sa.engine.make_url(first), sa.engine.make_url(second)
    return f"postgresql://postgres@{a.host}:{a.port},{b.host}:{b.port}/{a.database}"


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_a_url_naming_several_hosts_reaches_the_one_that_answers(
    postgresql_url: str, table_name: str
) -> None:
    shared = sa.engine.make_url(postgresql_url)
    url = f"postgresql://postgres@127.0.0.1:{closed_port()},{shared.host}:{shared.port}/"
    url += str(shared.database)
    engine = sa.create_engine(resolve_url(postgresql_url))
    upgrade(engine, table_name)
    locker = Locker(url, table=table_name)
    try:
        with locker.lock("nightly report") as lock:
            assert locker.lock_info("nightly report").lock_id == lock.lock_id  # type: ignore[union-attr]
    finally:
        locker.close()
        with engine.begin() as conn:
            conn.exec_driver_sql(f"DROP TABLE {table_name} CASCADE")
            conn.exec_driver_sql(f"DROP TABLE {table_name}_requests")
            conn.exec_driver_sql(f"DROP TABLE sqllocker_alembic_version_{table_name}")
        engine.dispose()


@pytest.mark.parametrize("kind", ["postgresql", "mysql"])
def test_a_waiter_waits_through_an_outage_within_its_wait(kind: str) -> None:
    """A failover leaves no server taking writes for a while (Patroni: its ttl). A waiter with
    time left keeps waiting through it, and takes the lock once the database is back and the
    row free; a lock() without wait still fails at once, in one line."""
    with running_private_server(kind) as server:
        holder, waiter = Locker(server.url, grace=0.2), Locker(server.url, grace=0.2)
        holder.create_table()
        held = holder.lock("nightly", expires=2)
        thread, result = wait_in_thread(waiter, "nightly", wait=60)
        time.sleep(0.5)
        server.stop(crash=True)
        with pytest.raises(DatabaseError):
            Locker(server.url).lock("nightly")  # no wait: the outage is the answer
        time.sleep(5)  # longer than the holder's expiry and a waiter's poll: an attempt fails
        server.start()
        thread.join(60)
        assert "lock" in result, result
        assert result["lock"].lock_id > held.lock_id
        result["lock"].unlock()
        holder.close()
        waiter.close()


def make_read_only(server: PrivatePostgres) -> None:
    """What a demoted primary looks like to its clients: every new transaction read-only."""
    server.sql("ALTER SYSTEM SET default_transaction_read_only = on")
    server.sql("SELECT pg_catalog.pg_reload_conf()")


def test_a_primary_that_stops_taking_writes_is_left_for_one_that_takes_them() -> None:
    """Its pooled connections are dropped and the operation is tried again, which the URL's
    second host answers; never a raw database error while a primary is reachable."""
    with (
        running_private_server("postgresql") as old,
        running_private_server("postgresql") as new,
    ):
        assert isinstance(old, PrivatePostgres)
        assert isinstance(new, PrivatePostgres)
        for server in (old, new):
            engine = sa.create_engine(resolve_url(server.url))
            upgrade(engine, "semaphores")
            engine.dispose()
        locker = Locker(two_hosts(old.url, new.url))
        try:
            first = locker.lock("before", expires=60)
            make_read_only(old)
            time.sleep(0.5)  # the reload reaches every session
            second = locker.lock("after", expires=60)
            on_new = sa.create_engine(resolve_url(new.url))
            with on_new.connect() as conn:
                rows = conn.exec_driver_sql("SELECT lockstring FROM semaphores").scalars().all()
            on_new.dispose()
            assert rows == ["after"]
            second.unlock()
            del first  # its row is on the old primary, which a real failover would have copied
        finally:
            locker.close()


def test_a_server_that_takes_no_writes_is_one_clear_error() -> None:
    with running_private_server("postgresql") as server:
        assert isinstance(server, PrivatePostgres)
        engine = sa.create_engine(resolve_url(server.url))
        upgrade(engine, "semaphores")
        engine.dispose()
        make_read_only(server)
        time.sleep(0.5)
        locker = Locker(server.url)
        try:
            with pytest.raises(DatabaseError) as refused:
                locker.lock("report")
            message = str(refused.value)
            assert "accepts no writes" in message
            assert "\n" not in message
        finally:
            locker.close()


def wait_for_standbys(primary: PrivatePostgres, count: int, state: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        states = primary.sql("SELECT sync_state FROM pg_stat_replication").split()
        if len(states) == count and all(found == state for found in states):
            return
        time.sleep(0.1)
    raise AssertionError(f"standbys of {primary.url}: {states}, not {count} x {state}")


def test_asynchronous_replication_is_reported_and_refused_when_strict() -> None:
    """A promoted asynchronous standby may lack an acknowledged lock row: a second holder and a
    reused fencing token. The settings check says so before anyone relies on it."""
    with running_private_server("postgresql") as primary:
        assert isinstance(primary, PrivatePostgres)
        with running_standby(primary):
            wait_for_standbys(primary, 1, "async")
            locker = Locker(primary.url, auto_create=False)
            try:
                upgrade(locker.engine, "semaphores")
                with pytest.warns(UnsafeDatabaseWarning, match="asynchronous replication"):
                    locker.lock("report").unlock()
            finally:
                locker.close()
            strict = Locker(primary.url, strict=True)
            try:
                with pytest.raises(UnsafeDatabase, match="when a replica is promoted"):
                    strict.lock("report")
            finally:
                strict.close()

            primary.sql("ALTER SYSTEM SET synchronous_standby_names = '*'")
            primary.sql("SELECT pg_catalog.pg_reload_conf()")
            wait_for_standbys(primary, 1, "sync")
            synchronous = Locker(primary.url, strict=True)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("error", UnsafeDatabaseWarning)
                    synchronous.lock("report").unlock()
            finally:
                synchronous.close()

            # Without the WARNING of a cancelled wait for the standby, such a commit would
            # count: sqllocker's own sessions ask for it; an Engine of the caller's is checked.
            primary.sql("ALTER SYSTEM SET client_min_messages = error")
            primary.sql("SELECT pg_catalog.pg_reload_conf()")
            own = Locker(primary.url, strict=True)
            engine = sa.create_engine(resolve_url(primary.url))
            callers = Locker(engine, strict=True)
            try:
                own.lock("report").unlock()
                with pytest.raises(UnsafeDatabase, match="client_min_messages=error"):
                    callers.lock("report")
            finally:
                own.close()
                callers.close()
                engine.dispose()


def test_a_mariadb_server_that_takes_no_writes_is_one_clear_error() -> None:
    """``read_only`` (a replica): connections dropped, tried again, then one line. (A role with
    READ ONLY ADMIN, such as root, writes anyway, so the locker runs as an ordinary one.)"""
    with running_private_server("mysql") as server:
        admin = sa.create_engine(resolve_url(server.url))
        with admin.begin() as conn:
            conn.exec_driver_sql("CREATE DATABASE locks")
            conn.exec_driver_sql("CREATE USER app@'127.0.0.1'")
            conn.exec_driver_sql("GRANT ALL ON locks.* TO app@'127.0.0.1'")
        url = f"mysql://app@127.0.0.1:{server.port}/locks"
        locker = Locker(url, auto_create=False)
        try:
            upgrade(locker.engine, "semaphores")
            locker.lock("before").unlock()
            with admin.begin() as conn:
                conn.exec_driver_sql("SET GLOBAL read_only = 1")
            with pytest.raises(DatabaseError) as refused:
                locker.lock("after")
            message = str(refused.value)
            assert "accepts no writes" in message
            assert "\n" not in message
        finally:
            locker.close()
            admin.dispose()


# -- a commit whose wait for its synchronous standby was cancelled ---------------------------
# PostgreSQL ends such a wait with the commit visible on the primary, and only a WARNING:
# "canceling wait for synchronous replication due to user request ... The transaction has
# already committed locally, but might not have been replicated to the standby." Whoever
# cancels it (a job's time limit, Ctrl-C, an operator's pg_cancel_backend, a pooler passing a
# cancel on), a failover may then lose the row. A standby that is named and never connects
# makes every commit wait, for as long as a test needs.


def name_a_standby(server: PrivatePostgres, name: str) -> None:
    """Make commits wait for standby ``name`` (none connects), or for nobody if ``name`` is
    empty."""
    server.sql(f"ALTER SYSTEM SET synchronous_standby_names = '{name}'")
    server.sql("SELECT pg_catalog.pg_reload_conf()")
    deadline = time.monotonic() + 10
    while server.sql("SHOW synchronous_standby_names") != name:
        assert time.monotonic() < deadline, "the setting was not reloaded"
        time.sleep(0.05)


def waiting_for_the_standby(server: PrivatePostgres, count: int = 1) -> list[str]:
    """The pids of the sessions whose commits wait for a synchronous standby, once ``count``
    do."""
    deadline = time.monotonic() + 30
    while True:
        pids = server.sql(
            "SELECT pid FROM pg_catalog.pg_stat_activity WHERE wait_event = 'SyncRep'"
        ).split()
        if len(pids) >= count:
            return pids
        assert time.monotonic() < deadline, f"{len(pids)} commits wait for the standby"
        time.sleep(0.05)


def test_a_warning_of_another_kind_on_a_lock_statement_is_no_concern(
    postgresql_url: str, table_name: str
) -> None:
    """Only the warning of a cancelled wait for a standby makes a statement not count: a
    server near transaction id wraparound warns on every write, a trigger may warn."""
    engine = sa.create_engine(resolve_url(postgresql_url))
    upgrade(engine, table_name)
    with engine.begin() as conn:
        conn.exec_driver_sql(
            f"CREATE FUNCTION {table_name}_warns() RETURNS trigger LANGUAGE plpgsql AS "
            "$$BEGIN RAISE WARNING 'database must be vacuumed'; RETURN NULL; END$$"
        )
        conn.exec_driver_sql(
            f"CREATE TRIGGER {table_name}_warns AFTER INSERT OR DELETE ON {table_name} "
            f"FOR EACH ROW EXECUTE FUNCTION {table_name}_warns()"
        )
    locker = Locker(postgresql_url, table=table_name)
    try:
        with locker.lock("report") as lock:
            assert lock.is_valid()
        assert locker.lock_info("report") is None
    finally:
        locker.close()
        engine.dispose()


def test_an_acquire_whose_wait_for_its_standby_is_cancelled_is_not_counted_on() -> None:
    """The acquire's INSERT acknowledged with that WARNING: not a lock (``wait=0``: a
    DatabaseError that says why); a waiting acquire tries again, finds the row its own and
    has the lock once its renewal of it was replicated."""
    with running_private_server("postgresql") as server:
        assert isinstance(server, PrivatePostgres)
        locker = Locker(server.url)
        try:
            upgrade(locker.engine, "semaphores")
            locker.lock("warm").unlock()
            name_a_standby(server, "nobody")
            thread, once = wait_in_thread(locker, "report", wait=0)
            server.sql(f"SELECT pg_catalog.pg_cancel_backend({waiting_for_the_standby(server)[0]})")
            thread.join(30)
            assert isinstance(once.get("error"), DatabaseError), once
            assert "failover" in str(once["error"])

            thread, waited = wait_in_thread(locker, "nightly", wait=60)
            server.sql(f"SELECT pg_catalog.pg_cancel_backend({waiting_for_the_standby(server)[0]})")
            waiting_for_the_standby(server)  # its own again: the renewal of the row it found
            assert "lock" not in waited, "counted on a row the standby may never have"
            replicated_at = time.monotonic()
            name_a_standby(server, "")
            thread.join(30)
            assert waited["lock"].is_valid(), waited
            assert waited["returned"] > replicated_at
            waited["lock"].unlock()
        finally:
            name_a_standby(server, "")
            locker.close()


def test_a_row_handed_over_by_a_release_cancelled_in_its_wait_for_its_standby_is_made_sure_of() -> (
    None
):
    """A release hands the row to the waiter with a ticket, its commit's wait for the standby is
    cancelled, and its signed grant reaches the waiter at once: where the server replicates, the
    waiter renews the row by a commit of its own before it counts on it, and so has the lock
    only once the standby has the grant too."""
    with running_private_server("postgresql") as server:
        assert isinstance(server, PrivatePostgres)
        holder, waiter = Locker(server.url), Locker(server.url)
        try:
            upgrade(holder.engine, "semaphores")
            held = holder.lock("report")
            name_a_standby(server, "nobody")
            waiter.locks()  # set up while a standby is named: it replicates
            name_a_standby(server, "")
            thread, waited = wait_in_thread(waiter, "report", wait=60)
            deadline = time.monotonic() + 30
            while server.sql("SELECT count(*) FROM semaphores_requests") != "1":
                assert time.monotonic() < deadline, "the waiter took no ticket"
                time.sleep(0.05)
            name_a_standby(server, "nobody")
            releaser = threading.Thread(target=_unlock_quietly, args=(held,))
            releaser.start()
            server.sql(f"SELECT pg_catalog.pg_cancel_backend({waiting_for_the_standby(server)[0]})")
            releaser.join(30)
            granted = server.sql("SELECT id FROM semaphores WHERE lockstring = 'report'")
            assert granted, "the release handed the row over"
            waiting_for_the_standby(server)  # the waiter's renewal of the row handed over
            assert "lock" not in waited, "counted on a grant the standby may never have"
            replicated_at = time.monotonic()
            name_a_standby(server, "")
            thread.join(30)
            assert waited["lock"].lock_id == int(granted), waited
            assert waited["returned"] > replicated_at
            waited["lock"].unlock()
        finally:
            name_a_standby(server, "")
            holder.close()
            waiter.close()


def _unlock_quietly(lock: Any) -> None:
    """Release ``lock``; its release, cancelled in its wait for the standby, may raise."""
    with contextlib.suppress(DatabaseError):
        lock.unlock()


def test_a_warning_heard_by_a_statement_that_failed_does_not_fail_the_next(
    postgresql_url: str,
) -> None:
    """The connection's record of the standby's warning outlives one operation (a connection
    serves many): a statement that failed after the warning came must leave no trace of it
    for the next statement, which did nothing of the kind."""
    from sqllocker.backends.postgresql import PostgreSQLBackend
    from sqllocker.execution import DriverSession, PreparedCache

    engine = sa.create_engine(resolve_url(postgresql_url))
    try:
        raw = engine.raw_connection()
        warnings_of = PostgreSQLBackend.statement_warnings(raw.dbapi_connection)
        assert warnings_of is not None
        session = DriverSession(
            raw.dbapi_connection, raw.cursor(), PreparedCache(engine.dialect), None, warnings_of
        )
        quotient = sa.cast(sa.literal(1) / sa.bindparam("n", type_=sa.Integer), sa.Integer)
        divide = sa.select(quotient.label("q"))
        warnings_of.append("canceling wait for synchronous replication due to user request")
        with pytest.raises(sa.exc.DBAPIError):
            session.execute(divide, {"n": 0})
        raw.rollback()
        assert session.execute(divide, {"n": 1}).rowcount == 1
        raw.close()
    finally:
        engine.dispose()
