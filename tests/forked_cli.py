"""The ``sqllocker`` console script (or Django's ``python -m django``), each run forked from
one server that imported it once.

``python -m tests.forked_cli PROGRAM`` imports the program (``sqllocker``: ``sqllocker.cli``,
that is SQLAlchemy, click and the library, half a second of CPU per interpreter, far more on a
loaded machine; ``django``: Django's command line and the library, settings unread), then
reads requests, one JSON line each (``argv``, ``env``, ``cwd``, ``out``, ``err``), and forks one
child per request that runs the program with ``argv`` as its console script does, in that
environment and directory (``PYTHONPATH`` first on the path), its stdout and stderr in the
files named; it answers each with its exit status, one JSON line. Nothing is connected or
configured before the fork; the children die with the server (``PR_SET_PDEATHSIG``).

:func:`run` starts one server of each program per process that calls it (an xdist worker),
and runs a command through it, for the tests whose claim is what a command does, not how it
starts.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
_PR_SET_PDEATHSIG = 1

_servers: dict[str, subprocess.Popen[str]] = {}
_guard = threading.Lock()


def run(
    argv: list[str],
    env: dict[str, str] | None = None,
    cwd: Path | str | None = None,
    timeout: float = 120,
    program: str = "sqllocker",
) -> subprocess.CompletedProcess[str]:
    """``sqllocker ARGV`` (``program="django"``: ``python -m django ARGV``) with ``env``
    (default: this process's) in ``cwd``: its exit status, stdout and stderr, as
    ``subprocess.run(..., capture_output=True, text=True)`` gives them.
    ``subprocess.TimeoutExpired`` after ``timeout`` seconds (the server is ended then)."""
    assert program in _PROGRAMS, program
    with _guard, tempfile.TemporaryDirectory(prefix="sqllocker-cli-") as directory:
        server = _servers.get(program)
        if server is None or server.poll() is not None:
            server = _servers[program] = subprocess.Popen(
                [sys.executable, "-m", "tests.forked_cli", program],
                cwd=REPO,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
        assert server.stdin is not None
        assert server.stdout is not None
        out, err = Path(directory, "out"), Path(directory, "err")
        request = {
            "argv": argv,
            "env": dict(os.environ if env is None else env),
            "cwd": str(cwd or os.getcwd()),
            "out": str(out),
            "err": str(err),
        }
        server.stdin.write(json.dumps(request) + "\n")
        server.stdin.flush()
        answer: list[str] = []
        answers = server.stdout
        reader = threading.Thread(target=lambda: answer.append(answers.readline()))
        reader.start()
        reader.join(timeout)
        if not answer or not answer[0]:
            _stop(program)
            reader.join()
            raise subprocess.TimeoutExpired([program, *argv], timeout)
        code = int(json.loads(answer[0])["code"])
        return subprocess.CompletedProcess([program, *argv], code, out.read_text(), err.read_text())


def _stop(program: str | None = None) -> None:
    for name in [program] if program is not None else list(_servers):
        server = _servers.pop(name, None)
        if server is not None:
            if server.poll() is None:
                server.kill()  # its children die with it
            server.wait()


atexit.register(_stop)


def _child(main: Callable[[list[str]], None], request: dict[str, Any], parent: int) -> None:
    """In the forked child: die with the server, take the request's environment, directory
    and output files, run the command, exit with its status."""
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the server died before the line above
        os._exit(1)
    code = 1
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, key in ((1, "out"), (2, "err")):
            target = os.open(str(request[key]), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(str(request["cwd"]))
        sys.path[:0] = [path for path in os.environ.get("PYTHONPATH", "").split(os.pathsep) if path]
        argv = list(request["argv"])
        try:
            main(argv)
            code = 0
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


def _sqllocker() -> Callable[[list[str]], None]:
    from sqllocker.cli import main

    def run(argv: list[str]) -> None:
        sys.argv = ["sqllocker", *argv]
        main(argv)

    return run


def _django() -> Callable[[list[str]], None]:
    import django.core.management

    # Imported once: the settings ask for the app, whose commands run the command line.
    import sqllocker.cli
    import sqllocker.django  # noqa: F401

    def run(argv: list[str]) -> None:
        django.core.management.execute_from_command_line(["python -m django", *argv])

    return run


_PROGRAMS = {"sqllocker": _sqllocker, "django": _django}


def serve(program: str) -> None:
    main = _PROGRAMS[program]()
    parent = os.getpid()
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(main, request, parent)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        print(json.dumps({"code": code}), flush=True)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt, BrokenPipeError):
        serve(sys.argv[1])
