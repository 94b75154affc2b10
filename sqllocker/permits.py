"""Counting semaphores on the lock table (``Locker.semaphore``): at most ``limit`` holders of
one name at once.

Each permit is an ordinary lock row under the same unique constraint, on the lockstring
``<name> (permit <slot>)`` for a slot in ``[0, limit)``: the row is the permit, with its own
fencing token, expiry, keep-alive and takeover, and ``sqllocker list`` and the view show it as
the name with its slot. No new consistency mechanism: the unique constraint alone keeps two
holders off one slot.

What the slots alone do not decide is a change of ``limit`` between callers: permits taken with
``limit=5`` occupy slots 3 and 4, which a caller with ``limit=3`` never tries. So a newcomer,
once its row is in, counts the live permits of the name (its own included) and keeps its permit
only if they are no more than its limit; otherwise it gives it back at once and counts as
refused. The rows go in before the counts are read, so of any two newcomers the later one to
count sees the other's row: no more than ``limit`` callers ever hold a permit that the smaller
limit admitted, and a smaller limit admits no newcomer until enough permits are released.

A permit given back because its count was too high was never granted: its row is deleted at
once, whatever ``hold_at_least`` the caller asked for (which applies to granted permits only).

**Turns.** Beside callers with a larger limit, which keep the count up to theirs, a caller
with a smaller limit would find the count too high nearly every time and starve. So a waiter
refused for its smaller limit (its row counted past it, or every one of its slots held while
more permits than its limit are live) takes the semaphore's *turn*: one more lock row, on
``<name> (turn)``, that says its limit (``locked_by.semaphore_limit``) and is kept alive while
it waits. While a live turn is someone else's, a newcomer keeps its permit only if the count,
its own included, leaves room for the waiter whose turn it is (at most that waiter's limit less
one): the holders drain down to the smaller limit as they release, and that waiter gets in. It
gives the turn up once it has its permit, stops waiting, or is cancelled; a turn whose waiter
died expires within ``TURN_EXPIRES`` seconds (plus the locker's grace). One waiter has the turn
at a time: others refused for a smaller limit take it after, one by one. Turns only ever refuse
a permit, never grant one, so they cannot let more holders in than the counts above allow; a
turn row written by anyone else (an operator) can only hold newcomers back, until it expires.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

from .errors import LockBusy, LockTypeError, LockValueError
from .validation import MAX_LOCKSTRING_LENGTH, check_lockstring

if TYPE_CHECKING:
    from .operations import LockInfo

MAX_LIMIT = 1000
_SLOT = " (permit {slot})"
_TURN = " (turn)"
# Seconds a waiter's turn lasts unrenewed: it is kept alive while the waiter waits, so this is how
# long a turn whose waiter died holds newcomers back.
TURN_EXPIRES = 10.0
_TURN_LIMIT = "semaphore_limit"
_LONGEST_SLOT = len(_SLOT.format(slot=MAX_LIMIT - 1))


def check_semaphore(name: object, limit: object) -> tuple[str, int]:
    """A semaphore's name (a lockstring, short enough for its longest slot) and limit."""
    checked = check_lockstring(name)
    if len(checked) > MAX_LOCKSTRING_LENGTH - _LONGEST_SLOT:
        raise LockValueError(
            f"a semaphore's name is at most {MAX_LOCKSTRING_LENGTH - _LONGEST_SLOT} characters "
            f"(its permits' lockstrings add the slot): {checked[:40]!r}...",
            checked,
        )
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise LockTypeError(f"limit must be an int, not {type(limit).__name__}", checked)
    if not 1 <= limit <= MAX_LIMIT:
        raise LockValueError(f"limit must be 1 to {MAX_LIMIT}, not {limit}", checked)
    return checked, limit


def permit_lockstring(name: str, slot: int) -> str:
    return name + _SLOT.format(slot=slot)


def permit_pattern(name: str) -> tuple[str, str]:
    """The glob of every permit of ``name``: the name taken literally, then any slot (as
    ``(literal prefix, wildcard suffix)``, for ``Backend.permit_glob``)."""
    return name, _SLOT.format(slot="*")


def slots_to_try(limit: int) -> list[int]:
    """Every slot once, in random order: waiters spread over the free slots instead of all
    meeting on the first."""
    slots = list(range(limit))
    random.shuffle(slots)
    return slots


def refused(name: str, limit: int, wait: float | None) -> LockBusy:
    busy = LockBusy(name, waited=0.0 if wait is None else wait)
    busy.message = (
        f"semaphore {name!r}: all {limit} permits are held"
        + (f"; gave up after waiting {wait:.3g}s" if wait else "")
        + f"; `sqllocker list {name!r}*` shows their holders"
    )
    busy.args = (busy.message,)  # repr() and pickling say the same as str()
    return busy


def turn_lockstring(name: str) -> str:
    """The lockstring of ``name``'s turn (which its permits' glob does not match)."""
    return name + _TURN


def turn_details(limit: int) -> dict[str, Any]:
    """What a turn's row says beside its holder: the limit of the waiter whose turn it is."""
    return {_TURN_LIMIT: limit}


def admits(limit: int, live: int, turn: LockInfo | None, own_turn: int | None) -> bool:
    """Whether a newcomer with ``limit`` keeps its permit, with ``live`` permits counted (its own
    among them) and the semaphore's ``turn`` row as read with them (``own_turn``: the id of the
    turn the newcomer holds, if any): at most its limit, and while someone else's turn is live,
    room left for that waiter."""
    if live > limit:
        return False
    if turn is None or turn.expired or turn.lock_id == own_turn:
        return True
    waiting = turn.locked_by.get(_TURN_LIMIT)
    if isinstance(waiting, bool) or not isinstance(waiting, int) or not 1 <= waiting <= MAX_LIMIT:
        return True  # not a turn's row: nothing to make room for
    return live < waiting
