"""The COMMAND a worker's ``sqllocker run`` runs: a family of two processes (this one and a child
it starts), each recording in the history when it starts, every few hundredths of a second
while it works, and when it stops (at its end, or on SIGTERM). The checker finds a family's
interval from these events, under the fencing token ``run`` gave it ($SQLLOCKER_LOCK_ID).

``python -m tests.campaign.command HISTORY SECONDS [--child]``
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from types import FrameType

from tests.campaign.history import History

TICK = 0.03


def main(argv: list[str]) -> int:
    path, seconds = argv[0], float(argv[1])
    is_child = "--child" in argv
    history = History(path, "command")
    fields = {
        "ls": os.environ.get("SQLLOCKER_LOCKSTRING"),
        "id": int(os.environ.get("SQLLOCKER_LOCK_ID", "0")),
        "child": is_child,
    }

    def stop(signum: int, _frame: FrameType | None) -> None:
        history.record("cmd", phase="stop", signal=signum, **fields)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    history.record("cmd", phase="start", **fields)
    child = None
    if not is_child:
        child = subprocess.Popen([sys.executable, "-m", "tests.campaign.command", *argv, "--child"])
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(TICK)
        history.record("cmd", phase="tick", **fields)
    if child is not None:
        child.wait()
    history.record("cmd", phase="stop", **fields)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
