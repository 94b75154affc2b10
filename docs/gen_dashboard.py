"""Render docs/images/dashboard.png: the observability page's dashboard, from a real run.

    .venv/bin/pip install -e '.[docs]'
    .venv/bin/python docs/gen_dashboard.py            # about two minutes

Worker processes take, hold, lose and abandon locks on a SQLite table, each recording through
the OpenTelemetry SDK (an in-memory reader, read every few seconds into a file), while
``sqllocker exporter`` serves the table and is scraped as Prometheus would; a purge runs every
half minute. The panels are the page's queries over those series.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

SECONDS = 100.0
STEP = 2.0  # seconds between scrapes, and between the workers' readings
WORKERS = 4
OUT = Path(__file__).resolve().parent / "images" / "dashboard.png"


def worker(url: str, table: str, seconds: float, readings: Path) -> None:
    """Locks as jobs take them: mostly released, some busy or timed out, now and then one
    held past its expiry (lost, its renewal failing) or abandoned (left to expire)."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from sqllocker import Locker, LockError

    reader = InMemoryMetricReader()
    locker = Locker(url, table=table, meter_provider=MeterProvider(metric_readers=[reader]))
    end, next_reading = time.monotonic() + seconds, 0.0
    abandoned = []
    while time.monotonic() < end:
        job = f"job {random.randrange(6)}"
        try:
            lock = locker.lock(job, wait=random.choice([0, 0.2, 1.0]), expires=1.0)
            chance = random.random()
            if chance < 0.05:  # stalled past its expiry: the renewal fails, the lock is lost
                time.sleep(1.6)
                with contextlib.suppress(LockError):
                    lock.extend()
            elif chance < 0.08:  # the process "dies": its row stays until purged
                lock._finalizer.detach()
                abandoned.append(lock)
            else:
                time.sleep(random.uniform(0.05, 0.4))
                lock.unlock()
        except LockError:
            time.sleep(0.05)
        if time.monotonic() >= next_reading:
            next_reading = time.monotonic() + STEP
            with readings.open("a") as out:
                out.write(json.dumps([time.time(), _points(reader)]) + "\n")
    locker.close()


def _points(reader: Any) -> list[dict[str, Any]]:
    data = reader.get_metrics_data()
    points = []
    for resource in data.resource_metrics if data else []:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    entry = {"name": metric.name, **dict(point.attributes)}
                    if hasattr(point, "bucket_counts"):
                        entry["buckets"] = list(point.bucket_counts)
                        entry["bounds"] = list(point.explicit_bounds)
                    else:
                        entry["value"] = point.value
                    points.append(entry)
    return points


def scrape(port: int) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def run(workdir: Path) -> tuple[list[tuple[float, dict[str, float]]], list[Path]]:
    from sqllocker import Locker

    url, table = f"sqlite:///{workdir / 'locks.db'}", "jobs"
    Locker(url, table=table).create_table()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    sqllocker = Path(sys.executable).parent / "sqllocker"
    exporter = subprocess.Popen(
        [sqllocker, "--url", url, "--table", table, "exporter", "--listen", f"127.0.0.1:{port}"]
    )
    readings = [workdir / f"worker{n}.jsonl" for n in range(WORKERS)]
    workers = [mp.Process(target=worker, args=(url, table, SECONDS, path)) for path in readings]
    for process in workers:
        process.start()
    scraped, started, purged = [], time.time(), time.time()
    try:
        while any(process.is_alive() for process in workers):
            time.sleep(STEP)
            try:
                scraped.append((time.time() - started, scrape(port)))
            except OSError:
                continue  # the exporter still starting
            if time.time() - purged > 30:
                Locker(url, table=table).purge_expired_locks()
                purged = time.time()
    finally:
        exporter.terminate()
        exporter.wait(10)
    return scraped, readings


def quantile(buckets: list[float], bounds: list[float], q: float) -> float | None:
    """Prometheus's ``histogram_quantile`` over one interval's bucket counts."""
    total = sum(buckets)
    if total == 0:
        return None
    seen = 0.0
    for index, count in enumerate(buckets):
        if seen + count >= q * total:
            lower = bounds[index - 1] if index else 0.0
            upper = bounds[index] if index < len(bounds) else bounds[-1]
            return lower + (upper - lower) * ((q * total - seen) / count if count else 0)
        seen += count
    return bounds[-1]


def per_interval(readings: list[Path], started: float) -> dict[str, list[Any]]:
    """The workers' points, as each one's increase since its last reading, summed per step:
    the busy, timeout, lost and failed rates per second, and the acquire duration's p50 and
    p99 over the step."""
    steps: dict[int, dict[Any, Any]] = {}
    for path in readings:
        previous: dict[Any, Any] = {}
        for line in path.read_text().splitlines():
            moment, points = json.loads(line)
            step = steps.setdefault(int((moment - started) // STEP), {})
            for point in points:
                key = (point["name"], point.get("sqllocker.outcome", ""))
                if "buckets" in point:
                    before = previous.get(key, [0] * len(point["buckets"]))
                    grown = [a - b for a, b in zip(point["buckets"], before, strict=True)]
                    summed = step.get(key, [0] * len(grown))
                    step[key] = [a + b for a, b in zip(summed, grown, strict=True)]
                    step["bounds"] = point["bounds"]
                    previous[key] = point["buckets"]
                else:
                    step[key] = step.get(key, 0) + point["value"] - previous.get(key, 0)
                    previous[key] = point["value"]
    series: dict[str, list[Any]] = {
        key: [] for key in ("t", "p50", "p99", "busy", "timeout", "lost", "failed")
    }
    acquire = "sqllocker.lock.acquire.duration"
    for index in sorted(steps):
        step = steps[index]
        series["t"].append(index * STEP)
        for name, q in (("p50", 0.5), ("p99", 0.99)):
            series[name].append(
                quantile(step.get((acquire, "acquired"), []), step.get("bounds", []), q)
            )
        for outcome in ("busy", "timeout"):
            series[outcome].append(sum(step.get((acquire, outcome), [])) / STEP)
        series["lost"].append(step.get(("sqllocker.lock.lost", ""), 0) / STEP)
        series["failed"].append(step.get(("sqllocker.lock.renewals", "failed"), 0) / STEP)
    return series


def render(scraped: list[tuple[float, dict[str, float]]], series: dict[str, list[Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.style.use("dark_background")
    figure, axes = plt.subplots(2, 3, figsize=(15, 7))
    t = [moment for moment, _ in scraped]

    def table(name: str) -> list[float]:
        return [values.get(name, 0.0) for _, values in scraped]

    panels = [
        ("Waiting for locks (acquired), s", [("p50", series["t"], series["p50"]),
                                            ("p99", series["t"], series["p99"])]),
        ("Busy and timed out, /s", [("busy", series["t"], series["busy"]),
                                    ("timeout", series["t"], series["timeout"])]),
        ("Lost and renewal failures, /s", [("lost", series["t"], series["lost"]),
                                           ("renewals failed", series["t"], series["failed"])]),
        ("Locks held (exporter)", [("sqllocker_locks_held", t, table("sqllocker_locks_held"))]),
        ("Oldest hold, s (exporter)",
         [("sqllocker_lock_oldest_held_seconds", t, table("sqllocker_lock_oldest_held_seconds"))]),
        ("Expired, not purged (exporter)",
         [("sqllocker_locks_expired", t, table("sqllocker_locks_expired"))]),
    ]  # fmt: skip
    for axis, (title, lines) in zip(axes.flat, panels, strict=True):
        for label, xs, ys in lines:
            axis.plot(xs, [y if y is not None else float("nan") for y in ys], label=label)
        axis.set_title(title, loc="left", fontsize=11)
        axis.set_xlabel("seconds into the run", fontsize=8)
        axis.grid(alpha=0.2)
        axis.legend(fontsize=8, loc="upper left")
    figure.suptitle(f"sqllocker: {WORKERS} processes on 6 jobs, from a real run", fontsize=13)
    figure.tight_layout()
    OUT.parent.mkdir(exist_ok=True)
    figure.savefig(OUT, dpi=80)


def main() -> int:
    with tempfile.TemporaryDirectory() as workdir:
        started = time.time()
        scraped, readings = run(Path(workdir))
        render(scraped, per_interval(readings, started))
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
