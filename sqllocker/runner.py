"""``sqllocker run``: run a command while holding a lock, like flock(1) across machines.

The lock is kept alive for as long as the command runs (``Lock.keep_alive``: renewed every third
of its expiry period), so a short expiry protects a command of any length and a crashed runner
blocks others for at most one period; if it is lost, ``on_lost`` says so at once. Signals that
would end sqllocker (INT, TERM, HUP, QUIT) are passed on to the command instead, and the lock is
released once the command has ended, however it ended.

Ctrl-C and Ctrl-\\ at a terminal are the exception: the terminal sends them to its whole
foreground process group, which the command shares with sqllocker, so the command already has
them. Passing them on as well would interrupt it twice, and many programs take a second
interrupt as "stop now, skip the clean-up".
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType

from .errors import LockBusy, LockLost
from .lock import Lock
from .locker import Locker

# Exit statuses that are not the command's own, after the shells' and flock(1)'s conventions.
EXIT_LOCK_LOST = 75  # EX_TEMPFAIL: the command ran, but not (all of it) under the lock
EXIT_CANNOT_EXECUTE = 126
EXIT_NOT_FOUND = 127
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
# What a terminal's keys send (Ctrl-C, Ctrl-\) to its foreground process group.
TERMINAL_KEY_SIGNALS = (signal.SIGINT, signal.SIGQUIT)


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

        def on_lost(error: LockLost) -> None:
            print(f"sqllocker: {error}", file=sys.stderr)
            if options.kill_on_lost and child.poll() is None:
                print("sqllocker: stopping the command (--kill-on-lost)", file=sys.stderr)
                child.terminate()

        lock.keep_alive(on_lost=on_lost)
        with _signals_forwarded_to(child):
            returncode = child.wait()
        lost = not lock.is_valid()
    finally:
        try:
            lock.unlock()
        except LockLost as error:
            if not lost:
                print(f"sqllocker: {error}", file=sys.stderr)
            lost = True
    status = returncode if returncode >= 0 else 128 - returncode
    if lost and status == 0:
        return EXIT_LOCK_LOST
    return status


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
        if child.poll() is not None:
            return
        if signum in TERMINAL_KEY_SIGNALS and _hears_the_terminal_with_us(child):
            return  # the terminal sent it to the command too
        child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _hears_the_terminal_with_us(child: subprocess.Popen[bytes]) -> bool:
    """Whether ``child`` is in sqllocker's process group and that group is in the foreground of
    a controlling terminal: then a Ctrl-C there reached the child as it reached us.

    Judged when the signal comes, since job control can move the group to the background. A
    ``kill -INT`` of sqllocker from elsewhere then is not passed on either, the price of not
    telling the two apart (the signal's sender is not visible to a Python handler).
    """
    try:
        if os.getpgid(child.pid) != os.getpgrp():
            return False
        terminal = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY)
    except OSError:  # no controlling terminal (cron, a service), or the child is gone
        return False
    try:
        return os.tcgetpgrp(terminal) == os.getpgrp()
    except OSError:
        return False
    finally:
        os.close(terminal)
