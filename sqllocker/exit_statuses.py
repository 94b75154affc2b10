"""The ``sqllocker`` command's exit statuses, grep's way: 0 the positive answer, or done; 1 the
negative answer only; 2 no answer: an error. A script that tests for 1 (``sqllocker show
nightly; [ $? -eq 1 ] && start_nightly``) then never takes an outage for "not held". ``run``
adds the shells' and flock(1)'s: the command's own, 128+N, 126, 127, and 75 (EX_TEMPFAIL)."""

from __future__ import annotations

import signal

EXIT_OK = 0
# show: not held (an expired row included); leader: nobody leads; migrate --check: behind;
# release: nothing to break; run: the lock is held by someone else (unless -E N).
EXIT_NO = 1
# A usage error, or any error that kept the command from answering (the database unreachable,
# the table missing, a value the library refuses).
EXIT_ERROR = 2
EXIT_LOCK_LOST = 75  # run: the command ran, but not (all of it) under the lock
EXIT_CANNOT_EXECUTE = 126
EXIT_NOT_FOUND = 127
EXIT_SIGNAL = 128  # run: 128+N, the command died of signal N (or the wait was, before it ran)
EXIT_INTERRUPTED = EXIT_SIGNAL + signal.SIGINT  # Ctrl-C, outside run's command

__all__ = [
    "EXIT_CANNOT_EXECUTE",
    "EXIT_ERROR",
    "EXIT_INTERRUPTED",
    "EXIT_LOCK_LOST",
    "EXIT_NO",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_SIGNAL",
]
