"""Every database difference has one home: ``sqllocker/backends/``, a module per database."""

from __future__ import annotations

import asyncio
import logging
import re
import time
import warnings
from pathlib import Path

import pytest
import sqlalchemy as sa

from sqllocker import LockBusy, Locker, LockValueError
from sqllocker.asyncio import AsyncLocker
from sqllocker.backends import Backend, backend_class
from sqllocker.engine import resolve_url
from sqllocker.migrations import downgrade, schema_differences, upgrade_sql
from tests.helpers import abandon, apply_sql

PACKAGE = Path(__file__).resolve().parents[1] / "sqllocker"
# Asking which database this is: a dialect's or backend's name compared, or a database's name
# written as a string to compare with.
BRANCH = re.compile(
    r"(dialect|backend)\.name\s*(==|!=|\bin\b)"
    r"|get_backend_name\(\)\s*(==|!=|\bin\b)"
    r"|(==|!=)\s*[\"'](sqlite|postgres|postgresql|mysql|mariadb)[\"']"
    r"|\bin\s*[\[({][^\]})]*[\"'](sqlite|postgres|postgresql|mysql|mariadb)[\"']"
)


def test_no_code_outside_the_backends_package_branches_on_a_database() -> None:
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if "backends" not in path.relative_to(PACKAGE).parts
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if BRANCH.search(line)
    ]
    assert offenders == []


def test_the_check_finds_a_branch() -> None:
    assert BRANCH.search('if engine.dialect.name == "sqlite":')
    assert BRANCH.search('elif backend in {"mysql", "mariadb"}:')
    assert not BRANCH.search("backend_class(engine.dialect.name).begin")


@pytest.mark.parametrize("name", ["sqlite", "postgresql", "postgres", "mysql", "mariadb"])
def test_every_database_answers_everything(name: str) -> None:
    """A module that left a method to the base class's NotImplementedError would fail only on
    its database, at run time."""
    cls = backend_class(name)
    required = {
        attribute for attribute, value in vars(Backend).items() if _raises_not_implemented(value)
    }
    assert {"now", "acquire", "read_settings", "migration_connection"} <= required
    tickets = {"acquire_unless_queued", "join_line", "leave_line", "sweep_requests"}
    # only where atomic_takeover / tickets / adoption_swaps (or not)
    adoption = {"swap_in", "adoption_before_create"}
    optional = {"take_over", *tickets, *adoption}
    missing = {attribute for attribute in required - optional if attribute not in _defined(cls)}
    assert missing == set()
    assert adoption <= required
    adopts_by = "swap_in" if cls.adoption_swaps else "adoption_before_create"
    assert adopts_by in _defined(cls)
    if cls.atomic_takeover:
        assert "take_over" in _defined(cls)
    if "takes_tickets" in _defined(cls):
        assert tickets <= _defined(cls)


def test_an_unknown_database_is_refused_by_name() -> None:
    with pytest.raises(LockValueError, match="not 'oracle'"):
        backend_class("oracle")
    assert backend_class(sa.create_engine("sqlite://").dialect.name).name == "sqlite"


def _defined(cls: type) -> set[str]:
    return {name for klass in cls.__mro__ if klass is not Backend for name in vars(klass)}


def _raises_not_implemented(function: object) -> bool:
    code = getattr(getattr(function, "__func__", function), "__code__", None)
    return code is not None and "NotImplementedError" in code.co_names


@pytest.mark.parametrize(
    ("written", "hosts", "query"),
    [
        ("postgresql://app@h1:5432,h2:5433/locks", ("h1:5432", "h2:5433"), {}),
        ("postgres://app:pw@h1,h2/locks?sslmode=require", ("h1", "h2"), {"sslmode": "require"}),
        ("postgresql+psycopg://app@[::1]:5432,h2:5432/locks", ("[::1]:5432", "h2:5432"), {}),
    ],
)
def test_a_url_naming_several_postgresql_hosts_is_understood(
    written: str, hosts: tuple[str, ...], query: dict[str, str]
) -> None:
    """libpq's own form, which SQLAlchemy's URL parser does not take."""
    url = resolve_url(written)
    assert url.query["host"] == hosts
    assert url.database == "locks"
    assert {key: value for key, value in url.query.items() if key != "host"} == query
    assert url.username == "app"


def test_a_mariadb_url_is_mariadb_from_the_printed_sql_to_the_lock(
    mysql_url: str, table_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``mariadb://`` keeps SQLAlchemy's MariaDB dialect: ``migrate --sql`` prints MariaDB's
    DDL without a server to ask (it printed MySQL 8's collation, which MariaDB lacks), which
    applies; and on that dialect the lock table's options are used without a warning, a purge
    deletes in batches (its LIMIT was left out) and a lock is taken, waited for and released,
    sync and asyncio. (Migrations on ``mariadb+pymysql://`` raised KeyError.)"""
    url = sa.make_url(mysql_url).set(drivername="mariadb").render_as_string(hide_password=False)
    assert resolve_url(url).drivername == "mariadb+pymysql"
    script = upgrade_sql(resolve_url(url), table_name)
    assert "utf8mb4_nopad_bin" in script
    assert "0900" not in script
    apply_sql(url, script)
    with warnings.catch_warnings():
        warnings.simplefilter("error", sa.exc.SADeprecationWarning)
        locker = Locker(url, table=table_name, auto_create=False, grace=0)
        try:
            assert schema_differences(locker.engine, table_name) == []
            held = locker.lock("job")
            with pytest.raises(LockBusy):
                locker.lock("job", wait=0.3)  # by a ticket
            held.unlock()
            for n in range(5):
                abandon(locker.lock(f"dead {n}", expires=0.1))
            time.sleep(0.3)
            caplog.set_level(logging.DEBUG, logger="sqllocker.sql")
            caplog.clear()
            assert locker.purge_expired_locks(batch_size=2) == 5
            purge = f"DELETE FROM {table_name} "
            deleted = [r.getMessage() for r in caplog.records if r.getMessage().startswith(purge)]
            assert len(deleted) == 3  # 2 + 2 + 1
            assert all(" LIMIT 2" in sql for sql in deleted)
        finally:
            locker.close()

        async def asynchronously() -> None:
            async_locker = AsyncLocker(url, table=table_name, auto_create=False)
            try:
                assert async_locker.engine.dialect.name == "mariadb"
                await (await async_locker.lock("job")).unlock()
            finally:
                await async_locker.aclose()

        asyncio.run(asynchronously())
    engine = sa.create_engine(resolve_url(url))
    try:
        downgrade(engine, table_name)
    finally:
        engine.dispose()
