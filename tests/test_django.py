"""sqllocker.django with a real Django project (tests/django_project) on each backend, each test
in a database of its own: ``manage.py migrate`` makes the lock table sqllocker's migrations make;
``manage.py sqllocker ...`` is the command line on it; two ``manage.py`` processes on one
lockstring run one at a time; ``guard`` on Django's connection commits only while the lock is
held; a view answers 409 while its lock is held."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("django")

import sqlalchemy as sa
from sqlalchemy.engine import make_url

from sqllocker import Locker
from sqllocker.engine import resolve_url
from sqllocker.migrations import current_revision, head_revision, schema_differences
from tests import forked_cli
from tests.conftest import IN_CI, MYSQL_ADMIN_URL, POSTGRES_ADMIN_URL
from tests.helpers import abandon

pytestmark = pytest.mark.slow  # real workers, schedulers or processes

ROOT = Path(__file__).resolve().parent.parent
ADMIN_URLS = {"postgresql": POSTGRES_ADMIN_URL, "mysql": MYSQL_ADMIN_URL}


@pytest.fixture
def database(backend: str, tmp_path: Path) -> Iterator[str]:
    """A database of this test's own (Django's tables are not per test as the lock tables are)."""
    if backend == "sqlite":
        yield f"sqlite:///{tmp_path / 'django.db'}"
        return
    name = f"sqllocker_django_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(resolve_url(ADMIN_URLS[backend]), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f"CREATE DATABASE {name}")
    except sa.exc.OperationalError as error:
        admin.dispose()
        if IN_CI:
            pytest.fail(f"{backend} is unreachable: {error.orig} (CI requires every backend)")
        pytest.skip(f"{backend} is unreachable: {error.orig}")
    try:
        url = make_url(resolve_url(ADMIN_URLS[backend])).set(database=name)
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            force = " WITH (FORCE)" if backend == "postgresql" else ""
            conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {name}{force}")
        admin.dispose()


class Project:
    def __init__(self, url: str, table: str, state: Path) -> None:
        self.url, self.table = url, table
        self.env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "tests.django_project.settings",
            "SQLLOCKER_DJANGO_URL": url,
            "SQLLOCKER_DJANGO_TABLE": table,
            "SQLLOCKER_DJANGO_STATE": str(state),
            "PYTHONPATH": str(ROOT),
        }

    def command(self, *arguments: str) -> list[str]:
        return [sys.executable, "-m", "django", *arguments]

    def manage(self, *arguments: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """``python -m django ARGUMENTS``, forked from a server that imported Django and the
        library once (``tests/forked_cli.py``): what a command does, not how it starts."""
        done = forked_cli.run(list(arguments), env=self.env, cwd=ROOT, program="django")
        if check:
            assert done.returncode == 0, done.stderr
        return done

    def popen(self, *arguments: str) -> forked_cli.Popen:
        """``python -m django ARGUMENTS`` started, forked as ``manage`` forks its commands."""
        return forked_cli.Popen(list(arguments), program="django", cwd=ROOT, env=self.env)


@pytest.fixture
def project(database: str, table_name: str, tmp_path: Path) -> Project:
    made = Project(database, table_name, tmp_path)
    made.manage("migrate", "--verbosity=0")
    return made


def test_migrate_makes_the_table_sqllocker_migrate_makes(project: Project) -> None:
    engine = sa.create_engine(resolve_url(project.url))
    try:
        assert current_revision(engine, project.table) == head_revision()
        assert schema_differences(engine, project.table) == []
    finally:
        engine.dispose()
    project.manage("migrate", "sqllocker", "zero", "--verbosity=0")
    inspector_engine = sa.create_engine(resolve_url(project.url))
    try:
        assert not sa.inspect(inspector_engine).has_table(project.table)
    finally:
        inspector_engine.dispose()


def test_migrate_brings_a_lock_table_made_before_0002_to_the_head(project: Project) -> None:
    """A project migrated before sqllocker's revision 0002 came has its lock table at 0001
    (migrating back to the app's 0001 leaves it so); ``manage.py migrate`` brings it up."""
    project.manage("migrate", "sqllocker", "0001", "--verbosity=0")
    engine = sa.create_engine(resolve_url(project.url))
    try:
        assert current_revision(engine, project.table) == "0001"
        project.manage("migrate", "--verbosity=0")
        assert current_revision(engine, project.table) == head_revision() == "0004"
        assert schema_differences(engine, project.table) == []
    finally:
        engine.dispose()


def test_manage_py_sqllocker_is_the_command_line_on_the_table(project: Project) -> None:
    holder = project.popen("report", "2026-11-25", "30")
    try:
        deadline = time.monotonic() + 60
        while "report 2026-11-25" not in project.manage("sqllocker", "list").stdout:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        shown = project.manage("sqllocker", "show", "report 2026-11-25", "--json").stdout
        assert f'"pid": {holder.pid}' in shown
        refused = project.manage("sqllocker", "release", "report 2026-11-25", check=False)
        assert refused.returncode != 0  # --force is required
        project.manage("sqllocker", "release", "report 2026-11-25", "--force")
        assert "report 2026-11-25" not in project.manage("sqllocker", "list").stdout
        purged = project.manage("sqllocker", "purge-expired", "--json").stdout
        assert json.loads(purged) == {"purged": 0}
    finally:
        holder.kill()
        holder.wait()


def test_two_management_commands_on_one_lockstring_run_one_at_a_time(
    project: Project, tmp_path: Path
) -> None:
    commands = [project.popen("report", "2026-11-26", "3") for _ in range(2)]
    errors = [command.communicate(timeout=120)[1] for command in commands]
    assert [command.returncode for command in commands] == [0, 0]
    assert not (tmp_path / "overlaps").exists()
    assert len((tmp_path / "runs").read_text().split()) == 1
    assert sum("skipped Command.handle" in error for error in errors) == 1


def test_guard_on_djangos_connection_commits_only_while_the_lock_is_held(
    project: Project, backend: str
) -> None:
    """... and bounds the silence of the guarded transaction until it ends (on MariaDB the
    bound is the session's: it was given back as guard() returned, leaving the transaction
    that holds the row lock unbounded), then gives the session its own bound back."""
    said = project.manage("guarded").stdout.splitlines()
    assert said == [
        "break waits: True",
        "held: 1",
        "conflict: 409",
        "conflict class: 409",  # method_decorator(locked(...), name="dispatch")
        "conflict method: 409",
        "free: 200",
        "free class: 200",
        "free method: 200",
        "refused: LockLost",
        "after: 0",
        f"silence bounded while guarded: {backend != 'sqlite'}",
        "silence limit after the commit: True",
        "silence limit after a rollback and a request: True",
        "outside atomic: LockError",
    ]


def test_manage_py_purge_expired_leaves_what_the_settings_grace_keeps(project: Project) -> None:
    """A row expired a moment ago, within the setting's grace: the setting's Lockers would not
    take it over yet, so the purge leaves it (it took the command line's own default)."""
    project.env["SQLLOCKER_DJANGO_GRACE"] = "60"
    locker = Locker(project.url, table=project.table)
    try:
        abandon(locker.lock("crashed job", expires=0.1))
        time.sleep(1.5)  # past the command line's default grace
        project.manage("sqllocker", "purge-expired")
        assert [info.lockstring for info in locker.locks()] == ["crashed job"]
        project.manage("sqllocker", "purge-expired", "--grace", "0")
        assert locker.locks() == []
    finally:
        locker.close()


def test_locked_refuses_what_it_cannot_protect(project: Project) -> None:
    said = project.manage("decorated").stdout.splitlines()
    assert said == [
        "outside a transaction: ran",
        "inside atomic: LockError",
        "autocommit off: LockError",
        "autocommit off in the settings, a new thread: LockError",
        "under ATOMIC_REQUESTS: LockError",
        "non_atomic_requests: 200",
        "coroutine function: LockTypeError",
        "async view's as_view(): LockTypeError",
        "generator function: LockTypeError",
        "held while rendered: True",
        "finished by its framework: 200",
        "async response: LockTypeError",
        "async response: rows left 0",
        "streamed response: LockTypeError",
        "streamed response: rows left 0",
        "{'wait': -1}: LockValueError",
        "{'expires': 0}: LockValueError",
        "{'hold_at_least': -5}: LockValueError",
    ]


def test_the_docs_example_runs_once_per_day(project: Project, tmp_path: Path) -> None:
    """docs/django.md's command, as an app of its own beside the test project's models."""
    text = (ROOT / "docs" / "django.md").read_text()
    example = text.split("```python\n", 1)[1].split("```", 1)[0]
    assert "from reports.models import Entry" in example
    example = example.replace("from reports.models", "from tests.django_project.reports.models")
    commands = tmp_path / "docs_example" / "management" / "commands"
    commands.mkdir(parents=True)
    for package in (commands.parent.parent, commands.parent, commands):
        (package / "__init__.py").touch()
    (commands / "nightly_report.py").write_text(example)
    project.env["SQLLOCKER_DJANGO_APPS"] = "docs_example"
    project.env["PYTHONPATH"] = f"{tmp_path}:{ROOT}"

    first = project.manage("nightly_report", "2026-11-25").stdout
    assert first.startswith("report 2026-11-25 made under lock ")
    second = project.manage("nightly_report", "2026-11-25").stdout
    assert second.startswith("skipped: ")  # hold_at_least: once for the day
    assert "made" in project.manage("nightly_report", "2026-11-26").stdout
    listed = project.manage("sqllocker", "list").stdout
    assert "nightly report 2026-11-25" in listed


def test_djangos_test_runner_gets_the_lock_table_in_its_test_database(project: Project) -> None:
    done = project.manage("test", "tests.django_project.reports", "--noinput", check=False)
    assert done.returncode == 0, done.stderr
    assert "Ran 3 tests" in done.stderr


@pytest.mark.parametrize("backend", ["sqlite"])  # the setting's check: no database's
@pytest.mark.parametrize(
    ("setting", "said"),
    [
        ({"database": "reports"}, "names the database 'reports', which settings.DATABASES"),
        ({"database": ["default"]}, "database must be the name of one of settings.DATABASES"),
        ({"table": None}, "a table name must be a str, not NoneType"),
        ({"grace": "abc"}, "grace"),
    ],
    ids=["unknown database", "database not a name", "table None", "grace not a number"],
)
def test_manage_py_sqllocker_with_a_bad_setting_says_so_in_one_line_and_exits_2(
    project: Project, setting: dict[str, Any], said: str
) -> None:
    """A bad ``settings.SQLLOCKER``: the command line's status for an error, in one line (it was
    Django's traceback and 1, the negative answer; a table None was the table 'None', a grace
    that is no number a usage error of an option nobody typed)."""
    project.env["SQLLOCKER_DJANGO_SETTING"] = json.dumps(setting)
    done = project.manage("sqllocker", "purge-expired", check=False)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("CommandError: "), done.stderr
    assert said in lines[0], done.stderr


@pytest.mark.parametrize("backend", ["sqlite"])  # the streams': no database's
def test_manage_py_sqllocker_whose_stderr_is_closed_still_exits_2_on_an_error(
    project: Project,
) -> None:
    """The table missing, and stderr's reader gone: Django's own report of the error failed
    too, and the process exited 1, a script's "not held"."""
    project.env["SQLLOCKER_DJANGO_TABLE"] = "never_migrated"
    reader, writer = os.pipe()
    os.close(reader)
    try:
        done = subprocess.run(
            project.command("sqllocker", "show", "job"),
            env=project.env,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=writer,
            timeout=120,
            check=False,
        )
    finally:
        os.close(writer)
    assert done.returncode == 2
