"""Applying the shipped alembic migrations to a database, from code.

The scripts live in the repository's top-level ``migrations/`` and are mapped into the wheel as
``sqllocker/_migrations``; an editable install or a checkout has only the former, a wheel only
the latter, so both places are looked for. Migrations record their progress in sqllocker's own
version table, never in the application's ``alembic_version``.
"""

from __future__ import annotations

import contextlib
import io
import threading
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import URL, Connection, Engine

from .adoption import check_adoptable, interrupted_after_swap, plan_adoption
from .backends import backend_class, backend_for
from .engine import describe_url
from .errors import ForeignTable, LockError, one_line
from .schema import (
    DEFAULT_TABLE,
    FOREIGN_GUID_PREFIX,
    current_revision_on,
    lock_table,
    set_aside_name,
    version_table_for,
)


def script_location() -> Path:
    package_dir = Path(__file__).resolve().parent
    for candidate in (package_dir / "_migrations", package_dir.parent / "migrations"):
        if (candidate / "env.py").is_file():
            return candidate
    raise FileNotFoundError(
        f"sqllocker's migration scripts are missing (looked in {package_dir / '_migrations'} "
        f"and {package_dir.parent / 'migrations'}); reinstall sqllocker"
    )


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


# Alembic keeps the migration running in a process in module globals (its ``context`` and
# ``op`` proxies): two at once, on two databases from two threads (a ``migrate`` beside a Locker
# making its table on first use), failed with KeyError, "table already exists", and crashed the
# interpreter.
# Taken after the database's own migration lock (``_migration_connection``), never before it.
_ALEMBIC = threading.RLock()


def current_revision(engine: Engine, table: str = DEFAULT_TABLE) -> str | None:
    with engine.connect() as conn:
        return current_revision_on(conn, table)


def upgrade(engine: Engine, table: str = DEFAULT_TABLE, revision: str = "head") -> None:
    """Apply the migrations up to ``revision``, serialised against concurrent upgrades.

    A table sqllocker did not make (``Backend.foreign_table``) is refused before anything is
    written: on MySQL, alembic's version table would otherwise stay behind."""
    with _migration_connection(engine) as conn:
        reason = _foreign_reason(conn, table)
        if reason is not None:
            raise ForeignTable.naming(table, describe_url(engine.url), reason)
        gone = _recorded_but_gone(conn, table)
        if gone is not None:
            raise LockError(gone)
        with _ALEMBIC:
            command.upgrade(alembic_config(table, connection=conn), revision)


def recorded_but_gone(engine: Engine, table: str = DEFAULT_TABLE) -> str | None:
    """What to do where ``table``'s migrations are recorded but the table is gone (dropped by
    hand): alembic would take it for up to date, and make nothing; else None."""
    with engine.connect() as conn:
        return _recorded_but_gone(conn, table)


def _recorded_but_gone(conn: Connection, table: str) -> str | None:
    version_table = version_table_for(table)
    revision = current_revision_on(conn, table)
    if revision is None or sa.inspect(conn).has_table(table):
        return None
    return (
        f"table {table!r} is gone, but {version_table} records its migrations up to revision "
        f"{revision} (was the table dropped by hand?); drop {version_table} too, and what the "
        f"migrations made beside the table if it is left ({table}_held, {table}_requests, "
        f"{table}_id_order, and on PostgreSQL the {table}_* functions), then migrate again"
    )


def foreign_reason(engine: Engine, table: str = DEFAULT_TABLE) -> str | None:
    """Why ``table`` is not a table sqllocker made (``Backend.foreign_table``), or is one whose
    adoption was stopped half-way (which the adopt command finishes); or None."""
    with engine.connect() as conn:
        return _foreign_reason(conn, table)


def _foreign_reason(conn: Connection, table: str) -> str | None:
    if interrupted_after_swap(conn, table, version_table_for(table)):
        return f"its adoption was stopped before it was recorded; {set_aside_name(table)} is left"
    return backend_for(conn.dialect).foreign_table(conn, table)


def adopt_dbix_locker(
    engine: Engine, table: str, perl_tz: ZoneInfo, exact_lockstrings: bool = False
) -> int:
    """Convert DBIx::Locker table ``table`` into sqllocker's, at the newest revision, keeping
    its rows (see ``sqllocker.adoption``); returns how many rows it kept. Refuses before
    anything is written unless the table can be adopted (``check_adoptable``); finishes an
    adoption that was stopped after its swap (``interrupted_after_swap``)."""
    version_table = version_table_for(table)
    backend = backend_for(engine.dialect)
    failure: Exception | None = None
    with _migration_connection(engine) as conn:
        if interrupted_after_swap(conn, table, version_table):
            # All but the record was made before the swap: record it; the old table goes below.
            with _ALEMBIC:
                command.stamp(alembic_config(table, connection=conn), "head")
            count = sa.select(sa.func.count()).select_from(sa.table(table))
            rows = int(conn.execute(count).scalar() or 0)
        else:
            backend.reopen_for_perl(conn, table)  # closed by an adoption killed in its swap
            check_adoptable(conn, table, version_table)
            had_version_table = sa.inspect(conn).has_table(version_table)
            backend.prepare_adoption(conn, table)
            adoption = plan_adoption(conn, table, perl_tz, exact_lockstrings, online=True)
            try:
                config = alembic_config(table, connection=conn, adoption=adoption)
                with _ALEMBIC:
                    command.upgrade(config, "head")
            except Exception as error:
                if not backend.adoption_swaps:
                    raise  # rolled back whole
                failure = error
                # What is left of the transaction goes (its connection may have, killed or
                # cut off: the adoption's own error is the one to tell).
                with contextlib.suppress(sa.exc.SQLAlchemyError):
                    conn.rollback()
            rows = adoption.rows
    if failure is not None:
        # Outside the migration's connection, whose transaction holds the version table.
        raise _after_failed_swap(
            engine, table, version_table, had_version_table, failure
        ) from failure
    if backend.adoption_swaps:
        try:
            with engine.begin() as conn:
                conn.exec_driver_sql(f"DROP TABLE {set_aside_name(table)}")
        except Exception as error:
            raise LockError(
                f"adopted {table!r} with its {rows} rows, but its old table "
                f"{set_aside_name(table)!r} could not be dropped ({one_line(error)}): drop it"
            ) from error
    return rows


def _after_failed_swap(
    engine: Engine, table: str, version_table: str, had_version_table: bool, error: Exception
) -> LockError:
    """An adoption that failed where DDL commits (MySQL): if the new table was not swapped in,
    the old one is untouched and what was made beside it is dropped again; if it was, it
    holds every row, and the error says what is left."""
    with engine.connect() as conn:
        inspector = sa.inspect(conn)
        columns = {column["name"] for column in inspector.get_columns(table)}
    if "guid" in columns:
        return LockError(
            f"adoption of {table!r} failed after the new table took its place, with every row: "
            f"{one_line(error)}; the old table is kept as {set_aside_name(table)!r} until the "
            f"adoption is finished by `sqllocker --url URL --table {table} migrate "
            "--adopt-dbix-locker --perl-tz ZONE`"
        )
    backend = backend_for(engine.dialect)
    made = [name for name in backend.adoption_names(table) if name != set_aside_name(table)]
    if not had_version_table:
        made.append(version_table)
    with engine.begin() as conn:
        backend.reopen_for_perl(conn, table)
        views = set(sa.inspect(conn).get_view_names())
        for name in made:
            kind = "VIEW" if name in views else "TABLE"
            conn.exec_driver_sql(f"DROP {kind} IF EXISTS {name}")
    return LockError(f"adoption of {table!r} failed, and {table!r} is untouched: {one_line(error)}")


def adoption_sql(
    engine: Engine, table: str, perl_tz: ZoneInfo, exact_lockstrings: bool = False
) -> str:
    """The SQL :func:`adopt_dbix_locker` would run now, for a DBA to read or apply: it holds
    the table's rows as they are when it is made (Perl processes that lock after that would
    lose their rows: stop them while it is applied)."""
    with engine.connect() as conn:
        check_adoptable(conn, table, version_table_for(table))
        adoption = plan_adoption(conn, table, perl_tz, exact_lockstrings, online=False)
    buffer = io.StringIO()
    config = alembic_config(table, url=engine.url, output_buffer=buffer, adoption=adoption)
    with _ALEMBIC:
        command.upgrade(config, "head", sql=True)
    return buffer.getvalue()


def downgrade(engine: Engine, table: str = DEFAULT_TABLE, revision: str = "base") -> None:
    """Undo the migrations down to ``revision``: by default everything they made (the table,
    and on PostgreSQL its trigger, functions and requests table), for tearing a table down."""
    with _migration_connection(engine) as conn, _ALEMBIC:
        command.downgrade(alembic_config(table, connection=conn), revision)


def upgrade_sql(url: URL, table: str = DEFAULT_TABLE) -> str:
    """The DDL of a full upgrade for ``url``'s dialect, for DBAs who apply it themselves."""
    buffer = io.StringIO()
    with _ALEMBIC:
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
                "compare_server_default": _compare_server_default,
                "include_object": ours,
                "version_table": version_table_for(table),
            },
        )
        return list(compare_metadata(context, metadata))


def _compare_server_default(
    context: Any,
    inspected_column: Any,
    metadata_column: Any,
    inspected_default: str | None,
    metadata_default: Any,
    rendered_metadata_default: str | None,
) -> bool | None:
    """Whether a column's default differs: the guid's random expression is the same whenever the
    database shows its prefix (alembic would evaluate both sides on PostgreSQL, and random
    values never agree; SQLAlchemy reflects no expression default on MySQL); every
    other column, alembic's own comparison."""
    if metadata_column.name != "guid":
        return None
    if inspected_default is None:
        backend = backend_for(context.dialect)
        inspected_default = backend.reflected_default(
            context.connection, metadata_column.table.name, "guid"
        )
    return inspected_default is None or FOREIGN_GUID_PREFIX not in inspected_default


def _migration_connection(engine: Engine) -> AbstractContextManager[Connection]:
    """A connection in a transaction, serialised against concurrent migrations."""
    return backend_class(engine.dialect.name).migration_connection(engine)
