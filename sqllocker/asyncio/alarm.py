"""The deadlines of an event loop's bounded works (``concurrency.within``), on one timer.

Every lock cycle's release is bounded by the lock's life. A timer of its own each
(``loop.call_later``), made and cancelled, cost that cycle more than the rest of the bound: the
loop keeps its timers in a heap of Python objects, compared one by one, and a cancelled timer
stays in it until its time comes. So the loop's bounded works share one timer, set for the
earliest of their deadlines and, when it rings, for the earliest of those still waiting: a work
that ends before its deadline only leaves the table.
"""

from __future__ import annotations

import asyncio
import logging
import math
import weakref
from collections.abc import Callable
from typing import Protocol

logger = logging.getLogger("sqllocker")


class Bounded(Protocol):
    """What the alarm tells when its deadline has come."""

    def expire(self) -> None: ...


def _NO_TIMER() -> None:
    return None


class Alarm:
    """The deadlines (on ``loop.time()``) of ``loop``'s bounded works."""

    __slots__ = ("__weakref__", "_at", "_due", "_loop", "_timer")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        # The loop's timer holds the loop; its alarm, kept for it, must not.
        self._loop: Callable[[], asyncio.AbstractEventLoop | None] = weakref.ref(loop)
        self._due: dict[Bounded, float] = {}
        # Weakly too: a timer handle holds its loop, and the alarm outlives a closed loop
        # (``_last``, or as the value of the loop's own entry in ``_alarms``).
        self._timer: Callable[[], asyncio.TimerHandle | None] = _NO_TIMER
        self._at = math.inf  # when the timer rings

    def set(self, work: Bounded, when: float) -> None:
        """Call ``work.expire()`` at ``when``, unless ``clear(work)`` comes first."""
        self._due[work] = when
        if when < self._at:
            self._wind(when)

    def clear(self, work: Bounded) -> None:
        self._due.pop(work, None)

    def _wind(self, when: float) -> None:
        loop = self._loop()
        if loop is None or loop.is_closed():
            return
        timer = self._timer()
        if timer is not None:
            timer.cancel()
        handle = loop.call_at(when, self._ring)
        try:
            self._timer = weakref.ref(handle)
        except TypeError:  # a loop's handle that cannot be referred to weakly: held
            self._timer = lambda: handle
        self._at = when

    def _ring(self) -> None:
        self._timer, self._at = _NO_TIMER, math.inf
        loop = self._loop()
        if loop is None:
            return
        now = loop.time()
        expired = [work for work, when in self._due.items() if when <= now]
        for work in expired:
            del self._due[work]
        if self._due:
            self._wind(min(self._due.values()))
        for work in expired:
            try:
                work.expire()
            except Exception:  # one work's failure must not keep the others past their deadlines
                logger.exception("a deadline's expiry failed")


_alarms: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Alarm] = weakref.WeakKeyDictionary()
_last: Alarm | None = None  # the alarm asked for last: nearly always the running loop's


def of(loop: asyncio.AbstractEventLoop) -> Alarm:
    """``loop``'s alarm."""
    global _last
    alarm = _last
    if alarm is not None and alarm._loop() is loop:
        return alarm
    try:
        alarm = _alarms.get(loop)
        if alarm is None:
            alarm = _alarms[loop] = Alarm(loop)
    except TypeError:  # a loop that cannot be referred to weakly: an alarm for this work alone
        return _Unkept(loop)
    _last = alarm
    return alarm


class _Unkept(Alarm):
    """The alarm of one bounded work, on a loop that cannot be referred to weakly (a timer of
    its own, as before alarms were shared)."""

    __slots__ = ()

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = lambda: loop
        self._due = {}
        self._timer = _NO_TIMER
        self._at = math.inf
