"""``sqllocker run``: run a command while holding a lock, like flock(1) across machines.

The lock is kept alive for as long as the command runs by extending it every third of its expiry
period, so a short expiry protects a command of any length and a crashed runner blocks others for
at most one period. Signals that would end sqllocker (INT, TERM, HUP, QUIT) are passed on to the
command instead, and the lock is released once the command has ended, however it ended.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType

from .errors import LockBusy, LockError, LockLost
from .lock import Lock
from .locker import Locker

logger = logging.getLogger("sqllocker")

# Exit statuses that are not the command's own, after the shells' and flock(1)'s conventions.
EXIT_LOCK_LOST = 75  # EX_TEMPFAIL: the command ran, but not (all of it) under the lock
EXIT_CANNOT_EXECUTE = 126
EXIT_NOT_FOUND = 127
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
# Extend this long before the deadline at the latest: a renewal must land while the row is live.
SAFETY_MARGIN = 0.1
# After a failed renewal (a database hiccup), try again this soon rather than a third of a period.
RETRY_DELAY = 1.0


@dataclass(frozen=True)
class RunOptions:
    wait: float | None
    expires: float
    conflict_exit_code: int = 1
    quiet: bool = False
    kill_on_lost: bool = False


class _Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def run_locked(locker: Locker, lockstring: str, command: Sequence[str], options: RunOptions) -> int:
    """Run ``command`` under ``lockstring``; return the exit status sqllocker should exit with."""
    try:
        with _signals_raise():
            lock = locker.lock(
                lockstring,
                wait=options.wait,
                expires=options.expires,
                locked_by={"command": shlex.join(command)},
            )
    except LockBusy as busy:
        if not options.quiet:
            print(f"sqllocker: {busy}", file=sys.stderr)
        return options.conflict_exit_code
    except _Interrupted as interrupted:
        return 128 + interrupted.signum
    return _supervise(lock, command, options)


def _supervise(lock: Lock, command: Sequence[str], options: RunOptions) -> int:
    environment = dict(
        os.environ, SQLLOCKER_LOCKSTRING=lock.lockstring, SQLLOCKER_LOCK_ID=str(lock.lock_id)
    )
    lost = False
    try:
        try:
            child = subprocess.Popen(list(command), env=environment)
        except FileNotFoundError:
            print(f"sqllocker: {command[0]}: command not found", file=sys.stderr)
            return EXIT_NOT_FOUND
        except PermissionError as error:
            print(f"sqllocker: {command[0]}: cannot execute: {error}", file=sys.stderr)
            return EXIT_CANNOT_EXECUTE
        with _signals_forwarded_to(child):
            returncode, lost = _wait_keeping_alive(child, lock, options)
    finally:
        if lock.is_locked:
            try:
                lock.unlock()
            except LockLost as error:
                lost = True
                print(f"sqllocker: {error}", file=sys.stderr)
    status = returncode if returncode >= 0 else 128 - returncode
    if lost and status == 0:
        return EXIT_LOCK_LOST
    return status


def _wait_keeping_alive(
    child: subprocess.Popen[bytes], lock: Lock, options: RunOptions
) -> tuple[int, bool]:
    """Wait for ``child``, extending ``lock`` meanwhile; returns (returncode, lock was lost)."""
    period = options.expires
    # The row is ours, for certain, until `period` after the last renewal that was *sent* and
    # succeeded; past that, nobody can prove it, so the command is told the lock is lost.
    valid_until = time.monotonic() + period - SAFETY_MARGIN
    next_renewal = time.monotonic() + period / 3
    lost = False
    while True:
        timeout = max(0.0, next_renewal - time.monotonic()) if not lost else None
        try:
            return child.wait(timeout=timeout), lost
        except subprocess.TimeoutExpired:
            pass
        sent = time.monotonic()
        try:
            lock.extend(period)
        except LockLost as error:
            lost = _report_lost(child, options, f"sqllocker: {error}")
            continue
        except LockError as error:
            if time.monotonic() >= valid_until:
                lost = _report_lost(
                    child,
                    options,
                    f"sqllocker: lock {lock.lockstring!r} could not be renewed "
                    f"before it expired ({error}); another process may hold it now",
                )
            else:
                logger.warning("could not renew lock %r (%s); retrying", lock.lockstring, error)
                next_renewal = time.monotonic() + min(RETRY_DELAY, period / 3)
            continue
        valid_until = sent + period - SAFETY_MARGIN
        next_renewal = sent + period / 3


def _report_lost(child: subprocess.Popen[bytes], options: RunOptions, message: str) -> bool:
    print(message, file=sys.stderr)
    if options.kill_on_lost:
        print("sqllocker: stopping the command (--kill-on-lost)", file=sys.stderr)
        child.terminate()
    return True


@contextmanager
def _signals_raise() -> Iterator[None]:
    """While waiting for the lock, turn TERM/HUP/QUIT into an exception, so that a lock granted
    just then is still released on the way out (SIGINT already raises KeyboardInterrupt)."""

    def interrupt(signum: int, _frame: FrameType | None) -> None:
        raise _Interrupted(signum)

    previous = {sig: signal.signal(sig, interrupt) for sig in FORWARDED_SIGNALS}
    try:
        yield
    except KeyboardInterrupt as error:
        raise _Interrupted(signal.SIGINT) from error
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextmanager
def _signals_forwarded_to(child: subprocess.Popen[bytes]) -> Iterator[None]:
    def forward(signum: int, _frame: FrameType | None) -> None:
        if child.poll() is None:
            child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
