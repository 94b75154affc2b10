"""PostgreSQL: every time DBIx::Locker writes is read again as UTC, whatever its value.

0002's trigger converted a time only when it differed from the row's old one. A Perl process
that moved its expiry on by exactly its session's offset east of UTC wrote local text that the
session read as the very instant the old, converted, time stood for: the trigger took it as
unchanged and left it, so that the row said the lock ended that offset earlier than Perl held
it. With Perl and its session more than 14 hours apart (``schema.FOREIGN_CLOCK_MARGIN``), the
lock could be taken over while Perl held it.

Now each of ``created`` and ``expires`` has a trigger of its own, ``<table>_foreign_created``
and ``<table>_foreign_expires``, on inserts and on every update that writes that column: a
column written is a column converted. Nothing on MySQL/MariaDB and SQLite.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""

from collections.abc import Sequence
from types import ModuleType

from alembic import context, op
from alembic.script import ScriptDirectory

from sqllocker.migration_functions import backend_name, create_pinned_functions, drop_functions
from sqllocker.schema import FOREIGN_GUID_PREFIX
from sqllocker.validation import check_table_name

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_COLUMNS = ("created", "expires")
_FUNCTION_SIGNATURES = tuple(f"{{table}}_foreign_{column}()" for column in _COLUMNS)


def _foreign_time(table: str, column: str) -> str:
    # As 0002's: the cast to timestamp gives back the text as the session read it; SECURITY
    # INVOKER, and never OR REPLACE.
    return f"""
        CREATE FUNCTION {table}_foreign_{column}() RETURNS trigger
        LANGUAGE plpgsql SECURITY INVOKER AS $$
        BEGIN
            NEW.{column} := pg_catalog.timezone('UTC'::text, NEW.{column}::timestamp);
            RETURN NEW;
        END
        $$"""


def _revision_0002() -> ModuleType:
    """0002's module: its trigger is dropped on the way up and made again on the way down."""
    script = ScriptDirectory.from_config(context.config).get_revision("0002")
    assert script is not None
    return script.module


def upgrade() -> None:
    if backend_name() != "postgresql":
        return
    table = check_table_name(context.config.attributes["table"])
    _revision_0002().drop(table)
    create_pinned_functions(
        table, [_foreign_time(table, column) for column in _COLUMNS], _FUNCTION_SIGNATURES
    )
    for column in _COLUMNS:
        op.execute(
            f"CREATE TRIGGER {table}_foreign_{column} BEFORE INSERT OR UPDATE OF {column} "
            f"ON {table} FOR EACH ROW WHEN (pg_catalog.starts_with(NEW.guid::text, "
            f"'{FOREIGN_GUID_PREFIX}'::text)) EXECUTE FUNCTION {table}_foreign_{column}()"
        )


def downgrade() -> None:
    if backend_name() != "postgresql":
        return
    table = check_table_name(context.config.attributes["table"])
    for column in _COLUMNS:
        op.execute(f"DROP TRIGGER {table}_foreign_{column} ON {table}")
    drop_functions(table, _FUNCTION_SIGNATURES)
    _revision_0002().create(table)
