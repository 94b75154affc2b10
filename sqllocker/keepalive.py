"""Keeping held locks alive: one scheduler thread per Locker renews all of its kept-alive locks.

Each lock is renewed every ``fraction`` of its expiry period with the same statement as
``extend()`` (which never revives an expired row). The statements run on worker threads (one
unless renewals overlap: ``RENEWERS``), apart from the scheduler, so that a renewal stuck on a
stalled network delays neither the other locks' renewals nor the other duty of the scheduler:
declaring a lock lost, and calling its ``on_lost``, the moment its validity deadline passes
without a successful renewal (each lock's ``on_lost`` on a thread of its own, so that a slow one
delays no other). That moment always comes before anyone else can take the lock over (see
``lock.py``). A renewal stuck on a frozen connection ends at its lock's expiry
(``sqllocker.deadlines``).

A transient database error is logged and retried with backoff until the deadline; a lock is
declared lost only when its row is found gone or expired, or when the deadline passes. Neither
thread holds a database connection between renewals, and both end when no lock is kept alive.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import queue
import threading
import weakref
from collections.abc import Callable

from . import clock, forks
from .errors import LockError, LockLost
from .lock import LockState
from .telemetry import end_spans_in_background

logger = logging.getLogger("sqllocker")

DEFAULT_FRACTION = 1 / 3
FIRST_RETRY_DELAY = 0.05
# Renewals that may run at once, each on a worker thread of its own: one, unless every worker
# has been busy with a renewal for STUCK_SECONDS, so that other locks' renewals never wait
# behind one stuck on a frozen connection, or a renewal due has waited for a worker that long
# (a quarter of its lock's time to spare, if less), so that renewals that each take their time
# on a slow server do not fall behind.
RENEWERS = 16
STUCK_SECONDS = 0.5
# How long the threads linger with nothing to renew before they end (and are started again by
# the next keep_alive()), so an idle Locker costs no thread.
IDLE_SECONDS = 5.0

_instances: weakref.WeakSet[KeepAlive] = weakref.WeakSet()
_numbers = itertools.count(1)


class _Entry:
    __slots__ = ("failures", "in_flight", "next_renewal", "state")

    def __init__(self, state: LockState, next_renewal: float) -> None:
        self.state = state
        self.next_renewal = next_renewal
        self.in_flight: object | None = None
        self.failures = 0


def _late_at(entry: _Entry) -> float:
    """When ``entry``'s renewal, due and waiting for a worker, is late: STUCK_SECONDS after it
    was due, or a quarter of the time its lock had to spare then, if that is sooner."""
    spare = entry.state.valid_until - entry.next_renewal
    return entry.next_renewal + min(STUCK_SECONDS, spare / 4)


class _Worker:
    """A thread that renews one lock at a time, and since when it is busy (None: idle).

    A thread of its own, not a ``concurrent.futures`` executor's: those take no work once the
    interpreter has begun to exit, from the moment the main thread returns, while other
    threads, which may hold kept-alive locks, still run (their renewals stopped, and nobody
    said so at the deadline)."""

    __slots__ = ("_jobs", "busy_since")

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.busy_since: float | None = None
        threading.Thread(target=self._work, name=name, daemon=True).start()

    def submit(self, job: Callable[[], None]) -> object:
        """Run ``job`` after the ones given before; a token of it (never None)."""
        self._jobs.put(job)
        return job

    def shutdown(self) -> None:
        """End the thread once the jobs given before have run."""
        self._jobs.put(None)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except BaseException:  # an on_lost that exits, say: the worker serves on
                logger.exception("a renewal ended in an exception")


class KeepAlive:
    """The kept-alive locks of one Locker, and the threads that renew them."""

    def __init__(self, fraction: float = DEFAULT_FRACTION) -> None:
        self.fraction = fraction
        self.name = f"sqllocker-keepalive-{next(_numbers)}"
        self._reset()
        _instances.add(self)

    def _reset(self) -> None:
        self._condition = threading.Condition()
        self._entries: dict[int, _Entry] = {}
        self._thread: threading.Thread | None = None
        # Each runs one renewal at a time; another is started only while every one has been
        # busy for STUCK_SECONDS (a renewal stuck on a frozen connection), up to RENEWERS.
        self._workers: list[_Worker] = []
        self._stopping = False
        self._pid = forks.pid

    def add(self, state: LockState) -> None:
        if self._pid != forks.pid:
            self._reset()  # a forked child renews none of its parent's locks
        with self._condition:
            if not state.held or state.lost is not None:
                return
            self._entries[id(state)] = _Entry(state, state.first_renewal(self.fraction))
            self._stopping = False
            if self._thread is None or not self._thread.is_alive():
                thread = threading.Thread(target=self._schedule, name=self.name, daemon=True)
                try:
                    thread.start()
                except RuntimeError as error:  # no thread to be had (a limit on processes)
                    self._entries.pop(id(state), None)
                    raise LockError(
                        f"cannot keep lock {state.lockstring!r} alive: no thread to renew it "
                        f"({error})",
                        state.lockstring,
                    ) from error
                self._thread = thread
            self._condition.notify()

    def remove(self, state: LockState) -> None:
        # Most released locks were never kept alive, and every release comes here: they are
        # turned away without the condition. Looking unlocked is safe: an add() racing with
        # this for the same state comes from keep_alive() racing with the release, and the
        # state is then already not held, which the scheduler drops instead of renewing.
        if self._pid != forks.pid or id(state) not in self._entries:
            return
        with self._condition:
            if self._entries.pop(id(state), None) is not None:
                self._condition.notify()

    def changed(self, state: LockState) -> None:
        """``state``'s deadline came closer, or its expiry period changed (an extend() of
        another length): the scheduler looks again, and renews it by then, and by its period's
        cadence from then on (a renewal queued behind the extend is sent by the period the
        extend leaves)."""
        if self._pid != forks.pid or id(state) not in self._entries:
            return
        with self._condition:
            entry = self._entries.get(id(state))
            if entry is None:
                return
            entry.next_renewal = min(entry.next_renewal, state.renewal_by(self.fraction))
            self._condition.notify()

    def __len__(self) -> int:
        with self._condition:
            return len(self._entries)

    def stop(self) -> None:
        """Stop renewing everything; the threads end. The locks it renewed stay held until they
        expire, and are lost from now (their on_lost is called): nothing renews them."""
        if self._pid != forks.pid:
            return
        with self._condition:
            self._stopping = True
            self._condition.notify()
            thread = self._thread
        self._lose_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(IDLE_SECONDS)

    # -- the scheduler thread -------------------------------------------------------------------

    def _schedule(self) -> None:
        try:
            self._schedule_renewals()
        except BaseException:
            # Nothing renews these locks from now: each is lost, and told so, rather than
            # left to expire unrenewed while its holder works on.
            logger.exception("the keep-alive scheduler failed; its locks are lost")
            with self._condition:
                self._thread = None
            self._lose_all()
            raise

    def _lose_all(self) -> None:
        """Renew nothing more: every lock still held is lost from now, and told so."""
        with self._condition:
            states = [entry.state for entry in self._entries.values()]
            self._entries.clear()
        for state in states:
            if state.held and state.lost is None:
                state.mark_lost(state.no_longer_renewed())

    def _schedule_renewals(self) -> None:
        idle_since: float | None = None
        with self._condition:
            while True:
                now = clock.now()
                if not self._entries:
                    idle_since = idle_since or now
                    if self._stopping or now - idle_since >= IDLE_SECONDS:
                        self._thread = None
                        for worker in self._workers:
                            worker.shutdown()
                        self._workers = []
                        return
                    self._condition.wait(IDLE_SECONDS)
                    continue
                idle_since = None
                wake = now + IDLE_SECONDS
                for key, entry in list(self._entries.items()):
                    state = entry.state
                    # pop, not del: the condition is let go while on_lost runs (below), and
                    # an unlock meanwhile may have taken this snapshot's later entries out.
                    if not state.held or state.lost is not None:
                        self._entries.pop(key, None)
                        continue
                    if now >= state.valid_until:
                        self._entries.pop(key, None)
                        self._declare_lost_at_deadline(state)
                        continue
                    if entry.in_flight is None and now >= entry.next_renewal:
                        entry.in_flight = self._submit(entry, now)
                    wake = min(wake, state.valid_until)
                    if entry.in_flight is None and now < entry.next_renewal:
                        wake = min(wake, entry.next_renewal)
                    elif entry.in_flight is None:
                        # Due, with no worker free yet: looked at again as one comes free
                        # (notified), or once the busy ones count as stuck, or it is late.
                        late = _late_at(entry)
                        wake = min(wake, now + STUCK_SECONDS, late if late > now else wake)
                self._condition.wait(max(0.0, wake - clock.now()))

    def _declare_lost_at_deadline(self, state: LockState) -> None:
        # On a thread of its own: an on_lost that takes its time (or never returns) must not
        # keep the next lock whose deadline passes from being declared lost on time, nor
        # delay the other locks' renewals.
        lost = state.deadline_passed()
        declaring = threading.Thread(
            target=state.mark_lost, args=(lost,), name=f"{self.name}-on-lost", daemon=True
        )
        try:
            declaring.start()
        except RuntimeError:  # no thread to be had (interpreter shutdown): here, then
            self._condition.release()
            try:
                state.mark_lost(lost)
            finally:
                self._condition.acquire()

    def _submit(self, entry: _Entry, now: float) -> object | None:
        """Start ``entry``'s renewal on an idle worker, or on a new one if every worker has
        been busy for STUCK_SECONDS or the renewal is late (``_late_at``); None if none can
        take it now."""
        if self._stopping:
            return None
        idle = next((worker for worker in self._workers if worker.busy_since is None), None)
        if idle is None:
            stuck = all(
                now - worker.busy_since >= STUCK_SECONDS
                for worker in self._workers
                if worker.busy_since is not None
            )
            if len(self._workers) >= RENEWERS or not (stuck or now >= _late_at(entry)):
                return None
            try:
                idle = _Worker(f"{self.name}-renew-{len(self._workers)}")
            except RuntimeError as error:  # no thread to be had (a limit on processes)
                logger.warning("could not start a renewal thread (%s); trying again", error)
                return None  # tried again at the next look; the deadline still counts
            self._workers.append(idle)
        idle.busy_since = now
        return idle.submit(functools.partial(self._renew, entry, idle))

    # -- the worker thread ------------------------------------------------------------------------

    def _renew(self, entry: _Entry, worker: _Worker) -> None:
        state = entry.state
        try:
            state.extend(None)  # by the lock's period as it is when sent
        except LockLost:
            pass  # extend() marked it lost and called on_lost; the scheduler drops it
        except LockError as error:
            entry.failures += 1
            delay = min(state.ttl * self.fraction, FIRST_RETRY_DELAY * 2 ** (entry.failures - 1))
            logger.warning(
                "could not renew lock %r (id %d), attempt %d: %s; retrying in %.2fs",
                state.lockstring,
                state.lock_id,
                entry.failures,
                error,
                delay,
            )
            entry.next_renewal = clock.now() + delay
        except Exception:
            logger.exception("unexpected error renewing lock %r", state.lockstring)
            entry.next_renewal = clock.now() + state.ttl * self.fraction
        else:
            entry.failures = 0
            entry.next_renewal = state.renewal_by(self.fraction)
        finally:
            with self._condition:
                entry.in_flight = None
                worker.busy_since = None
                self._condition.notify()
            # Ended on a thread of their own: a span processor that exports as a span ends,
            # and takes its time (or hangs), must hold up no renewal, nor every worker.
            end_spans_in_background(state.telemetry)


def _reset_after_fork() -> None:
    for keep_alive in list(_instances):
        keep_alive._reset()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)
