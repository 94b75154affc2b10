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
"""

from __future__ import annotations

import random

from .errors import LockBusy, LockTypeError, LockValueError
from .validation import MAX_LOCKSTRING_LENGTH, check_lockstring

MAX_LIMIT = 1000
_SLOT = " (permit {slot})"
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
