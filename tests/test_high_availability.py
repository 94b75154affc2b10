"""PostgreSQL run highly available, on real servers of the tests' own: a URL naming several
hosts, a primary that stops taking writes, a server away for a while, and replication the locks
cannot rely on. (The Patroni + etcd and Galera clusters are in tests/test_patroni.py and
tests/test_galera.py.)
"""

from __future__ import annotations

import socket
import time
import warnings

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
