"""PostgreSQL: notify waiters whenever a lock row is deleted.

A DELETE of a row (release, purge, an operator's DELETE, a takeover on the other backends)
sends ``NOTIFY sqllocker_<table>, '<lockstring>'``, so waiters that LISTEN wake at once instead
of polling. A trigger costs the releaser no extra round trip. Nothing on the other backends.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22
"""

from collections.abc import Sequence

from alembic import context, op

from sqllocker.validation import check_table_name

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    if op.get_context().dialect.name != "postgresql":
        return
    # A validated identifier (letters, digits, underscores): safe to write into DDL.
    table = check_table_name(context.config.attributes["table"])
    op.execute(
        f"""
        CREATE FUNCTION {table}_notify_release() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM pg_notify('sqllocker_{table}', OLD.lockstring);
            RETURN NULL;
        END
        $$"""
    )
    op.execute(
        f"CREATE TRIGGER {table}_released AFTER DELETE ON {table} "
        f"FOR EACH ROW EXECUTE FUNCTION {table}_notify_release()"
    )


def downgrade() -> None:
    if op.get_context().dialect.name != "postgresql":
        return
    table = check_table_name(context.config.attributes["table"])
    op.execute(f"DROP TRIGGER {table}_released ON {table}")
    op.execute(f"DROP FUNCTION {table}_notify_release()")
