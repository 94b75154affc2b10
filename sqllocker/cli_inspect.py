"""The command line's inspection and clean-up: ``list``, ``show``, ``leader``, ``release``
(breaking a dead holder's lock) and ``purge-expired``, cron's job."""

from __future__ import annotations

import json
import sys

import click

from .cli_common import (
    ROW_NOTES,
    Settings,
    info_json,
    pass_settings,
    print_json,
    time_left,
    when,
)
from .cli_waits import SECONDS
from .defaults import DEFAULT_GRACE, DEFAULT_PURGE_BATCH, DEFAULT_PURGE_PAUSE_RATIO
from .errors import describe_holder, printable
from .exit_statuses import EXIT_NO
from .row_kinds import kind_of

# -- purge-expired --------------------------------------------------------------------------------


@click.command("purge-expired")
@click.option(
    "--batch-size",
    type=click.IntRange(min=1),
    default=DEFAULT_PURGE_BATCH,
    help="Rows deleted per transaction.",
)
@click.option(
    "--pause-ratio",
    type=SECONDS,
    default=DEFAULT_PURGE_PAUSE_RATIO,
    show_default=True,
    help="After each batch, rest this many times as long as it took (0: flat out).",
)
@click.option(
    "--grace",
    type=SECONDS,
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
    settings: Settings,
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
    locker = settings.locker(creates=False, grace=grace)
    if dry_run:
        doomed = locker.expired_locks()
        if as_json:
            print_json({"would_purge": len(doomed), "locks": [info_json(i) for i in doomed]})
        else:
            for info in doomed:
                click.echo(
                    f"would purge {info.lockstring!r} (id {info.lock_id}), "
                    f"expired {when(info.expires)}, held by {describe_holder(info.locked_by)}"
                )
            click.echo(f"{len(doomed)} expired lock(s) would be purged")
        return
    purged = locker.purge_expired_locks(batch_size=batch_size, pause_ratio=pause_ratio)
    if as_json:
        print_json({"purged": purged})
    elif verbose:
        click.echo(f"purged {purged} expired lock(s)")


# -- list / show ----------------------------------------------------------------------------------


@click.command("list")
@click.argument("pattern", required=False)
@click.option("--json", "as_json", is_flag=True, help="A JSON array of objects.")
@click.option("--expired", "expired_only", is_flag=True, help="Only expired (not yet purged) rows.")
@pass_settings
def list_locks(settings: Settings, pattern: str | None, as_json: bool, expired_only: bool) -> None:
    """List locks, optionally those matching PATTERN (a glob: * and ? are wildcards)."""
    infos = settings.locker(creates=False).locks(pattern)
    if expired_only:
        infos = [info for info in infos if info.expired]
    if as_json:
        print_json([info_json(info) for info in infos])
        return
    header = ("LOCKSTRING", "KIND", "ID", "HOLDER", "PROGRAM", "CREATED", "EXPIRES", "LEFT")
    rows = [
        (
            printable(info.lockstring),
            kind_of(info.lockstring, info.locked_by),
            str(info.lock_id),
            printable(f"{info.locked_by.get('host', '?')}:{info.locked_by.get('pid', '?')}"),
            printable(info.locked_by.get("program", "")),
            when(info.created) + ("!" if info.created_in_future else ""),
            when(info.expires) + ("*" if info.dbix_locker else ""),
            time_left(info),
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


@click.command()
@click.argument("lockstring")
@click.option("--json", "as_json", is_flag=True, help="A JSON object.")
@pass_settings
def show(settings: Settings, lockstring: str, as_json: bool) -> None:
    """Show one lock in detail; exit status 1 if nobody holds LOCKSTRING (its row, if it has
    one that expired, is shown first), 2 on an error."""
    info = settings.locker(creates=False).lock_info(lockstring)
    if info is None:
        if as_json:
            print_json(None)
        else:
            click.echo(f"sqllocker: lock {lockstring!r} is not held", err=True)
        sys.exit(EXIT_NO)
    if as_json:
        print_json(info_json(info))
        if info.expired:
            sys.exit(EXIT_NO)  # its row expired: nobody holds it
        return
    left = time_left(info)
    state = left if info.expired else f"held, {left} left"
    click.echo(f"lockstring: {printable(info.lockstring)}")
    click.echo(f"kind:       {kind_of(info.lockstring, info.locked_by)}")
    click.echo(f"lock id:    {info.lock_id}")
    click.echo(f"state:      {state}")
    click.echo(f"holder:     {describe_holder(info.locked_by)}")
    click.echo(f"created:    {when(info.created)}" + ("!" if info.created_in_future else ""))
    click.echo(f"expires:    {when(info.expires)}" + ("*" if info.dbix_locker else ""))
    for note, applies in zip(ROW_NOTES, (info.created_in_future, info.dbix_locker), strict=True):
        if applies:
            click.echo(note)
    for key, value in sorted(info.locked_by.items()):
        shown = value if isinstance(value, str) else json.dumps(value)
        click.echo(f"  {printable(key)}: {printable(shown)}")
    if info.expired:
        sys.exit(EXIT_NO)  # its row expired: nobody holds it


# -- leader ---------------------------------------------------------------------------------------


@click.command()
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print the leader as JSON (null if none).")
@pass_settings
def leader(settings: Settings, name: str, as_json: bool) -> None:
    """Print who leads the election NAME (the holder of its lock, e.g. a `run --standby NAME`):
    host, pid, program, since when and its term (fencing token). Exit status 1 if none, 2 on
    an error."""
    current = settings.locker(creates=False).election(name).leader()
    if as_json:
        print_json(
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
        click.echo(f"since:   {when(current.since)}")
        click.echo(f"term:    {current.term}")
    if current is None:
        sys.exit(EXIT_NO)


# -- release --------------------------------------------------------------------------------------


@click.command()
@click.argument("lockstring")
@click.option("--force", is_flag=True, help="Required: you know the holder is dead.")
@click.option("--id", "lock_id", type=int, help="Break only this acquisition (lock id).")
@pass_settings
def release(settings: Settings, lockstring: str, force: bool, lock_id: int | None) -> None:
    """Break LOCKSTRING's lock, whoever holds it (for holders known to be dead).

    The holder is not told until it next extends or releases, when it gets LockLost; meanwhile
    someone else may take the lock. Prefer waiting for the lock to expire. Exit status 1 if
    nobody holds it (nothing to break), 2 on an error.
    """
    if not force:
        raise click.UsageError(
            f"refusing to break lock {lockstring!r} without --force: its holder may be alive"
        )
    broken = settings.locker(creates=False).break_lock(lockstring, lock_id=lock_id)
    if broken is None:
        which = f" with id {lock_id}" if lock_id is not None else ""
        click.echo(f"sqllocker: lock {lockstring!r}{which} is not held", err=True)
        sys.exit(EXIT_NO)
    click.echo(
        f"broke lock {lockstring!r} (id {broken.lock_id}) "
        f"held by {describe_holder(broken.locked_by)}"
    )
