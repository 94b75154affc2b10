"""Database servers of a test's own, never the shared ones: to stop, crash, or attach a debugger to.

They run as the servers' own users (initdb and mariadbd refuse root), so tests using them need
root and the servers' binaries: ``running_private_server`` fails under CI without them, and
skips elsewhere.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from tests.conftest import IN_CI


@contextlib.contextmanager
def running_private_server(kind: str, *options: str) -> Iterator[PrivatePostgres | PrivateMariaDB]:
    """A fresh, started server of ``kind`` ("postgresql" or "mysql"), removed afterwards;
    MariaDB's ``options`` go to mariadbd."""
    message = private_servers_missing()
    if message is not None:
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    with private_server(kind, *options) as server:
        yield server


@contextlib.contextmanager
def private_server(kind: str, *options: str) -> Iterator[PrivatePostgres | PrivateMariaDB]:
    """``running_private_server`` outside pytest: the caller has made sure that
    ``private_servers_missing()`` is None."""
    binaries = _postgres_binaries()
    assert binaries is not None
    with _home_of("postgres" if kind == "postgresql" else "mysql") as home:
        server = (
            PrivatePostgres(home, binaries)
            if kind == "postgresql"
            else PrivateMariaDB(home, *options)
        )
        with _started(server):
            yield server


def private_servers_missing() -> str | None:
    """Why private servers cannot be run here, or None if they can."""
    if _postgres_binaries() is None or os.geteuid() != 0 or shutil.which("runuser") is None:
        return "needs the database servers' binaries and root (to run them as their users)"
    return None


@contextlib.contextmanager
def running_standby(primary: PrivatePostgres) -> Iterator[PrivatePostgres]:
    """A streaming standby of ``primary`` (``pg_basebackup -R``: asynchronous unless the primary
    names it in ``synchronous_standby_names``), started and removed afterwards."""
    binaries = _postgres_binaries()
    assert binaries is not None
    with _home_of("postgres") as home:
        standby = PrivatePostgres(home, binaries, base_backup_of=primary)
        with _started(standby):
            yield standby


@contextlib.contextmanager
def _home_of(owner: str) -> Iterator[Path]:
    """A directory for one private server, owned by the user it runs as, removed afterwards.
    Not under pytest's temporary directory: only root may enter that."""
    home = Path(tempfile.mkdtemp(prefix="sqllocker-private-db-"))
    shutil.chown(home, owner)
    try:
        yield home
    finally:
        shutil.rmtree(home, ignore_errors=True)


@contextlib.contextmanager
def _started(server: PrivatePostgres | PrivateMariaDB) -> Iterator[None]:
    """``server`` running until the block ends, then stopped as a crash would stop it."""
    server.start()
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            server.stop(crash=True)


def _postgres_binaries() -> Path | None:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"))
    return found[-1].parent if found else None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _run_as(user: str, *command: str) -> None:
    subprocess.run(
        ["runuser", "-u", user, "--", *command], check=True, capture_output=True, timeout=120
    )


class PrivatePostgres:
    """A PostgreSQL server of this test's own, never the shared one, to stop and crash."""

    def __init__(
        self, home: Path, binaries: Path, base_backup_of: PrivatePostgres | None = None
    ) -> None:
        self.home, self.data, self.port = home, home / "data", _free_port()
        self.pg_ctl = str(binaries / "pg_ctl")
        self.psql = str(binaries / "psql")
        if base_backup_of is None:
            _run_as(
                "postgres",
                str(binaries / "initdb"),
                "-D",
                str(self.data),
                "-A",
                "trust",
                "-U",
                "postgres",
            )
        else:
            _run_as(
                "postgres",
                str(binaries / "pg_basebackup"),
                *("-h", "127.0.0.1", "-p", str(base_backup_of.port), "-U", "postgres"),
                *("-D", str(self.data), "-R", "-X", "stream"),
            )
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> None:
        options = f"-p {self.port} -k {self.home} -c listen_addresses=127.0.0.1"
        _run_as(
            "postgres",
            self.pg_ctl,
            "-D",
            str(self.data),
            "-o",
            options,
            "-l",
            str(self.home / "log"),
            "-w",
            "start",
        )

    def sql(self, statement: str) -> str:
        """Run ``statement`` as the superuser (ALTER SYSTEM runs in no transaction block)."""
        return subprocess.run(
            [
                "runuser",
                "-u",
                "postgres",
                "--",
                self.psql,
                "-h",
                "127.0.0.1",
                "-p",
                str(self.port),
                "-U",
                "postgres",
                "-Atc",
                statement,
            ],
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout.strip()

    def stop(self, crash: bool) -> None:
        # "immediate" skips the shutdown checkpoint: recovery replays the WAL, as after a crash.
        mode = "immediate" if crash else "fast"
        _run_as("postgres", self.pg_ctl, "-D", str(self.data), "-m", mode, "-w", "stop")


class PrivateMariaDB:
    """A MariaDB server of this test's own, never the shared one, to stop, crash, start with
    other settings, or attach gdb to."""

    def __init__(self, home: Path, *options: str) -> None:
        self.home, self.data, self.port = home, home / "data", _free_port()
        self.options = options  # mariadbd's own, e.g. "--innodb-autoinc-lock-mode=2"
        installed = subprocess.run(
            [
                "mariadb-install-db",
                "--no-defaults",
                f"--datadir={self.data}",
                "--user=mysql",
                "--auth-root-authentication-method=normal",
                "--skip-test-db",
                # Temporary tables in a directory of this server's own: mariadbd processes
                # sharing /tmp remove each other's ("Could not remove temporary table:
                # '/tmp/#sql-temptable-...'"), installs and the shared server's queries fail.
                f"--tmpdir={home}",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert installed.returncode == 0, installed.stdout + installed.stderr
        self.url = f"mysql://root@127.0.0.1:{self.port}/mysql"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            [
                "runuser",
                "-u",
                "mysql",
                "--",
                "/usr/sbin/mariadbd",
                "--no-defaults",
                f"--datadir={self.data}",
                f"--socket={self.home / 'sock'}",
                f"--port={self.port}",
                "--bind-address=127.0.0.1",
                f"--pid-file={self.home / 'pid'}",
                f"--tmpdir={self.home}",  # as at install: not /tmp, which others share
                *self.options,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                assert time.monotonic() < deadline, "private MariaDB did not start"
                time.sleep(0.1)

    @property
    def pid(self) -> int:
        """mariadbd's process id (runuser's child, not ``self.process``)."""
        return int((self.home / "pid").read_text())

    def stop(self, crash: bool) -> None:
        """SIGTERM (a normal shutdown) or SIGKILL; a SIGTERM that mariadbd still starting up
        missed is followed by SIGKILL after a minute."""
        pid = self.pid
        os.kill(pid, signal.SIGKILL if crash else signal.SIGTERM)
        deadline = time.monotonic() + 60
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                deadline = float("inf")
            time.sleep(0.05)
        if self.process is not None:
            self.process.wait(timeout=60)


@contextlib.contextmanager
def running_pgbouncer(
    server_url: str, pool_mode: str = "transaction", ignore_options: bool = False
) -> Iterator[str]:
    """A PgBouncer of this test's own in front of ``server_url``'s server (every database of
    it), in ``pool_mode``; in transaction mode with a pool of two server connections per
    database, so that a client's statements land on different server sessions. It yields
    ``server_url`` through it. It refuses the ``options`` startup parameter unless
    ``ignore_options``. It runs as ``postgres`` (PgBouncer refuses root): under CI it must be
    installed."""
    binary = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
    if not Path(binary).exists() or os.geteuid() != 0 or shutil.which("runuser") is None:
        message = "needs PgBouncer (Debian's pgbouncer package) and root (to run it as postgres)"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    url = make_url(server_url)
    home = Path(tempfile.mkdtemp(prefix="sqllocker-pgbouncer-"))
    port = _free_port()
    # In session mode each client keeps its server connection: the pool must cover them all.
    size = 2 if pool_mode == "transaction" else 20
    (home / "users.txt").write_text(f'"{url.username}" ""\n')
    (home / "pgbouncer.ini").write_text(
        "[databases]\n"
        f"* = host={url.host} port={url.port or 5432}\n"
        "[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
        f"auth_type = trust\nauth_file = {home / 'users.txt'}\n"
        f"pool_mode = {pool_mode}\ndefault_pool_size = {size}\nmax_client_conn = 500\n"
        + ("ignore_startup_parameters = options\n" if ignore_options else "")
        + f"pidfile = {home / 'pid'}\nlogfile = {home / 'log'}\n"
    )
    shutil.chown(home, "postgres")
    for path in home.iterdir():
        shutil.chown(path, "postgres")
    process = subprocess.Popen(
        ["runuser", "-u", "postgres", "--", binary, str(home / "pgbouncer.ini")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert process.poll() is None, (home / "log").read_text(errors="replace")
                assert time.monotonic() < deadline, "PgBouncer did not start"
                time.sleep(0.05)
        yield url.set(port=port).render_as_string(hide_password=False)
    finally:
        with contextlib.suppress(Exception):
            os.kill(int((home / "pid").read_text()), signal.SIGTERM)
        with contextlib.suppress(Exception):
            process.wait(timeout=30)
        if process.poll() is None:
            process.kill()
            process.wait()
        shutil.rmtree(home, ignore_errors=True)
