"""The command line's long-running views: ``top``, the live terminal view, and ``exporter``, the
lock table as Prometheus metrics."""

from __future__ import annotations

import sys

import click

from .cli_common import (
    Settings,
    pass_settings,
)
from .cli_inspect import list_locks
from .cli_waits import POSITIVE_SECONDS
from .engine import create_locker_engine
from .exporter import (
    DEFAULT_MAX_SERIES,
    DEFAULT_SCRAPE_TIMEOUT,
    ExporterOptions,
    parse_listen,
    serve,
)
from .validation import check_table_name

# -- top ----------------------------------------------------------------------------------------


@click.command()
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

    settings = context.find_object(Settings)
    assert settings is not None
    run_top(settings.locker(creates=False), pattern)


# -- exporter -------------------------------------------------------------------------------------


@click.command()
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
    type=POSITIVE_SECONDS,
    default=DEFAULT_SCRAPE_TIMEOUT,
    metavar="SECONDS",
    help="A scrape whose census of the table takes longer answers sqllocker_up 0 (keep it "
    "below Prometheus's scrape_timeout).",
)
@pass_settings
def exporter(
    settings: Settings, listen: str, per_lock: str | None, max_series: int, scrape_timeout: float
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
        settings.existing_url(), transaction_pooling=settings.transaction_pooling
    )
    serve(engine, options, host, port)
