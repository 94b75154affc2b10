"""The clock a lock's validity deadline is kept on.

``time.monotonic`` stops while the machine is suspended: a laptop or VM resumed after its lock's
row expired would still call the lock valid. Linux's ``CLOCK_BOOTTIME`` runs on through suspend
and is as cheap to read; elsewhere the monotonic clock is the best there is.
"""

from __future__ import annotations

import time

if hasattr(time, "CLOCK_BOOTTIME"):
    _BOOTTIME = time.CLOCK_BOOTTIME

    def now() -> float:
        """Seconds on a clock that never goes back and counts time spent suspended."""
        return time.clock_gettime(_BOOTTIME)

else:  # pragma: no cover - macOS, Windows
    now = time.monotonic
