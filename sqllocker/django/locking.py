"""Locks for views and management commands: ``@locked("report {day}")``."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from ..decorators import LockstringTemplate
from ..errors import LockBusy, LockValueError
from .configuration import get_locker

logger = logging.getLogger("sqllocker.django")

ON_BUSY = ("skip", "raise", "conflict")


def locked(
    lockstring: str,
    *,
    wait: float | None = 0,
    on_busy: str = "skip",
    expires: float | None = None,
    keep_alive: bool = True,
    hold_at_least: float | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Run the decorated function under the lock ``lockstring``, a ``str.format`` template over
    its arguments as ``locker.locked`` names its locks (a command's ``handle`` names its options
    ``{options[day]}``), with the Locker of the ``SQLLOCKER`` setting.

    When the lock is held elsewhere: ``on_busy="skip"`` returns None without calling the function
    (logged at INFO), ``"raise"`` raises LockBusy, ``"conflict"`` (for views) returns a 409
    response saying who holds it. The lock is kept alive while the function runs, and LockLost
    is raised at the end if it was lost meanwhile.
    """
    if on_busy not in ON_BUSY:
        raise LockValueError(f"on_busy must be 'skip', 'raise' or 'conflict', not {on_busy!r}")

    def decorate(function: Callable[..., Any]) -> Callable[..., Any]:
        template = LockstringTemplate(lockstring, function)

        @functools.wraps(function)
        def under_lock(*args: Any, **kwargs: Any) -> Any:
            name = template.render(args, kwargs)
            try:
                lock = get_locker().lock(
                    name,
                    wait=wait,
                    expires=expires,
                    keep_alive=keep_alive,
                    hold_at_least=hold_at_least,
                )
            except LockBusy as busy:
                if on_busy == "raise":
                    raise
                if on_busy == "conflict":
                    from django.http import HttpResponse

                    return HttpResponse(str(busy), status=409, content_type="text/plain")
                logger.info("skipped %s: %s", function.__qualname__, busy)
                return None
            with lock:
                return function(*args, **kwargs)

        return under_lock

    return decorate
