"""Locks on a MariaDB Galera cluster of the tests' own (``tests/galera_cluster.py``): three nodes.

Galera certifies each transaction against those that committed on any node since it began, and
the first to commit wins: two nodes that insert one lockstring at once cannot both commit, and
the loser's error (a deadlock, 1213) is retried as contention. So mutual exclusion holds
whichever nodes the holders write to. Auto-increment values are drawn per node, from
interleaved series (``auto_increment_offset``): with writers on every node a later holder can
carry a smaller fencing token, which the settings check reports; through one node, tokens
increase.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

from sqllocker import LockBusy, Locker, LockLost, UnsafeDatabase, UnsafeDatabaseWarning
from sqllocker.asyncio import AsyncLocker
from sqllocker.backends.mysql import MySQLBackend
from sqllocker.engine import resolve_url
from tests.fleet import Fleet
from tests.galera_cluster import GaleraCluster, running_galera_cluster
from tests.helpers import READ_BACK, break_and_take_when_stalled, holding_faults, worker_records
from tests.stall_proxy import StallProxy
from tests.workers import LOST

pytestmark = pytest.mark.slow  # a three-node Galera cluster: not in the quick subset

TABLE = "semaphores"
LOCKSTRING = "galera"
WORKERS = 6
ACQUISITIONS_EACH = 30
GROUPS_EACH = 15


@pytest.fixture(scope="module")
def cluster() -> Iterator[GaleraCluster]:
    with running_galera_cluster() as started:
        with Locker(started.urls()[0], table=TABLE) as locker:
            locker.create_table()
        yield started


def run_workers(
    command: str, urls: list[str], state: Path, lockstrings: list[str], *options: str
) -> list[dict[str, Any]]:
    """``WORKERS`` workers of ``tests.workers``' ``command`` on ``lockstrings``, through ``urls``
    in turn; their reports, once every one has ended well."""
    fleet = Fleet(
        "tests.workers",
        [
            [
                *(command, "--url", urls[number % len(urls)]),
                *("--table", TABLE, "--state", str(state), "--lockstrings", ",".join(lockstrings)),
                *("--grace", "0", *options),
            ]
            for number in range(WORKERS)
        ],
        state / "workers",
    )
    reports = []
    try:
        for outcome in fleet.wait(timeout=300):
            assert outcome.returncode == 0, f"worker failed:\n{outcome.err[-3000:]}"
            report = json.loads(outcome.out.strip().splitlines()[-1])
            report["lost_told"] = [
                line for line in outcome.err.splitlines() if line.startswith(LOST)
            ]
            reports.append(report)
    finally:
        fleet.kill()
    return reports


def contend(cluster: GaleraCluster, urls: list[str], state: Path, *options: str) -> dict[str, int]:
    """Six workers, through ``urls`` in turn, take ``LOCKSTRING`` and update its counter;
    returns what their acquisitions show (see ``holding_faults``)."""
    started = time.monotonic()
    count = ("--count", str(ACQUISITIONS_EACH))
    reports = run_workers("counter", urls, state, [LOCKSTRING], *count, *options)
    elapsed = time.monotonic() - started
    records = worker_records(state)
    assert len(records) == WORKERS * ACQUISITIONS_EACH
    assert sum(report["overlaps"] for report in reports) == 0
    # A lock told lost at its release, with nobody else in: the id its acquire reported was not
    # its row's (the node ran the INSERT again under another id, and nothing read the row back),
    # and the row stood until it expired.
    assert sum(report["lost"] for report in reports) == 0, [
        line for report in reports for line in report["lost_told"]
    ]
    faults = holding_faults(records, [LOCKSTRING], state)
    print(
        {
            "writers": WORKERS,
            "nodes written to": len(urls),
            "acquisitions": len(records),
            "per second": round(len(records) / elapsed, 1),
            **faults,
        }
    )
    return faults


@pytest.mark.parametrize("engine", ["sqllocker's", "caller's"])
def test_writers_on_every_node_never_hold_one_lockstring_at_once(
    cluster: GaleraCluster, tmp_path: Path, engine: str
) -> None:
    """Certification conflicts (two nodes inserting one lockstring) are retried, not raised;
    the tokens' order across nodes is not guaranteed, and the settings check says so.
    Through sqllocker's own connections a node never runs an aborted INSERT again by itself
    (its error is retried instead); through a caller's Engine it does, and each acquire reads
    its row back: either way every lock holds its row's id (see the next test)."""
    options = ("--callers-engine",) if engine == "caller's" else ()
    faults = contend(cluster, cluster.urls(), tmp_path, *options)
    assert faults["double holders"] == 0
    assert faults["lost updates"] == 0
    with (
        Locker(cluster.urls()[1], table=TABLE) as locker,
        pytest.warns(UnsafeDatabaseWarning, match="Galera cluster of 3 nodes"),
    ):
        locker.lock("check")
    with (
        Locker(cluster.urls()[1], table=TABLE, strict=True) as strict,
        pytest.raises(UnsafeDatabase, match="Galera"),
    ):
        strict.lock("check")


@pytest.mark.filterwarnings("ignore::sqllocker.UnsafeDatabaseWarning")  # reported above
def test_a_lone_acquire_reads_its_row_back_only_where_the_node_may_run_its_insert_again(
    cluster: GaleraCluster, mysql_url: str
) -> None:
    """A Galera node runs an autocommit INSERT that a replicated write aborted again by itself
    (``wsrep_retry_autocommit``), and its row may then stand under another id or not at all
    (with neither the setting nor the read-back, the test above catches it: a lock told lost at
    its release).
    sqllocker's own connections turn that off, so a lone acquire through them sends its INSERT
    and nothing more; through a caller's Engine, used as it is, it reads its row back. A group
    reads its rows back on a Galera node either way; a server without Galera reads nothing."""
    node = cluster.urls()[0]
    counting = sa.create_engine(resolve_url(node))
    with counting.connect() as status:

        def selects() -> int:
            return int(status.exec_driver_sql("SHOW GLOBAL STATUS LIKE 'Com_select'").one()[1])

        for kind, read_backs in (("sqllocker's", 0), ("caller's", 10)):
            callers = sa.create_engine(resolve_url(node))  # used for the caller's kind only
            target = node if kind == "sqllocker's" else callers
            with Locker(target, table=TABLE) as locker:
                locker.lock_info("read back count")  # set up first
                before = selects()
                for _ in range(10):
                    locker.lock("read back count").unlock()
                assert selects() - before == read_backs, kind
                if kind == "sqllocker's":
                    with locker.engine.connect() as conn:
                        retries = "SELECT @@session.wsrep_retry_autocommit"
                        assert conn.exec_driver_sql(retries).scalar() == 0
                    before = selects()
                    for lock in locker.lock_all(["read back a", "read back b"]):
                        lock.unlock()
                    assert selects() - before == 2, "a group's members are read back"
            callers.dispose()
    counting.dispose()
    engine = sa.create_engine(resolve_url(mysql_url))
    try:
        with engine.connect() as conn:
            settings = MySQLBackend.for_dialect(conn.dialect).read_settings(conn, TABLE)
    finally:
        engine.dispose()
    assert not settings.replays_inserts
    assert not settings.retries_autocommit


@pytest.mark.filterwarnings("ignore::sqllocker.UnsafeDatabaseWarning")  # reported above
def test_groups_taken_on_every_node_never_overlap_and_are_released_as_stored(
    cluster: GaleraCluster, tmp_path: Path
) -> None:
    """Groups of two taken by writers on every node: their transactions' certification
    conflicts are retried like a single row's, no two holders overlap, and every member is
    released as it was stored (a worker's ``unlock`` raises LockLost otherwise). A group is
    read back after its commit through any engine, though no run here has yet caught Galera
    replaying a group's transaction: its replay window is the COMMIT alone."""
    lockstrings = ["galera a", "galera b", "galera c"]
    started = time.monotonic()
    options = ("--count", str(GROUPS_EACH), "--expires", "30")
    reports = run_workers("pairs", cluster.urls(), tmp_path, lockstrings, *options)
    assert sum(report["overlaps"] for report in reports) == 0
    records = worker_records(tmp_path)
    assert len(records) == WORKERS * GROUPS_EACH * 2
    faults = holding_faults(records, lockstrings, tmp_path)
    assert faults["double holders"] == 0
    assert faults["lost updates"] == 0
    print({"groups": WORKERS * GROUPS_EACH, "seconds": round(time.monotonic() - started, 1)})


def test_lock_writes_through_one_node_keep_fencing_tokens_in_order(
    cluster: GaleraCluster, tmp_path: Path
) -> None:
    """What the docs prescribe: every lock operation through one node (a proxy or a floating
    address in front of the cluster), which draws every id from its own increasing series."""
    faults = contend(cluster, cluster.urls()[:1], tmp_path)
    assert faults == {"double holders": 0, "fencing inversions": 0, "lost updates": 0}


@pytest.mark.filterwarnings("ignore::sqllocker.UnsafeDatabaseWarning")  # reported above
def test_a_node_killed_mid_hold_lets_nobody_in_before_its_holder_is_told(
    cluster: GaleraCluster,
) -> None:
    """The holder's node dies while it holds a kept-alive lock: the row was on every node
    before the acquire returned, so the others refuse the lockstring until it expires, and by
    then the holder, unable to renew, has been told it lost the lock."""
    victim = cluster.nodes[2]
    url_of_victim, url_of_survivor = cluster.urls()[2], cluster.urls()[0]
    lost_at: list[float] = []
    holder = Locker(url_of_victim, table=TABLE, grace=0.5)
    contender = Locker(url_of_survivor, table=TABLE, grace=0.5)
    held = holder.lock(
        "nightly", expires=4, keep_alive=True, on_lost=lambda _: lost_at.append(time.monotonic())
    )
    cluster.kill(victim)
    killed_at = time.monotonic()
    cluster.wait_for_size(2, cluster.nodes[:2], seconds=60)
    refused = 0
    taken_at = None
    while taken_at is None and time.monotonic() < killed_at + 60:
        try:
            taken = contender.lock("nightly")
            taken_at = time.monotonic()
        except LockBusy:
            refused += 1
            time.sleep(0.1)
    assert taken_at is not None, "the dead holder's lock was never taken over"
    assert lost_at, "the holder was never told"
    assert lost_at[0] < taken_at, "taken over before its holder knew"
    assert taken.lock_id > held.lock_id
    with pytest.raises(LockLost):
        held.check()
    print(
        {
            "holder told after the kill (s)": round(lost_at[0] - killed_at, 2),
            "taken over after the kill (s)": round(taken_at - killed_at, 2),
            "refusals meanwhile": refused,
        }
    )
    taken.unlock()
    contender.close()
    holder_close = threading.Thread(target=holder.close, daemon=True)
    holder_close.start()  # its node is gone: closing may wait on a dead connection


@pytest.mark.parametrize("front", ["sync", "asyncio"])
@pytest.mark.parametrize("group", [False, True], ids=["one lock", "lock_all"])
@pytest.mark.filterwarnings("ignore::sqllocker.UnsafeDatabaseWarning")  # reported above
def test_an_acquire_whose_row_is_not_its_own_when_read_back_is_refused(
    cluster: GaleraCluster, front: str, group: bool
) -> None:
    """On a Galera node the table, not the INSERT's answer, says whether a lock was taken: the
    node's own retry of an INSERT that a replicated write aborted has told its client of a row
    the table then did not hold (the every-node test above caught it, rarely, on a loaded
    machine). Here another client breaks the new row and takes the lockstring between the
    INSERT and its read-back, which a proxy holds back: the acquire is refused, and a group
    gives back the members it did take. A lone acquire reads its row back through a caller's
    Engine (sqllocker's own connections turn the node's retries off: see above)."""
    node = cluster.nodes[0]
    proxy = StallProxy(node.port)
    url = cluster.urls()[0].replace(f":{node.port}/", f":{proxy.port}/")
    own = group  # else a caller's Engine
    kind = "group" if group else "one"
    names = [f"read back {front} {kind} {member}" for member in ("a", "b")[: 2 if group else 1]]
    breaker = Locker(cluster.urls()[0], table=TABLE)  # the same node, not through the proxy
    thief, taken = break_and_take_when_stalled(proxy, breaker, names[0])

    async def acquire_in_asyncio() -> None:
        callers = create_async_engine(resolve_url(url, asynchronous=True))
        async with AsyncLocker(url if own else callers, table=TABLE) as locker:
            await locker.lock_info(names[0])  # set up before the proxy waits for the read-back
            proxy.stall_before(READ_BACK)
            thief.start()
            with pytest.raises(LockBusy):
                await (locker.lock_all(names) if group else locker.lock(names[0]))
        await callers.dispose()

    try:
        if front == "asyncio":
            asyncio.run(acquire_in_asyncio())
        else:
            callers = sa.create_engine(resolve_url(url))
            with Locker(url if own else callers, table=TABLE) as locker:
                locker.lock_info(names[0])
                proxy.stall_before(READ_BACK)
                thief.start()
                with pytest.raises(LockBusy):
                    locker.lock_all(names) if group else locker.lock(names[0])
            callers.dispose()
        thief.join(30)
        assert len(taken) == 1, "the new row was not there to break while its read-back waited"
        held = breaker.lock_info(names[0])
        assert held is not None
        assert held.lock_id == taken[0].lock_id
        assert [breaker.lock_info(name) for name in names[1:]] == [None] * (len(names) - 1)
        taken[0].unlock()
    finally:
        proxy.close()
        breaker.close()
