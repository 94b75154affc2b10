"""A MariaDB Galera cluster of a test's own: three ``mariadbd`` nodes with the installed galera-4
provider, bootstrapped on loopback ports (group communication, IST and rsync SST each on a port
of their own). Nothing of the shared server is touched.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pymysql
import pytest

from tests.conftest import IN_CI
from tests.private_servers import PrivateMariaDB, _free_port, _home_of

PROVIDER = Path("/usr/lib/galera/libgalera_smm.so")


class GaleraCluster:
    def __init__(self, homes: list[Path]) -> None:
        group_ports = [_free_port() for _ in homes]
        members = ",".join(f"127.0.0.1:{port}" for port in group_ports)
        self.nodes: list[PrivateMariaDB] = []
        for index, (home, group_port) in enumerate(zip(homes, group_ports, strict=True)):
            provider_options = (
                f"gmcast.listen_addr=tcp://127.0.0.1:{group_port};"
                f"ist.recv_addr=127.0.0.1:{_free_port()};gcache.size=64M;"
                # Kill a node and the others go on in seconds, not after the default 5+ s.
                "evs.suspect_timeout=PT3S;evs.inactive_timeout=PT5S;evs.install_timeout=PT5S"
            )
            options = [
                "--wsrep-on=ON",
                f"--wsrep-provider={PROVIDER}",
                f"--wsrep-cluster-address=gcomm://{members}",
                "--wsrep-cluster-name=sqllocker-test",
                f"--wsrep-node-name=node{index + 1}",
                f"--wsrep-node-address=127.0.0.1:{group_port}",
                f"--wsrep-provider-options={provider_options}",
                "--wsrep-sst-method=rsync",
                f"--wsrep-sst-receive-address=127.0.0.1:{_free_port()}",
                "--binlog-format=ROW",
                "--innodb-autoinc-lock-mode=2",
                "--innodb-flush-log-at-trx-commit=1",
                "--log-error=" + str(home / "error.log"),
            ]
            if index == 0:
                options.append("--wsrep-new-cluster")
            self.nodes.append(PrivateMariaDB(home, *options))

    def urls(self) -> list[str]:
        return [node.url.replace("/mysql", "/sqllocker") for node in self.nodes]

    def start(self) -> None:
        for node in self.nodes:
            node.start()  # a joiner answers once its state transfer is done
            self.wait_for_size(self.nodes.index(node) + 1, [node])
        self.query(self.nodes[0], "CREATE DATABASE sqllocker")

    def query(self, node: PrivateMariaDB, statement: str) -> list[tuple[object, ...]]:
        connection = pymysql.connect(
            host="127.0.0.1", port=node.port, user="root", autocommit=True, connect_timeout=5
        )
        try:
            with connection.cursor() as cursor:
                cursor.execute(statement)
                return list(cursor.fetchall())
        finally:
            connection.close()

    def status(self, node: PrivateMariaDB, name: str) -> str | None:
        try:
            rows = self.query(node, f"SHOW STATUS LIKE '{name}'")
        except pymysql.Error:
            return None
        return str(rows[0][1]) if rows else None

    def wait_for_size(self, size: int, nodes: list[PrivateMariaDB], seconds: float = 90) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if all(
                self.status(node, "wsrep_cluster_size") == str(size)
                and self.status(node, "wsrep_local_state_comment") == "Synced"
                for node in nodes
            ):
                return
            time.sleep(0.2)
        log = (nodes[-1].home / "error.log").read_text(errors="replace")[-3000:]
        raise AssertionError(f"the Galera cluster did not reach {size} synced nodes:\n{log}")

    def kill(self, node: PrivateMariaDB) -> None:
        os.kill(node.pid, signal.SIGKILL)
        if node.process is not None:
            node.process.wait(30)
        node.process = None

    def stop(self) -> None:
        for node in self.nodes:
            if node.process is not None:
                with contextlib.suppress(Exception):
                    node.stop(crash=True)


def galera_missing() -> str | None:
    if not PROVIDER.exists() or shutil.which("wsrep_sst_rsync") is None:
        return "needs the galera-4 provider and MariaDB's rsync state transfer"
    if os.geteuid() != 0 or shutil.which("runuser") is None:
        return "needs root (to run mariadbd as mysql)"
    return None


@contextlib.contextmanager
def running_galera_cluster() -> Iterator[GaleraCluster]:
    """A started three-node Galera cluster (skips, or fails under CI, without galera-4)."""
    missing = galera_missing()
    if missing is not None:
        if IN_CI:
            pytest.fail(missing)
        pytest.skip(missing)
    with contextlib.ExitStack() as homes:
        cluster = GaleraCluster([homes.enter_context(_home_of("mysql")) for _ in range(3)])
        try:
            cluster.start()
            yield cluster
        finally:
            cluster.stop()
