"""``sqllocker run``: run a command while holding a lock, like flock(1) across machines.

The lock is kept alive for as long as the command runs (``Lock.keep_alive``: renewed every third
of its expiry period), so a short expiry protects a command of any length and a crashed runner
blocks others for at most one period.

It fails closed, as a leader that loses its lease steps down:

- the command runs in a process group of its own, led by a watchdog (``watchdog.py``), so that
  everything it starts can be stopped together;
- if the lock is lost while it runs (broken by an operator, or not renewable before its
  deadline, which comes before anyone else can take it over), the group gets SIGTERM at once,
  and SIGKILL ``kill_after`` seconds later (``on_lost="warn"`` only says so instead), and the
  exit status is 75;
- if sqllocker itself dies, the watchdog stops the group the same way;
- signals that would end sqllocker (INT, TERM, HUP, QUIT) are passed on to the group, handlers
  installed before the command starts. At a terminal, the group is made the foreground, so a
  Ctrl-C there reaches the command directly, once;
- the command's environment has no database URL (it may hold a password) unless asked, and the
  row records the program's name, not its arguments (which may hold secrets), unless asked.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from .engine import URL_ENVIRONMENT_VARIABLE
from .errors import LockBusy, LockLost
from .lock import Lock
from .locker import Locker

# Exit statuses that are not the command's own, after the shells' and flock(1)'s conventions.
EXIT_LOCK_LOST = 75  # EX_TEMPFAIL: the command ran, but not (all of it) under the lock
EXIT_CANNOT_EXECUTE = 126
EXIT_NOT_FOUND = 127
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
DEFAULT_KILL_AFTER = 10.0
ON_LOST_CHOICES = ("stop", "warn")
WATCHDOG = Path(__file__).with_name("watchdog.py")


@dataclass(frozen=True)
class RunOptions:
    wait: float | None
    expires: float
    conflict_exit_code: int = 1
    quiet: bool = False
    hold_at_least: float | None = None
    on_lost: str = "stop"
    kill_after: float = DEFAULT_KILL_AFTER
    pass_url: bool = False
    record_args: bool = False
    shared: bool = False  # the read side of the lock: with others that run --shared


class _Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def run_locked(locker: Locker, lockstring: str, command: Sequence[str], options: RunOptions) -> int:
    """Run ``command`` under ``lockstring``; return the exit status sqllocker should exit with."""
    recorded = shlex.join(command) if options.record_args else command[0]
    try:
        with _signals_raise():
            rw = locker.rwlock(lockstring)  # plain ``run`` is the write side (``rwlocks.py``)
            lock = (rw.read if options.shared else rw.write)(
                wait=options.wait,
                expires=options.expires,
                locked_by={"command": recorded},
                hold_at_least=options.hold_at_least,
            )
    except LockBusy as busy:
        if not options.quiet:
            print(f"sqllocker: {busy}", file=sys.stderr)
        return options.conflict_exit_code
    except _Interrupted as interrupted:
        return 128 + interrupted.signum
    return _supervise(lock, command, options)


class _Group:
    """The command's process group: its watchdog (the leader) and the command."""

    def __init__(self, kill_after: float) -> None:
        self.kill_after = kill_after
        self.watchdog = _spawn_in_group(
            [sys.executable, "-I", "-S", str(WATCHDOG), str(kill_after)], 0, stdin=subprocess.PIPE
        )
        self.id = self.watchdog.pid
        self.command: subprocess.Popen[bytes] | None = None
        self._terminal = _ForegroundTerminal(self.id)
        self._kill_timer: threading.Timer | None = None

    def start(self, command: Sequence[str], environment: dict[str, str]) -> None:
        self.command = _spawn_in_group(list(command), self.id, env=environment)

    def signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.id, signum)

    def stop(self) -> None:
        """SIGTERM now, SIGKILL ``kill_after`` seconds later (at once if 0)."""
        if self.kill_after == 0:
            self.signal(signal.SIGKILL)
            return
        self.signal(signal.SIGTERM)
        self._kill_timer = threading.Timer(self.kill_after, self.signal, (signal.SIGKILL,))
        self._kill_timer.daemon = True
        self._kill_timer.start()

    def close(self) -> None:
        """The command has ended (or never started): the watchdog stands down."""
        if self._kill_timer is not None:
            self._kill_timer.cancel()
        self._terminal.restore()
        assert self.watchdog.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            self.watchdog.stdin.write(b"done")
            self.watchdog.stdin.close()
        self.watchdog.wait()


def _spawn_in_group(args: list[str], group: int, **options: Any) -> subprocess.Popen[bytes]:
    """``Popen(args)`` in process group ``group`` (0: a new one, led by the new process)."""
    if sys.version_info >= (3, 11):
        return subprocess.Popen(args, process_group=group, **options)
    return subprocess.Popen(  # pragma: no cover - Python 3.10
        args, preexec_fn=lambda: os.setpgid(0, group), **options
    )


class _ForegroundTerminal:
    """At a terminal where sqllocker runs in the foreground, the command's group takes the
    foreground (as a shell gives it to a job), so that the terminal's keys reach the command
    directly and its reads of the terminal are not stopped; given back at the end."""

    def __init__(self, group: int) -> None:
        self._fd: int | None = None
        try:
            fd = sys.stdin.fileno()
            if not os.isatty(fd) or os.tcgetpgrp(fd) != os.getpgrp():
                return
            with _ignoring(signal.SIGTTOU):
                os.tcsetpgrp(fd, group)
            self._fd = fd
        except (OSError, ValueError):  # no terminal, or it went away
            return

    def restore(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError), _ignoring(signal.SIGTTOU):
            os.tcsetpgrp(self._fd, os.getpgrp())
        self._fd = None


@contextmanager
def _ignoring(signum: int) -> Iterator[None]:
    previous = signal.signal(signum, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signum, previous)


def _supervise(lock: Lock, command: Sequence[str], options: RunOptions) -> int:
    environment = dict(
        os.environ, SQLLOCKER_LOCKSTRING=lock.lockstring, SQLLOCKER_LOCK_ID=str(lock.lock_id)
    )
    if not options.pass_url:
        environment.pop(URL_ENVIRONMENT_VARIABLE, None)
    lost = threading.Event()
    forwarder = _Forwarder()

    def on_lost(error: LockLost) -> None:
        lost.set()
        print(f"sqllocker: {error}", file=sys.stderr)
        if options.on_lost == "stop" and forwarder.group is not None:
            print("sqllocker: stopping the command: its lock is lost", file=sys.stderr)
            forwarder.group.stop()

    try:
        with forwarder:
            group = _Group(options.kill_after)
            try:
                group.start(command, environment)
            except FileNotFoundError:
                print(f"sqllocker: {command[0]}: command not found", file=sys.stderr)
                return EXIT_NOT_FOUND
            except PermissionError as error:
                print(f"sqllocker: {command[0]}: cannot execute: {error}", file=sys.stderr)
                return EXIT_CANNOT_EXECUTE
            finally:
                forwarder.attach(group)
            lock.keep_alive(on_lost=on_lost)
            assert group.command is not None
            returncode = group.command.wait()
    finally:
        if forwarder.group is not None:
            forwarder.group.close()
        was_valid = lock.is_valid()
        try:
            lock.unlock()
        except LockLost as error:
            if not lost.is_set():
                print(f"sqllocker: {error}", file=sys.stderr)
            lost.set()
        if not was_valid:
            lost.set()
    if lost.is_set():
        return EXIT_LOCK_LOST
    return returncode if returncode >= 0 else 128 - returncode


class _Forwarder:
    """Passes INT, TERM, HUP and QUIT on to the command's group while it runs: installed
    before the group exists, so that none is missed; one that comes before the command has
    started is passed on as soon as it has."""

    def __init__(self) -> None:
        self.group: _Group | None = None
        self._pending: list[int] = []
        self._previous: dict[int, object] = {}

    def __enter__(self) -> _Forwarder:
        self._previous = {sig: signal.signal(sig, self._forward) for sig in FORWARDED_SIGNALS}
        return self

    def attach(self, group: _Group) -> None:
        self.group = group
        if group.command is not None:
            for signum in self._pending:
                group.signal(signum)
        self._pending.clear()

    def _forward(self, signum: int, _frame: FrameType | None) -> None:
        if self.group is None or self.group.command is None:
            self._pending.append(signum)
        else:
            self.group.signal(signum)

    def __exit__(self, *_: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]


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
