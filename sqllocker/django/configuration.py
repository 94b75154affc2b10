"""The ``SQLLOCKER`` setting, and the Locker it describes, built from Django's ``DATABASES``."""

from __future__ import annotations

import threading
from typing import Any

from django.conf import settings
from django.db import connections
from sqlalchemy.engine import URL

from ..errors import LockValueError
from ..locker import Locker
from ..schema import DEFAULT_TABLE
from ..validation import check_grace, check_table_name

# The libpq connection parameters of a PostgreSQL entry's OPTIONS that the URL carries.
_LIBPQ_OPTIONS = {
    "sslmode",
    "sslrootcert",
    "sslcert",
    "sslkey",
    "sslpassword",
    "options",
    "connect_timeout",
    "application_name",
    "target_session_attrs",
    "passfile",
    "service",
}

Parts = tuple[str, "str | None", dict[str, str]]  # driver, host, query


def _postgresql(entry: dict[str, Any], host: str | None) -> Parts:
    options = entry.get("OPTIONS") or {}
    query = {k: str(v) for k, v in options.items() if k in _LIBPQ_OPTIONS}
    if host is not None and host.startswith("/"):  # a socket directory
        query["host"], host = host, None
    return "postgresql+psycopg", host, query


def _mysql(entry: dict[str, Any], host: str | None) -> Parts:
    options = entry.get("OPTIONS") or {}
    query = {"charset": str(options["charset"])} if "charset" in options else {}
    if host is not None and host.startswith("/"):
        query["unix_socket"], host = host, None
    return "mysql+pymysql", host, query


def _sqlite(entry: dict[str, Any], host: str | None) -> Parts:
    name = str(entry.get("NAME") or "")
    if name in {"", ":memory:"} or "mode=memory" in name:
        raise LockValueError(
            "an SQLite database in memory cannot be shared with other processes: locks need a file"
        )
    return "sqlite", None, {}


# How each of Django's database vendors is reached with sqllocker's drivers.
_URL_PARTS = {"postgresql": _postgresql, "mysql": _mysql, "sqlite": _sqlite}

_made: dict[tuple[str, str], Locker] = {}
_making = threading.Lock()


def setting() -> dict[str, Any]:
    """``settings.SQLLOCKER``, checked: ``database`` (default ``"default"``) and ``table``
    (default ``"semaphores"``), and ``Locker``'s other options."""
    given = getattr(settings, "SQLLOCKER", {})
    if not isinstance(given, dict):
        raise LockValueError(f"settings.SQLLOCKER must be a dict, not {type(given).__name__}")
    options = {"database": "default", "table": DEFAULT_TABLE, **given}
    if not isinstance(options["database"], str):
        raise LockValueError(
            "settings.SQLLOCKER's database must be the name of one of settings.DATABASES, not "
            f"{options['database']!r}"
        )
    check_table_name(options["table"])
    if "grace" in options:
        check_grace(options["grace"])
    if options["database"] not in settings.DATABASES:
        raise LockValueError(
            f"settings.SQLLOCKER names the database {options['database']!r}, which "
            "settings.DATABASES does not have"
        )
    return options


def database_alias() -> str:
    return str(setting()["database"])


def table_name() -> str:
    return str(setting()["table"])


def database_url(alias: str) -> URL:
    """An SQLAlchemy URL (sqllocker's drivers) for Django's database ``alias``, as Django's own
    connection reaches it now (in tests, the test database)."""
    connection = connections[alias]
    parts = _URL_PARTS.get(connection.vendor)
    if parts is None:
        raise LockValueError(
            f"database {alias!r} is {connection.vendor}, and sqllocker supports PostgreSQL, "
            "MySQL/MariaDB and SQLite"
        )
    entry = connection.settings_dict
    host = str(entry.get("HOST") or "") or None
    driver, host, query = parts(entry, host)
    port = entry.get("PORT")
    return URL.create(
        driver,
        username=str(entry.get("USER") or "") or None,
        password=str(entry.get("PASSWORD") or "") or None,
        host=host,
        port=int(port) if port else None,
        database=str(entry.get("NAME") or "") or None,
        query=query,
    )


def get_locker() -> Locker:
    options = setting()
    alias = str(options.pop("database"))
    url = database_url(alias)
    key = (alias, url.render_as_string(hide_password=False))
    with _making:
        locker = _made.get(key)
        if locker is None:
            locker = _made[key] = Locker(url, **options)
        return locker


def close_lockers() -> None:
    """Close the Lockers this process made (their connections, which would keep a database
    from being dropped): the next ``get_locker()`` makes a new one."""
    with _making:
        made = list(_made.values())
        _made.clear()
    for locker in made:
        locker.close()
