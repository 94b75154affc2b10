"""The campaign's own database: a database of its own on the server (SQLite: a file), the lock
table made by the migrations, and the two tables the guarded writes go to; dropped at the end.

The server URLs are the test suite's (``SQLLOCKER_TEST_POSTGRES_URL`` /
``SQLLOCKER_TEST_MYSQL_URL``, same defaults).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.engine import make_url

from sqllocker.engine import resolve_url
from sqllocker.migrations import upgrade
from tests.conftest import MYSQL_ADMIN_URL, POSTGRES_ADMIN_URL

ADMIN_URLS = {"postgresql": POSTGRES_ADMIN_URL, "mysql": MYSQL_ADMIN_URL}
LOCK_TABLE = "campaign_locks"

metadata = sa.MetaData()
# One row per lockstring: the value every guarded write reads and writes back plus one.
counters = sa.Table(
    "campaign_counters",
    metadata,
    sa.Column("lockstring", sa.String(191), primary_key=True),
    sa.Column("value", sa.Integer, nullable=False),
)
# One row per committed guarded write: ``seq`` is the counter's value it wrote.
writes = sa.Table(
    "campaign_writes",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("lockstring", sa.String(191), nullable=False),
    sa.Column("seq", sa.Integer, nullable=False),
    sa.Column("lock_id", sa.BigInteger, nullable=False),
    sa.Column("worker", sa.String(40), nullable=False),
    sa.Column("op", sa.String(40), nullable=False),
)


@dataclass
class CampaignDatabase:
    url: str  # sync URL, straight to the server
    name: str | None  # the server database's name (None: SQLite)
    admin_url: str | None

    def engine(self) -> sa.Engine:
        return sa.create_engine(resolve_url(self.url))

    def prepare(self, lockstrings: list[str]) -> None:
        engine = self.engine()
        try:
            upgrade(engine, LOCK_TABLE)
            metadata.create_all(engine)
            with engine.begin() as conn:
                conn.execute(
                    counters.insert(), [{"lockstring": ls, "value": 0} for ls in lockstrings]
                )
        finally:
            engine.dispose()

    def drop(self) -> None:
        if self.name is None or self.admin_url is None:
            return
        admin = sa.create_engine(resolve_url(self.admin_url), isolation_level="AUTOCOMMIT")
        try:
            with admin.connect() as conn:
                force = " WITH (FORCE)" if admin.dialect.name == "postgresql" else ""
                conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {self.name}{force}")
        finally:
            admin.dispose()


def create(backend: str, directory: Path, admin_url: str | None = None) -> CampaignDatabase:
    """A fresh database for one campaign run (on the server of ``admin_url``, by default the
    test suite's)."""
    if backend == "sqlite":
        return CampaignDatabase(f"sqlite:///{directory / 'campaign.db'}", None, None)
    admin_url = admin_url or ADMIN_URLS[backend]
    name = f"sqllocker_campaign_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(resolve_url(admin_url), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f"CREATE DATABASE {name}")
    finally:
        admin.dispose()
    url = make_url(resolve_url(admin_url)).set(database=name)
    return CampaignDatabase(url.render_as_string(hide_password=False), name, admin_url)


def through_port(url: str, port: int) -> str:
    """``url`` reaching its server on 127.0.0.1:``port`` (the stall proxy) instead."""
    return make_url(url).set(host="127.0.0.1", port=port).render_as_string(hide_password=False)


def server_port(url: str) -> int:
    parsed = make_url(url)
    return parsed.port or {"postgresql": 5432, "mysql": 3306}[parsed.get_backend_name()]
