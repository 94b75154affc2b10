"""This process's pid, kept current without a system call per lock operation.

Connections, listeners, keep-alive registries and locks belong to the process that made them:
a forked child must neither use its parent's sockets nor release or renew its parent's locks.
Each of them remembers the pid it was made in and compares it with ``pid`` here before acting.
``os.getpid()`` is a system call, and an uncontended cycle made seven: reading the pid from here
instead took a measurable share off the library's own Python a cycle. So the pid
is read once, and again in every child that ``os.fork()`` makes, before the fork returns to the
child's Python code (``os.register_at_fork``; ``multiprocessing``'s fork and forkserver
children, ``pty.fork()`` and a ``subprocess`` ``preexec_fn`` all come through it).
"""

from __future__ import annotations

import os

pid = os.getpid()


def _after_fork_in_child() -> None:
    global pid
    pid = os.getpid()


os.register_at_fork(after_in_child=_after_fork_in_child)
