"""The ``sqllocker`` command: cron's purge job, running commands under a lock, and inspection.

Every command works on the embedded SQLite default with no set-up (``run`` and ``migrate`` make
its file; the others make nothing), and on a server given ``--url`` or ``$SQLLOCKER_URL``.

Exit statuses are grep's (``sqllocker.exit_statuses``): 0 the positive answer, or done; 1 the
negative answer only (not held, no leader, behind, busy); 2 any error, a usage error or one that
kept the command from answering, said in one line on stderr.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any

import click

from .cli_common import CONTEXT_SETTINGS, Settings
from .cli_inspect import leader, list_locks, purge_expired, release, show
from .cli_migrate import migrate
from .cli_run import run
from .cli_serve import exporter, top
from .engine import URL_ENVIRONMENT_VARIABLE
from .errors import LockError
from .exit_statuses import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_LOCK_LOST
from .schema import DEFAULT_TABLE
from .version import __version__


class OutputClosed(Exception):
    """What the command wrote to could not be written: the reader has gone (``| head``)."""


class _Commands(click.Group):
    """The commands, a broken pipe raised as ``OutputClosed`` (click's own handler for it exits
    1, which is the negative answer), the group's own ``--help`` and ``--version`` included."""

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except BrokenPipeError as error:
            raise OutputClosed() from error

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except BrokenPipeError as error:
            raise OutputClosed() from error


@click.group(
    cls=_Commands,
    context_settings=CONTEXT_SETTINGS,
    epilog="Exit status: 0 yes, or done; 1 no (show, release: not held; leader: nobody leads; "
    "migrate --check: behind; run: held by someone else); 2 an error, no answer (the database "
    "unreachable, the table missing, a bad argument). run returns COMMAND's otherwise.",
)
@click.option(
    "--url",
    envvar=URL_ENVIRONMENT_VARIABLE,
    show_envvar=True,
    help="Database URL (postgres://, mysql://, sqlite:///PATH) [default: sqlite:///sqllocker.db]",
)
@click.option(
    "--table",
    default=DEFAULT_TABLE,
    envvar="SQLLOCKER_TABLE",
    show_envvar=True,
    help="Name of the lock table.",
)
@click.option(
    "--transaction-pooling",
    is_flag=True,
    envvar="SQLLOCKER_TRANSACTION_POOLING",
    show_envvar=True,
    help="PostgreSQL is reached through a transaction-pooling PgBouncer: send no session "
    "settings, prepare nothing, and wait by retrying.",
)
@click.version_option(__version__, "--version", prog_name="sqllocker")
@click.pass_context
def cli(context: click.Context, url: str | None, table: str, transaction_pooling: bool) -> None:
    """Distributed locks kept as rows in an SQL table."""
    logging.basicConfig(level=logging.WARNING, format="sqllocker: %(message)s")
    context.obj = Settings(url or None, table, transaction_pooling)


for command in (purge_expired, list_locks, show, leader, release, run, top, exporter, migrate):
    cli.add_command(command)


def main(argv: Sequence[str] | None = None) -> None:
    """The console script: an error that kept the command from answering (a LockError, a usage
    error) is one line on stderr and exit status 2, never 1: that is the negative answer; so is
    output nobody reads any longer (``| head``), said nowhere, as grep's SIGPIPE."""
    # What is imported by now lives as long as the process: no collection of the garbage
    # collector's, nor the last one at exit, need go through it again.
    gc.freeze()
    try:
        answer(argv)
    except OutputClosed:
        # What is left in a buffer goes nowhere at exit (not an error and exit status 120).
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.dup2(devnull, sys.stderr.fileno())
        sys.exit(EXIT_ERROR)


def answer(argv: Sequence[str] | None) -> None:
    """The command line on ``argv``, in this process (``manage.py sqllocker``): exits
    (``SystemExit``) with its status, an error said in one line on stderr; ``OutputClosed`` if
    stdout's or stderr's reader has gone, the process's streams left as they are."""
    try:
        _answer(argv)
    except BrokenPipeError as error:  # an error said to a closed stderr
        raise OutputClosed() from error


def _answer(argv: Sequence[str] | None) -> None:
    try:
        cli.main(args=argv, prog_name="sqllocker", standalone_mode=False)
    except click.exceptions.Exit as done:
        sys.exit(done.exit_code)
    except click.ClickException as error:
        error.show()
        sys.exit(EXIT_ERROR)
    except click.exceptions.Abort:
        click.echo("sqllocker: aborted", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except LockError as error:
        click.echo(f"sqllocker: error: {error}", err=True)
        sys.exit(EXIT_ERROR)
    except OutputClosed:
        raise
    except BrokenPipeError as error:  # said to a closed stdout outside any command (completion)
        raise OutputClosed() from error
    except Exception:
        # A bug of ours: its traceback, to report, and not the status of a negative answer.
        traceback.print_exc()
        sys.exit(EXIT_ERROR)


__all__ = ["EXIT_LOCK_LOST", "OutputClosed", "answer", "cli", "main"]

if __name__ == "__main__":  # python -m sqllocker.cli, as the console script
    main()
