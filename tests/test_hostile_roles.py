"""PostgreSQL shared with other roles: what a role that can only connect (or one that can create
functions in a schema on our path) can and cannot do to the locks.

Each test plays the other role on a connection of its own, and checks that no second holder,
no stolen secret and no unbounded wait can come of it.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from typing import Any
from urllib.parse import quote

import psycopg
import pytest
import sqlalchemy as sa

from sqllocker import LockBusy, Locker, UnsafeDatabase
from sqllocker import tickets as ticketing
from sqllocker.engine import resolve_url
from sqllocker.migrations import upgrade
from sqllocker.notifications import guid_digest
from sqllocker.schema import lock_table
from tests.helpers import RawTicket, in_line, tickets, wait_in_thread, wait_until

_numbers = itertools.count(1)


def connect(url: str, **options: str) -> psycopg.Connection[tuple[object, ...]]:
    target = sa.make_url(resolve_url(url))
    return psycopg.connect(
        host=target.host,
        port=target.port,
        user=options.pop("user", target.username),
        dbname=target.database,
        autocommit=True,
        **options,
    )


def with_options(url: str, options: str) -> str:
    """``url`` whose sessions start with the server ``options`` (``-c name=value ...``)."""
    return f"{url}?options={quote(options)}"


@pytest.fixture
def intruder(postgresql_url: str) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    """A session of a role that may only connect to the database: no privilege on any table."""
    role = f"sqllocker_intruder_{uuid.uuid4().hex[:8]}"
    database = sa.make_url(resolve_url(postgresql_url)).database
    with connect(postgresql_url) as admin:
        admin.execute(f"CREATE ROLE {role} LOGIN")
        admin.execute(f"GRANT CONNECT ON DATABASE {database} TO {role}")
    connection = connect(postgresql_url, user=role)
    yield connection
    connection.close()
    with connect(postgresql_url) as admin:
        admin.execute(f"DROP OWNED BY {role}")
        admin.execute(f"DROP ROLE {role}")


def test_a_forged_grant_notification_is_not_taken_for_a_lock(
    migrated_postgres: str,
    table_name: str,
    admin: sa.Engine,
    intruder: psycopg.Connection[tuple[object, ...]],
) -> None:
    """Anyone who can connect can NOTIFY on the grants channel, naming any id. A waiter with a
    ticket must read its row back (id and its own guid) before it believes a grant."""
    holder = Locker(migrated_postgres, table=table_name)
    waiter = Locker(migrated_postgres, table=table_name)
    held = holder.lock("report")
    thread, result = wait_in_thread(waiter, wait=30)
    in_line(admin, table_name)
    (standing,) = tickets(admin, table_name)  # as a role allowed to read tickets would
    now = time.time()
    old_format = f"{standing[1]} {held.lock_id + 1} {now} {now + 30}"  # guid, id, times
    # Even one that names the waiter rightly (a digest is no secret to whoever saw the
    # notification of an earlier grant, or derived it from a guid it read somewhere).
    named = f"{held.lock_id + 1} {guid_digest(standing[1])}"
    for forged in (f"{held.lock_id} report", named, old_format):
        intruder.execute("SELECT pg_notify(%s, %s)", (f"sqllocker_{table_name}_granted", forged))
    time.sleep(1.0)
    assert "lock" not in result, "the waiter took a forged notification for its lock"
    assert thread.is_alive()
    held.unlock()  # now a true hand-off
    thread.join(10)
    lock = result["lock"]
    assert lock.lock_id > held.lock_id
    info = waiter.lock_info("report")
    assert info is not None
    assert info.lock_id == lock.lock_id
    lock.unlock()
    holder.close()
    waiter.close()


def test_a_grant_signed_wrongly_or_replayed_is_not_taken_for_a_lock(
    migrated_postgres: str,
    table_name: str,
    admin: sa.Engine,
    intruder: psycopg.Connection[tuple[object, ...]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A grant's notification is signed with a key its waiter gave with its ticket, which only
    the release trigger can read. Whoever can connect can listen to the genuine grants, and
    send any payload: one with a well-formed but wrong MAC, a genuine one readdressed to
    another waiter or naming another id, or replayed as it was, is not believed (nor read back:
    a signed grant is the trigger's, or nobody's)."""
    holder = Locker(migrated_postgres, table=table_name)
    waiter = Locker(migrated_postgres, table=table_name)
    other = Locker(migrated_postgres, table=table_name)
    read_back: list[int] = []
    claim_grant = waiter._operations.claim_grant

    def counted(lockstring: str, lock_id: int, guid: str) -> object:
        read_back.append(lock_id)
        return claim_grant(lockstring, lock_id, guid)

    monkeypatch.setattr(waiter._operations, "claim_grant", counted)
    channel = f"sqllocker_{table_name}_granted"
    intruder.execute(f'LISTEN "{channel}"')
    # A genuine grant, to another waiter, heard by the intruder.
    earlier = holder.lock("earlier")
    thread, result = wait_in_thread(other, "earlier", wait=30)
    in_line(admin, table_name)
    earlier.unlock()
    thread.join(10)
    result["lock"].unlock()
    (genuine,) = [notice.payload for notice in intruder.notifies(timeout=1, stop_after=1)]
    lock_id, digest, *times, mac = genuine.split(" ")
    held = holder.lock("report")
    thread, result = wait_in_thread(waiter, wait=30)
    in_line(admin, table_name)
    ((_lockstring, guid),) = tickets(admin, table_name)
    ours = guid_digest(guid)
    said = " ".join([str(held.lock_id + 1), ours, *times])
    for forged in (
        f"{said} {'0' * 64}",  # well-formed, its MAC wrong
        f"{said} {mac}",  # the genuine MAC, readdressed to our waiter and a new id
        " ".join([lock_id, ours, *times, mac]),  # readdressed to our waiter only
        " ".join([str(held.lock_id + 1), digest, *times, mac]),  # another id only
        genuine,  # replayed as it was
    ):
        intruder.execute("SELECT pg_notify(%s, %s)", (channel, forged))
    time.sleep(1.0)
    assert "lock" not in result, "the waiter took a forged notification for its lock"
    assert thread.is_alive()
    assert read_back == []
    held.unlock()  # now a true hand-off
    thread.join(10)
    lock = result["lock"]
    assert lock.lock_id > held.lock_id
    info = waiter.lock_info("report")
    assert info is not None
    assert info.lock_id == lock.lock_id
    assert read_back == []
    lock.unlock()
    for locker in (holder, waiter, other):
        locker.close()


def test_a_role_that_can_only_connect_learns_no_guid(
    migrated_postgres: str,
    table_name: str,
    admin: sa.Engine,
    intruder: psycopg.Connection[tuple[object, ...]],
) -> None:
    """Tickets hold their waiter's guid: only the table's owner can read them (the tickets'
    functions reach them for the roles that take locks, which PUBLIC may not call).
    Notifications carry no guid."""
    holder = Locker(migrated_postgres, table=table_name)
    waiter = Locker(migrated_postgres, table=table_name)
    held = holder.lock("report")
    intruder.execute(f'LISTEN "sqllocker_{table_name}_granted"')
    thread, result = wait_in_thread(waiter, wait=30)
    in_line(admin, table_name)
    (standing,) = tickets(admin, table_name)
    for table in (f"{table_name}_requests", table_name, f"{table_name}_held"):
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            intruder.execute(f"SELECT * FROM {table}")
    for call in (
        f"{table_name}_queue_leave(1, 'report', %s, true)",
        f"{table_name}_queue_join('report', %s, '{{}}', 30, 1)",
        f"{table_name}_anyone_ahead('report', 1)",
    ):
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            intruder.execute(f"SELECT {call}", (standing[1],) if "%s" in call else ())
    held.unlock()
    thread.join(10)
    lock = result["lock"]
    payloads = [notice.payload for notice in intruder.notifies(timeout=1, stop_after=1)]
    for _ in range(3):
        if payloads:
            break
        # No grant: an INSERT of the waiter's own (it tries the row again now and then) held
        # the lockstring's key as the release ran, so the release handed nothing over and the
        # waiter took the free row itself. Hand it over once more.
        held = lock
        thread, result = wait_in_thread(holder, wait=30)
        in_line(admin, table_name)
        held.unlock()
        thread.join(10)
        lock = result["lock"]
        payloads = [notice.payload for notice in intruder.notifies(timeout=1, stop_after=1)]
    assert len(payloads) == 1
    assert payloads[0].startswith(f"{lock.lock_id} {guid_digest(lock.guid)} ")  # one-way
    assert lock.guid not in payloads[0]
    with admin.connect() as conn:  # the view, what read-only roles are given, has none either
        view = conn.exec_driver_sql(f"SELECT * FROM {table_name}_held").mappings().one()
    assert "guid" not in view
    assert "guid" not in view["locked_by"]
    lock.unlock()
    holder.close()
    waiter.close()


@pytest.fixture
def planted(postgresql_url: str) -> Iterator[str]:
    """A schema in which another role planted look-alikes of the catalog's functions: each one
    records that it ran, and hands back what the real one would (or a clock set back a day)."""
    schema = f"planted_{next(_numbers)}_{uuid.uuid4().hex[:6]}"
    with connect(postgresql_url) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
        conn.execute(f"CREATE TABLE {schema}.ran (what text)")
        conn.execute(
            f"CREATE FUNCTION {schema}.pg_notify(text, varchar) RETURNS void "
            f"LANGUAGE sql AS $$ INSERT INTO {schema}.ran VALUES ('pg_notify') $$"
        )
        conn.execute(
            f"CREATE FUNCTION {schema}.clock_timestamp() RETURNS timestamptz "
            f"LANGUAGE sql AS $$ INSERT INTO {schema}.ran VALUES ('clock_timestamp'); "
            "SELECT pg_catalog.clock_timestamp() - interval '1 day' $$"
        )
        conn.execute(
            f"CREATE FUNCTION {schema}.hashtext(varchar) RETURNS integer "
            f"LANGUAGE sql AS $$ INSERT INTO {schema}.ran VALUES ('hashtext'); SELECT 7 $$"
        )
    yield schema
    with connect(postgresql_url) as conn:
        conn.execute(f"DROP SCHEMA {schema} CASCADE")


def test_functions_planted_on_the_callers_path_never_run(
    migrated_postgres: str, table_name: str, admin: sa.Engine, planted: str
) -> None:
    """CVE-2018-1058: a function in a schema ahead on the caller's path, with argument types
    that match better than pg_catalog's, runs in place of the catalog's, as the caller. Here
    the releasing (and acquiring) role's path puts the planted schema before pg_catalog; the
    trigger and the tickets' functions pin their own path, and every statement names
    pg_catalog's functions with their exact types."""
    path_first = with_options(migrated_postgres, f"-c search_path={planted},pg_catalog,public")
    holder = Locker(path_first, table=table_name)
    waiter = Locker(path_first, table=table_name)
    held = holder.lock("report", expires=60)
    thread, result = wait_in_thread(waiter, wait=30, expires=60)
    in_line(admin, table_name)
    held.unlock()  # the trigger hands the row over and notifies
    thread.join(10)
    lock = result["lock"]
    assert lock.expires > held.expires  # a day early, had the planted clock run
    lock.unlock()
    with holder.lock("report") as again:  # an uncontended cycle too
        assert again.is_valid()
    holder.purge_expired_locks()
    with admin.connect() as conn:
        ran = conn.exec_driver_sql(f"SELECT what FROM {planted}.ran").scalars().all()
    assert ran == []
    holder.close()
    waiter.close()


@pytest.mark.slow
def test_an_advisory_key_held_outside_the_protocol_bounds_the_wait_and_names_its_holder(
    migrated_postgres: str,
    table_name: str,
    intruder: psycopg.Connection[tuple[object, ...]],
) -> None:
    """Acquirers of a lockstring hold its id-order key only while they insert. A role that can
    only connect can take it and keep it: every acquire then waits out its bound (not the
    session's lock_timeout, three times over) and says who holds the key; through a
    transaction pooler, which carries no session settings, the wait is bounded all the same."""
    intruder.execute(
        "SELECT pg_advisory_lock(hashtext(%s), hashtext(%s))", (f"public.{table_name}", "job")
    )
    (pid,) = intruder.execute("SELECT pg_backend_pid()").fetchone()  # type: ignore[misc]
    for pooled in (False, True):
        locker = Locker(migrated_postgres, table=table_name, transaction_pooling=pooled)
        started = time.monotonic()
        with pytest.raises(LockBusy) as busy:
            locker.lock("job")
        assert time.monotonic() - started < 5
        assert busy.value.key_holder_pid == pid
        assert f"session {pid}" in str(busy.value)
        assert "holds no row" in str(busy.value)
        with pytest.raises(LockBusy, match=f"session {pid}"):
            locker.lock("job", wait=2)
        with pytest.raises(LockBusy, match=f"session {pid}"):
            locker.lock_all(["job", "other job"])  # a group names the key's holder too
        assert locker.try_lock("other job") is not None  # other lockstrings are untouched
        locker.close()
    intruder.execute("SELECT pg_advisory_unlock_all()")
    locker = Locker(migrated_postgres, table=table_name)
    locker.lock("job").unlock()
    locker.close()


def test_a_dead_lockers_liveness_key_held_outside_the_protocol_delays_a_waiter_by_one_patience(
    migrated_postgres: str,
    table_name: str,
    intruder: psycopg.Connection[tuple[object, ...]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A liveness key is in pg_locks for anyone to see. A role that can only connect can take
    the key of a Locker that died, so that its tickets look live: a waiter behind one, finding
    the row free, takes it after PATIENCE all the same (and a release that hands the row to
    such a ticket costs one expiry period: see tests/test_tickets.py)."""
    monkeypatch.setattr(ticketing, "PATIENCE", 0.5)
    dead = RawTicket(migrated_postgres, table_name, lockstring="job")
    dead.die()
    intruder.execute("SELECT pg_advisory_lock(%s)", (dead.key,))
    locker = Locker(migrated_postgres, table=table_name)
    started = time.monotonic()
    lock = locker.lock("job", wait=10)
    assert 0.5 <= time.monotonic() - started < 3
    lock.unlock()
    locker.close()


@pytest.fixture
def monitor(postgresql_url: str) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    """A session of a monitoring role (``pg_read_all_stats``, which ``pg_monitor`` has): it sees
    the statement every session runs or ran last in ``pg_stat_activity``, and no table."""
    role = f"sqllocker_monitor_{uuid.uuid4().hex[:8]}"
    database = sa.make_url(resolve_url(postgresql_url)).database
    with connect(postgresql_url) as admin:
        admin.execute(f"CREATE ROLE {role} LOGIN")
        admin.execute(f"GRANT CONNECT ON DATABASE {database} TO {role}")
        admin.execute(f"GRANT pg_read_all_stats TO {role}")
    connection = connect(postgresql_url, user=role)
    yield connection
    connection.close()
    with connect(postgresql_url) as admin:
        admin.execute(f"DROP OWNED BY {role}")
        admin.execute(f"DROP ROLE {role}")


def signed_with(key: bytes, lock_id: int, digest: str, ttl: float) -> str:
    """A grant as the release trigger writes it, for a row created now, signed with ``key``."""
    now = datetime.now(timezone.utc).replace(tzinfo=None)
    times = [now - timedelta(seconds=1), now, now + timedelta(seconds=ttl)]
    said = " ".join([str(lock_id), digest, *(t.strftime("%Y-%m-%dT%H:%M:%S.%f") for t in times)])
    return f"{said} {hmac.new(key, said.encode(), hashlib.sha256).hexdigest()}"


@pytest.mark.parametrize("cursor_factory", [None, psycopg.ClientCursor])
def test_a_role_that_sees_every_sessions_statement_cannot_sign_a_grant(
    migrated_postgres: str,
    table_name: str,
    admin: sa.Engine,
    monitor: psycopg.Connection[tuple[object, ...]],
    intruder: psycopg.Connection[tuple[object, ...]],
    cursor_factory: type[psycopg.ClientCursor[tuple[object, ...]]] | None,
) -> None:
    """A monitoring role reads every session's statement in ``pg_stat_activity``, and whoever
    can connect can NOTIFY. A driver that writes a statement's parameters into its text
    (psycopg's ClientCursor) would show a ticket's key there, to be signed with: a waiter on
    such a connection takes its ticket without a key (its grant is told unsigned, and read
    back); on one that binds them at the server the key is not in the text. Either way the
    monitor finds no key to sign a grant with that the waiter believes."""
    holder = Locker(migrated_postgres, table=table_name)
    options = {} if cursor_factory is None else {"cursor_factory": cursor_factory}
    engine = sa.create_engine(resolve_url(migrated_postgres), connect_args=options)
    waiter = Locker(engine, table=table_name)
    held = holder.lock("report")
    seen: set[str] = set()
    looking = threading.Event()

    def look() -> None:  # what the monitor sees, the whole time the waiter takes its ticket
        while not looking.is_set():
            for (query,) in monitor.execute(
                "SELECT query FROM pg_stat_activity "
                "WHERE query LIKE '%queue_join%' AND pid <> pg_backend_pid()"
            ):
                seen.add(str(query))
            time.sleep(0.005)

    watcher = threading.Thread(target=look)
    watcher.start()
    try:
        thread, result = wait_in_thread(waiter, wait=30)
        in_line(admin, table_name)
    finally:
        looking.set()
        watcher.join()
    assert seen, "the monitor saw the waiter's join"
    ((_lockstring, guid),) = tickets(admin, table_name)  # a digest, given away to be generous
    pads = [
        bytes.fromhex(found) for query in seen for found in re.findall(r"\\x([0-9a-f]{256})", query)
    ]
    keys = [bytes(byte ^ 0x36 for byte in pad[:32]) for pad in pads] or [bytes(32)]
    for key in keys:
        forged = signed_with(key, held.lock_id + 1, guid_digest(guid), waiter.expires)
        intruder.execute("SELECT pg_notify(%s, %s)", (f"sqllocker_{table_name}_granted", forged))
    time.sleep(1.0)
    assert "lock" not in result, f"a grant signed with a key read from {seen} was believed"
    assert pads == []
    held.unlock()  # now a true hand-off
    thread.join(10)
    lock = result["lock"]
    info = holder.lock_info("report")
    assert info is not None
    assert info.lock_id == lock.lock_id
    lock.unlock()
    holder.close()
    waiter.close()
    engine.dispose()


@pytest.fixture
def reader(postgresql_url: str) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    """A session of a role given ``pg_read_all_data`` (PostgreSQL 14+: backups, reporting): it
    may read every table, and write none."""
    role = f"sqllocker_reader_{uuid.uuid4().hex[:8]}"
    database = sa.make_url(resolve_url(postgresql_url)).database
    with connect(postgresql_url) as admin:
        admin.execute(f"CREATE ROLE {role} LOGIN")
        admin.execute(f"GRANT CONNECT ON DATABASE {database} TO {role}")
        admin.execute(f"GRANT pg_read_all_data TO {role}")
    connection = connect(postgresql_url, user=role)
    yield connection
    connection.close()
    with connect(postgresql_url) as admin:
        admin.execute(f"DROP OWNED BY {role}")
        admin.execute(f"DROP ROLE {role}")


def test_a_role_that_may_read_every_table_cannot_sign_a_grant(
    migrated_postgres: str,
    table_name: str,
    admin: sa.Engine,
    reader: psycopg.Connection[tuple[object, ...]],
) -> None:
    """A role that may read every table but write none (``pg_read_all_data``) cannot make a
    waiter believe a grant it was not given: where such a role is, tickets are taken without a
    key (and the release's grant read back from the table), so there is none to read, and a
    grant signed with a key it made up is not believed."""
    holder = Locker(migrated_postgres, table=table_name)
    waiter = Locker(migrated_postgres, table=table_name)
    held = holder.lock("report")
    thread, result = wait_in_thread(waiter, wait=30)
    in_line(admin, table_name)
    try:
        rows = reader.execute(f"SELECT guid, grant_key FROM {table_name}_requests").fetchall()
        assert rows, "the waiter's ticket"
        for guid, pads in rows:
            # No key to read; with one, a grant signed with it; else with one made up.
            assert pads is None, "a ticket's key is readable by a role that may read every table"
            key = os.urandom(32)
            forged = signed_with(key, held.lock_id + 1, guid_digest(str(guid)), waiter.expires)
            reader.execute("SELECT pg_notify(%s, %s)", (f"sqllocker_{table_name}_granted", forged))
        time.sleep(1.0)
        assert "lock" not in result, "a grant signed with a key read from the tickets was believed"
    finally:
        held.unlock()
        thread.join(10)
        if "lock" in result:
            result["lock"]._state.held = False  # a forged grant's row was never there
        holder.close()
        waiter.close()


def test_the_sql_log_shows_no_grant_key(
    migrated_postgres: str, table_name: str, admin: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """The SQL log (``sqllocker.sql`` at DEBUG) shows each statement's values, but not a
    ticket's grant key: with it, anyone who can NOTIFY could sign a grant to its waiter."""
    caplog.set_level(logging.DEBUG, logger="sqllocker.sql")
    holder = Locker(migrated_postgres, table=table_name)
    waiter = Locker(migrated_postgres, table=table_name)
    held = holder.lock("report")
    thread, result = wait_in_thread(waiter, wait=30)
    in_line(admin, table_name)
    joins = [record for record in caplog.records if "queue_join" in record.getMessage()]
    assert joins
    for record in joins:
        assert record.sqllocker_values["grant_key"] == "<secret>"  # type: ignore[attr-defined]
        assert "<secret>" in record.getMessage()
    held.unlock()
    thread.join(10)
    result["lock"].unlock()
    holder.close()
    waiter.close()


def test_same_named_tables_in_two_schemas_have_keys_of_their_own(
    postgresql_url: str, intruder: psycopg.Connection[tuple[object, ...]]
) -> None:
    schemas = [f"keys_{next(_numbers)}_{uuid.uuid4().hex[:6]}" for _ in range(2)]
    lockers = []
    for schema in schemas:
        with connect(postgresql_url) as conn:
            conn.execute(f"CREATE SCHEMA {schema}")
        url = with_options(postgresql_url, f"-c search_path={schema}")
        engine = sa.create_engine(resolve_url(url))
        upgrade(engine, "semaphores")
        engine.dispose()
        lockers.append(Locker(url))
    intruder.execute(
        "SELECT pg_advisory_lock(hashtext(%s), hashtext(%s))", (f"{schemas[0]}.semaphores", "job")
    )
    with pytest.raises(LockBusy, match="holds no row"):
        lockers[0].lock("job")
    lockers[1].lock("job").unlock()  # the other schema's table is not held up
    intruder.execute("SELECT pg_advisory_unlock_all()")
    for locker, schema in zip(lockers, schemas, strict=True):
        locker.close()
        with connect(postgresql_url) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")


def listened(url: str, channel: str) -> Callable[[], list[str]]:
    """Start listening on ``channel``; the returned function drains what has arrived."""
    connection = connect(url)
    connection.execute(f'LISTEN "{channel}"')

    def drain() -> list[str]:
        return [notice.payload for notice in connection.notifies(timeout=0.5)]

    return drain


def test_a_release_with_nobody_queued_sends_no_notification(
    migrated_postgres: str, table_name: str
) -> None:
    heard = listened(migrated_postgres, f"sqllocker_{table_name}")
    locker = Locker(migrated_postgres, table=table_name)
    for _ in range(3):
        locker.lock("job").unlock()
    locker.break_lock("job")
    assert heard() == []
    locker.close()


def test_a_release_succeeds_and_skips_its_notification_when_the_queue_is_filling(
    migrated_postgres: str, table_name: str, admin: sa.Engine
) -> None:
    """A listener anywhere in the cluster that stops reading holds the server's notification
    queue back; once it is full, every NOTIFY fails at commit, and a release that notified
    would fail with it. The trigger skips its notification past a threshold of the queue's
    use (``sqllocker.notify_queue_limit``, set very low here, as the real queue is 8 GB): the
    release deletes its row, the waiter still gets the row (it finds it at its next attempt)."""
    stalled = connect(migrated_postgres)
    stalled.execute('LISTEN "filler"')
    # A backend takes notifications off the queue when its session is idle, whether its client
    # reads them or not; inside an open transaction it takes none.
    stalled.autocommit = False
    stalled.execute("SELECT 1")
    filler = connect(migrated_postgres)
    for _ in range(40):
        filler.execute("SELECT pg_notify('filler', repeat('x', 7000))")
    with admin.connect() as conn:
        usage = conn.exec_driver_sql("SELECT pg_notification_queue_usage()").scalar()
    assert usage is not None
    assert usage > 1e-5
    heard = listened(migrated_postgres, f"sqllocker_{table_name}_granted")
    limited = with_options(migrated_postgres, "-c sqllocker.notify_queue_limit=0.000001")
    holder = Locker(limited, table=table_name)
    waiter = Locker(migrated_postgres, table=table_name)
    held = holder.lock("report")
    thread, result = wait_in_thread(waiter, wait=30)
    in_line(admin, table_name)
    held.unlock()  # no error, and the row is gone (handed over)
    thread.join(10)
    lock = result["lock"]
    assert lock.lock_id > held.lock_id
    assert heard() == []  # the grant was made, its notification skipped
    lock.unlock()
    wait_until(lambda: holder.lock_info("report") is None)
    stalled.close()
    filler.close()
    holder.close()
    waiter.close()


def test_a_forged_leader_notification_changes_no_leader(
    migrated_postgres: str,
    table_name: str,
    intruder: psycopg.Connection[tuple[object, ...]],
) -> None:
    """Anyone who can connect can NOTIFY on the leaders channel, with any payload. An observer
    takes it as a hint to read the leader's row again, and reports only what it reads."""
    import threading

    leader_locker = Locker(migrated_postgres, table=table_name)
    lead = leader_locker.election("scheduler").campaign()
    observer = Locker(migrated_postgres, table=table_name)
    seen: list[object] = []
    resigned = threading.Event()

    def observe() -> None:
        for leader in observer.election("scheduler").observe():
            seen.append(leader)
            if resigned.is_set():
                break

    threading.Thread(target=observe, daemon=True).start()
    wait_until(lambda: bool(seen), timeout=30)
    channel = f"sqllocker_{table_name}_leaders"
    for forged in ("scheduler", "", "scheduler 999999 evil-host 1", "x" * 1000):
        intruder.execute("SELECT pg_notify(%s, %s)", (channel, forged))
    time.sleep(1.5)  # past a poll, too: a forged hint changes nothing either way
    assert len(seen) == 1
    (current,) = seen
    assert getattr(current, "term", None) == lead.term
    resigned.set()
    lead.resign()
    wait_until(lambda: len(seen) == 2, timeout=30)
    assert seen[1] is None
    observer.close()
    leader_locker.close()


def test_a_lock_table_made_in_a_schema_ahead_on_the_search_path_takes_no_locker_away(
    postgresql_url: str, table_name: str
) -> None:
    """A role that may create schemas makes one named like another role, which comes first on
    that role's search path (``"$user", public``), and a table of the lock table's name in it:
    that role's statements would lock there, apart from everyone else's (a second holder), and
    the schema's owner would read their secret guids. A Locker set up before goes on locking in
    the table it found; one set up after refuses to pick."""
    suffix = uuid.uuid4().hex[:8]
    victim, hostile = f"sqllocker_victim_{suffix}", f"sqllocker_hostile_{suffix}"
    database = sa.make_url(resolve_url(postgresql_url)).database
    engine = sa.create_engine(resolve_url(postgresql_url))
    upgrade(engine, table_name)
    with connect(postgresql_url) as admin:
        admin.execute(f"CREATE ROLE {victim} LOGIN SUPERUSER")
        admin.execute(f"CREATE ROLE {hostile} LOGIN")
        admin.execute(f"GRANT CREATE ON DATABASE {database} TO {hostile}")
    victim_url = str(sa.make_url(resolve_url(postgresql_url)).set(username=victim))
    others = Locker(with_options(postgresql_url, "-c search_path=public"), table=table_name)
    running = Locker(victim_url, table=table_name)
    late = Locker(victim_url, table=table_name)
    try:
        with connect(postgresql_url, user=hostile) as conn:
            conn.execute(f"CREATE SCHEMA {victim}")
            conn.execute(f"GRANT USAGE ON SCHEMA {victim} TO PUBLIC")
            # What no INSERT or DELETE can be sent to may bear the name: not a second table.
            conn.execute(f"CREATE SEQUENCE {victim}.{table_name}")
        behind = with_options(postgresql_url, f"-c search_path=public,{victim}")
        with Locker(behind, table=table_name) as beside_a_sequence:
            beside_a_sequence.lock("warm").unlock()
        with connect(postgresql_url, user=hostile) as conn:
            conn.execute(f"DROP SEQUENCE {victim}.{table_name}")
        running.lock("warm").unlock()  # set up: one lock table on its path
        hostile_engine = sa.create_engine(resolve_url(victim_url).set(username=hostile))
        shadow = lock_table(table_name).to_metadata(sa.MetaData(), schema=victim)
        shadow.create(hostile_engine)
        hostile_engine.dispose()
        with running.lock("job"), pytest.raises(LockBusy):
            others.lock("job")
        with pytest.raises(UnsafeDatabase, match="more than one schema"):
            late.lock("job")
    finally:
        for locker in (running, late, others):
            locker.close()
        with connect(postgresql_url) as admin:
            admin.execute(f"DROP SCHEMA IF EXISTS {victim} CASCADE")
            for role in (hostile, victim):
                admin.execute(f"REVOKE ALL ON DATABASE {database} FROM {role}")
                admin.execute(f"DROP OWNED BY {role}")
                admin.execute(f"DROP ROLE {role}")
        engine.dispose()


def test_a_flood_of_forged_release_notifications_does_not_make_a_waiter_spin(
    migrated_postgres: str,
    table_name: str,
    admin: sa.Engine,
    intruder: psycopg.Connection[tuple[object, ...]],
) -> None:
    """A role that may only connect NOTIFYs the table's release channel with a lockstring, as
    fast as it can: each notification woke the waiters of that lockstring, which tried their
    INSERT every time (thousands of attempts a second). A waiter refused again by the same
    holder now waits longer before its next try, up to a quarter of a second."""
    holder = Locker(migrated_postgres, table=table_name)
    waiter = Locker(migrated_postgres, table=table_name)
    attempts: list[float] = []
    try_acquire = waiter._operations.try_acquire

    def counted(*args: Any, **kwargs: Any) -> Any:
        attempts.append(time.monotonic())
        return try_acquire(*args, **kwargs)

    waiter._operations.try_acquire = counted  # type: ignore[method-assign]
    held = holder.lock("report")
    try:
        thread, result = wait_in_thread(waiter, wait=3)
        in_line(admin, table_name)
        deadline = time.monotonic() + 3
        channel = f"sqllocker_{table_name}"
        while time.monotonic() < deadline:
            intruder.execute(f"NOTIFY \"{channel}\", 'report'")
        thread.join(10)
        assert isinstance(result.get("error"), LockBusy), result
        assert len(attempts) < 60, f"{len(attempts)} attempts in 3 s of forged notifications"
    finally:
        held.unlock()
        holder.close()
        waiter.close()
