"""What the lock table holds now, read for operators' monitoring (``sqllocker exporter``).

A census reads only the columns ``lockstring``, ``created`` and ``expires`` of the lock table
(never the secret ``guid``, never ``locked_by``), and on PostgreSQL and MySQL/MariaDB the
``lockstring`` and ``liveness_key`` of the waiters' tickets (``sqllocker.tickets``), so a role
granted SELECT on those columns alone can take it: see docs/observability.md. Times are the
database server's, as every expiry is judged by its clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from .backends import Backend, backend_for
from .schema import lock_table, to_utc
from .validation import check_table_name


@dataclass(frozen=True)
class LockCensus:
    """One lockstring's row, as a census saw it."""

    lockstring: str
    expired: bool
    held_seconds: float  # since the row was created, by the server's clock
    seconds_left: float  # until it expires; negative once expired
    waiters: int | None  # live tickets for it; None where waiters keep none in the database


@dataclass(frozen=True)
class TableCensus:
    """The table as a whole, and the rows of the lockstrings asked for."""

    table: str
    held: int  # unexpired rows
    expired: int  # expired rows the purge has not deleted yet
    oldest_held_seconds: float  # the longest an unexpired row has existed; 0 with none
    waiters: int | None  # live tickets, all lockstrings; None where there are none to count
    locks: list[LockCensus] = field(default_factory=list)
    more_locks: bool = False  # more lockstrings matched than were asked for


def take_census(
    engine: Engine, table: str, pattern: str | None = None, max_locks: int = 0
) -> TableCensus:
    """Read ``table``'s state on ``engine``, with the rows of at most ``max_locks`` lockstrings
    matching the glob ``pattern`` (``*`` and ``?``; none without a pattern), in lockstring
    order. Database errors propagate (SQLAlchemy's)."""
    name = check_table_name(table)
    rows = lock_table(name)
    c = rows.c
    with engine.connect() as conn:
        backend = backend_for(conn.dialect)
        now = backend.now()
        held = c.expires > now
        summary = conn.execute(
            sa.select(
                sa.func.count().label("total"),
                sa.func.coalesce(sa.func.sum(sa.case((held, 1), else_=0)), 0).label("held"),
                sa.func.min(sa.case((held, c.created))).label("oldest"),
                now.label("server_now"),
            ).select_from(rows)
        ).one()
        waiting = _waiters(conn, backend, name)
        locks: list[LockCensus] = []
        more = False
        if pattern is not None and max_locks > 0:
            listed = conn.execute(
                sa.select(c.lockstring, c.created, c.expires, now.label("server_now"))
                .where(backend.matches_glob(c.lockstring))
                .order_by(c.lockstring)
                .limit(max_locks + 1),
                {"pattern": backend.glob_value(pattern)},
            ).all()
            more = len(listed) > max_locks
            for row in listed[:max_locks]:
                server_now = _utc(row.server_now)
                left = (_utc(row.expires) - server_now).total_seconds()
                locks.append(
                    LockCensus(
                        lockstring=row.lockstring,
                        expired=left <= 0,
                        held_seconds=max(0.0, (server_now - _utc(row.created)).total_seconds()),
                        seconds_left=left,
                        waiters=None if waiting is None else waiting.get(row.lockstring, 0),
                    )
                )
    oldest = 0.0
    if summary.oldest is not None:
        oldest = max(0.0, (_utc(summary.server_now) - _utc(summary.oldest)).total_seconds())
    return TableCensus(
        table=name,
        held=int(summary.held),
        expired=int(summary.total) - int(summary.held),
        oldest_held_seconds=oldest,
        waiters=None if waiting is None else sum(waiting.values()),
        locks=locks,
        more_locks=more,
    )


def live_waiters(engine: Engine, table: str) -> dict[str, int] | None:
    """How many live tickets stand for each lockstring (those with none left out), or None
    where waiters keep no tickets in the database (SQLite)."""
    name = check_table_name(table)
    with engine.connect() as conn:
        return _waiters(conn, backend_for(conn.dialect), name)


def _waiters(conn: sa.Connection, backend: Backend, table: str) -> dict[str, int] | None:
    statement = backend.live_waiters(table)
    if statement is None:
        return None
    return {row.lockstring: int(row.waiters) for row in conn.execute(statement)}


def _utc(value: Any) -> datetime:
    moment = to_utc(value)
    assert moment is not None, "a timestamp column is NOT NULL, and the server's clock is read"
    return moment
