"""What both kinds of worker share: their configuration, how an operation's outcome is written
to the history, and the choice of the next operation."""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from sqllocker import DatabaseError, LockBusy, LockError, LockLost
from tests.campaign.history import History

# How often each operation is drawn, relative to the others (a dawdle takes seconds).
WEIGHTS = {"dawdle": 0.3, "run_command": 0.7, "hold_at_least": 0.5}


@dataclass(frozen=True)
class WorkerConfig:
    url: str
    table: str
    history: str
    number: int
    incarnation: int
    seed: int
    chaos_end_file: str  # holds when the faults stop (CLOCK_MONOTONIC), once all are ready
    expires: float
    grace: float
    kill_after: float
    liveness_wait: float
    operations: list[str]

    @property
    def name(self) -> str:
        return f"w{self.number}.{self.incarnation}"

    def to_json(self) -> str:
        return json.dumps(self.__dict__)


class ChaosEnd:
    """When the faults stop, as the campaign last wrote it (``chaos_end_file``, replaced whole
    by a rename): read again whenever the file was replaced, since a campaign run with
    ``--stop-on`` brings the end forward once its checker has seen what it was looking for."""

    def __init__(self, config: WorkerConfig) -> None:
        self.path = Path(config.chaos_end_file)
        self.version: tuple[int, int] | None = None  # the file's inode and mtime, as read
        self.moment = float("inf")

    def wait(self) -> float:
        """Once the campaign has written it: it starts its clock only when every first worker
        is ready, so that slow starts (imports on a loaded machine) take no time from the
        campaign."""
        while self.at() == float("inf"):
            time.sleep(0.05)
        return self.moment

    def at(self) -> float:
        try:
            status = os.stat(self.path)
            version = (status.st_ino, status.st_mtime_ns)
            if version != self.version:
                text = self.path.read_text()
                if text.endswith("\n"):
                    self.version, self.moment = version, float(text)
        except FileNotFoundError:
            pass
        return self.moment


def parse_config(argv: list[str] | None) -> WorkerConfig:
    # A worker that will not end is sent SIGUSR1 before it is killed: its threads' stacks go to
    # its log.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    return WorkerConfig(**json.loads(parser.parse_args(argv).config))


def next_operation(rng: random.Random, operations: list[str]) -> str:
    weights = [WEIGHTS.get(op, 1.0) for op in operations]
    return rng.choices(operations, weights)[0]


def outcome(history: History, op: str, error: BaseException, **fields: Any) -> None:
    """Record how an operation ended with ``error``: ``fail`` when it certainly did not take
    effect or the lock is known lost, ``info`` when the outcome is unknown."""
    kind = type(error).__name__
    if isinstance(error, LockBusy):
        history.record("fail", op=op, error=kind, **fields)
    elif isinstance(error, LockLost):
        history.record("fail", op=op, error=kind, lost=True, **fields)
    elif isinstance(error, DatabaseError):
        history.record(
            "info", op=op, error=kind, outage=error.outage, message=str(error)[:300], **fields
        )
    elif isinstance(error, (LockError, sa.exc.SQLAlchemyError, OSError, TimeoutError)):
        history.record("info", op=op, error=kind, message=str(error)[:200], **fields)
    else:
        raise error
