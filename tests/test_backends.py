"""Every database difference has one home: ``sqllocker/backends/``, a module per database."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import sqlalchemy as sa

from sqllocker import LockValueError
from sqllocker.backends import Backend, backend_class
from sqllocker.engine import resolve_url

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
