"""The process that starts a command run under a lock, and stops all of it when it must.

``sqllocker run`` starts this as the leader of a new process group, and this starts COMMAND
(in that group) and waits for it. On Linux it is also a *child subreaper*
(``PR_SET_CHILD_SUBREAPER``): whatever COMMAND starts stays among its descendants, even a
daemon that leaves the group and the session (``setsid``) or whose parent exits (a double
fork), since an orphan is handed to the nearest subreaper above it, not to init. To stop the
family it walks ``/proc`` for its own descendants and signals each of them; it reaps the
orphans handed to it.

Two pipes join it to sqllocker. On the status pipe it says ``started PID`` (or ``missing`` /
``refused MESSAGE`` if COMMAND cannot be run, ``late`` if the lock's deadline has passed
before it could start it), ``exit STATUS`` when COMMAND ends (a negative
status: the signal that ended it), ``suspended SIGNAL`` when COMMAND has been stopped by a
terminal's stop (Ctrl-Z, or a read or write of the terminal from the background: sqllocker then
stops too, as a job of the shell, and says ``resumed`` once it goes on; no other ``suspended``
comes before, so that a command stopped and continued over and over while sqllocker is stopped
cannot fill the pipe and block this process), and ``stopping REASON COUNT`` when it stops the
family (of COUNT processes) on its own account. On the control pipe sqllocker sends
``deadline VALID_UNTIL KILL_BY`` after each renewal of the lock and ``stop`` when the lock is
lost; both times are on the clock the lock's deadline is kept on (``CLOCK_BOOTTIME``, which
counts suspend; this is sqllocker's child, so it reads the same clock in the same time
namespace: absolute times, not the time left, lose nothing to the pipe's delay).

It stops the family (SIGTERM and SIGCONT to every descendant, SIGKILL to every descendant
``kill_after`` seconds later, whether or not COMMAND still lives) when:

- sqllocker says ``stop`` (the lock is lost);
- the lock's validity deadline passes with no newer one (sqllocker stopped, frozen or too slow
  to renew), unless told to only warn;
- the control pipe ends: sqllocker is gone (SIGKILL, the OOM killer);
- COMMAND has ended, and something it started still runs: that must not outlive the lock.

Once the deadline has passed (unless told to only warn) or sqllocker is gone, the SIGKILL
comes no later than KILL_BY, which sqllocker sets before the lock's row can expire: the family
is gone before anyone else can take the lock over.
The watchdog exits once COMMAND has ended and no descendant is left; sqllocker releases the
lock only then. Without ``/proc`` or the subreaper (not Linux), the family is the process group,
signalled as a whole, and what leaves the group is out of reach.

It is run as a script (``python -I -S watchdog.py``): it must start in milliseconds, and
needs nothing of sqllocker's (which imports it for ``become_subreaper`` and ``Family``, to
kill what a killed watchdog leaves). It ignores the signals sqllocker passes on to
the group, which are meant for the command, and a terminal's stops: it keeps watching the
lock's deadline while COMMAND and sqllocker are stopped.
"""

import contextlib
import os
import select
import signal
import sys
import time
from collections.abc import Callable

Member = tuple[int, int]  # a process: its pid and its start time

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
# The other signals that end a process by default, which a command sends its own group (``kill
# -USR1 0``) as readily as its children: the watchdog leads that group, and ignores them all.
IGNORED_SIGNALS = tuple(
    getattr(signal, name)
    for name in ("SIGUSR1", "SIGUSR2", "SIGALRM", "SIGVTALRM", "SIGPROF", "SIGIO", "SIGPWR")
    if hasattr(signal, name)
)
# A terminal's stops (Ctrl-Z, and a read or write of it from the background): they stop
# COMMAND's group, and the watchdog ignores them.
TERMINAL_STOPS = (signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU)
# Set back to their defaults in COMMAND: those this ignores, those Python ignores (SIGPIPE,
# SIGXFSZ), and SIGCHLD, which this handles.
DEFAULT_IN_COMMAND = (
    *FORWARDED_SIGNALS,
    *IGNORED_SIGNALS,
    *TERMINAL_STOPS,
    signal.SIGCHLD,
    signal.SIGPIPE,
    *([signal.SIGXFSZ] if hasattr(signal, "SIGXFSZ") else []),
)
PR_SET_CHILD_SUBREAPER = 36
# While a deadline matters, wake at least this often: a sleep is timed on a clock that stops
# while the machine is suspended, and the deadline's clock does not.
LONGEST_NAP = 0.25
KILL_POLL = 0.02  # while SIGKILLed processes are still dying (or still forking)
CHILD_KILL_ROUNDS = 2000  # reads of our children in one burst of SIGKILLs

now: Callable[[], float] = time.monotonic  # macOS: the same fallback as sqllocker.clock
if hasattr(time, "CLOCK_BOOTTIME"):
    _BOOTTIME = time.CLOCK_BOOTTIME

    def now() -> float:
        return time.clock_gettime(_BOOTTIME)


def become_subreaper() -> bool:
    if not sys.platform.startswith("linux") or not os.path.exists("/proc/self/stat"):
        return False  # pragma: no cover
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):  # pragma: no cover
        return False


def _stat(pid: int) -> tuple[int, int, bytes] | None:
    """(parent, start time, state) of ``pid`` from /proc, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            data = stat.read()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2 :].split()
    return int(fields[1]), int(fields[19]), fields[0]


def _threads_run_on(pid: int) -> bool:
    """Whether process ``pid``, shown as a zombie, still has threads running: its main thread
    ended (``pthread_exit``) and the others did not."""
    try:
        return len(os.listdir(f"/proc/{pid}/task")) > 1
    except OSError:
        return False


def _children_of_self() -> list[int]:
    """The pids of this process's children (of all its threads), from /proc."""
    pids: list[int] = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:  # pragma: no cover
        return pids
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/children", "rb") as children:
                pids.extend(int(pid) for pid in children.read().split())
        except OSError:  # pragma: no cover - a thread gone, or a kernel without the file
            continue
    return pids


def children() -> frozenset[Member]:
    """This process's children now, each as (pid, start time)."""
    found = set()
    for pid in _children_of_self():
        info = _stat(pid)
        if info is not None:
            found.add((pid, info[1]))
    return frozenset(found)


class Family:
    """The descendants of this process: found in /proc, each known by its pid and start time,
    so that a pid used again by another process after ours ended is never signalled. Those of
    ``spared`` (children it had before its family began: sqllocker exec'd by a shell that had
    started others) and theirs are not of the family."""

    def __init__(self, subreaper: bool, spared: frozenset[Member] = frozenset()) -> None:
        self.subreaper = subreaper
        self.spared = spared
        self.refused: set[Member] = (
            set()
        )  # (pid, start) that may not be signalled (setuid programs)

    def living(self) -> set[Member]:
        """{(pid, start)} of every descendant that has not yet ended."""
        if not self.subreaper:  # pragma: no cover
            return set()
        children: dict[int, list[tuple[int, int, bytes]]] = {}
        for name in os.listdir("/proc"):
            if name.isdigit():
                info = _stat(int(name))
                if info is not None:
                    children.setdefault(info[0], []).append((int(name), info[1], info[2]))
        found: set[Member] = set()
        todo = [os.getpid()]
        while todo:
            for pid, start, state in children.get(todo.pop(), ()):
                if (pid, start) in self.spared:
                    continue
                todo.append(pid)
                if state not in (b"Z", b"X") or _threads_run_on(pid):
                    found.add((pid, start))
        return found - self.refused

    def has_children(self) -> bool:
        """Whether this process has a child, ended (not yet reaped) or not. A subreaper's
        descendants all descend from its children, and an orphan becomes its child: once it has
        none, the family is gone, whatever a walk of /proc (a snapshot, which a process that
        forks and exits faster than it is read slips through) may have missed."""
        if not self.subreaper:  # pragma: no cover
            return False
        if self.spared:
            return bool(children() - self.spared)
        try:
            os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return False
        return True

    def gone(self) -> bool:
        return not self.living() and not self.has_children()

    def kill_children(self) -> None:
        """SIGKILL this process's children over and over for a moment, as fast as they can be
        read: what forks and exits faster than /proc is walked is caught here, as each new
        generation becomes the subreaper's child. A child's pid is not used again before it
        is reaped (by us, not meanwhile), so each pid read is still that child."""
        if not self.subreaper:  # pragma: no cover
            return
        killed: set[int] = {pid for pid, _ in self.spared}
        for _ in range(CHILD_KILL_ROUNDS):
            pids = set(_children_of_self()) - killed
            if not pids:  # none new: the rest are dying, ended, or may not be signalled
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            killed |= pids

    def signal(self, signum: int, members: set[Member]) -> None:
        """Send ``signum`` to each of ``members`` that is still the process it was."""
        if not self.subreaper:  # pragma: no cover - the process group is all we can reach
            with contextlib.suppress(ProcessLookupError):
                os.killpg(os.getpgrp(), signum)
            return
        for pid, start in members:
            self._send(pid, start, signum)

    def _send(self, pid: int, start: int, signum: int) -> None:
        handle: int | None = None
        try:
            handle = os.pidfd_open(pid)
        except ProcessLookupError:
            return
        except (AttributeError, OSError):  # pragma: no cover - a kernel before 5.3
            pass
        try:
            info = _stat(pid)  # with the pidfd open, the pid cannot pass to another process
            if info is None or info[1] != start:
                return
            if handle is not None:
                signal.pidfd_send_signal(handle, signum)
            else:  # pragma: no cover
                os.kill(pid, signum)
        except ProcessLookupError:
            pass
        except PermissionError:
            self.refused.add((pid, start))
            print(f"sqllocker watchdog: may not signal process {pid}", file=sys.stderr)
        finally:
            if handle is not None:
                os.close(handle)


class Watchdog:
    def __init__(
        self,
        status_fd: int,
        kill_after: float,
        act_on_deadline: bool,
        valid_until: float,
        kill_by: float,
    ) -> None:
        self.status_fd = status_fd
        self.kill_after = kill_after
        self.act_on_deadline = act_on_deadline
        self.valid_until = valid_until
        self.kill_by = kill_by
        self.family = Family(become_subreaper())
        self.command: int | None = None
        self.status: int | None = None  # COMMAND's, once it has ended
        self.control_open = True
        self.stop_asked = False
        self.kill_at: float | None = None  # once the family is being stopped
        self.suspension_told = False  # ``suspended`` said, and ``resumed`` not yet heard

    def tell(self, line: str) -> None:
        with contextlib.suppress(OSError):  # sqllocker is gone: the control pipe will say so
            os.write(self.status_fd, line.encode() + b"\n")

    def start(self, command: list[str], kept_ignored: frozenset[int] = frozenset()) -> bool:
        if now() >= self.valid_until:
            # Stalled since sqllocker last looked (stopped, or too slow to start): the next
            # holder may have the lock by now.
            self.tell("late")
            return False
        try:
            defaults = tuple(sig for sig in DEFAULT_IN_COMMAND if sig not in kept_ignored)
            self.command = os.posix_spawnp(command[0], command, os.environ, setsigdef=defaults)
        except FileNotFoundError:
            self.tell("missing")
            return False
        except OSError as error:
            self.tell(f"refused {error.strerror or error}")
            return False
        self.tell(f"started {self.command}")
        return True

    def reap(self) -> None:
        """Reap every child that has ended: COMMAND, and orphans handed to this subreaper; and
        say so when COMMAND has been stopped by a terminal's stop."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG | os.WUNTRACED)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if os.WIFSTOPPED(status):
                stop = os.WSTOPSIG(status)
                if (
                    pid == self.command
                    and stop in TERMINAL_STOPS
                    and self.status is None
                    and not self.suspension_told
                ):
                    self.suspension_told = True
                    self.tell(f"suspended {stop}")
                continue
            if pid == self.command:
                self.status = os.waitstatus_to_exitcode(status)
                self.tell(f"exit {self.status}")

    def read_control(self, fd: int, pending: bytes) -> bytes:
        try:
            data = os.read(fd, 4096)
        except BlockingIOError:
            return pending
        if not data:
            self.control_open = False
            return b""
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            words = line.split()
            try:
                if words[0] == b"deadline":
                    self.valid_until, self.kill_by = float(words[1]), float(words[2])
                elif words == [b"resumed"]:
                    self.suspension_told = False
                else:
                    self.stop_asked = True  # ``stop``, or anything we do not understand
            except (IndexError, ValueError):
                self.stop_asked = True
        return pending

    def must_end_by_kill_by(self, moment: float) -> bool:
        """Whether the lock may lapse: its deadline passed, or nobody renews it any more."""
        deadline_passed = self.act_on_deadline and moment >= self.valid_until
        return deadline_passed or not self.control_open

    def why_stop(self, moment: float) -> str | None:
        if not self.control_open:
            return "sqllocker has gone"
        if self.act_on_deadline and moment >= self.valid_until:
            return "deadline"
        if self.stop_asked:
            return "lost"
        if self.status is not None:
            return "leftovers"
        return None

    def living(self) -> set[Member]:
        """The family's members still running (without /proc: the group, while COMMAND runs)."""
        if self.family.subreaper:
            return self.family.living()
        return set() if self.status is not None else {(0, 0)}  # pragma: no cover

    def step(self, moment: float) -> float | None:
        """Act on the state as of ``moment``; return how long to wait, or None to exit."""
        if self.kill_at is None:
            reason = self.why_stop(moment)
            if reason is None:
                if self.act_on_deadline:
                    return min(LONGEST_NAP, max(0.0, self.valid_until - moment))
                return 3600.0  # until COMMAND ends, or sqllocker says something
            living = self.living()
            if reason == "leftovers" and not living and not self.family.has_children():
                return None
            if reason in ("deadline", "leftovers"):
                self.tell(f"stopping {reason} {len(living)}")
            self.kill_at = moment + self.kill_after
            if self.kill_after > 0:
                self.family.signal(signal.SIGTERM, living)
                self.family.signal(signal.SIGCONT, living)  # a stopped process acts on it then
        kill_at = self.kill_at
        if self.must_end_by_kill_by(moment):
            kill_at = min(kill_at, self.kill_by)
        living = self.living()
        if not living and not self.family.has_children():  # the family is gone
            return None if self.status is not None else KILL_POLL  # COMMAND's status to come
        if moment < kill_at:
            # From now: the walks of /proc since ``moment`` took their time.
            return max(0.0, min(LONGEST_NAP, kill_at - now()))
        self.family.signal(signal.SIGKILL, living)
        self.family.kill_children()
        return KILL_POLL


def main() -> int:
    control_fd, status_fd = int(sys.argv[1]), int(sys.argv[2])
    kill_after, mode = float(sys.argv[3]), sys.argv[4]
    valid_until, kill_by = float(sys.argv[5]), float(sys.argv[6])
    # The signals sqllocker was started ignoring (nohup): COMMAND keeps ignoring them.
    kept_ignored = frozenset(int(signum) for signum in sys.argv[7].split(",") if signum != "-")
    command = sys.argv[9:]
    for fd in (control_fd, status_fd):
        os.set_inheritable(fd, False)
    os.set_blocking(control_fd, False)
    for signum in (*FORWARDED_SIGNALS, *IGNORED_SIGNALS, *TERMINAL_STOPS):
        signal.signal(signum, signal.SIG_IGN)  # back to the default in COMMAND (setsigdef)
    wake_read, wake_write = os.pipe()
    for fd in (wake_read, wake_write):
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda _signum, _frame: None)
    watchdog = Watchdog(status_fd, kill_after, mode == "stop", valid_until, kill_by)
    if not watchdog.start(command, kept_ignored):
        return 0
    try:
        watch(watchdog, control_fd, wake_read)
    except BaseException:  # a bug of ours must not leave the family running unwatched
        kill_everything(watchdog.family)
        raise
    return 0


def watch(watchdog: Watchdog, control_fd: int, wake_read: int) -> None:
    pending = b""
    while True:
        watchdog.reap()
        wait = watchdog.step(now())
        if wait is None:
            watchdog.reap()
            # The last word: sqllocker releases the lock only once it has read it. A watchdog
            # killed before (however far the family's stop had come) has said nothing, and
            # sqllocker kills what is left itself.
            watchdog.tell("done")
            return
        readable = [wake_read] + ([control_fd] if watchdog.control_open else [])
        ready, _, _ = select.select(readable, [], [], wait)
        if wake_read in ready:
            with contextlib.suppress(BlockingIOError):
                while os.read(wake_read, 4096):
                    pass
        if control_fd in ready:
            pending = watchdog.read_control(control_fd, pending)


def kill_everything(family: Family) -> None:
    try:
        for _ in range(100):
            living = family.living()
            if not living and not family.has_children():
                return
            family.signal(signal.SIGKILL, living)
            family.kill_children()
            time.sleep(KILL_POLL)
            with contextlib.suppress(ChildProcessError):
                while os.waitpid(-1, os.WNOHANG)[0]:
                    pass
    finally:
        os.killpg(os.getpgrp(), signal.SIGKILL)  # what is left of the group, and this process


if __name__ == "__main__":
    sys.exit(main())
