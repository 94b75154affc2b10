"""The ``sqllocker`` command line on every backend, each command in a process of its own: the
console script itself where how a command starts or stops matters, else forked (``sqllocker``)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

import pytest
import sqlalchemy as sa

from sqllocker import Locker
from sqllocker.engine import resolve_url
from sqllocker.errors import printable
from tests import forked_cli
from tests.helpers import Proxied, abandon, migrate

SQLLOCKER = str(Path(sys.executable).parent / "sqllocker")
Run = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def sqllocker(url: str, table_name: str, tmp_path: Path) -> Run:
    """Run a command to its end against this test's database and table, in a process of its
    own forked from one that imported the command line once (``tests/forked_cli.py``): what
    the command does, not how the console script starts, which the tests that start it with
    ``popen`` (signals, process groups, a terminal) and ``tests/test_release.py`` cover."""

    def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return forked_cli.run(
            ["--url", url, "--table", table_name, *args], cwd=tmp_path, timeout=timeout
        )

    return run


@pytest.fixture
def migrated(url: str, table_name: str) -> Locker:
    """The table made by the migrations, in this process (``sqllocker migrate`` itself is
    tested on its own), and a Locker on it."""
    migrate(url, table_name)
    return Locker(url, table=table_name, grace=0)


def popen(url: str, table: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [SQLLOCKER, "--url", url, "--table", table, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run_job(url: str, table: str, options: str, script: str) -> subprocess.Popen[str]:
    """``sqllocker run OPTIONS job -- sh -c SCRIPT``, started (OPTIONS: words between spaces)."""
    return popen(url, table, "run", *options.split(), "job", "--", "sh", "-c", script)


def wait_until(condition: Callable[[], bool], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


# The expiry of a runner's lock that a test keeps alive, or breaks with ``release --force``:
# renewed every second, so that a runner slowed by a loaded machine still holds it (and still
# holds it when the break comes) rather than give it up at its deadline, as it would with 1 s.
RUNNER_EXPIRES = "3"


def first_line_of(stream: IO[str] | None, timeout: float = 20) -> str:
    assert stream is not None
    readable, _, _ = select.select([stream], [], [], timeout)
    assert readable, "timed out"
    return stream.readline()


# -- help and version -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "command", [[], ["purge-expired"], ["list"], ["show"], ["release"], ["run"], ["migrate"]]
)
def test_every_command_has_help(command: list[str]) -> None:
    result = subprocess.run([SQLLOCKER, *command, "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    assert "Usage: sqllocker" in result.stdout
    if not command:
        assert "SQLLOCKER_URL" in result.stdout  # the variable shows in --help


def test_version() -> None:
    from sqllocker import __version__

    result = subprocess.run([SQLLOCKER, "--version"], capture_output=True, text=True)
    assert result.returncode == 0
    assert __version__ in result.stdout


def test_run_help_says_it_does_not_wait_by_default() -> None:
    result = subprocess.run([SQLLOCKER, "run", "--help"], capture_output=True, text=True)
    assert "Unlike flock(1), which waits by default" in " ".join(result.stdout.split())


@pytest.mark.slow
def test_usage_errors_exit_2(sqllocker: Run) -> None:
    for args in (
        ["no-such-command"],
        ["run", "x"],
        ["purge-expired", "--batch-size", "0"],
        ["purge-expired", "--pause-ratio", "-1"],
        ["purge-expired", "--grace", "nan"],
        ["run", "--expires", "nan", "x", "--", "true"],
        ["run", "--expires", "0", "x", "--", "true"],
        ["run", "--hold-at-least", "inf", "x", "--", "true"],
        ["run", "--kill-after", "nan", "x", "--", "true"],
        ["exporter", "--scrape-timeout", "inf"],
    ):
        result = sqllocker(*args)
        assert result.returncode == 2, args  # not 1: that says the lock is held
        assert "Traceback" not in result.stderr


# -- migrate --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_migrate_check_apply_and_sql(sqllocker: Run, url: str, table_name: str) -> None:
    behind = sqllocker("migrate", "--check")
    assert behind.returncode == 1
    assert f"`sqllocker --url URL --table {table_name} migrate`" in behind.stderr
    applied = sqllocker("migrate")
    assert applied.returncode == 0, applied.stderr
    assert "migrated" in applied.stdout
    assert sqllocker("migrate").returncode == 0  # again: nothing to do
    assert sqllocker("migrate", "--check").returncode == 0
    ddl = sqllocker("migrate", "--sql")
    assert ddl.returncode == 0
    assert f"CREATE TABLE {table_name}" in ddl.stdout
    assert f"CREATE VIEW {table_name}_held" in ddl.stdout


@pytest.mark.slow
def test_missing_table_is_a_one_line_error_naming_migrate(sqllocker: Run, backend: str) -> None:
    for args in (["list"], ["purge-expired"], ["run", "job", "--", "true"]):
        result = sqllocker(*args)
        if backend == "sqlite" and args[0] == "run":  # the zero-set-up default makes its table
            assert result.returncode == 0, result.stderr
            continue
        assert result.returncode == 2, args  # not 1: that is a negative answer
        if backend == "sqlite":  # list and purge-expired make no database file
            assert "makes none (`sqllocker run` and `sqllocker migrate` do)" in result.stderr
        else:
            assert "migrate`" in result.stderr
            assert "`sqllocker --url URL --table " in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
        assert "Traceback" not in result.stderr


def test_unreachable_database_is_a_one_line_error() -> None:
    result = subprocess.run(
        [SQLLOCKER, "--url", "postgres://postgres@127.0.0.1:1/x", "purge-expired"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert "cannot connect" in result.stderr


@pytest.mark.parametrize(
    "url",
    [
        "nonsense",
        "foo://host/db",
        "postgresql://app:hunter2@host:port/db",
        "postgresql://app@127.0.0.1:1/db?password=hunter2",
    ],
)
def test_a_bad_url_is_one_line_without_its_password(url: str) -> None:
    result = subprocess.run(
        [SQLLOCKER, "--url", url, "list"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert "hunter2" not in result.stderr


def test_purge_help_says_which_grace_to_give() -> None:
    shown = subprocess.run(
        [SQLLOCKER, "purge-expired", "--help"], capture_output=True, text=True, timeout=60
    ).stdout
    assert "does not record" in " ".join(shown.split())


def test_sqlite_default_needs_no_set_up(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "SQLLOCKER_URL"}
    result = subprocess.run(
        [SQLLOCKER, "run", "nightly report", "--", "echo", "ran"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "ran\n"
    assert (tmp_path / "sqllocker.db").exists()


# -- list / show ----------------------------------------------------------------------------------

# The columns of ``sqllocker list`` (and of ``top``'s table).
LIST_COLUMNS = ["LOCKSTRING", "KIND", "ID", "HOLDER", "PROGRAM", "CREATED", "EXPIRES", "LEFT"]


@pytest.mark.slow
def test_list_and_show_in_text_and_json(sqllocker: Run, migrated: Locker) -> None:
    live = migrated.lock("report 1", expires=600, locked_by={"job": "report"})
    other = migrated.lock("digest", expires=600)
    dead = abandon(migrated.lock("report 2", expires=0.2))
    time.sleep(0.4)

    table = sqllocker("list")
    assert table.returncode == 0
    lines = table.stdout.splitlines()
    assert lines[0].split() == LIST_COLUMNS
    assert len(lines) == 4
    assert any("report 2" in line and line.endswith("expired") for line in lines)

    listed = json.loads(sqllocker("list", "--json").stdout)
    assert [item["lockstring"] for item in listed] == ["digest", "report 1", "report 2"]
    first = listed[1]
    assert first["lock_id"] == live.lock_id
    assert first["locked_by"]["job"] == "report"
    assert "guid" not in first["locked_by"]
    assert (
        live.guid not in sqllocker("list", "--json").stdout + sqllocker("show", "report 1").stdout
    )
    assert first["expired"] is False
    assert 500 < first["seconds_left"] <= 600
    assert set(first) == {
        "lockstring",
        "kind",
        "lock_id",
        "created",
        "expires",
        "expired",
        "seconds_left",
        "locked_by",
        "dbix_locker",
        "created_in_future",
    }
    assert first["dbix_locker"] is False
    assert first["created_in_future"] is False

    matching = json.loads(sqllocker("list", "report*", "--json").stdout)
    assert [item["lockstring"] for item in matching] == ["report 1", "report 2"]
    expired = json.loads(sqllocker("list", "--expired", "--json").stdout)
    assert [item["lock_id"] for item in expired] == [dead.lock_id]
    assert json.loads(sqllocker("list", "%", "--json").stdout) == []  # no SQL wildcards

    shown = sqllocker("show", "report 1")
    assert shown.returncode == 0
    assert f"lock id:    {live.lock_id}" in shown.stdout
    assert json.loads(sqllocker("show", "report 1", "--json").stdout)["lock_id"] == live.lock_id
    absent = sqllocker("show", "nobody holds this")
    assert absent.returncode == 1
    assert "not held" in absent.stderr
    # An expired row is shown, and nobody holds it: exit 1 (it exited 0, as if held).
    lapsed = sqllocker("show", "report 2")
    assert lapsed.returncode == 1
    assert "expired" in lapsed.stdout
    lapsed_json = sqllocker("show", "report 2", "--json")
    assert lapsed_json.returncode == 1
    assert json.loads(lapsed_json.stdout)["expired"] is True
    live.unlock()
    other.unlock()


# -- release --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("hidden", "shown"),
    [
        ("\U000e0020\U000e0078", "\\U000e0020\\U000e0078"),  # tag characters
        ("\u00ad", "\\xad"),  # a soft hyphen
        ("\u180e", "\\u180e"),
        ("\ufff9", "\\ufff9"),
        ("\U0001d173", "\\U0001d173"),
        ("\u00a0", "\\xa0"),  # a space that is not one
    ],
)
def test_invisible_characters_are_shown_escaped(hidden: str, shown: str) -> None:
    """``list`` showed "nightly report" and "nightly report" + two tag characters as two
    identical rows."""
    assert printable(f"nightly report{hidden}") == f"nightly report{shown}"
    assert printable("nightly report é 中 ✓") == "nightly report é 中 ✓"


@pytest.mark.slow
def test_control_characters_in_a_row_never_reach_the_terminal(
    sqllocker: Run, migrated: Locker
) -> None:
    forged = "job\x1b[2K\r\x1b[1Afake row\u202e"
    lock = migrated.lock(forged, locked_by={"note": "\x1b]0;title\x07"})
    for command in (["list"], ["show", forged]):
        shown = sqllocker(*command)
        assert shown.returncode == 0, shown.stderr
        assert not any(ch in shown.stdout for ch in "\x1b\r\x07\u202e")
        assert "job\\x1b[2K\\x0d" in shown.stdout
    exact = json.loads(sqllocker("list", "--json").stdout)
    assert exact[0]["lockstring"] == forged  # JSON output stays exact
    busy = sqllocker("run", forged, "--", "true")
    assert busy.returncode == 1
    assert "\x1b" not in busy.stderr
    lock.unlock()


@pytest.mark.slow
def test_release_needs_force_and_can_name_the_acquisition(sqllocker: Run, migrated: Locker) -> None:
    lock = migrated.lock("stuck job", expires=600)
    refused = sqllocker("release", "stuck job")
    assert refused.returncode == 2
    assert "--force" in refused.stderr
    assert migrated.lock_info("stuck job") is not None

    wrong_id = sqllocker("release", "stuck job", "--force", "--id", str(lock.lock_id + 1000))
    assert wrong_id.returncode == 1
    assert migrated.lock_info("stuck job") is not None

    broken = sqllocker("release", "stuck job", "--force", "--id", str(lock.lock_id))
    assert broken.returncode == 0, broken.stderr
    assert "broke lock 'stuck job'" in broken.stderr  # the log line: whose lock, broken by whom
    assert migrated.lock_info("stuck job") is None
    assert sqllocker("release", "stuck job", "--force").returncode == 1
    with pytest.raises(Exception, match="no longer ours"):
        lock.unlock()


# -- purge-expired --------------------------------------------------------------------------------


@pytest.mark.slow
def test_purge_expired_output_modes(sqllocker: Run, migrated: Locker) -> None:
    live = migrated.lock("live", expires=600)
    for n in range(3):
        abandon(migrated.lock(f"dead {n}", expires=0.2))
    time.sleep(0.4)
    dry = sqllocker("purge-expired", "--grace", "0", "--dry-run")
    assert dry.returncode == 0
    assert "3 expired lock(s) would be purged" in dry.stdout
    dry_json = json.loads(sqllocker("purge-expired", "--grace", "0", "--dry-run", "--json").stdout)
    assert dry_json["would_purge"] == 3
    assert len(migrated.locks()) == 4  # nothing deleted by a dry run

    quiet = sqllocker("purge-expired", "--grace", "0")
    assert (quiet.returncode, quiet.stdout, quiet.stderr) == (0, "", "")
    assert [info.lockstring for info in migrated.locks()] == ["live"]
    abandon(migrated.lock("dead again", expires=0.2))
    time.sleep(0.4)
    verbose = sqllocker("purge-expired", "--grace", "0", "--verbose")
    assert verbose.stdout == "purged 1 expired lock(s)\n"
    assert json.loads(sqllocker("purge-expired", "--json").stdout) == {"purged": 0}
    live.unlock()


@pytest.mark.slow
def test_purge_of_100000_expired_rows_interleaved_with_live_ones(
    sqllocker: Run, migrated: Locker
) -> None:
    from datetime import datetime, timezone

    table = migrated.table
    dead, live = 100_000, 1_000
    past = datetime(2000, 1, 1, tzinfo=timezone.utc)
    future = datetime(2999, 1, 1, tzinfo=timezone.utc)
    # Rows n = 0 .. 100,999: "row n", "guid-n", {"pid": n}, created in the past, and expired
    # but every 101st (live). Made by the server in one INSERT ... SELECT (n from a CTE of
    # 0 .. 999 taken twice) rather than sent from here a row at a time: the rows are the
    # purge's to find, and sending them took longer than the purge itself.
    digits = sa.union_all(*(sa.select(sa.literal(d).label("d")) for d in range(10))).subquery()
    ones, tens, hundreds = digits.alias("ones"), digits.alias("tens"), digits.alias("hundreds")
    thousand = sa.select((ones.c.d + 10 * tens.c.d + 100 * hundreds.c.d).label("n")).cte()
    low, high = thousand.alias("low"), thousand.alias("high")
    n = high.c.n * 1000 + low.c.n
    times = table.c.created.type
    holder = {
        "postgresql": sa.func.jsonb_build_object,
        "mysql": sa.func.json_object,
        "sqlite": sa.func.json_object,
    }[migrated.engine.dialect.name](sa.literal_column("'pid'"), n)
    rows = sa.select(
        sa.literal("row ") + sa.cast(n, sa.String),
        sa.literal("guid-") + sa.cast(n, sa.String),
        sa.literal(past, times),
        sa.case((n % 101 == 0, sa.literal(future, times)), else_=sa.literal(past, times)),
        holder,
    ).where(high.c.n < (dead + live) // 1000)
    columns = ["lockstring", "guid", "created", "expires", "locked_by"]
    engine = sa.create_engine(migrated.url, enable_from_linting=False)  # the products are meant
    with engine.begin() as conn:
        conn.execute(sa.insert(table).from_select(columns, rows))
        assert conn.execute(sa.select(sa.func.count()).select_from(table)).scalar() == dead + live
    engine.dispose()
    expected_live = sorted(f"row {i}" for i in range(0, dead + live, 101))

    started = time.monotonic()
    result = sqllocker("purge-expired", "--json", "--batch-size", "5000", timeout=600)
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stderr
    purged = json.loads(result.stdout)["purged"]
    assert purged == dead + live - len(expected_live)
    assert sorted(info.lockstring for info in migrated.locks()) == expected_live
    print(f"\npurged {purged} rows in batches of 5000 in {elapsed:.1f}s")


def test_purge_runs_in_batches(migrated: Locker, caplog: pytest.LogCaptureFixture) -> None:
    for n in range(25):
        abandon(migrated.lock(f"dead {n}", expires=0.1))
    time.sleep(0.3)
    caplog.set_level(logging.DEBUG, logger="sqllocker.sql")
    assert migrated.purge_expired_locks(batch_size=10) == 25
    messages = [r.getMessage() for r in caplog.records]
    statements = [message.split()[0] for message in messages]
    # (PostgreSQL names the schema the table was found in.)
    deletes = re.compile(rf"DELETE FROM (public\.)?{migrated.table_name} ")
    batches = [m for m in messages if deletes.match(m)]
    assert len(batches) == 3  # 10 + 10 + 5
    if migrated.engine.dialect.name == "postgresql":
        # and then the sweep of hand-off requests whose waiter has gone
        assert f"{migrated.table_name}_sweep_requests()" in messages[-1]
    if migrated.engine.dialect.name == "sqlite":
        # Each batch copies the pages it wrote back into the database itself, so that a lock
        # operation committing next is not the one that pays for them.
        assert statements == ["DELETE", "PRAGMA"] * 3
    else:
        assert "PRAGMA" not in statements


def test_purge_rests_after_each_full_batch_in_proportion_to_it(migrated: Locker) -> None:
    """A purge flat out keeps a server core busy; resting lets concurrent acquirers through."""
    for n in range(25):
        abandon(migrated.lock(f"dead {n}", expires=0.1))
    time.sleep(0.3)
    rests: list[float] = []
    migrated._operations.database.sleep = rests.append
    assert migrated.purge_expired_locks(batch_size=10, pause_ratio=2) == 25
    assert len(rests) == 2  # after the two full batches, not after the last, partial one
    assert all(0 < rest < 10 for rest in rests)
    for n in range(5):
        abandon(migrated.lock(f"dead again {n}", expires=0.1))
    time.sleep(0.3)
    rests.clear()
    assert migrated.purge_expired_locks(batch_size=2, pause_ratio=0) == 5
    assert rests == []  # 0: flat out


def test_purge_options_reach_the_library(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--batch-size and --pause-ratio are what the purge is given (their effect on the purge is
    tested above, through the library)."""
    from click.testing import CliRunner

    from sqllocker.cli import cli

    given: list[tuple[int, float]] = []

    def purge(self: Locker, batch_size: int, pause_ratio: float) -> int:
        given.append((batch_size, pause_ratio))
        return 0

    monkeypatch.setattr(Locker, "purge_expired_locks", purge)
    url = f"sqlite:///{tmp_path / 'locks.db'}"
    (tmp_path / "locks.db").touch()  # purge-expired makes no database
    for options, expected in [
        ([], (5000, 6.0)),
        (["--batch-size", "7", "--pause-ratio", "0"], (7, 0.0)),
        (["--pause-ratio", "0.5"], (5000, 0.5)),
    ]:
        result = CliRunner().invoke(cli, ["--url", url, "purge-expired", *options])
        assert result.exit_code == 0, result.output
        assert given.pop() == expected


# -- run ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_run_returns_the_commands_exit_status(sqllocker: Run, migrated: Locker) -> None:
    assert sqllocker("run", "job", "--", "true").returncode == 0
    assert sqllocker("run", "job", "--", "sh", "-c", "exit 3").returncode == 3
    killed = sqllocker("run", "job", "--", "sh", "-c", "kill -KILL $$")
    assert killed.returncode == 128 + signal.SIGKILL
    assert sqllocker("run", "job", "--", "/no/such/program").returncode == 127
    assert migrated.locks() == []  # released every time


def test_run_gives_the_command_its_fencing_token(sqllocker: Run, migrated: Locker) -> None:
    result = sqllocker(
        "run", "job", "--", "sh", "-c", 'echo "$SQLLOCKER_LOCK_ID $SQLLOCKER_LOCKSTRING"'
    )
    lock_id, lockstring = result.stdout.split(maxsplit=1)
    assert int(lock_id) > 0
    assert lockstring.strip() == "job"


@pytest.mark.slow
def test_run_conflict_exit_code_and_message(
    sqllocker: Run, migrated: Locker, url: str, table_name: str
) -> None:
    holder = popen(url, table_name, "run", "job", "--", "sleep", "30")
    try:
        wait_until(lambda: migrated.lock_info("job") is not None)
        conflict = sqllocker("run", "job", "--", "echo", "must not run")
        assert conflict.returncode == 1
        assert conflict.stdout == ""
        assert "is held by" in conflict.stderr
        assert str(holder.pid) in conflict.stderr
        assert len(conflict.stderr.strip().splitlines()) == 1
        custom = sqllocker("run", "-E", "7", "-q", "job", "--", "true")
        assert (custom.returncode, custom.stderr) == (7, "")
        timed_out = sqllocker("run", "-w", "0.5", "job", "--", "true")
        assert timed_out.returncode == 1
    finally:
        holder.terminate()
        holder.communicate(timeout=30)


@pytest.mark.slow
def test_run_with_wait_runs_once_the_holder_is_done(
    sqllocker: Run, migrated: Locker, url: str, table_name: str
) -> None:
    holder = popen(url, table_name, "run", "job", "--", "sleep", "1.5")
    wait_until(lambda: migrated.lock_info("job") is not None)
    waiter = sqllocker("run", "-w", "30", "job", "--", "echo", "ran after")
    assert waiter.returncode == 0, waiter.stderr
    assert waiter.stdout == "ran after\n"
    assert holder.wait(timeout=30) == 0


@pytest.mark.slow
def test_run_keeps_the_lock_for_several_expiry_periods(
    migrated: Locker, url: str, table_name: str, tmp_path: Path
) -> None:
    done = tmp_path / "command-finished"
    three_periods = f"sleep 9; touch {done}"
    runner = run_job(url, table_name, f"--expires {RUNNER_EXPIRES}", three_periods)
    wait_until(lambda: migrated.lock_info("job") is not None)
    first_id = migrated.lock_info("job").lock_id  # type: ignore[union-attr]
    while runner.poll() is None:
        contender = migrated.try_lock("job")  # grace=0: any expiry would let us in
        if contender is not None:
            contender.unlock()
            assert done.exists(), "took the lock while the command still ran"
        info = migrated.lock_info("job")
        assert info is None or info.lock_id == first_id
        time.sleep(0.2)
    _out, err = runner.communicate()
    assert runner.returncode == 0, err
    assert migrated.locks() == []


@pytest.mark.slow
def test_run_forwards_sigterm_and_releases(
    migrated: Locker, url: str, table_name: str, tmp_path: Path
) -> None:
    marker, trapping = tmp_path / "got-term", tmp_path / "trapping"
    script = f"trap 'touch {marker}; kill $!; exit 9' TERM; touch {trapping}; sleep 30 & wait"
    runner = run_job(url, table_name, "", script)
    wait_until(lambda: migrated.lock_info("job") is not None)
    wait_until(trapping.exists)  # the shell has installed its trap
    runner.send_signal(signal.SIGTERM)
    runner.communicate(timeout=30)
    assert marker.exists()  # the command got the signal
    assert runner.returncode == 9  # and its own status came back
    assert migrated.locks() == []


# A command that logs each SIGINT it gets, and exits half a second after the first.
COUNT_INTERRUPTS = """
import pathlib, signal, sys, time
log, first = pathlib.Path(sys.argv[1]), []
def interrupted(signum, frame):
    first.append(time.monotonic())
    with log.open("a") as out:
        out.write("INT\\n")
signal.signal(signal.SIGINT, interrupted)
(log.parent / "ready").touch()
deadline = time.monotonic() + 20
while time.monotonic() < (first[0] + 0.5 if first else deadline):
    time.sleep(0.02)
"""


def interrupts_counted(tmp_path: Path, send: Callable[[int], None], pid: int) -> int:
    """Wait for COUNT_INTERRUPTS to be ready under `sqllocker run` (process ``pid``), ``send``
    the interrupt, and count the SIGINTs the command got."""
    wait_until(lambda: (tmp_path / "ready").exists())
    send(pid)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return (tmp_path / "interrupts").read_text().count("INT")


def run_counting_interrupts(tmp_path: Path) -> list[str]:
    url = f"sqlite:///{tmp_path / 'locks.db'}"
    log = str(tmp_path / "interrupts")
    return [
        SQLLOCKER,
        "--url",
        url,
        "run",
        "job",
        "--",
        sys.executable,
        "-c",
        COUNT_INTERRUPTS,
        log,
    ]


def test_run_passes_on_an_interrupt_sent_to_it_alone(tmp_path: Path) -> None:
    """``kill -INT`` of sqllocker (no terminal): the command would not get it otherwise."""
    runner = subprocess.Popen(run_counting_interrupts(tmp_path), start_new_session=True)
    count = interrupts_counted(tmp_path, lambda pid: os.kill(pid, signal.SIGINT), runner.pid)
    runner.returncode = 0  # reaped above
    assert count == 1


def test_ctrl_c_at_a_terminal_reaches_the_command_once(tmp_path: Path) -> None:
    """The terminal interrupts its whole foreground process group, the command included:
    sqllocker must not interrupt it a second time."""
    pty = pytest.importorskip("pty")
    pid, terminal = pty.fork()  # the child leads a new session on a new pseudo-terminal
    if pid == 0:
        os.execv(SQLLOCKER, run_counting_interrupts(tmp_path))
    output = bytearray()

    def drain() -> None:
        try:
            while chunk := os.read(terminal, 4096):
                output.extend(chunk)
        except OSError:  # EIO: the terminal's last process has gone
            pass

    reader = threading.Thread(target=drain)
    reader.start()
    try:
        count = interrupts_counted(tmp_path, lambda _pid: os.write(terminal, b"\x03"), pid)
    finally:
        reader.join(30)
        os.close(terminal)
    assert count == 1, output.decode(errors="replace")


class ShellAtTerminal:
    """An interactive bash, with job control, on a pseudo-terminal of its own: what is typed at
    it, and what it printed."""

    def __init__(self) -> None:
        pty = pytest.importorskip("pty")
        self.pid, self.terminal = pty.fork()
        if self.pid == 0:
            environment = {**os.environ, "PS1": "$ ", "TERM": "dumb"}
            os.execvpe("bash", ["bash", "--norc", "--noprofile", "-i"], environment)
        self.output = bytearray()
        self.reader = threading.Thread(target=self._drain, daemon=True)
        self.reader.start()

    def _drain(self) -> None:
        try:
            while chunk := os.read(self.terminal, 4096):
                self.output.extend(chunk)
        except OSError:  # EIO: the terminal's last process has gone
            pass

    def type(self, keys: bytes) -> None:
        os.write(self.terminal, keys)

    def said(self, pattern: bytes) -> list[bytes]:
        return re.findall(pattern, bytes(self.output))

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)  # bash leads the terminal's session and group
        os.waitpid(self.pid, 0)
        self.reader.join(10)
        os.close(self.terminal)


# A command that writes its pid, then a tick every 0.1 s, 40 of them.
TICKING = """
import os, sys, time
with open(sys.argv[1], "a") as out:
    out.write(f"{os.getpid()}\\n")
    for _ in range(40):
        out.write("x")
        out.flush()
        time.sleep(0.1)
"""


def ticks(path: Path) -> int:
    return path.read_text().count("x") if path.exists() else 0


@pytest.mark.slow
@pytest.mark.parametrize("stopped_for", ["a while", "past the lock's expiry", "past it, warn"])
def test_ctrl_z_at_a_terminal_suspends_the_run_as_a_job(tmp_path: Path, stopped_for: str) -> None:
    """Ctrl-Z stops the command's group, the foreground: sqllocker stops with it, so that the
    shell has its terminal back (it waited for ever). ``fg`` continues the command under the
    lock; stopped past the lock's expiry (not renewed meanwhile), the command is stopped by its
    watchdog before anyone else can take the lock, and the run exits 75; with
    ``--on-lost=warn``, ``fg`` continues it all the same (nothing else would)."""
    url = f"sqlite:///{tmp_path / 'locks.db'}"
    log = tmp_path / "ticks"
    expires = "30" if stopped_for == "a while" else "2"
    if stopped_for == "past it, warn":
        expires += " --on-lost warn"
    shell = ShellAtTerminal()
    try:
        command_line = f"{sys.executable} -c '{TICKING}' {log}"
        run = f"{SQLLOCKER} --url {url} run --expires {expires} job -- {command_line}"
        shell.type(run.encode() + b"\n")
        wait_until(lambda: ticks(log) >= 3)
        shell.type(b"\x1a")  # Ctrl-Z
        wait_until(lambda: shell.said(rb"Stopped"), timeout=10)
        stopped_at = ticks(log)
        command = int(log.read_text().split()[0])
        if stopped_for == "a while":
            time.sleep(1)
            assert ticks(log) == stopped_at  # stopped, and its lock still held
            assert forked_cli.run(["--url", url, "run", "job", "--", "true"]).returncode == 1
        elif stopped_for == "past it, warn":
            time.sleep(4)
        else:
            # The next holder gets the lock once its row has expired: by then the command,
            # stopped as it was, has been ended by its watchdog.
            taken = forked_cli.run(["--url", url, "run", "-w", "30", "job", "--", "true"])
            assert taken.returncode == 0, taken.stderr
            assert not Path(f"/proc/{command}").exists()
            assert ticks(log) == stopped_at
        shell.type(b"fg; echo status=$?\n")
        wait_until(lambda: shell.said(rb"status=\d+"), timeout=30)
        status = shell.said(rb"status=(\d+)")[-1]
        if stopped_for == "a while":
            assert (status, ticks(log)) == (b"0", 40), shell.output.decode(errors="replace")
        elif stopped_for == "past it, warn":
            assert (status, ticks(log)) == (b"75", 40), shell.output.decode(errors="replace")
        else:
            assert status == b"75", shell.output.decode(errors="replace")
    finally:
        shell.close()


def test_run_reports_a_lost_lock(
    migrated: Locker, url: str, table_name: str, sqllocker: Run
) -> None:
    runner = popen(url, table_name, "run", "--expires", RUNNER_EXPIRES, "job", "--", "sleep", "60")
    wait_until(lambda: migrated.lock_info("job") is not None)
    assert sqllocker("release", "job", "--force").returncode == 0
    _, err = runner.communicate(timeout=30)
    assert runner.returncode == 75
    assert "no longer ours" in err or "could not be extended" in err


@pytest.mark.slow
def test_a_job_cron_starts_on_two_machines_runs_once_per_window(
    migrated: Locker, url: str, table_name: str, tmp_path: Path
) -> None:
    """The README's cron recipe: two machines' cron fire 0.3 s apart, the job takes 0.1 s.
    Without --hold-at-least the first run has released its row before the second asks, and
    the job runs twice; with it, once, and the next window's run goes ahead with a higher id."""
    ran = tmp_path / "ran"
    job = ["sh", "-c", f'echo "$SQLLOCKER_LOCK_ID" >> {ran}; sleep 0.1']

    def cron() -> subprocess.Popen[str]:
        return popen(
            url, table_name, "run", "-q", "-E", "0", "--hold-at-least", "2", "job", "--", *job
        )

    first = cron()
    time.sleep(0.3)
    second = cron()
    assert first.wait(30) == 0
    assert second.wait(30) == 0
    assert len(ran.read_text().split()) == 1
    time.sleep(3.5)  # the next window (2 s) and the takeover grace (1 s)
    assert cron().wait(30) == 0
    ids = [int(line) for line in ran.read_text().split()]
    assert len(ids) == 2
    assert ids[1] > ids[0]


@pytest.mark.slow
def test_of_eight_machines_starting_a_held_job_at_once_one_runs(
    migrated: Locker, url: str, table_name: str, tmp_path: Path
) -> None:
    ran = tmp_path / "ran"
    runners = [
        run_job(url, table_name, "-q -E 0 --hold-at-least 10", f"echo x >> {ran}") for _ in range(8)
    ]
    assert [runner.wait(60) for runner in runners] == [0] * 8
    assert ran.read_text().split() == ["x"]


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, killed and not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in {"Z", "X"}


# A command that starts a grandchild and says which: what a lost lock must stop, all of it.
WITH_GRANDCHILD = "sleep 60 & echo $! > {pids}; echo $$ >> {pids}; wait"


def started_pids(path: Path) -> list[int]:
    wait_until(lambda: path.exists() and len(path.read_text().split()) == 2)
    return [int(pid) for pid in path.read_text().split()]


@pytest.mark.slow
def test_run_stops_the_commands_whole_group_when_the_lock_is_lost(
    migrated: Locker, url: str, table_name: str, sqllocker: Run, tmp_path: Path
) -> None:
    pids = tmp_path / "pids"
    script = WITH_GRANDCHILD.format(pids=pids)
    runner = run_job(url, table_name, f"--expires {RUNNER_EXPIRES}", script)
    grandchild, child = started_pids(pids)
    started = time.monotonic()
    assert sqllocker("release", "job", "--force").returncode == 0
    _, err = runner.communicate(timeout=30)
    assert time.monotonic() - started < 30  # at the next renewal, not at the command's end (60 s)
    assert runner.returncode == 75
    assert "stopping the command" in err
    wait_until(lambda: not alive(grandchild) and not alive(child), timeout=5)


@pytest.mark.slow
def test_run_kills_a_command_that_ignores_sigterm_after_kill_after(
    migrated: Locker, url: str, table_name: str, sqllocker: Run, tmp_path: Path
) -> None:
    pids = tmp_path / "pids"
    script = "trap '' TERM; " + WITH_GRANDCHILD.format(pids=pids)  # both ignore SIGTERM
    runner = run_job(url, table_name, f"--expires {RUNNER_EXPIRES} --kill-after 1", script)
    grandchild, child = started_pids(pids)
    started = time.monotonic()
    assert sqllocker("release", "job", "--force").returncode == 0
    runner.communicate(timeout=30)
    assert runner.returncode == 75
    assert 1 <= time.monotonic() - started < 30  # killed, not left to its 60 s
    wait_until(lambda: not alive(grandchild) and not alive(child), timeout=5)


@pytest.mark.slow
def test_run_with_on_lost_warn_lets_the_command_finish(
    migrated: Locker, url: str, table_name: str, sqllocker: Run, tmp_path: Path
) -> None:
    done, go = tmp_path / "done", tmp_path / "go"
    runner = run_job(
        url,
        table_name,
        f"--expires {RUNNER_EXPIRES} --on-lost warn",
        f"until [ -e {go} ]; do sleep 0.05; done; touch {done}",
    )
    wait_until(lambda: migrated.lock_info("job") is not None)
    assert sqllocker("release", "job", "--force").returncode == 0
    told = first_line_of(runner.stderr)  # the command still runs: it waits for ``go``
    go.touch()
    _, err = runner.communicate(timeout=30)
    assert "no longer ours" in told or "could not be extended" in told
    assert "stopping" not in err
    assert done.exists()
    assert runner.returncode == 75


def test_a_killed_sqllocker_takes_its_commands_group_with_it(
    migrated: Locker, url: str, table_name: str, tmp_path: Path
) -> None:
    pids = tmp_path / "pids"
    runner = run_job(url, table_name, "--kill-after 1", WITH_GRANDCHILD.format(pids=pids))
    grandchild, child = started_pids(pids)
    runner.kill()  # SIGKILL: no handler of sqllocker's runs
    runner.communicate(timeout=30)
    wait_until(lambda: not alive(grandchild) and not alive(child), timeout=5)


@pytest.mark.slow
def test_run_keeps_the_url_and_the_arguments_to_itself_unless_asked(
    migrated: Locker, url: str, table_name: str, tmp_path: Path
) -> None:
    environment = dict(os.environ, SQLLOCKER_URL=url, SQLLOCKER_TABLE=table_name)
    seen = tmp_path / "seen"
    script = f'echo "${{SQLLOCKER_URL-no url}}" > {seen}; sleep 1'

    def run(*options: str) -> tuple[str, dict[str, object]]:
        runner = subprocess.Popen(
            [SQLLOCKER, "run", *options, "job", "--", "sh", "-c", script, "password=hunter2"],
            env=environment,
        )
        wait_until(lambda: migrated.lock_info("job") is not None)
        info = migrated.lock_info("job")
        assert info is not None
        assert runner.wait(30) == 0
        return seen.read_text().strip(), info.locked_by

    shown, locked_by = run()
    assert shown == "no url"
    assert locked_by["command"] == "sh"
    shown, locked_by = run("--pass-url", "--record-args")
    assert shown == url
    assert "password=hunter2" in str(locked_by["command"])


@pytest.mark.slow
@pytest.mark.parametrize("given", ["SQLLOCKER_URL", "--url"])
def test_a_sqllocker_in_a_run_given_no_url_does_not_lock_in_a_local_file(
    migrated: Locker, url: str, table_name: str, tmp_path: Path, given: str
) -> None:
    """``run`` withholds $SQLLOCKER_URL from its command: a nested ``sqllocker run`` (or a
    ``Locker()``) given no URL took the local default file ./sqllocker.db, and ran beside
    whoever held the same lock in the run's database (a second holder). It refuses instead."""
    environment = dict(os.environ, SQLLOCKER_TABLE=table_name)
    environment.pop("SQLLOCKER_URL", None)
    outer = ["--url", url] if given == "--url" else []
    if given == "SQLLOCKER_URL":
        environment["SQLLOCKER_URL"] = url
    nested = f"{SQLLOCKER} run inner -- true"
    done = subprocess.run(
        [SQLLOCKER, *outer, "run", "outer", "--", "sh", "-c", nested],
        env=environment,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0, done.stderr  # the nested sqllocker's error, passed on
    assert "no database URL: `sqllocker run`" in done.stderr
    assert not (tmp_path / "sqllocker.db").exists()
    passed = subprocess.run(
        [SQLLOCKER, *outer, "run", "--pass-url", "outer", "--", "sh", "-c", nested],
        env=environment,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    # --pass-url passes the variable on; a --url is the run's own, still withheld.
    assert (passed.returncode == 0) == (given == "SQLLOCKER_URL"), passed.stderr


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["postgresql", "mysql"])
def test_a_run_whose_release_finds_the_database_gone_keeps_the_commands_status(
    migrated: Locker, proxied: Proxied, table_name: str, backend: str, tmp_path: Path
) -> None:
    """The database refuses connections as the command ends, the lock still valid: the release
    fails, and the row is left to expire. The exit status was sqllocker's 1 (which says "busy"
    too), not the command's."""
    started = tmp_path / "started"
    command = ["sh", "-c", f"touch {started}; sleep 1; exit 3"]
    runner = popen(proxied.url, table_name, "run", "--expires", "60", "job", "--", *command)
    wait_until(started.exists)  # the lock's rows all taken (a writer's claim comes first)
    proxied.close()  # connections refused from now on
    _, err = runner.communicate(timeout=60)
    assert runner.returncode == 3, err
    assert "will expire" in err


def test_resolve_url_maps_postgres_scheme_to_psycopg() -> None:
    assert resolve_url("postgres://u@h/db").drivername == "postgresql+psycopg"
    assert resolve_url("postgresql://u@h/db").drivername == "postgresql+psycopg"
    assert resolve_url("mysql://u@h/db").drivername == "mysql+pymysql"
    assert resolve_url("postgresql+psycopg2://u@h/db").drivername == "postgresql+psycopg2"


@pytest.mark.parametrize("backend", ["sqlite"])  # the command line's, any backend
def test_run_options_end_where_the_command_begins(migrated: Locker, sqllocker: Run) -> None:
    """Without ``--``, run's own options written after COMMAND were taken as run's, not the
    command's: ``sqllocker run job ./report --shared`` ran as a reader of ``job``, beside
    other readers (two such runs overlapped), and so did one whose COMMAND had a ``--`` of its
    own. They end where COMMAND begins, as flock(1)'s."""
    echo = ["sh", "-c", 'echo "$*"', "sh"]
    for before, after in [
        ([], ["--shared", "-w", "5"]),
        (["-w", "5"], ["-q", "--expires=9"]),
        (["-qw", "3"], ["--on-lost", "warn"]),
        (["-w3", "--wait=4"], ["-E", "3"]),
        ([], ["--shared", "--", "-q"]),  # a "--" of the command's own
    ]:
        done = sqllocker("run", "job", *before, *echo, *after)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == after, (before, after)
    done = sqllocker("run", "job", "-w", "5", "--", *echo, "--shared", "--")  # as before
    assert done.stdout.split() == ["--shared", "--"]


def test_run_refuses_a_database_in_memory(tmp_path: Path) -> None:
    """``sqllocker --url sqlite:// run job -- ...``: each process's database in memory is its
    own, and two runs of one job ran at once, each holding the lock in its own."""
    for url in ("sqlite://", "sqlite:///file:jobs?mode=memory&cache=shared&uri=true"):
        done = forked_cli.run(["--url", url, "run", "job", "--", "true"], cwd=tmp_path)
        assert done.returncode == 2, done.stderr
        assert "a database in memory is this process's own" in done.stderr, done.stderr
