"""What a row of the lock table is, for those who look at the table (``list``, ``show``,
``top``, the exporter): a plain ``lock``, a semaphore's ``permit`` or its ``turn`` (a waiter's
place: see ``sqllocker.permits``), a read-write lock's ``reader`` or ``writer`` (both of a
writer's rows: see ``sqllocker.rwlocks``), or an election's ``leader`` (its writer).

Told by ``locked_by`` where the reader may read it, and otherwise (the exporter's role reads
the lockstring alone) by the lockstring's suffix, which a plain lock's name could also end
with: the kind is a label for people, never something a lock decides by.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

LOCK = "lock"
PERMIT = "permit"
TURN = "turn"
READER = "reader"
WRITER = "writer"
LEADER = "leader"

# The suffixes of permits.py's and rwlocks.py's lockstrings.
_SUFFIXES = (
    (TURN, re.compile(r" \(turn\)\Z")),
    (PERMIT, re.compile(r" \(permit \d+\)\Z")),
    (READER, re.compile(r" \(reader [0-9a-f]{16}\)\Z")),
    (WRITER, re.compile(r" \(writer [0-9a-f]{16}\)\Z")),
)
# The same, as LIKE patterns for a census (``_`` is one character, ``%`` any run).
LIKE_PATTERNS = (
    (TURN, "% (turn)"),
    (PERMIT, "% (permit %)"),
    (READER, "% (reader %)"),
    (WRITER, "% (writer %)"),
)


def kind_of(lockstring: str, locked_by: Mapping[str, Any] | None = None) -> str:
    """The kind of the row ``lockstring``, by its ``locked_by`` if given, else its suffix."""
    if locked_by is not None:
        side = locked_by.get("rwlock")
        if side in ("writer", "writer's fence"):
            return LEADER if locked_by.get("election") == "leader" else WRITER
        if side == "reader":
            return READER
        if "semaphore_limit" in locked_by and lockstring.endswith(" (turn)"):
            return TURN
    for kind, suffix in _SUFFIXES:
        if suffix.search(lockstring) and (kind != TURN or locked_by is None):
            return kind
    return LOCK


def writer_name(lockstring: str) -> str | None:
    """The name of the read-write lock whose writer's token row ``lockstring`` is, or None."""
    match = _SUFFIXES[3][1].search(lockstring)
    return lockstring[: match.start()] if match else None
