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

An owner freed by the cycle collector is freed wherever the collector happens to run: at any
allocation, in any code, sqllocker's own included, say half-way through setting up a connection
with the set-up lock held. A release run there would wait for that lock for ever, so what the
collector frees is called back on a thread of its own (``_Deferred``) instead; an owner freed by
its last reference going is called back at once, where that happened.
"""

from __future__ import annotations

import atexit
import gc
import os
import queue
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

from . import forks

# Each live finaliser's weak reference, mapped to what to call: dict operations are atomic
# under the GIL, so no lock is needed.
Due = tuple[Callable[[Any], None], Any]  # a callback and its argument
_pending: dict[weakref.ref[Any], Due] = {}
_shut_down = False


class Finaliser:
    """Calls ``callback(argument)`` once, when ``owner`` is collected or the interpreter exits,
    unless :meth:`detach` is called first. Calling it runs the callback now (if still due)."""

    __slots__ = ("_ref",)

    def __init__(self, owner: object, callback: Callable[[Any], None], argument: Any) -> None:
        self._ref = weakref.ref(owner, _collected)
        _pending[self._ref] = (callback, argument)
        if _deferred.pid != forks.pid:
            _deferred.start()  # here, not where the collector runs: see _Deferred
        if _collecting not in gc.callbacks:  # cleared by another library since
            gc.callbacks.append(_collecting)

    def detach(self) -> None:
        """Never call back."""
        _pending.pop(self._ref, None)

    def __call__(self) -> None:
        due = _pending.pop(self._ref, None)
        if due is not None and not _shut_down:
            _call(*due)


def _collected(ref: weakref.ref[Any]) -> None:
    due = _pending.pop(ref, None)
    if due is None or _shut_down:
        return
    if _collecting.thread == threading.get_ident():
        _deferred.put(due)
    else:
        _call(*due)


def _call(callback: Callable[[Any], None], argument: Any) -> None:
    try:
        callback(argument)
    except Exception:
        sys.excepthook(*sys.exc_info())


class _Collecting:
    """Which thread the cycle collector runs in, while it runs (``gc.callbacks``)."""

    thread: int | None = None

    def __call__(self, phase: str, _info: dict[str, int]) -> None:
        self.thread = threading.get_ident() if phase == "start" else None


class _Deferred:
    """The callbacks of owners the cycle collector freed. Where the collector runs they are
    only queued (a C queue: nothing there waits for a lock the interrupted code may hold, as
    starting a thread would); a thread of this process's own, started with its first
    finaliser, runs each on a thread of its own, so that a release stuck on one database
    holds up no other; at interpreter exit, what is queued runs there, and what runs is
    waited for."""

    def __init__(self) -> None:
        self.pid: int | None = None  # of the process whose thread serves the queue
        self._forget()

    def _forget(self) -> None:
        """Nothing queued or running yet: in a forked child, what the parent queued and ran,
        and its locks, held maybe by its threads, are not the child's."""
        self.pid = None
        self._queue: queue.SimpleQueue[Due] = queue.SimpleQueue()
        self._wake: queue.SimpleQueue[None] = queue.SimpleQueue()  # one per callback queued
        self._guard = threading.Lock()  # over taking a callback, and the runs
        self._runs: set[threading.Thread] = set()
        self._closing = False

    def start(self) -> None:
        thread = threading.Thread(
            target=self._serve,
            args=(self._queue, self._wake),
            name="sqllocker-finaliser",
            daemon=True,
        )
        try:
            thread.start()
        except RuntimeError:  # no thread to be had: tried again with the next finaliser
            return
        self.pid = forks.pid

    def put(self, due: Due) -> None:
        self._queue.put(due)
        self._wake.put(None)

    def _serve(self, served: queue.SimpleQueue[Due], wake: queue.SimpleQueue[None]) -> None:
        while True:
            wake.get()
            with self._guard:  # taken only here: drain() takes it, or waits for its run
                if self._closing:
                    return
                try:
                    due = served.get_nowait()
                except queue.Empty:
                    continue
                run = threading.Thread(
                    target=self._run, args=(due,), name="sqllocker-finaliser run", daemon=True
                )
                self._runs.add(run)
                try:
                    run.start()
                except RuntimeError:
                    self._runs.discard(run)
                    _call(*due)

    def _run(self, due: Due) -> None:
        try:
            _call(*due)
        finally:
            with self._guard:
                self._runs.discard(threading.current_thread())

    def drain(self) -> None:
        """Run what is queued, here and now, and wait for what runs; nothing starts after."""
        while True:
            with self._guard:
                self._closing = True
                runs = list(self._runs)
                queued = []
                while True:
                    try:
                        queued.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
            if not queued and not runs:
                return
            for due in queued:
                _call(*due)
            for run in runs:
                run.join()


_collecting = _Collecting()
gc.callbacks.append(_collecting)
_deferred = _Deferred()
os.register_at_fork(after_in_child=_deferred._forget)


@atexit.register  # at import: atexit runs hooks last in, first out, so every hook registered
# after sqllocker was imported (say, a caller's last work under its locks) runs before this
def _run_all_at_exit() -> None:
    global _shut_down
    collecting = gc.isenabled()
    gc.disable()  # no collection may start another finaliser's callback meanwhile
    try:
        _deferred.drain()
        while _pending:
            _ref, due = _pending.popitem()  # the newest first
            _call(*due)
    finally:
        _shut_down = True
        if collecting:
            gc.enable()
