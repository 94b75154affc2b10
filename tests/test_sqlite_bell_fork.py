"""A forked child does not keep the inotify instance of its parent's bell reader: inotify
instances are limited per user (``fs.inotify.max_user_instances``, 128 by default), and every
long-lived child forked while its parent waited would pin one."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

import pytest

from sqllocker import Locker
from sqllocker.file_queue import AVAILABLE
from tests.helpers import wait_until

pytestmark = pytest.mark.skipif(not AVAILABLE, reason="open file description locks are Linux's")


def inotify_fds() -> int:
    found = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            found += os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:inotify"
    return found


def test_a_child_forked_while_its_parent_waits_keeps_no_inotify_instance(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'locks.db'}"
    holder, waiter = Locker(url, grace=0), Locker(url, grace=0)
    # The bell readers of earlier tests end within their poll once their waiters have gone.
    wait_until(lambda: not any(t.name.endswith(" bell") for t in threading.enumerate()))
    before = inotify_fds()
    held = holder.lock("report", expires=30)
    waiting = threading.Thread(target=lambda: waiter.lock("report", wait=20, expires=30).unlock())
    waiting.start()
    time.sleep(0.5)  # the waiter's bell reader watches the queue file
    assert inotify_fds() == before + 1
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        os.close(read)
        os.write(write, bytes([inotify_fds()]))
        os._exit(0)
    os.close(write)
    in_child = os.read(read, 1)[0]
    os.close(read)
    os.waitpid(pid, 0)
    held.unlock()
    waiting.join(10)
    holder.close()
    waiter.close()
    assert in_child == before
