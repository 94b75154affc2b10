"""The lock table, made by sqllocker's own migrations (alembic), so that it is the table
``sqllocker migrate`` makes, on the database the ``SQLLOCKER`` setting names and no other."""

from __future__ import annotations

from typing import Any

from django.db import migrations

from sqllocker import migrations as lock_table_migrations
from sqllocker.django.lock_table import on_lock_database


def create_lock_table(apps: Any, schema_editor: Any) -> None:
    on_lock_database(schema_editor, lock_table_migrations.upgrade)


def drop_lock_table(apps: Any, schema_editor: Any) -> None:
    on_lock_database(schema_editor, lock_table_migrations.downgrade)


class Migration(migrations.Migration):
    # sqllocker's migrations run on a connection of their own, serialised against each other,
    # each in its own transactions: not inside Django's.
    atomic = False
    initial = True
    dependencies = []  # noqa: RUF012 (Django's own attributes)
    operations = [  # noqa: RUF012
        migrations.RunPython(create_lock_table, drop_lock_table, elidable=False)
    ]
