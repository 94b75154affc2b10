"""The grants each job needs (docs/operations.md says the same), proven with roles that have
exactly those and nothing more: one that migrates, one that takes locks (and purges, and
breaks locks, with waiters queued), and one that only reads the view of held locks."""

from __future__ import annotations

import subprocess
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import psycopg
import pytest
import sqlalchemy as sa

from sqllocker import Locker
from sqllocker.engine import resolve_url
from tests.helpers import wait_until

SQLLOCKER = str(Path(__file__).resolve().parents[1] / ".venv" / "bin" / "sqllocker")


@dataclass(frozen=True)
class Roles:
    migrator: str  # URLs, each as a role of its own
    app: str
    reader: str


def as_role(url: str, role: str, options: str = "") -> str:
    target = sa.make_url(resolve_url(url)).set(username=role)
    rendered = target.render_as_string(hide_password=False)
    return rendered + (f"?options={quote(options)}" if options else "")


def sqllocker(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [SQLLOCKER, "--url", url, *args], capture_output=True, text=True, timeout=60, check=False
    )


def exercise(app: str, table: str = "semaphores") -> None:
    """Everything a role that takes locks does: acquire, extend, keep alive, wait in the queue
    and be handed the row, list and show, purge, and break a dead holder's lock."""
    holder = Locker(app, table=table, grace=0)
    waiter = Locker(app, table=table, grace=0)
    held = holder.lock("job", keep_alive=True, expires=3)
    held.extend(5)
    got: list[object] = []
    thread = threading.Thread(target=lambda: got.append(waiter.lock("job", wait=30)))
    thread.start()
    wait_until(lambda: len(holder.locks()) == 1 and thread.is_alive(), timeout=5)
    held.unlock()
    thread.join(30)
    (handed,) = got
    handed.unlock()  # type: ignore[attr-defined]
    abandoned = holder.lock("dead holder", expires=0.2)
    abandoned._finalizer.detach()
    abandoned._state.held = False
    wait_until(lambda: bool(holder.expired_locks()))
    assert holder.purge_expired_locks() == 1
    crashed = holder.lock("crashed", expires=600)
    crashed._finalizer.detach()
    crashed._state.held = False
    assert [info.lockstring for info in holder.locks()] == ["crashed"]
    listed = sqllocker(app, "--table", table, "list")
    assert listed.returncode == 0, listed.stderr
    assert "crashed" in listed.stdout
    shown = sqllocker(app, "--table", table, "show", "crashed")
    assert shown.returncode == 0, shown.stderr
    broken = sqllocker(app, "--table", table, "release", "crashed", "--force")
    assert broken.returncode == 0, broken.stderr
    assert holder.locks() == []
    holder.close()
    waiter.close()


@pytest.fixture
def postgresql_roles(postgresql_url: str) -> Iterator[Roles]:
    tag = uuid.uuid4().hex[:8]
    schema, migrator, app, reader = (f"{kind}_{tag}" for kind in ("locks", "mig", "app", "ro"))
    database = sa.make_url(resolve_url(postgresql_url)).database
    admin = psycopg.connect(
        sa.make_url(resolve_url(postgresql_url))
        .set(drivername="postgresql")
        .render_as_string(hide_password=False),
        autocommit=True,
    )
    for role in (migrator, app, reader):
        admin.execute(f"CREATE ROLE {role} LOGIN")
        admin.execute(f"GRANT CONNECT ON DATABASE {database} TO {role}")
    admin.execute(f"CREATE SCHEMA {schema}")
    admin.execute(f"GRANT USAGE, CREATE ON SCHEMA {schema} TO {migrator}")
    admin.execute(f"GRANT USAGE ON SCHEMA {schema} TO {app}, {reader}")
    path = f"-c search_path={schema}"
    yield Roles(
        as_role(postgresql_url, migrator, path),
        as_role(postgresql_url, app, path),
        as_role(postgresql_url, reader, path),
    )
    admin.execute(f"DROP SCHEMA {schema} CASCADE")
    for role in (migrator, app, reader):
        admin.execute(f"DROP OWNED BY {role}")
        admin.execute(f"DROP ROLE {role}")
    admin.close()


POSTGRESQL_GRANTS = [
    "GRANT SELECT, INSERT, UPDATE, DELETE ON semaphores TO {app}",
    "GRANT USAGE ON SEQUENCE semaphores_id_seq TO {app}",
    "GRANT EXECUTE ON FUNCTION semaphores_queue_join(varchar, varchar, jsonb, double precision, "
    "bigint, bytea), semaphores_anyone_ahead(varchar, bigint), "
    "semaphores_queue_leave(bigint, varchar, varchar, boolean), "
    "semaphores_sweep_requests() TO {app}",
    "GRANT SELECT ON semaphores_held TO {reader}",
]


@pytest.mark.slow
def test_postgresql_roles_need_only_the_documented_grants(postgresql_roles: Roles) -> None:
    migrated = sqllocker(postgresql_roles.migrator, "migrate")  # CREATE on the schema only
    assert migrated.returncode == 0, migrated.stderr
    app = sa.make_url(resolve_url(postgresql_roles.app)).username
    reader = sa.make_url(resolve_url(postgresql_roles.reader)).username
    owner = sa.create_engine(resolve_url(postgresql_roles.migrator))
    with owner.begin() as conn:
        for grant in POSTGRESQL_GRANTS:
            conn.exec_driver_sql(grant.format(app=app, reader=reader))
    exercise(postgresql_roles.app)
    viewer = sa.create_engine(resolve_url(postgresql_roles.reader))
    keeper = Locker(postgresql_roles.app)
    with keeper.lock("job"), viewer.connect() as conn:
        (held,) = conn.exec_driver_sql("SELECT lockstring, pid FROM semaphores_held").all()
        assert held.lockstring == "job"
        for secret in ("semaphores", "semaphores_requests"):
            with pytest.raises(sa.exc.ProgrammingError, match="permission denied"):
                conn.exec_driver_sql(f"SELECT * FROM {secret}")
            conn.rollback()
    keeper.close()
    viewer.dispose()
    owner.dispose()


@pytest.fixture
def mysql_roles(mysql_url: str) -> Iterator[Roles]:
    tag = uuid.uuid4().hex[:8]
    migrator, app, reader = (f"{kind}_{tag}" for kind in ("mig", "app", "ro"))
    database = sa.make_url(resolve_url(mysql_url)).database
    admin = sa.create_engine(resolve_url(mysql_url), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        for user in (migrator, app, reader):
            conn.exec_driver_sql(f"CREATE USER '{user}'@'%%'")
        conn.exec_driver_sql(
            "GRANT CREATE, INDEX, CREATE VIEW, SELECT, INSERT, UPDATE, DELETE "
            f"ON {database}.* TO '{migrator}'@'%%'"
        )
    yield Roles(as_role(mysql_url, migrator), as_role(mysql_url, app), as_role(mysql_url, reader))
    with admin.connect() as conn:
        for user in (migrator, app, reader):
            conn.exec_driver_sql(f"DROP USER '{user}'@'%%'")
    admin.dispose()


# The app's grants on MySQL and MariaDB, as the docs list them.
MYSQL_GRANTS = [
    "GRANT SELECT, INSERT, UPDATE, DELETE ON {database}.{table} TO '{app}'@'%%'",
    "GRANT SELECT, UPDATE ON {database}.{table}_id_order TO '{app}'@'%%'",
    "GRANT SELECT, INSERT, DELETE ON {database}.{table}_requests TO '{app}'@'%%'",
]


def migrate_and_grant_mysql(roles: Roles, mysql_url: str, table: str, grants: list[str]) -> None:
    """The table migrated by the migrator role, then ``grants`` given by the admin (formatted
    with the ``database``, the ``table``, and the ``app`` and ``reader`` roles' user names)."""
    migrated = sqllocker(roles.migrator, "--table", table, "migrate")
    assert migrated.returncode == 0, migrated.stderr
    names = {
        "database": sa.make_url(resolve_url(mysql_url)).database,
        "table": table,
        "app": sa.make_url(resolve_url(roles.app)).username,
        "reader": sa.make_url(resolve_url(roles.reader)).username,
    }
    admin = sa.create_engine(resolve_url(mysql_url), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        for grant in grants:
            conn.exec_driver_sql(grant.format(**names))
    admin.dispose()


@pytest.mark.slow
def test_mysql_users_need_only_the_documented_grants(
    mysql_roles: Roles, mysql_url: str, table_name: str
) -> None:
    migrate_and_grant_mysql(
        mysql_roles,
        mysql_url,
        table_name,
        [*MYSQL_GRANTS, "GRANT SELECT ON {database}.{table}_held TO '{reader}'@'%%'"],
    )
    exercise(mysql_roles.app, table_name)
    viewer = sa.create_engine(resolve_url(mysql_roles.reader))
    keeper = Locker(mysql_roles.app, table=table_name)
    with keeper.lock("job"), viewer.connect() as conn:
        assert keeper._operations.waits_by_ticket  # it sees its line of tickets
        rows = conn.exec_driver_sql(f"SELECT lockstring FROM {table_name}_held").all()
        assert [row.lockstring for row in rows] == ["job"]
        with pytest.raises(sa.exc.OperationalError, match="denied"):
            conn.exec_driver_sql(f"SELECT guid FROM {table_name}")
    keeper.close()
    viewer.dispose()
