"""Locks through a PostgreSQL failover and switchover, on a real Patroni + etcd cluster of the
tests' own (``tests/patroni_cluster.py``): three nodes, ``synchronous_mode: true``, a client
URL naming all three hosts.

Each scenario runs 8 contending processes (read-sleep-write of a shared counter under 3
lockstrings) and a keeper process holding 3 more locks kept alive, and checks: no two holders
of a lockstring at once, no lost update, fencing tokens increasing in holding order, and every
kept-alive lock still its holder's afterwards, or its holder told (``on_lost``) before anyone
else took it. It prints the time from the fault to the first successful acquire.
"""

from __future__ import annotations

import itertools
import json
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sqllocker import Locker, UnsafeDatabase, UnsafeDatabaseWarning
from tests import forked_cli
from tests.helpers import holding_faults, wait_in_thread, worker_records
from tests.patroni_cluster import PatroniCluster, running_patroni_cluster

pytestmark = pytest.mark.slow  # Patroni + etcd clusters: not in the quick subset

CONTENDERS = 8
LOCKSTRINGS = ["ha 1", "ha 2", "ha 3"]
KEPT = ["kept 1", "kept 2", "kept 3"]
# Kept alive with an expiry shorter than a failover: lost, and its holder told before anyone
# else can take it.
SHORT = ["short 1"]
SHORT_EXPIRES = 6
TABLE = "semaphores"


@pytest.fixture(scope="module")
def cluster() -> Iterator[PatroniCluster]:
    with running_patroni_cluster(synchronous=True) as started:
        locker = Locker(started.url, table=TABLE)
        locker.create_table()
        locker.close()
        yield started


def _spawn(command: str, url: str, state: Path, *options: str) -> forked_cli.Popen:
    """A ``python -m tests.workers COMMAND`` process of its own, forked from one that imported
    tests.workers once (``tests/forked_cli.py``)."""
    return forked_cli.Popen(
        [command, "--url", url, "--table", TABLE, "--state", str(state), *options],
        stderr=state / f"{command}-{next(_logs)}.log",  # the retries' warnings, for a failure
    )


_logs = itertools.count()


def contend_through(
    cluster: PatroniCluster, state: Path, fault: Callable[[], None]
) -> dict[str, Any]:
    """Run the contenders and the keeper, apply ``fault`` once they are busy, let them go on
    until each contender has held a lock since, and check the outcome."""
    cluster.revive()
    keepers = [
        _spawn("keeper", cluster.url, state, "--lockstrings", ",".join(KEPT)),
        _spawn(
            "keeper",
            cluster.url,
            state,
            *("--lockstrings", ",".join(SHORT), "--expires", str(SHORT_EXPIRES)),
        ),
    ]
    for keeper in keepers:
        assert keeper.stdout is not None
        assert json.loads(keeper.stdout.readline()) == {"ready": True}
    contenders = [
        _spawn(
            "failover",
            cluster.url,
            state,
            "--lockstrings",
            ",".join(LOCKSTRINGS),
            "--kept",
            ",".join(KEPT + SHORT),
        )
        for _ in range(CONTENDERS)
    ]
    time.sleep(3)
    fault_at = time.monotonic()
    fault()
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        acquired_since = {
            path.name
            for path in state.glob("log-*.jsonl")
            for line in path.read_text().splitlines()
            if '"out"' in line and json.loads(line)["in"] > fault_at
        }
        if len(acquired_since) == CONTENDERS:
            break
        time.sleep(0.5)
    time.sleep(2)
    (state / "stop").touch()
    reports = [
        json.loads(line)
        for keeper in keepers
        for line in keeper.communicate(timeout=60)[0].splitlines()
    ]
    for contender in contenders:
        out, _ = contender.communicate(timeout=60)
        assert json.loads(out.splitlines()[-1])["overlaps"] == 0
    records = worker_records(state)
    held = [record for record in records if "out" in record]
    # Acquires asked for after the fault: those in flight before it may still have been
    # acknowledged by the old primary a moment later.
    since = [record["in"] for record in held if record["asked"] > fault_at]
    assert since, "no lock was acquired after the fault"
    workers_since = {
        path.name
        for path in state.glob("log-*.jsonl")
        for line in path.read_text().splitlines()
        if '"out"' in line and json.loads(line)["in"] > fault_at
    }
    assert len(workers_since) == CONTENDERS, "a contender never got a lock after the fault"

    faults = holding_faults(records, LOCKSTRINGS, state)
    assert faults == {"double holders": 0, "fencing inversions": 0, "lost updates": 0}

    takeovers = [record for record in records if record.get("took_kept")]
    for report in reports:  # each kept lock: still ours, or its holder told first
        if report["still_ours"]:
            assert report["lost_at"] is None
            assert not [t for t in takeovers if t["ls"] == report["ls"]], report
        else:
            assert report["lost_at"] is not None, f"{report['ls']!r} lost without on_lost"
            taken = [t["in"] for t in takeovers if t["ls"] == report["ls"]]
            assert all(report["lost_at"] < at for at in taken), report
    figures = {
        "first acquire asked after the fault (s)": round(min(since) - fault_at, 2),
        "acquisitions": len(held),
        "errors retried": sum(1 for record in records if "error" in record),
        "kept locks still held": sum(
            report["still_ours"] for report in reports if report["ls"] in KEPT
        ),
        "short locks lost, holder told first": sum(
            report["lost_at"] is not None for report in reports if report["ls"] in SHORT
        ),
    }
    print(figures)
    return figures


def test_a_synchronous_cluster_passes_the_settings_check_even_when_strict(
    cluster: PatroniCluster,
) -> None:
    with Locker(cluster.url, table=TABLE, strict=True) as locker, locker.lock("strict"):
        pass


def test_a_switchover_loses_no_lock(cluster: PatroniCluster, tmp_path: Path) -> None:
    """``patronictl switchover`` under load: waiters queued on the old primary queue again on
    the new one; every kept-alive lock is renewed there."""
    candidate = cluster.sync_standby()
    assert candidate is not None

    def switch_over() -> None:
        cluster.switchover(candidate)
        cluster.wait_for(lambda: cluster.leader() is candidate, "the new primary", 60)

    figures = contend_through(cluster, tmp_path, switch_over)
    assert figures["kept locks still held"] == len(KEPT)
    cluster.wait_for(lambda: cluster.sync_standby() is not None, "a synchronous standby", 60)


def test_a_failover_after_the_primary_dies_loses_no_lock(
    cluster: PatroniCluster, tmp_path: Path
) -> None:
    """The primary's machine dies (Patroni and PostgreSQL SIGKILLed): Patroni promotes the
    synchronous standby once the leader key expires; no acknowledged lock row is lost."""
    old = cluster.leader()
    standby = cluster.sync_standby()
    assert old is not None
    assert standby is not None

    def kill_primary() -> None:
        cluster.kill(old)
        cluster.wait_for(lambda: cluster.leader() is standby, "the promoted standby", 90)

    figures = contend_through(cluster, tmp_path, kill_primary)
    # The kept locks' expiry (60 s) outlasts the failover: renewed on the new primary.
    assert figures["kept locks still held"] == len(KEPT)


def test_a_partitioned_primary_accepts_no_write_that_counts(
    cluster: PatroniCluster, tmp_path: Path
) -> None:
    """The primary is cut off from etcd and the other nodes while clients still reach it: its
    commits wait for a synchronous standby that cannot answer until Patroni demotes it, which
    ends them unacknowledged; the standby that Patroni promotes has every acknowledged row."""
    old = cluster.leader()
    assert old is not None

    def partition_primary() -> None:
        cluster.partition(old)
        cluster.wait_for(
            lambda: cluster.leader() not in (None, old), "a primary on the other side", 90
        )

    figures = contend_through(cluster, tmp_path, partition_primary)
    assert figures["kept locks still held"] == len(KEPT)


def test_a_release_lost_in_a_failover_lets_nobody_in_before_it_is_replicated(
    cluster: PatroniCluster,
) -> None:
    """A release commits without waiting for the standby (``Statements.release``): a failover
    right after one brings the row back. The next acquirer's commit waits for the standby, and
    the WAL reaches it in order, so that acquirer cannot have the lock unless the release is on
    the standby too: when its lock() returns, the new primary bears its row out."""
    cluster.revive()
    holder, contender = Locker(cluster.url, table=TABLE), Locker(cluster.url, table=TABLE)
    old, standby = cluster.leader(), cluster.sync_standby()
    assert old is not None
    assert standby is not None
    released = holder.lock("payroll", expires=10)
    old.from_peers.stall()  # replication held back: the release reaches only the old primary
    released.unlock()
    # It waits through the failover, while no node takes writes.
    thread, result = wait_in_thread(contender, "payroll", wait=120, expires=10)
    time.sleep(1)
    assert "lock" not in result, "an acquire was acknowledged before the standby had it"
    cluster.kill(old)
    cluster.wait_for(lambda: cluster.leader() is standby, "the promoted standby", 90)
    thread.join(120)
    assert "lock" in result, result
    taken = result["lock"]
    row = contender.lock_info("payroll")
    assert row is not None
    assert row.lock_id == taken.lock_id  # borne out by the new primary
    assert taken.lock_id > released.lock_id
    taken.unlock()
    holder.close()
    contender.close()


def test_asynchronous_replication_is_refused_beforehand_and_can_lose_a_lock() -> None:
    """``synchronous_mode: false``: the settings check warns (and refuses when strict), and for
    good reason: with replication held back, an acknowledged lock does not survive a failover,
    and a second holder gets it while the first still holds it."""
    with running_patroni_cluster(synchronous=False) as cluster:
        with Locker(cluster.url, table=TABLE) as locker:
            locker.create_table()
            with pytest.warns(UnsafeDatabaseWarning, match="asynchronous"):
                locker.lock("check").unlock()
        with (
            Locker(cluster.url, table=TABLE, strict=True) as strict,
            pytest.raises(UnsafeDatabase),
        ):
            strict.lock("check")

        old = cluster.leader()
        assert old is not None
        first = Locker(cluster.url, table=TABLE)
        with pytest.warns(UnsafeDatabaseWarning):
            first.lock("check").unlock()
        old.from_peers.stall()  # replication held back, as a slow network would
        held = first.lock("payroll", expires=120)  # acknowledged at once: nobody waits
        cluster.kill(old)
        cluster.wait_for(lambda: cluster.leader() not in (None, old), "a new primary", 90)
        second = Locker(cluster.url, table=TABLE)
        with warnings.catch_warnings():  # the new primary may have no standby yet: no warning
            warnings.simplefilter("ignore", UnsafeDatabaseWarning)
            stolen = second.lock("payroll", wait=30)
        assert held.is_valid(), "the first holder still holds, by its own lights"
        assert stolen.lock_id > 0, "and a second holder has the same lockstring: the hazard"
        print({"acknowledged lock lost in an asynchronous failover": True})
        first.close()
        second.close()
