"""Worker processes for the multi-process tests: ``python -m tests.workers counter ...``.

Each worker (a sync one, or with ``--asyncio`` an async one running several tasks) takes random
lockstrings from a shared set, and under each lock does a read-sleep-write of a per-lockstring
counter file. It also creates a marker file with O_EXCL on
entry and removes it on exit, so a second holder is caught the instant it enters, and logs every
acquisition (lockstring, lock id, monotonic entry and exit times) as a JSON line for the checker.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import fcntl
import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TextIO

import sqlalchemy as sa

from sqllocker import Lock, LockBusy, Locker, LockError, LockLost, clock, tickets
from sqllocker.asyncio import AsyncLock, AsyncLocker
from sqllocker.engine import resolve_url
from tests.helpers import abandon
from tests.helpers import async_url as async_url  # the tests' import of it


def ended_waits(locker: Locker | AsyncLocker) -> int:
    """Waits cut short because the line stood still on a free row: waiters that took the row
    past a live ticket ahead (``tickets.PATIENCE``)."""
    return locker._tickets.line.passed


# With --cancel-some: the share of acquire attempts, and of releases, cancelled mid-way.
CANCELLED_SHARE = 0.3


class CriticalSection:
    """The work done under each lock: an O_EXCL marker file (a second holder is caught the
    instant it enters) and a read-pause-write of the lockstring's counter file (a second holder
    loses an update)."""

    def __init__(self, state: Path) -> None:
        self.state = state
        self.overlaps = 0

    def enter(self, lockstring: str) -> int:
        try:
            os.close(
                os.open(self.state / f"{lockstring}.holder", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            )
        except FileExistsError:
            self.overlaps += 1
        counter_file = self.state / f"{lockstring}.count"
        try:
            return int(counter_file.read_text()) if counter_file.exists() else 0
        except ValueError:  # torn read: another holder is writing it right now
            self.overlaps += 1
            return 0

    def leave(self, lockstring: str, value: int) -> None:
        (self.state / f"{lockstring}.count").write_text(str(value + 1))
        (self.state / f"{lockstring}.holder").unlink(missing_ok=True)


def acquire(locker: Locker, lockstring: str, args: argparse.Namespace, keep_alive: bool) -> Lock:
    """Wait for the lock (``wait=None``), or with ``--try-only`` try again and again without
    waiting (``wait=0``, the one-attempt path), as a poller of its own would."""
    if not args.try_only:
        return locker.lock(lockstring, wait=None, expires=args.expires, keep_alive=keep_alive)
    while True:
        try:
            return locker.lock(lockstring, expires=args.expires, keep_alive=keep_alive)
        except LockBusy:
            time.sleep(random.uniform(0, 0.002))


def counter(args: argparse.Namespace) -> int:
    """The sync worker: ``--threads`` threads share one Locker, its listener and its line (on
    PostgreSQL one of them reads the listening connection for all while it waits)."""
    locker = Locker(
        sa.create_engine(resolve_url(args.url)) if args.callers_engine else args.url,
        table=args.table,
        grace=args.grace,
        transaction_pooling=args.transaction_pooling,
    )
    work = CriticalSection(Path(args.state))
    lockstrings = args.lockstrings.split(",")
    tally = {"lost": 0, "abandoned": 0, "renewed": 0}
    guard = threading.Lock()  # the tally's and the log's
    failures: list[BaseException] = []

    def turns(numbers: range, log: TextIO) -> None:
        for number in numbers:
            lockstring = random.choice(lockstrings)
            # The middle turn of every N: held past its expiry while the others contend.
            every = args.outlive_every
            keep_alive = bool(every) and number % every == every // 2
            lock = acquire(locker, lockstring, args, keep_alive)
            try:
                entered = time.monotonic()
                valid_for = _valid_for(lock)
                value = work.enter(lockstring)
                # Held beyond its expiry now and then: only its keep-alive keeps it ours.
                time.sleep(args.expires * 1.5 if keep_alive else args.hold)
                if keep_alive:
                    # Still our row, pushed past the expiry the acquire set: renewed.
                    row = locker.lock_info(lockstring)
                    ours = row is not None and row.lock_id == lock.lock_id
                    with guard:
                        tally["renewed"] += ours and row is not None and row.expires > lock.expires
                work.leave(lockstring, value)
                left = time.monotonic()
            finally:
                if args.abandon_every and number % args.abandon_every == 0:
                    abandon(lock)  # the row stays until the others take it over
                    with guard:
                        tally["abandoned"] += 1
                else:
                    unlocking = time.monotonic()
                    try:
                        lock.unlock()
                    except LockLost as error:
                        with guard:
                            tally["lost"] += 1
                        _tell_lost(lock, entered, valid_for, unlocking, error)
            record = {"ls": lockstring, "id": lock.lock_id, "in": entered, "out": left}
            with guard:
                log.write(json.dumps(record) + "\n")

    def thread_turns(numbers: range, log: TextIO) -> None:
        try:
            turns(numbers, log)
        except BaseException as error:
            failures.append(error)
            raise

    with open(work.state / f"log-{os.getpid()}.jsonl", "w") as log:
        threads = [
            threading.Thread(target=thread_turns, args=(range(n, args.count, args.threads), log))
            for n in range(args.threads)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    if failures:
        raise failures[0]
    # PostgreSQL: how many of its locks a release handed over (migration 0005).
    handed_over = locker._tickets.listener.grants if locker._tickets.listener is not None else 0
    report = {
        "pid": os.getpid(),
        "overlaps": work.overlaps,
        **tally,
        "handed_over": handed_over,
        "ended_waits": ended_waits(locker),
    }
    print(json.dumps(report))
    return 0


def async_counter(args: argparse.Namespace) -> int:
    """``counter`` through AsyncLocker, by ``--tasks`` concurrent tasks sharing the process."""
    return asyncio.run(_async_counter(args))


async def _async_counter(args: argparse.Namespace) -> int:
    from sqllocker.asyncio import AsyncLocker

    asyncio.get_running_loop().add_signal_handler(DUMP_SIGNAL, _print_tasks)
    locker = AsyncLocker(
        async_url(args.url),
        table=args.table,
        grace=args.grace,
        transaction_pooling=args.transaction_pooling,
    )
    work = CriticalSection(Path(args.state))
    lockstrings = args.lockstrings.split(",")
    lost = 0

    async def acquire_cancelling_some(lockstring: str) -> AsyncLock | None:
        """Acquires cut off after a moment, any of them mid-statement (and the lock they won
        released by the library), until one is not: then that lock, or None to wait."""
        while random.random() < CANCELLED_SHARE:
            with contextlib.suppress(asyncio.TimeoutError):
                return await asyncio.wait_for(
                    locker.lock(lockstring, wait=None, expires=args.expires),
                    random.uniform(0, 0.003),
                )
        return None

    async def task(log: TextIO, count: int) -> None:
        nonlocal lost
        for _ in range(count):
            lockstring = random.choice(lockstrings)
            lock = await acquire_cancelling_some(lockstring) if args.cancel_some else None
            if lock is None:
                lock = await locker.lock(lockstring, wait=None, expires=args.expires)
            try:
                entered = time.monotonic()
                valid_for = _valid_for(lock)
                value = work.enter(lockstring)
                await asyncio.sleep(args.hold)  # other tasks run meanwhile
                work.leave(lockstring, value)
                left = time.monotonic()
            finally:
                try:
                    if args.cancel_some and random.random() < CANCELLED_SHARE:
                        with contextlib.suppress(asyncio.TimeoutError):
                            await asyncio.wait_for(lock.unlock(), random.uniform(0, 0.002))
                    unlocking = time.monotonic()
                    await lock.unlock()  # waits for a release in flight, or releases
                except LockLost as error:
                    lost += 1
                    _tell_lost(lock, entered, valid_for, unlocking, error)
            record = {"ls": lockstring, "id": lock.lock_id, "in": entered, "out": left}
            log.write(json.dumps(record) + "\n")

    with open(work.state / f"log-{os.getpid()}.jsonl", "w") as log:
        shares = [
            args.count // args.tasks + (n < args.count % args.tasks) for n in range(args.tasks)
        ]
        await asyncio.gather(*(task(log, share) for share in shares))
    ended = ended_waits(locker)
    await locker.aclose()
    report = {"pid": os.getpid(), "overlaps": work.overlaps, "lost": lost}
    print(json.dumps({**report, "ended_waits": ended}))
    return 0


def hold(args: argparse.Namespace) -> int:
    """Take a lock, report it, then obey commands on stdin: ``check`` (act as a possibly stale
    holder and report what happened), ``release``, ``unlock`` (at once, and report what it
    raised and how often on_lost was called), or end of input (exit holding it)."""
    import sqlalchemy as sa

    lost_calls: list[str] = []
    locker = Locker(args.url, table=args.table, grace=args.grace)
    lock = locker.lock(
        args.lockstring,
        wait=None,
        expires=args.expires,
        keep_alive=args.keep_alive,
        on_lost=lambda error: lost_calls.append(str(error)),
    )
    _say(event="acquired", lock_id=lock.lock_id, at=time.monotonic())
    for line in sys.stdin:
        command = line.strip()
        if command == "check":
            if args.keep_alive:
                deadline = time.monotonic() + 2  # let the woken keep-alive thread notice
                while not lost_calls and time.monotonic() < deadline:
                    time.sleep(0.01)
            report: dict[str, object] = {"event": "checked", "is_valid": lock.is_valid()}
            report["on_lost_called"] = len(lost_calls)
            for name, step in (("check", lock.check), ("extend", lock.extend)):
                try:
                    step()
                    report[name] = "ok"
                except LockLost:
                    report[name] = "LockLost"
            engine = sa.create_engine(locker.url)
            with engine.connect() as conn, conn.begin():
                try:
                    lock.guard(conn)
                    report["guard"] = "ok"
                except LockLost:
                    report["guard"] = "LockLost"
            with engine.begin() as conn:  # the protected resource's fenced write
                report["fenced_rows_written"] = conn.execute(
                    sa.text(
                        "UPDATE fenced SET fence = :fence, value = 'stale' "
                        "WHERE name = :name AND fence < :fence"
                    ),
                    {"fence": lock.lock_id, "name": args.lockstring},
                ).rowcount
            engine.dispose()
            try:
                lock.unlock()
                report["unlock"] = "ok"
            except LockLost:
                report["unlock"] = "LockLost"
            _say(**report)
        elif command == "release":
            lock.unlock()
            _say(event="released", at=time.monotonic())
        elif command == "unlock":  # at once, racing the woken keep-alive thread
            try:
                lock.unlock()
                outcome = "ok"
            except LockLost:
                outcome = "LockLost"
            time.sleep(0.5)  # a second call of on_lost would come by now
            _say(event="unlocked", unlock=outcome, on_lost_called=len(lost_calls))
    os._exit(0)  # leave holding it, as a crash would (no finaliser runs)


def pairs(args: argparse.Namespace) -> int:
    """Take random pairs of the lockstrings together (``lock_all``) ``--count`` times, waiting
    for ever and for a minute in turn (a finite wait bounds the attempts' statements); under
    each pair, the read-sleep-write of both lockstrings' counters, and a log line per member."""
    locker = Locker(args.url, table=args.table, grace=args.grace)
    work = CriticalSection(Path(args.state))
    lockstrings = args.lockstrings.split(",")
    with open(work.state / f"log-{os.getpid()}.jsonl", "w") as log:
        for n in range(args.count):
            pair = random.sample(lockstrings, 2)
            group = locker.lock_all(pair, wait=None if n % 2 else 60.0, expires=args.expires)
            entered = time.monotonic()
            values = {lockstring: work.enter(lockstring) for lockstring in pair}
            time.sleep(args.hold)
            for lockstring, value in values.items():
                work.leave(lockstring, value)
            left = time.monotonic()
            group.unlock()
            for lock in group.locks:
                record = {"ls": lock.lockstring, "id": lock.lock_id, "in": entered, "out": left}
                log.write(json.dumps(record) + "\n")
    print(json.dumps({"pid": os.getpid(), "overlaps": work.overlaps}))
    locker.close()
    return 0


def semaphore(args: argparse.Namespace) -> int:
    """Take permits of one semaphore again and again until ``--seconds`` have passed; while
    holding one, count this process among the holders in a file shared by the workers (under
    an flock of its own, so the count is exact), and record the most holders ever seen.

    Workers may give different ``--limit``s. Each also checks what its own limit promises: the
    holders present both before its acquire began and once it holds its permit held theirs
    throughout its count, so with it they are at most its limit (a breach is written to
    ``violations``)."""
    locker = Locker(args.url, table=args.table, grace=args.grace)
    permits = locker.semaphore(args.name, args.limit)
    state = Path(args.state)
    holders = state / "holders"
    present_file = state / "present"  # one line per holder present: "<pid>-<n>"
    deadline = time.monotonic() + args.seconds
    taken = 0

    def shared(change: int, token: str) -> set[str]:
        """Under the flock: the holders present (before ``change``), then count ``token`` in
        (+1) or out (-1); ``change`` 0 only reads."""
        with open(state / "count.lock", "a") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)
            present = set(present_file.read_text().split()) if present_file.exists() else set()
            if change == 0:
                return present
            now = int(holders.read_text()) if holders.exists() else 0
            now += change
            holders.write_text(str(now))
            most = state / "most"
            if now > (int(most.read_text()) if most.exists() else 0):
                most.write_text(str(now))
            changed = present | {token} if change > 0 else present - {token}
            present_file.write_text("\n".join(sorted(changed)))
            return present

    with open(state / f"log-{os.getpid()}.jsonl", "w") as log:
        while time.monotonic() < deadline:
            token = f"{os.getpid()}-{taken}"
            before = shared(0, token)
            permit = permits.acquire(wait=None, expires=args.expires)
            entered = time.monotonic()
            throughout = before & shared(+1, token)
            if len(throughout) + 1 > args.limit:
                with open(state / "violations", "a") as violations:
                    violations.write(f"limit {args.limit}: {sorted(throughout)} + {token}\n")
            time.sleep(random.uniform(0.005, 0.03))
            shared(-1, token)
            left = time.monotonic()
            permit.unlock()
            taken += 1
            record = {"ls": permit.lockstring, "id": permit.lock_id, "in": entered, "out": left}
            log.write(json.dumps(record) + "\n")
    _say(taken=taken, limit=args.limit)
    locker.close()
    return 0


def failover(args: argparse.Namespace) -> int:
    """Contend until ``<state>/stop`` exists, through a failover: a database error (the primary
    gone, the new one not yet promoted) is logged and the acquire tried again. Every
    acquisition is logged as by ``counter``, with the monotonic time its acquire returned; now
    and then the keeper's lockstrings are tried too, and a success logged (a takeover)."""
    locker = Locker(args.url, table=args.table, grace=args.grace)
    work = CriticalSection(Path(args.state))
    lockstrings = args.lockstrings.split(",")
    kept = args.kept.split(",") if args.kept else []
    errors = 0
    with open(work.state / f"log-{os.getpid()}.jsonl", "w") as log:
        while not (work.state / "stop").exists():
            lockstring = random.choice(lockstrings)
            try:
                if kept and random.random() < 0.2:
                    taken = locker.try_lock(random.choice(kept), expires=args.expires)
                    if taken is not None:
                        record = {"ls": taken.lockstring, "id": taken.lock_id, "took_kept": True}
                        log.write(json.dumps({**record, "in": time.monotonic()}) + "\n")
                        taken.unlock()
                    continue
                asked = time.monotonic()
                lock = locker.lock(lockstring, wait=args.wait, expires=args.expires)
            except LockError as error:
                errors += 1
                log.write(json.dumps({"error": str(error)[:200], "at": time.monotonic()}) + "\n")
                time.sleep(0.05)
                continue
            entered = time.monotonic()
            value = work.enter(lockstring)
            time.sleep(args.hold)
            work.leave(lockstring, value)
            left = time.monotonic()
            record = {"ls": lockstring, "id": lock.lock_id, "asked": asked, "in": entered}
            log.write(json.dumps({**record, "out": left}) + "\n")
            log.flush()
            try:
                lock.unlock()
            except LockError as error:  # it expires; nobody takes it before then
                errors += 1
                log.write(json.dumps({"error": str(error)[:200], "at": time.monotonic()}) + "\n")
    _say(pid=os.getpid(), overlaps=work.overlaps, errors=errors)
    return 0


def keeper(args: argparse.Namespace) -> int:
    """Hold ``--lockstrings`` kept alive until ``<state>/stop`` exists; log each one's id, when
    it was acquired, and when (if ever) its on_lost was called; at the end, whether each is
    still ours (an extend on the primary of the moment succeeds)."""
    state = Path(args.state)
    lost_at: dict[str, float] = {}

    def on_lost(error: LockLost) -> None:
        lost_at.setdefault(error.lockstring or "", time.monotonic())

    locker = Locker(args.url, table=args.table, grace=args.grace, on_lost=on_lost)
    locks = []
    for lockstring in args.lockstrings.split(","):
        lock = locker.lock(lockstring, expires=args.expires, keep_alive=True)
        locks.append((lock, time.monotonic()))
    _say(ready=True)
    while not (state / "stop").exists():
        time.sleep(0.1)
    for lock, acquired in locks:
        still_ours = False
        if lock.lockstring not in lost_at:
            for _ in range(20):  # the cluster may still be settling
                try:
                    lock.extend()
                    still_ours = True
                    break
                except LockLost:
                    break
                except LockError:
                    time.sleep(0.5)
        _say(
            ls=lock.lockstring,
            id=lock.lock_id,
            acquired=acquired,
            lost_at=lost_at.get(lock.lockstring),
            still_ours=still_ours,
        )
        with contextlib.suppress(LockError):
            lock.unlock()
    return 0


# Asks a worker for where each of its threads (and, async, each of its tasks) stands: a test
# sends it to a worker that ran out of time, before killing it. A sync worker ends with it.
DUMP_SIGNAL = signal.SIGUSR1


def _print_tasks() -> None:
    faulthandler.dump_traceback(all_threads=True)
    for task in asyncio.all_tasks():
        print(f"--- {task.get_name()}", file=sys.stderr)
        task.print_stack(file=sys.stderr)
    sys.stderr.flush()


def _valid_for(lock: Lock | AsyncLock) -> float:
    """How long ``lock`` has left to be valid by its holder's reckoning (negative: handed over
    already out of time, as on a machine too loaded for the lock's expiry)."""
    return lock._state.valid_until - clock.now()


def _tell_lost(
    lock: Lock | AsyncLock, entered: float, valid_for: float, unlocking: float, error: LockLost
) -> None:
    """A lock lost at its release, on stderr (``LOST``), for the test to show: how long it had
    left to be valid as the work under it began, how long after that its release began, and
    how long the release took."""
    ended = time.monotonic()
    print(
        f"{LOST} {lock.lockstring!r} id {lock.lock_id} in process {os.getpid()} "
        f"({'async' if isinstance(lock, AsyncLock) else 'sync'}): valid for {valid_for:.3f}s "
        f"more as the work began; release began {unlocking - entered:.3f}s after the work, "
        f"and took {ended - unlocking:.3f}s: {error}",
        file=sys.stderr,
    )


# What starts a line on stderr that tells of a lock lost at its release.
LOST = "lost:"


def _say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.workers")
    commands = parser.add_subparsers(dest="command", required=True)

    def command(
        name: str, about: str, expires: float, shared: bool = True
    ) -> argparse.ArgumentParser:
        """A worker's command, with the options every worker has: where the table is, the
        directory the workers share (``shared``), and the locks' expiry and grace."""
        sub = commands.add_parser(name, help=about)
        sub.add_argument("--url", required=True)
        sub.add_argument("--table", required=True)
        if shared:
            sub.add_argument("--state", required=True, help="directory shared by the workers")
        sub.add_argument("--expires", type=float, default=expires)
        sub.add_argument("--grace", type=float, default=1.0)
        return sub

    work = command("counter", "read-sleep-write a shared counter under locks", 60)
    work.add_argument("--asyncio", action="store_true", help="through AsyncLocker")
    work.add_argument("--tasks", type=int, default=4, help="concurrent tasks (with --asyncio)")
    work.add_argument("--threads", type=int, default=1, help="threads sharing a Locker (sync)")
    work.add_argument("--lockstrings", required=True, help="comma-separated")
    work.add_argument("--count", type=int, default=200)
    work.add_argument("--hold", type=float, default=0.001)
    work.add_argument(
        "--abandon-every", type=int, default=0, help="leave every Nth lock held (sync only)"
    )
    work.add_argument(
        "--try-only", action="store_true", help="acquire by trying repeatedly (sync only)"
    )
    work.add_argument(
        "--outlive-every",
        type=int,
        default=0,
        help="keep the middle lock of every N alive and hold it for 1.5 expiry periods (sync only)",
    )
    work.add_argument(
        "--queue-patience",
        type=float,
        help="seconds a waiter may be refused a free row by a live ticket ahead (tickets.PATIENCE)",
    )
    work.add_argument(
        "--cancel-some",
        action="store_true",
        help="cancel a share of the acquires and releases at a random moment (asyncio only)",
    )
    work.add_argument(
        "--callers-engine",
        action="store_true",
        help="through an Engine of the caller's, which sqllocker uses as it is (sync only)",
    )
    work.add_argument(
        "--transaction-pooling",
        action="store_true",
        help="through a transaction-pooling PgBouncer (Locker's transaction_pooling)",
    )
    holder = command("hold", "hold one lock and obey commands on stdin", 1.0, shared=False)
    holder.add_argument("--lockstring", required=True)
    holder.add_argument("--keep-alive", action="store_true")
    both = command("pairs", "take random pairs of locks together, counted", 60)
    both.add_argument("--lockstrings", required=True, help="comma-separated")
    both.add_argument("--count", type=int, default=200)
    both.add_argument("--hold", type=float, default=0.001)
    permits = command("semaphore", "take permits of a semaphore, counted", 60)
    permits.add_argument("--name", required=True)
    permits.add_argument("--limit", type=int, required=True)
    permits.add_argument("--seconds", type=float, default=10)
    contender = command("failover", "contend through a failover, counted", 10)
    contender.add_argument("--lockstrings", required=True, help="comma-separated")
    contender.add_argument("--kept", default="", help="the keeper's lockstrings, to try")
    contender.add_argument("--hold", type=float, default=0.01)
    contender.add_argument("--wait", type=float, default=2.0)
    kept = command("keeper", "hold kept-alive locks through a failover", 60)
    kept.add_argument("--lockstrings", required=True, help="comma-separated")
    args = parser.parse_args(argv)
    faulthandler.register(DUMP_SIGNAL, all_threads=True, chain=True)
    if args.command == "failover":
        return failover(args)
    if args.command == "keeper":
        return keeper(args)
    if args.command == "counter":
        if args.queue_patience is not None:
            tickets.PATIENCE = args.queue_patience
        return async_counter(args) if args.asyncio else counter(args)
    if args.command == "semaphore":
        return semaphore(args)
    if args.command == "pairs":
        return pairs(args)
    return hold(args)


if __name__ == "__main__":
    sys.exit(main())
