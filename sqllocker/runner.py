"""``sqllocker run``: run a command while holding a lock, like flock(1) across machines.

The lock is kept alive for as long as the command runs (``Lock.keep_alive``: renewed every third
of its expiry period), so a short expiry protects a command of any length and a crashed runner
blocks others for at most one period.

It fails closed, as a leader that loses its lease steps down:

- a watchdog (``watchdog.py``) starts the command, leads its process group and, on Linux, is a
  child subreaper: everything the command starts stays its descendant, daemons that leave the
  group included, and it can stop them all (the *family*);
- if the lock is lost while it runs (broken by an operator, or not renewable before its
  deadline, which comes before anyone else can take it over), the family gets SIGTERM at once,
  and SIGKILL ``kill_after`` seconds later, or sooner: never after the lock's stop-by moment,
  before its row can expire (``on_lost="warn"`` only says so instead); the exit status is 75;
- after each renewal the watchdog is told the new deadline, and stops the family itself if
  that passes with no newer one (sqllocker stopped, frozen, or too slow); if sqllocker dies,
  it stops the family the same way; if the watchdog dies, sqllocker kills the family;
- what the command leaves running when it ends is stopped before the lock is released;
- signals that would end sqllocker (INT, TERM, HUP, QUIT) are passed on to the group, handlers
  installed before the command starts. At a terminal, the group is made the foreground, so a
  Ctrl-C there reaches the command directly, once, and a Ctrl-Z that stops it stops
  sqllocker too, as one job of the shell;
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
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from . import watchdog as watchdog_script
from .engine import URL_ENVIRONMENT_VARIABLE, URL_WITHHELD_VARIABLE
from .errors import LockBusy, LockError, LockLost
from .exit_statuses import (
    EXIT_CANNOT_EXECUTE,
    EXIT_LOCK_LOST,
    EXIT_NO,
    EXIT_NOT_FOUND,
    EXIT_SIGNAL,
)
from .holding import CLOCK_DRIFT, TIMESTAMP_SLACK, safety_margin
from .lock import Lock
from .locker import Locker
from .rwlock import WriteLock
from .unblocked_stderr import unblocked_stderr

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
DEFAULT_KILL_AFTER = 10.0
ON_LOST_CHOICES = ("stop", "warn")
WATCHDOG = Path(__file__).with_name("watchdog.py")


@dataclass(frozen=True)
class RunOptions:
    wait: float | None
    expires: float
    conflict_exit_code: int = EXIT_NO
    quiet: bool = False
    hold_at_least: float | None = None
    on_lost: str = "stop"
    kill_after: float = DEFAULT_KILL_AFTER
    pass_url: bool = False
    names_database: bool = False  # the run was given a URL (--url or $SQLLOCKER_URL)
    record_args: bool = False
    shared: bool = False  # the read side of the lock: with others that run --shared


_NOT_STARTED = "the lock ran out or was lost before the command could start: it was not started"


class _StartedTooLate(Exception):
    """The watchdog found the lock's deadline passed when it was to start the command."""


class _WatchdogEnded(Exception):
    """The watchdog ended before it said whether it started the command."""


def _say(message: str) -> None:
    """``sqllocker: MESSAGE`` on stderr; a stderr that cannot be written (a full disk, a
    closed pipe) changes nothing of what the run does."""
    if sys.stderr is None:  # closed when sqllocker started (``2>&-``)
        return
    with contextlib.suppress(OSError, ValueError):
        print(f"sqllocker: {message}", file=sys.stderr)


class _Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def run_locked(locker: Locker, lockstring: str, command: Sequence[str], options: RunOptions) -> int:
    """Run ``command`` under ``lockstring``; return the exit status sqllocker should exit with."""
    with unblocked_stderr():
        return _run_locked(locker, lockstring, command, options)


def _run_locked(
    locker: Locker, lockstring: str, command: Sequence[str], options: RunOptions
) -> int:
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
            _say(str(busy))
        return options.conflict_exit_code
    except _Interrupted as interrupted:
        return EXIT_SIGNAL + interrupted.signum
    return _supervise(lock, command, options)


class _Family:
    """COMMAND and everything it starts, under its watchdog (``watchdog.py``): the watchdog
    leads the process group, starts COMMAND in it, and stops the family when it must. Two pipes
    join it to sqllocker (see there): sqllocker sends it the lock's deadlines and ``stop``, and
    reads back COMMAND's pid and exit status."""

    def __init__(
        self, command: Sequence[str], environment: dict[str, str], lock: Lock, options: RunOptions
    ) -> None:
        # Should the watchdog itself die, what it leaves comes to us, not to init (Linux).
        self._subreaper = watchdog_script.become_subreaper()
        # Children we had before (sqllocker exec'd by a shell that started others): not ours
        # to kill with the family.
        self._spared = watchdog_script.children() if self._subreaper else frozenset()
        control_read, self._control = os.pipe()
        status_read, status_write = os.pipe()
        valid_until, kill_by = _deadlines(lock)
        self.valid_until = valid_until  # the watchdog's deadline until it is told a later one
        try:
            self.watchdog = _spawn_in_group(
                [
                    sys.executable,
                    "-I",
                    "-S",
                    str(WATCHDOG),
                    str(control_read),
                    str(status_write),
                    repr(options.kill_after),
                    options.on_lost,
                    repr(valid_until),
                    repr(kill_by),
                    ",".join(str(int(signum)) for signum in _ignored(_KEPT_IGNORED)) or "-",
                    "--",
                    *command,
                ],
                0,
                env=environment,
                pass_fds=(control_read, status_write),
            )
        except BaseException:
            os.close(self._control)
            os.close(status_read)
            raise
        finally:
            os.close(control_read)
            os.close(status_write)
        self.id = self.watchdog.pid
        try:
            self._status = os.fdopen(status_read, "rb")
            # Continued after a Ctrl-Z only while the lock is valid; with --on-lost=warn,
            # whatever it is (nothing else would continue or end the family).
            warn = options.on_lost == "warn"
            valid = (lambda: True) if warn else lock.is_valid
            self._terminal = _ForegroundTerminal(self.id, valid)
        except BaseException:
            # The command may have started already, and nothing here could stop it later:
            # killed now, before the caller lets the lock go.
            self._kill_orphans()
            self.watchdog.wait()
            os.close(self._control)
            raise
        self._writing = threading.Lock()
        self.started = False
        self.stopped_by_watchdog: list[str] = []

    def wait_started(self, program: str) -> None:
        """Until the watchdog has started COMMAND; FileNotFoundError or PermissionError if it
        could not."""
        raw = self._status.readline()
        if not raw:
            # The watchdog ended without a word (killed): it may have started COMMAND, whose
            # family comes to us (subreaper).
            self.watchdog.wait()
            self._kill_orphans()
            raise _WatchdogEnded
        line = raw.decode(errors="replace").split(maxsplit=1)
        if line[:1] == ["started"]:
            self.started = True
        elif line[:1] == ["missing"]:
            raise FileNotFoundError(program)
        elif line[:1] == ["late"]:
            raise _StartedTooLate
        else:
            raise PermissionError(line[1].strip() if len(line) > 1 else "the watchdog failed")

    def wait(self) -> int:
        """COMMAND's exit status (negative: the signal that ended it), once the watchdog has
        ended: COMMAND has ended, and nothing it started still runs. A watchdog that ended
        before it said so (``done``: killed, while COMMAND ran or while what it left running
        was being stopped) has what is left killed here."""
        status: int | None = None
        done = False
        for raw in self._status:
            words = raw.decode(errors="replace").split()
            if words[:1] == ["exit"] and len(words) == 2:
                status = int(words[1])
            elif words[:1] == ["stopping"] and len(words) == 3:
                self.stopped_by_watchdog.append(words[1])
                _say_why_stopping(words[1], int(words[2]))
            elif words[:1] == ["suspended"]:
                self._terminal.suspend()
                self.tell("resumed")  # the watchdog may say the next one
            elif words == ["done"]:
                done = True
        self.watchdog.wait()
        if not done:
            self._kill_orphans()
            what = "the command" if status is None else "what the command left running"
            _say(f"the watchdog ended before {what} (it was killed): killed it and all it started")
            self.stopped_by_watchdog.append("orphaned")
            return self.watchdog.returncode if status is None else status
        assert status is not None  # the watchdog says "done" once COMMAND has ended
        return status

    def _kill_orphans(self) -> None:
        """SIGKILL what the watchdog left: the group, and every descendant of ours (ours as a
        subreaper), until none is left."""
        self.signal(signal.SIGKILL)
        family = watchdog_script.Family(self._subreaper, self._spared)
        while not family.gone():
            family.signal(signal.SIGKILL, family.living())
            family.kill_children()
            time.sleep(watchdog_script.KILL_POLL)
            with contextlib.suppress(ChildProcessError):
                while os.waitpid(-1, os.WNOHANG)[0]:
                    pass

    def tell(self, message: str) -> None:
        with self._writing, contextlib.suppress(OSError):  # OSError: the watchdog has ended
            if self._control >= 0:  # not closed (its number may be another file's by now)
                os.write(self._control, message.encode() + b"\n")

    def signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.id, signum)

    def follow_terminal(self) -> None:
        """The terminal to the family, if sqllocker has the foreground (``_ForegroundTerminal``)."""
        self._terminal.follow()

    def stop(self) -> None:
        """The lock is lost: the watchdog sends SIGTERM to the whole family now, and SIGKILL
        ``kill_after`` seconds later (at once if 0); woken first, if the group was stopped."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.id, signal.SIGCONT)  # our child, not yet reaped: its pid is its own
        self.tell("stop")

    def close(self) -> None:
        """COMMAND has ended (or never started); so has the watchdog, or it stops the family."""
        self._terminal.restore()
        with self._writing:
            os.close(self._control)
            self._control = -1
        self._status.close()
        self.watchdog.wait()


def _say_why_stopping(reason: str, count: int) -> None:
    if reason == "deadline":
        _say("stopping the command: its lock's deadline passed without renewal")
    elif reason == "leftovers" and count:
        _say(
            f"stopping what the command left running ({count} processes) before releasing the lock"
        )


def _deadlines(lock: Lock) -> tuple[float, float]:
    """The lock's validity deadline, and the moment by which its command's family must be
    gone if that passes without renewal (both on ``clock.now()``): halfway between the
    deadline and the earliest moment the row can expire by the server's clock (the expiry
    period after the renewal was sent, less the clock drift the safety margin allows for and
    the slack of the server's timestamps).
    Nobody, whatever their grace, can take the lock over before that. A writer's lock holds
    two rows (its claim on the name, and its token), and the earlier of theirs counts."""
    rows = [lock._state, lock.claim._state] if isinstance(lock, WriteLock) else [lock._state]
    valid_until = min(state.valid_until for state in rows)
    kill_by = min(
        state.valid_until
        + (safety_margin(state.ttl) - TIMESTAMP_SLACK - state.ttl * CLOCK_DRIFT) / 2
        for state in rows
    )
    return valid_until, kill_by


class _DeadlineCourier:
    """Sends the watchdog each new deadline of the lock as renewals move it on, looking a
    thirtieth of the expiry period apart (at most a second): a renewal comes two thirds of the
    period before the deadline it moves on. At each look, the terminal's foreground follows
    sqllocker's to the family (the shell's ``fg`` of a run in the background)."""

    def __init__(self, lock: Lock, family: _Family) -> None:
        self._lock = lock
        self._family = family
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sqllocker-deadlines", daemon=True)

    def __enter__(self) -> _DeadlineCourier:
        self._thread.start()
        return self

    def _run(self) -> None:
        period = min(1.0, max(0.02, self._lock.ttl / 30))
        sent = self._family.valid_until  # the watchdog's, which a renewal may have moved on
        while not self._done.wait(period):
            valid_until, kill_by = _deadlines(self._lock)
            if valid_until != sent:
                self._family.tell(f"deadline {valid_until!r} {kill_by!r}")
                sent = valid_until
            self._family.follow_terminal()

    def __exit__(self, *_: object) -> None:
        self._done.set()
        self._thread.join()


def _spawn_in_group(args: list[str], group: int, **options: Any) -> subprocess.Popen[bytes]:
    """``Popen(args)`` in process group ``group`` (0: a new one, led by the new process)."""
    if sys.version_info >= (3, 11):
        return subprocess.Popen(args, process_group=group, **options)
    return subprocess.Popen(  # pragma: no cover - Python 3.10
        args, preexec_fn=lambda: os.setpgid(0, group), **options
    )


class _ForegroundTerminal:
    """At a terminal, the command's group is a job within sqllocker's job. Where sqllocker runs
    in the foreground, the group takes the foreground (as a shell gives it to a job), so that
    the terminal's keys reach the command directly and its reads of the terminal are not
    stopped; given back at the end.

    A terminal's stop of the command (Ctrl-Z, or a read or write of the terminal from the
    background) stops sqllocker's own job too (``suspend``), so that the shell gets the terminal
    back; once the shell continues it (``fg``, ``bg``), the command's group is continued, if the
    lock is still ``valid``, and given the foreground whenever sqllocker has it (``follow``).
    The lock is not renewed meanwhile: stopped past its deadline, the family is stopped by its
    watchdog."""

    def __init__(self, group: int, valid: Callable[[], bool]) -> None:
        self._group = group
        self._valid = valid
        self._fd: int | None = None
        if sys.stdin is None:  # closed when sqllocker started (``<&-``): no terminal
            return
        try:
            fd = sys.stdin.fileno()
            if not os.isatty(fd):
                return
            if os.tcgetpgrp(fd) == os.getpgrp():
                with _ignoring(signal.SIGTTOU):
                    os.tcsetpgrp(fd, group)
        except (OSError, ValueError):  # no terminal, or it went away
            return
        self._fd = fd

    def suspend(self) -> None:
        """The command was stopped by a terminal's stop: stop sqllocker's job as well (as the
        shell's Ctrl-Z would have), the terminal given back to it first; once continued,
        continue the command. Not without a terminal, nor where sqllocker ignores SIGTSTP
        (it would not stop)."""
        if self._fd is None or signal.getsignal(signal.SIGTSTP) == signal.SIG_IGN:
            return
        self._give_back()
        with contextlib.suppress(OSError):
            os.killpg(os.getpgrp(), signal.SIGTSTP)
        # Continued (``fg``, ``bg``): the lock may have run out meanwhile, and the watchdog
        # then stops the family (it has, or will at once).
        if self._valid():
            self.follow()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._group, signal.SIGCONT)

    def follow(self) -> None:
        """The foreground to the command's group if sqllocker's has it (the shell's ``fg``), as
        long as the lock is valid. Any thread: it sends nothing from the background."""
        if self._fd is None or not self._valid():
            return
        with contextlib.suppress(OSError):
            if os.tcgetpgrp(self._fd) == os.getpgrp():
                os.tcsetpgrp(self._fd, self._group)

    def _give_back(self) -> None:
        """The terminal back to sqllocker's group, if the command's has it."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                if os.tcgetpgrp(self._fd) == self._group:
                    with _ignoring(signal.SIGTTOU):
                        os.tcsetpgrp(self._fd, os.getpgrp())

    def restore(self) -> None:
        self._give_back()
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
    if options.names_database and not environment.get(URL_ENVIRONMENT_VARIABLE):
        # A sqllocker in COMMAND given no URL must not lock in the local default file instead.
        environment[URL_WITHHELD_VARIABLE] = "1"
    lost = threading.Event()
    ended = threading.Event()  # the group is closed: nothing is left to stop
    forwarder = _Forwarder()

    def on_lost(error: LockLost) -> None:
        lost.set()
        stopping = forwarder.group if options.on_lost == "stop" and not ended.is_set() else None
        if stopping is not None:
            stopping.stop()  # first: nothing written to stderr (which may fail) comes before
        _say(str(error))
        if stopping is not None:
            _say("stopping the command: its lock is lost")

    try:
        with forwarder:
            # Renewed from here on, and checked last before the command starts: a run stalled
            # since its acquire (stopped, its database frozen) past the lock's deadline must not
            # start the command beside the next holder (the watchdog checks again, last thing).
            lock.keep_alive(on_lost=on_lost)
            if not lock.is_valid():
                _say(_NOT_STARTED)
                lost.set()
                return EXIT_LOCK_LOST
            family = _Family(command, environment, lock, options)
            # Stoppable from now on: a watchdog stopped (or slow) between starting the command
            # and saying so must still be told if the lock is lost meanwhile.
            forwarder.adopt(family)
            try:
                family.wait_started(command[0])
            except FileNotFoundError:
                _say(f"{command[0]}: command not found")
                return EXIT_NOT_FOUND
            except PermissionError as error:
                _say(f"{command[0]}: cannot execute: {error}")
                return EXIT_CANNOT_EXECUTE
            except _StartedTooLate:
                _say(_NOT_STARTED)
                lost.set()
                return EXIT_LOCK_LOST
            except _WatchdogEnded:
                _say(
                    "the watchdog ended before it said whether the command started (it was "
                    "killed): killed all it may have started"
                )
                lost.set()
                return EXIT_LOCK_LOST
            finally:
                forwarder.attach(family)
            if lost.is_set() and options.on_lost == "stop":
                family.stop()  # lost as the command started, before on_lost could reach it
            with _DeadlineCourier(lock, family):
                returncode = family.wait()
            if {"deadline", "orphaned"} & set(family.stopped_by_watchdog):
                lost.set()
    finally:
        if forwarder.group is not None:
            forwarder.group.close()
        ended.set()  # unlock() may yet call on_lost, when it finds the lock lost
        was_valid = lock.is_valid()
        try:
            lock.unlock()
        except LockLost as error:
            if not lost.is_set():
                _say(str(error))
            lost.set()
        except LockError as error:
            # Not released (the database unreachable): the row expires, held by nobody. The
            # command's status stands, unless the lock ran out before it ended (then 75, not
            # 1, which says "busy").
            _say(f"{error}; the lock will expire by itself")
        if not was_valid:
            lost.set()
    if lost.is_set():
        return EXIT_LOCK_LOST
    return returncode if returncode >= 0 else EXIT_SIGNAL - returncode


# What COMMAND keeps ignoring if sqllocker was started ignoring it.
_KEPT_IGNORED = (*FORWARDED_SIGNALS, *watchdog_script.TERMINAL_STOPS)


def _ignored(signals: Sequence[int] = FORWARDED_SIGNALS) -> list[int]:
    """The ``signals`` that sqllocker was started ignoring (``nohup`` ignores HUP): neither
    acted on nor passed on, and ignored by COMMAND too, as a job under ``nohup`` would ignore
    them."""
    return [sig for sig in signals if signal.getsignal(sig) == signal.SIG_IGN]


def _passed_on() -> list[int]:
    ignored = _ignored()
    return [sig for sig in FORWARDED_SIGNALS if sig not in ignored]


class _Forwarder:
    """Passes INT, TERM, HUP and QUIT on to the command's group while it runs: installed
    before the group exists, so that none is missed; one that comes before the command has
    started is passed on as soon as it has."""

    def __init__(self) -> None:
        self.group: _Family | None = None
        self._pending: list[int] = []
        self._previous: dict[int, object] = {}

    def __enter__(self) -> _Forwarder:
        self._previous = {sig: signal.signal(sig, self._forward) for sig in _passed_on()}
        return self

    def adopt(self, group: _Family) -> None:
        """``group``, not yet started: a signal is kept for it until ``attach``, and a lost
        lock stops it (``_Family.stop`` wakes its watchdog)."""
        self.group = group

    def attach(self, group: _Family) -> None:
        self.group = group
        if group.started:
            for signum in self._pending:
                group.signal(signum)
        self._pending.clear()

    def _forward(self, signum: int, _frame: FrameType | None) -> None:
        if self.group is None or not self.group.started:
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

    previous = {sig: signal.signal(sig, interrupt) for sig in _passed_on()}
    try:
        yield
    except KeyboardInterrupt as error:
        raise _Interrupted(signal.SIGINT) from error
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
