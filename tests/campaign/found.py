"""Campaigns that found a violation, kept with what they showed and run again by the suite
(``pytest tests/test_campaign.py -k found``) as regression tests of their fixes. A seed replays
the schedule, not the interleaving: a run that does not meet the bug again proves little on its
own, which is why each bug also has a scenario test of its own (for the stopped runner:
``tests/test_run_family.py``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Found:
    backend: str
    seed: int
    options: str  # besides --backend, --seed and --seconds
    showed: str
    seconds: float = 20


FOUND = [
    Found(
        "postgresql",
        31,
        "--workers 6 --operations run_command --faults pause_runner",
        "run-exclusion: the sqllocker of a run stopped (SIGSTOP) for 3.2 s, past its lock's 2 s "
        "expiry; the next run took the lock and started its command 0.26 s before the resumed "
        "sqllocker stopped the first family (issue 56, item 1: the watchdog does not know the "
        "lock's deadline)",
    ),
    Found(
        "sqlite",
        23,
        "--workers 6 --operations run_command --faults pause_runner",
        "run-exclusion: the same on SQLite: a stopped runner's command ran on beside the next "
        "holder's for 0.1 s, to its own end",
    ),
]
