"""PostgreSQL: a refused acquirer costs the holder nothing."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from sqllocker import Locker
from sqllocker.engine import resolve_url


@pytest.fixture
def admin(migrated_postgres: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(resolve_url(migrated_postgres))
    yield engine
    engine.dispose()


def test_a_refused_attempt_leaves_the_holders_row_untouched(
    migrated_postgres: str, table_name: str, admin: sa.Engine
) -> None:
    """An upsert that decides not to update still locks the row it met, so the holder's release
    would wait for the refused acquirer's commit: the row's xmax would name the refuser."""
    locker = Locker(migrated_postgres, table=table_name)
    held = locker.lock("report")
    for _ in range(3):
        assert locker.try_lock("report") is None
    with admin.connect() as conn:
        xmax = conn.execute(
            sa.text(f"SELECT xmax::text FROM {table_name} WHERE lockstring = 'report'")
        ).scalar_one()
    assert xmax == "0"
    held.unlock()
    locker.close()
