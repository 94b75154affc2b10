"""OpenTelemetry: every metric and span a lock records, read back through the SDK's in-memory
reader and exporter, on every backend, sync and async."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from sqllocker import Locker, LockError, LockLost, lock_table
from sqllocker.asyncio import AsyncLocker
from sqllocker.engine import resolve_url
from sqllocker.telemetry import Telemetry, default_name
from tests.helpers import FRONTS, Front, Proxied, wait_until, wait_until_async
from tests.workers import async_url


@dataclass
class Recorded:
    reader: InMemoryMetricReader
    spans: InMemorySpanExporter
    meter_provider: MeterProvider
    tracer_provider: TracerProvider

    def points(self, name: str) -> list[Any]:
        data = self.reader.get_metrics_data()
        if data is None:
            return []
        return [
            point
            for resource in data.resource_metrics
            for scope in resource.scope_metrics
            for metric in scope.metrics
            if metric.name == name
            for point in metric.data.data_points
        ]

    def count(self, name: str, **attributes: str) -> float:
        """The sum of a counter's points, or a histogram's count, whose attributes include
        ``attributes`` (keys with dots written with underscores)."""
        wanted = {key.replace("_", "."): v for key, v in attributes.items()}
        total = 0.0
        for point in self.points(name):
            if wanted.items() <= dict(point.attributes).items():
                total += point.count if hasattr(point, "count") else point.value
        return total

    def finished(self, name: str) -> list[Any]:
        return [span for span in self.spans.get_finished_spans() if span.name == name]

    @property
    def providers(self) -> dict[str, Any]:
        """A Locker's options that record here."""
        return {"meter_provider": self.meter_provider, "tracer_provider": self.tracer_provider}

    def async_locker(self, url: str, table_name: str, **options: Any) -> AsyncLocker:
        """An AsyncLocker on the test's table that records here."""
        return AsyncLocker(async_url(url), table=table_name, **self.providers, **options)


@pytest.fixture
def recorded() -> Iterator[Recorded]:
    reader = InMemoryMetricReader()
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    meter_provider = MeterProvider(metric_readers=[reader])
    yield Recorded(reader, spans, meter_provider, tracer_provider)
    meter_provider.shutdown()
    tracer_provider.shutdown()


def expected_system(url: str) -> str:
    engine = sa.create_engine(resolve_url(url))
    with engine.connect() as conn:
        name = conn.dialect.name
        if name == "mysql":
            name = "mariadb" if getattr(conn.dialect, "is_mariadb", False) else "mysql"
    engine.dispose()
    return name


def test_acquire_hold_release_busy_and_timeout_are_recorded(
    make_locker: Callable[..., Locker], url: str, table_name: str, recorded: Recorded
) -> None:
    locker = make_locker(**recorded.providers)
    other = make_locker(**recorded.providers)
    lock = locker.lock("digest 42")
    with pytest.raises(LockError):
        other.lock("digest 42")
    with pytest.raises(LockError):
        other.lock("digest 42", wait=0.3)
    assert recorded.count("sqllocker.locks.held") == 1
    lock.unlock()

    system = expected_system(url)
    common = {
        "db.system.name": system,
        "sqllocker.table": table_name,
        "sqllocker.kind": "lock",
        "sqllocker.name": "digest <n>",
    }
    acquires = {
        dict(p.attributes)["sqllocker.outcome"]: p
        for p in recorded.points("sqllocker.lock.acquire.duration")
    }
    assert set(acquires) == {"acquired", "busy", "timeout"}
    for outcome, point in acquires.items():
        assert dict(point.attributes) == {**common, "sqllocker.outcome": outcome}
        assert point.count == 1
    assert acquires["timeout"].sum >= 0.3
    # Buckets for seconds, not the SDK's default ones (made for milliseconds).
    assert list(acquires["acquired"].explicit_bounds)[:3] == [0.001, 0.0025, 0.005]
    holds = recorded.points("sqllocker.lock.hold.duration")
    assert [dict(p.attributes) for p in holds] == [{**common, "sqllocker.outcome": "released"}]
    assert recorded.count("sqllocker.locks.held") == 0
    (held,) = recorded.points("sqllocker.locks.held")
    assert dict(held.attributes) == {"db.system.name": system, "sqllocker.table": table_name}

    spans = recorded.finished("sqllocker.acquire")
    by_outcome = {span.attributes["sqllocker.outcome"]: span for span in spans}
    assert by_outcome["acquired"].attributes["sqllocker.lock.id"] == lock.lock_id
    assert by_outcome["acquired"].status.status_code == StatusCode.UNSET
    for refused in ("busy", "timeout"):
        assert by_outcome[refused].status.status_code == StatusCode.ERROR
        assert "sqllocker.lock.id" not in by_outcome[refused].attributes
    (release,) = recorded.finished("sqllocker.release")
    assert release.attributes["sqllocker.lock.id"] == lock.lock_id
    assert release.attributes["sqllocker.name"] == "digest <n>"
    assert_no_secrets(recorded, lock._state.guid, url)


def test_renewals_loss_and_purge_are_recorded(
    make_locker: Callable[..., Locker], recorded: Recorded
) -> None:
    locker = make_locker(
        **recorded.providers,
        telemetry_name=str,
    )
    lock = locker.lock("report 7", expires=30)
    lock.extend(30)
    assert recorded.count("sqllocker.lock.renewals", sqllocker_outcome="renewed") == 1
    assert locker.break_lock("report 7") is not None
    with pytest.raises(LockLost):
        lock.extend(30)
    assert recorded.count("sqllocker.lock.renewals", sqllocker_outcome="failed") == 1
    assert recorded.count("sqllocker.lock.lost") == 1
    with pytest.raises(LockLost):
        lock.unlock()
    assert recorded.count("sqllocker.lock.lost") == 1  # lost once, however often found
    assert recorded.count("sqllocker.lock.hold.duration", sqllocker_outcome="lost") == 1
    assert recorded.count("sqllocker.lock.hold.duration", sqllocker_outcome="released") == 0
    assert recorded.count("sqllocker.locks.held") == 0
    extends = recorded.finished("sqllocker.extend")
    assert [span.status.status_code for span in extends] == [StatusCode.UNSET, StatusCode.ERROR]
    assert {span.attributes["sqllocker.name"] for span in extends} == {"report 7"}

    lapsing = locker.lock("short 1", expires=0.5)
    wait_until(lambda: locker.lock_info("short 1").expired, timeout=30)  # type: ignore[union-attr]
    assert locker.purge_expired_locks() == 1
    assert recorded.count("sqllocker.purge.rows") == 1
    del lapsing


@pytest.mark.parametrize("front", FRONTS, ids=str)
def test_a_lock_lost_by_its_keep_alive_is_recorded_once(
    url: str, table_name: str, make_locker: Callable[..., Locker], recorded: Recorded, front: Front
) -> None:
    make_locker()  # the table
    lost: list[LockLost] = []

    def renewed() -> bool:
        return recorded.count("sqllocker.lock.renewals", sqllocker_outcome="renewed") >= 1

    async def scenario() -> None:
        locker = front.locker(url, table=table_name, grace=0, **recorded.providers)
        try:
            lock = await front.call(
                locker.lock, "kept 1", expires=1, keep_alive=True, on_lost=lost.append
            )
            await wait_until_async(renewed, timeout=30)
            await front.call(locker.break_lock, "kept 1")
            await wait_until_async(lambda: bool(lost), timeout=30)
            assert recorded.count("sqllocker.lock.lost") == 1
            assert recorded.count("sqllocker.locks.held") == 0
            with pytest.raises(LockLost):
                await front.call(lock.unlock)
        finally:
            await front.close(locker)

    asyncio.run(scenario())
    assert recorded.count("sqllocker.lock.lost") == 1  # lost once, however often found
    assert recorded.count("sqllocker.lock.renewals", sqllocker_outcome="failed") >= 1
    assert recorded.count("sqllocker.lock.hold.duration", sqllocker_outcome="lost") == 1
    assert recorded.count("sqllocker.locks.held") == 0


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_an_unreachable_database_is_an_error_outcome(
    backend: str, tmp_path: Path, recorded: Recorded
) -> None:
    if backend == "sqlite":
        url = f"sqlite:///{tmp_path / 'missing' / 'locks.db'}"
    else:
        scheme = {"postgresql": "postgresql://postgres:secret", "mysql": "mysql://root:secret"}
        url = f"{scheme[backend]}@127.0.0.1:{_closed_port()}/test"
    locker = Locker(url, **recorded.providers)
    with pytest.raises(LockError):
        locker.lock("job 1")
    locker.close()
    assert recorded.count("sqllocker.lock.acquire.duration", sqllocker_outcome="error") == 1
    (span,) = recorded.finished("sqllocker.acquire")
    assert span.status.status_code == StatusCode.ERROR
    assert_no_secrets(recorded, None, url)


async def test_the_async_front_end_records_the_same(
    url: str, table_name: str, make_locker: Callable[..., Locker], recorded: Recorded
) -> None:
    make_locker()  # the table
    async with recorded.async_locker(url, table_name, grace=0) as locker:
        lock = await locker.lock("digest 9", expires=30)
        async with recorded.async_locker(url, table_name, grace=0) as other:
            with pytest.raises(LockError):
                await other.lock("digest 9")
            with pytest.raises(LockError):
                await other.lock("digest 9", wait=0.3)
        await lock.extend(30)
        assert await locker.break_lock("digest 9") is not None
        with pytest.raises(LockLost):
            await lock.extend(30)
        with pytest.raises(LockLost):
            await lock.unlock()
        again = await locker.lock("digest 10")
        await again.unlock()
    for outcome in ("acquired", "busy", "timeout"):
        count = recorded.count("sqllocker.lock.acquire.duration", sqllocker_outcome=outcome)
        assert count == (2 if outcome == "acquired" else 1)
    assert recorded.count("sqllocker.lock.renewals", sqllocker_outcome="renewed") == 1
    assert recorded.count("sqllocker.lock.renewals", sqllocker_outcome="failed") == 1
    assert recorded.count("sqllocker.lock.lost") == 1
    assert recorded.count("sqllocker.lock.hold.duration", sqllocker_outcome="lost") == 1
    assert recorded.count("sqllocker.lock.hold.duration", sqllocker_outcome="released") == 1
    assert recorded.count("sqllocker.locks.held") == 0
    names = {span.name for span in recorded.spans.get_finished_spans()}
    assert names == {"sqllocker.acquire", "sqllocker.extend", "sqllocker.release"}
    assert {
        dict(p.attributes)["sqllocker.name"]
        for p in recorded.points("sqllocker.lock.acquire.duration")
    } == {"digest <n>"}


def test_nothing_is_recorded_without_a_provider(make_locker: Callable[..., Locker]) -> None:
    locker = make_locker()
    with locker.lock("job 1"):
        pass
    assert locker._telemetry._instruments is None


def test_the_default_name_replaces_runs_of_digits() -> None:
    assert default_name("digest 42") == "digest <n>"
    assert default_name("user 7 order 123456") == "user <n> order <n>"
    assert default_name("nightly") == "nightly"
    assert Telemetry("t", lambda: "sqlite")._look_for_providers() is None


def test_the_default_name_replaces_hex_ids_whole() -> None:
    """UUIDs and hex digests carry digits between letters: a series each, if only their
    digits were replaced."""
    assert default_name("order 550e8400-e29b-41d4-A716-446655440000") == "order <id>"
    assert default_name("order 550e8400-e29b-41d4-a716-446655440000 step 2") == (
        "order <id> step <n>"
    )
    assert default_name("blob sha256:9f86d081884c7d65") == "blob sha<n>:<id>"
    assert default_name("build deadbeef0") == "build <id>"
    assert default_name("job-1a2b3c4d5e") == "job-<id>"
    # Words of hex letters without a digit, and short mixed runs, are not ids.
    assert default_name("facade") == "facade"
    assert default_name("deadbeefcafe") == "deadbeefcafe"
    assert default_name("v2 abc123") == "v<n> abc<n>"
    assert default_name("report2024") == "report<n>"
    # Decimal numbers, however long, are numbers: ``<n>`` as they grow past 8 digits too.
    assert default_name("order 12345678") == "order <n>"
    assert default_name("report 20241130") == "report <n>"


def assert_no_secrets(recorded: Recorded, guid: str | None, url: str) -> None:
    password = sa.make_url(url).password
    values = [
        str(value)
        for span in recorded.spans.get_finished_spans()
        for value in [*span.attributes.values(), *(e.attributes or {} for e in span.events)]
    ] + [
        str(value)
        for name in (
            "sqllocker.lock.acquire.duration",
            "sqllocker.lock.hold.duration",
            "sqllocker.locks.held",
        )
        for point in recorded.points(name)
        for value in point.attributes.values()
    ]
    for secret in (guid, password, url):
        if secret:
            assert not any(secret in value for value in values)


def test_time_is_monotonic_not_wall() -> None:
    # The durations come from time.monotonic: a wall clock stepped back makes no negative hold.
    assert time.monotonic() > 0


# -- sqllocker run in its caller's trace -----------------------------------------------------------

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER = f"00-{TRACE_ID}-00f067aa0ba902b7-01"

# The command line in a process whose global tracer provider records in memory (as
# opentelemetry-instrument would set one), printing the finished spans as JSON.
RUN_TRACED = """
import json, sys
from opentelemetry import trace
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)
from sqllocker.cli import main
try:
    main(sys.argv[1:])
except SystemExit as done:
    status = done.code
spans = [
    {
        "name": s.name,
        "trace": format(s.context.trace_id, "032x"),
        "span": format(s.context.span_id, "016x"),
        "parent": format(s.parent.span_id, "016x") if s.parent else None,
    }
    for s in exporter.get_finished_spans()
]
print(json.dumps({"status": status, "spans": spans}))
"""


def _run_traced(
    launcher: list[str], url: str, table_name: str, seen: Path
) -> subprocess.CompletedProcess[str]:
    """``sqllocker run`` started by ``launcher`` in the caller's trace (TRACEPARENT), whose
    command writes the TRACEPARENT it was handed to ``seen``."""
    done = subprocess.run(
        [
            *launcher,
            "--url",
            url,
            "--table",
            table_name,
            "run",
            "job 5",
            "--",
            "sh",
            "-c",
            f'printf %s "$TRACEPARENT" > {seen}',
        ],
        env={**os.environ, "TRACEPARENT": CALLER},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done


def test_run_joins_the_callers_trace_and_passes_it_on(
    url: str, table_name: str, make_locker: Callable[..., Locker], tmp_path: Path
) -> None:
    make_locker()  # the table
    seen = tmp_path / "traceparent"
    done = _run_traced([sys.executable, "-c", RUN_TRACED], url, table_name, seen)
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["status"] == 0
    spans = {span["name"]: span for span in result["spans"]}
    assert set(spans) >= {"sqllocker.run", "sqllocker.acquire", "sqllocker.release"}
    run = spans["sqllocker.run"]
    assert {span["trace"] for span in spans.values()} == {TRACE_ID}
    assert run["parent"] == CALLER.split("-")[2]
    assert spans["sqllocker.acquire"]["parent"] == run["span"]
    # COMMAND is handed the context of the run's span, in the same trace.
    assert seen.read_text() == f"00-{TRACE_ID}-{run['span']}-01"


def test_run_passes_the_context_on_even_when_nothing_records(
    url: str, table_name: str, make_locker: Callable[..., Locker], tmp_path: Path
) -> None:
    make_locker()
    seen = tmp_path / "traceparent"
    sqllocker = str(Path(__file__).resolve().parents[1] / ".venv" / "bin" / "sqllocker")
    _run_traced([sqllocker], url, table_name, seen)
    assert seen.read_text() == CALLER


# -- takeovers, wait turns, a renewal that cannot reach the database ----------------------------


def test_a_takeover_and_the_wait_turns_are_recorded(
    make_locker: Callable[..., Locker], recorded: Recorded
) -> None:
    locker = make_locker(**recorded.providers)
    other = make_locker(**recorded.providers)
    lapsing = locker.lock("job 1", expires=0.5)
    wait_until(lambda: locker.lock_info("job 1").expired, timeout=30)  # type: ignore[union-attr]
    assert recorded.count("sqllocker.lock.takeovers") == 0
    taken = other.lock("job 1", expires=30)
    assert recorded.count("sqllocker.lock.takeovers") == 1
    with pytest.raises(LockError):
        locker.lock("job 1", wait=1)
    timeout = next(
        span
        for span in recorded.finished("sqllocker.acquire")
        if span.attributes["sqllocker.outcome"] == "timeout"
    )
    turns = [event for event in timeout.events if event.name == "sqllocker.wait_turn"]
    assert turns
    assert [event.attributes["sqllocker.turn"] for event in turns] == list(range(1, len(turns) + 1))
    taken.unlock()
    del lapsing


@pytest.mark.parametrize("server", ["postgresql", "mysql"])
def test_a_renewal_that_cannot_reach_the_database_fails_without_losing(
    server: str, request: pytest.FixtureRequest, table_name: str, recorded: Recorded
) -> None:
    target = resolve_url(request.getfixturevalue(f"{server}_url"))
    engine = sa.create_engine(target)
    lock_table(table_name).create(engine)
    engine.dispose()
    proxied = Proxied(target)
    locker = Locker(proxied.target, table=table_name, **recorded.providers)
    lock = locker.lock("job 1", expires=60)
    proxied.close()
    with pytest.raises(LockError) as failure:
        lock.extend(60)
    assert not isinstance(failure.value, LockLost)
    assert recorded.count("sqllocker.lock.renewals", sqllocker_outcome="failed") == 1
    assert recorded.count("sqllocker.lock.lost") == 0
    assert recorded.count("sqllocker.locks.held") == 1  # still held, as far as anyone knows
    (extend,) = recorded.finished("sqllocker.extend")
    assert extend.status.status_code == StatusCode.ERROR
    locker.close()


def test_a_decorated_function_is_named_by_its_template(
    make_locker: Callable[..., Locker], recorded: Recorded
) -> None:
    locker = make_locker(**recorded.providers)

    @locker.locked("report {day}")
    def report(day: str) -> str:
        return day

    assert report("monday 3") == "monday 3"
    names = {
        dict(point.attributes)["sqllocker.name"]
        for point in recorded.points("sqllocker.lock.acquire.duration")
    }
    assert names == {"report {day}"}
    with locker.lock("report tuesday 4"):
        pass
    names = {
        dict(point.attributes)["sqllocker.name"]
        for point in recorded.points("sqllocker.lock.acquire.duration")
    }
    assert names == {"report {day}", "report tuesday <n>"}


async def test_a_decorated_coroutine_is_named_by_its_template(
    url: str, table_name: str, make_locker: Callable[..., Locker], recorded: Recorded
) -> None:
    make_locker()
    async with recorded.async_locker(url, table_name) as locker:

        @locker.locked("digest {user}")
        async def digest(user: int) -> int:
            return user

        assert await digest(42) == 42
    (point,) = recorded.points("sqllocker.lock.acquire.duration")
    assert dict(point.attributes)["sqllocker.name"] == "digest {user}"


def test_groups_and_semaphores_are_recorded_by_kind(
    make_locker: Callable[..., Locker], recorded: Recorded
) -> None:
    locker = make_locker(**recorded.providers)
    other = make_locker(**recorded.providers)
    group = locker.lock_all(["a 1", "b 2", "c 3"])
    assert recorded.count("sqllocker.locks.held") == 3
    with pytest.raises(LockError):
        other.lock_all(["c 3", "d 4"])
    group.unlock()
    semaphore = locker.semaphore("crawlers", 2)
    first = semaphore.acquire()
    second = other.semaphore("crawlers", 2).acquire()
    with pytest.raises(LockError):
        other.semaphore("crawlers", 2).acquire()
    first.unlock()
    second.unlock()

    def outcomes(kind: str) -> dict[tuple[str, str], float]:
        found: dict[tuple[str, str], float] = {}
        for point in recorded.points("sqllocker.lock.acquire.duration"):
            attributes = dict(point.attributes)
            if attributes["sqllocker.kind"] == kind:
                key = (attributes["sqllocker.name"], attributes["sqllocker.outcome"])
                found[key] = found.get(key, 0) + point.count
        return found

    assert outcomes("group") == {("group of 3", "acquired"): 1, ("group of 2", "busy"): 1}
    # One outcome per semaphore acquire, not one per permit slot tried.
    assert outcomes("semaphore") == {("crawlers", "acquired"): 2, ("crawlers", "busy"): 1}
    assert outcomes("lock") == {}
    assert recorded.count("sqllocker.lock.hold.duration", sqllocker_kind="group") == 3
    assert recorded.count("sqllocker.lock.hold.duration", sqllocker_kind="semaphore") == 2
    assert recorded.count("sqllocker.locks.held") == 0
    releases = recorded.finished("sqllocker.release")
    assert sorted(span.attributes["sqllocker.name"] for span in releases) == [
        "crawlers",
        "crawlers",
        "group of 3",
        "group of 3",
        "group of 3",
    ]


def test_a_failing_name_mapping_never_stops_a_lock(
    make_locker: Callable[..., Locker], recorded: Recorded
) -> None:
    def broken(lockstring: str) -> str:
        raise ValueError(lockstring)

    locker = make_locker(
        **recorded.providers,
        telemetry_name=broken,
    )
    with locker.lock("job 1") as lock:
        assert lock.is_valid()
    assert locker.lock_info("job 1") is None


class _FailingSpanProcessor(SpanProcessor):
    """A span processor with a bug (an exporter's, a vendor's): it raises as a held lock's
    spans (its renewals, its release) start or end."""

    def __init__(self, at: str) -> None:
        self.at = at

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        if self.at == "start" and span.name != "sqllocker.acquire":
            raise RuntimeError("a span processor's bug")

    def on_end(self, span: Any) -> None:
        if self.at == "end" and span.name != "sqllocker.acquire":
            raise RuntimeError("a span processor's bug")


@pytest.mark.parametrize("front", FRONTS, ids=str)
@pytest.mark.parametrize("at", ["start", "end"])
def test_a_failing_span_processor_never_stops_a_release_or_a_renewal(
    url: str, table_name: str, make_locker: Callable[..., Locker], at: str, front: Front
) -> None:
    """A raising tracer left unlock() raising a RuntimeError with the row still live (at
    start: the DELETE never ran), or raising after the DELETE (at end), and made every renewal
    fail: a kept-alive lock was reported lost at its first deadline."""
    make_locker()  # the table
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(_FailingSpanProcessor(at))
    lost: list[LockLost] = []

    async def scenario() -> None:
        locker = front.locker(url, table=table_name, grace=0, tracer_provider=tracer_provider)
        try:
            lock = await front.call(
                locker.lock, "job 1", expires=2, keep_alive=True, on_lost=lost.append
            )
            # Past the lock's expiry: only its renewals keep it. An expiry of 1 s lost the
            # lock on a loaded machine, a renewal still unanswered at its deadline.
            await asyncio.sleep(3.0)
            assert not lost
            assert lock.is_valid()
            await front.call(lock.unlock)
            assert await front.call(locker.lock_info, "job 1") is None
        finally:
            await front.close(locker)

    asyncio.run(scenario())
    tracer_provider.shutdown()


class _SlowExporter(SpanExporter):
    """A span exporter that takes its time (a collector that does not answer), as a
    ``SimpleSpanProcessor`` calls it: as each span ends, on the thread that ends it."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def export(self, spans: Any) -> SpanExportResult:
        if any(span.name in ("sqllocker.acquire", "sqllocker.extend") for span in spans):
            time.sleep(self.seconds)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


@pytest.mark.parametrize(
    ("backend", "kind"),
    [(backend, "lock") for backend in ("sqlite", "postgresql", "mysql")]
    + [("sqlite", "reader"), ("sqlite", "writer")],
)
def test_a_slow_span_export_neither_loses_a_kept_alive_lock_nor_returns_it_expired(
    make_locker: Callable[..., Locker], kind: str
) -> None:
    """Spans ended, and exported, where the lock's work waited for them: an acquire's before
    its keep-alive began (lock() returned a lock another process had taken over meanwhile),
    and a renewal's with its turn held and before its deadline moved (the lock was reported
    lost though every renewal succeeded, and an unlock() meanwhile gave up, leaving the row)."""
    tracer_provider = TracerProvider()
    slow = _SlowExporter(3.0)
    tracer_provider.add_span_processor(SimpleSpanProcessor(slow))
    locker = make_locker(tracer_provider=tracer_provider)
    lost: list[LockLost] = []
    options: dict[str, Any] = {"expires": 2, "keep_alive": True, "on_lost": lost.append}
    lock: Any = (
        locker.lock("job", **options)
        if kind == "lock"
        else getattr(locker.rwlock("job"), "read" if kind == "reader" else "write")(**options)
    )
    assert lock.is_valid()  # renewed while the acquire's span was exported
    deadline = time.monotonic() + 5  # two and a half periods
    while time.monotonic() < deadline:
        assert lock.is_valid(), lost
        time.sleep(0.25)
    assert not lost
    # A SimpleSpanProcessor exports one span at a time: the release's span would wait for the
    # renewals' still to be exported.
    slow.seconds = 0
    lock.unlock()
    assert locker.locks() == []
    tracer_provider.shutdown()


@pytest.mark.parametrize("backend", ["postgresql", "mysql"])
def test_an_async_renewal_still_running_when_its_lock_is_lost_ends_its_span(
    url: str, table_name: str, make_locker: Callable[..., Locker], proxied: Proxied
) -> None:
    """The span of a renewal that was still in flight when its lock's deadline passed was
    left for a flush that never came: never ended, never exported."""
    make_locker()  # the table
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))

    async def scenario() -> None:
        locker = AsyncLocker(
            async_url(proxied.url), table=table_name, grace=0, tracer_provider=tracer_provider
        )
        try:
            lost = asyncio.Event()
            lock = await locker.lock(
                "job", expires=1.5, keep_alive=True, on_lost=lambda _: lost.set()
            )
            proxied.proxy.stall()  # the first renewal hangs; the deadline passes
            await asyncio.wait_for(lost.wait(), 10)
            proxied.proxy.resume()  # the renewal ends, after its lock
            await wait_until_async(
                lambda: any(s.name == "sqllocker.extend" for s in exporter.get_finished_spans()),
                10,
            )
            with contextlib.suppress(LockLost):
                await lock.unlock()
        finally:
            proxied.close()
            await locker.aclose()

    asyncio.run(scenario())
    tracer_provider.shutdown()


class _HangingExporter(SpanExporter):
    """A span exporter that never answers for renewals' spans (until told to)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def export(self, spans: Any) -> SpanExportResult:
        if any(span.name == "sqllocker.extend" for span in spans):
            self.release.wait(60)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self.release.set()


@pytest.mark.parametrize("backend", ["sqlite"])  # the keep-alive's own threads
def test_a_hanging_span_export_holds_up_no_renewal(make_locker: Callable[..., Locker]) -> None:
    """Renewals' spans ended on the renewal workers, each busy for as long as an export: a
    hanging exporter took one worker per renewal, and once all 16 were taken, the locks were
    lost."""
    exporter = _HangingExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    locker = make_locker(tracer_provider=tracer_provider)
    lost: list[LockLost] = []
    locks = [
        locker.lock(f"job {n}", expires=1.5, keep_alive=True, on_lost=lost.append) for n in range(4)
    ]
    time.sleep(12)  # more than 16 renewals, each with a span whose export hangs
    assert not lost
    assert all(lock.is_valid() for lock in locks)
    exporter.release.set()  # a SimpleSpanProcessor exports one span at a time: releases wait
    for lock in locks:
        lock.unlock()
    tracer_provider.shutdown()


class _ProviderThatFails:
    def get_meter(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a broken provider")

    def get_tracer(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a broken provider")


def test_a_provider_that_fails_to_make_instruments_never_stops_a_lock_or_a_purge(
    make_locker: Callable[..., Locker],
) -> None:
    broken = _ProviderThatFails()
    locker = make_locker(meter_provider=broken, tracer_provider=broken)
    for n in range(3):
        locker.lock(f"job {n}").unlock()
        abandoned = locker.lock(f"old {n}", expires=0.01)
        abandoned._finalizer.detach()
        time.sleep(0.05)
        assert locker.purge_expired_locks() == 1


RUN_WITH_A_FAILING_TRACER = """
import sys
from opentelemetry import trace
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider

class Failing(SpanProcessor):
    def on_start(self, span, parent_context=None):
        raise RuntimeError("a broken span processor")

provider = TracerProvider()
provider.add_span_processor(Failing())
trace.set_tracer_provider(provider)
from sqllocker.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_run_with_a_failing_span_processor_runs_its_command(
    url: str, table_name: str, make_locker: Callable[..., Locker]
) -> None:
    make_locker()  # the table
    done = subprocess.run(
        [sys.executable, "-c", RUN_WITH_A_FAILING_TRACER, "--url", url, "--table", table_name,
         "run", "job", "--", sys.executable, "-c", "print('ran'); raise SystemExit(3)"],
        capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    assert done.returncode == 3, done.stderr
    assert done.stdout.strip() == "ran"


# -- options refused at creation, and the kinds beside plain locks -------------------------------


@pytest.mark.parametrize(
    ("option", "value", "says"),
    [
        ("telemetry_name", "digest", "telemetry_name must be callable"),
        ("telemetry_name", 42, "telemetry_name must be callable"),
        ("meter_provider", "global", "meter_provider must be an OpenTelemetry meter provider"),
        ("tracer_provider", object(), "tracer_provider must be an OpenTelemetry tracer provider"),
    ],
)
def test_a_bad_telemetry_option_is_refused_at_creation(
    option: str, value: object, says: str, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'locks.db'}"
    for make in (Locker, AsyncLocker):
        with pytest.raises(LockError) as refused:
            make(url, **{option: value})  # type: ignore[arg-type]
        assert says in str(refused.value)
        assert "\n" not in str(refused.value)
    assert not (tmp_path / "locks.db").exists()  # nothing written


def test_a_groups_wait_turns_are_events_of_its_span(
    make_locker: Callable[..., Locker], recorded: Recorded
) -> None:
    held = make_locker(**recorded.providers).lock("c 3")
    with pytest.raises(LockError):
        make_locker(**recorded.providers).lock_all(["c 3", "d 4"], wait=1)
    (span,) = [
        span
        for span in recorded.finished("sqllocker.acquire")
        if span.attributes["sqllocker.kind"] == "group"
    ]
    assert span.attributes["sqllocker.outcome"] == "timeout"
    turns = [event for event in span.events if event.name == "sqllocker.wait_turn"]
    assert turns
    assert [event.attributes["sqllocker.turn"] for event in turns] == list(range(1, len(turns) + 1))
    held.unlock()


def test_a_semaphores_turn_is_never_counted_as_held(
    make_locker: Callable[..., Locker], recorded: Recorded
) -> None:
    wide = make_locker(**recorded.providers).semaphore("crawlers", 3)
    permits = [wide.acquire(), wide.acquire()]
    narrow = make_locker(**recorded.providers).semaphore("crawlers", 1)
    with pytest.raises(LockError):
        narrow.acquire(wait=1)  # outnumbered for its limit: it takes the turn while it waits
    assert recorded.count("sqllocker.locks.held") == 2
    assert recorded.count("sqllocker.lock.hold.duration") == 0
    for permit in permits:
        permit.unlock()
    assert recorded.count("sqllocker.lock.hold.duration", sqllocker_kind="semaphore") == 2
    assert recorded.count("sqllocker.locks.held") == 0


def _by_kind(recorded: Recorded, name: str) -> dict[tuple[str, str, str], float]:
    found: dict[tuple[str, str, str], float] = {}
    for point in recorded.points(name):
        attributes = dict(point.attributes)
        key = (
            attributes["sqllocker.kind"],
            attributes["sqllocker.name"],
            attributes["sqllocker.outcome"],
        )
        found[key] = found.get(key, 0) + point.count
    return found


def test_read_write_locks_and_elections_are_recorded_by_kind(
    make_locker: Callable[..., Locker], recorded: Recorded
) -> None:
    locker, other = make_locker(**recorded.providers), make_locker(**recorded.providers)
    readers = [locker.rwlock("catalog 7").read(), other.rwlock("catalog 7").read()]
    assert recorded.count("sqllocker.locks.held") == 2
    with pytest.raises(LockError):
        locker.rwlock("catalog 7").write(wait=0.5)
    for reader in readers:
        reader.unlock()
    writer = locker.rwlock("catalog 7").write()
    assert recorded.count("sqllocker.locks.held") == 1  # two rows, one lock
    with pytest.raises(LockError):
        other.rwlock("catalog 7").read()
    writer.unlock()
    lead = other.election("scheduler").campaign()
    assert recorded.count("sqllocker.locks.held") == 1
    lead.resign()

    assert _by_kind(recorded, "sqllocker.lock.acquire.duration") == {
        ("rwlock.reader", "catalog <n>", "acquired"): 2,
        ("rwlock.reader", "catalog <n>", "busy"): 1,
        ("rwlock.writer", "catalog <n>", "timeout"): 1,
        ("rwlock.writer", "catalog <n>", "acquired"): 1,
        ("election", "scheduler", "acquired"): 1,
    }
    assert _by_kind(recorded, "sqllocker.lock.hold.duration") == {
        ("rwlock.reader", "catalog <n>", "released"): 2,
        ("rwlock.writer", "catalog <n>", "released"): 1,
        ("election", "scheduler", "released"): 1,
    }
    assert recorded.count("sqllocker.locks.held") == 0
    timeout = next(
        span
        for span in recorded.finished("sqllocker.acquire")
        if span.attributes["sqllocker.outcome"] == "timeout"
    )
    assert [event for event in timeout.events if event.name == "sqllocker.wait_turn"]
    acquired = [
        span
        for span in recorded.finished("sqllocker.acquire")
        if span.attributes["sqllocker.outcome"] == "acquired"
        and span.attributes["sqllocker.kind"] == "election"
    ]
    assert [span.attributes["sqllocker.lock.id"] for span in acquired] == [lead.term]


def test_a_writer_lost_through_its_claim_is_recorded_once(
    make_locker: Callable[..., Locker], recorded: Recorded
) -> None:
    locker = make_locker(**recorded.providers)
    lost: list[LockLost] = []
    lead = locker.election("scheduler").campaign(expires=1, on_lost=lost.append)
    locker.break_lock("scheduler")  # the claim on the name, not the term's row
    wait_until(lambda: bool(lost), timeout=30)
    wait_until(lambda: recorded.count("sqllocker.lock.lost") >= 1, timeout=30)
    with pytest.raises(LockLost):
        lead.resign()
    assert recorded.count("sqllocker.lock.lost") == 1
    assert recorded.count("sqllocker.locks.held") == 0
    assert recorded.count("sqllocker.lock.hold.duration", sqllocker_outcome="lost") == 1


async def test_async_read_write_locks_and_elections_are_recorded_by_kind(
    url: str, table_name: str, make_locker: Callable[..., Locker], recorded: Recorded
) -> None:
    make_locker()
    async with recorded.async_locker(url, table_name) as locker:
        reader = await locker.rwlock("catalog").read()
        await reader.unlock()
        writer = await locker.rwlock("catalog").write()
        assert recorded.count("sqllocker.locks.held") == 1
        await writer.unlock()
        lead = await locker.election("scheduler").campaign()
        await lead.resign()
        group = await locker.lock_all(["a", "b"])
        await group.unlock()
    assert _by_kind(recorded, "sqllocker.lock.hold.duration") == {
        ("rwlock.reader", "catalog", "released"): 1,
        ("rwlock.writer", "catalog", "released"): 1,
        ("election", "scheduler", "released"): 1,
        ("group", "group of 2", "released"): 2,
    }
    assert recorded.count("sqllocker.locks.held") == 0
