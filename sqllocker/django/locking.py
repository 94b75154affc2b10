"""Locks for views and management commands: ``@locked("report {day}")``."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from ..concurrency import check_decorated
from ..decorators import LockstringTemplate, check_decoration, finished
from ..errors import LockBusy, LockError, LockTypeError
from .configuration import get_locker
from .guarding import restore_silence_limits

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

    Called inside a transaction (``transaction.atomic()``, a view under ATOMIC_REQUESTS), it
    raises LockError: the lock would be released before the transaction commits, and the next
    holder would not see what this one wrote (``transaction.non_atomic_requests`` above it
    leaves a view out of ATOMIC_REQUESTS). A coroutine function, which would run after the
    release, and bad options are refused when the function is decorated.
    """
    check_decoration(on_busy, wait, expires, hold_at_least, ON_BUSY)

    def decorate(function: Callable[..., Any]) -> Callable[..., Any]:
        check_decorated(function)
        template = LockstringTemplate(lockstring, function)

        @functools.wraps(function)
        def under_lock(*args: Any, **kwargs: Any) -> Any:
            name = template.render(args, kwargs)
            _refuse_in_a_transaction(function, name)
            restore_silence_limits()
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
                return _finished_response(function, finished(function, function(*args, **kwargs)))

        return under_lock

    return decorate


def _finished_response(function: Callable[..., Any], result: Any) -> Any:
    """``result``, rendered now if it is a response still to be rendered (a
    ``TemplateResponse``, as every generic view returns: Django renders it after the view
    returns, its template's queries and code after the release); refused (LockTypeError, and
    closed) if it is a streaming response, whose content would be made as it is sent."""
    if (
        getattr(result, "is_rendered", True) is False
        and getattr(result, "template_name", None) is not None
        and callable(getattr(result, "render", None))
    ):
        # (A template response without a template, Django REST framework's Response, is
        # rendered by its framework's code once the view returns: left to it.)
        result.render()
    if getattr(result, "streaming", False) is True:
        result.close()
        raise LockTypeError(
            f"{function.__qualname__} returned a streaming response under @locked: its content "
            "would be made after the lock is released, beside the next holder; make the "
            "content under the lock, or take the lock inside its generator"
        )
    return result


def _refuse_in_a_transaction(function: Callable[..., Any], name: str) -> None:
    from django.db import DEFAULT_DB_ALIAS, connections

    inside = [
        connection.alias
        for connection in connections.all(initialized_only=True)
        if _in_a_transaction(connection)
    ]
    # Autocommit turned off in the settings: a thread's first connection, not made yet, will
    # begin a transaction of its own with its first statement.
    inside += [alias for alias in connections if connections.settings[alias]["AUTOCOMMIT"] is False]
    if inside:
        alias = inside[0]
        using = "" if alias == DEFAULT_DB_ALIAS else f"(using={alias!r})"
        raise LockError(
            f"{function.__qualname__} runs under @locked inside a transaction on {alias!r} "
            "(transaction.atomic(), a view under ATOMIC_REQUESTS, or autocommit turned off): "
            "its lock would be released before that transaction commits, and the next holder "
            "would not see what it wrote; take the lock outside the transaction (a view: put "
            f"@transaction.non_atomic_requests{using} above @locked)",
            name,
        )


def _in_a_transaction(connection: Any) -> bool:
    """Whether Django's ``connection`` is in a transaction of the code's own: an atomic block
    (not one a ``TestCase`` opened around its test, which is rolled back, never committed), or
    autocommit turned off by hand."""
    if any(not getattr(block, "_from_testcase", False) for block in connection.atomic_blocks):
        return True
    return (
        connection.connection is not None
        and not connection.in_atomic_block
        and not connection.get_autocommit()
    )
