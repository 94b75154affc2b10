"""The ``sqllocker`` console script (or Django's ``python -m django``, a fault campaign's
``python -m tests.campaign``, or ``python -m tests.workers``), each run forked from one server
that imported it once (``fork_server.py``).

``python -m tests.forked_cli PROGRAM`` imports the program (``sqllocker``: ``sqllocker.cli``,
that is SQLAlchemy, click and the library, half a second of CPU per interpreter, far more on a
loaded machine; ``django``: Django's command line and the library, settings unread;
``campaign``: the campaign, what its processes run and every backend's drivers;
``workers``: ``tests.workers`` and every backend's drivers; ``python``: ``python -c PROGRAM``
with sqllocker and every backend's drivers; ``apscheduler``: ``python -m
tests.apscheduler_worker``, APScheduler and every backend's drivers; ``celery``: ``python -m
celery`` in a session of its own, Celery, its Redis transport and every backend's drivers,
the app unread), then
serves requests on its stdin and stdout, forking one child per request that runs the program
with the request's ``argv`` as its console script does. Nothing is connected or configured
before the fork; the children die with the server (``PR_SET_PDEATHSIG``).

:func:`run` runs a command to its end, and :class:`Popen` starts one that the test talks to
while it runs (its stdin and stdout pipes), for the tests whose claim is what a command or a
process does, not how it starts: each forked from an idle server of its program among those
that the calling process (an xdist worker) keeps, started as first needed (one more whenever
all run a child at once).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO

from tests import preloading
from tests.fork_server import REPO, Channel, Server, run_module, serve


def run(
    argv: list[str],
    env: dict[str, str] | None = None,
    cwd: Path | str | None = None,
    timeout: float = 120,
    program: str = "sqllocker",
) -> subprocess.CompletedProcess[str]:
    """``sqllocker ARGV`` (``program="django"``: ``python -m django ARGV``; ``"campaign"``:
    ``python -m tests.campaign ARGV``) with ``env``
    (default: this process's) in ``cwd``: its exit status, stdout and stderr, as
    ``subprocess.run(..., capture_output=True, text=True)`` gives them.
    ``subprocess.TimeoutExpired`` after ``timeout`` seconds (the command is killed then)."""
    assert program in _PROGRAMS, program
    with tempfile.TemporaryDirectory(prefix="sqllocker-cli-") as directory:
        out, err = Path(directory, "out"), Path(directory, "err")
        files = (os.devnull, str(out), str(err))
        server = _idle_server(program)
        try:
            code = server.run(argv, program, env, cwd, files, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise subprocess.TimeoutExpired([program, *argv], timeout) from None
        finally:
            _give_back(server)
        return subprocess.CompletedProcess([program, *argv], code, out.read_text(), err.read_text())


class Popen:
    """``python -m tests.workers ARGV`` (``program``: another of ``run``'s, such as ``"python"``
    for ``python -c PROGRAM ARGS``) forked from an idle server of this process's, with what
    ``subprocess.Popen(..., stdin=PIPE, stdout=PIPE, stderr=PIPE, text=True)`` offers of it:
    ``pid``, ``stdin``, ``stdout``, ``stderr`` (read once it has ended), ``returncode``,
    ``poll``, ``wait``, ``send_signal``, ``kill``, ``communicate``; with ``stderr``, its stderr
    written to that file instead; with ``stdout``, its stdout written to that file, and its
    stdin /dev/null (no pipe). ``env`` (default: this process's) and ``cwd`` are its own. It is
    the server's child, and dies with it."""

    def __init__(
        self,
        argv: list[str],
        program: str = "workers",
        cwd: Path | str = REPO,
        stderr: Path | None = None,
        env: dict[str, str] | None = None,
        stdout: Path | str | None = None,
    ) -> None:
        assert program in _PROGRAMS, program
        self.args = argv
        self.pid = 0
        self.returncode: int | None = None
        self._error: BaseException | None = None
        self._directory = Path(tempfile.mkdtemp(prefix="forked-", dir=_scratch()))
        pipes = stdout is None
        into, out_of = self._directory / "in", self._directory / "out"  # the pipes, if any
        self._stderr = stderr or self._directory / "err"
        self._stderr.touch()  # there to read at once, as Popen's own files are
        if pipes:
            os.mkfifo(into)
            os.mkfifo(out_of)
            files = (str(into), str(out_of), str(self._stderr))
        else:
            files = (os.devnull, str(stdout), str(self._stderr))
        server = _idle_server(program)
        known = threading.Event()

        def started(pid: int) -> None:
            self.pid = pid
            known.set()

        def run_and_wait() -> None:
            try:
                self.returncode = server.run(argv, program, env, cwd, files, started=started)
            except BaseException as error:  # told by wait()
                self._error = error
            finally:
                _give_back(server)
                known.set()

        self._thread = threading.Thread(target=run_and_wait, name=program, daemon=True)
        self._thread.start()
        known.wait(60)
        if not self.pid:
            raise AssertionError(f"the fork server could not start {argv}: {self._error!r}")
        self.stdin: IO[str] | None = None
        self.stdout: IO[str] | None = None
        if pipes:
            # The child opens its stdin, then its stdout: each open of a FIFO waits for the
            # other end.
            self.stdin = open(into, "w")  # noqa: SIM115 (closed by communicate)
            self.stdout = open(out_of)  # noqa: SIM115 (closed by communicate)
        self.stderr = _Later(self._stderr, self._thread)

    def poll(self) -> int | None:
        return None if self._thread.is_alive() else self._code()

    def wait(self, timeout: float | None = None) -> int:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self._code()

    def send_signal(self, signum: int) -> None:
        if self._thread.is_alive():  # not reaped: the pid is still this child's
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Close its stdin, read the rest of its stdout, wait for its end: (stdout, stderr)."""
        out = ""
        if self.stdin is not None and self.stdout is not None:
            with contextlib.suppress(BrokenPipeError):
                self.stdin.close()
            out = self.stdout.read()
            self.stdout.close()
        self.wait(timeout)
        err = self.stderr.read()
        shutil.rmtree(self._directory, ignore_errors=True)
        return out, err

    def _code(self) -> int:
        if self._error is not None:
            raise AssertionError(f"the fork server could not run {self.args}: {self._error!r}")
        assert self.returncode is not None
        return self.returncode


class _Later:
    """A child's stderr, read from its file once it has ended (a moment at most)."""

    def __init__(self, path: Path, thread: threading.Thread) -> None:
        self._path, self._thread = path, thread

    def read(self) -> str:
        self._thread.join(5)
        return self._path.read_text(errors="replace") if self._path.exists() else ""


# Each program's servers (one at first, one more whenever all run a child at once), started
# as this process first needs them and kept until it ends.
_pools: dict[str, list[Server]] = {}
_scratches: list[str] = []  # this process's directory of Popen's pipes and files, once made
_taken: set[Server] = set()  # running a child, or about to: each runs one at a time
_pools_guard = threading.Lock()


def _idle_server(program: str) -> Server:
    """A server of ``program`` that runs no child now (one more if all do), taken."""
    with _pools_guard:
        pool = _pools.setdefault(program, [])
        idle = [s for s in pool if s not in _taken and s.process.poll() is None]
        server = idle[0] if idle else _start(program)
        if not idle:
            pool.append(server)
        _taken.add(server)
        return server


def _give_back(server: Server) -> None:
    with _pools_guard:
        _taken.discard(server)


def _scratch() -> str:
    with _pools_guard:
        if not _scratches:
            _scratches.append(tempfile.mkdtemp(prefix="sqllocker-forked-"))
        return _scratches[0]


def _start(program: str) -> Server:
    return Server.start([sys.executable, "-m", "tests.forked_cli", program], cwd=REPO)


def _stop() -> None:
    for pool in _pools.values():
        for server in pool:
            server.kill()  # its children die with it
    for directory in _scratches:
        shutil.rmtree(directory, ignore_errors=True)


atexit.register(_stop)


def _sqllocker() -> Callable[[list[str]], None]:
    from sqllocker.cli import main

    preloading.backends()

    def run(argv: list[str]) -> None:
        sys.argv = ["sqllocker", *argv]
        main(argv)

    return run


# Imported by every command of tests/django_project, none reading the settings as it is imported
# (MySQL's backend is not among them: it needs the settings' PyMySQL in place of MySQLdb).
_DJANGO_PRELOADED = (
    "django.core.management.commands.migrate",
    "django.db.backends.postgresql.base",
    "django.db.backends.sqlite3.base",
    "django.db.migrations.autodetector",
    "django.db.migrations.executor",
    "django.db.models",
    "django.views.generic",
)


def _django() -> Callable[[list[str]], None]:
    import django.core.management

    # Imported once: the settings ask for the app, whose commands run the command line.
    import sqllocker.cli
    import sqllocker.django  # noqa: F401

    preloading.backends()
    for module in _DJANGO_PRELOADED:  # what every command of the test project imports
        importlib.import_module(module)

    def run(argv: list[str]) -> None:
        django.core.management.execute_from_command_line(["python -m django", *argv])

    return run


def _campaign() -> Callable[[list[str]], None]:
    import tests.campaign.campaign  # noqa: F401
    from tests.campaign import processes

    processes.preload("sqlite", "postgresql", "mysql")

    def run(argv: list[str]) -> None:
        run_module(["-m", "tests.campaign", *argv])

    return run


def _workers() -> Callable[[list[str]], None]:
    import tests.workers

    preloading.backends()

    def run(argv: list[str]) -> None:
        sys.argv = ["python -m tests.workers", *argv]
        raise SystemExit(tests.workers.main(argv))

    return run


def _python() -> Callable[[list[str]], None]:
    import sqllocker
    import sqllocker.asyncio  # noqa: F401

    preloading.backends()

    def run(argv: list[str]) -> None:
        if len(argv) < 2 or argv[0] != "-c":
            raise SystemExit(f"forked python: not -c PROGRAM [ARGS...]: {argv}")
        sys.argv = ["-c", *argv[2:]]
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})

    return run


def _apscheduler() -> Callable[[list[str]], None]:
    import tests.apscheduler_worker  # noqa: F401

    preloading.backends()

    def run(argv: list[str]) -> None:
        run_module(["-m", "tests.apscheduler_worker", *argv])

    return run


# What a Celery worker or beat of tests/celery_app.py imports, none reading the app's settings.
_CELERY_PRELOADED = (
    "celery.apps.beat",
    "celery.apps.worker",
    "celery.bin.celery",
    "celery.concurrency.prefork",
    "kombu.transport.redis",
    "redis",
    "sqllocker.celery",
)


def _celery() -> Callable[[list[str]], None]:
    for module in _CELERY_PRELOADED:
        importlib.import_module(module)
    preloading.backends()

    def run(argv: list[str]) -> None:
        os.setsid()  # a session and a process group of its own, as start_new_session gives
        run_module(["-m", "celery", *argv])

    return run


_PROGRAMS = {
    "sqllocker": _sqllocker,
    "django": _django,
    "campaign": _campaign,
    "workers": _workers,
    "python": _python,
    "apscheduler": _apscheduler,
    "celery": _celery,
}


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt, BrokenPipeError):
        serve(_PROGRAMS[sys.argv[1]](), Channel(0, 1))
