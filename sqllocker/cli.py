"""The ``sqllocker`` command: cron's purge job, running commands under a lock, and inspection.

Every command works on the embedded SQLite default with no set-up, and on a server given
``--url`` or ``$SQLLOCKER_URL``. Errors are one line on stderr and exit 1; usage errors exit 2.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo

import click

from . import __version__
from .adoption import check_zone
from .cli_waits import FOREVER, wait_seconds
from .defaults import DEFAULT_GRACE, DEFAULT_PURGE_BATCH, DEFAULT_PURGE_PAUSE_RATIO
from .engine import URL_ENVIRONMENT_VARIABLE, create_locker_engine, describe_url, resolve_url
from .errors import ForeignTable, LockError, describe_holder, one_line, printable
from .exporter import (
    DEFAULT_MAX_SERIES,
    DEFAULT_SCRAPE_TIMEOUT,
    ExporterOptions,
    parse_listen,
    serve,
)
from .locker import Locker, LockInfo
from .row_kinds import kind_of
from .runner import DEFAULT_KILL_AFTER, EXIT_LOCK_LOST, ON_LOST_CHOICES, RunOptions, run_locked
from .schema import DEFAULT_TABLE, FOREIGN_CLOCK_MARGIN
from .telemetry import default_name
from .trace_context import joined_trace
from .validation import check_table_name

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "show_default": True}


class _Settings:
    def __init__(self, url: str | None, table: str, transaction_pooling: bool) -> None:
        self.url = url
        self.table = table
        self.transaction_pooling = transaction_pooling
        self._locker: Locker | None = None

    def locker(self, **options: Any) -> Locker:
        if self._locker is None:
            self._locker = Locker(
                self.url,
                table=self.table,
                transaction_pooling=self.transaction_pooling,
                **options,
            )
        return self._locker


pass_settings = click.make_pass_decorator(_Settings)


@click.group(context_settings=CONTEXT_SETTINGS)
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
    context.obj = _Settings(url or None, table, transaction_pooling)


# -- purge-expired --------------------------------------------------------------------------------


@cli.command("purge-expired")
@click.option(
    "--batch-size",
    type=click.IntRange(min=1),
    default=DEFAULT_PURGE_BATCH,
    help="Rows deleted per transaction.",
)
@click.option(
    "--pause-ratio",
    type=click.FloatRange(min=0),
    default=DEFAULT_PURGE_PAUSE_RATIO,
    show_default=True,
    help="After each batch, rest this many times as long as it took (0: flat out).",
)
@click.option(
    "--grace",
    type=click.FloatRange(min=0),
    default=DEFAULT_GRACE,
    help="Leave rows that expired less than this many seconds ago. The table does not record "
    "the grace its Lockers use (each process sets its own): give the largest of theirs, so that "
    "no row is purged sooner than a Locker would take it over. The default is Locker's.",
)
@click.option("--dry-run", is_flag=True, help="Print what would be purged; delete nothing.")
@click.option("--json", "as_json", is_flag=True, help='Print {"purged": N} (or what would go).')
@click.option("-v", "--verbose", is_flag=True, help="Print how many rows were purged.")
@pass_settings
def purge_expired(
    settings: _Settings,
    batch_size: int,
    pause_ratio: float,
    grace: float,
    dry_run: bool,
    as_json: bool,
    verbose: bool,
) -> None:
    """Delete expired locks, in batches: the job to run from cron.

    Only rows expired by the database server's clock are deleted; a live lock is never touched,
    whatever this machine's clock or time zone says. On PostgreSQL it also deletes the tickets
    left by waiters whose process died. Prints nothing on success unless asked.
    """
    locker = settings.locker(grace=grace)
    if dry_run:
        doomed = locker.expired_locks()
        if as_json:
            _print_json({"would_purge": len(doomed), "locks": [_info_json(i) for i in doomed]})
        else:
            for info in doomed:
                click.echo(
                    f"would purge {info.lockstring!r} (id {info.lock_id}), "
                    f"expired {_when(info.expires)}, held by {describe_holder(info.locked_by)}"
                )
            click.echo(f"{len(doomed)} expired lock(s) would be purged")
        return
    purged = locker.purge_expired_locks(batch_size=batch_size, pause_ratio=pause_ratio)
    if as_json:
        _print_json({"purged": purged})
    elif verbose:
        click.echo(f"purged {purged} expired lock(s)")


# -- list / show ----------------------------------------------------------------------------------


@cli.command("list")
@click.argument("pattern", required=False)
@click.option("--json", "as_json", is_flag=True, help="A JSON array of objects.")
@click.option("--expired", "expired_only", is_flag=True, help="Only expired (not yet purged) rows.")
@pass_settings
def list_locks(settings: _Settings, pattern: str | None, as_json: bool, expired_only: bool) -> None:
    """List locks, optionally those matching PATTERN (a glob: * and ? are wildcards)."""
    infos = settings.locker().locks(pattern)
    if expired_only:
        infos = [info for info in infos if info.expired]
    if as_json:
        _print_json([_info_json(info) for info in infos])
        return
    header = ("LOCKSTRING", "KIND", "ID", "HOLDER", "PROGRAM", "CREATED", "EXPIRES", "LEFT")
    rows = [
        (
            printable(info.lockstring),
            kind_of(info.lockstring, info.locked_by),
            str(info.lock_id),
            printable(f"{info.locked_by.get('host', '?')}:{info.locked_by.get('pid', '?')}"),
            printable(info.locked_by.get("program", "")),
            _when(info.created) + ("!" if info.created_in_future else ""),
            _when(info.expires) + ("*" if info.dbix_locker else ""),
            "expired" if info.expired else _duration(info.seconds_left),
        )
        for info in infos
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        click.echo(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        )
    flagged = (any(i.created_in_future for i in infos), any(i.dbix_locker for i in infos))
    for note, applies in zip(ROW_NOTES, flagged, strict=True):
        if applies:
            click.echo(note)


@cli.command()
@click.argument("lockstring")
@click.option("--json", "as_json", is_flag=True, help="A JSON object.")
@pass_settings
def show(settings: _Settings, lockstring: str, as_json: bool) -> None:
    """Show one lock in detail; exit 1 if nobody holds LOCKSTRING."""
    info = settings.locker().lock_info(lockstring)
    if info is None:
        if as_json:
            _print_json(None)
        else:
            click.echo(f"sqllocker: lock {lockstring!r} is not held", err=True)
        sys.exit(1)
    if as_json:
        _print_json(_info_json(info))
        return
    state = "expired" if info.expired else f"held, {_duration(info.seconds_left)} left"
    click.echo(f"lockstring: {printable(info.lockstring)}")
    click.echo(f"kind:       {kind_of(info.lockstring, info.locked_by)}")
    click.echo(f"lock id:    {info.lock_id}")
    click.echo(f"state:      {state}")
    click.echo(f"holder:     {describe_holder(info.locked_by)}")
    click.echo(f"created:    {_when(info.created)}" + ("!" if info.created_in_future else ""))
    click.echo(f"expires:    {_when(info.expires)}" + ("*" if info.dbix_locker else ""))
    for note, applies in zip(ROW_NOTES, (info.created_in_future, info.dbix_locker), strict=True):
        if applies:
            click.echo(note)
    for key, value in sorted(info.locked_by.items()):
        shown = value if isinstance(value, str) else json.dumps(value)
        click.echo(f"  {printable(key)}: {printable(shown)}")


# -- leader ---------------------------------------------------------------------------------------


@cli.command()
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print the leader as JSON (null if none).")
@pass_settings
def leader(settings: _Settings, name: str, as_json: bool) -> None:
    """Print who leads the election NAME (the holder of its lock, e.g. a `run --standby NAME`):
    host, pid, program, since when and its term (fencing token). Exit status 1 if none."""
    current = settings.locker().election(name).leader()
    if as_json:
        _print_json(
            None
            if current is None
            else {
                "host": current.host,
                "pid": current.pid,
                "program": current.program,
                "since": current.since.isoformat(),
                "term": current.term,
            }
        )
    elif current is None:
        click.echo(f"sqllocker: election {name!r} has no leader", err=True)
    else:
        click.echo(f"host:    {printable(str(current.host))}")
        click.echo(f"pid:     {current.pid}")
        click.echo(f"program: {printable(str(current.program))}")
        click.echo(f"since:   {_when(current.since)}")
        click.echo(f"term:    {current.term}")
    if current is None:
        sys.exit(1)


# -- release --------------------------------------------------------------------------------------


@cli.command()
@click.argument("lockstring")
@click.option("--force", is_flag=True, help="Required: you know the holder is dead.")
@click.option("--id", "lock_id", type=int, help="Break only this acquisition (lock id).")
@pass_settings
def release(settings: _Settings, lockstring: str, force: bool, lock_id: int | None) -> None:
    """Break LOCKSTRING's lock, whoever holds it (for holders known to be dead).

    The holder is not told until it next extends or releases, when it gets LockLost; meanwhile
    someone else may take the lock. Prefer waiting for the lock to expire.
    """
    if not force:
        raise click.UsageError(
            f"refusing to break lock {lockstring!r} without --force: its holder may be alive"
        )
    broken = settings.locker().break_lock(lockstring, lock_id=lock_id)
    if broken is None:
        which = f" with id {lock_id}" if lock_id is not None else ""
        click.echo(f"sqllocker: lock {lockstring!r}{which} is not held", err=True)
        sys.exit(1)
    click.echo(
        f"broke lock {lockstring!r} (id {broken.lock_id}) "
        f"held by {describe_holder(broken.locked_by)}"
    )


# -- run ------------------------------------------------------------------------------------------


@cli.command(context_settings={"ignore_unknown_options": False})
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
    default=1,
    help="Exit status when the lock is held by someone else.",
)
@click.option(
    "--expires",
    type=click.FloatRange(min=0, min_open=True),
    default=60.0,
    help="Expiry period; renewed every third of it while the command runs.",
)
@click.option("-q", "--quiet", is_flag=True, help="Say nothing when the lock is held.")
@click.option(
    "--hold-at-least",
    type=click.FloatRange(min=0, min_open=True),
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
    type=click.FloatRange(min=0),
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
    settings: _Settings,
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
    is returned (128+N if it died of signal N); INT, TERM, HUP and QUIT are passed on to its
    process group (a Ctrl-C typed at the terminal reaches it directly, once); the lock is
    released when it ends.

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
        record_args=record_args,
    )
    with joined_trace(default_name(lockstring)):
        status = run_locked(settings.locker(), lockstring, command, options)
    sys.exit(status)


# -- top ----------------------------------------------------------------------------------------


@cli.command()
@click.argument("pattern", required=False)
@click.pass_context
def top(context: click.Context, pattern: str | None) -> None:
    """Watch the held locks live, oldest first, refreshed every second; q quits.

    Shows each lock's holder, how long it has been held, how long until it expires (in red
    when close), its queued waiters, and the expired rows not yet purged; only lockstrings
    matching PATTERN (a glob) with one. Needs pip install 'sqllocker[top]'. When stdout is
    not a terminal it prints what `list` prints, once.
    """
    if not (sys.stdout.isatty() and sys.stdin.isatty()):
        context.invoke(list_locks, pattern=pattern, as_json=False, expired_only=False)
        return
    from .top import run_top

    settings = context.find_object(_Settings)
    assert settings is not None
    run_top(settings.locker(), pattern)


# -- exporter -------------------------------------------------------------------------------------


@cli.command()
@click.option(
    "--listen",
    default="127.0.0.1:9464",
    metavar="HOST:PORT",
    help="Where to serve /metrics (0.0.0.0:PORT: every address).",
)
@click.option(
    "--per-lock",
    metavar="GLOB",
    help="Also give each lockstring matching GLOB series of its own (label lockstring).",
)
@click.option(
    "--max-series",
    type=click.IntRange(min=1),
    default=DEFAULT_MAX_SERIES,
    help="At most this many lockstrings get series of their own (the first, in order).",
)
@click.option(
    "--scrape-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=DEFAULT_SCRAPE_TIMEOUT,
    metavar="SECONDS",
    help="A scrape whose census of the table takes longer answers sqllocker_up 0 (keep it "
    "below Prometheus's scrape_timeout).",
)
@pass_settings
def exporter(
    settings: _Settings, listen: str, per_lock: str | None, max_series: int, scrape_timeout: float
) -> None:
    """Serve the lock table as Prometheus metrics, read from the database on each scrape.

    Needs pip install 'sqllocker[exporter]'. Run it as a role that may only read (see the
    Observability page for its grants). A scrape that cannot reach the database answers
    sqllocker_up 0.
    """
    host, port = parse_listen(listen)
    options = ExporterOptions(
        table=check_table_name(settings.table),
        per_lock=per_lock,
        max_series=max_series,
        timeout=scrape_timeout,
    )
    engine = create_locker_engine(
        resolve_url(settings.url), transaction_pooling=settings.transaction_pooling
    )
    serve(engine, options, host, port)


# -- migrate --------------------------------------------------------------------------------------


@cli.command()
@click.option(
    "--sql",
    "print_sql",
    is_flag=True,
    help="Print the DDL instead of applying it (for DBAs who apply it themselves).",
)
@click.option("--check", is_flag=True, help="Exit 1 if the database is behind; change nothing.")
@click.option(
    "--adopt-dbix-locker",
    "adopt",
    is_flag=True,
    help="Convert the DBIx::Locker table of this name into sqllocker's, keeping its rows "
    "(needs --perl-tz; with --sql, print the conversion with the rows as they are now).",
)
@click.option(
    "--perl-tz",
    metavar="ZONE",
    help="With --adopt-dbix-locker: the time zone the Perl processes ran in (e.g. "
    "America/New_York); DBIx::Locker wrote its times in it.",
)
@click.option(
    "--exact-lockstrings",
    is_flag=True,
    help='With --adopt-dbix-locker, MySQL/MariaDB: compare lockstrings exactly ("Foo" and '
    '"foo" two locks) instead of by the table\'s case-folding collation.',
)
@pass_settings
def migrate(
    settings: _Settings,
    print_sql: bool,
    check: bool,
    adopt: bool,
    perl_tz: str | None,
    exact_lockstrings: bool,
) -> None:
    """Create or upgrade the lock table (and its `<table>_held` view), or adopt a DBIx::Locker
    table."""
    from . import migrations

    locker = settings.locker(auto_create=False)
    if adopt:
        if check:
            raise click.UsageError("--check and --adopt-dbix-locker contradict each other")
        if perl_tz is None:
            raise click.UsageError(
                "--adopt-dbix-locker needs --perl-tz ZONE: the time zone DBIx::Locker wrote "
                "its times in (the Perl processes' TZ; UTC if they ran with TZ=UTC)"
            )
        _adopt(locker, check_zone(perl_tz), exact_lockstrings, print_sql)
        return
    if perl_tz is not None or exact_lockstrings:
        raise click.UsageError("--perl-tz and --exact-lockstrings go with --adopt-dbix-locker")
    if print_sql:
        click.echo(migrations.upgrade_sql(locker.url, locker.table_name), nl=False)
        return
    with _one_line_errors(f"migration of {describe_url(locker.url)}"):
        current = migrations.current_revision(locker.engine, locker.table_name)
        if check:
            # `sqllocker migrate` would refuse such a table: the adoption is what it needs.
            reason = migrations.foreign_reason(locker.engine, locker.table_name)
            if reason is not None:
                raise ForeignTable.naming(locker.table_name, describe_url(locker.url), reason)
            head = migrations.head_revision()
            if current != head:
                click.echo(
                    f"sqllocker: {locker.table_name!r} in {describe_url(locker.url)} is at "
                    f"revision {current or 'none'}, behind {head}; run `sqllocker --url URL "
                    f"--table {locker.table_name} migrate`",
                    err=True,
                )
                sys.exit(1)
            click.echo(f"{locker.table_name} is up to date (revision {head})")
            return
        migrations.upgrade(locker.engine, locker.table_name)
    head = migrations.head_revision()
    if current != head:
        click.echo(f"migrated {locker.table_name} from {current or 'nothing'} to revision {head}")


@contextmanager
def _one_line_errors(what: str) -> Iterator[None]:
    """alembic's and the driver's errors as one line (a LockError), not a traceback."""
    try:
        yield
    except LockError:
        raise
    except Exception as error:
        raise LockError(f"{what} failed: {one_line(error)}") from error


def _adopt(locker: Locker, perl_tz: ZoneInfo, exact_lockstrings: bool, print_sql: bool) -> None:
    from . import migrations

    table = locker.table_name
    with _one_line_errors(f"adoption of {table!r} in {describe_url(locker.url)}"):
        if print_sql:
            sql = migrations.adoption_sql(locker.engine, table, perl_tz, exact_lockstrings)
            click.echo(sql, nl=False)
            return
        rows = migrations.adopt_dbix_locker(locker.engine, table, perl_tz, exact_lockstrings)
    click.echo(
        f"adopted {table} with its {rows} row{'s' if rows != 1 else ''} (times read as "
        f"{perl_tz.key}); its rows written by DBIx::Locker are taken over or purged only once "
        "expired in every time zone"
    )


# -- helpers --------------------------------------------------------------------------------------


def _when(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{seconds:02d}s" if hours else f"{minutes}m{seconds:02d}s"


# What `list` and `show` mark with "!" and "*".
ROW_NOTES = (
    "! created in the future by the database's clock: written from a client's clock in another "
    "time zone (DBIx::Locker writes local times)",
    f"* written by DBIx::Locker, in its client's local time: taken over or purged only "
    f"{FOREIGN_CLOCK_MARGIN // 3600} hours "
    "after this expiry, once past in every time zone",
)


def _info_json(info: LockInfo) -> dict[str, Any]:
    return {
        "lockstring": info.lockstring,
        "kind": kind_of(info.lockstring, info.locked_by),
        "lock_id": info.lock_id,
        "created": info.created.isoformat(),
        "expires": info.expires.isoformat(),
        "expired": info.expired,
        "seconds_left": round(info.seconds_left, 3),
        "locked_by": info.locked_by,
        "dbix_locker": info.dbix_locker,
        "created_in_future": info.created_in_future,
    }


def _print_json(value: object) -> None:
    click.echo(json.dumps(value, indent=2, sort_keys=True))


def main(argv: Sequence[str] | None = None) -> None:
    """The console script: LockErrors become one line on stderr and exit status 1."""
    try:
        cli.main(args=argv, prog_name="sqllocker", standalone_mode=False)
    except click.exceptions.Exit as done:
        sys.exit(done.exit_code)
    except click.ClickException as error:
        error.show()
        sys.exit(error.exit_code)
    except click.exceptions.Abort:
        click.echo("sqllocker: aborted", err=True)
        sys.exit(130)
    except LockError as error:
        click.echo(f"sqllocker: error: {error}", err=True)
        sys.exit(1)


__all__ = ["EXIT_LOCK_LOST", "cli", "main"]

if __name__ == "__main__":  # python -m sqllocker.cli, as the console script
    main()
