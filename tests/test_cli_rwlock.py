"""``sqllocker run --shared`` (the read side) beside a plain ``run`` (the write side), and the
waits without limit: ``-w forever`` and ``--standby``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sqllocker import Locker
from tests.test_cli import Run, migrated, popen, sqllocker, wait_until

__all__ = ["migrated", "sqllocker"]  # the fixtures, used by name


def _readers(locker: Locker) -> int:
    return sum(info.locked_by.get("rwlock") == "reader" for info in locker.locks("catalog*"))


@pytest.mark.slow
def test_shared_runs_run_together_and_a_plain_run_waits_for_them_all(
    sqllocker: Run, migrated: Locker, url: str, table_name: str, tmp_path: Path
) -> None:
    done = tmp_path / "done"
    go = tmp_path / "go"  # the readers hold until the test has tried the plain run
    readers = [
        popen(
            url,
            table_name,
            "run",
            "--shared",
            "catalog",
            "--",
            "sh",
            "-c",
            f"while [ ! -e {go} ]; do sleep 0.05; done; echo r >> {done}",
        )
        for _ in range(2)
    ]
    wait_until(lambda: _readers(migrated) == 2)  # both hold at once
    busy = sqllocker("run", "catalog", "--", "echo", "must not run")
    assert busy.returncode == 1, busy.stderr
    assert "readers hold it" in busy.stderr
    assert _readers(migrated) == 2
    assert not done.exists()
    go.touch()
    writer = sqllocker("run", "-w", "30", "catalog", "--", "cat", str(done))
    assert writer.returncode == 0, writer.stderr
    assert writer.stdout == "r\nr\n"  # it ran after both readers were done
    for reader in readers:
        assert reader.wait(30) == 0
    assert migrated.locks() == []


@pytest.mark.slow
def test_a_shared_run_waits_for_a_plain_run(
    sqllocker: Run, migrated: Locker, url: str, table_name: str
) -> None:
    writer = popen(url, table_name, "run", "catalog", "--", "sleep", "30")
    try:
        wait_until(lambda: migrated.lock_info("catalog") is not None)
        busy = sqllocker("run", "--shared", "catalog", "--", "echo", "must not run")
        assert busy.returncode == 1
        assert busy.stdout == ""
        assert "a writer holds or waits" in busy.stderr
    finally:
        writer.terminate()
        writer.communicate(timeout=30)
    shared = sqllocker("run", "--shared", "catalog", "--", "sh", "-c", "echo $SQLLOCKER_LOCKSTRING")
    assert shared.returncode == 0, shared.stderr
    assert shared.stdout.startswith("catalog (reader ")


@pytest.mark.parametrize(
    ("options", "status"),
    [
        (["-w", "forever"], 0),
        (["-w", "FOREVER"], 0),
        (["--standby"], 0),
        (["--standby", "-w", "forever"], 0),
        (["--standby", "-w", "3"], 2),
        (["-n", "--standby"], 2),
        (["-w", "soon"], 2),
        (["-w", "-1"], 2),
        (["-w", "nan"], 2),
    ],
)
@pytest.mark.slow
def test_waits_without_limit_and_what_they_refuse(
    sqllocker: Run, migrated: Locker, options: list[str], status: int
) -> None:
    result = sqllocker("run", *options, "job", "--", "true")
    assert result.returncode == status, result.stderr
    assert migrated.locks() == []


@pytest.mark.slow
def test_a_standby_takes_over_when_the_active_copy_ends_and_leader_names_each(
    sqllocker: Run, migrated: Locker, url: str, table_name: str
) -> None:
    service = ["sh", "-c", "echo $SQLLOCKER_LOCK_ID; exec sleep 30"]
    active = popen(url, table_name, "run", "--standby", "service", "--", *service)
    assert active.stdout is not None
    active_token = int(active.stdout.readline())
    shown = sqllocker("leader", "--json", "service")
    assert shown.returncode == 0, shown.stderr
    leader = json.loads(shown.stdout)
    assert (leader["pid"], leader["term"]) == (active.pid, active_token)
    standby = popen(url, table_name, "run", "--standby", "service", "--", *service)
    assert standby.stdout is not None
    active.terminate()
    active.communicate(timeout=30)
    standby_token = int(standby.stdout.readline())
    assert standby_token > active_token
    leader = json.loads(sqllocker("leader", "--json", "service").stdout)
    assert (leader["pid"], leader["term"]) == (standby.pid, standby_token)
    standby.terminate()
    standby.communicate(timeout=30)
    none = sqllocker("leader", "service")
    assert none.returncode == 1
