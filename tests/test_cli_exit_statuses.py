"""The command line's exit statuses, grep's: 0 the positive answer (or done), 1 the negative
answer only (not held, no leader, behind, busy), 2 an error that kept the command from
answering. A script's ``sqllocker show nightly || start_nightly`` started the job when the
database was unreachable: that exited 1 as well.

Each command is forked from one process that imported the command line (``forked_cli``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa

from sqllocker import Locker
from sqllocker.engine import resolve_url
from tests import forked_cli
from tests.helpers import migrate

# Every command that answers, with a lockstring where it takes one.
ANSWERING = [
    ["show", "nightly"],
    ["leader", "nightly"],
    ["list"],
    ["run", "nightly", "--", "true"],
    ["migrate", "--check"],
    ["purge-expired"],
    ["release", "nightly", "--force"],
]
# The commands that only read or delete rows: they create no database file, nor table.
CREATING_NOTHING = [
    ["show", "nightly"],
    ["leader", "nightly"],
    ["list"],
    ["top"],  # stdout is no terminal: it prints what `list` prints
    ["purge-expired"],
    ["release", "nightly", "--force"],
    ["exporter", "--listen", "127.0.0.1:0"],
]


def sqllocker(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("SQLLOCKER_")}
    return forked_cli.run(list(args), env=environment, cwd=cwd, timeout=30)


def has_table(url: str, table: str) -> bool:
    engine = sa.create_engine(resolve_url(url))
    try:
        return sa.inspect(engine).has_table(table)
    finally:
        engine.dispose()


def assert_error(result: subprocess.CompletedProcess[str], *words: str) -> None:
    """Exit 2, one line on stderr (``sqllocker: error: ...``), nothing on stdout."""
    assert result.returncode == 2, (result.args, result.stderr)
    assert result.stderr.startswith("sqllocker: error: "), result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stdout == ""
    for word in words:
        assert word in result.stderr


@pytest.mark.parametrize(
    "url", ["postgresql://postgres@127.0.0.1:9/test", "mysql://root@127.0.0.1:9/test"]
)
def test_an_unreachable_database_exits_2(url: str) -> None:
    for args in ANSWERING:
        assert_error(sqllocker("--url", url, "--table", "locks", *args), "127.0.0.1:9")


def test_a_missing_table_exits_2(url: str, backend: str, table_name: str) -> None:
    if backend == "sqlite":  # a database of another table: the file is there, not the table
        migrate(url, f"{table_name}_other")
    for args in [*ANSWERING, ["top"]]:  # top: `list` once, stdout being no terminal
        if args[0] == "run" and backend == "sqlite":
            continue  # the zero-set-up default makes its table: last
        result = sqllocker("--url", url, "--table", table_name, *args)
        if args[0] == "migrate":  # its answer: a table not yet made is behind
            assert result.returncode == 1, result.stderr
            assert "is at revision none" in result.stderr
        else:
            assert_error(result, f"lock table {table_name!r} does not exist", "migrate`")
    if backend == "sqlite":
        result = sqllocker("--url", url, "--table", table_name, "run", "nightly", "--", "true")
        assert result.returncode == 0, result.stderr
        assert has_table(url, table_name)


def test_bad_input_exits_2_and_writes_nothing(
    url: str, backend: str, table_name: str, tmp_path: Path
) -> None:
    migrate(url, table_name)
    for args in (
        ["show", ""],
        ["leader", ""],
        ["run", "", "--", "touch", str(tmp_path / "ran")],
        ["release", "", "--force"],
    ):
        assert_error(sqllocker("--url", url, "--table", table_name, *args), "lockstring")
    for args in (
        ["list"],
        ["show", "x"],
        ["run", "x", "--", "touch", str(tmp_path / "ran")],
        ["purge-expired"],
        ["migrate"],
        ["migrate", "--check"],
        ["exporter"],
    ):
        assert_error(sqllocker("--url", url, "--table", "Bad-Name", *args), "table name")
    assert_error(sqllocker("--url", url, "exporter", "--listen", "nowhere"), "--listen")
    assert_error(sqllocker("--url", "nonsense", "list"), "not a database URL")
    assert not (tmp_path / "ran").exists()
    locker = Locker(url, table=table_name)
    assert locker.locks() == []
    locker.close()
    if backend == "sqlite":  # nor does a run, which would, make the file of a bad lockstring
        fresh = tmp_path / "fresh.db"
        assert_error(sqllocker(f"--url=sqlite:///{fresh}", "run", "", "--", "true"), "lockstring")
        assert not fresh.exists()


def test_the_negative_answers_exit_1(url: str, table_name: str) -> None:
    migrate(url, table_name)
    locker = Locker(url, table=table_name, grace=0)
    held = locker.lock("held", expires=600)
    try:
        table = ["--url", url, "--table", table_name]
        assert sqllocker(*table, "show", "held").returncode == 0
        assert sqllocker(*table, "migrate", "--check").returncode == 0
        for args in (
            ["show", "nightly"],
            ["leader", "nightly"],
            ["release", "nightly", "--force"],
            ["run", "held", "--", "true"],
        ):
            result = sqllocker(*table, *args)
            assert result.returncode == 1, (args, result.stderr)
            assert "error" not in result.stderr
        assert sqllocker(*table, "run", "-E", "7", "-q", "held", "--", "true").returncode == 7
        behind = sqllocker("--url", url, "--table", f"{table_name}_new", "migrate", "--check")
        assert behind.returncode == 1, behind.stderr
    finally:
        held.unlock()
        locker.close()


@pytest.mark.parametrize("where", ["a mistyped path", "the default file", "memory", "a URI"])
def test_sqlite_commands_that_create_nothing_refuse_a_database_that_is_not_there(
    tmp_path: Path, where: str
) -> None:
    """They created an empty database file where a mistyped path pointed, and answered from
    it: nobody holds anything there."""
    missing = tmp_path / "no" / "such.db" if where != "a URI" else tmp_path / "such.db"
    url = {
        "a mistyped path": [f"--url=sqlite:///{missing}"],
        "the default file": [],  # sqlite:///sqllocker.db in the working directory
        "memory": ["--url=sqlite://"],
        "a URI": [f"--url=sqlite:///file:{missing}?uri=true"],
    }[where]
    if where == "a mistyped path":
        missing.parent.mkdir()
    for args in CREATING_NOTHING:
        result = sqllocker(*url, *args, cwd=tmp_path)
        assert_error(result, "memory" if where == "memory" else "does not exist")
        assert not missing.exists()
        assert sorted(p.name for p in tmp_path.rglob("*")) == (
            ["no"] if where == "a mistyped path" else []
        )
    # migrate --check changes nothing: a database not there is behind (in memory: an error).
    checked = sqllocker(*url, "migrate", "--check", cwd=tmp_path)
    if where == "memory":
        assert_error(checked, "memory")
    else:
        assert checked.returncode == 1, checked.stderr
        assert "does not exist" in checked.stderr
    assert not missing.exists()
    # What makes it, as before: migrate, and run (the zero-set-up default).
    if where in ("a mistyped path", "the default file"):
        made = tmp_path / "sqllocker.db" if where == "the default file" else missing
        ran = sqllocker(*url, "run", "nightly", "--", "true", cwd=tmp_path)
        assert ran.returncode == 0, ran.stderr
        assert made.exists()
        assert sqllocker(*url, "show", "nightly", cwd=tmp_path).returncode == 1
        assert sqllocker(*url, "list", cwd=tmp_path).returncode == 0


@pytest.mark.parametrize("backend", ["sqlite"])  # the output's: no database's
def test_output_nobody_reads_exits_2_not_1(url: str, table_name: str, tmp_path: Path) -> None:
    """``sqllocker show nightly | head`` whose reader has gone (``pipefail``): click's own
    handler exited 1, the negative answer, though the lock was held; and an error said to a
    closed stderr likewise. Shell completion's answer printed a traceback."""
    migrate(url, table_name)
    locker = Locker(url, table=table_name)
    held = locker.lock("nightly")
    try:
        for args, streams in [
            (["show", "nightly"], ("stdout",)),
            (["list"], ("stdout",)),
            (["migrate", "--check"], ("stdout",)),  # up to date: said, to nobody
            (["--version"], ("stdout",)),  # the group's own options
            (["--help"], ("stdout",)),
            (["show", "nightly", "--table", "Bad"], ("stdout", "stderr")),
            (["completion"], ("stdout",)),  # the shell's: run with _SQLLOCKER_COMPLETE
        ]:
            completing = {"_SQLLOCKER_COMPLETE": "bash_complete", "COMP_WORDS": "sqllocker "}
            completing["COMP_CWORD"] = "1"
            environment = {**os.environ, **completing} if args == ["completion"] else None
            reader, writer = os.pipe()
            os.close(reader)  # the reader gone before anything is written
            command = [sys.executable, "-m", "sqllocker.cli", "--url", url]
            pipes = {stream: writer for stream in streams}
            try:
                done = subprocess.run(
                    [*command, "--table", table_name, *args],
                    **{"stdout": subprocess.DEVNULL, "stderr": subprocess.PIPE, **pipes},
                    env=environment,
                    timeout=60,
                    check=False,
                )
            finally:
                os.close(writer)
            assert done.returncode == 2, (args, done.stderr)
            assert not done.stderr, done.stderr  # said nowhere, no traceback
    finally:
        held.unlock()
        locker.close()


@pytest.mark.parametrize("backend", ["sqlite"])  # the output's: no database's
def test_output_nobody_reads_leaves_an_in_process_callers_streams_alone(
    url: str, table_name: str
) -> None:
    """``manage.py sqllocker`` runs the command line in Django's process: a reader gone from
    its stdout must not send that process's stderr to /dev/null for the rest of its life."""
    migrate(url, table_name)
    Locker(url, table=table_name).lock("nightly").unlock()
    script = f"""
import os, sys
from sqllocker.cli import OutputClosed, answer
reader, writer = os.pipe()
os.close(reader)
sys.stdout = os.fdopen(writer, "w")
try:
    answer(["--url", {url!r}, "--table", {table_name!r}, "list"])
except OutputClosed:
    os.write(2, b"told, and stderr still mine")
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert "told, and stderr still mine" in done.stderr, done.stderr


def test_sqlite_uris_name_the_file_sqlite_opens(tmp_path: Path) -> None:
    """A URI's authority (``file://localhost/...``, ``file:///...``) and %HH escapes are
    SQLite's to read: the file was taken to be ``//localhost/...`` or ``my%20locks.db`` and
    refused as missing, and its waiters' queue file was not the one beside the database that
    other spellings of it queue on."""
    from sqlalchemy.engine import make_url

    from sqllocker.backends.sqlite import SQLiteBackend

    database = tmp_path / "my locks.db"
    Locker(f"sqlite:///{database}").lock("nightly").unlock()
    quoted = str(database).replace(" ", "%20")
    spellings = [
        f"sqlite:///{database}",
        f"sqlite:///file:{quoted}?uri=true",
        f"sqlite:///file://{quoted}?uri=true",
        f"sqlite:///file://localhost{quoted}?uri=true",
        f"sqlite:///file://localhost{quoted}?mode=rw&uri=true",
        f"sqlite:///file:{quoted}%23fragment?uri=true",  # a fragment ends the URI
    ]
    for url in spellings:
        assert SQLiteBackend.missing_database(make_url(url)) is None, url
        assert SQLiteBackend.queue_file(make_url(url)) == SQLiteBackend.queue_file(
            make_url(spellings[0])
        ), url
    listed = sqllocker(f"--url={spellings[3]}", "list", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    # The URL's query goes into the URI as it is, and SQLite decodes it: "%6d" is "m".
    assert SQLiteBackend.in_memory(make_url("sqlite:///file:x?mode=%256demory&uri=true"))
