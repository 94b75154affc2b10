"""``sqllocker exporter``: the lock table scraped over HTTP while locks are held, expired and
waited for, with the database unreachable, and as a role granted only what the docs give."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from prometheus_client.parser import text_string_to_metric_families

from sqllocker import Locker
from sqllocker.engine import create_locker_engine, resolve_url
from sqllocker.exporter import ExporterOptions, registry_for
from tests import test_privileges
from tests.helpers import Proxied, migrate, wait_until
from tests.test_privileges import (
    MYSQL_GRANTS,
    POSTGRESQL_GRANTS,
    Roles,
    migrate_and_grant_mysql,
    sqllocker,
)

SQLLOCKER = str(Path(__file__).resolve().parents[1] / ".venv" / "bin" / "sqllocker")

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        assert response.status == 200
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


@pytest.fixture
def migrated(url: str, table_name: str) -> str:
    """The table as the migrations make it, tickets table included."""
    migrate(url, table_name)
    return url


def serve_in_thread(url: str, options: ExporterOptions) -> Iterator[int]:
    from prometheus_client import start_http_server

    engine = create_locker_engine(resolve_url(url))
    server, thread = start_http_server(0, "127.0.0.1", registry_for(engine, options))
    yield server.server_port
    server.shutdown()
    server.server_close()
    thread.join(10)
    engine.dispose()


@pytest.fixture
def exporter_port(migrated: str, table_name: str) -> Iterator[int]:
    yield from serve_in_thread(
        migrated, ExporterOptions(table=table_name, per_lock="job *", max_series=2)
    )


def test_a_scrape_shows_held_expired_and_waited_for_locks(
    migrated: str, table_name: str, exporter_port: int, backend: str
) -> None:
    table = {"table": table_name}
    empty = scrape(exporter_port)
    assert value(empty, "sqllocker_up", **table) == 1
    assert value(empty, "sqllocker_locks_held", **table) == 0
    assert value(empty, "sqllocker_locks_expired", **table) == 0
    assert value(empty, "sqllocker_lock_oldest_held_seconds", **table) == 0

    holder = Locker(migrated, table=table_name, grace=0)
    held = [holder.lock(name, expires=120) for name in ("job 1", "job 2", "job 3", "other")]
    lapsing = holder.lock("job 0", expires=1)
    # A waiter in another process (one in this process would be refused: not re-entrant).
    waiter = subprocess.Popen(
        [SQLLOCKER, "--url", migrated, "--table", table_name, "run", "-w", "60", "job 1", "true"]
    )
    try:
        wait_until(lambda: holder.lock_info("job 0").expired, timeout=30)  # type: ignore[union-attr]
        if backend == "sqlite":
            # SQLite's waiters queue in the kernel, beside the database file: not readable.
            time.sleep(1)
            samples = scrape(exporter_port)
            assert value(samples, "sqllocker_waiters", **table) is None
        else:
            wait_until(lambda: value(scrape(exporter_port), "sqllocker_waiters", **table) == 1, 30)
            samples = scrape(exporter_port)
            job1 = {"table": table_name, "lockstring": "job 1"}
            assert value(samples, "sqllocker_lock_waiters", **job1) == 1
        assert waiter.poll() is None
        assert value(samples, "sqllocker_up", **table) == 1
        assert value(samples, "sqllocker_locks_held", **table) == 4
        assert value(samples, "sqllocker_locks_expired", **table) == 1
        oldest = value(samples, "sqllocker_lock_oldest_held_seconds", **table)
        assert oldest is not None
        assert 0 <= oldest < 120
        per_lock = {
            dict(labels)["lockstring"]: v
            for (name, labels), v in samples.items()
            if name == "sqllocker_lock_held"
        }
        # "job 0" (expired) and "job 1", in lockstring order; "job 2" and "job 3" cut off by
        # --max-series, "other" not matched.
        assert per_lock == {"job 0": 0, "job 1": 1}
        assert value(samples, "sqllocker_lock_series_truncated", **table) == 1
        left = value(
            samples, "sqllocker_lock_expires_in_seconds", table=table_name, lockstring="job 0"
        )
        assert left is not None
        assert left <= 0
        held[0].unlock()
        assert waiter.wait(60) == 0
        after = scrape(exporter_port)
        assert value(after, "sqllocker_locks_held", **table) == 3
        assert value(after, "sqllocker_locks_expired", **table) == 1
        if backend != "sqlite":
            assert value(after, "sqllocker_waiters", **table) == 0
    finally:
        waiter.kill()
        waiter.wait(30)
        for lock in [*held[1:], lapsing]:
            lock.unlock()
        holder.close()


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _unreachable(backend: str, tmp_path: Path) -> str:
    if backend == "sqlite":
        return f"sqlite:///{tmp_path / 'no such directory' / 'locks.db'}"
    scheme = {"postgresql": "postgresql://postgres", "mysql": "mysql://root"}[backend]
    return f"{scheme}@127.0.0.1:{_closed_port()}/test"


def test_a_scrape_with_the_database_unreachable_answers_up_0(backend: str, tmp_path: Path) -> None:
    table = f"t_{uuid.uuid4().hex[:6]}"
    for port in serve_in_thread(_unreachable(backend, tmp_path), ExporterOptions(table=table)):
        samples = scrape(port)
        assert samples == {("sqllocker_up", (("table", table),)): 0}


def test_the_command_serves_metrics_and_survives_an_outage(migrated: str, table_name: str) -> None:
    port = _closed_port()
    exporter = subprocess.Popen(
        [
            SQLLOCKER,
            "--url",
            migrated,
            "--table",
            table_name,
            "exporter",
            "--listen",
            f"127.0.0.1:{port}",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        locker = Locker(migrated, table=table_name)
        with locker.lock("nightly"):
            samples: Samples = {}

            def answered() -> bool:
                nonlocal samples
                try:
                    samples = scrape(port)
                except OSError:
                    return False
                return True

            wait_until(answered, timeout=30)
            assert value(samples, "sqllocker_up", table=table_name) == 1
            assert value(samples, "sqllocker_locks_held", table=table_name) == 1
        locker.close()
        assert exporter.poll() is None
    finally:
        exporter.terminate()
        exporter.wait(30)


def test_a_bad_listen_address_is_a_one_line_error() -> None:
    done = subprocess.run(
        [SQLLOCKER, "exporter", "--listen", "nowhere"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr == "sqllocker: error: --listen must be HOST:PORT, not 'nowhere'\n"


# -- a role granted only what docs/observability.md gives ------------------------------------------

postgresql_roles = test_privileges.postgresql_roles
mysql_roles = test_privileges.mysql_roles

POSTGRESQL_EXPORTER_GRANTS = [
    "GRANT SELECT (lockstring, created, expires) ON semaphores TO {reader}",
    "GRANT SELECT (lockstring, liveness_key) ON semaphores_requests TO {reader}",
]
MYSQL_EXPORTER_GRANTS = [
    "GRANT SELECT (lockstring, created, expires) ON {database}.{table} TO '{reader}'@'%%'",
    "GRANT SELECT (lockstring, liveness_key) ON {database}.{table}_requests TO '{reader}'@'%%'",
]


def _census_as_reader(reader_url: str, app_url: str, table: str) -> None:
    """A lock held and a waiter queued, seen by the reader's exporter; the secret guid is
    out of the reader's reach."""
    holder = Locker(app_url, table=table)
    held = holder.lock("job 1", expires=120)
    waiter = subprocess.Popen(
        [SQLLOCKER, "--url", app_url, "--table", table, "run", "-w", "60", "job 1", "true"]
    )
    try:
        for port in serve_in_thread(reader_url, ExporterOptions(table=table, per_lock="*")):
            wait_until(lambda: value(scrape(port), "sqllocker_waiters", table=table) == 1, 30)
            samples = scrape(port)
            assert value(samples, "sqllocker_up", table=table) == 1
            assert value(samples, "sqllocker_locks_held", table=table) == 1
            assert value(samples, "sqllocker_lock_held", table=table, lockstring="job 1") == 1
        reader = sa.create_engine(resolve_url(reader_url))
        with reader.connect() as conn, pytest.raises(sa.exc.DBAPIError, match="denied"):
            conn.exec_driver_sql(f"SELECT guid FROM {table}")
        reader.dispose()
        held.unlock()
        assert waiter.wait(60) == 0
    finally:
        waiter.kill()
        waiter.wait(30)
        holder.close()


@pytest.mark.slow
def test_postgresql_exporter_role_needs_only_the_documented_grants(
    postgresql_roles: Roles,
) -> None:
    migrated = sqllocker(postgresql_roles.migrator, "migrate")
    assert migrated.returncode == 0, migrated.stderr
    app = sa.make_url(resolve_url(postgresql_roles.app)).username
    reader = sa.make_url(resolve_url(postgresql_roles.reader)).username
    owner = sa.create_engine(resolve_url(postgresql_roles.migrator))
    with owner.begin() as conn:
        for grant in [*POSTGRESQL_GRANTS, *POSTGRESQL_EXPORTER_GRANTS]:
            conn.exec_driver_sql(grant.format(app=app, reader=reader))
    owner.dispose()
    _census_as_reader(postgresql_roles.reader, postgresql_roles.app, "semaphores")


@pytest.mark.slow
def test_mysql_exporter_user_needs_only_the_documented_grants(
    mysql_roles: Roles, mysql_url: str, table_name: str
) -> None:
    migrate_and_grant_mysql(
        mysql_roles, mysql_url, table_name, [*MYSQL_GRANTS, *MYSQL_EXPORTER_GRANTS]
    )
    _census_as_reader(mysql_roles.reader, mysql_roles.app, table_name)


@pytest.mark.slow
@pytest.mark.parametrize("server", ["postgresql", "mysql"])
def test_a_scrape_through_a_stalled_network_answers_up_0_in_time(
    server: str, request: pytest.FixtureRequest, table_name: str
) -> None:
    target = request.getfixturevalue(f"{server}_url")
    migrate(target, table_name)
    proxied = Proxied(target)
    proxy = proxied.proxy
    try:
        for port in serve_in_thread(proxied.url, ExporterOptions(table=table_name, timeout=2)):
            assert value(scrape(port), "sqllocker_up", table=table_name) == 1
            proxy.stall()
            started = time.monotonic()
            assert scrape(port) == {("sqllocker_up", (("table", table_name),)): 0}
            # Against the driver's own 60 s statement timeout that it would otherwise wait.
            assert time.monotonic() - started < 30
            assert scrape(port) == {("sqllocker_up", (("table", table_name),)): 0}
            proxy.resume()
            wait_until(lambda: value(scrape(port), "sqllocker_up", table=table_name) == 1, 90)
    finally:
        proxied.close()


def test_readers_writers_permits_and_turns_are_shown_as_what_they_are(
    migrated: str, table_name: str, backend: str
) -> None:
    holder = Locker(migrated, table=table_name)
    other = Locker(migrated, table=table_name)
    readers = [holder.rwlock("catalog").read(), other.rwlock("catalog").read()]
    writer = holder.rwlock("orders").write()
    permits = [holder.semaphore("crawl", 3).acquire() for _ in range(2)]
    # A semaphore's turn, as a waiter with a smaller limit takes it (see sqllocker.permits).
    turn = other.lock("crawl (turn)", locked_by={"semaphore_limit": 1})
    plain = holder.lock("plain")
    port_of = serve_in_thread(migrated, ExporterOptions(table=table_name, per_lock="*"))
    port = next(port_of)
    try:
        samples = scrape(port)
        table = {"table": table_name}
        # 2 readers, 1 writer (two rows, counted once), 2 permits, 1 plain lock; no turn.
        assert value(samples, "sqllocker_locks_held", **table) == 6
        assert value(samples, "sqllocker_semaphore_turns", **table) == 1
        by_kind = {
            dict(labels)["kind"]: v
            for (name, labels), v in samples.items()
            if name == "sqllocker_locks_held_by_kind"
        }
        assert by_kind == {"reader": 2, "writer": 1, "permit": 2}
        kinds = {
            dict(labels)["lockstring"]: dict(labels)["kind"]
            for (name, labels), v in samples.items()
            if name == "sqllocker_lock_kind" and v == 1
        }
        assert kinds == {
            readers[0].lockstring: "reader",
            readers[1].lockstring: "reader",
            "orders": "writer",
            writer._state.lockstring: "writer",
            permits[0].lockstring: "permit",
            permits[1].lockstring: "permit",
            "crawl (turn)": "turn",
            "plain": "lock",
        }
    finally:
        next(port_of, None)
    command = [SQLLOCKER, "--url", migrated, "--table", table_name]
    listed = subprocess.run([*command, "list"], capture_output=True, text=True, check=True)
    assert listed.stdout.split()[:2] == ["LOCKSTRING", "KIND"]
    as_json = subprocess.run(
        [*command, "list", "--json"], capture_output=True, text=True, check=True
    )
    assert {item["lockstring"]: item["kind"] for item in json.loads(as_json.stdout)} == kinds
    show = subprocess.run([*command, "show", "orders"], capture_output=True, text=True, check=True)
    assert "kind:       writer" in show.stdout
    for lock in [*readers, writer, *permits, turn, plain]:
        lock.unlock()
    holder.close()
    other.close()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"], indirect=True)
def test_a_row_no_value_holds_fails_the_scrape_saying_so(
    migrated: str, backend: str, table_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A row an operator's SQL wrote with a timestamp that is not one (SQLite: text;
    PostgreSQL: 'infinity'): the scrape answers up 0 and the log names the unreadable row, not
    a database that did not answer."""
    engine = create_locker_engine(resolve_url(migrated))
    bad = "'not a time'" if backend == "sqlite" else "'infinity'"
    with engine.begin() as conn:
        conn.exec_driver_sql(
            f"INSERT INTO {table_name} (lockstring, guid, created, expires, locked_by) "
            f"VALUES ('bad row', 'x', {bad}, {bad}, '{{}}')"
        )
    engine.dispose()
    for port in serve_in_thread(migrated, ExporterOptions(table=table_name)):
        samples = scrape(port)
    assert value(samples, "sqllocker_up", table=table_name) == 0
    said = " ".join(record.getMessage() for record in caplog.records)
    assert "cannot be read" in said, said
    assert "did not answer" not in said, said
