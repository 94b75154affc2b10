"""The SQLAlchemy internals of ``sqllocker.sqlalchemy_internals``, against the installed
SQLAlchemy (CI runs this with the oldest version the project declares, and the newest)."""

from __future__ import annotations

import asyncio

import sqlalchemy as sa
from greenlet import getcurrent, greenlet
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.pool import QueuePool
from sqlalchemy.util.concurrency import in_greenlet

from sqllocker.sqlalchemy_internals import (
    bind_order,
    commits_each_statement,
    lets_await,
    literal_binds,
    most_connections,
)

try:
    from sqlalchemy.util import await_
except ImportError:  # SQLAlchemy 2.0 calls it await_only
    from sqlalchemy.util import await_only as await_


def test_most_connections_is_the_pools_size_plus_its_overflow(tmp_path: object) -> None:
    engine = sa.create_engine(
        f"sqlite:///{tmp_path}/x.db", poolclass=QueuePool, pool_size=3, max_overflow=4
    )
    assert isinstance(engine.pool, QueuePool)
    assert most_connections(engine.pool) == 7
    unlimited = sa.create_engine(
        f"sqlite:///{tmp_path}/y.db", poolclass=QueuePool, pool_size=2, max_overflow=-1
    )
    assert isinstance(unlimited.pool, QueuePool)
    assert most_connections(unlimited.pool) is None


def test_bind_order_and_literal_binds_of_a_compiled_statement() -> None:
    statement = sa.select(
        sa.func.strftime("%Y", "now"), sa.bindparam("given"), sa.bindparam("other")
    )
    for dialect in (sqlite.dialect(), mysql.dialect(), postgresql.dialect()):
        compiled = statement.compile(dialect=dialect)
        binds = literal_binds(compiled)  # type: ignore[arg-type]
        assert binds["given"] is None  # to be supplied on each execution
        assert binds["other"] is None
        assert sorted(value for value in binds.values() if value is not None) == ["%Y", "now"]
        order = bind_order(compiled)  # type: ignore[arg-type]
        if dialect.positional:
            assert order is not None
            assert sorted(order) == sorted(binds)
            assert list(order)[-2:] == ["given", "other"]
        else:
            assert not order


async def test_a_greenlet_marked_by_lets_await_may_await_through_its_parent() -> None:
    @lets_await
    class Marked(greenlet):  # type: ignore[misc]
        pass

    def awaits() -> tuple[bool, str]:
        return in_greenlet(), await_(asyncio.sleep(0, result="awaited"))

    marked = Marked(awaits, getcurrent())
    outcome = marked.switch()  # the coroutine await_ handed to its parent, this greenlet
    while not marked.dead:
        outcome = marked.switch(await outcome)
    assert outcome == (True, "awaited")


def test_commits_each_statement_reads_the_connections_and_the_engines_isolation_level() -> None:
    plain = sa.create_engine("sqlite://")
    autocommitting = sa.create_engine("sqlite://", isolation_level="AUTOCOMMIT")
    try:
        with plain.connect() as conn:
            assert not commits_each_statement(conn)
            assert commits_each_statement(conn.execution_options(isolation_level="AUTOCOMMIT"))
        with autocommitting.connect() as conn:
            assert commits_each_statement(conn)
            assert not commits_each_statement(
                conn.execution_options(isolation_level="SERIALIZABLE")
            )
    finally:
        plain.dispose()
        autocommitting.dispose()
