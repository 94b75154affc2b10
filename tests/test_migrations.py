"""The shipped migrations build exactly sqllocker.schema.lock_table() (that they ship in the
wheel: tests/test_release.py)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from sqllocker import LockBusy, Locker
from sqllocker.asyncio import AsyncLocker
from sqllocker.cli import cli
from sqllocker.engine import resolve_url
from sqllocker.migrations import (
    current_revision,
    downgrade,
    head_revision,
    schema_differences,
    upgrade,
    upgrade_sql,
)
from sqllocker.notifications import guid_digest
from sqllocker.schema import ID_ORDER_STRIPES, VERSION_TABLE, version_table_for
from tests import forked_cli, helpers
from tests.helpers import RawTicket

REPO = Path(__file__).resolve().parent.parent


def test_migrations_produce_exactly_the_table(url: str, table_name: str) -> None:
    engine = sa.create_engine(resolve_url(url))
    upgrade(engine, table_name)
    assert schema_differences(engine, table_name) == []
    assert current_revision(engine, table_name) == head_revision()
    engine.dispose()


def test_the_comparison_notices_a_table_that_differs(url: str, table_name: str) -> None:
    engine = sa.create_engine(resolve_url(url))
    upgrade(engine, table_name)
    with engine.begin() as conn:
        conn.exec_driver_sql(
            f"DROP INDEX ix_{table_name}_expires"
            + (f" ON {table_name}" if engine.dialect.name == "mysql" else "")
        )
    assert schema_differences(engine, table_name) != []
    engine.dispose()


def test_upgrade_is_idempotent_and_uses_its_own_version_table(url: str) -> None:
    engine = sa.create_engine(resolve_url(url))
    locker = Locker(engine)  # the default table, "semaphores"
    locker.create_table()
    locker.create_table()
    tables = set(sa.inspect(engine).get_table_names())
    assert VERSION_TABLE in tables
    assert "alembic_version" not in tables  # the application's own alembic is left alone
    with locker.lock("job"):
        pass
    locker.close()
    downgrade(engine)  # everything the migrations made, for the next test on this database
    assert not set(sa.inspect(engine).get_table_names()) & {"semaphores", "semaphores_requests"}
    with engine.begin() as conn:
        conn.exec_driver_sql(f"DROP TABLE {VERSION_TABLE}")
    engine.dispose()


def foreign_time_triggers(engine: sa.Engine, table: str) -> tuple[set[str], set[str]]:
    """The names (less ``<table>_``) of the ``<table>_foreign_*`` triggers, and of the
    functions, that exist."""
    found = []
    with engine.connect() as conn:
        for catalogue, column in (("pg_trigger", "tgname"), ("pg_proc", "proname")):
            names = conn.exec_driver_sql(
                f"SELECT {column} FROM pg_catalog.{catalogue} "
                f"WHERE starts_with({column}::text, %(prefix)s)",
                {"prefix": f"{table}_foreign_"},
            ).scalars()
            found.append({name.removeprefix(f"{table}_") for name in names})
    return found[0], found[1]


BY_COLUMN = {"foreign_created", "foreign_expires"}


def test_a_table_at_0001_is_behind_and_migrate_brings_the_foreign_times(
    url: str, table_name: str
) -> None:
    """A table migrated before revision 0002 came is at 0001: ``migrate --check`` says it is
    behind and what to run, and ``migrate`` brings it, on PostgreSQL the triggers that read
    a DBIx::Locker row's offset-less times as UTC, whatever the inserting session's TimeZone
    (without them, a Tokyo session reads Perl's 12:00 as 03:00 UTC: nine hours early), and
    every time such a row is written again, even one that the session reads as the instant the
    row held (0002's trigger took that for no change)."""
    engine = sa.create_engine(resolve_url(url))
    postgresql = engine.dialect.name == "postgresql"
    upgrade(engine, table_name, "0001")
    if postgresql:
        assert foreign_time_triggers(engine, table_name) == (set(), set())
    checked = CliRunner().invoke(cli, ["--url", url, "--table", table_name, "migrate", "--check"])
    assert checked.exit_code == 1, checked.output
    assert f"at revision 0001, behind {head_revision()}" in checked.output
    assert f"`sqllocker --url URL --table {table_name} migrate`" in checked.output
    migrated = CliRunner().invoke(cli, ["--url", url, "--table", table_name, "migrate"])
    assert migrated.exit_code == 0, migrated.output
    assert f"from 0001 to revision {head_revision()}" in migrated.output
    assert current_revision(engine, table_name) == head_revision() == "0004"
    assert schema_differences(engine, table_name) == []
    if postgresql:
        assert foreign_time_triggers(engine, table_name) == (BY_COLUMN, BY_COLUMN)
        with engine.connect() as conn:
            for name in BY_COLUMN:
                pinned, public = conn.exec_driver_sql(
                    "SELECT proconfig, "
                    "pg_catalog.has_function_privilege('public', oid, 'EXECUTE') "
                    "FROM pg_catalog.pg_proc WHERE proname = %(name)s",
                    {"name": f"{table_name}_{name}"},
                ).one()
                assert pinned == ["search_path=pg_catalog, public, pg_temp"]
                assert not public
    for local_expires, expires in [
        # As DBIx::Locker inserts: no guid, local times without an offset.
        (None, datetime(2030, 1, 1, 12, tzinfo=timezone.utc)),
        # As its expires setter updates: by exactly Tokyo's offset, the text that Tokyo reads
        # as 12:00 UTC, the instant the row holds.
        ("2030-01-01 21:00:00", datetime(2030, 1, 1, 21, tzinfo=timezone.utc)),
    ]:
        with engine.begin() as conn:
            if postgresql:
                conn.exec_driver_sql("SET LOCAL TIME ZONE 'Asia/Tokyo'")  # this session only
            if local_expires is None:
                conn.exec_driver_sql(
                    f"INSERT INTO {table_name} (lockstring, created, expires, locked_by) "
                    "VALUES ('perl job', '2030-01-01 11:00:00', '2030-01-01 12:00:00', '{}')"
                )
            else:
                conn.exec_driver_sql(
                    f"UPDATE {table_name} SET expires = '{local_expires}' "
                    "WHERE lockstring = 'perl job'"
                )
        locker = Locker(url, table=table_name, auto_create=False)
        try:
            info = locker.lock_info("perl job")
        finally:
            locker.close()
        assert info is not None
        assert info.dbix_locker
        assert info.expires == expires
    with engine.begin() as conn:
        conn.exec_driver_sql(f"DELETE FROM {table_name}")
    for revision, triggers in [("0003", {"foreign_times"}), ("0001", set())]:
        downgrade(engine, table_name, revision)
        assert current_revision(engine, table_name) == revision
        if postgresql:
            assert foreign_time_triggers(engine, table_name) == (triggers, triggers)
    downgrade(engine, table_name)
    assert not sa.inspect(engine).has_table(table_name)
    engine.dispose()


def functions_named(
    engine: sa.Engine, name: str, role: str
) -> list[tuple[str, list[str], bool, bool]]:
    """Each function called ``name``: its arguments, pinned path, whether PUBLIC and whether
    ``role`` may EXECUTE it."""
    with engine.connect() as conn:
        rows = conn.exec_driver_sql(
            "SELECT pg_catalog.pg_get_function_identity_arguments(oid), proconfig, "
            "pg_catalog.has_function_privilege('public', oid, 'EXECUTE'), "
            "pg_catalog.has_function_privilege(%(role)s, oid, 'EXECUTE') "
            "FROM pg_catalog.pg_proc WHERE proname = %(name)s",
            {"name": name, "role": role},
        ).all()
    return [tuple(row) for row in rows]  # type: ignore[misc]


def test_a_table_at_0002_has_its_grants_signed_once_migrated_and_keeps_execute(
    postgresql_url: str, table_name: str
) -> None:
    """Revision 0003 (PostgreSQL): tickets keep a key their grants are signed with. The table's
    ``queue_join`` takes it as a sixth argument (a new function), and the roles granted
    EXECUTE on the old one have it on the new one too, and back again on a downgrade. A
    ticket taken without a key (the five arguments an older sqllocker sends) is still
    handed the row, told it unsigned."""
    engine = sa.create_engine(resolve_url(postgresql_url))
    role = f"sqllocker_caller_{table_name}"
    with engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE ROLE {role}")
    upgrade(engine, table_name, "0002")
    join = f"{table_name}_queue_join"
    five = (
        "ls character varying, request_guid character varying, holder jsonb, "
        "ttl double precision, liveness_key bigint"
    )
    with engine.begin() as conn:
        conn.exec_driver_sql(
            f"GRANT EXECUTE ON FUNCTION {join}(varchar, varchar, jsonb, double precision, "
            f"bigint) TO {role}"
        )
    pinned = ["search_path=pg_catalog, public, pg_temp"]
    assert functions_named(engine, join, role) == [(five, pinned, False, True)]
    upgrade(engine, table_name)
    assert current_revision(engine, table_name) == head_revision()
    assert schema_differences(engine, table_name) == []
    six = f"{five}, grant_key bytea"
    assert functions_named(engine, join, role) == [(six, pinned, False, True)]
    (release,) = functions_named(engine, f"{table_name}_notify_release", role)
    assert release[1:3] == (pinned, False)
    holder = Locker(postgresql_url, table=table_name, auto_create=False)
    held = holder.lock("report")
    raw = RawTicket(postgresql_url, table_name)  # five arguments: no key
    heard = psycopg_listen(postgresql_url, f"sqllocker_{table_name}_granted")
    held.unlock()
    payloads = heard()
    assert len(payloads) == 1
    _granted, digest = payloads[0].split(" ")
    assert digest == guid_digest(raw.guid)
    assert raw.leave(give_back=True)  # the row granted to it goes back
    raw.die()
    holder.close()
    downgrade(engine, table_name, "0002")
    assert functions_named(engine, join, role) == [(five, pinned, False, True)]
    downgrade(engine, table_name)
    with engine.begin() as conn:
        conn.exec_driver_sql(f"DROP ROLE {role}")
    engine.dispose()


def psycopg_listen(url: str, channel: str) -> Callable[[], list[str]]:
    """Listen on ``channel``; the returned function drains what has arrived."""
    connection = helpers.connect(url)
    connection.execute(f'LISTEN "{channel}"')

    def drain() -> list[str]:
        payloads = [notice.payload for notice in connection.notifies(timeout=0.5)]
        connection.close()
        return payloads

    return drain


def test_each_table_has_its_own_version_table() -> None:
    assert version_table_for("semaphores") == "sqllocker_alembic_version"
    assert version_table_for("job_locks") == "sqllocker_alembic_version_job_locks"


@pytest.mark.parametrize("dialect", ["postgresql", "mysql", "sqlite"])
def test_offline_sql_is_the_ddl_for_the_dialect(dialect: str) -> None:
    urls = {
        "postgresql": "postgresql://localhost/x",
        "mysql": "mysql://localhost/x",
        "sqlite": "sqlite:///x.db",
    }
    ddl = upgrade_sql(resolve_url(urls[dialect]), "semaphores")
    assert "CREATE TABLE semaphores" in ddl
    assert "ix_semaphores_expires" in ddl
    assert "sqllocker_alembic_version" in ddl
    expected = {"postgresql": "JSONB", "mysql": "utf8mb4_nopad_bin", "sqlite": "AUTOINCREMENT"}
    if dialect == "mysql":
        # Offline there is no server to ask whether it is MariaDB; the MySQL 8 collation is used.
        expected["mysql"] = "utf8mb4_0900_bin"
        assert "INSERT INTO semaphores_id_order (stripe) VALUES (0), (1), " in ddl
    assert expected[dialect] in ddl
    # No placeholders in printed SQL: a '%' is one (psycopg's and PyMySQL's paramstyle doubled
    # it, and broke queue_join's RAISE).
    assert "%%" not in ddl
    if dialect == "postgresql":
        assert "a grant key is 128 bytes, not %'" in ddl


@pytest.mark.parametrize("backend", ["postgresql", "sqlite"], indirect=True)
def test_the_offline_sql_applied_by_hand_makes_a_table_at_the_head(
    url: str, backend: str, table_name: str
) -> None:
    """What ``migrate --sql`` prints, run as a DBA runs it (psql, stopping at the first error):
    the table is at the head, as ``migrate`` makes it, and locks. PostgreSQL's printed '%' as
    '%%' (the driver's paramstyle), which broke a function's RAISE. (MySQL's offline DDL is for
    MySQL 8, whose collation this MariaDB lacks: its text is checked below.)"""
    script = upgrade_sql(resolve_url(url), table_name)
    helpers.apply_sql(url, script)
    engine = sa.create_engine(resolve_url(url))
    try:
        assert current_revision(engine, table_name) == head_revision()
        assert schema_differences(engine, table_name) == []
        locker = Locker(url, table=table_name, auto_create=False)
        try:
            held = locker.lock("job")
            with pytest.raises(LockBusy):
                locker.lock("job", wait=0.5)  # on PostgreSQL, by a ticket: queue_join runs
            held.unlock()
        finally:
            locker.close()
    finally:
        downgrade(engine, table_name)
        engine.dispose()


def test_mysql_migration_makes_the_stripes_table(mysql_url: str, table_name: str) -> None:
    """The stripes table that MySQL's acquire locks with innodb_autoinc_lock_mode=2 (see
    Statements.acquire; that mode is tested on a private server in test_holding.py and
    test_fencing.py). This server runs MariaDB's default mode 1, where the AUTO-INC lock
    orders ids and the acquire leaves the stripes alone; downgrading takes the table away."""
    engine = sa.create_engine(resolve_url(mysql_url))
    stripes = f"{table_name}_id_order"
    upgrade(engine, table_name)
    with engine.connect() as conn:
        count, low, high = conn.exec_driver_sql(
            f"SELECT COUNT(*), MIN(stripe), MAX(stripe) FROM {stripes}"
        ).one()
        assert conn.exec_driver_sql("SELECT @@innodb_autoinc_lock_mode").scalar() == 1
    assert (count, low, high) == (ID_ORDER_STRIPES, 0, ID_ORDER_STRIPES - 1)
    locker = Locker(mysql_url, table=table_name)
    with locker.lock("job"):
        assert locker._operations.statements.id_order is None
    locker.close()
    downgrade(engine, table_name)
    assert stripes not in sa.inspect(engine).get_table_names()
    engine.dispose()


def test_the_migration_keeps_its_own_snapshot_of_the_stripe_count() -> None:
    """A migration is a snapshot: the count of stripes it inserts is its own constant, which
    must agree with the one the acquire hashes lockstrings by."""
    from sqllocker.migrations import script_location

    source = (script_location() / "versions" / "0001_create_lock_table.py").read_text()
    assert f"STRIPES = {ID_ORDER_STRIPES}\n" in source


@pytest.mark.slow
def test_sqlite_processes_creating_the_table_at_once_do_not_collide(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'race.db'}"
    code = f"from sqllocker import Locker\nwith Locker({url!r}).lock('first use', wait=30): pass\n"
    workers = [
        subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stderr=subprocess.PIPE, text=True)
        for _ in range(6)
    ]
    for worker in workers:
        _, err = worker.communicate(timeout=120)
        assert worker.returncode == 0, err


def test_lockers_creating_their_tables_at_once_in_one_process_take_turns(tmp_path: Path) -> None:
    """alembic runs a migration through module-level proxies: two at once in one process,
    in threads or in an event loop's tasks, took each other's (KeyError: 'config', a table
    created twice), and every Locker that created its table on first use beside another
    failed with an error that was not even a LockError."""
    failed: list[BaseException] = []

    def first_use(n: int) -> None:
        try:
            Locker(f"sqlite:///{tmp_path}/thread{n}.db").lock("first use").unlock()
        except BaseException as error:
            failed.append(error)

    threads = [threading.Thread(target=first_use, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert failed == []

    async def tasks() -> None:
        lockers = [AsyncLocker(f"sqlite+aiosqlite:///{tmp_path}/task{n}.db") for n in range(8)]
        try:
            await asyncio.gather(*(locker.create_table() for locker in lockers))
            for locker in lockers:
                await (await locker.lock("first use")).unlock()
        finally:
            for locker in lockers:
                await locker.aclose()

    asyncio.run(tasks())


def test_an_interrupted_migration_raises_the_interrupt_and_can_run_again(
    url: str, table_name: str
) -> None:
    """Ctrl-C during a migration is a KeyboardInterrupt for the caller, not a DatabaseError
    made of the cleanup that found its connection invalidated (SQLAlchemy's
    PendingRollbackError); nothing is left half-done or held (MariaDB's migration lock, SQLite's
    write lock), so the migration runs again at once. SQLite in memory too, whose database goes
    with the connection the interrupt invalidated."""
    for target in [url, "sqlite://"] if url.startswith("sqlite") else [url]:
        locker = Locker(target, table=table_name)
        sa.event.listen(locker.engine, "before_cursor_execute", _interrupt_create_table)
        try:
            with pytest.raises(KeyboardInterrupt):
                locker.create_table()
        finally:
            sa.event.remove(locker.engine, "before_cursor_execute", _interrupt_create_table)
        try:
            locker.create_table()
            with locker.lock("report") as lock:
                assert lock.lock_id >= 1
        finally:
            if target == url:
                downgrade(locker.engine, table_name)
            locker.close()


def _interrupt_create_table(_conn: object, _cursor: object, statement: str, *_: object) -> None:
    if statement.lstrip().upper().startswith("CREATE TABLE"):
        raise KeyboardInterrupt


def test_tables_made_at_once_on_several_databases_by_threads_of_one_process(
    tmp_path: Path,
) -> None:
    """Alembic keeps the migration it runs in module globals: ``upgrade()`` on several SQLite
    files from several threads of one process (and beside a Locker making its table on first
    use) failed with KeyError or "table already exists", or crashed the interpreter."""
    failures: list[BaseException] = []

    def create(thread: int) -> None:
        for n in range(10):
            url = f"sqlite:///{tmp_path / f'{thread}-{n}.db'}"
            try:
                if thread == 0:
                    locker = Locker(url, table=f"t{thread}_{n}")
                    locker.lock("job").unlock()  # the table made on first use
                    locker.close()
                else:
                    engine = sa.create_engine(url)
                    upgrade(engine, f"t{thread}_{n}")
                    engine.dispose()
            except BaseException as error:
                failures.append(error)

    threads = [threading.Thread(target=create, args=(thread,)) for thread in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []


@pytest.mark.parametrize("backend", ["sqlite"])  # the version table's, any backend
def test_a_table_dropped_by_hand_is_not_called_up_to_date(url: str, table_name: str) -> None:
    """The lock table dropped by hand, its version table left: ``migrate`` made nothing and
    ``migrate --check`` said "up to date", while every lock failed for want of the table.
    Both now say what is left and what to do."""
    engine = sa.create_engine(resolve_url(url))
    Locker(engine, table=table_name).create_table()
    with engine.begin() as conn:
        conn.exec_driver_sql(f"DROP VIEW {table_name}_held")
        conn.exec_driver_sql(f"DROP TABLE {table_name}")
    for check in ([], ["--check"]):
        result = forked_cli.run(["--url", url, "--table", table_name, "migrate", *check])
        assert result.returncode == 2, result.stdout + result.stderr
        assert f"table {table_name!r} is gone" in result.stderr, result.stderr
        assert f"drop {version_table_for(table_name)}" in result.stderr
    with engine.begin() as conn:
        conn.exec_driver_sql(f"DROP TABLE {version_table_for(table_name)}")
    result = forked_cli.run(["--url", url, "--table", table_name, "migrate"])
    assert result.returncode == 0, result.stderr
    Locker(engine, table=table_name).lock("job").unlock()
    engine.dispose()
