"""Checking the database settings that the locks' guarantees rest on.

A lock row that the database acknowledged and then lost in a crash lets a second holder in, and
the lost id can be handed out again, breaking the fencing token. These settings allow exactly
that (each observed on this project's test machine): PostgreSQL ``synchronous_commit=off``,
``fsync=off`` or an UNLOGGED table; MariaDB/MySQL ``innodb_flush_log_at_trx_commit`` other than 1;
SQLite ``synchronous=OFF`` or a journal that is off or in memory.

MariaDB/MySQL ``innodb_autoinc_lock_mode=2`` (MySQL 8's default) draws auto-increment values
under no lock that lasts the statement. Then only the stripes table of migration 0006 keeps an
acquirer delayed between drawing its id and the unique check from holding the lock after a
later holder, with a smaller fencing token (see ``Statements.acquire``), so a table without it
is reported. Mutual exclusion does not depend on it; the order of tokens does.
"""

from __future__ import annotations

from typing import NamedTuple

from sqlalchemy.engine import Connection

from .schema import id_order_table_name

LOSES_ROWS = (
    "can lose acknowledged lock rows in a crash, which lets a second holder in and reuses its "
    "lock id"
)
REORDERS_IDS = (
    "can hand out lock ids out of holding order, so a later holder may carry a smaller fencing "
    "token"
)


class UnsafeSetting(NamedTuple):
    setting: str  # as the operator would set it, e.g. "innodb_autoinc_lock_mode=2"
    harm: str


class ServerSettings(NamedTuple):
    unsafe: list[UnsafeSetting]  # what breaks a guarantee of the locks, with what each breaks
    # MySQL with innodb_autoinc_lock_mode=2: acquires lock their stripe of migration 0006's
    # table (see ``Statements.acquire``). With 0 or 1 the AUTO-INC lock that InnoDB keeps to the
    # end of an INSERT ... SELECT orders the ids already, and the stripe lock would only cost
    # (fewer cycles/s with four processes: docs/speed-history.md).
    lock_stripes: bool
    # PostgreSQL: the schema the lock table is in (where the search path finds it; where it
    # would be made, if it is not there yet). Its functions are called by their full names,
    # and its advisory keys include it.
    schema: str | None = None
    # PostgreSQL: whether the table has the functions its migration makes (a table made by
    # ``lock_table().create()`` has none): without them waiters back off, as elsewhere.
    has_functions: bool = False
    # Why the table, if it exists, is not sqllocker's (a DBIx::Locker table): no operation may
    # run on it (see ``foreign_table``).
    foreign: str | None = None


def read_settings(conn: Connection, table: str) -> ServerSettings:
    """The settings of ``conn``'s database that the locks' guarantees rest on, read when a
    Locker is set up, and again after it lost a connection or migrated its table (see
    ``LockOperations.ensure_setup``)."""
    name = conn.dialect.name
    problems: list[UnsafeSetting] = []
    lock_stripes = False
    schema = None
    has_functions = False
    if name == "postgresql":
        schema, has_functions = conn.exec_driver_sql(_TABLE_SCHEMA, {"table": table}).one()
        if conn.exec_driver_sql("SHOW synchronous_commit").scalar() == "off":
            problems.append(UnsafeSetting("synchronous_commit=off", LOSES_ROWS))
        if conn.exec_driver_sql("SHOW fsync").scalar() == "off":
            problems.append(UnsafeSetting("fsync=off", LOSES_ROWS))
        persistence = conn.exec_driver_sql(
            "SELECT relpersistence FROM pg_catalog.pg_class "
            "WHERE oid OPERATOR(pg_catalog.=) pg_catalog.to_regclass(%(table)s::text)",
            {"table": table},
        ).scalar()
        if persistence == "u":
            problems.append(UnsafeSetting(f"table {table} is UNLOGGED", LOSES_ROWS))
    elif name == "mysql":
        flush, autoinc = conn.exec_driver_sql(
            "SELECT @@innodb_flush_log_at_trx_commit, @@innodb_autoinc_lock_mode"
        ).one()
        if flush is not None and int(flush) != 1:
            problems.append(UnsafeSetting(f"innodb_flush_log_at_trx_commit={flush}", LOSES_ROWS))
        if autoinc is not None and int(autoinc) == 2:
            lock_stripes = _has_id_order_table(conn, table)
            if not lock_stripes:
                setting = (
                    f"innodb_autoinc_lock_mode=2 with lock table {table} lacking "
                    f"{id_order_table_name(table)} (run `sqllocker migrate --table {table}`)"
                )
                problems.append(UnsafeSetting(setting, REORDERS_IDS))
    elif name == "sqlite":
        if conn.exec_driver_sql("PRAGMA synchronous").scalar() == 0:
            problems.append(UnsafeSetting("PRAGMA synchronous=OFF", LOSES_ROWS))
        journal = str(conn.exec_driver_sql("PRAGMA journal_mode").scalar()).lower()
        if journal in {"off", "memory"}:
            problems.append(UnsafeSetting(f"PRAGMA journal_mode={journal.upper()}", LOSES_ROWS))
    foreign = foreign_table(conn, table)
    return ServerSettings(problems, lock_stripes, schema, bool(has_functions), foreign)


def foreign_table(conn: Connection, table: str) -> str | None:
    """Why ``table`` is not a table sqllocker made, or None (also when it does not exist).

    A DBIx::Locker table has no ``guid``; its ``locked_by`` is text; on SQLite its ids are reused
    (no AUTOINCREMENT); on MySQL its lockstrings fold case. Each breaks a guarantee: a purge would
    judge Perl's local-time expiries as UTC, a reused id lets a stale holder release the next
    one's lock. A MySQL table adopted without ``--exact-lockstrings`` keeps its collation on
    purpose, and has a version row to show for it.
    """
    name = conn.dialect.name
    columns: dict[str, str | None]
    if name == "postgresql":
        columns = dict(conn.exec_driver_sql(_POSTGRESQL_COLUMNS, {"table": table}).all())
        if columns and columns.get("locked_by") not in (None, "jsonb", "json"):
            return f"its locked_by column is {columns['locked_by']}, not JSON"
    elif name == "mysql":
        columns = dict(conn.exec_driver_sql(_MYSQL_COLLATIONS, {"table": table}).all())
        collation = columns.get("lockstring")
        if collation and not collation.endswith("_bin") and not _has_version_row(conn, table):
            return f"its lockstrings compare by collation {collation}, which folds case"
    else:
        columns = dict.fromkeys(
            conn.exec_driver_sql("SELECT name FROM pragma_table_info(?)", (table,)).scalars()
        )
        ddl = conn.exec_driver_sql(
            "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)
        ).scalar()
        if ddl is not None and "guid" in columns and "AUTOINCREMENT" not in ddl.upper():
            return "it is not AUTOINCREMENT, so SQLite reuses the ids of deleted rows"
    if columns and "guid" not in columns:
        return "it has no guid column"
    return None


def _has_version_row(conn: Connection, table: str) -> bool:
    from .migrations import current_revision_on

    return current_revision_on(conn, table) is not None


_POSTGRESQL_COLUMNS = (
    "SELECT a.attname::text, pg_catalog.format_type(a.atttypid, a.atttypmod) "
    "FROM pg_catalog.pg_attribute AS a "
    "WHERE a.attrelid OPERATOR(pg_catalog.=) pg_catalog.to_regclass(%(table)s::text) "
    "AND a.attnum OPERATOR(pg_catalog.>) 0::smallint AND NOT a.attisdropped"
)
# Every column, with the collation of those that have one.
_MYSQL_COLLATIONS = (
    "SELECT column_name, COALESCE(collation_name, '') FROM information_schema.columns "
    "WHERE table_schema = DATABASE() AND table_name = %(table)s"
)


_TABLE_SCHEMA = (
    "SELECT s.name, pg_catalog.to_regprocedure(pg_catalog.quote_ident(s.name) "
    "OPERATOR(pg_catalog.||) '.' OPERATOR(pg_catalog.||) %(table)s::text "
    "OPERATOR(pg_catalog.||) '_queue_leave(bigint,varchar,varchar,boolean)') IS NOT NULL "
    "FROM (SELECT COALESCE((SELECT n.nspname::text FROM pg_catalog.pg_class AS c "
    "JOIN pg_catalog.pg_namespace AS n ON n.oid OPERATOR(pg_catalog.=) c.relnamespace "
    "WHERE c.oid OPERATOR(pg_catalog.=) pg_catalog.to_regclass(%(table)s::text)), "
    "pg_catalog.current_schema()::text) AS name) AS s"
)


def _has_id_order_table(conn: Connection, table: str) -> bool:
    return bool(
        conn.exec_driver_sql(
            "SELECT COUNT(*) FROM information_schema.tables "
            "WHERE table_schema = DATABASE() AND table_name = %(name)s",
            {"name": id_order_table_name(table)},
        ).scalar()
    )
