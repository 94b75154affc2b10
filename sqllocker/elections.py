"""Leader election on the lock table (``Locker.election``): one leader of a name at a time.

The leader is the writer of the read-write lock ``<name>`` (``rwlocks.py``), kept alive for
as long as it leads: it holds the row ``<name>`` and a fence row whose id is its ``term``. So
an election is a lock that candidates wait for without limit, and ``sqllocker run
--standby NAME`` (a plain run: the write side) campaigns for the same lead, with the same
term in ``$SQLLOCKER_LOCK_ID``. Everything a lock guarantees
carries over: the database's clock judges the lease, the fence row's id is the leader's ``term``
(its fencing token: every term is greater than the terms before it), a leader that cannot
renew is told (``on_lost``) before its lease can be taken over, and ``guard`` rejects its
term from then on. Candidates queue as any waiters do (first come, first served where the
backend queues), and ``sqllocker run --standby NAME`` campaigns for the same row.

``leader()`` reads the row (read access is enough) and ``observe()`` reads it again at most
a second apart and yields each change; both say what the row says, which is only as fresh
as the moment it was read. On PostgreSQL a writer of the name (a leader) that takes or gives
up the lead also sends ``NOTIFY sqllocker_<table>_leaders, '<name>'``, on which observers
read the row again at once: any role that can connect can send one, so it is only a hint to
read, never a leader believed, and the poll stays for what no NOTIFY says (a leader that
died, or one lost).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from .operations import LockInfo
from .row_kinds import writer_name
from .rwlocks import FENCE_CLAIM, WRITER_FENCE

# How often ``observe()`` reads the leader's row: a change is seen at most this late.
OBSERVE_INTERVAL = 1.0


# On PostgreSQL, the least time between two reads of one observer's, however many NOTIFYs come.
HINTED_READ_GAP = 0.05


@dataclass(frozen=True)
class Leader:
    """Who leads an election, as its row says."""

    host: str | None
    pid: int | None
    program: str | None
    since: datetime  # when it took the lead, by the server's clock
    term: int  # its fencing token: the row's id


def leader_from(info: LockInfo | None, fences: list[LockInfo]) -> Leader | None:
    """The leader the row ``<name>`` names, its term the id of its fence row (``fences``: the
    live ones); None if there is no live row, or it has no fence row yet (a candidate still
    waiting for readers to leave, or a plain lock of the name, which leads nothing)."""
    if info is None or info.expired:
        return None
    # A fence row drawn for this very claim (one of an older sqllocker's says not: any later);
    # not any row the fence rows' pattern matches (a semaphore's permits, a reader of a
    # read-write lock, named ``<name> (writer ...``).
    terms = [
        fence.lock_id
        for fence in fences
        if fence.lock_id > info.lock_id
        and fence.locked_by.get("rwlock") == WRITER_FENCE
        and writer_name(fence.lockstring) is not None
        and fence.locked_by.get(FENCE_CLAIM, info.lock_id) == info.lock_id
    ]
    if not terms:
        return None
    details = info.locked_by
    host, pid, program = details.get("host"), details.get("pid"), details.get("program")
    return Leader(
        host=host if isinstance(host, str) else None,
        pid=pid if isinstance(pid, int) and not isinstance(pid, bool) else None,
        program=program if isinstance(program, str) else None,
        since=info.created,
        term=max(terms),
    )
