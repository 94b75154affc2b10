"""What a campaign is made of, and what its seed decides.

The seed decides every random choice the campaign makes: each worker's operations and their
timings (a ``random.Random`` per operation, from the seed, the worker's number, how many times
it was restarted and the operation's place) and the nemesis's schedule of faults (kinds,
moments, and draws that pick a target and a duration). What the seed cannot decide is how the
operating system interleaves the processes: which waiter wins a race, whether a fault lands
inside or beside a critical section, hence which target a draw picks among those there are
then, how many operations fit in the time, and what each one meets.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# Plain locks (also taken in pairs by lock_all, and once each in the liveness phase).
LOCKS = ("c0", "c1", "c2")
# Locks only ``sqllocker run`` takes: their critical section is the command's process family.
RUN_LOCKS = ("r0",)
# Locks only the decorator takes (``DECORATED`` formatted with the argument).
DECORATED = "d{n}"
DECORATED_LOCKS = ("d0",)
SEMAPHORE = "s"
SEMAPHORE_LIMIT = 2

SYNC_OPERATIONS = (
    "lock_wait",
    "lock_nowait",
    "try_lock",
    "lock_all",
    "semaphore",
    "hold_at_least",
    "decorator",
    "run_command",
    "dawdle",
)
# asyncio workers also abandon acquires part-way (asyncio.wait_for around them).
ASYNC_OPERATIONS = (*SYNC_OPERATIONS[:-2], "cancelled", "dawdle")

FAULTS_EVERYWHERE = ("kill", "clock", "pause", "pause_runner", "break", "release_force", "purge")
FAULTS_ON_SERVERS = ("stall", "cut", "lose_answer")
# Only on a private server the campaign started itself (``--private-server``).
FAULTS_ON_PRIVATE_SERVERS = ("restart",)


@dataclass(frozen=True)
class Settings:
    backend: str
    seconds: float
    seed: int
    workers: int = 4  # half of them asyncio
    expires: float = 2.0
    grace: float = 1.0  # sqllocker run's (the CLI has no option for it)
    kill_after: float = 1.0  # ``run --kill-after``
    faults: tuple[str, ...] = ()  # empty: every kind the backend allows
    operations: tuple[str, ...] = ()  # empty: every kind
    mutant: str | None = None
    fault_gap: tuple[float, float] = (0.5, 2.5)
    private_server: bool = False  # a server of the campaign's own, which the nemesis restarts
    # Violations of these checks (checker.EARLY_CHECKS) end the faults as soon as the history
    # so far shows one (the campaigns against a broken library: what they must show is shown).
    stop_on: tuple[str, ...] = ()

    @property
    def liveness_wait(self) -> float:
        """How long each worker waits for each lock once the faults stop: far longer than any
        holder keeps a lock, or a dead holder's row lasts."""
        return 3 * (self.expires + self.grace) + 15.0

    def fault_kinds(self) -> tuple[str, ...]:
        allowed = FAULTS_EVERYWHERE + (FAULTS_ON_SERVERS if self.backend != "sqlite" else ())
        if self.private_server and self.backend != "sqlite":
            allowed += FAULTS_ON_PRIVATE_SERVERS
        return tuple(kind for kind in (self.faults or allowed) if kind in allowed)

    def worker_is_async(self, number: int) -> bool:
        return number % 2 == 1

    def operations_for(self, is_async: bool) -> tuple[str, ...]:
        kinds = ASYNC_OPERATIONS if is_async else SYNC_OPERATIONS
        return tuple(kind for kind in kinds if not self.operations or kind in self.operations)


def operation_rng(seed: int, worker: int, incarnation: int, step: int) -> random.Random:
    """The draws of one operation (which, on what, how long): the ``step``-th operation of a
    worker's incarnation is the same on every run of a seed, whatever the earlier ones met."""
    return random.Random(f"{seed}/worker {worker}/{incarnation}/{step}")


def nemesis_rng(seed: int) -> random.Random:
    return random.Random(f"{seed}/nemesis")
