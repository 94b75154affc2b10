"""``sqllocker top`` driven in a real terminal (tmux): a held lock and its waiter appear, ``q``
quits; and without a terminal it prints what ``list`` prints."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import os
import shlex
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sqllocker import Locker, LockError
from tests.conftest import IN_CI
from tests.helpers import abandon, migrate, wait_until
from tests.test_cli import LIST_COLUMNS

SQLLOCKER = str(Path(__file__).resolve().parents[1] / ".venv" / "bin" / "sqllocker")
TMUX = shutil.which("tmux")


@pytest.fixture
def migrated(url: str, table_name: str) -> str:
    migrate(url, table_name)
    return url


class Terminal:
    """A tmux server of its own (its own socket), one window of a fixed size."""

    def __init__(self, socket: str) -> None:
        self.socket = socket

    def tmux(self, *args: str) -> subprocess.CompletedProcess[str]:
        assert TMUX is not None
        # The terminal's own size, not one pytest's environment would impose on rich.
        environment = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
        return subprocess.run(
            [TMUX, "-L", self.socket, *args],
            env=environment,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )

    def start(self, command: str) -> None:
        started = self.tmux("new-session", "-d", "-s", "top", "-x", "160", "-y", "30", command)
        assert started.returncode == 0, started.stderr

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", "top").stdout

    def alive(self) -> bool:
        return self.tmux("has-session", "-t", "top").returncode == 0


@pytest.fixture
def terminal() -> Iterator[Terminal]:
    if TMUX is None:
        if IN_CI:
            pytest.fail("needs tmux (Debian's tmux package)")
        pytest.skip("tmux is not installed")
    term = Terminal(f"sqllocker-test-{uuid.uuid4().hex[:8]}")
    yield term
    term.tmux("kill-server")


@pytest.mark.slow
def test_top_shows_a_held_lock_and_its_waiter_and_q_quits(
    migrated: str, table_name: str, terminal: Terminal, tmp_path: Path, backend: str
) -> None:
    holder = Locker(migrated, table=table_name)
    held = holder.lock("nightly report 42", expires=300)
    waiter = subprocess.Popen(
        [
            SQLLOCKER,
            "--url",
            migrated,
            "--table",
            table_name,
            "run",
            "-w",
            "120",
            "nightly report 42",
            "true",
        ]
    )
    status = tmp_path / "status"
    command = shlex.join([SQLLOCKER, "--url", migrated, "--table", table_name, "top"])
    try:
        terminal.start(f"{command}; echo $? > {shlex.quote(str(status))}")
        # SQLite's waiters queue in the kernel, where they cannot be counted.
        expected = "1 held, 0 waiting" if backend == "sqlite" else "1 held, 1 waiting"
        screens: list[str] = []

        def drawn() -> bool:
            # A capture may catch a redraw half done: one that shows both is what counts.
            screens.append(terminal.screen())
            return expected in screens[-1] and "nightly report 42" in screens[-1]

        try:
            wait_until(drawn, timeout=30)
        except AssertionError:
            raise AssertionError(screens[-1]) from None
        screen = screens[-1]
        line = next(line for line in screen.splitlines() if "nightly report 42" in line)
        assert str(os.getpid()) in line.split()
        if backend != "sqlite":
            assert line.rstrip(" │|").endswith(" 1")  # the WAITERS column
        assert "q quits" in screen
        terminal.tmux("send-keys", "-t", "top", "q")
        wait_until(lambda: status.exists() and status.read_text().strip() != "", timeout=30)
        assert status.read_text().strip() == "0"
        wait_until(lambda: not terminal.alive(), timeout=30)
        held.unlock()
        assert waiter.wait(60) == 0
    finally:
        waiter.kill()
        waiter.wait(30)
        holder.close()


def test_top_without_a_terminal_prints_the_list(migrated: str, table_name: str) -> None:
    holder = Locker(migrated, table=table_name)
    with holder.lock("job 7"):
        done = subprocess.run(
            [SQLLOCKER, "--url", migrated, "--table", table_name, "top", "job *"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    holder.close()
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split() == LIST_COLUMNS
    assert lines[1].startswith("job 7 ")


def test_a_lock_close_to_expiry_is_marked(make_locker: Any) -> None:
    from sqllocker.top import Row

    locker = make_locker()
    with locker.lock("job 1", expires=60):
        (info,) = locker.locks()
    far = Row(info=info, held_seconds=0.0, waiters=None)
    assert not far.close_to_expiry
    near = Row(info=dataclasses.replace(info, seconds_left=4.0), held_seconds=56.0, waiters=None)
    assert near.close_to_expiry  # less than 5 s left
    # A lock kept alive for an hour: its row's life (expires - created) is an hour long, and
    # as much of its 60 s period is left as after any renewal. It was shown red for good.
    renewed = dataclasses.replace(
        info, created=info.created - dt.timedelta(hours=1), seconds_left=45.0
    )
    assert not Row(info=renewed, held_seconds=3615.0, waiters=None).close_to_expiry


def test_top_shows_what_rows_hold_as_text_not_markup(make_locker: Any) -> None:
    """rich reads a str as markup: ``job [daily]`` was shown as ``job``, ``[link=...]`` made
    a hyperlink, and ``sync [/srv/data]`` stopped top with a MarkupError."""
    from rich.console import Console

    from sqllocker.top import render

    locker = make_locker()
    names = ["job [daily]", "sync [/srv/data]", "[link=https://example.com/]click[/link]"]
    held = [locker.lock(name) for name in names]
    console = Console(width=300, record=True)
    console.print(render(locker, None))
    shown = console.export_text()
    for name in names:
        assert name in shown
    for lock in held:
        lock.unlock()


def test_top_tells_readers_writers_and_turns_apart(make_locker: Any) -> None:
    from sqllocker.top import read_rows, render

    locker = make_locker()
    reader = locker.rwlock("catalog").read()
    writer = locker.rwlock("orders").write()
    turn = locker.lock("crawl (turn)", locked_by={"semaphore_limit": 1})
    held, expired, _ = read_rows(locker, None)
    assert not expired
    kinds = {row.info.lockstring: row.kind for row in held}
    assert kinds == {
        reader.lockstring: "reader",
        "orders": "writer",
        writer._state.lockstring: "writer",
        "crawl (turn)": "turn",
    }
    assert sum(row.counts_as_held for row in held) == 2  # the reader, the writer once
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(render(locker, None))
    assert "2 held, 1 waiting" in console.export_text()
    for lock in (reader, writer, turn):
        lock.unlock()


def test_top_shows_what_fits_and_counts_the_rest(make_locker: Any) -> None:
    """Every row of the table was made into the screen each second: 200,000 expired rows
    took 42 s to the first frame. Only what fits is shown, held locks first, and the rest
    counted."""
    from rich.console import Console

    from sqllocker.top import render

    locker = make_locker()
    held = [locker.lock(f"job {n}") for n in range(3)]
    gone = [locker.lock(f"gone {n}", expires=0.05) for n in range(6)]
    time.sleep(0.1)
    console = Console(width=200, record=True)
    console.print(render(locker, None, most_rows=4))
    shown = console.export_text()
    assert all(f"job {n}" in shown for n in range(3)), shown
    assert sum(f"gone {n}" in shown for n in range(6)) == 1, shown
    assert "5 more rows" in shown, shown
    assert "3 held, 0 waiting, 6 expired not yet purged" in shown, shown
    for lock in held:
        lock.unlock()
    for lock in gone:
        with contextlib.suppress(LockError):
            lock.unlock()


def test_top_fits_long_lockstrings_on_a_small_screen(make_locker: Any) -> None:
    """A row is one line, however long its lockstring, so the rows counted to fit the screen
    do fit it, and the count of the rest is shown (it was cropped, a lockstring folding onto
    several lines)."""
    from rich.console import Console

    from sqllocker.top import _AROUND_ROWS, render

    locker = make_locker()
    held = [locker.lock(f"job {n} " + "x" * 120) for n in range(20)]
    console = Console(width=80, height=24)
    screen = render(locker, None, console.size.height - _AROUND_ROWS)
    lines = console.render_lines(screen, console.options, pad=False)
    assert len(lines) <= 24, len(lines)
    shown = "\n".join("".join(segment.text for segment in line) for line in lines)
    assert "3 more rows" in shown, shown
    for lock in held:
        lock.unlock()


def test_top_reads_only_the_expired_rows_that_fit_and_counts_the_rest(
    make_locker: Any, table_name: str, url: str
) -> None:
    """Every row was read each second, and sorted: 200,000 expired rows took seconds a frame.
    The held rows are read, the expired ones only as many as the screen shows, the longest
    expired first, and the rest counted by the database; a pattern counts what it matches. A
    DBIx::Locker row expired within its margin (its clock may be another time zone's) is held,
    as ``list`` shows it."""
    import sqlalchemy as sa

    from sqllocker.engine import resolve_url
    from sqllocker.schema import FOREIGN_GUID_PREFIX, lock_table
    from sqllocker.top import read_rows, render

    locker = make_locker()
    held = [locker.lock(f"job {n}") for n in range(3)]
    for n in range(30):
        abandon(locker.lock(f"gone {n}", expires=0.05))
    abandon(locker.lock("perl job"))
    table = lock_table(table_name)
    engine = sa.create_engine(resolve_url(url))
    try:
        with engine.begin() as conn:
            row = conn.execute(sa.select(table.c.expires).where(table.c.lockstring == "perl job"))
            expires = row.scalar_one() - dt.timedelta(minutes=10)
            conn.execute(
                sa.update(table)
                .where(table.c.lockstring == "perl job")
                .values(guid=FOREIGN_GUID_PREFIX + "0" * 20, expires=expires)
            )
    finally:
        engine.dispose()
    time.sleep(0.1)
    live, expired, count = read_rows(locker, None, 4)
    assert [row.info.lockstring for row in live] == ["job 0", "job 1", "job 2", "perl job"]
    assert [row.info.lockstring for row in expired] == [f"gone {n}" for n in range(4)]
    assert count == 30
    live, expired, count = read_rows(locker, "gone 1*", 2)
    assert (live, [row.info.lockstring for row in expired], count) == (
        [],
        ["gone 1", "gone 10"],
        11,
    )
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(render(locker, None, most_rows=6))
    shown = console.export_text()
    assert "4 held, 0 waiting, 30 expired not yet purged" in shown, shown
    assert "28 more rows" in shown, shown
    for lock in held:
        lock.unlock()


def test_listing_the_table_again_and_again_compiles_nothing_new(make_locker: Any) -> None:
    """``locks()`` and ``top``'s reads made a new statement each call, which the connection's
    cache of compiled statements kept: a process listing the table each second grew without
    end. Three Lockers, each listing in every way: a cache for the class would have them evict
    each other's statements."""
    from sqllocker.top import read_rows

    lockers = [make_locker() for _ in range(3)]
    semaphores = [locker.semaphore("crawl", 2) for locker in lockers]

    def list_everything() -> None:
        for locker, semaphore in zip(lockers, semaphores, strict=True):
            locker.locks()
            locker.locks("job*")
            read_rows(locker, None, 10)
            read_rows(locker, "job*", 10)
            with semaphore.acquire():
                semaphore.holders()

    def compiled() -> list[int]:
        return [len(locker._operations.database._prepared._prepared) for locker in lockers]

    list_everything()
    before = compiled()
    for _ in range(10):
        list_everything()
    assert compiled() == before


def test_top_shows_a_row_expiring_as_it_reads_once(make_locker: Any) -> None:
    """``top`` reads the count, the expired rows and the held ones in three statements, each on
    the server's clock of its own moment: rows expiring meanwhile were shown in both lists and
    counted apart from the list. Rows expiring every 2.5 ms, read again and again while they do."""
    from sqllocker.top import read_rows

    locker = make_locker()
    for n in range(300):
        abandon(locker.lock(f"row {n:03d}", expires=0.2 + n * 0.0025))
    mixed = 0  # reads that found some rows expired and some held
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        held, expired, count = read_rows(locker, None, 400)
        mixed += 0 < len(expired) < 300
        held_names = {row.info.lockstring for row in held}
        expired_names = [row.info.lockstring for row in expired]
        assert not held_names & set(expired_names), held_names & set(expired_names)
        assert not any(row.info.expired for row in held)
        assert all(row.info.expired for row in expired)
        assert count == len(expired), (count, len(expired))
        assert len(held) + len(expired) == 300, (len(held), len(expired))
        assert expired_names == sorted(expired_names)  # longest expired first
        if len(expired) == 300:
            break
    # The last row expires 0.95 s after the last lock: reads by the score on a fast machine,
    # a few on one so loaded that a read takes a quarter of a second; a count of reads in a
    # given time would test the machine's pace, not top's.
    assert mixed >= 3


def test_top_shows_a_row_that_expires_between_its_reads(
    make_locker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A row that expires after ``top`` read the expired rows and before it read the held ones
    was in neither list (the held rows were those not expired by then)."""
    from sqllocker.statements import Statements
    from sqllocker.top import read_rows

    locker = make_locker()
    abandon(locker.lock("short", expires=1.0))
    held = locker.lock("long", expires=60)
    expires_at = time.monotonic() + 1.0
    time.sleep(0.7)
    built = Statements.held_rows

    def late(self: Statements, pattern: bool) -> Any:
        time.sleep(max(0.0, expires_at + 0.3 - time.monotonic()))  # "short" expires meanwhile
        return built(self, pattern)

    monkeypatch.setattr(Statements, "held_rows", late)
    live, expired, count = read_rows(locker, None, 10)
    assert [row.info.lockstring for row in live] == ["long"]
    assert [row.info.lockstring for row in expired] == ["short"]
    assert count == 1
    held.unlock()
