"""MySQL/MariaDB: a stripes table whose rows an acquire locks, so that lock ids grow in holding
order whatever ``innodb_autoinc_lock_mode`` is.

InnoDB draws a row's auto-increment id before the unique check. An acquirer delayed between
the two could insert after a later acquirer had held and released the lock, and so hold it
with the smaller fencing token. Until now only the table's AUTO-INC lock, which ``INSERT ...
SELECT`` keeps to the end of the statement, prevented that, and only with
``innodb_autoinc_lock_mode`` 0 or 1: MySQL 8's default is 2, which takes no such lock. Now the
acquire's SELECT first locks (FOR UPDATE) the row of the lockstring's stripe in
``<table>_id_order``, one of 1,024 by CRC32 of the lockstring, until its statement commits,
so acquirers of one lockstring draw their ids one at a time, in the order they can hold the
row. Lockstrings that share a stripe only wait for each other's INSERT. Nothing on the other
backends.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-24
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import context, op

from sqllocker.validation import check_table_name

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# sqllocker.schema.ID_ORDER_STRIPES when this was written: a snapshot, as every migration is
# (tests/test_migrations.py checks that the two agree).
STRIPES = 1024


def upgrade() -> None:
    if op.get_context().dialect.name != "mysql":
        return
    # A validated identifier (letters, digits, underscores): safe to write into DDL.
    table = check_table_name(context.config.attributes["table"])
    op.create_table(
        f"{table}_id_order",
        sa.Column("stripe", sa.SmallInteger(), primary_key=True, autoincrement=False),
        mysql_engine="InnoDB",
    )
    # One statement, also in the SQL that `sqllocker migrate --sql` prints for a DBA.
    stripes = ", ".join(f"({stripe})" for stripe in range(STRIPES))
    op.execute(f"INSERT INTO {table}_id_order (stripe) VALUES {stripes}")  # noqa: S608 -- integers


def downgrade() -> None:
    if op.get_context().dialect.name != "mysql":
        return
    table = check_table_name(context.config.attributes["table"])
    op.drop_table(f"{table}_id_order")
