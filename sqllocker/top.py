"""``sqllocker top``: the held locks, live in a terminal, with ``rich``.

Every second it reads the held rows, as many expired ones as the screen has rows, the count of
the rest (``operations.Inspection.overview``) and the waiters' live tickets
(``census.live_waiters``), and redraws: held locks oldest first, then the expired rows the
purge has not deleted yet, longest expired first. ``q`` quits. Times are the database server's,
as every expiry is.
"""

from __future__ import annotations

import contextlib
import select
import sys
import termios
import tty
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from .census import live_waiters
from .engine import describe_url
from .errors import LockError, LockValueError, one_line, printable
from .row_kinds import TURN, kind_of, writer_name
from .validation import check_pattern

if TYPE_CHECKING:
    from .locker import Locker, LockInfo

# Every expired row: ``read_rows`` with no screen's height to bound them.
_ALL = 2**31 - 1

REFRESH_SECONDS = 1.0
# An unexpired lock is shown as close to expiring when less than this is left. (Not a share of
# its period: the row does not say what that is, and ``expires - created`` is its whole life,
# which grows with each renewal: every long-held lock would be shown close.)
CLOSE_SECONDS = 5.0
# Lines of the screen that are not rows (each row and heading line is one line, cut to the
# width): the heading's two, the table's borders and header, and the caption that counts the
# rows not shown.
_AROUND_ROWS = 7


@dataclass(frozen=True)
class Row:
    """One lock as ``top`` shows it."""

    info: LockInfo
    held_seconds: float
    waiters: int | None

    @property
    def kind(self) -> str:
        """What the row is (``sqllocker.row_kinds``)."""
        return kind_of(self.info.lockstring, self.info.locked_by)

    @property
    def counts_as_held(self) -> bool:
        """A lock of its own: not a semaphore's turn (a waiter), nor a writer's second row."""
        return self.kind != TURN and writer_name(self.info.lockstring) is None

    @property
    def close_to_expiry(self) -> bool:
        return self.info.seconds_left < CLOSE_SECONDS


def read_rows(
    locker: Locker, pattern: str | None, most_expired: int | None = None
) -> tuple[list[Row], list[Row], int]:
    """The held rows, oldest first; the expired ones, longest expired first (at most
    ``most_expired`` of them); and how many rows are expired in all."""
    check_pattern(pattern)
    # Read through the locker's operations, as its ``locks()`` is: only what a screen shows.
    held_infos, expired_infos, expired_count = locker._operations.overview(
        pattern, _ALL if most_expired is None else most_expired
    )
    try:
        waiting = live_waiters(locker.engine, locker.table_name)
    except sa.exc.DBAPIError:
        # A role granted only what taking locks needs may not read the tickets (PostgreSQL):
        # the waiters are then unknown, shown as on SQLite.
        waiting = None

    def row(info: LockInfo) -> Row:
        return Row(
            info=info,
            held_seconds=(info.expires - info.created).total_seconds() - info.seconds_left,
            waiters=None if waiting is None else waiting.get(info.lockstring, 0),
        )

    return [row(info) for info in held_infos], [row(info) for info in expired_infos], expired_count


def duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{seconds:02d}s" if hours else f"{minutes}m{seconds:02d}s"


def render(locker: Locker, pattern: str | None, most_rows: int | None = None) -> Any:
    """The screen: a heading and the table of locks (or the error that kept them unread); at
    most ``most_rows`` of them (held locks first), the rest counted below."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    now = datetime.now(timezone.utc).strftime("%H:%M:%S")
    where = f"{describe_url(locker.url)} table {locker.table_name}"
    shown = f"  filter {pattern!r}" if pattern else ""
    try:
        # Held rows come first: no more expired ones than the screen has rows can show.
        held, expired, expired_count = read_rows(locker, pattern, most_rows)
    except LockError as error:
        return Group(
            Text(f"sqllocker top  {where}{shown}  {now}  (q quits)", style="bold"),
            Text(f"cannot read the table: {one_line(error)}", style="bold red"),
        )
    waiting = sum(r.waiters or 0 for r in held) + sum(r.kind == TURN for r in held)
    holding = sum(r.counts_as_held for r in held)
    heading = Text(
        f"sqllocker top  {where}{shown}  {now}  (q quits)\n"
        f"{holding} held, {waiting} waiting, {expired_count} expired not yet purged",
        style="bold",
        no_wrap=True,
        overflow="ellipsis",
    )
    table = Table(expand=True, header_style="bold")
    # One line a row, so that what fits the screen is counted in rows: a long lockstring is
    # cut (``list`` and ``show`` print it whole); the program is cut first.
    table.add_column("LOCKSTRING", overflow="ellipsis", no_wrap=True, min_width=16, ratio=3)
    table.add_column("KIND", no_wrap=True)
    table.add_column("ID", no_wrap=True)
    table.add_column("HOST", overflow="ellipsis", no_wrap=True, max_width=24)
    table.add_column("PID", no_wrap=True)
    table.add_column("PROGRAM", overflow="ellipsis", no_wrap=True, ratio=1, max_width=32)
    for column in ("HELD FOR", "EXPIRES IN", "WAITERS"):
        table.add_column(column, no_wrap=True, justify="right")
    rows = [*held, *expired]
    total = len(held) + expired_count
    if most_rows is not None and total > most_rows:
        # What the screen cannot show is neither read nor laid out: rich's time grows with
        # every row, and a table of expired rows the purge has yet to delete can be long.
        table.caption = f"... {total - most_rows} more rows (sqllocker list shows them all)"
        rows = rows[:most_rows]
    for row in rows:
        info = row.info
        if info.expired:
            left, style = Text("expired", style="dim red"), "dim"
        elif info.expiry_unknown:
            left, style = Text("unknown"), ""
        else:
            left = Text(
                duration(info.seconds_left), style="bold red" if row.close_to_expiry else ""
            )
            style = "dim" if row.kind == TURN else ""
        # Text, not str: rich reads a str as markup, and a lockstring or holder is anyone's
        # text ("job [daily]" was shown as "job", "[link=...]" made a hyperlink).
        table.add_row(
            Text(printable(info.lockstring)),
            row.kind,
            str(info.lock_id),
            Text(printable(str(info.locked_by.get("host", "?")))),
            Text(printable(str(info.locked_by.get("pid", "?")))),
            Text(printable(str(info.locked_by.get("program", "")))),
            duration(row.held_seconds),
            left,
            "-" if row.waiters is None else str(row.waiters),
            style=style,
        )
    return Group(heading, table)


def run_top(locker: Locker, pattern: str | None) -> None:
    """Redraw every second until ``q`` (or Ctrl-C) on a terminal."""
    try:
        from rich.console import Console
        from rich.live import Live
    except ImportError:
        raise LockValueError("top needs rich: pip install 'sqllocker[top]'") from None
    console = Console()

    def screen() -> Any:
        return render(locker, pattern, max(1, console.size.height - _AROUND_ROWS))

    with (
        _keys() as key,
        Live(screen(), console=console, screen=True, auto_refresh=False) as live,
    ):
        while True:
            pressed = key(REFRESH_SECONDS)
            if pressed in ("q", "Q"):
                return
            live.update(screen(), refresh=True)


@contextlib.contextmanager
def _keys() -> Iterator[Any]:
    """A reader of single key presses from the terminal (``None`` after ``timeout`` seconds
    without one), with the terminal in cbreak mode meanwhile: no echo, no line buffering."""
    stdin = sys.stdin
    fd = stdin.fileno()
    saved = termios.tcgetattr(fd)

    def key(timeout: float) -> str | None:
        readable, _, _ = select.select([fd], [], [], timeout)
        return stdin.read(1) if readable else None

    tty.setcbreak(fd)
    try:
        yield key
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)
