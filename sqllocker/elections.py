"""Leader election on the lock table (``Locker.election``): one leader of a name at a time.

The leader holds the row ``<name>``, an ordinary lock kept alive for as long as it leads, so
an election is a lock that candidates wait for without limit. Everything a lock guarantees
carries over: the database's clock judges the lease, the row's id is the leader's ``term``
(its fencing token: every term is greater than the terms before it), a leader that cannot
renew is told (``on_lost``) before its lease can be taken over, and ``guard`` rejects its
term from then on. Candidates queue as any waiters do (first come, first served where the
backend queues), and ``sqllocker run --standby NAME`` campaigns for the same row.

``leader()`` reads the row (read access is enough) and ``observe()`` reads it again at most
a second apart and yields each change; both say what the row says, which is only as fresh
as the moment it was read.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from .operations import LockInfo

# How often ``observe()`` reads the leader's row: a change is seen at most this late.
OBSERVE_INTERVAL = 1.0


@dataclass(frozen=True)
class Leader:
    """Who leads an election, as its row says."""

    host: str | None
    pid: int | None
    program: str | None
    since: datetime  # when it took the lead, by the server's clock
    term: int  # its fencing token: the row's id


def leader_from(info: LockInfo | None) -> Leader | None:
    """The leader a row names, or None if there is no row or it has expired."""
    if info is None or info.expired:
        return None
    details = info.locked_by
    host, pid, program = details.get("host"), details.get("pid"), details.get("program")
    return Leader(
        host=host if isinstance(host, str) else None,
        pid=pid if isinstance(pid, int) and not isinstance(pid, bool) else None,
        program=program if isinstance(program, str) else None,
        since=info.created,
        term=info.lock_id,
    )
