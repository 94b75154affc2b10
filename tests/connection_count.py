"""This process's connections to a database, counted from /proc: what the tests that bound a
Locker's connections sample while its waiters wait."""

from __future__ import annotations

import os
import threading

SAMPLE_SECONDS = 0.02


def _socket_inodes() -> set[str]:
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def open_connections(url: str) -> int:
    """This process's connections to ``url``'s server now (TCP sockets to its port), or for an
    SQLite database, its open descriptors of the database file."""
    if url.startswith("sqlite"):
        database = url.removeprefix("sqlite:///")
        count = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            count += target.endswith(os.path.basename(database))
        return count
    port = 5432 if url.startswith("postgresql") else 3306
    mine = _socket_inodes()
    count = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as lines:
            next(lines)
            for line in lines:
                fields = line.split()
                remote_port = int(fields[2].rsplit(":", 1)[1], 16)
                established = fields[3] == "01"
                count += established and remote_port == port and fields[9] in mine
    return count


class Sampler:
    """The most connections this process had open, sampled every SAMPLE_SECONDS."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.most = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_SECONDS):
            self.most = max(self.most, open_connections(self.url))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.most
