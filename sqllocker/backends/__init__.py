"""What differs between the databases, each in a module of its own, and nothing else.

:class:`Backend` says what every database must answer: how to read the *server's* clock and
shift it (client clocks are never consulted: DBIx::Locker's client-side local-time strings let a
purge in another time zone delete a live lock), which statements differ, how its driver reports
the few errors sqllocker must tell apart, which connection settings and server settings the
locks rely on, and how a migration and an adoption run there. ``sqlite``, ``postgresql`` and
``mysql`` answer for their database. Code outside this package never asks which database it is
on; adding one means a module here, its branch in the migration, and its test fixture.
"""

from __future__ import annotations

from collections.abc import Iterator

from sqlalchemy.engine import Dialect

from .. import schema
from ..errors import LockValueError
from .base import Backend, StatementParts
from .mysql import MySQLBackend
from .postgresql import PostgreSQLBackend
from .sqlite import SQLiteBackend

__all__ = ["Backend", "StatementParts", "backend_class", "backend_for", "url_names"]

_BACKENDS: dict[str, type[Backend]] = {
    url_name: cls
    for cls in (SQLiteBackend, PostgreSQLBackend, MySQLBackend)
    for url_name in cls.url_names
}


def backend_class(name: str) -> type[Backend]:
    """The Backend for a dialect or URL backend name (``postgres``, ``mariadb``, ...)."""
    try:
        return _BACKENDS[name]
    except KeyError:
        raise LockValueError(
            f"sqllocker supports SQLite, PostgreSQL and MySQL/MariaDB, not {name!r}"
        ) from None


def backend_for(dialect: Dialect) -> Backend:
    """The Backend of a connected ``dialect`` (some capabilities are known only then)."""
    return backend_class(dialect.name).for_dialect(dialect)


def url_names() -> Iterator[tuple[str, type[Backend]]]:
    return iter(_BACKENDS.items())


# The table's column types ask the backend of the dialect they are compiled for.
schema.use_column_rules(backend_class)
