"""The integrations are optional extras: importing sqllocker (its API, its command line, its
asyncio front end) never imports a framework, which need not even be installed; each
integration's module imports its own framework and what that brings along, no other. Nor does
a process import another database's SQLAlchemy dialect than its own, or OpenTelemetry before
anything can have given it a provider: each is a good part of a command's start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from sqllocker import Locker
from tests.helpers import async_url

ROOT = Path(__file__).resolve().parents[1]

# Each integration's module that uses its framework; that framework, and the framework's part
# the module uses (which can bring others along: Celery's Task looks for Django).
FRAMEWORKS = {
    "sqllocker.celery": ("celery", "from celery import Task"),
    "sqllocker.apscheduler": ("apscheduler", "import apscheduler.executors.pool"),
    "sqllocker.django.configuration": ("django", "import django.db"),
}
NAMES = sorted(framework for framework, _ in FRAMEWORKS.values())


def imported_frameworks(*statements: str) -> set[str]:
    program = (
        "import json, sys\n"
        + "".join(f"{statement}\n" for statement in statements)
        + f"print(json.dumps([m for m in {NAMES!r} if m in sys.modules]))\n"
    )
    output = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, check=True
    ).stdout
    return set(json.loads(output))


def test_importing_sqllocker_imports_no_framework() -> None:
    modules = ("sqllocker", "sqllocker.cli", "sqllocker.asyncio", "sqllocker.django")
    assert imported_frameworks(*(f"import {module}" for module in modules)) == set()


@pytest.mark.parametrize("integration", sorted(FRAMEWORKS))
def test_an_integration_imports_its_own_framework_only(integration: str) -> None:
    framework, its_part = FRAMEWORKS[integration]
    pytest.importorskip(framework)
    expected = imported_frameworks(its_part) | {framework}
    assert imported_frameworks(f"import {integration}") == expected


def modules_loaded(program: str, env: dict[str, str] | None = None) -> list[str]:
    """``program``'s run, then the names of every module it has imported."""
    program += "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))\n"
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, check=True, env=env
    )
    return list(json.loads(done.stdout.splitlines()[-1]))


def test_a_lock_on_sqlite_imports_no_other_databases_dialect_nor_opentelemetry(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'locks.db'}"
    Locker(url).lock("made").unlock()  # the table (a migration imports alembic's every dialect)
    program = (
        "import sqllocker.cli\n"
        "from sqllocker import Locker\n"
        f"with Locker({url!r}).lock('job') as lock: lock.extend(60)\n"
    )
    modules = modules_loaded(program)
    assert "sqllocker.backends.sqlite" in modules
    unwanted = (
        "sqlalchemy.dialects.postgresql",
        "sqllocker.backends.postgresql",
        "sqllocker.backends.mysql",
        "sqllocker.backends.pymysql",
        "opentelemetry",
    )
    assert [m for m in modules if m.startswith(unwanted)] == []


def test_a_provider_named_in_the_environment_is_found_without_the_api_imported_first(
    tmp_path: Path,
) -> None:
    """Imported as the Locker is made, not by an acquisition in whatever thread: a fork by
    another thread during the import would leave the child its lock."""
    pytest.importorskip("opentelemetry.sdk")
    url = f"sqlite:///{tmp_path / 'locks.db'}"
    Locker(url).lock("made").unlock()
    program = (
        "import sys\n"
        "from sqllocker import Locker\n"
        "assert 'opentelemetry.trace' not in sys.modules\n"
        f"locker = Locker({url!r})\n"
        "assert 'opentelemetry.trace' in sys.modules, 'not imported by the Locker'\n"
        "locker.lock('job').unlock()\n"
        "from opentelemetry import trace\n"
        "assert type(trace.get_tracer_provider()).__module__ == 'opentelemetry.sdk.trace'\n"
        "assert locker._telemetry._instruments is not None, 'the provider was not found'\n"
    )
    env = {**os.environ, "OTEL_PYTHON_TRACER_PROVIDER": "sdk_tracer_provider"}
    modules_loaded(program, env)


def test_the_suites_fork_servers_import_every_backend_a_lock_or_command_needs(
    url: str, table_name: str, make_locker: Callable[..., Locker]
) -> None:
    """``tests/preloading.py``, which the suite's fork servers and launchers run before they
    fork: a child then imports no backend, dialect or driver of its own for a lock (sync or
    asyncio) or a command (each such import costs a tenth of a second of CPU, and the suite
    forks hundreds of children)."""
    make_locker()  # the table
    program = (
        "import asyncio, json, sys\n"
        "import sqllocker.cli\n"
        "from sqllocker import Locker\n"
        "from sqllocker.asyncio import AsyncLocker\n"
        "from tests import preloading\n"
        "preloading.backends()\n"
        "before = set(sys.modules)\n"
        f"with Locker({url!r}, table={table_name!r}).lock('job') as lock: lock.extend(60)\n"
        "async def cycle():\n"
        f"    locker = AsyncLocker({async_url(url)!r}, table={table_name!r})\n"
        "    async with await locker.lock('job'):\n"
        "        pass\n"
        "    await locker.aclose()\n"
        "asyncio.run(cycle())\n"
        f"try: sqllocker.cli.main(['--url', {url!r}, '--table', {table_name!r}, 'list'])\n"
        "except SystemExit: pass\n"
        "print(json.dumps(sorted(set(sys.modules) - before)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, check=True, cwd=ROOT
    )
    imported = json.loads(done.stdout.splitlines()[-1])
    drivers = ("psycopg", "pymysql", "aiomysql", "aiosqlite", "sqlite3", "asyncpg")
    assert [
        m for m in imported if m.startswith(("sqlalchemy.dialects", "sqllocker.backends", *drivers))
    ] == []
