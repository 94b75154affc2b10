"""What the app's Django migrations run: sqllocker's own migrations (alembic) of the lock
table, on the database the ``SQLLOCKER`` setting names and no other."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

from sqllocker.django.configuration import database_alias, database_url, table_name


def on_lock_database(schema_editor: Any, migrate: Callable[[sa.Engine, str], None]) -> None:
    """``migrate(engine, table)`` when the Django migration runs on the lock table's database;
    nothing on any other."""
    alias = schema_editor.connection.alias
    if alias != database_alias():
        return
    engine = sa.create_engine(database_url(alias))
    try:
        migrate(engine, table_name())
    finally:
        engine.dispose()
