"""DBIx::Locker itself beside sqllocker, on every backend: refusing its table until adopted, the
adoption, Perl processes in other time zones, and the two excluding each other.

The Perl module is the unmodified copy of DBIx::Locker 1.103 in ../shared/vendor (see its
NOTICE), run from there with Debian's Perl packages. Outside CI these tests skip without them;
under CI they must run (.ci/run installs the packages).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import shlex
import shutil
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
import sqlalchemy as sa
from rich.console import Console

from sqllocker import ForeignTable, LockBusy, Locker, TableMissing
from sqllocker.asyncio import AsyncLocker
from sqllocker.backends.sqlite import ADOPTED_ID_GAP
from sqllocker.backoff import Backoff
from sqllocker.census import take_census
from sqllocker.engine import resolve_url
from sqllocker.migrations import (
    adopt_dbix_locker,
    current_revision,
    head_revision,
    schema_differences,
    upgrade,
)
from sqllocker.schema import FOREIGN_CLOCK_MARGIN, version_table_for
from sqllocker.top import render

from . import forked_cli
from .conftest import IN_CI
from .helpers import apply_sql
from .test_cli import SQLLOCKER
from .workers import async_url

HERE = Path(__file__).resolve().parent
DBIX_LOCKER = Path(
    os.environ.get(
        "SQLLOCKER_DBIX_LOCKER", HERE.parent.parent / "shared" / "vendor" / "dbix-locker-1.103"
    )
)
PERL_MODULES = ("DBI", "DBD::SQLite", "DBD::Pg", "DBD::mysql", "Data::GUID", "Sub::Install", "JSON")


def _perl_missing() -> str | None:
    if shutil.which("perl") is None:
        return "perl is not installed"
    if not (DBIX_LOCKER / "lib" / "DBIx" / "Locker.pm").is_file():
        return f"DBIx::Locker is not at {DBIX_LOCKER}"
    uses = "; ".join(f"use {module}" for module in PERL_MODULES)
    probe = subprocess.run(["perl", "-e", uses], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"Perl lacks a module DBIx::Locker needs: {probe.stderr.splitlines()[0]}"
    return None


_MISSING = _perl_missing()
if _MISSING is not None and IN_CI:
    raise RuntimeError(f"under CI the DBIx::Locker tests must run: {_MISSING}")
pytestmark = [
    pytest.mark.slow,  # Perl processes beside Python ones: not in the quick subset
    pytest.mark.skipif(_MISSING is not None, reason=_MISSING or ""),
]


# -- DBIx::Locker's side ------------------------------------------------------------------------


def dbi_source(url: str) -> tuple[str, str]:
    """The DBI data source and user for one of the test fixtures' URLs."""
    parsed = sa.engine.make_url(url)
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        return f"dbi:SQLite:dbname={parsed.database}", ""
    driver = "Pg" if backend == "postgresql" else "mysql"
    name = "dbname" if backend == "postgresql" else "database"
    source = f"dbi:{driver}:{name}={parsed.database};host={parsed.host};port={parsed.port}"
    return source, parsed.username or ""


def perl_command(url: str, table: str, *args: str) -> list[str]:
    source, user = dbi_source(url)
    return ["perl", str(HERE / "dbix_locker.pl"), source, user, table, *args]


def perl_environment(zone: str) -> dict[str, str]:
    return {**os.environ, "PERL5LIB": str(DBIX_LOCKER / "lib"), "TZ": zone}


_HOLDERS: list[subprocess.Popen[str]] = []


@pytest.fixture(autouse=True)
def _no_perl_left_behind() -> Iterator[None]:
    """Perl holders a failed test left running are ended before their table is dropped."""
    yield
    while _HOLDERS:
        process = _HOLDERS.pop()
        if process.poll() is None:
            process.kill()
        process.wait()


class PerlHolder:
    """A Perl process holding a DBIx::Locker lock until told to unlock it or to leave it."""

    def __init__(self, url: str, table: str, lockstring: str, seconds: int, zone: str) -> None:
        self.process = subprocess.Popen(
            perl_command(url, table, "hold", lockstring, str(seconds)),
            env=perl_environment(zone),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        _HOLDERS.append(self.process)
        assert self.process.stdout is not None
        self.answer = self.process.stdout.readline().strip()
        self.lock_id = int(self.answer.split()[1]) if self.answer.startswith("locked ") else None

    def ask(self, line: str) -> str:
        """Its answer to ``line`` (``cycle OTHER``), holding on."""
        assert self.process.stdin is not None
        assert self.process.stdout is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()
        return self.process.stdout.readline().strip()

    def tell(self, line: str) -> str:
        assert self.process.stdin is not None
        assert self.process.stdout is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()
        answer = self.process.stdout.readline().strip() if line == "unlock" else ""
        self.process.wait(timeout=30)
        return answer


def perl_leaves_lock(url: str, table: str, lockstring: str, seconds: int, zone: str) -> int:
    """A Perl process that locks and dies without unlocking; the lock's id."""
    holder = PerlHolder(url, table, lockstring, seconds, zone)
    assert holder.lock_id is not None, holder.answer
    holder.tell("leave")
    return holder.lock_id


def create_dbix_table(url: str, table: str) -> None:
    """The table as DBIx::Locker's own DDL makes it (its sql/; PostgreSQL, which it ships none
    for, a direct translation of the MySQL one)."""
    backend = sa.engine.make_url(url).get_backend_name()
    if backend == "postgresql":
        ddl = (
            f"CREATE TABLE {table} (id bigserial PRIMARY KEY, lockstring varchar(128) UNIQUE, "
            "created timestamp NOT NULL, expires timestamp NOT NULL, locked_by text NOT NULL)"
        )
    else:
        shipped = (DBIX_LOCKER / "sql" / f"{backend}.sql").read_text()
        ddl = shipped.replace("TABLE semaphores", f"TABLE {table}")
        ddl = ddl.replace("TABLE locks", f"TABLE {table}").strip().rstrip(";")
    engine = sa.create_engine(resolve_url(url))
    with engine.begin() as conn:
        conn.exec_driver_sql(ddl)
    engine.dispose()


# -- fixtures and helpers -----------------------------------------------------------------------


# Every function a lock table's migrations make beside it, at any revision, less its prefix.
POSTGRESQL_FUNCTIONS = (
    "notify_release",
    "queue_join",
    "anyone_ahead",
    "queue_leave",
    "sweep_requests",
    "foreign_times",
    "foreign_created",
    "foreign_expires",
)


@pytest.fixture
def db(url: str, table_name: str) -> Iterator[sa.Engine]:
    """An engine on the test's database; drops what the test made there."""
    engine = sa.create_engine(resolve_url(url))
    yield engine
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            conn.exec_driver_sql(f"DROP TABLE IF EXISTS {table_name} CASCADE")
            conn.exec_driver_sql(f"DROP TABLE IF EXISTS {table_name}_requests")
            for name in POSTGRESQL_FUNCTIONS:
                conn.exec_driver_sql(f"DROP FUNCTION IF EXISTS {table_name}_{name} CASCADE")
        else:
            conn.exec_driver_sql(f"DROP VIEW IF EXISTS {table_name}_held")
        for name in (
            table_name,
            f"{table_name}_dbix_locker",
            f"{table_name}_sqllocker_new",
            f"{table_name}_id_order",
            f"{table_name}_requests",
            version_table_for(table_name),
        ):
            conn.exec_driver_sql(f"DROP TABLE IF EXISTS {name}")
    engine.dispose()


def sqllocker_cli(url: str, table: str, *args: str) -> tuple[int, str]:
    """The console script's exit status and what it printed (stdout, then stderr); forked
    from a server that imported it once (``tests/forked_cli.py``)."""
    result = forked_cli.run(["--url", url, "--table", table, *args])
    return result.returncode, result.stdout + result.stderr


def server_now(db: sa.Engine) -> datetime:
    with db.connect() as conn:
        if db.dialect.name == "postgresql":
            value = conn.exec_driver_sql("SELECT now() AT TIME ZONE 'UTC'").scalar()
        elif db.dialect.name == "mysql":
            value = conn.exec_driver_sql("SELECT UTC_TIMESTAMP(6)").scalar()
        else:
            value = datetime.fromisoformat(
                conn.exec_driver_sql("SELECT strftime('%Y-%m-%d %H:%M:%f', 'now')").scalar()
            )
    assert isinstance(value, datetime)
    return value.replace(tzinfo=timezone.utc)


def set_expiry(db: sa.Engine, table: str, lockstring: str, expires: datetime) -> None:
    """Write a row's expiry as the backend stores UTC instants (as sqllocker writes them)."""
    value: object = expires
    if db.dialect.name == "mysql":
        value = expires.replace(tzinfo=None)
    elif db.dialect.name == "sqlite":
        value = expires.strftime("%Y-%m-%d %H:%M:%S.%f")[:23]
    rows = sa.table(table, sa.column("lockstring"), sa.column("expires"))
    with db.begin() as conn:
        conn.execute(sa.update(rows).where(rows.c.lockstring == lockstring).values(expires=value))


def row_count(db: sa.Engine, table: str) -> int:
    with db.connect() as conn:
        return int(conn.exec_driver_sql(f"SELECT COUNT(*) FROM {table}").scalar() or 0)


# -- detect and refuse --------------------------------------------------------------------------


def test_a_dbix_locker_table_is_refused_until_adopted(
    url: str, table_name: str, db: sa.Engine
) -> None:
    create_dbix_table(url, table_name)
    perl_leaves_lock(url, table_name, "nightly report", 3600, "America/New_York")
    locker = Locker(url, table=table_name)
    try:
        for operation in (
            lambda: locker.lock("nightly report"),
            lambda: locker.lock("something else"),
            lambda: locker.locks(),
            lambda: locker.lock_info("nightly report"),
            lambda: locker.purge_expired_locks(),
        ):
            with pytest.raises(ForeignTable) as refused:
                operation()
            message = str(refused.value)
            assert "\n" not in message
            assert "not made by sqllocker" in message
            assert "--adopt-dbix-locker --perl-tz ZONE" in message
    finally:
        locker.close()

    async def async_lock() -> None:
        async_locker = AsyncLocker(async_url(str(resolve_url(url))), table=table_name)
        try:
            await async_locker.lock("nightly report")
        finally:
            await async_locker.aclose()

    with pytest.raises(ForeignTable):
        asyncio.run(async_lock())

    for command in (["purge-expired"], ["list"], ["migrate"]):
        code, output = sqllocker_cli(url, table_name, *command)
        assert code != 0
        assert len(output.strip().splitlines()) == 1, output
        assert "--adopt-dbix-locker" in output
    # The refused migrate left nothing behind, and the Perl lock is still there.
    assert not sa.inspect(db).has_table(version_table_for(table_name))
    assert row_count(db, table_name) == 1


# -- adoption -----------------------------------------------------------------------------------


def test_adoption_keeps_rows_converts_times_and_the_rows_still_exclude(
    url: str, backend: str, table_name: str, db: sa.Engine
) -> None:
    create_dbix_table(url, table_name)
    live = PerlHolder(url, table_name, "nightly report", 3600, "America/New_York")
    assert live.lock_id is not None, live.answer
    crashed_id = perl_leaves_lock(url, table_name, "crashed job", 7200, "America/New_York")

    code, printed = sqllocker_cli(
        url, table_name, "migrate", "--adopt-dbix-locker", "--perl-tz", "America/New_York", "--sql"
    )
    assert code == 0, printed
    assert "nightly report" in printed
    assert "crashed job" in printed
    assert "guid" not in {c["name"] for c in sa.inspect(db).get_columns(table_name)}

    code, output = sqllocker_cli(
        url, table_name, "migrate", "--adopt-dbix-locker", "--perl-tz", "America/New_York"
    )
    assert code == 0, output
    assert f"adopted {table_name} with its 2 rows" in output
    assert current_revision(db, table_name) == head_revision()
    if backend != "mysql":  # MySQL keeps the case-folding collation: see the test below
        assert schema_differences(db, table_name) == []

    now = server_now(db)
    locker = Locker(url, table=table_name)
    try:
        rows = {info.lockstring: info for info in locker.locks()}
        assert rows["nightly report"].lock_id == live.lock_id
        assert rows["crashed job"].lock_id == crashed_id
        # Written as New York's local time, read back as the UTC instant it meant.
        assert abs(rows["nightly report"].expires - (now + timedelta(hours=1))) < timedelta(
            minutes=2
        )
        assert abs(rows["crashed job"].expires - (now + timedelta(hours=2))) < timedelta(minutes=2)
        assert all(info.dbix_locker and not info.created_in_future for info in rows.values())
        # The view made beside it reads the adopted table (on MySQL it was made before the
        # swap, by the name the new table then took).
        with db.connect() as conn:
            held = conn.exec_driver_sql(
                f"SELECT lockstring, host FROM {table_name}_held ORDER BY lock_id"
            ).all()
        assert [row[0] for row in held] == ["nightly report", "crashed job"]
        assert all(row[1] for row in held)

        with pytest.raises(LockBusy):
            locker.lock("nightly report")
        # The Perl process still releases its lock by its id, after which Python takes it, with
        # an id above any the old table handed out.
        assert live.tell("unlock") == "unlocked"
        lock = locker.lock("nightly report")
        floor = max(live.lock_id, crashed_id) + (ADOPTED_ID_GAP if backend == "sqlite" else 0)
        assert lock.lock_id > floor
        # And an unmodified Perl process still locks on the adopted table, excluded by Python.
        later = PerlHolder(url, table_name, "nightly report", 60, "UTC")
        assert later.answer.startswith("refused could not lock resource"), later.answer
        fresh = PerlHolder(url, table_name, "weekly report", 60, "UTC")
        assert fresh.lock_id is not None, fresh.answer
        with pytest.raises(LockBusy):
            locker.lock("weekly report")
        assert fresh.tell("unlock") == "unlocked"
        lock.unlock()
    finally:
        locker.close()


@pytest.mark.parametrize("backend", ["postgresql"])
@pytest.mark.parametrize("owns", [False, True], ids=["granted", "the owner"])
def test_postgresql_adoption_keeps_what_other_roles_may_do_with_the_table(
    url: str, backend: str, table_name: str, db: sa.Engine, owns: bool
) -> None:
    """Perl jobs of another role, granted what DBIx::Locker needs on its table and sequence,
    or its owner (a DBA adopting the application's table): the adoption drops and makes the
    table again, and they could no longer lock or unlock ("permission denied"), their held
    rows left for the clock margin."""
    create_dbix_table(url, table_name)
    role = f"sqllocker_perl_{table_name}"
    with db.begin() as conn:
        conn.exec_driver_sql(f"CREATE ROLE {role} LOGIN")
        if owns:
            conn.exec_driver_sql(f"ALTER TABLE {table_name} OWNER TO {role}")
        else:
            conn.exec_driver_sql(f"GRANT SELECT, INSERT, UPDATE, DELETE ON {table_name} TO {role}")
            conn.exec_driver_sql(f"GRANT USAGE ON SEQUENCE {table_name}_id_seq TO {role}")
    perl_role = sa.create_engine(resolve_url(url).set(username=role))
    try:
        code, printed = sqllocker_cli(
            url, table_name, "migrate", "--adopt-dbix-locker", "--perl-tz", "UTC", "--sql"
        )
        assert code == 0, printed
        assert f"GRANT INSERT ON TABLE {table_name} TO {role}" in printed
        code, output = sqllocker_cli(
            url, table_name, "migrate", "--adopt-dbix-locker", "--perl-tz", "UTC"
        )
        assert code == 0, output
        with perl_role.begin() as conn:  # what DBIx::Locker's lock and unlock send
            conn.exec_driver_sql(
                f"INSERT INTO {table_name} (lockstring, created, expires, locked_by) "
                "VALUES ('perl job', now(), now() + interval '1 hour', '{}')"
            )
            lock_id = conn.exec_driver_sql(
                f"SELECT currval(pg_get_serial_sequence('{table_name}', 'id'))"
            ).scalar()
            deleted = conn.exec_driver_sql(f"DELETE FROM {table_name} WHERE id = {lock_id}")
            assert deleted.rowcount == 1
    finally:
        perl_role.dispose()
        with db.begin() as conn:
            conn.exec_driver_sql(f"DROP OWNED BY {role}")
            conn.exec_driver_sql(f"DROP ROLE {role}")


@pytest.mark.parametrize("backend", ["postgresql"])
def test_a_perl_process_locks_on_after_adopting_a_table_renamed_since_it_was_made(
    url: str, table_name: str, db: sa.Engine
) -> None:
    """A table renamed since it was made keeps its sequence's old name, which DBD::Pg
    remembers per table once a Perl process has locked: asked for the id of its next lock
    after the adoption, the sequence was gone with the old table, the lock taken with no id,
    and its release failed, the row left for the clock margin. The new table's sequence now
    takes the old one's name."""
    create_dbix_table(url, f"{table_name}_was")
    with db.begin() as conn:
        conn.exec_driver_sql(f"ALTER TABLE {table_name}_was RENAME TO {table_name}")
    perl = PerlHolder(url, table_name, "before", 3600, "UTC")  # DBD::Pg learns the sequence
    assert perl.lock_id is not None, perl.answer
    code, output = sqllocker_cli(
        url, table_name, "migrate", "--adopt-dbix-locker", "--perl-tz", "UTC"
    )
    assert code == 0, output
    answer = perl.ask("cycle after")
    assert re.fullmatch(r"cycled \d+", answer), answer
    assert int(answer.split()[1]) > perl.lock_id
    assert perl.tell("unlock") == "unlocked"
    with db.connect() as conn:
        left = conn.exec_driver_sql(f"SELECT lockstring FROM {table_name}").scalars().all()
    assert left == [], left


@pytest.mark.parametrize("backend", ["postgresql"])
def test_the_adoption_sql_printed_by_the_owner_and_applied_by_a_dba_keeps_the_owner_locking(
    url: str, table_name: str, db: sa.Engine
) -> None:
    """``--sql`` printed by the table's owner, applied by a DBA (psql as postgres): the grants
    to the owner were left out, the owner being the role that printed them, and its Perl jobs
    were locked out of the DBA's new table ("permission denied")."""
    create_dbix_table(url, table_name)
    role = f"sqllocker_owner_{table_name}"
    with db.begin() as conn:
        conn.exec_driver_sql(f"CREATE ROLE {role} LOGIN")
        conn.exec_driver_sql(f"ALTER TABLE {table_name} OWNER TO {role}")
    as_owner = str(sa.engine.make_url(url).set(username=role))
    owner = sa.create_engine(resolve_url(as_owner))
    try:
        adopt = ["migrate", "--adopt-dbix-locker", "--perl-tz", "UTC", "--sql"]
        code, printed = sqllocker_cli(as_owner, table_name, *adopt)
        assert code == 0, printed
        apply_sql(url, printed)
        with owner.begin() as conn:  # what DBIx::Locker's lock and unlock send
            conn.exec_driver_sql(
                f"INSERT INTO {table_name} (lockstring, created, expires, locked_by) "
                "VALUES ('perl job', now(), now() + interval '1 hour', '{}')"
            )
            conn.exec_driver_sql(f"DELETE FROM {table_name} WHERE lockstring = 'perl job'")
    finally:
        owner.dispose()
        with db.begin() as conn:
            conn.exec_driver_sql(f"DROP OWNED BY {role}")
            conn.exec_driver_sql(f"DROP ROLE {role}")


def test_the_adoption_sql_applied_by_hand_keeps_every_lockstring(
    url: str, backend: str, table_name: str, db: sa.Engine
) -> None:
    """What ``--adopt-dbix-locker --sql`` prints, applied as a DBA does (psql), copies a Perl
    lock whose lockstring has a '%' as it is: printed as '%%', it was another lockstring (and
    on PostgreSQL the script stopped at a function's RAISE). MySQL's is only read: its offline
    DDL is MySQL 8's, whose collation this MariaDB lacks."""
    create_dbix_table(url, table_name)
    perl_leaves_lock(url, table_name, "job 100%", 7200, "America/New_York")
    code, printed = sqllocker_cli(
        url, table_name, "migrate", "--adopt-dbix-locker", "--perl-tz", "America/New_York", "--sql"
    )
    assert code == 0, printed
    assert "'job 100%'" in printed
    if backend == "mysql":
        return
    apply_sql(url, printed)
    assert current_revision(db, table_name) == head_revision()
    locker = Locker(url, table=table_name, auto_create=False)
    try:
        assert [info.lockstring for info in locker.locks()] == ["job 100%"]
        with pytest.raises(LockBusy):
            locker.lock("job 100%")
    finally:
        locker.close()


@pytest.mark.parametrize("backend", ["mysql"])
@pytest.mark.parametrize("exact", [False, True], ids=["folding", "exact"])
def test_mysql_adoption_keeps_case_folding_unless_asked(
    url: str, table_name: str, db: sa.Engine, exact: bool
) -> None:
    create_dbix_table(url, table_name)
    perl_leaves_lock(url, table_name, "Report", 3600, "UTC")
    options = ["--exact-lockstrings"] if exact else []
    code, output = sqllocker_cli(
        url, table_name, "migrate", "--adopt-dbix-locker", "--perl-tz", "UTC", *options
    )
    assert code == 0, output
    locker = Locker(url, table=table_name)
    try:
        if exact:
            locker.lock("report").unlock()
            assert schema_differences(db, table_name) == []
        else:
            with pytest.raises(LockBusy):
                locker.lock("report")
    finally:
        locker.close()


def test_adoption_refuses_what_is_not_a_dbix_locker_table(
    url: str, table_name: str, db: sa.Engine
) -> None:
    code, output = sqllocker_cli(url, table_name, "migrate", "--adopt-dbix-locker")
    assert code != 0
    assert "needs --perl-tz" in output
    code, output = sqllocker_cli(
        url, table_name, "migrate", "--adopt-dbix-locker", "--perl-tz", "Mars/Olympus"
    )
    assert code != 0
    assert "unknown time zone" in output
    code, output = sqllocker_cli(
        url, table_name, "migrate", "--adopt-dbix-locker", "--perl-tz", "UTC"
    )
    assert code != 0
    assert "no table" in output
    upgrade(db, table_name)
    code, output = sqllocker_cli(
        url, table_name, "migrate", "--adopt-dbix-locker", "--perl-tz", "UTC"
    )
    assert code != 0
    assert "sqllocker's already" in output
    assert len(output.strip().splitlines()) == 1


@pytest.mark.parametrize("backend", ["postgresql"])
@pytest.mark.parametrize("made", ["times with zones", "a sequence of its own"])
def test_postgresql_adoption_refuses_a_table_whose_times_or_ids_it_cannot_follow(
    url: str, table_name: str, db: sa.Engine, made: str
) -> None:
    """Made by hand otherwise than DBIx::Locker's DDL: timestamptz columns, which read each
    Perl time in its session's TimeZone (a Los Angeles expiry put 17 hours early by a Tokyo
    session); an id drawn from a sequence the column does not own, whose ids the adoption
    missed, and which outlived the old table, still answering DBD::Pg's long-running Perl
    processes with the id of their previous lock (then released by id: another's). Refused,
    nothing written; with the sequence made the column's own, adopted."""
    times = "timestamptz" if made == "times with zones" else "timestamp"
    with db.begin() as conn:
        if made == "a sequence of its own":
            conn.exec_driver_sql(f"CREATE SEQUENCE {table_name}_ids")
            ids = f"bigint PRIMARY KEY DEFAULT nextval('{table_name}_ids')"
        else:
            ids = "bigserial PRIMARY KEY"
        conn.exec_driver_sql(
            f"CREATE TABLE {table_name} (id {ids}, lockstring varchar(128) UNIQUE, "
            f"created {times} NOT NULL, expires {times} NOT NULL, locked_by text NOT NULL)"
        )
    adopt = ("migrate", "--adopt-dbix-locker", "--perl-tz", "America/Los_Angeles")
    code, output = sqllocker_cli(url, table_name, *adopt)
    assert code != 0
    assert "cannot be adopted as it is" in output
    assert "guid" not in {c["name"] for c in sa.inspect(db).get_columns(table_name)}
    assert current_revision(db, table_name) is None
    if made == "a sequence of its own":
        with db.begin() as conn:
            conn.exec_driver_sql(f"ALTER SEQUENCE {table_name}_ids OWNED BY {table_name}.id")
        code, output = sqllocker_cli(url, table_name, *adopt)
        assert code == 0, output


# -- side by side -------------------------------------------------------------------------------


@pytest.mark.parametrize("zone", ["America/New_York", "Asia/Tokyo"])
def test_perl_rows_are_taken_over_only_once_expired_in_every_time_zone(
    url: str, table_name: str, db: sa.Engine, zone: str
) -> None:
    upgrade(db, table_name)
    perl = PerlHolder(url, table_name, "nightly report", 3600, zone)
    assert perl.lock_id is not None, perl.answer
    locker = Locker(url, table=table_name, grace=0)
    try:
        info = locker.lock_info("nightly report")
        assert info is not None
        assert info.dbix_locker
        # Tokyo's local time reads as hours ahead of the server's UTC clock (on PostgreSQL, whose
        # session reads the text in its own zone, too), and is flagged.
        assert info.created_in_future == (zone == "Asia/Tokyo")
        now = server_now(db)
        # Its written expiry hours past by UTC, as New York's local time reads: still held.
        set_expiry(db, table_name, "nightly report", now - timedelta(hours=5))
        with pytest.raises(LockBusy):
            locker.lock("nightly report")
        assert locker.purge_expired_locks() == 0
        # ... and shown so: its time left unknown, not "expired".
        info = locker.lock_info("nightly report")
        assert info is not None
        assert not info.expired
        code, output = sqllocker_cli(url, table_name, "show", "nightly report")
        assert (code, "state:      held, unknown* left" in output) == (0, True), output
        code, output = sqllocker_cli(url, table_name, "list", "--expired")
        assert (code, "nightly report" in output) == (0, False), output
        console = Console(width=200, record=True)
        console.print(render(locker, None))
        assert "unknown" in console.export_text()
        margin = timedelta(seconds=FOREIGN_CLOCK_MARGIN)
        set_expiry(db, table_name, "nightly report", now - margin + timedelta(minutes=5))
        with pytest.raises(LockBusy):
            locker.lock("nightly report")
        # Past in every zone: taken over, with a new id, and the stale Perl holder cannot
        # release the new holder's lock.
        set_expiry(db, table_name, "nightly report", now - margin - timedelta(minutes=1))
        info = locker.lock_info("nightly report")
        assert info is not None
        assert info.expired
        lock = locker.lock("nightly report")
        assert lock.lock_id > perl.lock_id
        assert perl.tell("unlock").startswith("unlock failed")
        assert locker.lock_info("nightly report") is not None
        lock.check()
        lock.unlock()
    finally:
        locker.close()


def test_a_waiter_behind_a_perl_row_past_its_written_expiry_backs_off(
    url: str, table_name: str, db: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Perl row whose written expiry has passed is still held for the clock margin (hours):
    a waiter's pauses were capped at that written expiry, past already, and it asked again
    every fraction of a millisecond, thousands of statements a second."""
    upgrade(db, table_name)
    perl = PerlHolder(url, table_name, "nightly report", 3600, "America/New_York")
    assert perl.lock_id is not None, perl.answer
    set_expiry(db, table_name, "nightly report", server_now(db) - timedelta(hours=5))
    pauses: list[float] = []
    next_delay = Backoff.next_delay

    def recorded(backoff: Backoff, *args: Any, **kwargs: Any) -> float:
        pauses.append(next_delay(backoff, *args, **kwargs))
        return pauses[-1]

    monkeypatch.setattr(Backoff, "next_delay", recorded)
    locker = Locker(url, table=table_name)
    try:
        with pytest.raises(LockBusy):
            locker.lock("nightly report", wait=2)
    finally:
        locker.close()
    # Backing off to MAX_DELAY (a quarter of a second): a few dozen pauses in 2 s.
    assert len(pauses) < 100, f"{len(pauses)} pauses in 2 s, the last {pauses[-5:]}"
    perl.tell("unlock")


def test_a_python_lock_is_not_taken_by_perl(url: str, table_name: str, db: sa.Engine) -> None:
    upgrade(db, table_name)
    locker = Locker(url, table=table_name)
    try:
        with locker.lock("nightly report", expires=600):
            for zone in ("America/New_York", "Asia/Tokyo", "UTC"):
                perl = PerlHolder(url, table_name, "nightly report", 60, zone)
                assert perl.answer.startswith("refused could not lock resource"), perl.answer
                perl.process.wait(timeout=30)
    finally:
        locker.close()


@pytest.mark.parametrize("backend", ["sqlite"])
def test_a_perl_lock_whose_lockstring_is_not_utf8_is_listed_and_purged(
    url: str, table_name: str, db: sa.Engine
) -> None:
    """DBD::SQLite stores the bytes of a Perl byte string as they are: a lockstring written in
    Latin-1 is no UTF-8, which sqlite3 cannot read as text, and one such row failed every
    listing of the table (``sqllocker list``, ``top``, the exporter's census). It is listed,
    its bytes that are no UTF-8 as escapes, beside the others; and purged once expired."""
    upgrade(db, table_name)
    perl = PerlHolder(url, table_name, "caf\udce9 report", 3600, "UTC")  # Latin-1 "café"
    assert perl.lock_id is not None, perl.answer
    locker = Locker(url, table=table_name)
    try:
        with locker.lock("other report"):
            expected = {"caf\\xe9 report", "other report"}
            assert {info.lockstring for info in locker.locks()} == expected
            assert {info.lockstring for info in locker.locks("*report")} == expected
            census = take_census(locker.engine, table_name, "*", 10)
            assert {lock.lockstring for lock in census.locks} == expected
            code, output = sqllocker_cli(url, table_name, "list")
            assert (code, "caf\\xe9 report" in output) == (0, True), output
            console = Console(width=200, record=True)
            console.print(render(locker, None))
            assert "caf\\xe9 report" in console.export_text()
        with db.begin() as conn:
            long_ago = "2000-01-01 00:00:00.000"
            conn.execute(
                sa.text(f"UPDATE {table_name} SET expires = :at WHERE id = :id"),
                {"at": long_ago, "id": perl.lock_id},
            )
        assert locker.purge_expired_locks() == 1
        assert locker.locks() == []
    finally:
        locker.close()
    perl.process.kill()
    perl.process.wait()


def test_perl_and_python_processes_exclude_each_other(
    url: str, table_name: str, db: sa.Engine, tmp_path: Path
) -> None:
    """Two Perl processes (New York, Tokyo) and two Python ones (UTC) increment one counter
    under one lockstring: no two inside at once (O_EXCL marker), no update lost."""
    upgrade(db, table_name)
    state = tmp_path / "state"
    state.mkdir()
    (state / "counter.count").write_text("0")
    turns = 40
    perls = [
        subprocess.Popen(
            perl_command(
                url,
                table_name,
                "count",
                "counter",
                str(turns),
                str(state / "counter.count"),
                str(state / "counter.holder"),
            ),
            env=perl_environment(zone),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for zone in ("America/New_York", "Asia/Tokyo")
    ]
    pythons = [  # python -m tests.workers, forked from a server that imported it once
        forked_cli.Popen(
            [
                "counter",
                f"--url={url}",
                f"--table={table_name}",
                f"--state={state}",
                "--lockstrings=counter",
                f"--count={turns}",
                "--hold=0.002",
                "--expires=60",
            ],
            cwd=HERE.parent,
        )
        for _ in range(2)
    ]
    perl_ids: list[int] = []
    for process in perls:
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err
        perl_ids += [int(value) for value in out.split()[1:]]
    for process in pythons:
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err
        report = json.loads(out.strip().splitlines()[-1])
        assert report["overlaps"] == 0
        assert report["lost"] == 0
    assert int((state / "counter.count").read_text()) == 4 * turns
    assert len(perl_ids) == 2 * turns
    python_ids = [
        json.loads(line)["id"]
        for log in state.glob("log-*.jsonl")
        for line in log.read_text().splitlines()
    ]
    # Every acquisition, Perl's and Python's, had an id of its own.
    assert len(set(perl_ids) | set(python_ids)) == 4 * turns


# -- adoption while Perl keeps locking ------------------------------------------------------------

CHURN_LOCKSTRINGS = ("alpha", "beta", "gamma")
# Perl's words for a table that is not there, on each backend's driver.
MISSING_TABLE = ("doesn't exist", "does not exist", "no such table")


def start_churn(
    url: str, table: str, state: Path, seconds: float, zone: str = "UTC"
) -> list[subprocess.Popen[str]]:
    """Three Perl processes locking and unlocking CHURN_LOCKSTRINGS for ``seconds`` at most,
    until :func:`check_churn` stops them."""
    for name in CHURN_LOCKSTRINGS:
        (state / f"{name}.count").write_text("0")
    processes = [
        subprocess.Popen(
            perl_command(
                url,
                table,
                "churn",
                ",".join(CHURN_LOCKSTRINGS),
                str(seconds),
                str(state / "log"),
                str(state),
            ),
            env=perl_environment(zone),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(CHURNERS)
    ]
    _HOLDERS.extend(processes)
    return processes


CHURNERS = 3  # Perl processes in a churn
UNKNOWN_THREAD = 1094  # MariaDB's error: KILL of a connection that has ended
CHURN_HOLDS = 3  # holds each churning process completes before and after what a test does


def wait_for_churn(
    state: Path, after: float | None = None, timeout: float = 120, refused: str | None = None
) -> None:
    """Until every churning Perl process has released ``CHURN_HOLDS`` locks (since the
    monotonic moment ``after``): they are all taking and releasing locks then, whatever time
    their start took on a loaded machine. A process that reports an error (but one that
    says ``refused``) or ends fails it."""
    log = state / "log"
    deadline = time.monotonic() + timeout
    while True:
        lines = log.read_text().splitlines() if log.exists() else []
        assert not churn_errors(lines, refused), lines
        released = Counter(
            line.split()[4]
            for line in lines
            if line.startswith("release ") and (after is None or float(line.split()[3]) > after)
        )
        if len(released) == CHURNERS and min(released.values()) >= CHURN_HOLDS:
            return
        assert time.monotonic() < deadline, f"the churn stood still: {released}"
        time.sleep(0.05)


def churn_errors(lines: list[str], refused: str | None = None) -> list[str]:
    """The errors a churn's log reports, but those that say ``refused``."""
    errors = [line for line in lines if line.startswith("error ")]
    return [line for line in errors if refused is None or refused not in line]


def check_churn(
    processes: list[subprocess.Popen[str]], state: Path, refused: str | None = None
) -> dict[str, int]:
    """Every Perl process ended well, no lockstring ever had two holders (its logged holds
    never overlap, its counter lost no update), Perl never met a missing table, nor any error
    but one that says ``refused``. Returns how many times each lockstring was held."""
    (state / "stop").touch()
    for process in processes:
        out, err = process.communicate(timeout=120)
        assert process.returncode == 0, err
        assert out.startswith("acquired "), out
    lines = (state / "log").read_text().splitlines()
    errors = [line for line in lines if line.startswith("error ")]
    assert not [e for e in errors if any(m in e for m in MISSING_TABLE)], errors
    assert churn_errors(lines, refused) == []
    holds: dict[str, list[tuple[float, float, int]]] = {name: [] for name in CHURN_LOCKSTRINGS}
    open_holds: dict[tuple[str, str], float] = {}
    for line in lines:
        if line.startswith("error "):
            continue  # refused
        kind, name, lock_id, moment, _pid = line.split()
        if kind == "acquire":
            open_holds[(name, lock_id)] = float(moment)
        else:
            holds[name].append((open_holds.pop((name, lock_id)), float(moment), int(lock_id)))
    assert open_holds == {}
    for name, intervals in holds.items():
        intervals.sort()
        for (_, end, lock_id), (next_start, _, next_id) in itertools.pairwise(intervals):
            assert end < next_start, f"{name}: ids {lock_id} and {next_id} held at once"
        assert int((state / f"{name}.count").read_text()) == len(intervals)
    return {name: len(intervals) for name, intervals in holds.items()}


def test_adoption_while_perl_locks_and_unlocks_never_hands_a_lock_twice(
    url: str, table_name: str, db: sa.Engine, tmp_path: Path
) -> None:
    """Three Perl processes keep taking and releasing three lockstrings while the table is
    adopted: each lock has one holder at a time, before, during and after, and no Perl process
    ever finds the table missing (MySQL renamed it aside and made an empty one live)."""
    create_dbix_table(url, table_name)
    # Rows the adoption must carry over: one held by a Perl process throughout.
    held, churn, state = perl_at_work(url, table_name, tmp_path)
    began = time.monotonic()  # CLOCK_MONOTONIC, as Perl's log
    code, output = sqllocker_cli(
        url, table_name, "migrate", "--adopt-dbix-locker", "--perl-tz", "UTC"
    )
    ended = time.monotonic()
    assert code == 0, output
    wait_for_churn(state, after=ended)
    counts = check_churn(churn, state)
    assert all(count > 0 for count in counts.values()), counts
    moments = [float(line.split()[3]) for line in (state / "log").read_text().splitlines()]
    # Perl kept locking on both sides of the adoption.
    assert min(moments) < began
    assert max(moments) > ended
    locker = Locker(url, table=table_name)
    try:
        with pytest.raises(LockBusy):
            locker.lock("held throughout")
        assert held.tell("unlock") == "unlocked"
        locker.lock("held throughout").unlock()
        for name in CHURN_LOCKSTRINGS:
            locker.lock(name).unlock()
    finally:
        locker.close()
    assert not sa.inspect(db).has_table(f"{table_name}_dbix_locker")


def test_adopting_an_adopted_table_refuses_and_changes_nothing(
    url: str, table_name: str, db: sa.Engine
) -> None:
    """The refusal comes before anything is renamed or written: the table stays live, its
    lock held, every lock operation works (MySQL renamed it aside first, and every lock
    operation then failed "table does not exist")."""
    upgrade(db, table_name)
    locker = Locker(url, table=table_name)
    try:
        held = locker.lock("held", expires=600)
        code, output = sqllocker_cli(
            url, table_name, "migrate", "--adopt-dbix-locker", "--perl-tz", "UTC"
        )
        assert code == 2, output
        assert "sqllocker's already" in output
        assert len(output.strip().splitlines()) == 1
        assert not sa.inspect(db).has_table(f"{table_name}_dbix_locker")
        with pytest.raises(LockBusy):
            locker.lock("held")
        locker.lock("another").unlock()
        held.unlock()
    finally:
        locker.close()
    code, output = sqllocker_cli(url, table_name, "migrate", "--check")
    assert code == 0, output


def test_adopting_an_empty_never_used_table(
    url: str, backend: str, table_name: str, db: sa.Engine
) -> None:
    """A DBIx::Locker table that never held a row adopts like any other (PostgreSQL refused:
    setval of 0 on its never-used sequence)."""
    create_dbix_table(url, table_name)
    code, output = sqllocker_cli(
        url, table_name, "migrate", "--adopt-dbix-locker", "--perl-tz", "UTC"
    )
    assert code == 0, output
    assert f"adopted {table_name} with its 0 rows" in output
    locker = Locker(url, table=table_name)
    try:
        lock = locker.lock("first")
        assert lock.lock_id >= (ADOPTED_ID_GAP if backend == "sqlite" else 1)
        lock.unlock()
    finally:
        locker.close()
    fresh = PerlHolder(url, table_name, "perl", 60, "UTC")
    assert fresh.lock_id is not None, fresh.answer
    assert fresh.tell("unlock") == "unlocked"


# -- time zones: Perl's zone against the database session's ---------------------------------------

# (Perl's TZ, the database session's zone): the worst pairs there are, both ways, and the one an
# operator met (a server in Tokyo, Perl in Los Angeles).
ZONE_PAIRS = [
    ("America/Los_Angeles", "Asia/Tokyo"),
    ("Etc/GMT+12", "Etc/GMT-14"),
    ("Etc/GMT-14", "Etc/GMT+12"),
    ("UTC", "Etc/GMT-14"),
    ("Etc/GMT+12", "UTC"),
]


@pytest.fixture
def session_zone_for_perl(url: str, backend: str) -> Iterator[object]:
    """Sets the zone the Perl processes' database sessions read times in: PostgreSQL, the test
    database's own TimeZone (ALTER DATABASE, this run's database only, undone afterwards);
    MySQL, the session's time_zone by the DSN's init command (which leaves DATETIME alone);
    SQLite has no such thing."""
    applied: list[str] = []

    def apply(zone: str) -> str:
        if backend == "postgresql":
            engine = sa.create_engine(resolve_url(url), isolation_level="AUTOCOMMIT")
            with engine.connect() as conn:
                name = conn.exec_driver_sql("SELECT current_database()").scalar()
                conn.exec_driver_sql(f"ALTER DATABASE {name} SET timezone = '{zone}'")
            engine.dispose()
            applied.append(str(name))
            return ""
        if backend == "mysql":
            offset = datetime.now(ZoneInfo(zone)).utcoffset() or timedelta()
            # MariaDB takes offsets from -12:59 to +13:00 only.
            minutes = min(int(offset.total_seconds()) // 60, 13 * 60)
            sign = "-" if minutes < 0 else "+"
            # A DSN cannot hold a colon: CHAR(58) is one.
            hours, rest = f"{sign}{abs(minutes) // 60:02d}", f"{abs(minutes) % 60:02d}"
            return f";mysql_init_command=SET time_zone=CONCAT('{hours}',CHAR(58),'{rest}')"
        return ""

    yield apply
    for name in applied:
        engine = sa.create_engine(resolve_url(url), isolation_level="AUTOCOMMIT")
        with engine.connect() as conn:
            conn.exec_driver_sql(f"ALTER DATABASE {name} RESET timezone")
        engine.dispose()


@pytest.mark.parametrize(("perl_zone", "session_zone"), ZONE_PAIRS)
@pytest.mark.parametrize("made_by", ["adoption", "migration"])
def test_a_perl_lock_is_never_taken_over_early_whatever_the_zones(
    url: str,
    table_name: str,
    db: sa.Engine,
    session_zone_for_perl: Any,
    perl_zone: str,
    session_zone: str,
    made_by: str,
) -> None:
    """A Perl process in ``perl_zone`` locks for an hour through a session whose zone is
    ``session_zone``: sqllocker neither takes the lock over nor purges it. On PostgreSQL the
    session read Perl's offset-less local time in its own zone, up to 26 hours early, past the
    14-hour margin (Tokyo's session and Los Angeles' Perl: taken over with an hour left)."""
    if made_by == "adoption":
        # What `sqllocker migrate --adopt-dbix-locker --perl-tz ZONE` runs (the command's own
        # tests are above), without a second's start of the console script for each case.
        create_dbix_table(url, table_name)
        adopter = Locker(url, table=table_name, auto_create=False)
        try:
            adopt_dbix_locker(adopter.engine, table_name, ZoneInfo(perl_zone))
        finally:
            adopter.close()
    else:
        upgrade(db, table_name)
    dsn_suffix = session_zone_for_perl(session_zone)
    source, user = dbi_source(url)
    command = ["perl", str(HERE / "dbix_locker.pl"), source + dsn_suffix, user, table_name]
    perl = subprocess.Popen(
        [*command, "hold", "nightly report", "3600"],
        env=perl_environment(perl_zone),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    _HOLDERS.append(perl)
    assert perl.stdout is not None
    assert perl.stdin is not None
    answer = perl.stdout.readline().strip()
    assert answer.startswith("locked "), answer
    locker = Locker(url, table=table_name, grace=0)
    margin = timedelta(seconds=FOREIGN_CLOCK_MARGIN)
    # A Perl lock pushed on by exactly the session's offset east of UTC: its new local text
    # reads, in the session's zone, as the instant the old text was made (as UTC) by 0002.
    session_offset = datetime.now(ZoneInfo(session_zone)).utcoffset() or timedelta()
    pushes = [session_offset] if session_offset > timedelta() else []
    try:
        for step, left in [
            ("", timedelta(hours=1)),
            # DBIx::Locker's expires setter writes the same local text by an UPDATE.
            ("extend 7200", timedelta(hours=2)),
            *[(f"push {int(p.total_seconds())}", timedelta(hours=2) + p) for p in pushes],
        ]:
            if step:
                perl.stdin.write(step + "\n")
                perl.stdin.flush()
                assert perl.stdout.readline().strip() == "extended"
            with pytest.raises(LockBusy):
                locker.lock("nightly report")
            assert locker.purge_expired_locks() == 0
            info = locker.lock_info("nightly report")
            assert info is not None
            assert info.dbix_locker
            # As the table reads it, within Perl's own offset of the truth (never more than
            # the margin early).
            assert info.expires > server_now(db) + left - margin
    finally:
        locker.close()
    perl.stdin.write("unlock\n")
    perl.stdin.flush()
    assert perl.stdout.readline().strip() == "unlocked"
    perl.wait(timeout=30)


# -- advice that works: every command the errors and the migration page suggest is run ----------

MIGRATING_PAGE = HERE.parent / "docs" / "migrating-from-dbix-locker.md"


def page_commands(page: str) -> list[str]:
    """The sqllocker commands in the page's ```sh blocks, in order, continuation lines joined."""
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", page, re.DOTALL):
        joined = re.sub(r"\\\n\s*", " ", block)
        commands += [line.strip() for line in joined.splitlines() if line.strip()]
    assert all(command.startswith("sqllocker ") for command in commands), commands
    return commands


def message_commands(message: str) -> list[str]:
    """The sqllocker commands an error message gives in backticks, each on one line."""
    return [" ".join(found.split()) for found in re.findall(r"`(sqllocker [^`]+)`", message)]


def run_suggested(
    command: str, url: str, table: str, tmp_path: Path, lockstring: str = "crashed job"
) -> subprocess.CompletedProcess[str]:
    """``command`` as a user would type it, its placeholders filled in: URL, ZONE, LOCKSTRING,
    and the page's table name."""
    values = {
        "URL": url,
        "ZONE": "America/New_York",
        "LOCKSTRING": lockstring,
        "semaphores": table,
    }
    program, *words = shlex.split(command)
    assert program == "sqllocker"
    return forked_cli.run(
        [values.get(word, word) for word in words],
        cwd=tmp_path,
        env={key: value for key, value in os.environ.items() if not key.startswith("SQLLOCKER")},
    )


def test_every_command_of_the_migration_page_runs(
    url: str, table_name: str, db: sa.Engine, tmp_path: Path
) -> None:
    """In the page's order, on a DBIx::Locker table holding a crashed Perl job's lock: each
    exits 0 (they put the group's options after `migrate`: a usage error)."""
    create_dbix_table(url, table_name)
    perl_leaves_lock(url, table_name, "crashed job", 3600, "America/New_York")
    commands = page_commands(MIGRATING_PAGE.read_text())
    assert any("--adopt-dbix-locker" in command for command in commands)
    for command in commands:
        result = run_suggested(command, url, table_name, tmp_path)
        assert result.returncode == 0, (command, result.stdout + result.stderr)
    assert current_revision(db, table_name) == head_revision()
    assert row_count(db, table_name) == 0  # the crashed job's lock broken by the last one


def test_the_commands_that_refusals_give_run(
    url: str, table_name: str, db: sa.Engine, tmp_path: Path
) -> None:
    """A DBIx::Locker table's refusals, by a Locker, by `migrate` and by `migrate --check`
    (which said "run `sqllocker migrate`", which refuses it), all give the adopt command,
    which runs; a missing table's gives the command that creates it, which runs."""
    create_dbix_table(url, table_name)
    perl_leaves_lock(url, table_name, "crashed job", 3600, "UTC")
    locker = Locker(url, table=table_name)
    try:
        with pytest.raises(ForeignTable) as refused:
            locker.lock("job")
    finally:
        locker.close()
    messages = [str(refused.value)]
    for args in (["migrate"], ["migrate", "--check"]):
        code, output = sqllocker_cli(url, table_name, *args)
        assert code == 2, output
        messages.append(output)
    suggested = [message_commands(message) for message in messages]
    assert all(len(commands) == 1 for commands in suggested), messages
    assert len({commands[0] for commands in suggested}) == 1, suggested
    command = suggested[0][0]
    assert "--adopt-dbix-locker" in command
    result = run_suggested(command, url, table_name, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    code, output = sqllocker_cli(url, table_name, "migrate", "--check")
    assert code == 0, output

    missing = f"{table_name}_m"
    locker = Locker(url, table=missing, auto_create=False)
    try:
        with pytest.raises(TableMissing) as caught:
            locker.lock("job")
        (command,) = message_commands(str(caught.value))
        result = run_suggested(command, url, table_name, tmp_path)
        assert result.returncode == 0, result.stdout + result.stderr
        locker.lock("job").unlock()
    finally:
        locker.close()
        with db.begin() as conn:
            if db.dialect.name == "postgresql":
                conn.exec_driver_sql(f"DROP TABLE IF EXISTS {missing} CASCADE")
                conn.exec_driver_sql(f"DROP TABLE IF EXISTS {missing}_requests")
                for name in POSTGRESQL_FUNCTIONS:
                    conn.exec_driver_sql(f"DROP FUNCTION IF EXISTS {missing}_{name} CASCADE")
            else:
                conn.exec_driver_sql(f"DROP VIEW IF EXISTS {missing}_held")
            for name in (missing, f"{missing}_id_order", f"{missing}_requests"):
                conn.exec_driver_sql(f"DROP TABLE IF EXISTS {name}")
            conn.exec_driver_sql(f"DROP TABLE IF EXISTS {version_table_for(missing)}")


# -- adoptions that stop half-way --------------------------------------------------------------


def dbix_rows(db: sa.Engine, table: str) -> list[tuple[object, ...]]:
    with db.connect() as conn:
        return [
            tuple(row)
            for row in conn.exec_driver_sql(
                f"SELECT id, lockstring, expires FROM {table} ORDER BY id"
            )
        ]


def test_a_failed_adoption_leaves_the_table_untouched_and_nothing_beside_it(
    url: str, table_name: str, db: sa.Engine
) -> None:
    """A row the new table cannot take (DBIx::Locker's lockstring column allows NULL, the new
    one does not) fails the adoption; on MySQL, where it fails while copying under the table
    locks, the old table is as it was, and what the adoption made beside it is gone again."""
    create_dbix_table(url, table_name)
    perl_leaves_lock(url, table_name, "crashed job", 3600, "UTC")
    with db.begin() as conn:
        conn.exec_driver_sql(
            f"INSERT INTO {table_name} (lockstring, created, expires, locked_by) "
            "VALUES (NULL, '2030-01-01 00:00:00', '2030-01-01 01:00:00', '{}')"
        )
    before = dbix_rows(db, table_name)
    tables_before = set(sa.inspect(db).get_table_names()) | set(sa.inspect(db).get_view_names())
    code, output = sqllocker_cli(
        url, table_name, "migrate", "--adopt-dbix-locker", "--perl-tz", "UTC"
    )
    assert code == 2, output
    assert len(output.strip().splitlines()) == 1, output
    assert dbix_rows(db, table_name) == before
    inspector = sa.inspect(db)
    assert set(inspector.get_table_names()) | set(inspector.get_view_names()) == tables_before
    assert "guid" not in {column["name"] for column in inspector.get_columns(table_name)}
    # Perl still locks through it.
    perl = PerlHolder(url, table_name, "another job", 60, "UTC")
    assert perl.lock_id is not None, perl.answer
    assert perl.tell("unlock") == "unlocked"
    # Once the row is fixed, the adoption runs.
    with db.begin() as conn:
        conn.exec_driver_sql(f"DELETE FROM {table_name} WHERE lockstring IS NULL")
    code, output = sqllocker_cli(
        url, table_name, "migrate", "--adopt-dbix-locker", "--perl-tz", "UTC"
    )
    assert code == 0, output


def test_a_name_the_adoption_needs_in_use_is_refused_before_anything_is_written(
    url: str, backend: str, table_name: str, db: sa.Engine, tmp_path: Path
) -> None:
    """A table left where the adoption builds its own (an adoption that was killed) is named,
    nothing is written, and the advice (drop it and adopt again) works."""
    create_dbix_table(url, table_name)
    perl_leaves_lock(url, table_name, "crashed job", 3600, "UTC")
    in_the_way = f"{table_name}_sqllocker_new" if backend == "mysql" else f"{table_name}_held"
    with db.begin() as conn:
        conn.exec_driver_sql(f"CREATE TABLE {in_the_way} (x integer)")
    before = dbix_rows(db, table_name)
    code, output = sqllocker_cli(
        url, table_name, "migrate", "--adopt-dbix-locker", "--perl-tz", "UTC"
    )
    assert code == 2, output
    assert f"{in_the_way!r} exists already" in output
    assert "drop it and adopt again" in output
    assert dbix_rows(db, table_name) == before
    assert not sa.inspect(db).has_table(version_table_for(table_name))
    with db.begin() as conn:
        conn.exec_driver_sql(f"DROP TABLE {in_the_way}")
    code, output = sqllocker_cli(
        url, table_name, "migrate", "--adopt-dbix-locker", "--perl-tz", "UTC"
    )
    assert code == 0, output


@pytest.mark.parametrize("backend", ["mysql"])
@pytest.mark.parametrize("exact", [False, True], ids=["folding", "exact"])
def test_an_adoption_stopped_after_its_swap_is_finished_by_the_adopt_command(
    url: str, table_name: str, db: sa.Engine, tmp_path: Path, exact: bool
) -> None:
    """Killed between the swap and the record of its revision, a MySQL adoption leaves the new
    table complete, unrecorded, and the old one aside. Every refusal then names the adopt
    command (not `migrate`, whose CREATE TABLE would fail), which finishes it."""
    create_dbix_table(url, table_name)
    perl = PerlHolder(url, table_name, "nightly report", 3600, "UTC")
    assert perl.lock_id is not None, perl.answer
    options = ["--exact-lockstrings"] if exact else []
    code, output = sqllocker_cli(
        url, table_name, "migrate", "--adopt-dbix-locker", "--perl-tz", "UTC", *options
    )
    assert code == 0, output
    # As the kill leaves it: no revision recorded, the old table still aside.
    with db.begin() as conn:
        conn.exec_driver_sql(f"DELETE FROM {version_table_for(table_name)}")
        conn.exec_driver_sql(f"CREATE TABLE {table_name}_dbix_locker (id bigint)")
    for args in (["migrate"], ["migrate", "--check"]):
        code, output = sqllocker_cli(url, table_name, *args)
        assert code == 2, output
        (command,) = message_commands(output)
        assert "--adopt-dbix-locker" in command
    result = run_suggested(command, url, table_name, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert current_revision(db, table_name) == head_revision()
    assert not sa.inspect(db).has_table(f"{table_name}_dbix_locker")
    locker = Locker(url, table=table_name)
    try:
        with pytest.raises(LockBusy):
            locker.lock("nightly report")
    finally:
        locker.close()
    assert perl.tell("unlock") == "unlocked"


# When the adoption is killed: once a name it makes appears (MySQL: the table it builds, then
# the old one set aside by the swap), or once a statement of it runs (the RENAME that waits for
# the table locks); elsewhere once its transaction has the old table locked.
KILL_MOMENTS = {
    "mysql": {
        "building": "SELECT 1 FROM information_schema.tables WHERE table_schema = DATABASE() "
        "AND table_name = '{table}_sqllocker_new'",
        "renaming": "SELECT 1 FROM information_schema.processlist WHERE info LIKE "
        "'RENAME TABLE {table} %%'",
        "swapped": "SELECT 1 FROM information_schema.tables WHERE table_schema = DATABASE() "
        "AND table_name = '{table}_dbix_locker'",
    },
    "postgresql": {
        "locked": "SELECT 1 FROM pg_locks WHERE relation = to_regclass('{table}') "
        "AND mode = 'AccessExclusiveLock' AND granted",
    },
}


def kill_moments() -> list[tuple[str, str]]:
    moments = [(backend, moment) for backend, named in KILL_MOMENTS.items() for moment in named]
    return [*moments, ("sqlite", "started")]


@pytest.mark.parametrize(("backend", "moment"), kill_moments())
def test_an_adoption_killed_at_any_moment_hands_no_lock_twice_and_can_be_finished(
    url: str, backend: str, table_name: str, db: sa.Engine, tmp_path: Path, moment: str
) -> None:
    """The adoption is SIGKILLed at ``moment`` while Perl keeps locking: no lockstring ever has
    two holders, Perl never finds the table missing, and following the refusals' advice (drop
    what is named, adopt again) ends in an adopted table holding the Perl lock held
    throughout."""
    create_dbix_table(url, table_name)
    held, churn, state = perl_at_work(url, table_name, tmp_path)
    adopt = ["migrate", "--adopt-dbix-locker", "--perl-tz", "UTC"]
    adoption = subprocess.Popen(
        [SQLLOCKER, "--url", url, "--table", table_name, *adopt],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    probe = KILL_MOMENTS.get(backend, {}).get(moment)
    if probe is None:
        time.sleep(0.5)
    else:
        watcher = sa.create_engine(resolve_url(url), isolation_level="AUTOCOMMIT")
        with watcher.connect() as conn:
            query = probe.format(table=table_name)
            while adoption.poll() is None and conn.exec_driver_sql(query).first() is None:
                pass
        watcher.dispose()
    adoption.kill()
    adoption.communicate(timeout=60)
    print(f"killed at {moment}:", adoption.returncode, sorted(sa.inspect(db).get_table_names()))
    adopt_as_the_refusals_say(url, table_name, db)
    wait_for_churn(state, after=time.monotonic())
    check_churn(churn, state)
    held_throughout(url, table_name, db, held)


def perl_at_work(
    url: str, table_name: str, tmp_path: Path
) -> tuple[PerlHolder, list[subprocess.Popen[str]], Path]:
    """A Perl lock "held throughout", and a churn of Perl processes under way (its state)."""
    held = PerlHolder(url, table_name, "held throughout", 3600, "UTC")
    assert held.lock_id is not None, held.answer
    state = tmp_path / "state"
    state.mkdir()
    churn = start_churn(url, table_name, state, seconds=120)
    wait_for_churn(state)
    return held, churn, state


def adopt_as_the_refusals_say(url: str, table_name: str, db: sa.Engine) -> None:
    """Adopt ``table_name`` until it is adopted, dropping each table or view a refusal names
    as in the way (left by an adoption that was stopped)."""
    adopt = ["migrate", "--adopt-dbix-locker", "--perl-tz", "UTC"]
    for _ in range(10):
        code, output = sqllocker_cli(url, table_name, *adopt)
        if code == 0 or "sqllocker's already" in output:
            return
        in_the_way = re.search(r"'(\w+)' exists already", output)
        assert in_the_way is not None, output
        name = in_the_way.group(1)
        kind = "VIEW" if name in sa.inspect(db).get_view_names() else "TABLE"
        with db.begin() as conn:
            conn.exec_driver_sql(f"DROP {kind} {name}")
    pytest.fail(f"never adopted: {output}")


def held_throughout(url: str, table_name: str, db: sa.Engine, held: PerlHolder) -> None:
    """The table adopted, at the head revision, and ``held``'s Perl lock still its own."""
    assert current_revision(db, table_name) == head_revision()
    locker = Locker(url, table=table_name)
    try:
        with pytest.raises(LockBusy):
            locker.lock("held throughout")
    finally:
        locker.close()
    assert held.tell("unlock") == "unlocked"


# Tries of a scenario whose kill must come within a moment a loaded machine's watcher can miss.
KILL_TRIES = 3


@pytest.mark.parametrize("backend", ["mysql"])
def test_an_adoption_whose_connection_ends_as_it_swaps_hands_no_lock_twice(
    url: str, table_name: str, db: sa.Engine, tmp_path: Path
) -> None:
    """The adoption's connection is killed (a DBA's KILL, a proxy's failover) once the rows
    are copied, as its RENAME's connection opens: its table locks go with it before the
    RENAME waits for them. Perl's statements that waited wrote to the old table, which the
    RENAME then set aside: a Perl lock held there, its lockstring free in the new table, and
    taken by another, and a Perl release that reached it left the copied row
    standing. The old table now refuses new locks from the copy on (Perl is told to try
    again), and makes a release in the new table too, so no lockstring ever has two holders,
    and adopting again finishes the adoption (or starts it again) with the Perl lock held
    throughout. A try whose watcher comes too late (the adoption ended unkilled) is checked
    all the same, and the scenario tried again on a table of its own."""
    for attempt in range(KILL_TRIES):
        table = f"{table_name}_{attempt}"
        if _adoption_killed_as_it_swaps(url, table, db, tmp_path / str(attempt)):
            return
    pytest.fail(f"the adoption's connection was never killed in {KILL_TRIES} tries")


def _adoption_killed_as_it_swaps(url: str, table_name: str, db: sa.Engine, tmp_path: Path) -> bool:
    """One try of the scenario above, checked whether or not the kill came in time: whether
    it did."""
    tmp_path.mkdir()
    create_dbix_table(url, table_name)
    with db.begin() as conn:  # expired rows, never purged: the copy takes a moment
        conn.execute(
            sa.text(
                f"INSERT INTO {table_name} (lockstring, created, expires, locked_by) "
                "VALUES (:ls, '2020-01-01', '2020-01-01 01:00:00', '{}')"
            ),
            [{"ls": f"old {n}"} for n in range(20000)],
        )
    held, churn, state = perl_at_work(url, table_name, tmp_path)
    adopt = ["migrate", "--adopt-dbix-locker", "--perl-tz", "UTC"]
    watcher = sa.create_engine(resolve_url(url), isolation_level="AUTOCOMMIT")
    with watcher.connect() as conn:
        me = conn.exec_driver_sql("SELECT CONNECTION_ID()").scalar()
        before = set(conn.exec_driver_sql("SELECT id FROM information_schema.processlist"))
        adoption = subprocess.Popen(
            [SQLLOCKER, "--url", url, "--table", table_name, *adopt],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        main, copied, killed, late = None, False, False, False
        while adoption.poll() is None and not killed and not late:
            if main is None:  # the adoption's connection holds the migrations' lock
                main = conn.exec_driver_sql("SELECT IS_USED_LOCK('sqllocker_migrate')").scalar()
                continue
            # Copied: its counter set (a moment's statement, missed by a watcher slowed by a
            # loaded machine), or the old table closed behind it (until the swap).
            copied = copied or bool(
                conn.exec_driver_sql(
                    "SELECT COUNT(*) FROM information_schema.triggers "
                    "WHERE trigger_schema = DATABASE() AND trigger_name = %s",
                    (f"{table_name}_sqllocker_closed_insert",),
                ).scalar()
            )
            sessions = conn.exec_driver_sql("SELECT id, info FROM information_schema.processlist")
            for session, info in sessions.all():
                if session == main and str(info).startswith(f"ALTER TABLE {table_name}_sql"):
                    copied = True
                elif copied and (session,) not in before and session not in (main, me):
                    try:
                        conn.exec_driver_sql(f"KILL CONNECTION {int(main)}")  # the RENAME's opens
                    except sa.exc.OperationalError as error:
                        if error.orig.args[0] != UNKNOWN_THREAD:
                            raise
                        late = True  # the adoption's connection had ended: done unkilled
                    else:
                        killed = True
                    break
    watcher.dispose()
    output = adoption.communicate(timeout=120)[0]
    if killed:
        assert adoption.returncode != 0, output
        # Said as it is: the swap made or not (it had said "Can't reconnect until invalid
        # transaction is rolled back", SQLAlchemy's words as the migrations' lock was released).
        assert "took its place" in output or "is untouched" in output, output
        adopt_as_the_refusals_say(url, table_name, db)
    else:
        assert adoption.returncode == 0, output
    refused = "being adopted by sqllocker"
    wait_for_churn(state, after=time.monotonic(), refused=refused)
    check_churn(churn, state, refused=refused)
    held_throughout(url, table_name, db, held)
    return killed


@pytest.mark.parametrize("backend", ["sqlite"])
def test_sqlite_adoption_starts_above_the_ids_an_autoincrement_table_recorded(
    url: str, table_name: str, db: sa.Engine
) -> None:
    """A DBIx::Locker table made by hand with AUTOINCREMENT recorded the highest id it handed
    out (here 5,000,000, its rows since deleted by the Perl purge): a stale Perl holder may
    carry it, so new ids start above it, not above the rows left."""
    with db.begin() as conn:
        conn.exec_driver_sql(
            f"CREATE TABLE {table_name} (id INTEGER PRIMARY KEY AUTOINCREMENT, "
            "lockstring varchar(128) UNIQUE, created datetime NOT NULL, "
            "expires datetime NOT NULL, locked_by text NOT NULL)"
        )
        conn.exec_driver_sql(
            f"INSERT INTO {table_name} (lockstring, created, expires, locked_by) "
            "VALUES ('old', '2026-01-01 00:00:00', '2026-01-01 01:00:00', '{}')"
        )
        conn.exec_driver_sql(
            "UPDATE sqlite_sequence SET seq = 5000000 WHERE name = ?", (table_name,)
        )
    code, output = sqllocker_cli(
        url, table_name, "migrate", "--adopt-dbix-locker", "--perl-tz", "UTC"
    )
    assert code == 0, output
    locker = Locker(url, table=table_name)
    try:
        with locker.lock("first") as lock:
            assert lock.lock_id > 5_000_000 + ADOPTED_ID_GAP
    finally:
        locker.close()


@pytest.mark.parametrize("backend", ["mysql"])
def test_a_table_of_the_longest_name_is_adopted(url: str, db: sa.Engine) -> None:
    """MySQL builds the new table under a longer name (``<table>_sqllocker_new``), which the
    adoption refused as a table name past 18 characters, though names run to 32."""
    table = "t" + "x" * 31
    create_dbix_table(url, table)
    held = PerlHolder(url, table, "held throughout", 3600, "UTC")
    assert held.lock_id is not None, held.answer
    code, output = sqllocker_cli(url, table, "migrate", "--adopt-dbix-locker", "--perl-tz", "UTC")
    assert code == 0, output
    held_throughout(url, table, db, held)
