"""What the lock operations learn on first use: the backend, the statements for the table, and
whether the server's settings keep the locks' guarantees."""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL, Connection

from ..backends import Backend, backend_for
from ..engine import describe_url, prepares_statements
from ..errors import ForeignTable, LockValueError, UnsafeDatabase, UnsafeDatabaseWarning
from ..schema import FOREIGN_CLOCK_MARGIN, id_order_table
from ..server_settings import UnsafeSetting
from ..statements import Statements

logger = logging.getLogger("sqllocker")


@dataclass(frozen=True)
class Options:
    """What the set-up needs to know of the Locker: see ``Database``."""

    url: URL
    table_name: str
    grace: float
    strict: bool
    owns_engine: bool
    transaction_pooling: bool


@dataclass(frozen=True)
class Setup:
    """What one connection taught: the backend and the statements for the table; ``expiry``,
    the parameters of the test whether a row may be taken over or purged now (written by the
    backend, never changed by their users); ``inserts_replayed`` and ``lone_inserts_retried``
    (see ServerSettings.replays_inserts and retries_autocommit): where a group's rows, and
    where a lone acquire's row, are read back after their commit; ``confirms_grants`` (see
    ServerSettings.replicated): where a waiter makes sure of a row handed to it."""

    backend: Backend
    statements: Statements
    expiry: dict[str, Any]
    inserts_replayed: bool
    lone_inserts_retried: bool
    confirms_grants: bool


def set_up(conn: Connection, table: Any, options: Options) -> Setup:
    """Learn the backend on ``conn`` and check the settings the locks' guarantees rest on: a
    setting unsafe now is reported (``strict``: refused), and a foreign table refused."""
    check_pooled_connection(conn, options)
    backend = backend_for(conn.dialect)
    settings = backend.read_settings(conn, options.table_name)
    if settings.foreign is not None:
        raise ForeignTable.naming(options.table_name, describe_url(options.url), settings.foreign)
    report(settings.unsafe, options)
    id_order = id_order_table(options.table_name) if settings.lock_stripes else None
    if settings.schema is not None:
        # Named with the schema it was found in: a table of that name made later in a schema
        # ahead on the search path (by a role that may) cannot take a running Locker's
        # statements away from it.
        table = table.to_metadata(sa.MetaData(), schema=settings.schema)
    statements = Statements(table, backend, id_order, settings.schema, has_line=settings.has_line)
    # Read off one connection: only sqllocker's own connections, each straight to the server,
    # are all set alike.
    lone_inserts_retried = settings.replays_inserts and (
        settings.retries_autocommit or not options.owns_engine or options.transaction_pooling
    )
    expiry = {
        "minus_grace": backend.seconds_value(-options.grace),
        "minus_foreign_grace": backend.seconds_value(-options.grace - FOREIGN_CLOCK_MARGIN),
    }
    return Setup(
        backend,
        statements,
        expiry,
        settings.replays_inserts,
        lone_inserts_retried,
        settings.replicated,
    )


def check_pooled_connection(conn: Connection, options: Options) -> None:
    """Through a transaction pooler, refuse a caller's Engine whose connections prepare
    statements: sqllocker's own are made not to, and it cannot change a caller's."""
    if options.transaction_pooling and prepares_statements(conn.connection.driver_connection):
        raise LockValueError(
            f"{describe_url(options.url)}: with transaction_pooling=True the engine's "
            "connections must not prepare statements, which a transaction pooler hands to "
            "one server session and the next statement may not find; create it with "
            "connect_args={'prepare_threshold': None}"
        )


def report(problems: list[UnsafeSetting], options: Options) -> None:
    """Warn of (or, strict, refuse) settings that break a guarantee of the locks."""
    if not problems:
        return
    harms = {
        harm: ", ".join(p.setting for p in problems if p.harm == harm)
        for harm in dict.fromkeys(p.harm for p in problems)
    }
    found = f"{describe_url(options.url)}: " + "; ".join(
        f"{settings} {harm}" for harm, settings in harms.items()
    )
    change = f"change {'these settings' if len(problems) > 1 else 'the setting'}"
    if options.strict:
        raise UnsafeDatabase(f"{found}; refused (strict=True): {change}")
    message = f"{found}; {change}, or pass strict=True to refuse such databases"
    logger.warning("%s", message)
    warnings.warn(message, UnsafeDatabaseWarning, stacklevel=3)
