"""The purge of rows expired beyond grace, and of the tickets of waiters gone."""

from __future__ import annotations

import logging

from .. import clock
from ..execution import DriverSession
from .database import Database
from .release import Releaser

logger = logging.getLogger("sqllocker")


class Purge:
    """Deletes what nobody holds any more from ``database``'s table; ``checkpoints`` copies
    SQLite's log back after each batch."""

    def __init__(self, database: Database, checkpoints: Releaser) -> None:
        self._db = database
        self._checkpoints = checkpoints

    def purge_expired(self, batch_size: int, pause_ratio: float) -> int:
        """Delete rows expired beyond grace in batches, each its own short transaction, so a
        large purge never blocks acquirers for long; returns how many.

        After each full batch it rests ``pause_ratio`` times as long as the batch took: a purge
        flat out keeps a server core busy (and its commits share the log flush with the
        acquirers'), which on a small machine multiplied a concurrent worker's p99 by 4-7.
        It then sweeps the tickets of waiters gone since (``Statements.sweep_stale_requests``),
        which nothing else might ever delete.
        """
        total = 0
        while True:
            started = clock.now()
            deleted = self._db.run(None, lambda conn: self._purge_batch(conn, batch_size))
            total += deleted
            if deleted < batch_size:
                break
            if pause_ratio:
                self._db.sleep((clock.now() - started) * pause_ratio)
        if total:
            logger.info("purged %d expired lock(s) from %s", total, self._db.table_name)
        if self._db.sql.sweep_stale_requests is not None:
            swept = self._db.run(None, self._sweep_stale_requests)
            if swept:
                logger.info(
                    "swept %d ticket(s) of Lockers gone from %s", swept, self._db.table_name
                )
        return total

    def _purge_batch(self, conn: DriverSession, batch_size: int) -> int:
        params = self._db.expiry
        # Not ``affected``: a batch of many rows is no statement for the event loop's thread
        # (``DriverSession.affected``).
        deleted = conn.execute(self._db.sql.purge_batch(batch_size), params).rowcount
        if deleted:
            # The purge pays for its own WAL pages here, rather than the next lock operation.
            self._checkpoints.checkpoint_on(conn)
        return deleted

    def _sweep_stale_requests(self, conn: DriverSession) -> int:
        sweep = self._db.sql.sweep_stale_requests
        if sweep is None:
            return 0
        result = conn.execute(sweep)
        return int(result.one().swept) if self._db.be.hands_over else result.rowcount
