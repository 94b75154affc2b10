"""The process that stops a command run under a lock if ``sqllocker run`` itself dies.

``sqllocker run`` starts this first, as the leader of a new process group, and then the command
in that group. It reads its standard input, a pipe from sqllocker, until the end: sqllocker
writes ``done`` before it closes the pipe once the command has ended. An end without ``done``
means sqllocker was killed (SIGKILL, the OOM killer) while the command ran, and the lock is no
longer renewed: the whole group (the command and whatever it started) gets SIGTERM, and SIGKILL
after the grace the user gave (``--kill-after``).

It is run as a script (``python -I -S watchdog.py``), not imported: it must start in
milliseconds, and needs nothing of sqllocker's. It ignores the signals sqllocker passes on to
the group, which are meant for the command.
"""

import os
import signal
import sys
import time


def main() -> int:
    kill_after = float(sys.argv[1])
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(signum, signal.SIG_IGN)
    told = sys.stdin.buffer.read()
    if told == b"done":
        return 0
    group = os.getpgrp()
    if kill_after > 0:
        os.killpg(group, signal.SIGTERM)
        time.sleep(kill_after)
    os.killpg(group, signal.SIGKILL)  # this process too: it is the group's leader
    return 1  # pragma: no cover - SIGKILL came first


if __name__ == "__main__":
    sys.exit(main())
