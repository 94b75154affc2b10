"""Runs one campaign: ``python -m tests.campaign --backend sqlite|postgresql|mysql --seconds S
--seed N`` from the checkout's root.

It makes a database of its own (SQLite: a file in a temporary directory), starts the workers
(on the servers, through a stall proxy on 127.0.0.1), runs the nemesis for S seconds while
restarting the workers it kills, then stops the faults and lets every worker go through the
liveness phase, checks, prints the report, and drops the database. The exit status is 0 only
if no violation was found; the last line is the summary.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import random
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import sqlalchemy as sa

from sqllocker import Locker, LockError
from sqllocker.permits import permit_lockstring
from tests.campaign import checker, database, history, mutants, plan, processes, report
from tests.campaign.nemesis import Nemesis, descendants
from tests.campaign.sections import WorkerConfig
from tests.fork_server import Child, Server, boot_clock_ahead
from tests.private_servers import (
    PrivateMariaDB,
    PrivatePostgres,
    private_server,
    private_servers_missing,
)
from tests.stall_proxy import StallProxy

ROOT = Path(__file__).resolve().parents[2]
PR_SET_CHILD_SUBREAPER = 36
WATCH_PERIOD = 0.5  # seconds between the checks of the history so far (--stop-on)


class Workers:
    """The worker processes: started (by ``launcher``, see ``processes.py``), restarted after
    the nemesis kills one (until the faults stop), and waited for."""

    def __init__(
        self, settings: plan.Settings, url: str, directory: Path, launcher: Server
    ) -> None:
        self.settings = settings
        self.url = url
        self.launcher = launcher
        self.history_path = directory / "history.jsonl"
        self.chaos_end_file = directory / "chaos_end"
        self.chaos_end = float("inf")
        self.logs = directory
        self.processes: dict[int, tuple[str, Child]] = {}
        self.exits: dict[str, int | None] = {}
        self.incarnations: dict[int, int] = {}
        self.clock_steps: dict[int, int] = {}  # worker -> its next start's boot-time offset
        self._lock = threading.Lock()

    def start(self, number: int) -> None:
        incarnation = self.incarnations.get(number, -1) + 1
        self.incarnations[number] = incarnation
        config = WorkerConfig(
            url=self.url,
            table=database.LOCK_TABLE,
            history=str(self.history_path),
            number=number,
            incarnation=incarnation,
            seed=self.settings.seed,
            chaos_end_file=str(self.chaos_end_file),
            expires=self.settings.expires,
            grace=self.settings.grace,
            kill_after=self.settings.kill_after,
            liveness_wait=self.settings.liveness_wait,
            operations=list(self.settings.operations_for(self.settings.worker_is_async(number))),
        )
        module = "async_worker" if self.settings.worker_is_async(number) else "worker"
        step = self.clock_steps.pop(number, None)
        environment = dict(os.environ, PYTHONPATH=str(ROOT))
        environment.pop(mutants.ENVIRONMENT_VARIABLE, None)
        if self.settings.mutant:
            environment[mutants.ENVIRONMENT_VARIABLE] = self.settings.mutant
        log = str(self.logs / f"{config.name}.log")
        process = self.launcher.spawn(
            ["-m", f"tests.campaign.{module}", config.to_json()],
            module,
            env=environment,
            cwd=ROOT,
            files=(os.devnull, log, log),
            boottime_ahead=step,
        )
        with self._lock:
            self.processes[number] = (config.name, process)

    def wait_until_ready(self, timeout: float = 120.0) -> None:
        """Until every worker has started (recorded ``start``)."""
        deadline = history.now() + timeout
        while history.now() < deadline:
            if self.history_path.exists():
                events = history.read(self.history_path)
                if sum(1 for event in events if event["type"] == "start") >= self.settings.workers:
                    return
            time.sleep(0.1)
        raise RuntimeError("the workers did not start; see their logs")

    def begin(self, seconds: float) -> float:
        """Start the campaign's clock: tell the workers when the faults stop."""
        began = history.now()
        self.chaos_end = began + seconds
        staging = self.chaos_end_file.with_suffix(".new")
        staging.write_text(f"{self.chaos_end!r}\n")
        staging.rename(self.chaos_end_file)
        return began

    def end_chaos_now(self) -> None:
        """Bring the moment the faults stop forward to now (the workers read it again before
        each operation)."""
        self.chaos_end = min(self.chaos_end, history.now())
        staging = self.chaos_end_file.with_suffix(".new")
        staging.write_text(f"{self.chaos_end!r}\n")
        staging.rename(self.chaos_end_file)

    def step_clock_of(self, number: int, seconds: int) -> None:
        self.clock_steps[number] = seconds

    def live(self) -> dict[int, int]:
        with self._lock:
            return {n: p.pid for n, (_, p) in self.processes.items() if p.poll() is None}

    def supervise(self, stop: threading.Event) -> None:
        """Restart killed workers until the faults stop."""
        while not stop.is_set():
            with self._lock:
                ended = [
                    (n, name, p) for n, (name, p) in self.processes.items() if p.poll() is not None
                ]
            for number, name, process in ended:
                self.exits[name] = process.returncode
                if history.now() < self.chaos_end - 0.5:
                    self.start(number)
                else:
                    with self._lock:
                        del self.processes[number]
            stop.wait(0.1)

    def wait(self, deadline: float) -> None:
        with self._lock:
            remaining = list(self.processes.values())
        for name, process in remaining:
            try:
                process.wait(max(0.1, deadline - history.now()))
                self.exits[name] = process.returncode
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGUSR1)  # its stacks, to its log
                time.sleep(1)
                process.kill()
                process.wait()
                self.exits[name] = None  # it had to be killed: it never ended


class Snapshots:
    """The lock table's live rows, read again and again from the moment the faults stop (for
    the ``held-by-nobody`` check), until ``finish`` has seen them all expire or gone."""

    PERIOD = 0.25

    def __init__(self, url: str) -> None:
        self.locker = Locker(url, table=database.LOCK_TABLE)
        self.taken: list[checker.Snapshot] = []
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="snapshots", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def take(self) -> checker.Snapshot | None:
        at = history.now()
        try:
            infos = self.locker.locks()
        except LockError:
            self.failures += 1
            return None
        rows = [
            {
                "ls": info.lockstring,
                "id": info.lock_id,
                "pid": info.locked_by.get("pid"),
                "left": info.seconds_left,
            }
            for info in infos
            if not info.expired
        ]
        snapshot = checker.Snapshot(at, rows)
        self.taken.append(snapshot)
        return snapshot

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.take()
            self._stop.wait(self.PERIOD)

    def finish(self, longest: float) -> list[checker.Snapshot]:
        """Stop polling, then read until no live row is left (for at most ``longest``
        seconds): the campaign's last word on the rows."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        deadline = history.now() + longest
        while True:
            snapshot = self.take()
            if (snapshot is not None and not snapshot.rows) or history.now() > deadline:
                break
            time.sleep(self.PERIOD)
        self.locker.close()
        return self.taken


def run(settings: plan.Settings, launcher: Server, keep: Path | None = None) -> int:
    """One campaign, its processes started by ``launcher`` (``processes.py``); prints its
    report; returns how many violations it found."""
    if not settings.private_server or settings.backend == "sqlite":
        return _run(settings, launcher, keep, None)
    missing = private_servers_missing()
    if missing is not None:
        raise SystemExit(f"--private-server {missing}")
    with private_server(settings.backend) as server:
        print(f"private {settings.backend} server on port {server.port}", flush=True)
        return _run(settings, launcher, keep, server)


def _run(
    settings: plan.Settings,
    launcher: Server,
    keep: Path | None,
    server: PrivatePostgres | PrivateMariaDB | None,
) -> int:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # orphans come back to us
    directory = Path(tempfile.mkdtemp(prefix="sqllocker-campaign-"))
    db = database.create(settings.backend, directory, server.url if server else None)
    proxy = None
    violations = -1
    try:
        worker_url = db.url
        if settings.backend != "sqlite":
            proxy = StallProxy(database.server_port(db.url))
            worker_url = database.through_port(db.url, proxy.port)
        workers = Workers(settings, worker_url, directory, launcher)
        history_path = workers.history_path
        for number in range(settings.workers):
            workers.start(number)  # they touch nothing before the campaign's clock starts
        permits = [permit_lockstring(plan.SEMAPHORE, slot) for slot in range(plan.SEMAPHORE_LIMIT)]
        db.prepare([*plan.LOCKS, *permits])
        workers.wait_until_ready()
        began = workers.begin(settings.seconds)
        chaos_end = workers.chaos_end
        stop = threading.Event()
        supervisor = threading.Thread(target=workers.supervise, args=(stop,), daemon=True)
        supervisor.start()
        steps = workers.step_clock_of if time_namespaces() else None
        snapshots = Snapshots(db.url)
        nemesis = Nemesis(
            settings,
            history_path,
            db.url,
            workers.live,
            launcher,
            proxy,
            steps,
            snapshots.start,
            server,
        )
        watcher = None
        if settings.stop_on:
            watcher = threading.Thread(
                target=_stop_on_violation,
                args=(settings, history_path, began, workers, nemesis, stop),
                name="watcher",
                daemon=True,
            )
            watcher.start()
        nemesis.run(began, chaos_end)
        stop.set()
        supervisor.join()
        if watcher is not None:
            watcher.join()
        workers.wait(history.now() + 4 * settings.liveness_wait + 30)
        launcher.close()
        _end_descendants(server)
        taken = snapshots.finish(settings.expires + checker.NOBODY_SLACK + 1)
        with open(directory / "snapshots.jsonl", "w") as kept_rows:  # kept with the history
            kept_rows.writelines(json.dumps(snapshot.__dict__) + "\n" for snapshot in taken)
        events = history.read(history_path)
        rows, counters = _rows(db)
        verdict = checker.check(events, rows, counters, workers.exits, settings, began, taken)
        violations = len(verdict.violations)
        print(report.render(settings, events, verdict, began))
        if violations or keep is not None:
            kept = keep or Path(tempfile.mkdtemp(prefix="sqllocker-campaign-kept-"))
            shutil.copytree(directory, kept, dirs_exist_ok=True)
            print(f"history and worker logs kept in {kept}")
        print(report.summary(settings, events, violations))
    except BaseException:
        kept = keep or Path(tempfile.mkdtemp(prefix="sqllocker-campaign-kept-"))
        shutil.copytree(directory, kept, dirs_exist_ok=True)
        print(f"the campaign failed; its history and worker logs are kept in {kept}")
        raise
    finally:
        _end_descendants(server)  # after a failure part-way, workers may still wait for the clock
        if proxy is not None:
            proxy.close()
        db.drop()
        shutil.rmtree(directory, ignore_errors=True)
    return violations


def _stop_on_violation(
    settings: plan.Settings,
    history_path: Path,
    began: float,
    workers: Workers,
    nemesis: Nemesis,
    stop: threading.Event,
) -> None:
    """Check the history so far every ``WATCH_PERIOD``; once it shows a violation of one of
    ``settings.stop_on``, end the faults now. The verdict is still the full check's, after
    the liveness phase, on the whole history (which holds every violation seen here)."""
    while not stop.wait(WATCH_PERIOD):
        seen = [
            violation
            for violation in checker.early(history.read(history_path), settings, began)
            if violation.check in settings.stop_on
        ]
        if seen:
            print(
                f"faults ended at {history.now() - began:.1f}s of {settings.seconds:g}s: "
                f"[{seen[0].check}] seen",
                flush=True,
            )
            workers.end_chaos_now()
            nemesis.end_now()
            return


def time_namespaces() -> bool:
    """Whether time namespaces can be made here (Linux 5.6, and root)."""
    try:
        subprocess.run(["true"], check=True, preexec_fn=lambda: boot_clock_ahead(1))
    except (OSError, subprocess.SubprocessError):
        return False
    return True


def _rows(db: database.CampaignDatabase) -> tuple[list[dict[str, object]], dict[str, int]]:
    engine = db.engine()
    try:
        with engine.connect() as conn:
            rows = [dict(row._mapping) for row in conn.execute(sa.select(database.writes))]
            counters = {
                row.lockstring: row.value for row in conn.execute(sa.select(database.counters))
            }
    finally:
        engine.dispose()
    return rows, counters


def _end_descendants(server: PrivatePostgres | PrivateMariaDB | None = None) -> None:
    """What is left of the runs' processes (a killed worker's ``sqllocker run`` goes on): SIGTERM,
    a moment, then SIGKILL. Not the private server's (restarted, they are ours too)."""
    for signum in (signal.SIGTERM, signal.SIGKILL):
        spared = _server_processes(server)
        left = [pid for pid in descendants(os.getpid()) if pid not in spared]
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signum)
        if left:
            time.sleep(0.5)
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG) == (0, 0):
                break
        except ChildProcessError:
            break


def _server_processes(server: PrivatePostgres | PrivateMariaDB | None) -> set[int]:
    """The private server's processes (started again by the nemesis, they are our orphans)."""
    if server is None:
        return set()
    roots = set()
    if isinstance(server, PrivatePostgres):
        pid_file = server.data / "postmaster.pid"
    else:
        pid_file = server.home / "pid"
        if server.process is not None:
            roots.add(server.process.pid)  # runuser, mariadbd's parent
    with contextlib.suppress(OSError, ValueError, IndexError):
        roots.add(int(pid_file.read_text().split()[0]))
    return roots | {pid for root in roots for pid in descendants(root)}


def _gap(text: str) -> tuple[float, float]:
    low, high = (float(part) for part in text.split(","))
    return low, high


def _stop_on(text: str | None, parser: argparse.ArgumentParser) -> tuple[str, ...]:
    checks = tuple(text.split(",")) if text else ()
    unknown = sorted(set(checks) - set(checker.EARLY_CHECKS))
    if unknown:
        parser.error(f"--stop-on: not checks that can end a campaign early: {unknown}")
    return checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.campaign", description=__doc__)
    parser.add_argument("--backend", choices=["sqlite", "postgresql", "mysql"], required=True)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--seed", type=int, help="default: a fresh one, printed")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--expires", type=float, default=2.0)
    parser.add_argument("--faults", help="comma-separated fault kinds (default: all)")
    parser.add_argument("--operations", help="comma-separated operations (default: all)")
    parser.add_argument(
        "--fault-gap",
        default="0.5,2.5",
        help="the nemesis waits between LOW and HIGH seconds between faults (LOW,HIGH)",
    )
    parser.add_argument("--mutant", choices=mutants.MUTANTS, help="break the library on purpose")
    parser.add_argument(
        "--private-server",
        action="store_true",
        help="run on a server of the campaign's own (not the suite's), which the nemesis "
        "restarts (needs root and the servers' binaries)",
    )
    parser.add_argument(
        "--stop-on",
        help="comma-separated checks (of: " + ", ".join(checker.EARLY_CHECKS) + "): end the "
        "faults as soon as the history so far shows a violation of one (default: never)",
    )
    parser.add_argument("--keep", type=Path, help="copy the history and logs here")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 10**6)
    settings = plan.Settings(
        backend=args.backend,
        seconds=args.seconds,
        seed=seed,
        workers=args.workers,
        expires=args.expires,
        faults=tuple(args.faults.split(",")) if args.faults else (),
        operations=tuple(args.operations.split(",")) if args.operations else (),
        mutant=args.mutant,
        fault_gap=_gap(args.fault_gap),
        private_server=args.private_server,
        stop_on=_stop_on(args.stop_on, parser),
    )
    print(f"campaign: {settings.backend} seed {seed}, {settings.seconds:g}s", flush=True)
    launcher = processes.launcher(settings.backend)  # before anything connects or starts
    try:
        return 1 if run(settings, launcher, args.keep) else 0
    finally:
        launcher.close()
