"""Libraries broken on purpose, to show that the checker catches what it claims.

A worker process (and the ``sqllocker`` of its ``run`` operations) whose environment names a
mutant in ``SQLLOCKER_CAMPAIGN_MUTANT`` patches the library in memory before it starts; the
library itself is never changed. The nemesis and the checker never apply one.

- ``release-skips-guid``: a release deletes the lockstring's row whoever holds it, and never
  says LockLost (a stale holder's release frees the next holder's lock);
- ``renewal-revives``: an extend renews the lockstring's row whoever's it is, expired or
  taken over (a holder that dawdled past its expiry goes on as if it still held the lock);
- ``run-never-stops``: ``sqllocker run`` never stops its command when the lock is lost;
- ``semaphore-limit-plus-one``: a semaphore admits one holder more than its limit;
- ``release-keeps-row``: a release reports success and deletes nothing (the row stays, held by
  nobody, until it expires);
- ``acquire-fails-after-insert``: every other acquire whose row is in fails with DatabaseError
  and leaves the row (held by nobody until it expires).
"""

from __future__ import annotations

import os
from datetime import datetime
from typing import Any

import sqlalchemy as sa

ENVIRONMENT_VARIABLE = "SQLLOCKER_CAMPAIGN_MUTANT"
MUTANTS = (
    "release-skips-guid",
    "renewal-revives",
    "run-never-stops",
    "semaphore-limit-plus-one",
    "release-keeps-row",
    "acquire-fails-after-insert",
)

_by_lockstring: dict[int, dict[str, Any]] = {}


def _statements(database: Any) -> dict[str, Any]:
    """This Database's mutant statements, keyed by name (made once: the driver session
    prepares each statement object once)."""
    sql = database.sql
    found = _by_lockstring.get(id(sql))
    if found is None:
        table = sql.table
        this = table.c.lockstring == sa.bindparam("ls")
        found = {
            "release": sa.delete(table).where(this),
            "extend": sa.update(table).where(this).values(expires=database.be.shifted_now("ttl")),
            "expires": sa.select(table.c.expires).where(this),
        }
        _by_lockstring[id(sql)] = found
    return found


def _release_skipping_guid(
    self: Any, lockstring: str, lock_id: int, guid: str, hold_at_least: float | None = None
) -> None:
    statement = _statements(self._db)["release"]
    self._db.run(lockstring, lambda conn: conn.affected(statement, {"ls": lockstring}))


def _extend_reviving(
    self: Any, lockstring: str, lock_id: int, guid: str, ttl: float, resent: Any = None
) -> datetime:
    statements = _statements(self._db)

    def extend(conn: Any) -> Any:
        params = {"ls": lockstring, "ttl": self._db.be.seconds_value(ttl)}
        conn.affected(statements["extend"], params)
        row = conn.execute(statements["expires"], {"ls": lockstring}).first()
        return None if row is None else row[0]

    expires: Any = self._db.run(lockstring, extend)
    if expires is None:  # no row at all: nothing to revive
        from sqllocker import LockLost

        raise LockLost(f"mutant: no row of {lockstring!r}", lockstring, lock_id)
    return expires  # type: ignore[no-any-return]


def _release_keeping_row(
    self: Any, lockstring: str, lock_id: int, guid: str, hold_at_least: float | None = None
) -> None:
    return None


def _failing_after_insert(original: Any) -> Any:
    acquired = 0

    def try_acquire(self: Any, lockstring: str, *args: Any, **kwargs: Any) -> Any:
        nonlocal acquired
        from sqllocker import DatabaseError
        from sqllocker.operations import Acquired

        outcome = original(self, lockstring, *args, **kwargs)
        if isinstance(outcome, Acquired):
            acquired += 1
            if acquired % 2 == 1:
                raise DatabaseError(f"mutant: the row of {lockstring!r} is in; failing", lockstring)
        return outcome

    return try_acquire


def _never_stop(self: Any) -> None:
    return None


def _no_deadline(lock: Any) -> tuple[float, float]:
    """A watchdog told of no deadline: it never stops the family of a stopped sqllocker."""
    return float("inf"), float("inf")


def apply(name: str | None = None) -> str | None:
    """Apply the mutant ``name`` (else the one the environment names); returns its name."""
    name = name or os.environ.get(ENVIRONMENT_VARIABLE) or None
    if name is None:
        return None
    if name not in MUTANTS:
        raise SystemExit(f"unknown mutant {name!r}; one of {', '.join(MUTANTS)}")
    from sqllocker.operations.acquire import Acquirer
    from sqllocker.operations.release import Releaser

    if name == "release-skips-guid":
        Releaser.release = _release_skipping_guid  # type: ignore[method-assign]
    elif name == "renewal-revives":
        Releaser.extend = _extend_reviving  # type: ignore[method-assign]
    elif name == "run-never-stops":
        from sqllocker import runner

        # Neither sqllocker (when it finds its lock lost) nor its watchdog (when the lock's
        # deadline passes) stops the command's family.
        runner._Family.stop = _never_stop  # type: ignore[method-assign]
        runner._deadlines = _no_deadline
    elif name == "release-keeps-row":
        Releaser.release = _release_keeping_row  # type: ignore[method-assign]
    elif name == "acquire-fails-after-insert":
        Acquirer.try_acquire = _failing_after_insert(  # type: ignore[method-assign]
            Acquirer.try_acquire
        )
    else:
        from sqllocker import semaphore
        from sqllocker.asyncio import semaphore as async_semaphore

        original = semaphore.check_semaphore

        def one_more(name: object, limit: object) -> tuple[str, int]:
            checked, checked_limit = original(name, limit)
            return checked, checked_limit + 1

        semaphore.check_semaphore = one_more  # type: ignore[assignment]
        async_semaphore.check_semaphore = one_more  # type: ignore[assignment]
    return name
