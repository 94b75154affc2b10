"""A highly available PostgreSQL of a test's own: one etcd member and three PostgreSQL nodes
managed by Patroni, all on loopback ports, from Debian's ``patroni`` and ``etcd-server``
packages (``.ci/run`` installs them). Nothing of the shared servers is touched.

Patroni runs as the ``postgres`` user (PostgreSQL refuses root), with the shortest timings it
accepts (``ttl`` 20 s, ``loop_wait`` 1 s, ``retry_timeout`` 3 s), so a failover after a node
dies takes about 20 seconds and a switchover a few.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.conftest import IN_CI
from tests.private_servers import _free_port, _postgres_binaries
from tests.stall_proxy import StallProxy

SCOPE = "sqllocker-test"


@dataclass
class Node:
    """One Patroni node. Clients reach its PostgreSQL directly (``port``); the other nodes
    reach it, and it reaches etcd, through proxies, which ``PatroniCluster.partition`` stalls."""

    name: str
    port: int
    api_port: int
    config: Path
    to_etcd: StallProxy
    from_peers: StallProxy
    api_from_peers: StallProxy
    process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


class PatroniCluster:
    """Three Patroni nodes on one etcd; ``url`` names them all (libpq picks the primary)."""

    def __init__(self, home: Path, synchronous: bool) -> None:
        self.home = home
        self.synchronous = synchronous
        self.etcd_port, peer_port = _free_port(), _free_port()
        self.etcd: subprocess.Popen[bytes] | None = None
        self._etcd_command = [
            "etcd",
            *("--name", "sqllocker-etcd", "--data-dir", str(home / "etcd")),
            *("--listen-client-urls", f"http://127.0.0.1:{self.etcd_port}"),
            *("--advertise-client-urls", f"http://127.0.0.1:{self.etcd_port}"),
            *("--listen-peer-urls", f"http://127.0.0.1:{peer_port}"),
            *("--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}"),
            *("--initial-cluster", f"sqllocker-etcd=http://127.0.0.1:{peer_port}"),
        ]
        self.nodes = [self._node(f"node{index}") for index in range(1, 4)]
        self.cut_off: set[str] = set()  # partitioned nodes, whose view of the cluster is stale
        hosts = ",".join(node.address for node in self.nodes)
        self.url = f"postgresql://postgres@{hosts}/postgres"

    def _node(self, name: str) -> Node:
        binaries = _postgres_binaries()
        assert binaries is not None
        port, api_port = _free_port(), _free_port()
        node = Node(
            name,
            port,
            api_port,
            self.home / f"{name}.yml",
            to_etcd=StallProxy(self.etcd_port),
            from_peers=StallProxy(port),
            api_from_peers=StallProxy(api_port),
        )
        config = {
            "scope": SCOPE,
            "name": name,
            "log": {"dir": str(self.home / "logs" / name), "level": "INFO"},
            "restapi": {
                "listen": f"127.0.0.1:{node.api_port}",
                "connect_address": f"127.0.0.1:{node.api_from_peers.port}",
            },
            # Only through its proxy: no discovery of etcd's own address, which a partition
            # would not cut.
            "etcd3": {"hosts": f"127.0.0.1:{node.to_etcd.port}", "use_proxies": True},
            "bootstrap": {
                "dcs": {
                    "ttl": 20,
                    "loop_wait": 1,
                    "retry_timeout": 3,
                    "maximum_lag_on_failover": 1024 * 1024,
                    "synchronous_mode": self.synchronous,
                    "postgresql": {
                        "use_pg_rewind": False,
                        "parameters": {
                            "wal_level": "replica",
                            "hot_standby": "on",
                            "max_wal_senders": 10,
                            "max_replication_slots": 10,
                            "wal_keep_size": "128MB",
                        },
                    },
                },
                "initdb": [{"encoding": "UTF8"}, {"auth": "trust"}],
                "pg_hba": [
                    "local all all trust",
                    "host all all 127.0.0.1/32 trust",
                    "host replication all 127.0.0.1/32 trust",
                ],
            },
            "postgresql": {
                "listen": node.address,
                "connect_address": f"127.0.0.1:{node.from_peers.port}",
                "data_dir": str(self.home / name),
                "bin_dir": str(binaries),
                "pgpass": str(self.home / f"{name}.pgpass"),
                "authentication": {
                    "superuser": {"username": "postgres"},
                    "replication": {"username": "postgres"},
                },
                "parameters": {"unix_socket_directories": str(self.home)},
                # A replica that replayed WAL the promoted node never got cannot follow it:
                # Patroni copies it afresh.
                "remove_data_directory_on_diverged_timelines": True,
            },
            "tags": {"nofailover": False, "noloadbalance": False, "clonefrom": False},
        }
        (self.home / "logs" / name).mkdir(parents=True, exist_ok=True)
        node.config.write_text(json.dumps(config))  # JSON is YAML
        return node

    # -- running -----------------------------------------------------------------------------

    def _etcd_decided(self) -> bool:
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.etcd_port}/version", timeout=2
            ) as answer:
                version = json.loads(answer.read())
        except (OSError, ValueError):
            return False
        return str(version.get("etcdcluster", "not_decided")) != "not_decided"

    def start(self) -> None:
        self.etcd = subprocess.Popen(
            ["runuser", "-u", "postgres", "--", *self._etcd_command],
            stdout=(self.home / "etcd.log").open("wb"),
            stderr=subprocess.STDOUT,
        )
        # Patroni reads etcd's cluster version once, at start, and exits on "not_decided",
        # which a member just started reports for a moment (a CI run met it).
        self.wait_for(self._etcd_decided, "etcd's cluster version decided", 60)
        for node in self.nodes:
            self.start_node(node)
            if node is self.nodes[0]:
                self.wait_for(lambda: self.leader() is not None, "a leader", 60)
        self.wait_for(lambda: len(self.streaming()) == 2, "two streaming replicas", 90)
        if self.synchronous:
            self.wait_for(lambda: self.sync_standby() is not None, "a synchronous standby", 60)

    def start_node(self, node: Node) -> None:
        shutil.chown(self.home / "logs" / node.name, "postgres")
        node.process = subprocess.Popen(
            ["runuser", "-u", "postgres", "--", "patroni", str(node.config)],
            stdout=(self.home / f"{node.name}.out").open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def kill(self, node: Node) -> None:
        """The node's machine dies: Patroni and its PostgreSQL SIGKILLed at once."""
        assert node.process is not None
        postmaster = Path(self.home / node.name / "postmaster.pid")
        pid = int(postmaster.read_text().split()[0]) if postmaster.exists() else None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(node.process.pid, signal.SIGKILL)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(os.getpgid(pid), signal.SIGKILL)
                os.kill(pid, signal.SIGKILL)
        node.process.wait(10)
        node.process = None

    def revive(self) -> None:
        """Every node killed or cut off comes back as a new replica (its data wiped, as a
        replaced machine would), until the cluster is whole and healthy again."""
        for node in self.nodes:
            if node.process is not None and node.name not in self.cut_off:
                continue
            if node.process is not None:
                self.kill(node)
            for proxy in (node.to_etcd, node.from_peers, node.api_from_peers):
                proxy.resume()
            self.cut_off.discard(node.name)
            shutil.rmtree(self.home / node.name, ignore_errors=True)
            self.start_node(node)
        self.wait_for(lambda: len(self.streaming()) == 2, "two streaming replicas", 120)
        self.wait_for(self.healthy, "a primary and a synchronous standby", 60)

    def partition(self, node: Node) -> None:
        """Cut ``node`` off from etcd and the other nodes; clients still reach it."""
        self.cut_off.add(node.name)
        for proxy in (node.to_etcd, node.from_peers, node.api_from_peers):
            proxy.stall()

    def stop(self) -> None:
        for node in self.nodes:
            for proxy in (node.to_etcd, node.from_peers, node.api_from_peers):
                proxy.close()
        for node in self.nodes:
            if node.process is not None:
                with contextlib.suppress(Exception):
                    self.kill(node)
        # Postmasters whose Patroni died first: every process of ours, by its data directory.
        subprocess.run(["pkill", "-9", "-f", str(self.home)], check=False)
        if self.etcd is not None:
            self.etcd.kill()
            self.etcd.wait(10)

    # -- state, from Patroni's REST API ------------------------------------------------------

    def cluster(self) -> list[dict[str, Any]]:
        """The members as Patroni sees them, from the first node that answers."""
        for node in self.nodes:
            if node.process is None or node.name in self.cut_off:
                continue
            try:
                url = f"http://127.0.0.1:{node.api_port}/cluster"
                with urllib.request.urlopen(url, timeout=2) as answer:
                    members: list[dict[str, Any]] = json.load(answer)["members"]
                    return members
            except (OSError, urllib.error.URLError, ValueError):
                continue
        return []

    def leader(self) -> Node | None:
        """The primary, once it takes writes (Patroni names it leader a moment before)."""
        for member in self.cluster():
            if member["role"] == "leader" and member["state"] == "running":
                node = self.node(member["name"])
                return node if _takes_writes(node) else None
        return None

    def healthy(self) -> bool:
        """A primary, and a synchronous standby streaming with no lag (with synchronous_mode)."""
        members = self.cluster()
        standbys = [m for m in members if m["role"] == "sync_standby" or not self.synchronous]
        return any(m["role"] == "leader" and m["state"] == "running" for m in members) and any(
            m["state"] in ("running", "streaming") and m.get("lag") == 0 for m in standbys
        )

    def sync_standby(self) -> Node | None:
        for member in self.cluster():
            if member["role"] == "sync_standby" and member["state"] in ("running", "streaming"):
                return self.node(member["name"])
        return None

    def streaming(self) -> list[Node]:
        return [
            self.node(member["name"])
            for member in self.cluster()
            if member["role"] in ("replica", "sync_standby")
            and member["state"] in ("running", "streaming")
            and member.get("lag", 0) in (0, "0")
        ]

    def node(self, name: str) -> Node:
        return next(node for node in self.nodes if node.name == name)

    def switchover(self, candidate: Node) -> None:
        leader = self.leader()
        assert leader is not None
        body = json.dumps({"leader": leader.name, "candidate": candidate.name}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{leader.api_port}/switchover",
            data=body,
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=30) as answer:
            assert answer.status == 200, answer.read()

    def wait_for(self, condition: Any, what: str, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if condition():
                return
            time.sleep(0.2)
        logs = "\n".join(
            f"--- {path.name}\n{path.read_text(errors='replace')[-3000:]}"
            for path in sorted(self.home.glob("*.out"))
        )
        raise AssertionError(f"no {what} after {seconds}s: {self.cluster()}\n{logs}")


def _takes_writes(node: Node) -> bool:
    try:
        with psycopg.connect(
            host="127.0.0.1", port=node.port, user="postgres", dbname="postgres", connect_timeout=2
        ) as connection:
            row = connection.execute("SELECT pg_catalog.pg_is_in_recovery()").fetchone()
            return row is not None and not row[0]
    except psycopg.Error:
        return False


def patroni_missing() -> str | None:
    if shutil.which("patroni") is None or shutil.which("etcd") is None:
        return "needs Debian's patroni and etcd-server packages"
    if _postgres_binaries() is None or os.geteuid() != 0 or shutil.which("runuser") is None:
        return "needs the PostgreSQL binaries and root (to run Patroni as postgres)"
    return None


@contextlib.contextmanager
def running_patroni_cluster(synchronous: bool = True) -> Iterator[PatroniCluster]:
    """A started three-node Patroni cluster (skips, or fails under CI, without the packages)."""
    missing = patroni_missing()
    if missing is not None:
        if IN_CI:
            pytest.fail(missing)
        pytest.skip(missing)
    home = Path(tempfile.mkdtemp(prefix="sqllocker-patroni-"))
    shutil.chown(home, "postgres")
    os.chmod(home, 0o700)
    cluster = PatroniCluster(home, synchronous)
    for path in home.rglob("*"):
        shutil.chown(path, "postgres")
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(home, ignore_errors=True)
