"""A view of held (unexpired) locks, with the holder's host, pid and program as columns.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""

from collections.abc import Sequence

from alembic import context, op

from sqllocker.validation import check_table_name

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The table name is a validated identifier (letters, digits, underscores), so it can be written
# into DDL; nothing else here comes from outside.
_SELECTS = {
    "postgresql": """
        SELECT id AS lock_id, lockstring, created, expires,
               locked_by ->> 'host' AS host,
               (locked_by ->> 'pid')::bigint AS pid,
               locked_by ->> 'program' AS program,
               locked_by
        FROM {table}
        WHERE expires > clock_timestamp()""",
    "mysql": """
        SELECT id AS lock_id, lockstring, created, expires,
               JSON_UNQUOTE(JSON_EXTRACT(locked_by, '$.host')) AS host,
               CAST(JSON_EXTRACT(locked_by, '$.pid') AS SIGNED) AS pid,
               JSON_UNQUOTE(JSON_EXTRACT(locked_by, '$.program')) AS program,
               locked_by
        FROM {table}
        WHERE expires > UTC_TIMESTAMP(6)""",
    "sqlite": """
        SELECT id AS lock_id, lockstring, created, expires,
               json_extract(locked_by, '$.host') AS host,
               json_extract(locked_by, '$.pid') AS pid,
               json_extract(locked_by, '$.program') AS program,
               locked_by
        FROM {table}
        WHERE expires > strftime('%Y-%m-%d %H:%M:%f', 'now')""",
}


def upgrade() -> None:
    table = check_table_name(context.config.attributes["table"])
    select = _SELECTS[op.get_context().dialect.name].format(table=table)
    op.execute(f"CREATE VIEW {table}_held AS {select}")


def downgrade() -> None:
    table = check_table_name(context.config.attributes["table"])
    op.execute(f"DROP VIEW {table}_held")
