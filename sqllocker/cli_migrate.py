"""The command line's ``migrate``: the table created or upgraded by the shipped migrations, or a
DBIx::Locker table adopted."""

from __future__ import annotations

import sys
from zoneinfo import ZoneInfo

import click

from .adoption import check_zone
from .cli_common import (
    Settings,
    one_line_errors,
    pass_settings,
)
from .engine import describe_url
from .errors import ForeignTable, LockError
from .exit_statuses import EXIT_NO
from .locker import Locker

# -- migrate --------------------------------------------------------------------------------------


@click.command()
@click.option(
    "--sql",
    "print_sql",
    is_flag=True,
    help="Print the DDL instead of applying it (for DBAs who apply it themselves).",
)
@click.option(
    "--check",
    is_flag=True,
    help="Exit status 1 if the table is behind (or not there), 0 if up to date; change nothing.",
)
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
    settings: Settings,
    print_sql: bool,
    check: bool,
    adopt: bool,
    perl_tz: str | None,
    exact_lockstrings: bool,
) -> None:
    """Create or upgrade the lock table (and its `<table>_held` view), or adopt a DBIx::Locker
    table."""
    from . import migrations

    if check:
        # It changes nothing: no database file made where a mistyped path points.
        _, missing = settings.missing_file()
        if missing is not None:
            click.echo(
                f"sqllocker: database {missing} does not exist, so neither does table "
                f"{settings.table!r}; run `sqllocker --url URL --table {settings.table} "
                "migrate`",
                err=True,
            )
            sys.exit(EXIT_NO)
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
    with one_line_errors(f"migration of {describe_url(locker.url)}"):
        current = migrations.current_revision(locker.engine, locker.table_name)
        if check:
            # `sqllocker migrate` would refuse such a table: the adoption is what it needs.
            reason = migrations.foreign_reason(locker.engine, locker.table_name)
            if reason is not None:
                raise ForeignTable.naming(locker.table_name, describe_url(locker.url), reason)
            gone = migrations.recorded_but_gone(locker.engine, locker.table_name)
            if gone is not None:
                raise LockError(gone)
            head = migrations.head_revision()
            if current != head:
                click.echo(
                    f"sqllocker: {locker.table_name!r} in {describe_url(locker.url)} is at "
                    f"revision {current or 'none'}, behind {head}; run `sqllocker --url URL "
                    f"--table {locker.table_name} migrate`",
                    err=True,
                )
                sys.exit(EXIT_NO)
            click.echo(f"{locker.table_name} is up to date (revision {head})")
            return
        migrations.upgrade(locker.engine, locker.table_name)
    head = migrations.head_revision()
    if current != head:
        click.echo(f"migrated {locker.table_name} from {current or 'nothing'} to revision {head}")


def _adopt(locker: Locker, perl_tz: ZoneInfo, exact_lockstrings: bool, print_sql: bool) -> None:
    from . import migrations

    table = locker.table_name
    with one_line_errors(f"adoption of {table!r} in {describe_url(locker.url)}"):
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
