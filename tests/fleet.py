"""Many worker processes forked from one launcher that imported their module once.

A launcher reads a JSON list of argument lists on stdin, imports ``MODULE`` (``tests.workers``
and the like), then forks one worker per argument list, each running ``MODULE.main(argv)``
with its stdout and stderr in ``DIRECTORY/worker-<n>.out`` and ``.err``. The workers are
separate processes as if each had been started alone: nothing is connected or started before
the fork, and each seeds its own random numbers. The launcher passes ``DUMP_SIGNAL`` on to them,
they die with it (``PR_SET_PDEATHSIG``), and it prints the workers' exit statuses as a JSON
list once all have ended.

Each launcher is itself forked from a server (``fork_server.py``, ``python -m tests.fleet``)
that imported the library, SQLAlchemy, every backend's drivers and ``tests.workers`` once per
process that starts fleets (an xdist worker): about a second of CPU a fleet, which a launcher
started as a fresh interpreter spent on its imports.

:class:`Fleet` starts one and reads what each worker said.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from tests import preloading
from tests.fork_server import Channel, Server, serve

REPO = Path(__file__).resolve().parent.parent
_PR_SET_PDEATHSIG = 1
# What every launcher's workers import, imported once by the servers launchers are forked from.
PRELOADED = ("tests.workers",)

_servers: list[Server] = []
_taken: set[Server] = set()  # serving a fleet, or about to: each serves one at a time
_servers_guard = threading.Lock()


@dataclass
class Outcome:
    """One worker's exit status and what it wrote."""

    returncode: int
    out: str
    err: str


class Fleet:
    """Workers of ``module`` (one per argument list), forked from one launcher."""

    def __init__(self, module: str, argvs: list[list[str]], directory: Path) -> None:
        self.directory = directory
        self.count = len(argvs)
        directory.mkdir(parents=True, exist_ok=True)
        plan = directory / "launcher.in"
        plan.write_text(json.dumps(argvs))
        self._out, self._err = directory / "launcher.out", directory / "launcher.err"
        files = (str(plan), str(self._out), str(self._err))
        self._launcher_pid: int | None = None
        self._pid_known = threading.Event()
        self._code: int | None = None  # the launcher's exit status, once it has ended
        self._error: BaseException | None = None  # why it could not run
        server = _idle_server()

        def started(pid: int) -> None:
            self._launcher_pid = pid
            self._pid_known.set()

        def launch_and_wait() -> None:
            try:
                argv = [module, str(directory)]
                self._code = server.run(argv, "fleet", cwd=REPO, files=files, started=started)
            except BaseException as error:  # told by wait()
                self._error = error
            finally:
                with _servers_guard:
                    _taken.discard(server)
                self._pid_known.set()

        self._thread = threading.Thread(target=launch_and_wait, name="fleet", daemon=True)
        self._thread.start()
        self._pid_known.wait(60)

    def wait(self, timeout: float) -> list[Outcome]:
        """Each worker's outcome, in order, once all have ended (``subprocess.TimeoutExpired``
        if they have not after ``timeout`` seconds)."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise subprocess.TimeoutExpired(["fleet", str(self.directory)], timeout)
        if self._error is not None:
            raise AssertionError(f"the launcher could not run: {self._error!r}")
        err = self._err.read_text() if self._err.exists() else ""
        assert self._code == 0, f"the launcher failed:\n{err}"
        codes = json.loads(self._out.read_text().strip().splitlines()[-1])
        return [Outcome(code, *self._output(n)) for n, code in enumerate(codes)]

    def stacks(self, signum: int) -> str:
        """Where each worker stands (sent ``signum``, which dumps their stacks), and what it
        wrote to stderr; they are all killed after."""
        self._signal(signum)
        self._thread.join(5)
        self.kill()
        return "\n".join(
            f"--- worker {n}:\n{self._output(n)[1][-20000:]}" for n in range(self.count)
        )

    def kill(self) -> None:
        """End the launcher, and with it every worker still running."""
        self._signal(signal.SIGKILL)
        self._thread.join()

    def _signal(self, signum: int) -> None:
        if self._launcher_pid is not None and self._thread.is_alive():  # not reaped yet
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._launcher_pid, signum)

    def _output(self, n: int) -> tuple[str, str]:
        def read(suffix: str) -> str:
            path = self.directory / f"worker-{n}.{suffix}"
            return path.read_text() if path.exists() else ""

        return read("out"), read("err")


def _idle_server() -> Server:
    """A launchers' server of this process that serves no fleet now (one more if all do),
    taken for the caller's fleet."""
    with _servers_guard:
        idle = [s for s in _servers if s not in _taken and s.process.poll() is None]
        server = idle[0] if idle else Server.start([sys.executable, "-m", "tests.fleet"], cwd=REPO)
        if not idle:
            _servers.append(server)
        _taken.add(server)
        return server


def _stop() -> None:
    for server in _servers:
        server.kill()  # its launchers die with it, and their workers with them


atexit.register(_stop)


def _run_worker(main: object, argv: list[str], directory: Path, n: int, parent: int) -> None:
    """In the forked child: die with the launcher, write to this worker's files, run."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the launcher died before the line above
        os._exit(1)
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    signal.signal(signal.SIGUSR2, signal.SIG_DFL)
    code = 1
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, suffix in ((1, "out"), (2, "err")):
            target = os.open(directory / f"worker-{n}.{suffix}", os.O_WRONLY | os.O_CREAT, 0o644)
            os.dup2(target, fd)
            os.close(target)
        try:
            result = main(argv)  # type: ignore[operator]
            code = int(result or 0)
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (1 if exit_.code else 0)
        except BaseException:
            traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def launch(module_name: str, directory: Path, argvs: list[list[str]]) -> list[int]:
    """Fork one worker per argument list; each one's exit status once all have ended."""
    main = importlib.import_module(module_name).main
    parent = os.getpid()
    children: list[int] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signum)

    # The signals the workers' stacks are dumped with.
    signal.signal(signal.SIGUSR1, forward)
    signal.signal(signal.SIGUSR2, forward)
    sys.stdout.flush()
    sys.stderr.flush()
    for n, argv in enumerate(argvs):
        pid = os.fork()
        if pid == 0:
            _run_worker(main, argv, directory, n, parent)
        children.append(pid)
    return [os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) for child in children]


def _launcher(argv: list[str]) -> None:
    """A launcher's main, forked from a server: ``[MODULE, DIRECTORY]``, the argument lists
    on stdin, the workers' exit statuses printed."""
    module_name, directory = argv
    print(
        json.dumps(launch(module_name, Path(directory), json.loads(sys.stdin.read()))), flush=True
    )


if __name__ == "__main__":
    for module in PRELOADED:
        importlib.import_module(module)
    preloading.backends()
    with contextlib.suppress(KeyboardInterrupt, BrokenPipeError):
        serve(_launcher, Channel(0, 1))
