"""What ``weakref.finalize`` does for a dropped lock, for a third of its cost.

Every lock gets a finaliser that releases its row if the caller drops it while held, and that
``unlock()`` detaches. ``weakref.finalize`` made and detached was a noticeable share of the
library's own Python in an uncontended cycle; this one gives the same guarantees for about a
third of that:

- it runs once, when its owner is garbage-collected, cycles included: the registry, not the
  owner, keeps the weak reference alive, so the collector calls back as it frees the owner;
- or at interpreter exit, newest first, with the collector paused, for owners still alive then
  (a script that ends without unlocking gives its rows back rather than leaving them to expire);
- never after that exit pass (interpreter teardown, with modules half gone), and never once
  detached.
"""

from __future__ import annotations

import atexit
import gc
import sys
import weakref
from collections.abc import Callable
from typing import Any

# Each live finaliser's weak reference, mapped to what to call: dict operations are atomic
# under the GIL, so no lock is needed.
_pending: dict[weakref.ref[Any], tuple[Callable[[Any], None], Any]] = {}
_shut_down = False


class Finaliser:
    """Calls ``callback(argument)`` once, when ``owner`` is collected or the interpreter exits,
    unless :meth:`detach` is called first. Calling it runs the callback now (if still due)."""

    __slots__ = ("_ref",)

    def __init__(self, owner: object, callback: Callable[[Any], None], argument: Any) -> None:
        self._ref = weakref.ref(owner, _collected)
        _pending[self._ref] = (callback, argument)

    def detach(self) -> None:
        """Never call back."""
        _pending.pop(self._ref, None)

    def __call__(self) -> None:
        _collected(self._ref)


def _collected(ref: weakref.ref[Any]) -> None:
    due = _pending.pop(ref, None)
    if due is not None and not _shut_down:
        callback, argument = due
        callback(argument)


@atexit.register  # at import: atexit runs hooks last in, first out, so every hook registered
# after sqllocker was imported (say, a caller's last work under its locks) runs before this
def _run_all_at_exit() -> None:
    global _shut_down
    collecting = gc.isenabled()
    gc.disable()  # no collection may start another finaliser's callback meanwhile
    try:
        while _pending:
            _ref, (callback, argument) = _pending.popitem()  # the newest first
            try:
                callback(argument)
            except Exception:
                sys.excepthook(*sys.exc_info())
    finally:
        _shut_down = True
        if collecting:
            gc.enable()
