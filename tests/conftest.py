"""Fixtures: every test that takes ``url`` runs on SQLite, PostgreSQL and MariaDB/MySQL.

Each test run creates a private database on each server (dropped at the end) and each test a
table of its own, so parallel runs and tests never see each other's rows. Under CI (``CI=true``)
a server that cannot be reached fails the run instead of skipping its tests.
"""

from __future__ import annotations

import compileall
import itertools
import os
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from sqllocker import Locker, lock_table
from sqllocker.backoff import Backoff
from sqllocker.engine import resolve_url
from tests.helpers import Proxied, migrate
from tests.preloading import BACKENDS

POSTGRES_ADMIN_URL = os.environ.get(
    "SQLLOCKER_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
)
MYSQL_ADMIN_URL = os.environ.get("SQLLOCKER_TEST_MYSQL_URL", "mysql://root@127.0.0.1:3306/test")
IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}

_table_numbers = itertools.count(1)
_RUN_ID = uuid.uuid4().hex[:10]


def _server_database(admin_url: str, kind: str) -> Iterator[str]:
    """Create ``sqllocker_test_<run>`` on the server; yield its URL; drop it afterwards."""
    name = f"sqllocker_test_{_RUN_ID}"
    admin = sa.create_engine(resolve_url(admin_url), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f"CREATE DATABASE {name}")
    except sa.exc.OperationalError as error:
        admin.dispose()
        message = f"{kind} server at {admin_url} is unreachable: {error.orig}"
        if IN_CI:
            pytest.fail(f"{message} (CI requires every backend)", pytrace=False)
        pytest.skip(message)
    url = make_url(resolve_url(admin_url)).set(database=name)
    try:
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            if kind == "postgresql":
                conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
            else:
                conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {name}")
        admin.dispose()


@pytest.fixture(scope="session")
def postgresql_url() -> Iterator[str]:
    yield from _server_database(POSTGRES_ADMIN_URL, "postgresql")


@pytest.fixture(scope="session")
def mysql_url() -> Iterator[str]:
    yield from _server_database(MYSQL_ADMIN_URL, "mysql")


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def url(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A database URL for this test's backend (SQLite: a file of its own)."""
    if backend == "sqlite":
        return f"sqlite:///{tmp_path / 'locks.db'}"
    return str(request.getfixturevalue(f"{backend}_url"))


@pytest.fixture
def table_name() -> str:
    return f"t{next(_table_numbers)}_{uuid.uuid4().hex[:6]}"


@pytest.fixture
def make_locker(url: str, table_name: str) -> Iterator[Callable[..., Locker]]:
    """Build Lockers on this test's table (created once, directly from the Table definition;
    the migration path has tests of its own). grace defaults to 0 here so expiry tests are quick."""
    lockers: list[Locker] = []
    engine = sa.create_engine(resolve_url(url))
    lock_table(table_name).create(engine)
    engine.dispose()

    def make(**options: object) -> Locker:
        options.setdefault("table", table_name)
        options.setdefault("grace", 0)
        locker = Locker(url, **options)  # type: ignore[arg-type]
        lockers.append(locker)
        return locker

    yield make
    for locker in lockers:
        locker.close()


@pytest.fixture
def locker(make_locker: Callable[..., Locker]) -> Locker:
    return make_locker()


@pytest.fixture
def migrated_postgres(postgresql_url: str, table_name: str) -> str:
    """A table made by the migrations, so it has the release-notifying trigger."""
    migrate(postgresql_url, table_name)
    return postgresql_url


@pytest.fixture
def proxied(url: str) -> Iterator[Proxied]:
    """A StallProxy in front of this test's server (PostgreSQL or MariaDB)."""
    through = Proxied(url)
    try:
        yield through
    finally:
        through.close()


@pytest.fixture
def slow_polling(monkeypatch: pytest.MonkeyPatch) -> None:
    """Waiters that would poll only every 30 s: if they come back sooner, NOTIFY woke them."""
    monkeypatch.setattr(Backoff, "for_wait", classmethod(lambda cls, wait: cls(None, 30.0, 30.0)))


# -- PostgreSQL tickets (tests/test_tickets.py, tests/test_hand_off.py) ----------------------


@pytest.fixture
def holder_and_waiter(migrated_postgres: str, table_name: str) -> Iterator[tuple[Locker, Locker]]:
    """Two Lockers of one PostgreSQL table made by the migrations (tickets, hand-offs)."""
    lockers = (
        Locker(migrated_postgres, table=table_name),
        Locker(migrated_postgres, table=table_name),
    )
    yield lockers
    for locker in lockers:
        locker.close()


@pytest.fixture
def admin(migrated_postgres: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(resolve_url(migrated_postgres))
    yield engine
    engine.dispose()


# README's test command runs the suite on six pytest-xdist workers, one per lane below from the
# start (with five, the sixth lane began only once another had ended). The tests of the modules
# below load the machine, time what they check against expiries and turns, or start private
# servers and clusters: each group (a "lane") runs its modules one after another on one worker,
# as they would alone, since beside many of the same kind they would find the machine slower
# than their timings allow for. The lanes differ in what they load: the processes' and the
# campaign's lanes run many processes at once (CPU), the faults' and the turns' lanes a few
# threads and processes timed against expiries, keep-alives and turns, the clusters' lane
# mostly waits for private servers and clusters to start, fail over and catch up, and the
# commands' lane for `sqllocker run`'s process families and for servers frozen behind a proxy.
# The other modules, a thread or two at a time, fill whichever worker is free.
_LANES = {
    "the processes' lane": {
        "test_groups",
        "test_mutual_exclusion",
        "test_poolers",
        "test_semaphores",
    },
    "the campaign's lane": {
        "test_campaign",
        "test_dbix_locker",
        "test_rwlocks",
    },
    "the faults' lane": {
        "test_faults",
        "test_hand_off",
        "test_hostile_roles",  # its pg_read_all_data role turns test_hand_off's grants unsigned
        "test_queue_order",
    },
    "the turns' lane": {
        "test_apscheduler",
        "test_celery",
        "test_elections",
        "test_holding",
    },
    "the clusters' lane": {
        "test_fencing",
        "test_galera",
        "test_high_availability",
        "test_patroni",
    },
    "the commands' lane": {
        "test_life_bounds",
        "test_run_family",
    },
}
_LANE_OF = {module: lane for lane, modules in _LANES.items() for module in modules}
# The free modules that take longest (most of their tests run the command line, Django or Perl
# in subprocesses), started before the others so that none of them is left to run alone at the
# end; the longest first.
_LONG_FIRST = ("test_cli", "test_django", "test_cli_rwlock", "test_asyncio", "test_telemetry")


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Whole modules to each worker, each lane's modules to one worker in turn, the lanes
    before the other modules (pytest-xdist's ``xdist_group`` marks, which would say the same,
    are lost on pytest 9's node ids)."""
    from xdist.scheduler import LoadScopeScheduling

    class LanesFirst(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.partition("::")[0]
            return _LANE_OF.get(Path(module).stem, module)

        def _assign_work_unit(self, node: Any) -> None:
            first = [*_LANES, *(f"tests/{module}.py" for module in _LONG_FIRST)]
            for scope in reversed(first):
                if scope in self.workqueue:
                    self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    return LanesFirst(config, log)


def pytest_configure(config: pytest.Config) -> None:
    # This process keeps what it compiles from here on, pytest's rewritten test modules among
    # them (half of each worker's collection), though PYTHONDONTWRITEBYTECODE is set.
    sys.dont_write_bytecode = False
    if not hasattr(config, "workerinput"):  # once, before pytest-xdist starts its workers
        _compile_once()


def _compile_once() -> None:
    """The library's and the tests' bytecode, written beside their sources before the run.

    The suite starts hundreds of interpreters (workers, fleets, the command line, Django,
    Celery). Where PYTHONDONTWRITEBYTECODE is set, as on CI machines, none writes what it
    compiles, so each compiled the library from source again, a good part of its start's CPU.
    They read bytecode that is there all the same, and a source changed since is compiled
    afresh as usual (its bytecode records the source's time and size).
    """
    root = Path(__file__).resolve().parent.parent
    for directory in ("sqllocker", "tests"):
        compileall.compile_dir(root / directory, quiet=1, workers=1)


def pytest_unconfigure(config: pytest.Config) -> None:
    # Locks that some tests deliberately leave held are released by their finalisers at exit,
    # after the per-run databases have been dropped; those warnings would only be noise.
    import logging

    logging.getLogger("sqllocker").setLevel(logging.CRITICAL)
