"""The write each critical section makes: in one transaction on the lock's own database,
``guard()`` every lock held, then for each lockstring a read-modify-write of its counter and a
row recording (lockstring, seq, lock_id, worker, op). A second holder shows as a lost update
(two rows with one ``seq``) or as fencing tokens out of order; a stale holder's transaction must
never commit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from sqllocker import Lock
from sqllocker.asyncio import AsyncLock
from tests.campaign.database import counters, writes


def _statements(lockstring: str) -> tuple[Any, Any]:
    read = sa.select(counters.c.value).where(counters.c.lockstring == lockstring)
    update = sa.update(counters).where(counters.c.lockstring == lockstring)
    return read, update


def write(engine: sa.Engine, locks: Sequence[Lock], worker: str, op: str) -> list[int]:
    """The guarded write; returns the ``seq`` written for each lock. LockLost if one is gone."""
    with engine.begin() as conn:
        for lock in locks:
            lock.guard(conn)
        seqs = []
        for lock in locks:
            read, update = _statements(lock.lockstring)
            seq = conn.execute(read).scalar_one() + 1
            conn.execute(update.values(value=seq))
            conn.execute(
                writes.insert().values(_row(lock.lockstring, seq, lock.lock_id, worker, op))
            )
            seqs.append(seq)
        return seqs


async def write_async(
    engine: AsyncEngine, locks: Sequence[AsyncLock], worker: str, op: str
) -> list[int]:
    conn: AsyncConnection
    async with engine.begin() as conn:
        for lock in locks:
            await lock.guard(conn)
        seqs = []
        for lock in locks:
            read, update = _statements(lock.lockstring)
            seq = (await conn.execute(read)).scalar_one() + 1
            await conn.execute(update.values(value=seq))
            row = _row(lock.lockstring, seq, lock.lock_id, worker, op)
            await conn.execute(writes.insert().values(row))
            seqs.append(seq)
        return seqs


def _row(lockstring: str, seq: int, lock_id: int, worker: str, op: str) -> dict[str, Any]:
    return {"lockstring": lockstring, "seq": seq, "lock_id": lock_id, "worker": worker, "op": op}
