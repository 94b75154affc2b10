"""A sync worker process: random operations on the campaign's locks until the faults stop, then
the liveness phase (each lock once more, waiting long enough to be served whatever happened).

``python -m tests.campaign.worker CONFIG_JSON`` (the campaign starts it; see ``sections.py``).
Its ``sqllocker run`` processes are forked from a server it forks as it starts
(``processes.py``).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Sequence

import sqlalchemy as sa

import sqllocker.cli  # noqa: F401 -- what the runs run, imported once, before the runs' server
from sqllocker import Lock, Locker
from sqllocker.engine import resolve_url
from tests.campaign import guarded, mutants, plan, processes
from tests.campaign.history import History, now
from tests.campaign.sections import (
    ChaosEnd,
    WorkerConfig,
    next_operation,
    outcome,
    parse_config,
)
from tests.fork_server import Server, run_module

RUN_TIMEOUT = 60.0


class SyncWorker:
    def __init__(self, config: WorkerConfig, runs: Server) -> None:
        self.config = config
        self.runs = runs  # forks the ``sqllocker run`` processes
        self.rng = plan.operation_rng(config.seed, config.number, config.incarnation, 0)
        self.history = History(config.history, config.name)
        self.locker = Locker(
            config.url, table=config.table, expires=config.expires, grace=config.grace
        )
        self.engine = sa.create_engine(resolve_url(config.url))
        self.decorated = self.locker.locked(
            plan.DECORATED, wait=0.5, expires=config.expires, on_busy="skip"
        )(self._decorated_body)

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> None:
        self.history.record("start", incarnation=self.config.incarnation)
        chaos_end = ChaosEnd(self.config)
        chaos_end.wait()
        step = 0
        while now() < chaos_end.at():
            step += 1
            self.rng = plan.operation_rng(
                self.config.seed, self.config.number, self.config.incarnation, step
            )
            if not self.config.operations:  # none of those asked for is of this kind
                time.sleep(0.1)
                continue
            op = next_operation(self.rng, self.config.operations)
            getattr(self, op)(op)
            time.sleep(self.rng.uniform(0, 0.05))
        for lockstring in plan.LOCKS:
            self.acquire_and_hold("liveness", lockstring, wait=self.config.liveness_wait)
        self.semaphore("liveness", wait=self.config.liveness_wait)
        self.history.record("done")
        self.locker.close()
        self.engine.dispose()
        self.runs.close()

    # -- operations ---------------------------------------------------------------------------

    def lock_wait(self, op: str) -> None:
        # Some wait long enough to ride out an outage longer than the expiry.
        wait = self.rng.uniform(0, 2) if self.rng.random() < 0.7 else self.rng.uniform(2, 10)
        self.acquire_and_hold(op, self.rng.choice(plan.LOCKS), wait=wait)

    def lock_nowait(self, op: str) -> None:
        self.acquire_and_hold(op, self.rng.choice(plan.LOCKS), wait=0)

    def hold_at_least(self, op: str) -> None:
        self.acquire_and_hold(
            op, self.rng.choice(plan.LOCKS), wait=1.0, hold_at_least=self.rng.uniform(0.1, 1.0)
        )

    def try_lock(self, op: str) -> None:
        lockstring = self.rng.choice(plan.LOCKS)
        self.history.record("invoke", op=op, ls=lockstring)
        try:
            lock = self.locker.try_lock(lockstring, expires=self.config.expires)
        except Exception as error:
            outcome(self.history, op, error, ls=lockstring)
            return
        if lock is None:
            self.history.record("fail", op=op, ls=lockstring, error="busy")
            return
        self.history.record("ok", op=op, ls=lockstring, id=lock.lock_id)
        self.hold(op, [lock], lock)

    def acquire_and_hold(self, op: str, lockstring: str, wait: float, **options: object) -> None:
        keep_alive = self.rng.random() < 0.5
        self.history.record("invoke", op=op, ls=lockstring, wait=wait, keep_alive=keep_alive)
        try:
            lock = self.locker.lock(
                lockstring,
                wait=wait,
                expires=self.config.expires,
                keep_alive=keep_alive,
                **options,  # type: ignore[arg-type]
            )
        except Exception as error:
            outcome(self.history, op, error, ls=lockstring)
            return
        self.history.record("ok", op=op, ls=lockstring, id=lock.lock_id)
        self.hold(op, [lock], lock)

    def lock_all(self, op: str) -> None:
        lockstrings = self.rng.sample(plan.LOCKS, 2)
        self.history.record("invoke", op=op, ls=lockstrings)
        try:
            group = self.locker.lock_all(
                lockstrings, wait=self.rng.uniform(0, 1.5), expires=self.config.expires
            )
        except Exception as error:
            outcome(self.history, op, error, ls=lockstrings)
            return
        members = list(group.locks)
        self.history.record(
            "ok",
            op=op,
            ls=[lock.lockstring for lock in members],
            ids=[lock.lock_id for lock in members],
            asked=lockstrings,
        )
        self.hold(op, members, group)

    def semaphore(self, op: str, wait: float | None = None) -> None:
        permits = self.locker.semaphore(plan.SEMAPHORE, plan.SEMAPHORE_LIMIT)
        wait = self.rng.uniform(0, 1.5) if wait is None else wait
        self.history.record("invoke", op=op, sem=plan.SEMAPHORE, wait=wait)
        try:
            permit = permits.acquire(
                wait=wait, expires=self.config.expires, keep_alive=self.rng.random() < 0.5
            )
        except Exception as error:
            outcome(self.history, op, error, sem=plan.SEMAPHORE)
            return
        self.history.record(
            "ok", op=op, ls=permit.lockstring, id=permit.lock_id, sem=plan.SEMAPHORE
        )
        self.hold(op, [permit], permit)

    def decorator(self, op: str) -> None:
        lockstring = plan.DECORATED.format(n=0)
        self.history.record("invoke", op=op, ls=lockstring)
        try:
            ran = self.decorated(0)
        except Exception as error:
            outcome(self.history, op, error, ls=lockstring)
            return
        if ran:
            self.history.record("ok", op=op, ls=lockstring)
        else:
            self.history.record("fail", op=op, ls=lockstring, error="skipped")

    def _decorated_body(self, n: int) -> bool:
        lockstring = plan.DECORATED.format(n=n)
        self.history.record("deco", phase="enter", ls=lockstring)
        time.sleep(self.rng.uniform(0, 0.03))
        self.history.record("deco", phase="exit", ls=lockstring)
        return True

    def run_command(self, op: str) -> None:
        lockstring = self.rng.choice(plan.RUN_LOCKS)
        seconds = self.rng.uniform(0.2, 5.0)
        command = [
            *["-m", processes.RUNNER],
            *["--url", self.config.url, "--table", self.config.table, "run", "-q"],
            *["--expires", str(self.config.expires), "--wait", str(self.rng.uniform(0, 4))],
            *["--kill-after", str(self.config.kill_after), lockstring, "--"],
            *[sys.executable, "-m", "tests.campaign.command", self.config.history, str(seconds)],
        ]
        self.history.record("invoke", op=op, ls=lockstring, seconds=seconds)
        try:
            # Its stdin, stdout and stderr are the worker's; it outlives a worker killed.
            status = self.runs.run(
                command,
                processes.RUNNER_NAME,
                files=(None, None, None),
                timeout=RUN_TIMEOUT,
                die_with_parent=False,
            )
        except subprocess.TimeoutExpired:
            self.history.record("info", op=op, ls=lockstring, error="timeout")
            return
        kind = {0: "ok", 1: "fail"}.get(status, "info")
        self.history.record(kind, op=op, ls=lockstring, status=status)

    def dawdle(self, op: str) -> None:
        """Hold a lock without keep-alive past its expiry (a process paused by a long GC, say),
        then extend it, write under it and release it: each must fail if anyone took it."""
        lockstring = self.rng.choice(plan.LOCKS)
        self.history.record("invoke", op=op, ls=lockstring)
        try:
            lock = self.locker.lock(lockstring, wait=1.0, expires=self.config.expires)
        except Exception as error:
            outcome(self.history, op, error, ls=lockstring)
            return
        self.history.record("ok", op=op, ls=lockstring, id=lock.lock_id)
        self.observe([lock])
        until = now() + self.config.expires + self.config.grace + self.rng.uniform(0.1, 1.0)
        while now() < until:
            time.sleep(0.2)
            self.observe([lock])
        self.extend(op, lock, [lock])
        self.observe([lock])
        self.write(op, [lock])
        self.release(op, lock, [lock])

    # -- what a holder does -------------------------------------------------------------------

    def hold(self, op: str, locks: Sequence[Lock], handle: object) -> None:
        self.observe(locks)
        self.write(op, locks)
        for _ in range(self.rng.randint(0, 3)):
            time.sleep(self.rng.uniform(0, 0.1))
            self.observe(locks)
        if self.rng.random() < 0.3:
            self.extend(op, handle, locks)
            self.observe(locks)
        self.release(op, handle, locks)

    def observe(self, locks: Sequence[Lock]) -> None:
        for lock in locks:
            at = now()  # before the call: a True answer means valid at this moment
            self.history.record(
                "valid", at=at, ls=lock.lockstring, id=lock.lock_id, v=lock.is_valid()
            )

    def write(self, op: str, locks: Sequence[Lock]) -> None:
        fields = {
            "ls": [lock.lockstring for lock in locks],
            "ids": [lock.lock_id for lock in locks],
        }
        self.history.record("invoke", op="write", during=op, **fields)
        try:
            seqs = guarded.write(self.engine, locks, self.config.name, op)
        except Exception as error:
            outcome(self.history, "write", error, **fields)
            return
        self.history.record("ok", op="write", seqs=seqs, **fields)

    def extend(self, op: str, handle: object, locks: Sequence[Lock]) -> None:
        ids = [lock.lock_id for lock in locks]
        self.history.record("invoke", op="extend", during=op, ids=ids)
        try:
            handle.extend()  # type: ignore[attr-defined]
        except Exception as error:
            outcome(self.history, "extend", error, ids=ids)
            return
        self.history.record("ok", op="extend", ids=ids)

    def release(self, op: str, handle: object, locks: Sequence[Lock]) -> None:
        ids = [lock.lock_id for lock in locks]
        self.history.record("invoke", op="release", during=op, ids=ids)
        try:
            handle.unlock()  # type: ignore[attr-defined]
        except Exception as error:
            outcome(self.history, "release", error, ids=ids)
            return
        self.history.record("ok", op="release", ids=ids)


def main(argv: list[str] | None = None) -> int:
    # The runs' server first: it must hold no mutant (each run applies its own), no
    # connection and no thread.
    runs = Server.fork(run_module)
    mutants.apply()
    config = parse_config(argv)
    SyncWorker(config, runs).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
