"""The ``sqllocker`` console script (or Django's ``python -m django``, or a fault campaign's
``python -m tests.campaign``), each run forked from one server that imported it once
(``fork_server.py``).

``python -m tests.forked_cli PROGRAM`` imports the program (``sqllocker``: ``sqllocker.cli``,
that is SQLAlchemy, click and the library, half a second of CPU per interpreter, far more on a
loaded machine; ``django``: Django's command line and the library, settings unread;
``campaign``: the campaign, what its processes run and every backend's drivers), then
serves requests on its stdin and stdout, forking one child per request that runs the program
with the request's ``argv`` as its console script does. Nothing is connected or configured
before the fork; the children die with the server (``PR_SET_PDEATHSIG``).

:func:`run` starts one server of each program per process that calls it (an xdist worker),
and runs a command through it, for the tests whose claim is what a command does, not how it
starts.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from tests import preloading
from tests.fork_server import REPO, Channel, Server, run_module, serve

_servers: dict[str, Server] = {}
_guard = threading.Lock()


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
    with _guard, tempfile.TemporaryDirectory(prefix="sqllocker-cli-") as directory:
        server = _servers.get(program)
        if server is None or server.process.poll() is not None:
            server = _servers[program] = Server.start(
                [sys.executable, "-m", "tests.forked_cli", program], cwd=REPO
            )
        out, err = Path(directory, "out"), Path(directory, "err")
        files = (os.devnull, str(out), str(err))
        try:
            code = server.run(argv, program, env, cwd, files, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise subprocess.TimeoutExpired([program, *argv], timeout) from None
        return subprocess.CompletedProcess([program, *argv], code, out.read_text(), err.read_text())


def _stop() -> None:
    for name in list(_servers):
        _servers.pop(name).kill()  # its children die with it


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


_PROGRAMS = {"sqllocker": _sqllocker, "django": _django, "campaign": _campaign}


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt, BrokenPipeError):
        serve(_PROGRAMS[sys.argv[1]](), Channel(0, 1))
