"""What differs between the databases, each in a module of its own, and nothing else.

:class:`Backend` says what every database must answer: how to read the *server's* clock and
shift it (client clocks are never consulted: DBIx::Locker's client-side local-time strings let a
purge in another time zone delete a live lock), which statements differ, how its driver reports
the few errors sqllocker must tell apart, which connection settings and server settings the
locks rely on, and how a migration and an adoption run there. ``sqlite``, ``postgresql`` and
``mysql`` answer for their database. Code outside this package never asks which database it is
on; adding one means a module here (and its names in ``_WHERE``), its branch in the migration,
and its test fixture.
"""

from __future__ import annotations

import importlib

from sqlalchemy.engine import Dialect

from .. import schema
from ..errors import LockValueError
from .base import Backend, StatementParts

__all__ = ["Backend", "StatementParts", "backend_class", "backend_for", "url_names"]

# Each backend name a URL may give (SQLAlchemy's dialect names, and ``postgres``) and the module
# and class of its Backend, imported when first asked for: a process imports the SQLAlchemy
# dialect of the database it uses, no other.
_WHERE: dict[str, tuple[str, str]] = {
    "sqlite": ("sqlite", "SQLiteBackend"),
    "postgresql": ("postgresql", "PostgreSQLBackend"),
    "postgres": ("postgresql", "PostgreSQLBackend"),
    "mysql": ("mysql", "MySQLBackend"),
    "mariadb": ("mysql", "MySQLBackend"),
}
_URL_NAMES = frozenset(_WHERE)
_BACKENDS: dict[str, type[Backend]] = {}


def backend_class(name: str) -> type[Backend]:
    """The Backend for a dialect or URL backend name (``postgres``, ``mariadb``, ...)."""
    try:
        return _BACKENDS[name]
    except KeyError:
        pass
    try:
        module, class_name = _WHERE[name]
    except KeyError:
        raise LockValueError(
            f"sqllocker supports SQLite, PostgreSQL and MySQL/MariaDB, not {name!r}"
        ) from None
    cls: type[Backend] = getattr(importlib.import_module(f".{module}", __name__), class_name)
    _BACKENDS[name] = cls
    return cls


def backend_for(dialect: Dialect) -> Backend:
    """The Backend of a connected ``dialect`` (some capabilities are known only then)."""
    return backend_class(dialect.name).for_dialect(dialect)


def url_names() -> frozenset[str]:
    """The backend names a URL may give (``sqlite``, ``postgres``, ``mariadb``, ...)."""
    return _URL_NAMES


# The table's column types ask the backend of the dialect they are compiled for.
schema.use_column_rules(backend_class)
