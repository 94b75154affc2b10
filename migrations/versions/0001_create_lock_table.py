"""Create the lock table.

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import context, op
from sqlalchemy.dialects import postgresql

from sqllocker.schema import Lockstring, UTCDateTime

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    table = context.config.attributes["table"]
    op.create_table(
        table,
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            primary_key=True,
            autoincrement=True,
            comment="fencing token: strictly increasing, never reused",
        ),
        sa.Column("lockstring", Lockstring(), nullable=False),
        sa.Column("guid", sa.String(36), nullable=False),
        sa.Column("created", UTCDateTime(), nullable=False),
        sa.Column("expires", UTCDateTime(), nullable=False),
        sa.Column(
            "locked_by", sa.JSON().with_variant(postgresql.JSONB(), "postgresql"), nullable=False
        ),
        sa.UniqueConstraint("lockstring", name=f"uq_{table}_lockstring"),
        sqlite_autoincrement=True,
        mysql_engine="InnoDB",
        mysql_charset="utf8mb4",
    )
    op.create_index(f"ix_{table}_expires", table, ["expires"])


def downgrade() -> None:
    table = context.config.attributes["table"]
    op.drop_index(f"ix_{table}_expires", table_name=table)
    op.drop_table(table)
