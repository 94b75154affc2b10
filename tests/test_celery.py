"""sqllocker.celery with real Celery workers and beat processes (tests/celery_app.py), Redis as
broker and result backend, on every backend: at most one copy per lockstring, skip/retry/raise,
a SIGKILLed worker's lock freed by expiry and its acks_late re-delivery held off meanwhile, a lost
lock reported as the task's failure, and two beat processes' copies of a periodic task run once
per period."""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("celery")
redis = pytest.importorskip("redis")

from celery.result import AsyncResult  # noqa: E402

from sqllocker import Locker  # noqa: E402
from sqllocker.celery import is_skipped  # noqa: E402
from tests import forked_cli  # noqa: E402
from tests.conftest import IN_CI  # noqa: E402
from tests.helpers import wait_until  # noqa: E402

pytestmark = pytest.mark.slow  # real workers, schedulers or processes

REDIS_URL = os.environ.get("SQLLOCKER_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
ROOT = Path(__file__).resolve().parent.parent


class Cluster:
    """Worker and beat processes of tests/celery_app.py on this test's queue, key prefix, lock
    table and state directory; the app itself, configured the same way, to send tasks."""

    def __init__(self, url: str, table: str, state: Path) -> None:
        self.state = state
        self.prefix = f"sqllocker-test-{uuid.uuid4().hex[:12]}:"
        self.env = {
            **os.environ,
            "CELERY_TEST_PREFIX": self.prefix,
            "CELERY_TEST_QUEUE": self.prefix + "tasks",
            "CELERY_TEST_STATE": str(state),
            "CELERY_TEST_URL": url,
            "CELERY_TEST_TABLE": table,
            "CELERY_TEST_REDIS": REDIS_URL,
            "PYTHONPATH": str(ROOT),
        }
        self.processes: list[tuple[forked_cli.Popen, Path]] = []
        # tests/celery_app.py reads its settings when imported, here as in the workers.
        self.saved = {k: v for k, v in os.environ.items() if k.startswith("CELERY_TEST_")}
        os.environ.update({k: v for k, v in self.env.items() if k.startswith("CELERY_TEST_")})
        for name in [m for m in sys.modules if m == "tests.celery_app"]:
            del sys.modules[name]
        import tests.celery_app as app_module

        self.app = app_module

    def start(self, *arguments: str, ready: str, wait: bool = True) -> forked_cli.Popen:
        """Start a celery process (in a session of its own, forked from a server that imported
        Celery once: ``tests/forked_cli.py``); with ``wait``, return once its log says
        ``ready``."""
        log = self.state / f"process-{len(self.processes)}.log"
        process = forked_cli.Popen(
            ["-A", "tests.celery_app", *arguments],
            program="celery",
            env=self.env,
            cwd=ROOT,
            stdout=os.devnull,
            stderr=log,
        )
        self.processes.append((process, log))
        if wait:
            wait_until(lambda: ready in log.read_text(errors="replace"), timeout=90)
        return process

    def workers(self, pool: str, *names: str) -> list[forked_cli.Popen]:
        """Worker processes, started together; returned once each is ready."""
        started = [
            self.start(
                "worker",
                f"--pool={pool}",
                "--concurrency=3",
                f"--hostname={name}-{self.prefix[:-1]}@localhost",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
                "--loglevel=INFO",
                ready="ready.",
                wait=False,
            )
            for name in names
        ]
        logs = [log for process, log in self.processes if process in started]
        wait_until(
            lambda: all("ready." in log.read_text(errors="replace") for log in logs), timeout=90
        )
        return started

    def beat(self, number: int) -> forked_cli.Popen:
        return self.start(
            "beat",
            f"--schedule={self.state / f'beat-{number}'}",
            "--loglevel=INFO",
            ready="beat: Starting",
        )

    def logs(self) -> str:
        return "".join(log.read_text(errors="replace") for _, log in self.processes)

    def records(self) -> list[dict[str, Any]]:
        runs = self.state / "runs.jsonl"
        if not runs.exists():
            return []
        return [json.loads(line) for line in runs.read_text().splitlines()]

    def started(self, name: str, count: int = 1) -> list[dict[str, Any]]:
        def enough() -> bool:
            return len(self.events(name, "start")) >= count

        wait_until(enough, timeout=60)
        return self.events(name, "start")

    def events(self, name: str, event: str) -> list[dict[str, Any]]:
        return [r for r in self.records() if r["name"] == name and r["event"] == event]

    def stop_early(self, name: str) -> None:
        (self.state / f"{name}.stop").touch()

    def close(self) -> None:
        for process, _ in self.processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process, _ in self.processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        for key in [k for k in os.environ if k.startswith("CELERY_TEST_")]:
            del os.environ[key]
        os.environ.update(self.saved)
        client = redis.Redis.from_url(REDIS_URL)
        keys = list(client.scan_iter(match=self.prefix + "*"))
        if keys:
            client.delete(*keys)
        client.close()


@pytest.fixture
def cluster(
    url: str, table_name: str, tmp_path: Path, make_locker: Callable[..., Locker]
) -> Iterator[Cluster]:
    try:
        redis.Redis.from_url(REDIS_URL).ping()
    except redis.exceptions.ConnectionError as error:
        if IN_CI:
            pytest.fail(f"Redis at {REDIS_URL} is unreachable: {error} (CI requires it)")
        pytest.skip(f"Redis at {REDIS_URL} is unreachable: {error}")
    make_locker()  # creates the table
    running = Cluster(url, table_name, tmp_path)
    yield running
    running.close()


def results(sent: list[AsyncResult[Any]]) -> list[AsyncResult[Any]]:
    for result in sent:
        result.get(timeout=120, propagate=False)
    return sent


def assert_one_at_a_time(cluster: Cluster) -> None:
    records = cluster.records()
    assert [r for r in records if r["event"] == "overlap"] == []
    for name in {r["name"] for r in records}:
        spans = sorted(
            (r["at"], r["event"]) for r in records if r["name"] == name and r["event"] != "stale"
        )
        # start, end, start, end ... for each lockstring: never two starts in a row
        assert all(a[1] != b[1] for a, b in itertools.pairwise(spans)), f"{name}: {spans}"


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_one_copy_per_lockstring_skip_retry_raise(cluster: Cluster, pool: str) -> None:
    cluster.workers(pool, "w1", "w2")
    tasks = cluster.app
    # A first copy of each holds its lock while more copies arrive, and find free slots (six).
    first = [
        tasks.work_skip.delay("a", 30),
        tasks.work_retry.delay("b", 30),
        tasks.work_raise.delay("c", 30),
    ]
    for name in "abc":
        cluster.started(name)
    skips = [tasks.work_skip.delay("a", 0.2) for _ in range(4)]
    retries = [tasks.work_retry.delay("b", 0.2) for _ in range(3)]
    raises = [tasks.work_raise.delay("c", 0.2) for _ in range(2)]
    results(skips)
    results(raises)

    def all_retried() -> bool:  # each retry copy has found the lock held, and retried
        logs = cluster.logs()
        return all(f"[{r.id}] retry: Retry in" in logs for r in retries)

    wait_until(all_retried, timeout=60)
    for name in "abc":
        cluster.stop_early(name)
    results(first + retries)

    assert all(r.state == "SUCCESS" for r in first)
    # skip: every copy that arrived while the lock was held succeeded without running
    assert [(r.state, is_skipped(r.result)) for r in skips] == [("SUCCESS", True)] * 4
    assert len(cluster.events("a", "start")) == 1
    assert "skipped tests.celery_app.work_skip" in cluster.logs()
    # retry: each copy ran in the end, one at a time, after retrying while the lock was held
    assert [r.result for r in retries] == ["b", "b", "b"]
    started = cluster.events("b", "start")
    assert len(started) == 4
    assert all(r["retries"] > 0 for r in started[1:])
    # raise: the copies failed with LockBusy, and did not run
    assert all(r.state == "FAILURE" for r in raises)
    assert {type(r.result).__name__ for r in raises} == {"LockBusy"}
    assert len(cluster.events("c", "start")) == 1
    assert_one_at_a_time(cluster)


def test_sigkilled_worker_frees_the_lock_by_expiry_and_its_redelivery_waits(
    cluster: Cluster,
) -> None:
    """work_late: acks_late with reject_on_worker_lost, so the message of a task whose worker
    process is SIGKILLed is delivered again at once; its lock (8 s) is still the dead process's,
    so the second delivery retries until the lock expires, then runs: never both at once."""
    cluster.workers("prefork", "w1", "w2")
    sent = cluster.app.work_late.delay("k", 60)
    (first,) = cluster.started("k")
    os.kill(first["pid"], signal.SIGKILL)
    cluster.stop_early("k")
    assert sent.get(timeout=120) == "k"

    first_run, second_run = cluster.events("k", "start")
    assert second_run["pid"] != first["pid"]
    assert second_run["retries"] > 0  # held off while the dead worker's lock lived
    assert second_run["lock_id"] > first_run["lock_id"]  # taken over once it expired
    assert [r["of"] for r in cluster.events("k", "stale")] == [first["pid"]]
    assert cluster.events("k", "overlap") == []
    assert len(cluster.events("k", "end")) == 1


def test_a_lock_lost_while_the_task_runs_is_its_failure(
    cluster: Cluster, make_locker: Callable[..., Locker]
) -> None:
    cluster.workers("threads", "w1")
    sent = cluster.app.work_skip.delay("lost", 60)
    cluster.started("lost")
    assert make_locker().break_lock("work lost") is not None
    cluster.stop_early("lost")
    sent.get(timeout=60, propagate=False)
    assert sent.state == "FAILURE"
    assert type(sent.result).__name__ == "LockLost"


def test_two_beat_processes_run_a_periodic_task_once_per_period(cluster: Cluster) -> None:
    """Two beat processes each send beat_tick every 3 s (out of phase: an interval schedule
    counts from its beat's start); with lock_hold_at_least="schedule" it runs at most once a
    period, and every copy either ran or was skipped."""
    every = cluster.app.BEAT_EVERY
    cluster.workers("prefork", "w1", "w2")
    beats = [cluster.beat(1), cluster.beat(2)]
    beat_logs = [log for process, log in cluster.processes if process in beats]

    def sent_by_each() -> list[int]:
        return [log.read_text(errors="replace").count("Sending due task tick") for log in beat_logs]

    wait_until(lambda: min(sent_by_each()) >= 5, timeout=180)  # both beat processes send
    for process in beats:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)
    # A beat logs a send before it publishes: one stopped in between sent one copy fewer.
    sent = sum(sent_by_each())

    def received() -> int:
        return len(
            re.findall(r"Task tests\.celery_app\.beat_tick\[[^\]]+\] received", cluster.logs())
        )

    def handled() -> int:
        return len(cluster.events("tick", "end")) + cluster.logs().count(
            "skipped tests.celery_app.beat_tick"
        )

    # Every copy the workers received ran or was skipped, and none but those a stopped beat
    # never published went missing.
    try:
        wait_until(lambda: sent - len(beats) <= received() == handled(), timeout=60)
    except AssertionError:
        raised = [line for line in cluster.logs().splitlines() if "raised" in line]
        pytest.fail(f"sent {sent}, received {received()}, handled {handled()}; {raised}")
    assert received() <= sent, (received(), sent)
    runs = sorted(r["at"] for r in cluster.events("tick", "start"))
    assert len(runs) >= 2
    assert received() - len(runs) >= 2
    # At most once a period. The lock keeps runs 3/4 of a period apart by the database's clock
    # (the window and the grace); these times are the workers', taken just after acquiring, so
    # some slack. Two runs in one period would be at most half a period apart.
    assert all(b - a > 0.6 * every for a, b in itertools.pairwise(runs)), runs
    assert_one_at_a_time(cluster)


def docs_example(page: str) -> str:
    """The first Python block of a docs page."""
    text = (ROOT / "docs" / page).read_text()
    return text.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_docs_example_runs(
    cluster: Cluster, url: str, table_name: str, make_locker: Callable[..., Locker]
) -> None:
    """docs/celery.md's tasks.py, on this test's Redis keys, queue and lock table."""
    example = docs_example("celery.md")
    for placeholder in ('"redis://localhost:6379/0"', '"postgresql://app@db/app"'):
        assert placeholder in example
    example = example.replace('"redis://localhost:6379/0"', repr(REDIS_URL)).replace(
        '"postgresql://app@db/app"', f"{url!r}, table={table_name!r}"
    )
    transport = {"global_keyprefix": cluster.prefix}
    example += (
        f"\napp.conf.update(broker_transport_options={transport!r}, "
        f"result_backend_transport_options={transport!r}, "
        f"task_default_queue={cluster.prefix + 'tasks'!r})\n"
    )
    (cluster.state / "tasks.py").write_text(example)
    log = cluster.state / "docs-worker.log"
    worker = forked_cli.Popen(  # python -m celery, as Cluster.start starts it
        [
            "-A",
            "tasks",
            "worker",
            "--pool=threads",
            f"--hostname=docs-{cluster.prefix[:-1]}@localhost",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "--loglevel=INFO",
        ],
        program="celery",
        env={**cluster.env, "PYTHONPATH": f"{cluster.state}:{ROOT}"},
        cwd=cluster.state,
        stdout=os.devnull,
        stderr=log,
    )
    cluster.processes.append((worker, log))
    wait_until(lambda: "ready." in log.read_text(errors="replace"), timeout=90)
    sys.path.insert(0, str(cluster.state))
    try:
        import tasks  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(cluster.state))
    try:
        made = tasks.make_report.delay("2026-11-25").get(timeout=60)
        assert made.startswith("report 2026-11-25 made under lock ")
        assert tasks.purge_expired.delay().get(timeout=60) == 0
        with make_locker().lock("report 2026-11-26"), make_locker().lock("invoice 7"):
            assert is_skipped(tasks.make_report.delay("2026-11-26").get(timeout=60))
            invoice = tasks.send_invoice.delay(7)
            wait_until(lambda: "Retry in 1s" in log.read_text(errors="replace"), timeout=60)
        assert invoice.get(timeout=60) == "invoice 7 sent"
    finally:
        tasks.locker.close()
        del sys.modules["tasks"]
