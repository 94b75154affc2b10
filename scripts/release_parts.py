"""Where a PostgreSQL release that hands the row over spends its time, part by part.

Under contention the release is on every waiter's path: with four processes taking turns, each
0.1 ms of it adds about 0.3 ms to every wait (``contended_turns.py``). This times the release's
DELETE alone, from one client, with the queue's head waiting on a second connection, and the
release trigger (migration 0005) swapped for variants of itself on a scratch table:

- ``as shipped``: the trigger as migrated (0007: the head's liveness told by its request's own
  key, with ``pg_try_advisory_xact_lock``);
- ``liveness in pg_locks``: 0005's test instead, the head's session looked up in ``pg_locks``;
- ``no liveness test``: the request granted without any test;
- ``no flush``: as shipped, but the grant's commit does not wait for the disk (unsafe: a
  grant lost in a crash would leave its waiter believing it holds the lock);
- ``nobody queued``: no request standing, so the release only deletes and notifies.

Each round times 400 releases per variant (after 50 unmeasured), variants in turn, and prints
the medians in milliseconds.

    .venv/bin/python scripts/release_parts.py --rounds 3
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psycopg

from scripts import bench
from sqllocker import Locker
from sqllocker.execution import Prepared

TABLE = "release_parts"
QUEUE_KEY = 7_000_000_001  # the scratch table's one queue
# The head's liveness test of migration 0007, and of 0005 before it, as the migration has them.
_MIGRATION = importlib.import_module("migrations.versions.0007_request_locks")
LIVENESS = f"AND {_MIGRATION.HEAD_HOLDS_ITS_KEY}"
IN_PG_LOCKS = f"AND {_MIGRATION.HEAD_IN_PG_LOCKS}"
FLUSH = "PERFORM set_config('synchronous_commit', 'on', true);"


def variants(shipped: str) -> dict[str, str | None]:
    """Each variant's trigger function (its CREATE OR REPLACE), None for no request standing."""
    for part in (LIVENESS, FLUSH):
        if part not in shipped:
            raise SystemExit(f"the release trigger has changed; update this script ({part!r})")
    return {
        "as shipped": shipped,
        "liveness in pg_locks": shipped.replace(LIVENESS, IN_PG_LOCKS),
        "no liveness test": shipped.replace(LIVENESS, ""),
        "no flush": shipped.replace(FLUSH, ""),
        "nobody queued": None,
    }


class Release:
    """A holder's connection and a waiting head's, on the scratch table."""

    def __init__(self, url: str) -> None:
        locker = Locker(url, table=TABLE)
        locker.lock("compile").unlock()
        table = locker._table
        dialect = table.engine.dialect
        self.acquire = Prepared(table.statements.acquire, dialect)
        self.release = Prepared(table.statements.release, dialect)
        self.ttl = table.backend.seconds_value(3600)
        self.minus_grace = table.backend.seconds_value(-1)
        self.holder = json.dumps({"host": "release_parts", "pid": os.getpid()})
        dsn = table.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
        locker.close()
        # As sqllocker's own sessions: every commit waits for the disk unless told otherwise.
        options = "-c synchronous_commit=on"
        self.holder_conn = psycopg.connect(dsn, autocommit=True, options=options)
        self.head_conn = psycopg.connect(dsn, autocommit=True, options=options)

    def shipped_trigger(self) -> str:
        row = self.holder_conn.execute(
            "SELECT pg_get_functiondef(%s::regproc)", (f"{TABLE}_notify_release",)
        ).fetchone()
        assert row is not None
        return str(row[0])

    def use_trigger(self, function: str) -> None:
        self.holder_conn.execute(function)

    def timed(self, queued: bool) -> float:
        """One release, in seconds, handing the row to a waiting head if ``queued``."""
        head_guid, holder_guid = os.urandom(16).hex(), os.urandom(16).hex()
        if queued:
            self.head_conn.execute(
                f"SELECT {TABLE}_queue_for_hand_off(%s, 1000, 'the lock', %s, %s, 3600)",
                (QUEUE_KEY, head_guid, self.holder),
            )
        values: dict[str, Any] = {
            "ls": "the lock",
            "lock_guid": holder_guid,
            "ttl": self.ttl,
            "minus_grace": self.minus_grace,
            "holder": {"host": "release_parts"},
        }
        row = self.holder_conn.execute(self.acquire.sql, self.acquire.parameters(values)).fetchone()
        assert row is not None, "the lock was held"
        mine = {"lock_id": row[0], "lock_guid": holder_guid}
        started = time.perf_counter()
        deleted = self.holder_conn.execute(self.release.sql, self.release.parameters(mine))
        took = time.perf_counter() - started
        assert deleted.rowcount == 1
        if queued:
            granted = self.head_conn.execute(
                f"SELECT {TABLE}_queue_leave(%s, 'the lock', %s, true)", (QUEUE_KEY, head_guid)
            ).fetchone()
            assert granted is not None
            if not granted[0]:
                raise SystemExit("the release did not hand the row over: nothing to measure")
        return took

    def close(self) -> None:
        self.holder_conn.close()
        self.head_conn.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--url", default=bench.URLS["postgresql"])
    args = parser.parse_args()
    bench.fresh_table(args.url, TABLE)
    medians: dict[str, list[float]] = {}
    release = Release(args.url)
    shipped = release.shipped_trigger()
    try:
        for _round in range(args.rounds):
            for name, function in variants(shipped).items():
                release.use_trigger(function or shipped)
                queued = function is not None
                for _ in range(50):
                    release.timed(queued)
                took = [release.timed(queued) for _ in range(400)]
                medians.setdefault(name, []).append(statistics.median(took) * 1000)
    finally:
        release.use_trigger(shipped)
        release.close()
        bench.drop_table(args.url, TABLE)
    for name, figures in medians.items():
        print(f"{name:22s} " + " ".join(f"{ms:.3f}" for ms in figures) + " ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
