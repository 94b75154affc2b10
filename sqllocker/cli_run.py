"""The command line's ``run``: a command run under a lock (see ``sqllocker.runner``)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import click

from .cli_common import (
    Settings,
    pass_settings,
)
from .cli_waits import FOREVER, POSITIVE_SECONDS, SECONDS, wait_seconds
from .engine import URL_ENVIRONMENT_VARIABLE
from .exit_statuses import EXIT_NO
from .runner import DEFAULT_KILL_AFTER, ON_LOST_CHOICES, RunOptions, run_locked
from .telemetry import default_name
from .trace_context import joined_trace

# -- run ------------------------------------------------------------------------------------------


class _RunCommand(click.Command):
    """``run``, whose options end where COMMAND begins, ``--`` or not, as flock(1)'s do: in
    ``sqllocker run job ./report --shared``, ``--shared`` is the report's (click would take
    it as run's own, the run a reader of the name beside other readers)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        start = _command_start(args, self._valued())
        if start is not None:
            args = [*args[:start], "--", *args[start:]]
        return super().parse_args(ctx, args)

    def _valued(self) -> set[str]:
        """The option strings of run's that take a value (the next word, if not attached)."""
        return {
            name
            for param in self.params
            if isinstance(param, click.Option) and not param.is_flag and not param.count
            for name in param.opts
        }


def _command_start(args: list[str], valued: set[str]) -> int | None:
    """Where COMMAND's first word is in ``args`` (the second word that is neither an option nor
    an option's value: the first is LOCKSTRING), or None: none, or a ``--`` before it, which
    says where COMMAND begins itself (one after it is COMMAND's own)."""
    words = 0
    index = 0
    while index < len(args):
        word = args[index]
        index += 1
        if word == "--":
            return None
        if word.startswith("--"):
            index += word in valued  # ``--wait 10``; ``--wait=10`` holds its value
        elif word.startswith("-") and word != "-":
            # A cluster of short flags, the last of which may take the next word (``-qw 10``),
            # or a short option with its value attached (``-w10``).
            for position, letter in enumerate(word[1:], start=1):
                if f"-{letter}" in valued:
                    index += position == len(word) - 1
                    break
        else:
            words += 1
            if words == 2:
                return index - 1
    return None


@click.command(cls=_RunCommand, context_settings={"ignore_unknown_options": False})
@click.argument("lockstring")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.option(
    "-n", "--nonblock", is_flag=True, help="Fail at once if the lock is held (the default)."
)
@click.option(
    "-w",
    "--wait",
    callback=wait_seconds,
    default=None,
    metavar="SECONDS|forever",
    help="Wait up to SECONDS for the lock instead (forever: without limit).",
)
@click.option(
    "--shared",
    is_flag=True,
    help="Take the read side of LOCKSTRING's read-write lock: any number of --shared runs "
    "together, while a plain run (the write side) runs alone.",
)
@click.option(
    "--standby",
    is_flag=True,
    help="Wait for the lock without limit (as -w forever): a hot standby of COMMAND, which "
    "takes over when the active copy dies or is stopped.",
)
@click.option(
    "-E",
    "--conflict-exit-code",
    type=click.IntRange(0, 255),
    default=EXIT_NO,
    help="Exit status when the lock is held by someone else (errors exit 2).",
)
@click.option(
    "--expires",
    type=POSITIVE_SECONDS,
    default=60.0,
    help="Expiry period; renewed every third of it while the command runs.",
)
@click.option("-q", "--quiet", is_flag=True, help="Say nothing when the lock is held.")
@click.option(
    "--hold-at-least",
    type=POSITIVE_SECONDS,
    default=None,
    metavar="SECONDS",
    envvar="SQLLOCKER_HOLD_AT_LEAST",
    show_envvar=True,
    help="Keep the lock at least this long after taking it, even if COMMAND ends sooner: a job "
    "that cron starts on several machines then runs once per window, however short it is.",
)
@click.option(
    "--on-lost",
    type=click.Choice(ON_LOST_CHOICES),
    default="stop",
    envvar="SQLLOCKER_ON_LOST",
    show_envvar=True,
    help="If the lock is lost while COMMAND runs: stop everything it started (SIGTERM, then "
    "SIGKILL after --kill-after), or only warn.",
)
@click.option(
    "--kill-after",
    type=SECONDS,
    default=DEFAULT_KILL_AFTER,
    metavar="SECONDS",
    help="How long COMMAND has to end after SIGTERM before SIGKILL (0: SIGKILL at once); less "
    "if the lock runs out sooner.",
)
@click.option(
    "--pass-url",
    is_flag=True,
    help=f"Leave ${URL_ENVIRONMENT_VARIABLE} in COMMAND's environment (removed by default: it "
    "may hold a password).",
)
@click.option(
    "--record-args",
    is_flag=True,
    help="Record COMMAND's arguments in the lock's locked_by, not only the program's name "
    "(arguments may hold secrets).",
)
@pass_settings
def run(
    settings: Settings,
    lockstring: str,
    command: Sequence[str],
    nonblock: bool,
    wait: float | None,
    conflict_exit_code: int,
    expires: float,
    quiet: bool,
    hold_at_least: float | None,
    on_lost: str,
    kill_after: float,
    pass_url: bool,
    record_args: bool,
    shared: bool,
    standby: bool,
) -> None:
    """Run COMMAND while holding LOCKSTRING, like flock(1) across machines.

    \b
    sqllocker run "nightly report" -- ./report.sh --full

    Unlike flock(1), which waits by default, this fails at once if the lock is held (as the
    library's lock() does); -w waits. The lock is renewed for as long as COMMAND runs, so
    --expires only bounds how long a crashed sqllocker keeps others out. COMMAND's exit status
    is returned (128+N if it died of signal N); 1 (-E) if the lock is held by someone else, 2
    on an error (the database unreachable, say), COMMAND not run. INT, TERM, HUP and QUIT are
    passed on to its process group (a Ctrl-C typed at the terminal reaches it directly, once);
    the lock is released when it ends.

    It fails closed: a watchdog starts COMMAND and keeps all it starts in its family (on Linux,
    daemons that leave the process group too). If the lock is lost while it runs (broken, or
    not renewable before its deadline, which comes before anyone else can take it), the whole
    family is stopped (see --on-lost) and the exit status is 75; if sqllocker itself is killed,
    or stopped past the lock's deadline, the watchdog stops the family itself. What COMMAND
    leaves running when it ends is stopped before the lock is released. COMMAND sees the
    lock's fencing token in $SQLLOCKER_LOCK_ID, and not the database URL (see --pass-url).
    """
    if nonblock and (wait is not None or standby):
        raise click.UsageError("--nonblock and --wait or --standby contradict each other")
    if standby and wait is not None and wait != FOREVER:
        raise click.UsageError("--standby waits forever: it takes no --wait")
    options = RunOptions(
        wait=None if standby or wait == FOREVER else (wait or 0),
        shared=shared,
        expires=expires,
        conflict_exit_code=conflict_exit_code,
        quiet=quiet,
        hold_at_least=hold_at_least,
        on_lost=on_lost,
        kill_after=kill_after,
        pass_url=pass_url,
        names_database=settings.url is not None,
        record_args=record_args,
    )
    settings.shared_database()
    with joined_trace(default_name(lockstring)):
        status = run_locked(settings.locker(), lockstring, command, options)
    sys.exit(status)
