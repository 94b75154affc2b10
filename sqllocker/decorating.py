# Generated from sqllocker/asyncio/decorating.py by tests/unasync.py: edit that file, then
# run `python -m tests.unasync`.
"""The locker's decorator: a function run under a lock (``Locker.locked``).

Written once for asyncio; the sync ``sqllocker/decorating.py`` is generated from it
(``tests/unasync.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from . import concurrency
from .decorators import check_decoration, finished, lock_namer, when_busy
from .errors import LockBusy
from .lock import LockTaker
from .telemetry import named

P = ParamSpec("P")
R = TypeVar("R")


def lock_decorator(
    locker: LockTaker,
    lockstring: str | None,
    key: Callable[..., str] | None,
    wait: float | None,
    on_busy: str,
    expires: float | None,
    keep_alive: bool,
    hold_at_least: float | None,
) -> Callable[[Callable[P, R]], Callable[P, R | None]]:
    """``locker.locked()``'s decorator, its arguments checked now."""
    behaviour = check_decoration(on_busy, wait, expires, hold_at_least)

    def decorate(function: Callable[P, R]) -> Callable[P, R | None]:
        concurrency.check_decorated(function)
        name_lock = lock_namer(lockstring, key, function)
        # What telemetry names these locks by: the template, never a call's own name.
        recorded_as = lockstring if lockstring is not None else function.__qualname__

        @functools.wraps(function)
        def under_lock(*args: P.args, **kwargs: P.kwargs) -> R | None:
            name = name_lock(args, kwargs)
            try:
                with named(recorded_as):
                    lock = locker.lock(
                        name,
                        wait=wait,
                        expires=expires,
                        keep_alive=keep_alive,
                        hold_at_least=hold_at_least,
                    )
            except LockBusy as busy:
                when_busy(behaviour, function, busy)
                return None
            with lock:
                return finished(function, function(*args, **kwargs))

        return under_lock

    return decorate
