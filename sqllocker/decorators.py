"""What ``Locker.locked`` and ``AsyncLocker.locked`` share: the lockstring template, checked
against the decorated function's signature when it is decorated, and what to do when the lock
is busy.

``@locker.locked("report {day}")`` names its lock by formatting the template with the
function's arguments, bound by name (defaults included), so ``report(day="2026-11-25")`` and
``report("2026-11-25")`` take the same lock.
"""

from __future__ import annotations

import inspect
import logging
import string
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .errors import LockBusy, LockTypeError, LockValueError
from .validation import check_hold_at_least, check_seconds, check_wait

logger = logging.getLogger("sqllocker")

ON_BUSY = ("skip", "raise")


def check_decoration(on_busy: object, wait: object, expires: object, hold_at_least: object) -> str:
    """The options of ``locked()``, checked when the function is decorated; returns
    ``on_busy``."""
    if on_busy not in ON_BUSY:
        raise LockValueError(f"on_busy must be 'skip' or 'raise', not {on_busy!r}")
    check_wait(wait)
    if expires is not None:
        check_seconds(expires, "expires")
    check_hold_at_least(hold_at_least)
    return str(on_busy)


class LockstringTemplate:
    """A ``str.format`` template over a function's parameters, by name."""

    def __init__(self, template: object, function: Callable[..., Any]) -> None:
        if not isinstance(template, str):
            raise LockTypeError(
                f"a lockstring template must be a str, not {type(template).__name__}"
            )
        self.template = template
        self.signature = inspect.signature(function)
        try:
            parsed = string.Formatter().parse(template)
            named = {_root(field) for _, field, _, _ in parsed if field is not None}
        except ValueError as error:
            raise LockValueError(f"lockstring template {template!r}: {error}") from error
        missing = sorted(named - set(self.signature.parameters))
        if missing:
            what = ", ".join(missing) if all(missing) else "a field by position ('{}')"
            raise LockValueError(
                f"lockstring template {template!r} names {what}, which "
                f"{function.__qualname__}{self.signature} does not take by name"
            )

    def render(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        """The lockstring for one call's arguments."""
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return self.template.format(**bound.arguments)


def _root(field: str) -> str:
    """``day`` of ``day``, ``job.name`` or ``days[0]``."""
    for separator in ".[":
        field = field.split(separator, 1)[0]
    return field


def when_busy(on_busy: str, function: Callable[..., Any], busy: LockBusy) -> None:
    """Skip the call (None, logged at INFO), or raise ``busy``."""
    if on_busy == "raise":
        raise busy
    logger.info("skipped %s: %s", function.__qualname__, busy)
