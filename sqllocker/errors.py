"""The one hierarchy of sqllocker errors, rooted at :class:`LockError`.

Every error carries the lockstring it concerns (``None`` when it concerns no single lock) so that a
caller juggling many locks can tell which one failed without parsing the message, and every error
pickles, so it survives being raised in a worker process and re-raised in its parent.
"""

from __future__ import annotations

import shlex
import socket
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from . import forks


class LockError(Exception):
    """Base class of every error sqllocker raises on purpose."""

    def __init__(self, message: str, lockstring: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.lockstring = lockstring

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[Any, ...]:
        # Exception pickles as cls(*self.args), which would drop the keyword attributes of the
        # subclasses; rebuild from the full __dict__ instead.
        return (_rebuild, (type(self), self.__dict__))


def _rebuild(cls: type[LockError], state: dict[str, Any]) -> LockError:
    error = cls.__new__(cls)
    Exception.__init__(error, state.get("message", ""))
    error.__dict__.update(state)
    return error


class LockValueError(LockError, ValueError):
    """An argument has the right type but a value sqllocker refuses; nothing was sent."""


class LockTypeError(LockError, TypeError):
    """An argument has the wrong type; nothing was sent to the database."""


class LockBusy(LockError):
    """The lock is held by someone else (and ``wait`` ran out, if one was given).

    The holder's row is described by :attr:`holder` (the ``locked_by`` JSON), :attr:`lock_id`,
    :attr:`created` and :attr:`expires`, each ``None`` if the row vanished before it could be read.
    :attr:`key_holder_pid` (PostgreSQL): the lockstring could not even be tried, because a
    session that holds no row has held its advisory key (which acquirers take only for their
    INSERT) for longer than an acquire waits for it; that session's pid.
    """

    def __init__(
        self,
        lockstring: str,
        *,
        holder: Mapping[str, Any] | None = None,
        lock_id: int | None = None,
        created: datetime | None = None,
        expires: datetime | None = None,
        waited: float = 0.0,
        key_holder_pid: int | None = None,
    ) -> None:
        self.holder = dict(holder) if holder is not None else None
        self.lock_id = lock_id
        self.created = created
        self.expires = expires
        self.waited = waited
        self.key_holder_pid = key_holder_pid
        super().__init__(_busy_message(lockstring, self), lockstring)

    @property
    def host(self) -> str | None:
        return _str_or_none((self.holder or {}).get("host"))

    @property
    def pid(self) -> int | None:
        pid = (self.holder or {}).get("pid")
        return pid if isinstance(pid, int) else None


class LockLost(LockError):
    """A lock we held is no longer ours: it expired and was purged or taken over, or was broken.

    Raised by ``unlock()``, ``extend()`` and ``check()``. Whatever the holder was protecting may
    have been touched by someone else since; the fencing token (``lock_id``) is how a protected
    resource tells the stale holder's writes from the new holder's.
    """

    def __init__(self, message: str, lockstring: str | None = None, lock_id: int | None = None):
        super().__init__(message, lockstring)
        self.lock_id = lock_id


class TableMissing(LockError):
    """The lock table does not exist; the message names the command that creates it."""


class ForeignTable(LockError):
    """The lock table was not made by sqllocker (a DBIx::Locker table, say): every operation
    refuses it, purge included, as its rows do not mean what sqllocker's mean; the message
    names the command that adopts it."""

    @classmethod
    def naming(cls, table: str, where: str, reason: str) -> ForeignTable:
        return cls(
            f"lock table {table!r} in {where} was not made by sqllocker ({reason}: a "
            f"DBIx::Locker table?); convert it, keeping its rows, with `sqllocker --url URL "
            f"--table {table} migrate --adopt-dbix-locker --perl-tz ZONE`"
        )


class UnsafeDatabase(LockError):
    """The database is configured so that a guarantee does not hold: a crash can lose an
    acknowledged lock row, or lock ids can come out of holding order (raised with
    ``strict=True``; otherwise an ``UnsafeDatabaseWarning`` is issued)."""


class UnsafeDatabaseWarning(UserWarning):
    """The database is configured so that a guarantee of the locks does not hold."""


class DatabaseError(LockError):
    """The database could not be reached, or failed; the driver's error is the ``__cause__``.

    ``outage``: the database was reachable before and is not now, or takes no writes (a
    failover under way, a restart): a waiting acquire with time left waits through it.
    """

    def __init__(self, message: str, lockstring: str | None = None, outage: bool = False) -> None:
        super().__init__(message, lockstring)
        self.outage = outage


class NotDurable(DatabaseError):
    """A lock statement that succeeded on the server, whose commit may yet be lost with a
    failover: PostgreSQL's wait for its synchronous standbys was cancelled. What it wrote is
    not counted on (an outage: a waiting acquire tries again)."""

    def __init__(self, message: str, lockstring: str | None = None) -> None:
        super().__init__(message, lockstring, outage=True)


def one_line(text: object) -> str:
    """A driver's message folded onto one line, for one-line errors and logs."""
    return " ".join(str(text).split())


# What reading back a value that no Python type holds raises: a row written by something other
# than sqllocker (an operator's SQL, another program), with a timestamp out of range or not
# one, or locked_by that is not JSON.
UNREADABLE_VALUE = (ValueError, OverflowError, RecursionError)


def unreadable_row(table: str, where: str, error: BaseException) -> str:
    """The message of a row of ``table`` (in ``where``, "for lock ...") that cannot be read."""
    return (
        f"a row of table {table!r} {where}cannot be read (not written by sqllocker?): "
        f"{one_line(error)}"
    )


def printable(text: object) -> str:
    """``text`` safe to show on a terminal or in a log line: whatever a lock row holds (its
    lockstring, its locked_by) was written by someone else, and a character in it that is not
    printable must not move the cursor, recolour the screen, forge a line, reorder what is
    shown or hide itself (controls, formatting and invisible characters, separators other
    than the space, unassigned code points: what ``str.isprintable`` refuses). Each such
    character is shown as its escape (``\\x1b``, ``\\u202e``, ``\\U000e0020``)."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(
        character if character.isprintable() else _escape(character) for character in text
    )


def _escape(character: str) -> str:
    code = ord(character)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def describe_holder(holder: Mapping[str, Any] | None) -> str:
    """One phrase naming the holder of a lock, for operators: ``host:pid (program, user)``."""
    if not holder:
        return "an unknown holder"
    place = f"{holder.get('host', '?')}:{holder.get('pid', '?')}"
    details = [str(holder[key]) for key in ("program", "user") if holder.get(key)]
    return printable(f"{place} ({', '.join(details)})" if details else place)


def _busy_message(lockstring: str, busy: LockBusy) -> str:
    if busy.key_holder_pid is not None and busy.holder is None:
        waited = f"; gave up after waiting {busy.waited:.3g}s" if busy.waited else ""
        return (
            f"lock {lockstring!r} could not be tried: PostgreSQL session {busy.key_holder_pid} "
            "holds its advisory key, which acquirers hold only while they insert, and holds "
            "no row of the lock table (a session outside sqllocker, or a stuck one: see "
            f"pg_stat_activity where pid = {busy.key_holder_pid}){waited}"
        )
    finished = (busy.holder or {}).get("finished")
    if finished is not None:
        parts = [
            f"lock {lockstring!r} was held by {describe_holder(busy.holder)}, which finished at "
            f"{printable(finished)} and keeps it for the rest of its window (hold_at_least)"
        ]
    else:
        parts = [f"lock {lockstring!r} is held by {describe_holder(busy.holder)}"]
    if busy.created is not None:
        parts.append(f"since {busy.created.isoformat(timespec='seconds')}")
    if busy.expires is not None:
        parts.append(f"until {busy.expires.isoformat(timespec='seconds')}")
    if busy.lock_id is not None:
        parts.append(f"(lock id {busy.lock_id})")
    message = " ".join(parts)
    if (
        busy.holder
        and busy.holder.get("pid") == forks.pid
        and busy.holder.get("host") == socket.gethostname()
    ):
        message += " -- that is this very process: sqllocker locks are not re-entrant"
    if busy.waited:
        message += f"; gave up after waiting {busy.waited:.3g}s"
    return (
        message + "; wait for it, or, if that holder is dead, break it with "
        f"`sqllocker release {_shell_quote(lockstring)} --force`"
    )


def _shell_quote(text: str) -> str:
    return printable(shlex.quote(text))


def _str_or_none(value: object) -> str | None:
    return value if isinstance(value, str) else None
