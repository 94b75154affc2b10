"""Many worker processes forked from one launcher that imported their module once.

``python -m tests.fleet MODULE DIRECTORY`` reads a JSON list of argument lists on stdin, imports
``MODULE`` (``tests.workers``: SQLAlchemy, the drivers and both front ends, about a second of CPU
per interpreter), then forks one worker per argument list, each running ``MODULE.main(argv)``
with its stdout and stderr in ``DIRECTORY/worker-<n>.out`` and ``.err``. The workers are
separate processes as if each had been started alone: nothing is connected or started before
the fork, and each seeds its own random numbers. The launcher passes ``DUMP_SIGNAL`` on to them,
they die with it (``PR_SET_PDEATHSIG``), and it prints the workers' exit statuses as a JSON
list once all have ended.

:class:`Fleet` starts one and reads what each worker said.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import signal
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from tests import preloading

REPO = Path(__file__).resolve().parent.parent
_PR_SET_PDEATHSIG = 1


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
        self.launcher = subprocess.Popen(
            [sys.executable, "-m", "tests.fleet", module, str(directory)],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.launcher.stdin is not None
        self.launcher.stdin.write(json.dumps(argvs))
        self.launcher.stdin.close()

    def wait(self, timeout: float) -> list[Outcome]:
        """Each worker's outcome, in order, once all have ended (``subprocess.TimeoutExpired``
        if they have not after ``timeout`` seconds)."""
        assert self.launcher.stdout is not None
        assert self.launcher.stderr is not None
        self.launcher.wait(timeout)
        out, err = self.launcher.stdout.read(), self.launcher.stderr.read()
        assert self.launcher.returncode == 0, f"the launcher failed:\n{err}"
        codes = json.loads(out.strip().splitlines()[-1])
        return [Outcome(code, *self._output(n)) for n, code in enumerate(codes)]

    def stacks(self, signum: int) -> str:
        """Where each worker stands (sent ``signum``, which dumps their stacks), and what it
        wrote to stderr; they are all killed after."""
        self.launcher.send_signal(signum)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.launcher.wait(5)
        self.kill()
        return "\n".join(
            f"--- worker {n}:\n{self._output(n)[1][-20000:]}" for n in range(self.count)
        )

    def kill(self) -> None:
        """End the launcher, and with it every worker still running."""
        if self.launcher.poll() is None:
            self.launcher.kill()
        self.launcher.wait()

    def _output(self, n: int) -> tuple[str, str]:
        def read(suffix: str) -> str:
            path = self.directory / f"worker-{n}.{suffix}"
            return path.read_text() if path.exists() else ""

        return read("out"), read("err")


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
    preloading.backends()
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


if __name__ == "__main__":
    module_name, directory = sys.argv[1], Path(sys.argv[2])
    print(json.dumps(launch(module_name, directory, json.loads(sys.stdin.read()))), flush=True)
