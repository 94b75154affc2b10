"""Applying the shipped alembic migrations to a database, from code.

The scripts live in the repository's top-level ``migrations/`` and are mapped into the wheel as
``sqllocker/_migrations``; an editable install or a checkout has only the former, a wheel only
the latter, so both places are looked for. Migrations record their progress in sqllocker's own
version table, never in the application's ``alembic_version``.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import URL, Connection, Engine

from .schema import DEFAULT_TABLE, lock_table
from .validation import check_table_name

VERSION_TABLE = "sqllocker_alembic_version"
# Serialises concurrent `sqllocker migrate` runs on the servers (an advisory lock, not a row).
_MIGRATION_LOCK_NAME = "sqllocker_migrate"
_MIGRATION_LOCK_KEY = 0x5351_4C4C  # "SQLL": the PostgreSQL advisory-lock key for the same purpose


def script_location() -> Path:
    package_dir = Path(__file__).resolve().parent
    for candidate in (package_dir / "_migrations", package_dir.parent / "migrations"):
        if (candidate / "env.py").is_file():
            return candidate
    raise FileNotFoundError(
        f"sqllocker's migration scripts are missing (looked in {package_dir / '_migrations'} "
        f"and {package_dir.parent / 'migrations'}); reinstall sqllocker"
    )


def version_table_for(table: str) -> str:
    """sqllocker_alembic_version for the default table; one per table for the others."""
    check_table_name(table)
    return VERSION_TABLE if table == DEFAULT_TABLE else f"{VERSION_TABLE}_{table}"


def alembic_config(table: str, **attributes: Any) -> Config:
    config = Config(output_buffer=attributes.pop("output_buffer", None))
    config.set_main_option("script_location", str(script_location()))
    config.attributes.update(table=table, version_table=version_table_for(table), **attributes)
    return config


def head_revision() -> str:
    head = ScriptDirectory(str(script_location())).get_current_head()
    if head is None:
        raise RuntimeError("sqllocker ships no migrations")
    return head


def current_revision(engine: Engine, table: str = DEFAULT_TABLE) -> str | None:
    with engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"version_table": version_table_for(table)})
        return context.get_current_revision()


def upgrade(engine: Engine, table: str = DEFAULT_TABLE, revision: str = "head") -> None:
    """Apply the migrations up to ``revision``, serialised against concurrent upgrades."""
    with _migration_connection(engine) as conn:
        command.upgrade(alembic_config(table, connection=conn), revision)


def downgrade(engine: Engine, table: str = DEFAULT_TABLE, revision: str = "base") -> None:
    """Undo the migrations down to ``revision``: by default everything they made (the table,
    and on PostgreSQL its trigger, functions and requests table), for tearing a table down."""
    with _migration_connection(engine) as conn:
        command.downgrade(alembic_config(table, connection=conn), revision)


def upgrade_sql(url: URL, table: str = DEFAULT_TABLE) -> str:
    """The DDL of a full upgrade for ``url``'s dialect, for DBAs who apply it themselves."""
    buffer = io.StringIO()
    command.upgrade(alembic_config(table, url=url, output_buffer=buffer), "head", sql=True)
    return buffer.getvalue()


def schema_differences(engine: Engine, table: str = DEFAULT_TABLE) -> list[Any]:
    """How the table in the database differs from ``sqllocker.schema.lock_table`` (alembic's
    autogenerate comparison); empty when they match."""
    metadata = sa.MetaData()
    lock_table(table, metadata)
    index_names = {index.name for index in metadata.tables[table].indexes}

    def ours(obj: Any, name: str | None, type_: str, *_: Any) -> bool:
        if type_ == "table":
            return name == table
        if type_ == "index":
            return name in index_names
        return True

    with engine.connect() as conn:
        context = MigrationContext.configure(
            conn,
            opts={
                "compare_type": True,
                "compare_server_default": True,
                "include_object": ours,
                "version_table": version_table_for(table),
            },
        )
        return list(compare_metadata(context, metadata))


@contextmanager
def _migration_connection(engine: Engine) -> Iterator[Connection]:
    name = engine.dialect.name
    if name == "sqlite":
        # BEGIN IMMEDIATE takes SQLite's write lock up front, so processes that all find the
        # table missing at once create it one after another; alembic joins the open transaction.
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                conn.exec_driver_sql("ROLLBACK")
                raise
            conn.exec_driver_sql("COMMIT")
        return
    with engine.connect().execution_options(isolation_level="READ COMMITTED") as conn:
        if name == "postgresql":
            with conn.begin():
                conn.execute(sa.select(sa.func.pg_advisory_xact_lock(_MIGRATION_LOCK_KEY)))
                yield conn
            return
        # MySQL DDL commits implicitly, so the lock is a session lock released explicitly.
        conn.execute(sa.select(sa.func.get_lock(_MIGRATION_LOCK_NAME, 600)))
        conn.commit()
        try:
            with conn.begin():
                yield conn
        finally:
            conn.execute(sa.select(sa.func.release_lock(_MIGRATION_LOCK_NAME)))
            conn.commit()
