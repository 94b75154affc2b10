"""The SQLAlchemy internals sqllocker relies on, in one place.

Each saves a measurable part of a lock cycle (see ``execution.py`` and ``connections.py``), and
none has a public equivalent. ``tests/test_sqlalchemy_internals.py`` checks each against the
installed SQLAlchemy, and CI runs the lock tests against the oldest SQLAlchemy the project
declares as well as the newest, so that a release that changes one fails here, not in a cycle.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from sqlalchemy.engine import Connection
from sqlalchemy.pool import QueuePool
from sqlalchemy.sql.compiler import SQLCompiler

T = TypeVar("T")


def most_connections(pool: QueuePool) -> int | None:
    """How many connections ``pool`` lets be open at once (``pool_size + max_overflow``), or
    None for no limit: the ConnectionStack keeps the pool's limits without going through it."""
    overflow: int = pool._max_overflow
    return None if overflow < 0 else pool.size() + overflow


def commits_each_statement(connection: Connection) -> bool:
    """Whether ``connection`` runs in AUTOCOMMIT, by its own execution options or its engine's
    ``isolation_level``: its "transaction" ends with each statement, and a row lock with it.
    Asked of SQLAlchemy, not of the database (which would cost a round trip)."""
    return bool(connection._is_autocommit_isolation())


def bind_order(compiled: SQLCompiler) -> Sequence[str] | None:
    """The names of ``compiled``'s bound parameters in the order a positional driver takes
    them (None for a driver that takes them by name)."""
    return compiled.positiontup


def literal_binds(compiled: SQLCompiler) -> dict[str, Any]:
    """Every bound parameter of ``compiled`` with the value it carries itself (literals such as
    'now' or a format string; None where the caller must supply one), without SQLAlchemy's
    check that the caller has supplied them: they are supplied on each execution instead."""
    return dict(compiled.construct_params(_check=False) or {})


def lets_await(greenlet_class: type[T]) -> type[T]:
    """Mark ``greenlet_class`` (a greenlet's subclass) as one SQLAlchemy's ``await_`` may be
    called in: it then hands its awaitable to the running greenlet's parent to await and
    switch back with the outcome, as in the greenlets ``greenlet_spawn`` makes."""
    setattr(greenlet_class, "__sqlalchemy_greenlet_provider__", True)  # noqa: B010
    return greenlet_class
