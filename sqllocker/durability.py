"""Checking that the database keeps what it acknowledges.

A lock row that the database acknowledged and then lost in a crash lets a second holder in, and
the lost id can be handed out again, breaking the fencing token. These settings allow exactly
that (each observed on this project's test machine): PostgreSQL ``synchronous_commit=off``,
``fsync=off`` or an UNLOGGED table; MariaDB/MySQL ``innodb_flush_log_at_trx_commit`` other than 1;
SQLite ``synchronous=OFF`` or a journal that is off or in memory.
"""

from __future__ import annotations

from sqlalchemy.engine import Connection


def unsafe_settings(conn: Connection, table: str) -> list[str]:
    """Descriptions of the settings on ``conn``'s database that can lose acknowledged rows."""
    name = conn.dialect.name
    problems: list[str] = []
    if name == "postgresql":
        if conn.exec_driver_sql("SHOW synchronous_commit").scalar() == "off":
            problems.append("synchronous_commit=off")
        if conn.exec_driver_sql("SHOW fsync").scalar() == "off":
            problems.append("fsync=off")
        persistence = conn.exec_driver_sql(
            "SELECT relpersistence FROM pg_class WHERE oid = to_regclass(%(table)s)",
            {"table": table},
        ).scalar()
        if persistence == "u":
            problems.append(f"table {table} is UNLOGGED")
    elif name == "mysql":
        flush = conn.exec_driver_sql("SELECT @@innodb_flush_log_at_trx_commit").scalar()
        if flush is not None and int(flush) != 1:
            problems.append(f"innodb_flush_log_at_trx_commit={flush}")
    elif name == "sqlite":
        if conn.exec_driver_sql("PRAGMA synchronous").scalar() == 0:
            problems.append("PRAGMA synchronous=OFF")
        journal = str(conn.exec_driver_sql("PRAGMA journal_mode").scalar()).lower()
        if journal in {"off", "memory"}:
            problems.append(f"PRAGMA journal_mode={journal.upper()}")
    return problems
