"""MySQL and MariaDB (InnoDB) through PyMySQL, or aiomysql for the async front end."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql
from sqlalchemy.engine import URL, Connection, Dialect, Engine
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.expression import Executable
from sqlalchemy.types import TypeEngine

from ..schema import (
    ID_ORDER_STRIPES,
    UTCDateTime,
    current_revision_on,
    id_order_table_name,
    mysql_options,
    requests_table,
    requests_table_name,
    set_aside_name,
    swap_name,
)
from ..server_settings import (
    LOSES_ROWS,
    MOVES_THE_CLOCK,
    REORDERS_IDS,
    ServerSettings,
    UnsafeSetting,
)
from ..timeouts import (
    CONNECT_TIMEOUT_SECONDS,
    ROW_LOCK_TIMEOUT_SECONDS,
    STATEMENT_TIMEOUT_SECONDS,
)
from . import mysql_adoption, pymysql_tls
from .base import Backend, StatementParts, shut_down_socket

if TYPE_CHECKING:
    from sqlalchemy.sql import Delete, Insert, Select


# Serialises concurrent `sqllocker migrate` runs (a named lock, not a row).
_MIGRATION_LOCK_NAME = "sqllocker_migrate"
# The server's status flags, on each answer: inside an explicit transaction; in autocommit.
_SERVER_STATUS_IN_TRANS, _SERVER_STATUS_AUTOCOMMIT = 1, 2
# How far the session's clock (NOW()) may be from the server's real time (SYSDATE()) in the
# settings check: the two are read in one statement, microseconds apart.
SESSION_CLOCK_TOLERANCE = 1.0


# A ticket's liveness key, as the GET_LOCK name its Locker's listening connection holds
# (``sqllocker.tickets``): GET_LOCK names are the server's, so the key is random and 64 bits.
LIVENESS_PREFIX = "sqllocker-live:"


def liveness_name(key: int) -> str:
    """The GET_LOCK name that keeps the tickets of liveness key ``key`` alive."""
    return f"{LIVENESS_PREFIX}{key}"


def _is_live(liveness_key: ColumnElement[Any]) -> ColumnElement[bool]:
    """Whether a ticket's liveness key is held (its Locker's listener is connected)."""
    name = sa.func.concat(sa.literal(LIVENESS_PREFIX), liveness_key)
    return sa.func.is_used_lock(name).is_not(None)


def _sha256(guid: ColumnElement[Any]) -> ColumnElement[str]:
    """A waiter's guid as its ticket names it: the guid is the holder's secret, and a role that
    only reads tickets must not learn it."""
    return sa.func.sha2(guid, 256, type_=sa.String())


class MySQLBackend(Backend):
    name = "mysql"
    sync_driver = "mysql+pymysql"
    # aiomysql speaks PyMySQL's protocol and raises PyMySQL's errors.
    async_driver = "mysql+aiomysql"
    adoption_swaps = True

    @classmethod
    def takes_tickets(cls, dialect: Dialect) -> bool:
        return True

    @classmethod
    def driver_scheme(cls, name: str, asynchronous: bool) -> str:
        # mariadb:// keeps SQLAlchemy's MariaDB dialect, which knows its server before it
        # connects (the SQL that `migrate --sql` prints is MariaDB's), and refuses a MySQL one.
        return super().driver_scheme(name, asynchronous).replace("mysql+", f"{name}+", 1)

    @classmethod
    def for_dialect(cls, dialect: Dialect) -> Backend:
        # MariaDB >= 10.5 has INSERT ... RETURNING, MySQL none; neither has UPDATE ... RETURNING.
        return cls(insert_returning=bool(dialect.insert_returning), update_returning=False)

    def now(self) -> ColumnElement[Any]:
        return sa.func.utc_timestamp(sa.literal_column("6"), type_=UTCDateTime())

    def shifted_now(self, param: str) -> ColumnElement[Any]:
        return self.shifted(sa.func.utc_timestamp(sa.literal_column("6")), param)

    def shifted(self, moment: ColumnElement[Any], param: str) -> ColumnElement[Any]:
        return sa.func.timestampadd(
            sa.literal_column("MICROSECOND"),
            sa.bindparam(param, type_=sa.BigInteger()),
            moment,
            type_=UTCDateTime(),
        )

    def seconds_value(self, seconds: float) -> Any:
        return round(seconds * 1_000_000)

    # -- statements ------------------------------------------------------------------------------

    def acquire(self, statements: StatementParts) -> Insert:
        """An INSERT of a SELECT, whose duplicate-key error means held (never ``INSERT
        IGNORE``: it truncates over-long keys).

        INSERT ... SELECT, for the order of fencing tokens: InnoDB draws the auto-increment
        value before the unique check, so an acquirer delayed between its draw and its check
        could insert after a later acquirer had held and released the lock, and hold it with
        the smaller id (tests/test_fencing.py pauses an acquirer there with gdb). With
        innodb_autoinc_lock_mode 0 or 1 (MariaDB's default) InnoDB keeps the table's AUTO-INC
        lock to the end of an INSERT ... SELECT (never of an INSERT ... VALUES), so no one else
        draws an id meanwhile. With 2 (MySQL 8's default) it takes no such lock, and the SELECT
        first locks the row of the lockstring's stripe (``id_order``) until the statement
        commits, so acquirers of one lockstring draw their ids one at a time, in the order they
        can hold the row. Mode 2 without that table is reported by the settings check.
        """
        insert = sa.insert(statements.table).from_select(
            list(statements.new_row), self._new_row(statements)
        )
        return insert.returning(*statements.returned) if self.insert_returning else insert

    def acquire_unless_queued(self, statements: StatementParts) -> Any:
        """``acquire``, unless a live ticket lower than ``queue_key`` waits for the lockstring
        (``tickets.NEWCOMER``: any live ticket at all): then insert nothing and raise nothing,
        which tells this refusal from the held row's duplicate key."""
        insert = sa.insert(statements.table).from_select(
            list(statements.new_row),
            self._new_row(statements).where(sa.not_(self._anyone_ahead(statements))),
        )
        return insert.returning(*statements.returned) if self.insert_returning else insert

    def _anyone_ahead(self, statements: StatementParts) -> ColumnElement[bool]:
        """Whether a live ticket lower than ``:queue_key`` waits for the lockstring."""
        requests = statements.requests
        ahead = (
            sa.select(sa.literal(1))
            .select_from(requests)
            .where(
                self.equal(requests.c.lockstring, statements.lockstring_param),
                requests.c.ticket < sa.bindparam("queue_key", type_=sa.BigInteger()),
                _is_live(requests.c.liveness_key),
            )
        )
        return sa.exists(ahead)

    def join_line(self, statements: StatementParts) -> Insert:
        """A ticket: a row of the requests table, whose id is its number."""
        return sa.insert(statements.requests).values(
            lockstring=statements.lockstring_param,
            guid_sha256=_sha256(sa.bindparam("lock_guid", type_=sa.String())),
            liveness_key=sa.bindparam("liveness_key", type_=sa.BigInteger()),
        )

    def leave_line(self, statements: StatementParts) -> Delete:
        requests = statements.requests
        ticket = sa.bindparam("ticket", type_=sa.BigInteger())
        return sa.delete(requests).where(
            # PyMySQL sends the ticket as a literal, and the server folds the NULL test away.
            sa.or_(requests.c.ticket == ticket, ticket.is_(None)),
            statements.backend.equal(requests.c.lockstring, statements.lockstring_param),
            requests.c.guid_sha256 == _sha256(sa.bindparam("lock_guid", type_=sa.String())),
        )

    @classmethod
    def system_name(cls, dialect: Dialect) -> str:
        # Known once connected: SQLAlchemy reads it from the server's version.
        return "mariadb" if getattr(dialect, "is_mariadb", False) else "mysql"

    def live_waiters(self, table: str) -> Executable | None:
        requests = requests_table(table)
        return (
            sa.select(requests.c.lockstring, sa.func.count().label("waiters"))
            .where(_is_live(requests.c.liveness_key))
            .group_by(requests.c.lockstring)
        )

    def sweep_requests(self, statements: StatementParts) -> Delete:
        requests = statements.requests
        return sa.delete(requests).where(sa.not_(_is_live(requests.c.liveness_key)))

    def _new_row(self, statements: StatementParts) -> Select[Any]:
        new_row = sa.select(*statements.new_row.values())
        if statements.id_order is not None:
            # CRC32 of the lockstring's UTF-8 bytes, whatever the connection's character set.
            utf8 = sa.cast(statements.lockstring_param, mysql.CHAR(charset="utf8mb4"))
            stripe = sa.func.crc32(utf8) % ID_ORDER_STRIPES
            new_row = new_row.where(statements.id_order.c.stripe == stripe).with_for_update()
        return new_row

    def purge_batch(self, statements: StatementParts, batch_size: int) -> Delete:
        # MySQL refuses LIMIT in an IN (sub-select) on the same table; DELETE ... LIMIT is fine.
        return (
            sa.delete(statements.table)
            .where(statements.expired_beyond_grace)
            .with_dialect_options(**mysql_options(limit=batch_size))
        )

    # -- schema ------------------------------------------------------------------------------------

    @classmethod
    def lockstring_type(cls, dialect: Dialect, length: int) -> TypeEngine[Any]:
        # MariaDB's default collations fold case and ignore trailing spaces, and even
        # utf8mb4_bin pads; MySQL 8 has no utf8mb4_nopad_bin, but its utf8mb4_0900_bin is NO PAD.
        mariadb = bool(getattr(dialect, "is_mariadb", False))
        collation = "utf8mb4_nopad_bin" if mariadb else "utf8mb4_0900_bin"
        return dialect.type_descriptor(
            mysql.VARCHAR(length, charset="utf8mb4", collation=collation)
        )

    @classmethod
    def timestamp_type(cls, dialect: Dialect) -> TypeEngine[Any]:
        return dialect.type_descriptor(mysql.DATETIME(fsp=6))

    @classmethod
    def timestamp_bind(cls, value: Any) -> Any:
        return value.replace(tzinfo=None)

    @classmethod
    def foreign_guid_default(cls) -> str:
        from ..schema import FOREIGN_GUID_PREFIX

        return f"(concat('{FOREIGN_GUID_PREFIX}', substr(md5(concat(rand(), uuid())), 1, 31)))"

    # -- errors ------------------------------------------------------------------------------------

    def is_unique_violation(self, error: sa.exc.DBAPIError) -> bool:
        return _errno(error) == 1062

    def is_transient_conflict(self, error: sa.exc.DBAPIError) -> bool:
        # lock wait timeout, deadlock, and InnoDB's AUTO-INC lock lost to a deadlock or a
        # timeout ("Failed to read auto-increment value"), met by transactions of several
        # INSERT ... SELECTs (lock_all)
        return _errno(error) in {1205, 1213, 1467}

    def is_missing_table(self, error: sa.exc.DBAPIError) -> bool:
        return _errno(error) == 1146

    def is_read_only(self, error: sa.exc.DBAPIError) -> bool:
        # --read-only (a replica, or a Galera node that left the primary component's writes),
        # and MySQL's own read-only mode.
        return _errno(error) in {1290, 1836}

    # -- connections -------------------------------------------------------------------------------

    @classmethod
    def connect_args(
        cls, url: URL, transaction_pooling: bool, default: Callable[[str, object], None]
    ) -> dict[str, Any]:
        # PyMySQL and aiomysql take the same arguments.
        connect_args: dict[str, Any] = {"connect_timeout": CONNECT_TIMEOUT_SECONDS}
        if url.get_driver_name() == "pymysql":  # aiomysql has no socket timeouts
            default("read_timeout", STATEMENT_TIMEOUT_SECONDS)
            default("write_timeout", STATEMENT_TIMEOUT_SECONDS)
        if "init_command" not in url.query:
            connect_args["init_command"] = (
                f"SET SESSION innodb_lock_wait_timeout = {ROW_LOCK_TIMEOUT_SECONDS}"
            )
        return connect_args

    @classmethod
    def configure_engine(cls, engine: Engine) -> None:
        if engine.dialect.driver == "pymysql":
            sa.event.listen(engine, "do_connect", pymysql_tls.connect)
        sa.event.listen(engine, "connect", _server_clock)
        sa.event.listen(engine, "connect", _no_autocommit_retries)

    @classmethod
    def cap_connect(cls, dialect: Dialect, cparams: dict[str, Any], seconds: float) -> None:
        seconds = max(seconds, 0.1)
        cparams["connect_timeout"] = min(float(cparams.get("connect_timeout") or seconds), seconds)
        if dialect.driver == "pymysql":
            # The server's greeting is read with the read timeout: capped for the start-up
            # only (pymysql_tls.connect gives the connection its own back).
            own = cparams.get("read_timeout")
            cparams["read_timeout"] = min(float(own or seconds), seconds)
            cparams[pymysql_tls.READ_TIMEOUT_AFTER] = own
        elif dialect.driver == "aiomysql":
            # aiomysql bounds only its TCP connect; the greeting is awaited without a limit.
            connect = cparams.pop("async_creator_fn", None) or _aiomysql_connect()
            cparams["async_creator_fn"] = _within(connect, seconds)

    @classmethod
    def interrupt(cls, dbapi_connection: Any) -> None:
        # PyMySQL's socket (read_timeout would end the wait only after a minute).
        sock = getattr(dbapi_connection, "_sock", None)
        if sock is not None:
            shut_down_socket(sock.fileno())

    # -- settings ----------------------------------------------------------------------------------

    @classmethod
    def in_transaction(cls, driver_connection: Any) -> bool | None:
        # PyMySQL's and aiomysql's: an explicit transaction, or none at all in autocommit (an
        # implicit one, autocommit off, is not flagged as one).
        status = getattr(driver_connection, "server_status", None)
        if status is None:
            return None
        return bool(status & _SERVER_STATUS_IN_TRANS) or not status & _SERVER_STATUS_AUTOCOMMIT

    def bound_silence(self, conn: Connection, seconds: float) -> None:
        # MariaDB's idle_transaction_timeout counts only silence inside a transaction; MySQL
        # has none, and its wait_timeout counts any silence. Either is the session's: set here,
        # and set back as the transaction ends (see _restore_silence), unless already shorter.
        name = _SILENCE_LIMIT[bool(getattr(conn.dialect, "is_mariadb", False))]
        now = int(conn.execute(sa.text(f"SELECT @@session.{name}")).scalar_one())
        limit = min(max(math.ceil(seconds), 1), _MOST_SECONDS)
        if 0 < now <= limit:
            return  # the session's own limit, or an earlier guard's in this transaction
        if SILENCE_KEY not in conn.info:
            for ending in _TRANSACTION_ENDS:
                if not sa.event.contains(conn, ending, _restore_silence):
                    sa.event.listen(conn, ending, _restore_silence)
            conn.info[SILENCE_KEY] = (name, now)
        conn.execute(sa.text(f"SET SESSION {name} = :limit"), {"limit": limit})

    def read_settings(self, conn: Connection, table: str) -> ServerSettings:
        """``innodb_autoinc_lock_mode=2`` (MySQL 8's default) draws auto-increment values under
        no lock that lasts the statement. Then only the stripes table keeps an acquirer delayed
        between drawing its id and the unique check from holding the lock after a later holder,
        with a smaller fencing token (see :meth:`acquire`), so a table without it is reported.
        Mutual exclusion does not depend on it; the order of tokens does.

        A Galera cluster of several nodes: each node draws ids from its own interleaved series
        (``auto_increment_offset``), and a lock taken through one node may carry a smaller id
        than an earlier holder's taken through another (tests/test_galera.py sees it happen).
        Certification keeps two holders out, whichever nodes they write to; the order of tokens
        holds only if every lock write goes to one node, which no client can tell from its
        session, so the check reports every multi-node cluster."""
        problems = []
        lock_stripes = False
        # NOW() (as UTC_TIMESTAMP(), the statements' clock) follows the session's ``timestamp``
        # when something set it (an init_command, a test's frozen clock); SYSDATE() never does.
        flush, autoinc, clock_set_apart = conn.exec_driver_sql(
            "SELECT @@innodb_flush_log_at_trx_commit, @@innodb_autoinc_lock_mode, "
            "ABS(TIMESTAMPDIFF(MICROSECOND, NOW(6), SYSDATE(6))) / 1e6"
        ).one()
        if flush is not None and int(flush) != 1:
            problems.append(UnsafeSetting(f"innodb_flush_log_at_trx_commit={flush}", LOSES_ROWS))
        if clock_set_apart is not None and float(clock_set_apart) > SESSION_CLOCK_TOLERANCE:
            problems.append(UnsafeSetting("SET timestamp", MOVES_THE_CLOCK))
        if autoinc is not None and int(autoinc) == 2:
            lock_stripes = _has_table(conn, id_order_table_name(table))
            if not lock_stripes:
                setting = (
                    f"innodb_autoinc_lock_mode=2 with lock table {table} lacking "
                    f"{id_order_table_name(table)} "
                    f"(run `sqllocker --url URL --table {table} migrate`)"
                )
                problems.append(UnsafeSetting(setting, REORDERS_IDS))
        # This session's values (sqllocker's own connections turn the retries off).
        wsrep: dict[str, object] = dict(
            conn.exec_driver_sql(
                "SHOW VARIABLES WHERE variable_name IN ('wsrep_on', 'wsrep_retry_autocommit')"
            ).all()
        )
        galera_node = str(wsrep.get("wsrep_on", "")).upper() == "ON"
        galera = conn.exec_driver_sql("SHOW GLOBAL STATUS LIKE 'wsrep_cluster_size'").first()
        if galera is not None and str(galera[1]).isdigit() and int(galera[1]) > 1:
            setting = (
                f"a Galera cluster of {galera[1]} nodes (wsrep_cluster_size), unless every lock "
                "write goes to one node"
            )
            problems.append(UnsafeSetting(setting, REORDERS_IDS))
        return ServerSettings(
            problems,
            lock_stripes,
            has_line=_has_table(conn, requests_table_name(table)),
            foreign=self.foreign_table(conn, table),
            replays_inserts=galera_node,
            retries_autocommit=galera_node and str(wsrep.get("wsrep_retry_autocommit")) != "0",
        )

    def foreign_table(self, conn: Connection, table: str) -> str | None:
        """A table adopted without ``--exact-lockstrings`` keeps its case-folding collation on
        purpose, and has a version row to show for it."""
        columns: dict[str, str] = dict(
            conn.exec_driver_sql(
                "SELECT column_name, COALESCE(collation_name, '') FROM "
                "information_schema.columns WHERE table_schema = DATABASE() "
                "AND table_name = %(table)s",
                {"table": table},
            ).all()
        )
        if not columns:
            return None
        if "guid" not in columns:
            return "it has no guid column"
        collation = columns.get("lockstring", "")
        if (
            collation
            and not collation.endswith("_bin")
            and current_revision_on(conn, table) is None
        ):
            return f"its lockstrings compare by collation {collation}, which folds case"
        return None

    # -- migrations and adoption -------------------------------------------------------------------

    @classmethod
    @contextmanager
    def migration_connection(cls, engine: Engine) -> Iterator[Connection]:
        with engine.connect().execution_options(isolation_level="READ COMMITTED") as conn:
            # DDL commits implicitly, so the lock is a session lock released explicitly.
            conn.execute(sa.select(sa.func.get_lock(_MIGRATION_LOCK_NAME, 600)))
            conn.commit()
            try:
                with conn.begin():
                    yield conn
            finally:
                try:
                    conn.execute(sa.select(sa.func.release_lock(_MIGRATION_LOCK_NAME)))
                    conn.commit()
                except sa.exc.SQLAlchemyError:
                    # The session ended (killed, cut off), its lock with it: the migration's
                    # own error is the one to tell.
                    conn.invalidate()

    def reflected_default(self, conn: Connection, table: str, column: str) -> str | None:
        # SQLAlchemy does not reflect MySQL's expression defaults at all.
        default = conn.exec_driver_sql(
            "SELECT column_default FROM information_schema.columns WHERE table_schema = "
            "DATABASE() AND table_name = %(table)s AND column_name = %(column)s",
            {"table": table, "column": column},
        ).scalar()
        return None if default is None else str(default)

    def adoption_names(self, table: str) -> list[str]:
        return [
            swap_name(table),
            set_aside_name(table),
            f"{table}_held",
            id_order_table_name(table),
            requests_table_name(table),
        ]

    def reopen_for_perl(self, conn: Connection, table: str) -> None:
        mysql_adoption.reopen(conn, table)

    def ids_handed_out_below(self, conn: Connection, source: str, highest_row: int) -> int:
        return max(highest_row + 1, mysql_adoption.next_auto_increment(conn, source))

    def next_id_at_least(self, table: str, first: int) -> list[Executable | str]:
        return [f"ALTER TABLE {table} AUTO_INCREMENT = {int(first)}"]

    def lockstring_like(
        self, conn: Connection, source: str, table: str, exact_lockstrings: bool
    ) -> list[Executable | str]:
        return mysql_adoption.lockstring_like(conn, source, table, exact_lockstrings)

    def swap_in(
        self,
        conn: Connection,
        table: str,
        new: str,
        aside: str,
        copy_rows: Callable[[Connection], list[int]],
    ) -> int:
        return mysql_adoption.swap_in(conn, table, new, aside, copy_rows)


# A server without Galera does not know its variables.
_UNKNOWN_SYSTEM_VARIABLE = 1193


def _server_clock(dbapi_connection: Any, _record: Any) -> None:
    """The session's clock set back to the server's: an ``init_command`` of the URL's that set
    ``timestamp`` (a frozen test clock, say) would have the statements judge expiry by it."""
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("SET SESSION timestamp = DEFAULT")
    finally:
        cursor.close()


def _no_autocommit_retries(dbapi_connection: Any, _record: Any) -> None:
    """On a Galera node, an autocommit statement that a replicated write aborted is run again
    by the node itself (``wsrep_retry_autocommit``, 1 by default), after its client may have
    been told of the first attempt's row: an acquire's INSERT could then stand under another
    id, or not at all. Turned off, the node answers with a deadlock error instead, which the
    lock operations try again as any contention, and an acquire need not read its row back
    (``ServerSettings.retries_autocommit``)."""
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("SET SESSION wsrep_retry_autocommit = 0")
    except Exception as error:
        if getattr(error, "args", ())[:1] != (_UNKNOWN_SYSTEM_VARIABLE,):
            raise
    finally:
        cursor.close()


def _has_table(conn: Connection, name: str) -> bool:
    return bool(
        conn.exec_driver_sql(
            "SELECT COUNT(*) FROM information_schema.tables "
            "WHERE table_schema = DATABASE() AND table_name = %(name)s",
            {"name": name},
        ).scalar()
    )


# The session variable that ends a silent client's session: MariaDB's (True) or MySQL's.
_SILENCE_LIMIT = {True: "idle_transaction_timeout", False: "wait_timeout"}
# Their largest value (a year, in seconds).
_MOST_SECONDS = 31536000
# In a connection's info while a guard's limit stands: (variable, the session's own value).
SILENCE_KEY = "sqllocker_silence_limit"
# The Connection events that end a transaction (each fires before it ends on the server).
_TRANSACTION_ENDS = ("commit", "rollback", "commit_twophase", "rollback_twophase")


def _restore_silence(conn: Connection, *_: Any) -> None:
    """As a guarded transaction ends: give the session back its own silence limit, before the
    connection goes back to its pool. A connection that is gone has no session to restore."""
    saved = conn.info.pop(SILENCE_KEY, None)
    if saved is None:
        return
    name, before = saved
    cursor = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
    try:
        cursor.execute(f"SET SESSION {name} = %s", (int(before),))
    except conn.dialect.loaded_dbapi.Error:
        conn.info[SILENCE_KEY] = saved  # not restored: the session is gone, or going
    finally:
        with contextlib.suppress(conn.dialect.loaded_dbapi.Error):
            cursor.close()


def _errno(error: sa.exc.DBAPIError) -> int | None:
    args = getattr(error.orig, "args", ())
    return args[0] if args and isinstance(args[0], int) else None


def _aiomysql_connect() -> Any:
    import aiomysql

    return aiomysql.connect


def _within(connect: Any, seconds: float) -> Any:
    """``connect``, an async connect function, ending by ``seconds`` (then TimeoutError)."""
    import asyncio

    async def bounded(*args: Any, **kwargs: Any) -> Any:
        try:
            return await asyncio.wait_for(connect(*args, **kwargs), seconds)
        except asyncio.TimeoutError:
            from pymysql.err import OperationalError

            raise OperationalError(
                2003, f"Can't connect to MySQL server: no answer within {seconds:.1f} s"
            ) from None

    return bounded
