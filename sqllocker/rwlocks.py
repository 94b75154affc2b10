"""Read-write locks on the lock table (``Locker.rwlock``): any number of readers together, or
one writer alone.

Rows, each an ordinary lock with its own fencing token, expiry, keep-alive and takeover:

- the **writer** holds the row ``<name>`` itself, the same row a plain ``locker.lock(name)``
  takes (its ``locked_by`` says ``"rwlock": "writer"``), so a plain lock of the name and a
  writer exclude each other; and, once the readers are gone, a row of its own,
  ``<name> (writer <random hex>)`` (``"rwlock": "writer's fence"``), whose id is its token;
- each **reader** holds a row of its own, ``<name> (reader <random hex>)`` (``locked_by``
  ``"rwlock": "reader"``), so ``sqllocker list 'name*'`` and the view show the readers and the
  writer for what they are.

No transaction is held and no new mechanism is needed beside the unique constraint: each side
puts its row in first and only then looks at the other side's rows.

- A reader inserts its row, then counts the live writer rows (the row ``<name>``); if there is
  one it deletes its own row again and waits.
- A writer takes the row ``<name>`` (waiting in line behind other writers and plain holders,
  as any lock does), then waits, holding it, until no live reader row is left.

Each statement sees every row committed before it, so of a reader and a writer that overlap,
the later of the two to look sees the other's row: they never both go on. A writer's row,
once in, refuses every new reader, so a stream of readers cannot starve a waiting writer, and
the readers waiting behind it all get in together when it is released, unless another writer
takes the row first: writers wait in line for it, readers in none, so writers that keep taking
turns keep readers out (writer preference).

Fencing: a writer's token must be greater than every token handed out before it, readers'
included. The id of the row ``<name>`` is drawn before the writer waits for the readers, and
on PostgreSQL and MySQL a reader's id may be drawn after it yet committed (and the reader
gone again) before the writer looks. So the writer's token is the id of a second row, drawn
once the readers are gone: every reader that held before it drew its id before then. Readers'
tokens are ordered against writers only in that direction: a reader may hold a token lower
than the last writer's.
"""

from __future__ import annotations

import secrets
from typing import Any

from .errors import LockBusy, LockValueError
from .validation import (
    MAX_LOCKSTRING_LENGTH,
    check_hold_at_least,
    check_locked_by,
    check_on_lost,
    check_seconds,
)

READER = "reader"
WRITER = "writer"
WRITER_FENCE = "writer's fence"
_READER_SUFFIX = " (reader {suffix})"
_WRITER_SUFFIX = " (writer {suffix})"
_TOKEN_HEX = 16
_LONGEST_SUFFIX = len(_READER_SUFFIX.format(suffix="0" * _TOKEN_HEX))


def check_reader_name(checked: str) -> None:
    """A read-write lock's name, to be read: short enough for its readers' suffix (the
    writer's row is the name itself, as long as any lockstring)."""
    if len(checked) > MAX_LOCKSTRING_LENGTH - _LONGEST_SUFFIX:
        raise LockValueError(
            f"a read-write lock's name is at most {MAX_LOCKSTRING_LENGTH - _LONGEST_SUFFIX} "
            f"characters (its readers' lockstrings add a suffix): {checked[:40]!r}...",
            checked,
        )


def reader_lockstring(name: str) -> str:
    """A lockstring of its own for one reader of ``name``."""
    return name + _READER_SUFFIX.format(suffix=secrets.token_hex(_TOKEN_HEX // 2))


def writer_lockstring(name: str) -> str:
    """A lockstring of its own for a writer's token row (the name cut short to fit the
    suffix: the row is found by its guid, never by its name)."""
    suffix = _WRITER_SUFFIX.format(suffix=secrets.token_hex(_TOKEN_HEX // 2))
    return name[: MAX_LOCKSTRING_LENGTH - len(suffix)] + suffix


# In a writer's fence row's locked_by: the id of the claim it was drawn for (the row of the
# name itself). Names longer than a fence row's lockstring leaves room for share a pattern:
# this tells whose fence a row is.
FENCE_CLAIM = "rwlock_claim"


def writer_fence_pattern(name: str) -> tuple[str, str]:
    """Every writer's fence row of ``name``, as ``(literal prefix, wildcard suffix)``."""
    suffix = _WRITER_SUFFIX.format(suffix="*")
    return name[: MAX_LOCKSTRING_LENGTH - _LONGEST_SUFFIX], suffix


def reader_pattern(name: str) -> tuple[str, str]:
    """Every reader row of ``name``, as ``(literal prefix, wildcard suffix)``."""
    return name, _READER_SUFFIX.format(suffix="*")


def writer_pattern(name: str) -> tuple[str, str]:
    """The writer row of ``name`` (the name itself), as ``(literal prefix, wildcard suffix)``."""
    return name, ""


def refused(name: str, side: str, wait: float | None, ran_out: float | None = None) -> LockBusy:
    """The LockBusy of a side not taken within ``wait``: held by the other side, or (a reader
    whose own row ran out before it found no writer, a writer whose claim did before its
    token was drawn) for want of time: ``ran_out``, its expiry."""
    busy = LockBusy(name, waited=0.0 if wait is None else wait)
    if ran_out is not None and side == READER:
        other = (
            f"no writer holds it, but its reader's row, {ran_out:.3g}s long, ran out before "
            "that was confirmed: give it a longer expiry"
        )
    elif ran_out is not None:
        other = (
            f"its writer's claim, {ran_out:.3g}s long, ran out before the writer's token was "
            "drawn: give it a longer expiry"
        )
    else:
        other = "a writer holds or waits for it" if side == READER else "readers hold it"
    busy.message = (
        f"read-write lock {name!r}: no {side} lock, {other}"
        + (f"; gave up after waiting {wait:.3g}s" if wait else "")
        + f"; `sqllocker list {name!r}*` shows its holders"
    )
    busy.args = (busy.message,)
    return busy


def check_side_request(
    name: str, expires: object, on_lost: object, locked_by: object, hold_at_least: object
) -> dict[str, Any]:
    """A read, write or campaign's options, checked before anything is read or written (they
    reach ``lock()`` only after the table is set up and looked at); ``locked_by`` as a dict."""
    check_on_lost(on_lost)
    if expires is not None:
        check_seconds(expires, "expires", name)
    check_hold_at_least(hold_at_least, name)
    return {} if locked_by is None else check_locked_by(locked_by, name)
