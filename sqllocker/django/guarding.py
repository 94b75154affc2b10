"""``guard(lock)`` on Django's own connection, inside ``transaction.atomic()``.

``Lock.guard`` runs its statement on an SQLAlchemy connection in the caller's transaction. Here
that connection is made around the DB-API connection Django holds (through an engine whose only
connection it is), so the statement joins Django's transaction; SQLAlchemy is handed a stand-in
that forwards everything but commit, rollback and close, so it can never end Django's
transaction or close its connection.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import django.db
import sqlalchemy as sa
from django.db import DEFAULT_DB_ALIAS, connections
from sqlalchemy.pool import StaticPool

from ..errors import LockError
from ..lock import Lock
from .configuration import database_alias

# The SQLAlchemy dialect for each DB-API module Django's backends use, and its options: the
# PostgreSQL dialects would look hstore up on the connection, which is Django's to configure.
_NO_HSTORE = {"use_native_hstore": False}
logger = logging.getLogger("sqllocker.django")

_DIALECTS: dict[str, tuple[str, dict[str, Any]]] = {
    "psycopg": ("postgresql+psycopg", _NO_HSTORE),
    "psycopg2": ("postgresql+psycopg2", _NO_HSTORE),
    "pymysql": ("mysql+pymysql", {}),
    "MySQLdb": ("mysql+mysqldb", {}),
    "sqlite3": ("sqlite+pysqlite", {}),
}


def guard(lock: Lock, using: str | None = None) -> None:
    """Inside ``transaction.atomic(using=using)``: prove ``lock`` is still held and keep it from
    being taken over or purged until that transaction ends (``Lock.guard``), so the transaction
    commits only while the lock is held. Raises LockLost if it is not: let it leave the
    ``atomic`` block, which rolls back.

    ``using`` (default: Django's default database) must be the database of the ``SQLLOCKER``
    setting, where the lock's row is. The ``atomic`` block must be the outermost one, and the
    lock released after it (its row lock lasts until the transaction ends, and a release inside
    the transaction would wait for it): guard() refuses a nested one.
    """
    alias = using or DEFAULT_DB_ALIAS
    if alias != database_alias():
        raise LockError(
            f"guard() needs a transaction on the lock table's database "
            f"({database_alias()!r}), not on {alias!r}",
            lock.lockstring,
        )
    connection = connections[alias]
    if not connection.in_atomic_block:
        raise LockError(
            "guard() needs to run inside transaction.atomic(): the protection lasts until that "
            "transaction ends",
            lock.lockstring,
        )
    if len(connection.atomic_blocks) > 1:
        # The row lock lasts until the outermost transaction ends: a release before then (the
        # end of the lock's block inside it) would wait for this very transaction.
        raise LockError(
            "guard() needs the outermost transaction.atomic() (not one nested in another, nor "
            "ATOMIC_REQUESTS' or a TestCase's): its protection lasts until the outermost "
            "transaction ends, and releasing the lock before then would wait for it",
            lock.lockstring,
        )
    connection.ensure_connection()
    restore_silence_limit(connection)  # a bound left by a guarded transaction rolled back
    raw = connection.connection
    module = type(raw).__module__.partition(".")[0]
    known = _DIALECTS.get(module)
    if known is None:
        raise LockError(f"guard() does not know Django's driver {module!r}", lock.lockstring)
    dialect, options = known
    borrowed = _Borrowed(raw)
    engine = sa.create_engine(
        f"{dialect}://",
        **options,
        creator=lambda: borrowed,
        poolclass=StaticPool,
        pool_reset_on_return=None,
    )
    # MySQL's (a project on another database imports no MySQL dialect).
    from ..backends.mysql import SILENCE_KEY

    try:
        with engine.connect() as sa_connection:
            sa_connection.begin()  # SQLAlchemy's view of the transaction Django has open
            lock.guard(sa_connection)
            silence = sa_connection.info.pop(SILENCE_KEY, None)  # see _restore_on_commit
    finally:
        engine.dispose()
    if silence is not None:
        _restore_on_commit(connection, *silence)


# On Django's connection: (variable, the session's own value) while a guard's bound stands.
_PENDING = "_sqllocker_silence_limit"


def _restore_on_commit(connection: Any, name: str, before: int) -> None:
    """MySQL/MariaDB: the session's own silence limit, which the guard shortened for as long
    as the transaction lasts, given back when Django commits it. (SQLAlchemy's connection
    would give it back as it closes, at once, its transaction still open: the guarded
    transaction was left unbounded.) After a rollback it is given back by the next
    ``guard()`` or ``@locked`` call on the connection, or at the end of the request
    (``restore_silence_limit``)."""
    if getattr(connection, _PENDING, None) is not None:
        return  # an earlier guard's in this transaction saved the session's own
    setattr(connection, _PENDING, (name, before))
    connection.on_commit(functools.partial(restore_silence_limit, connection), robust=True)


def restore_silence_limits(**_: object) -> None:
    """``restore_silence_limit`` on every connection made in this thread: at the end of a
    request, and before a ``@locked`` call."""
    for connection in connections.all(initialized_only=True):
        restore_silence_limit(connection)


def restore_silence_limit(connection: Any) -> None:
    """Give the session of Django's ``connection`` back its own silence limit, if a guard's
    bound still stands on it and its transaction has ended (committed, or rolled back)."""
    pending = getattr(connection, _PENDING, None)
    if pending is None or connection.connection is None:
        return
    if connection.in_atomic_block and any(
        getattr(due, "func", None) is restore_silence_limit
        for _, due, _ in connection.run_on_commit
    ):
        return  # the guarded transaction is still open: its commit gives it back
    name, before = pending
    setattr(connection, _PENDING, None)
    try:
        with connection.cursor() as cursor:
            cursor.execute(f"SET SESSION {name} = %s", [int(before)])
    except django.db.Error as error:  # the session is gone (and its bound with it), or going
        logger.warning("could not give a session its own silence limit back: %s", error)


class _Borrowed:
    """Django's DB-API connection, lent to SQLAlchemy: its statements run in Django's
    transaction; commit, rollback and close are Django's alone."""

    def __init__(self, connection: Any) -> None:
        self._connection = connection

    def __getattr__(self, name: str) -> Any:
        return getattr(self._connection, name)

    def commit(self) -> None:
        pass

    def rollback(self) -> None:
        pass

    def close(self) -> None:
        pass
