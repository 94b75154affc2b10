"""sqllocker's revision 0004 (PostgreSQL: every time DBIx::Locker writes is read again as UTC,
whatever its value), for a lock table that an earlier migration made before it came. Backwards,
the table goes back to 0003."""

from __future__ import annotations

from typing import Any

from django.db import migrations

from sqllocker import migrations as lock_table_migrations
from sqllocker.django.lock_table import on_lock_database


def upgrade_lock_table(apps: Any, schema_editor: Any) -> None:
    on_lock_database(schema_editor, lock_table_migrations.upgrade)


def downgrade_lock_table(apps: Any, schema_editor: Any) -> None:
    on_lock_database(
        schema_editor,
        lambda engine, table: lock_table_migrations.downgrade(engine, table, "0003"),
    )


class Migration(migrations.Migration):
    atomic = False
    dependencies = [("sqllocker", "0003_signed_grants")]  # noqa: RUF012 (Django's own attributes)
    operations = [  # noqa: RUF012
        migrations.RunPython(upgrade_lock_table, downgrade_lock_table, elidable=False)
    ]
