"""OpenTelemetry metrics and traces of the locks a process takes (``sqllocker[otel]``).

Each Locker has a ``Telemetry``. Without ``opentelemetry-api``, or with neither a provider
given to the Locker nor a global one set (the API's proxies still in place), it records
nothing, and what the lock operations pay is one check per acquisition. Once a provider is
there, it records:

- ``sqllocker.lock.acquire.duration`` (histogram, s), ``sqllocker.outcome`` = ``acquired`` |
  ``busy`` (refused at once) | ``timeout`` (refused after waiting) | ``error``;
- ``sqllocker.lock.hold.duration`` (histogram, s), ``released`` | ``lost``;
- ``sqllocker.lock.renewals`` (counter), ``renewed`` | ``failed``;
- ``sqllocker.lock.lost`` (counter); ``sqllocker.lock.takeovers`` (counter: expired holders'
  rows taken over); ``sqllocker.locks.held`` (up-down counter);
- ``sqllocker.purge.rows`` (counter);

and the spans ``sqllocker.acquire``, ``sqllocker.release`` and ``sqllocker.extend``. Their
attributes are ``db.system.name``, ``sqllocker.table``, ``sqllocker.kind`` and
``sqllocker.name``: a decorator's template, a semaphore's name, a group's size (``group of
3``), or else the lockstring with its ids replaced by ``<id>`` and ``<n>`` (lockstrings carry
ids, and a metric's series must stay few), or what the Locker's ``telemetry_name`` makes of
it. No guid, URL or password is ever an attribute.
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from typing import Any, Literal, ParamSpec, TypeVar

from sqlalchemy.engine import Engine

from . import forks
from .backends import backend_class
from .errors import LockBusy, LockLost
from .version import __version__

logger = logging.getLogger("sqllocker")
P = ParamSpec("P")
R = TypeVar("R")
_DIGITS = re.compile(r"\d+")
# A UUID, or a run of 8 or more hex digits with both a decimal digit and a letter among them (a
# digest), standing alone: an id whose letters vary too. (Decimal numbers stay ``<n>``.)
_HEX_IDS = re.compile(
    r"(?<![0-9A-Za-z])"
    r"(?:[0-9A-Fa-f]{8}(?:-[0-9A-Fa-f]{4}){3}-[0-9A-Fa-f]{12}"
    r"|(?=[0-9A-Fa-f]*[0-9])(?=[0-9A-Fa-f]*[A-Fa-f])[0-9A-Fa-f]{8,})"
    r"(?![0-9A-Za-z])"
)
# The acquisition this task or thread is recording, for the attempts deep in its wait.
_CURRENT: ContextVar[Acquisition | None] = ContextVar("sqllocker_acquisition", default=None)
_NOTHING: AbstractContextManager[None] = nullcontext()

NameMapping = Callable[[str], str]
# The histograms' buckets, unless a View says otherwise: the SDK's default ones are made for
# milliseconds, and would put every acquisition under 5 s in one bucket. From a millisecond's
# uncontended cycle up to a nightly job's hour.
SECONDS_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    300.0, 900.0, 3600.0,
)  # fmt: skip
# While no provider is set, how long a Locker goes before it looks for one again: one set
# later (after the Locker was made) is found within this long.
LOOK_AGAIN_SECONDS = 1.0


# The environment's names of providers that OpenTelemetry's API makes on first use.
_PROVIDERS_NAMED = ("OTEL_PYTHON_METER_PROVIDER", "OTEL_PYTHON_TRACER_PROVIDER")
# The API's metrics and trace modules once ``_opentelemetry`` imported them; False: not
# installed; None: not imported yet.
_OPENTELEMETRY: tuple[Any, Any] | Literal[False] | None = None


def _opentelemetry(provider_given: bool) -> tuple[Any, Any] | None:
    """OpenTelemetry's metrics and trace API, imported only once a provider can be there: one
    given to the Locker, the API imported by the application (a provider is set through it) or
    a provider named in the environment. Importing sqllocker imports no OpenTelemetry."""
    global _OPENTELEMETRY
    if _OPENTELEMETRY is False:
        return None
    if _OPENTELEMETRY is None:
        imported = "opentelemetry.metrics" in sys.modules or "opentelemetry.trace" in sys.modules
        if not (provider_given or imported or any(n in os.environ for n in _PROVIDERS_NAMED)):
            return None
        try:
            from opentelemetry import metrics, trace
        except ImportError:
            _OPENTELEMETRY = False
            return None
        _OPENTELEMETRY = metrics, trace
    return _OPENTELEMETRY


def system_name(engine: Engine) -> str:
    """``db.system.name`` of ``engine``'s database (MariaDB is told from MySQL once
    connected)."""
    return backend_class(engine.dialect.name).system_name(engine.dialect)


def default_name(lockstring: str) -> str:
    """A lockstring as ``sqllocker.name``: its UUIDs and hex ids replaced by ``<id>``, then its
    runs of digits by ``<n>``."""
    return _DIGITS.sub("<n>", _HEX_IDS.sub("<id>", lockstring))


class Hold:
    """What one held lock records: nothing (this class), or ``_RecordedHold``'s."""

    def extending(self) -> AbstractContextManager[Any]:
        return _NOTHING

    def releasing(self) -> AbstractContextManager[Any]:
        return _NOTHING

    def end_spans(self) -> None:
        """End the renewals' spans left to end (``extending``): called once the renewal's
        outcome is the lock's and its turn is given up, so that a span processor that exports
        as a span ends (``SimpleSpanProcessor``), and takes its time, holds neither up."""

    def lost(self) -> None:
        pass


NO_HOLD = Hold()


class LostWith(Hold):
    """The hold of a second row of one lock (a writer's claim on its name): its loss is the
    lock's, recorded once; its renewals and release are the lock's own row's."""

    def __init__(self, hold: Hold) -> None:
        self._hold = hold

    def lost(self) -> None:
        self._hold.lost()


# The group or semaphore acquisition whose member locks the acquisitions here are.
_COMPOUND: ContextVar[_RecordedAcquisition | None] = ContextVar("sqllocker_compound", default=None)
# The name a decorator gives the acquisitions it makes: its lockstring template.
_NAMED: ContextVar[str | None] = ContextVar("sqllocker_name", default=None)
# Set while a compound takes rows that are not locks of their own (a semaphore's turn, a
# read-write lock's rows before it decides): they record nothing but the compound's wait turns.
_UNRECORDED: ContextVar[bool] = ContextVar("sqllocker_unrecorded", default=False)


@contextmanager
def unrecorded() -> Iterator[None]:
    """Within: acquisitions record no outcome or hold of their own; their attempts are still
    the wait turns of the group, semaphore or read-write lock acquisition around them."""
    token = _UNRECORDED.set(True)
    try:
        yield
    finally:
        _UNRECORDED.reset(token)


@contextmanager
def named(name: str) -> Iterator[None]:
    """Within: acquisitions here record ``sqllocker.name`` = ``name`` (a decorator's template,
    ``"report {day}"``), whatever their lockstring."""
    token = _NAMED.set(name)
    try:
        yield
    finally:
        _NAMED.reset(token)


def attempted(outcome: object) -> None:
    """One attempt of the acquisition being recorded here ended: refused (a wait turn), or
    acquired (by taking over an expired holder's row, perhaps). Nothing when nothing records."""
    acquisition = _CURRENT.get()
    if acquisition is not None:
        acquisition.attempted(outcome)


class Acquisition:
    """What one acquisition records: nothing (this class), or ``_RecordedAcquisition``'s."""

    def attempted(self, outcome: object) -> None:
        pass

    def failed(self, error: BaseException) -> None:
        pass

    def acquired(self, lock_id: int) -> Hold:
        """``holding``, and the acquisition ends (``succeeded``)."""
        hold = self.holding(lock_id)
        self.succeeded()
        return hold

    def holding(self, lock_id: int) -> Hold:
        """The hold of lock ``lock_id``, just acquired; the acquisition ends with
        ``succeeded``, once the lock is its caller's (kept alive, if asked): a span processor
        that exports as a span ends (``SimpleSpanProcessor``), and takes its time, holds up
        nothing the lock needs."""
        return NO_HOLD

    def member(self, lock_id: int) -> Hold:
        """A member lock of a group or semaphore acquisition (``Telemetry.compound``)."""
        return NO_HOLD

    def succeeded(self) -> None:
        """The acquisition (a group's or semaphore's: of all its locks) has ended with its
        lock."""


_NO_ACQUISITION = Acquisition()


class _Member(Acquisition):
    """A lock taken inside a group or semaphore acquisition: its attempts are that one's
    wait turns, its hold is recorded under that one's kind and name, and the compound records
    the acquisition's outcome (a semaphore's slot found busy is no outcome of its own)."""

    def __init__(self, compound: _RecordedAcquisition) -> None:
        self._compound = compound

    def attempted(self, outcome: object) -> None:
        self._compound.attempted(outcome)

    def holding(self, lock_id: int) -> Hold:
        return self._compound.member(lock_id)


class Telemetry:
    """A Locker's instruments, made on its first acquisition once a provider is there."""

    def __init__(
        self,
        table: str,
        system_name: Callable[[], str],
        meter_provider: Any = None,
        tracer_provider: Any = None,
        name_of: NameMapping | None = None,
    ) -> None:
        self._table = table
        self._system_name = system_name
        self._meter_provider = meter_provider
        self._tracer_provider = tracer_provider
        self._name_of = name_of or default_name
        self._instruments: _Instruments | None = None
        self._next_look = 0.0
        # Imported now, where it can be (usually at start-up), not by an acquisition in some
        # thread: a fork by another thread meanwhile leaves the child the import's lock.
        _opentelemetry(bool(meter_provider or tracer_provider))

    def acquiring(self, lockstring: str, wait: float | None, kind: str = "lock") -> Acquisition:
        instruments = self._instruments or self._look_for_providers()
        if instruments is None or _UNRECORDED.get():
            return _NO_ACQUISITION
        compound = _COMPOUND.get()
        if compound is not None:
            return _Member(compound)
        try:
            name = _NAMED.get()
            if name is None:
                name = self.name_of(lockstring)
            return _RecordedAcquisition(
                instruments, functools.partial(self._attributes, kind, name), wait
            )
        except Exception:
            logger.exception("sqllocker: recording telemetry failed")
            return _NO_ACQUISITION

    def name_of(self, lockstring: str) -> str:
        """``sqllocker.name`` of ``lockstring``: the caller's mapping's, if it gives a str."""
        name = self._name_of(lockstring)
        if not isinstance(name, str):
            raise TypeError(f"telemetry_name returned {type(name).__name__}, not str")
        return name

    def compound(self, kind: str, name: str, wait: object, *, mapped: bool = False) -> Acquisition:
        """The acquisition of a ``group`` (named by its size), a ``semaphore`` (by its name),
        or a read-write lock's side or election (``rwlock.reader``, ``rwlock.writer``,
        ``election``: by its name, mapped as a lockstring), whose locks are taken inside it (in
        this task or thread) until it ends: ``failed``, or ``member`` for each lock (or
        ``acquired`` for a lock of one row's token) then ``succeeded``. ``mapped``: ``name``
        goes through the Locker's ``telemetry_name`` as a lockstring would."""
        instruments = self._instruments or self._look_for_providers()
        if instruments is None or _UNRECORDED.get():
            return _NO_ACQUISITION
        try:
            if mapped:
                name = self.name_of(name)
            acquisition = _RecordedAcquisition(
                instruments, functools.partial(self._attributes, kind, name), wait
            )
        except Exception:
            logger.exception("sqllocker: recording telemetry failed")
            return _NO_ACQUISITION
        _COMPOUND.set(acquisition)
        return acquisition

    def purged(self, rows: int) -> None:
        instruments = self._instruments or self._look_for_providers()
        if instruments is None or not rows:
            return
        try:
            instruments.purge_rows.add(rows, self._table_attributes())
        except Exception:  # the rows are gone: the purge has succeeded
            logger.exception("sqllocker: recording telemetry failed")

    def _table_attributes(self) -> dict[str, str]:
        return {"db.system.name": self._system_name(), "sqllocker.table": self._table}

    def _attributes(self, kind: str, name: str) -> dict[str, str]:
        return {**self._table_attributes(), "sqllocker.kind": kind, "sqllocker.name": name}

    def _look_for_providers(self) -> _Instruments | None:
        """The instruments, once a provider is there; None (and no look again for a while:
        an acquisition must not pay for the look) while none is."""
        now = time.monotonic()
        if now < self._next_look:
            return None
        self._next_look = now + LOOK_AGAIN_SECONDS
        api = _opentelemetry(bool(self._meter_provider or self._tracer_provider))
        if api is None:
            return None
        metrics, trace = api
        try:
            meter_provider = self._meter_provider or metrics.get_meter_provider()
            tracer_provider = self._tracer_provider or trace.get_tracer_provider()
            if _is_proxy(meter_provider) and _is_proxy(tracer_provider):
                return None  # nobody configured OpenTelemetry (yet): record nothing
            instruments = _Instruments(meter_provider, tracer_provider, self._table_attributes)
        except Exception:
            # A provider that fails to make its instruments: the lock operations go on, unrecorded
            # (and the look is tried again a while later).
            logger.exception("sqllocker: recording telemetry failed")
            return None
        self._instruments = instruments
        return instruments


def _is_proxy(provider: Any) -> bool:
    """The API's stand-in before a provider is set (or its no-op one)."""
    return type(provider).__name__ in {
        "_ProxyMeterProvider",
        "ProxyTracerProvider",
        "NoOpMeterProvider",
        "NoOpTracerProvider",
    }


class _Instruments:
    def __init__(
        self,
        meter_provider: Any,
        tracer_provider: Any,
        table_attributes: Callable[[], dict[str, str]],
    ) -> None:
        meter = meter_provider.get_meter("sqllocker", __version__)
        self.tracer = tracer_provider.get_tracer("sqllocker", __version__)
        self.table_attributes = table_attributes
        self.acquire_duration = meter.create_histogram(
            "sqllocker.lock.acquire.duration",
            unit="s",
            description="From the call to acquire a lock to its outcome",
            explicit_bucket_boundaries_advisory=SECONDS_BUCKETS,
        )
        self.hold_duration = meter.create_histogram(
            "sqllocker.lock.hold.duration",
            unit="s",
            description="From a lock acquired to released or lost",
            explicit_bucket_boundaries_advisory=SECONDS_BUCKETS,
        )
        self.renewals = meter.create_counter(
            "sqllocker.lock.renewals", description="Extensions of held locks, by outcome"
        )
        self.lost = meter.create_counter("sqllocker.lock.lost", description="Locks lost")
        self.takeovers = meter.create_counter(
            "sqllocker.lock.takeovers", description="Expired holders' rows taken over"
        )
        self.held = meter.create_up_down_counter(
            "sqllocker.locks.held", description="Locks this process holds now"
        )
        self.purge_rows = meter.create_counter(
            "sqllocker.purge.rows", description="Expired rows deleted by purges"
        )


def _never_raising(method: Callable[P, R]) -> Callable[P, R | None]:
    """Recording must never change what a lock operation does: a provider's error (or a
    caller's ``telemetry_name`` raising) is logged, and the operation goes on."""

    @functools.wraps(method)
    def record(*args: P.args, **kwargs: P.kwargs) -> R | None:
        try:
            return method(*args, **kwargs)
        except Exception:
            logger.exception("sqllocker: recording telemetry failed")
            return None

    return record


@_never_raising
def _status(span: Any, error: BaseException | None) -> None:
    from opentelemetry.trace import Status, StatusCode

    if error is not None:
        span.set_status(Status(StatusCode.ERROR, type(error).__name__))
        span.set_attribute("error.type", type(error).__name__)


class _RecordedAcquisition(Acquisition):
    def __init__(
        self, instruments: _Instruments, attributes: Callable[[], dict[str, str]], wait: Any
    ) -> None:
        self._instruments = instruments
        # Read again at the outcome: MariaDB is told from MySQL only once connected.
        self._attributes_now = attributes
        self._attributes = attributes()
        self._waits = wait != 0
        self._started = time.monotonic()
        self._span = instruments.tracer.start_span("sqllocker.acquire", attributes=self._attributes)
        self._turns = 0
        self._took_over = False
        _CURRENT.set(self)

    @_never_raising
    def attempted(self, outcome: object) -> None:
        took_over = getattr(outcome, "took_over", None)
        if took_over is None:  # refused
            self._turns += 1
            self._span.add_event("sqllocker.wait_turn", {"sqllocker.turn": self._turns})
        elif took_over:
            self._took_over = True

    def failed(self, error: BaseException) -> None:
        outcome = "error"
        if isinstance(error, LockBusy):
            outcome = "timeout" if self._waits else "busy"
        self._end(outcome, error)

    def holding(self, lock_id: int) -> Hold:
        self._identify(lock_id)
        return self.member(lock_id)

    @_never_raising
    def _identify(self, lock_id: int) -> None:
        self._span.set_attribute("sqllocker.lock.id", lock_id)

    def member(self, lock_id: int) -> Hold:
        try:
            self._instruments.held.add(1, self._instruments.table_attributes())
            return _RecordedHold(self._instruments, self._attributes_now(), lock_id)
        except Exception:
            logger.exception("sqllocker: recording telemetry failed")
            return NO_HOLD

    def succeeded(self) -> None:
        self._end("acquired", None)
        if self._took_over:
            self._count_takeover()

    @_never_raising
    def _count_takeover(self) -> None:
        self._instruments.takeovers.add(1, self._attributes)

    @_never_raising
    def _end(self, outcome: str, error: BaseException | None) -> None:
        if _CURRENT.get() is self:
            _CURRENT.set(None)
        if _COMPOUND.get() is self:
            _COMPOUND.set(None)
        elapsed = time.monotonic() - self._started
        try:
            self._attributes = self._attributes_now()
            attributes = {**self._attributes, "sqllocker.outcome": outcome}
            self._instruments.acquire_duration.record(elapsed, attributes)
        finally:  # the span ends whatever a metric does
            self._span.set_attributes(self._attributes)
            self._span.set_attribute("sqllocker.outcome", outcome)
            _status(self._span, error)
            self._span.end()


class _RecordedHold(Hold):
    def __init__(self, instruments: _Instruments, attributes: dict[str, str], lock_id: int) -> None:
        self._instruments = instruments
        self._attributes = attributes
        self._lock_id = lock_id
        self._since = time.monotonic()
        self._ended = False
        # A keep-alive's thread may find the lock lost as the caller releases it: one ends it.
        self._ending = threading.Lock()
        self._unended: list[Any] = []  # renewals' spans, for end_spans

    @contextmanager
    def extending(self) -> Iterator[None]:
        with self._span("sqllocker.extend", deferred=True) as span:
            try:
                yield
            except BaseException as error:
                self._renewal("failed")
                _status(span, error)
                if isinstance(error, LockLost):
                    self.lost()
                raise
            self._renewal("renewed")

    @contextmanager
    def releasing(self) -> Iterator[None]:
        with self._span("sqllocker.release") as span:
            try:
                yield
            except LockLost as error:
                _status(span, error)
                self.lost()
                raise
            except BaseException as error:
                _status(span, error)  # still held: unlock() may be tried again
                raise
            self._end("released")

    @_never_raising
    def lost(self) -> None:
        if self._end("lost"):
            self._instruments.lost.add(1, self._attributes)

    @_never_raising
    def _renewal(self, outcome: str) -> None:
        self._instruments.renewals.add(1, {**self._attributes, "sqllocker.outcome": outcome})

    @_never_raising
    def _end(self, outcome: str) -> bool:
        with self._ending:
            if self._ended:
                return False
            self._ended = True
        self.end_spans()
        elapsed = time.monotonic() - self._since
        attributes = {**self._attributes, "sqllocker.outcome": outcome}
        try:
            self._instruments.hold_duration.record(elapsed, attributes)
        finally:  # the count of held locks comes down whatever the other metric does
            self._instruments.held.add(-1, self._instruments.table_attributes())
        return True

    def end_spans(self) -> None:
        while self._unended:
            try:
                span = self._unended.pop()
            except IndexError:  # ended by another thread meanwhile
                return
            _end_span(span)

    @contextmanager
    def _span(self, name: str, deferred: bool = False) -> Iterator[Any]:
        """A span around a renewal or a release (``deferred``: left for ``end_spans``, or
        for the hold's end). A tracer or span processor that raises as the span starts or ends
        must not keep the statement from running, nor report one that ran as failed: the
        renewal would be retried until the lock is lost, and the release leave a live row that
        nobody holds."""
        span = self._start_span(name) or _non_recording_span()
        try:
            yield span
        finally:
            if deferred:
                self._leave_unended(span)
            else:
                _end_span(span)

    def _leave_unended(self, span: Any) -> None:
        """``span``, for ``end_spans``; ended now if the hold has ended (a renewal that ran on
        after its lock was released or lost: nothing would end it later)."""
        with self._ending:
            if not self._ended:
                self._unended.append(span)
                return
        _end_span(span)

    @_never_raising
    def _start_span(self, name: str) -> Any:
        attributes = {**self._attributes, "sqllocker.lock.id": self._lock_id}
        return self._instruments.tracer.start_span(name, attributes=attributes)


def _non_recording_span() -> Any:
    from opentelemetry.trace import INVALID_SPAN

    return INVALID_SPAN


@_never_raising
def _end_span(span: Any) -> None:
    span.end()


class _SpanEnder:
    """A thread that ends renewals' spans (``Hold.end_spans``), one hold after another, for
    every keep-alive of the process; started on first use (and again in a forked child)."""

    def __init__(self) -> None:
        self._holds: queue.SimpleQueue[Hold] = queue.SimpleQueue()
        self._pid: int | None = None
        self._starting = threading.Lock()

    def end(self, hold: Hold) -> None:
        if type(hold) is Hold:  # nothing recorded, nothing to end
            return
        if self._pid != forks.pid:
            with self._starting:
                if self._pid != forks.pid:
                    self._holds = queue.SimpleQueue()
                    try:
                        threading.Thread(
                            target=self._work, name="sqllocker-span-ender", daemon=True
                        ).start()
                    except RuntimeError:  # no thread to be had: ended here, then
                        hold.end_spans()
                        return
                    self._pid = forks.pid
        self._holds.put(hold)

    def _work(self) -> None:
        holds = self._holds
        while True:
            try:
                holds.get().end_spans()
            except Exception:  # recording never stops the thread (end_spans logs its own)
                logger.exception("ending a renewal's spans failed")


_span_ender = _SpanEnder()


def end_spans_in_background(hold: Hold) -> None:
    """``hold.end_spans()`` on a thread of its own: a renewal worker's, which a span processor
    that exports as a span ends, and takes its time (or hangs), must not hold up."""
    _span_ender.end(hold)
