"""PostgreSQL: a function that waits in a lockstring's queue without logging an ERROR.

Waiters queue on a session advisory lock (``sqllocker.waiting_room``) and stop waiting at a
``lock_timeout``: their patience, or the caller's deadline. A lock_timeout that fires is an
ERROR, and the server logs every one ("canceling statement due to lock timeout"): a waiter
behind a job that holds its lock for ten minutes logged one a second, which operators took
for faults. An ERROR caught by a PL/pgSQL exception handler is not logged, so the wait runs
in this function, which returns false instead. Nothing on the other backends.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23
"""

from collections.abc import Sequence

from alembic import context, op

from sqllocker.validation import check_table_name

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    if op.get_context().dialect.name != "postgresql":
        return
    # A validated identifier (letters, digits, underscores): safe to write into DDL.
    table = check_table_name(context.config.attributes["table"])
    # The limit is local to the caller's transaction (one autocommit statement), so the
    # session's own lock_timeout is untouched; an exception block rolls it back anyway.
    op.execute(
        f"""
        CREATE FUNCTION {table}_queue_wait(queue_key bigint, patience_ms integer)
        RETURNS boolean LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM set_config('lock_timeout', patience_ms::text, true);
            PERFORM pg_advisory_lock(queue_key);
            RETURN true;
        EXCEPTION WHEN lock_not_available THEN
            RETURN false;
        END
        $$"""
    )


def downgrade() -> None:
    if op.get_context().dialect.name != "postgresql":
        return
    table = check_table_name(context.config.attributes["table"])
    op.execute(f"DROP FUNCTION {table}_queue_wait(bigint, integer)")
