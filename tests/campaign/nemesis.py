"""The nemesis: faults at moments and of kinds drawn from the campaign's seed, each recorded in
the history (``fault``, and ``fault_end`` when it is undone), until the faults stop.

Kinds: ``kill`` (SIGKILL a worker; the campaign starts it again), ``clock`` (the same, and it
comes back in a time namespace whose boot-time clock, which sqllocker keeps validity on, is
up to a day ahead of the host's; where time namespaces can be made), ``pause`` (SIGSTOP a
worker, SIGCONT later, at times past its locks' expiry), ``pause_runner`` (the same to the
sqllocker of a ``run`` in progress), ``break`` (``Locker.break_lock`` of a held lock),
``release_force`` (``sqllocker release --force --id``), ``purge`` (``sqllocker purge-expired``
running beside), and through the stall proxy on the servers: ``stall`` (a silent network for
a while), ``cut`` (every connection reset) and ``lose_answer`` (the next statement on the lock table
reaches the server, its answer is lost, and the network stays silent for a while: an acquire
whose row is in, or a release or renewal done, and a client that cannot know it); on a server
the campaign started itself (``--private-server``): ``restart`` (the server stopped, fast or
as a crash would stop it, and started again a while later).

The operators' commands (``release_force`` and ``purge``: ``OPERATOR_COMMANDS``) each have a
number (``operator``) and their command line (``command``) in their ``fault`` event, and their
exit status (``status``), the start of their stderr (``stderr``, whose whole text is kept as
``operator-N-KIND.stderr`` beside the history) and whether it holds a ``traceback`` in their
``fault_end``; the checker judges them (``operators``).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import sqlalchemy as sa

from sqllocker import Locker, LockError
from sqllocker.engine import resolve_url
from sqllocker.permits import permit_lockstring
from tests.campaign import plan, processes
from tests.campaign.database import LOCK_TABLE
from tests.campaign.history import History, now
from tests.fork_server import Server, process_name
from tests.private_servers import PrivateMariaDB, PrivatePostgres
from tests.stall_proxy import StallProxy

T = TypeVar("T")
OPERATOR_TIMEOUT = 300.0  # seconds: an operator's command still running then is killed
OPERATOR_COMMANDS = ("release_force", "purge")  # the faults that are a `sqllocker` command
STDERR_LINES = 3  # the first lines of an operator's stderr kept in the history (and its last)
SERVER_START_TIMEOUT = 60.0
SERVER_BACK_BEFORE_END = 2.0  # seconds: a restarted server is started again this long before


@dataclass(frozen=True)
class Fault:
    offset: float  # seconds after the campaign began
    kind: str
    pick: float  # which target, as a fraction of those there are then
    fraction: float  # how long, as a fraction of the kind's range


def schedule(settings: plan.Settings) -> list[Fault]:
    """The faults of the whole campaign, from the seed alone: the same list on every run."""
    rng = plan.nemesis_rng(settings.seed)
    kinds = settings.fault_kinds()
    faults, offset = [], 0.0
    while kinds:
        offset += rng.uniform(*settings.fault_gap)
        if offset >= settings.seconds:
            break
        faults.append(Fault(offset, rng.choice(kinds), rng.random(), rng.random()))
    return faults


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux ``/proc``)."""
    found: list[int] = []
    pending = [pid]
    while pending:
        parent = pending.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            with suppress(OSError):
                children = [int(child) for child in (task / "children").read_text().split()]
                found += children
                pending += children
    return found


def run_lock_id(runner: int) -> int | None:
    """The fencing token of the lock a ``sqllocker run`` holds, as its command was given it."""
    for pid in descendants(runner):
        try:
            environment = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for entry in environment:
            if entry.startswith(b"SQLLOCKER_LOCK_ID="):
                return int(entry.partition(b"=")[2])
    return None


Outcome = dict[str, object]


def stderr_outcome(path: Path) -> Outcome:
    """What the history keeps of an operator's stderr: its first ``STDERR_LINES`` lines (and
    its last, after ``...``), and whether it holds a Python traceback."""
    try:
        text = path.read_text(errors="replace")
    except OSError as error:
        return {"stderr": f"(unread: {error})"}
    lines = [line.rstrip()[:300] for line in text.splitlines() if line.strip()]
    if len(lines) > STDERR_LINES + 1:
        lines = [*lines[:STDERR_LINES], "...", lines[-1]]
    outcome: Outcome = {"stderr": "\n".join(lines)}
    if "Traceback (most recent call last)" in text:
        outcome["traceback"] = True
    return outcome


class Nemesis:
    def __init__(
        self,
        settings: plan.Settings,
        history_path: Path,
        url: str,
        workers: Callable[[], dict[int, int]],
        launcher: Server,
        proxy: StallProxy | None,
        step_clock_of: Callable[[int, int], None] | None = None,
        on_undone: Callable[[], None] | None = None,
        server: PrivatePostgres | PrivateMariaDB | None = None,
    ) -> None:
        self.settings = settings
        self.history = History(history_path, "nemesis")
        self.url = url
        self.workers = workers  # worker number -> pid of the live ones
        self.launcher = launcher  # the operators' commands are forked from it (processes.py)
        self.proxy = proxy
        self.step_clock_of = step_clock_of  # (worker, seconds): its next boot clock that far ahead
        self.on_undone = on_undone  # called once every fault is undone
        self.server = server  # the campaign's own, to restart
        self.server_down = False
        self.until = float("inf")  # when the faults stop
        self.locker = Locker(url, table=LOCK_TABLE, expires=settings.expires, grace=settings.grace)
        self.schedule = schedule(settings)
        self._pick = 0.0  # this fault's draws: which target, and how long (as fractions)
        self._fraction = 0.0
        self.counts: Counter[str] = Counter()
        self.undo: list[tuple[float, str, Callable[[], None], dict[str, object]]] = []
        self.directory = history_path.parent  # where each operator's stderr is kept
        self.operated = 0  # operators' commands started
        self.operators: list[threading.Thread] = []

    def run(self, began: float, until: float) -> None:
        """Inject the scheduled faults (offsets from ``began``) until ``until`` (monotonic, or
        sooner if ``end_now`` is called), then undo every one still in force."""
        pending = list(self.schedule)
        self.until = until
        while now() < self.until:
            self._undo_due(now())
            if pending and now() >= began + pending[0].offset:
                fault = pending.pop(0)
                self._pick, self._fraction = fault.pick, fault.fraction
                injected = sum(self.counts.values())
                getattr(self, fault.kind.replace("break", "break_"))()
                if sum(self.counts.values()) == injected:
                    self.pause()  # nothing for that kind to act on now (no lock held, say)
            time.sleep(0.02)
        self.stop()

    def end_now(self) -> None:
        """Stop injecting faults (from another thread): ``run`` undoes them and returns."""
        self.until = min(self.until, now())

    def _choose(self, items: list[T]) -> T:
        return items[min(int(self._pick * len(items)), len(items) - 1)]

    def _seconds(self, shortest: float, longest: float) -> float:
        return shortest + self._fraction * (longest - shortest)

    def stop(self) -> None:
        self._undo_due(float("inf"))
        if self.proxy is not None:
            # A lost answer armed just before its undo can stall the proxy after it: undone here.
            self.proxy.stop_losing()
            self.proxy.resume()
        # Every fault is undone; the operators' breaks and purges running beside may still end.
        self.history.record("faults_undone")
        if self.on_undone is not None:
            self.on_undone()
        for operator in self.operators:
            operator.join(OPERATOR_TIMEOUT)
        self.history.record("faults_stop", counts=dict(self.counts))
        self.locker.close()

    def _undo_due(self, moment: float) -> None:
        due = [entry for entry in self.undo if entry[0] <= moment]
        self.undo = [entry for entry in self.undo if entry[0] > moment]
        for _, kind, action, fields in sorted(due, key=lambda entry: entry[0]):
            action()
            self.history.record("fault_end", kind=kind, **fields)

    def _count(self, kind: str, **fields: object) -> float:
        self.counts[kind] += 1
        return self.history.record("fault", kind=kind, **fields)

    # -- the faults ---------------------------------------------------------------------------

    def _pick_worker(self) -> tuple[int, int] | None:
        live = sorted(self.workers().items())
        return self._choose(live) if live else None

    def kill(self) -> None:
        picked = self._pick_worker()
        if picked is None:
            return
        number, pid = picked
        self._count("kill", worker=number, target=pid)
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    def clock(self) -> None:
        picked = self._pick_worker()
        if picked is None or self.step_clock_of is None:
            return
        number, pid = picked
        seconds = int(self._seconds(1, 86400))
        self._count("clock", worker=number, target=pid, boottime_ahead=seconds)
        self.step_clock_of(number, seconds)
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    def pause(self) -> None:
        picked = self._pick_worker()
        if picked is None:
            return
        number, pid = picked
        self._stop_for(pid, "pause", worker=number)

    def pause_runner(self) -> None:
        runners = [
            pid
            for worker in self.workers().values()
            for pid in descendants(worker)
            if process_name(pid) == processes.RUNNER_NAME
        ]
        if not runners:
            return
        runner = self._choose(sorted(runners))
        self._stop_for(runner, "pause_runner", id=run_lock_id(runner))

    def _stop_for(self, pid: int, kind: str, **fields: object) -> None:
        longest = 2 * (self.settings.expires + self.settings.grace)
        seconds = self._seconds(0.1, longest)
        self._count(kind, target=pid, seconds=seconds, **fields)
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)

        def resume() -> None:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

        self.undo.append((now() + seconds, kind, resume, {"target": pid, **fields}))

    def _held(self) -> tuple[str, int] | None:
        """A live lock to break, among those held now (not the decorator's: its body has no
        handle to learn of the loss, so the checker would see a second holder it was promised
        nothing about)."""
        breakable = {
            *plan.LOCKS,
            *plan.RUN_LOCKS,
            *(permit_lockstring(plan.SEMAPHORE, slot) for slot in range(plan.SEMAPHORE_LIMIT)),
        }
        try:
            held = [info for info in self.locker.locks() if not info.expired]
        except LockError:
            return None
        candidates = sorted(
            (info.lockstring, info.lock_id) for info in held if info.lockstring in breakable
        )
        return self._choose(candidates) if candidates else None

    def break_(self) -> None:
        held = self._held()
        if held is None:
            return
        lockstring, lock_id = held
        self._count("break", ls=lockstring, id=lock_id)
        fields = {"ls": lockstring, "id": lock_id}
        self._beside("break", fields, lambda: self._break(lockstring, lock_id))

    def _break(self, lockstring: str, lock_id: int) -> dict[str, object]:
        try:
            broken = self.locker.break_lock(lockstring, lock_id)
        except LockError as error:
            return {"error": str(error)[:300]}
        return {"broken": broken is not None}

    def release_force(self) -> None:
        held = self._held()
        if held is None:
            return
        lockstring, lock_id = held
        arguments = ["release", "--force", "--id", str(lock_id), lockstring]
        self._operator("release_force", arguments, ls=lockstring, id=lock_id)

    def purge(self) -> None:
        grace = str(self.settings.grace)
        self._operator("purge", ["purge-expired", "--grace", grace, "--pause-ratio", "0"])

    def _operator(self, kind: str, arguments: list[str], **fields: object) -> None:
        """An operator's ``sqllocker ARGUMENTS``, run beside the nemesis's schedule: its exit
        status and stderr recorded when it ends (killed if it runs ``OPERATOR_TIMEOUT``)."""
        self.operated += 1
        fields["operator"] = self.operated
        self._count(kind, command=shlex.join(["sqllocker", *arguments]), **fields)
        command = [*self._cli(), *arguments]
        stderr = self.directory / f"operator-{self.operated}-{kind}.stderr"

        def operate() -> dict[str, object]:
            files = (os.devnull, os.devnull, str(stderr))
            process = self.launcher.spawn(command, "sqllocker", files=files)
            outcome: dict[str, object] = {}
            try:
                outcome["status"] = process.wait(OPERATOR_TIMEOUT)
            except subprocess.TimeoutExpired:
                process.kill()
                outcome["status"] = process.wait()
                outcome["timed_out"] = OPERATOR_TIMEOUT
            return {**outcome, **stderr_outcome(stderr)}

        self._beside(kind, fields, operate)

    def _beside(self, kind: str, fields: dict[str, object], act: Callable[[], Outcome]) -> None:
        """An operator's break, release or purge, run beside the nemesis's schedule (it waits
        as long as the database makes it, behind a guarded transaction say), recorded when it
        ends (``fault_end``, with ``fields`` and ``act``'s outcome, or the error it raised)."""
        began = now()

        def operate() -> None:
            try:
                outcome = act()
            except Exception as error:  # recorded: the checker judges an operator's command
                outcome = {"error": repr(error)[:300]}
            self.history.record("fault_end", kind=kind, seconds=now() - began, **fields, **outcome)

        thread = threading.Thread(target=operate, name=f"nemesis {kind}", daemon=True)
        thread.start()
        self.operators.append(thread)

    def stall(self) -> None:
        assert self.proxy is not None
        seconds = self._seconds(0.1, 2 * (self.settings.expires + self.settings.grace))
        self._count("stall", seconds=seconds)
        self.proxy.stall()
        self.undo.append((now() + seconds, "stall", self.proxy.resume, {}))

    def lose_answer(self) -> None:
        assert self.proxy is not None
        seconds = self._seconds(0.1, 2 * (self.settings.expires + self.settings.grace))
        self._count("lose_answer", seconds=seconds)
        self.proxy.lose_answer_to(LOCK_TABLE.encode(), then_stall=True)
        self.undo.append((now() + seconds, "lose_answer", self._stop_losing, {}))

    def _stop_losing(self) -> None:
        assert self.proxy is not None
        self.proxy.stop_losing()
        self.proxy.resume()

    def cut(self) -> None:
        assert self.proxy is not None
        self._count("cut", connections=self.proxy.cut_all())

    def restart(self) -> None:
        """Stop the server, fast (PostgreSQL ``-m fast``, MariaDB SIGTERM) or as a crash would
        (``-m immediate``, SIGKILL), and start it again a while later."""
        if self.server is None or self.server_down:
            return
        crash = self._pick < 0.5
        mode = "immediate" if crash else "fast"
        seconds = self._seconds(0.1, 2 * (self.settings.expires + self.settings.grace))
        # Back before the faults stop, so that the liveness phase meets a server that is up
        # (a worker started during the outage has never reached it: its acquires fail at once).
        seconds = min(seconds, self.until - SERVER_BACK_BEFORE_END - now())
        if seconds < 0.1:
            return
        began = self._count("restart", mode=mode, seconds=seconds)
        self.server_down = True
        try:
            self.server.stop(crash=crash)
        except Exception as error:  # a shutdown that failed: the server may still run
            self.history.record("fault_end", kind="restart", error=str(error)[:300])
            self.server_down = False
            return
        self.history.record("server_stopped", mode=mode, seconds=now() - began)
        self.undo.append((now() + seconds, "restart", self._start_server, {"mode": mode}))

    def _start_server(self) -> None:
        assert self.server is not None
        for attempt in range(3):
            try:
                self.server.start()
                self._until_ready()
                break
            except Exception:  # a start that failed: again, a moment later
                if attempt == 2:
                    raise
                time.sleep(1)
        self.server_down = False

    def _until_ready(self) -> None:
        """Until the restarted server answers a query (MariaDB listens before it is ready for
        a shutdown: a SIGTERM that soon is missed)."""
        engine = sa.create_engine(resolve_url(self.url), poolclass=sa.pool.NullPool)
        deadline = now() + SERVER_START_TIMEOUT
        try:
            while True:
                try:
                    with engine.connect() as conn:
                        conn.execute(sa.text("SELECT 1"))
                    return
                except sa.exc.SQLAlchemyError:
                    if now() > deadline:
                        raise
                    time.sleep(0.2)
        finally:
            engine.dispose()

    def _cli(self) -> list[str]:
        return ["-m", "sqllocker.cli", "--url", self.url, "--table", LOCK_TABLE]
