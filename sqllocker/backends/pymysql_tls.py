"""PyMySQL connections that share one TLS context for PyMySQL's preferred mode.

Given no TLS options, PyMySQL (from 1.2) tries TLS if the server offers it, verifying
nothing, and builds that context anew for every connection, loading the system's CA paths for
a context that uses none of them: far more of the connecting thread's CPU than the connection
itself, which a lock operation that has to open a connection waits for (CHANGELOG.md).
Engines sqllocker makes connect through ``connect``, whose connections share one such context,
built by PyMySQL itself on first use. Connections given TLS options of their own build theirs
as PyMySQL does.
"""

from __future__ import annotations

import threading
from typing import Any

_lock = threading.Lock()
_preferred_context: Any = None  # the ssl.SSLContext of PyMySQL's preferred mode, once built
_connection_class: Any = None


# A connect argument of sqllocker's own (``MySQL.cap_connect``): the read timeout the
# connection keeps once connected, where the start-up had a shorter one.
READ_TIMEOUT_AFTER = "sqllocker_read_timeout_after"


def connect(_dialect: Any, _record: Any, cargs: Any, cparams: Any) -> Any:
    """SQLAlchemy's ``do_connect`` event: a PyMySQL connection made with the engine's
    arguments, sharing the process's preferred-mode TLS context."""
    if READ_TIMEOUT_AFTER not in cparams:
        return _shared_context_connection()(*cargs, **cparams)
    after = cparams.pop(READ_TIMEOUT_AFTER)
    connection = _shared_context_connection()(*cargs, **cparams)
    connection._read_timeout = after  # PyMySQL sets it on the socket before each read
    return connection


def _shared_context_connection() -> Any:
    """PyMySQL's Connection class, with its preferred-mode context made once per process
    (PyMySQL is imported only by engines that use it)."""
    global _connection_class
    if _connection_class is None:
        import pymysql.connections

        class SharedContextConnection(pymysql.connections.Connection):  # type: ignore[misc]
            def _create_ssl_ctx(self, sslp: Any) -> Any:
                if sslp:  # TLS options of the caller's own: as PyMySQL builds them
                    return super()._create_ssl_ctx(sslp)
                global _preferred_context
                if _preferred_context is None:
                    with _lock:
                        if _preferred_context is None:
                            _preferred_context = super()._create_ssl_ctx(sslp)
                return _preferred_context

        _connection_class = SharedContextConnection
    return _connection_class
