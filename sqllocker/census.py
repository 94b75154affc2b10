"""What the lock table holds now, read for operators' monitoring (``sqllocker exporter``).

A census reads only the columns ``lockstring``, ``created`` and ``expires`` of the lock table
(never the secret ``guid``, never ``locked_by``), and on PostgreSQL and MySQL/MariaDB the
``lockstring`` and ``liveness_key`` of the waiters' tickets (``sqllocker.tickets``), so a role
granted SELECT on those columns alone can take it: see docs/observability.md. Times are the
database server's, as every expiry is judged by its clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from .backends import Backend, backend_for
from .row_kinds import LIKE_PATTERNS, LOCK, PERMIT, READER, TURN, WRITER, kind_of, writer_name
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
    kind: str = LOCK  # what the row is (``sqllocker.row_kinds``): lock, permit, reader, ...


@dataclass(frozen=True)
class TableCensus:
    """The table as a whole, and the rows of the lockstrings asked for."""

    table: str
    # Unexpired locks: rows, less semaphores' turns (a waiter's place, in ``turns``) and the
    # second row each writer of a read-write lock holds (so that a writer counts once).
    held: int
    expired: int  # expired rows the purge has not deleted yet
    oldest_held_seconds: float  # the longest a held lock's row has existed; 0 with none
    waiters: int | None  # live tickets, all lockstrings; None where there are none to count
    # Held locks told apart by their rows: readers, writers (those past their readers) and
    # permits; the rest of ``held`` are plain locks and the claims writers hold on names.
    held_by_kind: dict[str, int] = field(default_factory=dict)
    turns: int = 0  # unexpired semaphores' turns: waiters, not holders
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
        text = backend.as_text(c.lockstring)
        kind = sa.case(
            *((text.like(sa.literal(like)), sa.literal(name)) for name, like in LIKE_PATTERNS),
            else_=sa.literal(LOCK),
        )
        each = sa.select(
            kind.label("kind"),
            sa.case((held, 1), else_=0).label("held"),
            sa.case((held, c.created)).label("held_since"),
        ).subquery()
        by_kind = conn.execute(
            sa.select(
                each.c.kind,
                sa.func.count().label("total"),
                sa.func.coalesce(sa.func.sum(each.c.held), 0).label("held"),
                sa.func.min(each.c.held_since).label("oldest"),
            ).group_by(each.c.kind)
        ).all()
        server_now = _utc(conn.execute(sa.select(now.label("server_now"))).scalar_one())
        waiting = _waiters(conn, backend, name)
        locks: list[LockCensus] = []
        more = False
        if pattern is not None and max_locks > 0:
            listed = conn.execute(
                sa.select(
                    backend.readable_text(c.lockstring).label("lockstring"),
                    c.created,
                    c.expires,
                    now.label("server_now"),
                )
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
                        kind=kind_of(row.lockstring),
                    )
                )
    counted = {row.kind: int(row.held) for row in by_kind}
    locks_rows = [row for row in by_kind if row.kind not in (TURN, WRITER)]
    since = [_utc(row.oldest) for row in locks_rows if row.oldest is not None]
    oldest = max(0.0, (server_now - min(since)).total_seconds()) if since else 0.0
    return TableCensus(
        table=name,
        held=sum(int(row.held) for row in locks_rows),
        expired=sum(int(row.total) - int(row.held) for row in by_kind),
        oldest_held_seconds=oldest,
        waiters=None if waiting is None else sum(waiting.values()),
        held_by_kind={kind: counted.get(kind, 0) for kind in (READER, WRITER, PERMIT)},
        turns=counted.get(TURN, 0),
        locks=_with_writers(locks),
        more_locks=more,
    )


def _with_writers(locks: list[LockCensus]) -> list[LockCensus]:
    """``locks`` with the claim of each writer whose token row is among them as a writer."""
    writers = {
        name
        for lock in locks
        if not lock.expired and (name := writer_name(lock.lockstring)) is not None
    }
    return [
        replace(lock, kind=WRITER) if lock.lockstring in writers and lock.kind == LOCK else lock
        for lock in locks
    ]


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
