"""What the command line's subcommands share: the settings of the ``sqllocker`` group (its
Locker), and how rows, times and errors are printed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import click
from sqlalchemy.engine import URL

from .backends import backend_class
from .engine import resolve_url
from .errors import LockError, LockValueError, one_line
from .locker import Locker, LockInfo
from .row_kinds import kind_of
from .schema import FOREIGN_CLOCK_MARGIN

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "show_default": True}


class Settings:
    def __init__(self, url: str | None, table: str, transaction_pooling: bool) -> None:
        self.url = url
        self.table = table
        self.transaction_pooling = transaction_pooling
        self._locker: Locker | None = None

    def locker(self, *, creates: bool = True, **options: Any) -> Locker:
        """The Locker of the command. ``creates=False``, for a command that only reads or
        deletes rows: it makes no database (see ``existing_url``) and no table, which is an
        error instead, as on a server."""
        if self._locker is None:
            if not creates:
                self.existing_url()
                options["auto_create"] = False
            self._locker = Locker(
                self.url,
                table=self.table,
                transaction_pooling=self.transaction_pooling,
                **options,
            )
        return self._locker

    def existing_url(self) -> URL:
        """The database's URL; LockValueError if connecting would make the database (SQLite's
        file that does not exist, a database in memory): a mistyped path must not answer from
        an empty database made there."""
        url, missing = self.missing_file()
        if missing is not None:
            raise LockValueError(
                f"database {missing} does not exist, and this command makes none "
                "(`sqllocker run` and `sqllocker migrate` do)"
            )
        return url

    def shared_database(self) -> URL:
        """The database's URL; LockValueError for a database in memory: each process's own,
        new and empty, so that a lock in it keeps no other process out (two runs of one job
        ran at once) and a read of it finds nothing."""
        url = resolve_url(self.url)
        if backend_class(url.get_backend_name()).in_memory(url):
            raise LockValueError(
                "a database in memory is this process's own, new and empty: a lock in it keeps "
                "no other process out; give a file or a server"
            )
        return url

    def missing_file(self) -> tuple[URL, str | None]:
        """The database's URL, and the file connecting to it would make, not being there yet
        (SQLite's), or None; LockValueError for a database in memory (``shared_database``)."""
        url = self.shared_database()
        return url, backend_class(url.get_backend_name()).missing_database(url)


pass_settings = click.make_pass_decorator(Settings)


@contextmanager
def one_line_errors(what: str) -> Iterator[None]:
    """alembic's and the driver's errors as one line (a LockError), not a traceback."""
    try:
        yield
    except (LockError, BrokenPipeError):  # the latter: its output's reader gone, no failure
        raise
    except Exception as error:
        raise LockError(f"{what} failed: {one_line(error)}") from error


def when(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")


def duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{seconds:02d}s" if hours else f"{minutes}m{seconds:02d}s"


def time_left(info: LockInfo) -> str:
    """How long ``info``'s lock has left, as ``list`` and ``show`` say it: "expired", a
    duration, or "unknown*" for a DBIx::Locker row past its written expiry but not in every
    time zone (its client's local time: see ``ROW_NOTES``)."""
    if info.expired:
        return "expired"
    if info.expiry_unknown:
        return "unknown*"
    return duration(info.seconds_left)


# What `list` and `show` mark with "!" and "*".
ROW_NOTES = (
    "! created in the future by the database's clock: written from a client's clock in another "
    "time zone (DBIx::Locker writes local times)",
    f"* written by DBIx::Locker, in its client's local time: taken over or purged only "
    f"{FOREIGN_CLOCK_MARGIN // 3600} hours "
    "after this expiry, once past in every time zone",
)


def info_json(info: LockInfo) -> dict[str, Any]:
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


def print_json(value: object) -> None:
    click.echo(json.dumps(value, indent=2, sort_keys=True))
