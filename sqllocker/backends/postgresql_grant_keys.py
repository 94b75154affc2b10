"""PostgreSQL: where a ticket's grant key would be seen by others than the release trigger.

A grant key (``sqllocker.notifications.GrantKey``), once read, lets anyone who can NOTIFY sign
a grant to a waiter still in line. Where it could be read (from the requests table, or from
the text of the statement that sends it), a waiter takes its ticket without one and reads the
release's grant back from the table.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.sql.elements import ClauseElement

from ..schema import requests_table_name


def others_read_tickets(table: str) -> ClauseElement:
    """A grant key, read, lets anyone who can NOTIFY sign a grant: so a ticket is taken with
    one only where no role that can log in may SELECT from the requests table, by itself or
    through a role it is a member of (a grant, PUBLIC, ``pg_read_all_data``, which
    ``has_table_privilege`` counts), but the table's owner, the roles that may act as it,
    and superusers (who may do anything). A table that cannot be found counts as read."""
    return (
        sa.text(
            "SELECT pg_catalog.to_regclass(:requests) IS NULL OR EXISTS ("
            " SELECT FROM pg_catalog.pg_class AS c, pg_catalog.pg_roles AS r,"
            "  pg_catalog.pg_roles AS g"
            " WHERE c.oid = pg_catalog.to_regclass(:requests)"
            "  AND r.rolcanlogin AND NOT r.rolsuper"
            "  AND NOT pg_catalog.pg_has_role(r.oid, c.relowner, 'MEMBER')"
            "  AND pg_catalog.pg_has_role(r.oid, g.oid, 'MEMBER')"
            "  AND pg_catalog.has_table_privilege(g.oid, c.oid, 'SELECT')) AS read_by_others"
        )
        .bindparams(requests=requests_table_name(table))
        .columns(sa.column("read_by_others", sa.Boolean))
    )


def binds_in_text(dbapi_connection: Any) -> bool:
    """Whether the driver writes a statement's parameters into its text, which
    ``pg_stat_activity`` shows to the role's other sessions and to ``pg_read_all_stats``
    (``pg_monitor``): psycopg's ClientCursor, or a driver not known to bind them at the
    server. A ticket's grant key, with which anyone who can NOTIFY could sign a grant, is
    never sent so."""
    driver = getattr(dbapi_connection, "driver_connection", dbapi_connection)
    if not type(driver).__module__.startswith("psycopg"):
        return True
    import psycopg  # the driver's own module, loaded already

    factory = getattr(driver, "cursor_factory", None)
    return not isinstance(factory, type) or issubclass(
        factory, (psycopg.ClientCursor, psycopg.AsyncClientCursor)
    )
