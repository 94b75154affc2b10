"""PostgreSQL through psycopg 3: atomic takeover, waiters in line by ticket and handed the row
by the release (``sqllocker.tickets``), and a database shared with other roles.

Every catalog function and operator is named with its schema (``pg_catalog.``) and exact
types, and strings are compared as ``text`` on both sides, so that nothing another role creates
in a schema on the caller's path can run in its place (CVE-2018-1058).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import URL, Connection, Dialect, Engine
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.expression import Executable
from sqlalchemy.types import TypeEngine

from ..errors import UnsafeDatabase
from ..notifications import leaders_channel_for
from ..schema import UTCDateTime, requests_table_name
from ..server_settings import LOSES_ROWS, LOSES_ROWS_ON_FAILOVER, ServerSettings, UnsafeSetting
from ..timeouts import (
    CONNECT_TIMEOUT_SECONDS,
    DEAD_PEER_SECONDS,
    ROW_LOCK_TIMEOUT_SECONDS,
    STATEMENT_TIMEOUT_SECONDS,
)
from . import postgresql_grant_keys as grant_keys
from .base import Backend, StatementParts, shut_down_socket

# idle_in_transaction_session_timeout for the rest of the transaction: :ms, or the session's
# own if shorter (0 is no limit); catalog-qualified, so nothing on the search path stands in.
_BOUND_SILENCE = sa.text(
    "SELECT pg_catalog.set_config('idle_in_transaction_session_timeout', CAST(CASE "
    "WHEN CAST(setting AS bigint) BETWEEN 1 AND CAST(:ms AS bigint) THEN CAST(setting AS bigint) "
    "ELSE CAST(:ms AS bigint) END AS text), true) "
    "FROM pg_catalog.pg_settings WHERE name = 'idle_in_transaction_session_timeout'"
)
# The setting's largest value (INT_MAX milliseconds, some 24 days).
_MOST_MILLISECONDS = 2**31 - 1

if TYPE_CHECKING:
    from sqlalchemy.sql import Delete, Select
    from sqlalchemy.sql.dml import ReturningInsert
    from sqlalchemy.sql.selectable import TextualSelect


# How long an acquire waits for the lockstring's id-order key, which others hold only for their
# INSERT: a wait this long means a session outside the protocol holds it.
ID_ORDER_WAIT_MS = 1000
# libpq's transaction statuses (psycopg.pq.TransactionStatus) inside a transaction.
_INTRANS, _INERROR = 2, 3
# Serialises concurrent `sqllocker migrate` runs ("SQLL").
_MIGRATION_LOCK_KEY = 0x5351_4C4C


class PostgreSQLBackend(Backend):
    name = "postgresql"
    sync_driver = "postgresql+psycopg"
    async_driver = "postgresql+psycopg"
    atomic_takeover = True
    hands_over = True

    def now(self) -> ColumnElement[Any]:
        return sa.func.pg_catalog.clock_timestamp(type_=UTCDateTime())

    def shifted_now(self, param: str) -> ColumnElement[Any]:
        return self.shifted(self.now(), param)

    def shifted(self, moment: ColumnElement[Any], param: str) -> ColumnElement[Any]:
        # An interval of seconds only. One with a day part (which psycopg gives a timedelta of
        # a day or more, or of less than nothing: -1 s is '-1 days +23:59:59') is added by the
        # session's calendar, whose days that change to or from summer time last 23 or 25
        # hours: a grace of 1 s then came out as an hour ahead, and live rows as expired.
        seconds = sa.cast(sa.bindparam(param, type_=sa.Float()), postgresql.DOUBLE_PRECISION)
        zero: ColumnElement[int] = sa.literal_column("0")
        interval = sa.func.pg_catalog.make_interval(
            zero, zero, zero, zero, zero, zero, seconds, type_=sa.Interval()
        )
        return moment + interval

    def with_json_key(
        self, document: ColumnElement[Any], key: str, text: ColumnElement[Any]
    ) -> ColumnElement[Any]:
        path = sa.cast(sa.literal("{" + key + "}"), postgresql.ARRAY(sa.Text))
        value = sa.func.pg_catalog.to_jsonb(sa.cast(text, sa.Text))
        return sa.func.pg_catalog.jsonb_set(document, path, value)

    def json_key_absent(self, document: ColumnElement[Any], key: str) -> ColumnElement[bool]:
        return sa.not_(sa.func.pg_catalog.jsonb_exists(document, sa.cast(sa.literal(key), sa.Text)))

    def as_text(self, value: ColumnElement[Any]) -> ColumnElement[Any]:
        # varchar has no ``=`` of its own, so an exact ``=(varchar, varchar)`` that another role
        # created in a schema on our path would be chosen over pg_catalog's; with text on both
        # sides, pg_catalog's is the exact match, and it comes first.
        return sa.cast(value, sa.Text)

    def starts_with(self, column: ColumnElement[str], prefix: str) -> ColumnElement[bool]:
        return sa.func.pg_catalog.starts_with(
            self.as_text(column), sa.cast(sa.literal(prefix), sa.Text), type_=sa.Boolean()
        )

    # -- statements ------------------------------------------------------------------------------

    def acquire(self, statements: StatementParts) -> ReturningInsert[Any]:
        """``ON CONFLICT DO NOTHING`` returns no row when held, with no ERROR in the server log,
        and without locking the holder's row: an upsert that decides not to update still locks
        the row it met and must flush its commit to disk, and the holder's release then waits
        for that refused acquirer."""
        insert = postgresql.insert(statements.table).from_select(
            list(statements.new_row), self._new_row_in_id_order(statements)
        )
        c = statements.table.c
        return insert.on_conflict_do_nothing(index_elements=[c.lockstring]).returning(
            *statements.returned
        )

    def acquire_unless_queued(self, statements: StatementParts) -> ReturningInsert[Any]:
        """``acquire``, unless a live ticket lower than ``queue_key`` waits for the lockstring
        (see ``sqllocker.tickets``; ``tickets.NEWCOMER``: any live ticket at all): then insert
        nothing, as if refused. So a newcomer cannot take the row ahead of those already
        waiting, nor a waiter ahead of those before it."""
        anyone_ahead = sa.text(
            f"NOT {statements.function('anyone_ahead')}(CAST(:ls AS varchar), "
            "CAST(:queue_key AS bigint))"
        ).bindparams(statements.lockstring_param, sa.bindparam("queue_key", type_=sa.BigInteger))
        insert = postgresql.insert(statements.table).from_select(
            list(statements.new_row),
            self._new_row_in_id_order(statements, only_if=sa.type_coerce(anyone_ahead, sa.Boolean)),
        )
        c = statements.table.c
        return insert.on_conflict_do_nothing(index_elements=[c.lockstring]).returning(
            *statements.returned
        )

    def leader_notice(self, statements: StatementParts) -> TextualSelect:
        """``pg_notify`` on the table's leaders channel, with the election's name."""
        channel = leaders_channel_for(statements.table.name)
        return (
            sa.text("SELECT pg_catalog.pg_notify(:channel, CAST(:ls AS text)) IS NULL AS sent")
            .bindparams(sa.bindparam("channel", channel, type_=sa.String))
            .columns(sa.column("sent", sa.Boolean))
        )

    def join_line(self, statements: StatementParts) -> TextualSelect:
        """The table's ``queue_join``: the ticket, and whether the row is held; a release
        signs its grant to the ticket with ``:grant_key`` (``notifications.GrantKey``)."""
        # The function's name is the validated table's, in its quoted schema.
        return (
            sa.text(
                f"SELECT j.ticket, j.held FROM {statements.function('queue_join')}("  # noqa: S608
                "CAST(:ls AS varchar), CAST(:lock_guid AS varchar), CAST(:holder AS jsonb), "
                "CAST(:ttl AS double precision), CAST(:liveness_key AS bigint), "
                "CAST(:grant_key AS bytea)) AS j"
            )
            .bindparams(sa.bindparam("holder", type_=statements.table.c.locked_by.type))
            .columns(sa.column("ticket", sa.BigInteger), sa.column("held", sa.Boolean))
        )

    def join_line_unsigned(self, statements: StatementParts) -> TextualSelect:
        """``queue_join`` without a key, as a table behind revision 0003 has it: its release
        tells the ticket's grant unsigned, to be read back."""
        return (
            sa.text(
                f"SELECT j.ticket, j.held FROM {statements.function('queue_join')}("  # noqa: S608
                "CAST(:ls AS varchar), CAST(:lock_guid AS varchar), CAST(:holder AS jsonb), "
                "CAST(:ttl AS double precision), CAST(:liveness_key AS bigint)) AS j"
            )
            .bindparams(sa.bindparam("holder", type_=statements.table.c.locked_by.type))
            .columns(sa.column("ticket", sa.BigInteger), sa.column("held", sa.Boolean))
        )

    def leave_line(self, statements: StatementParts) -> TextualSelect:
        """The table's ``queue_leave``: says whether it gave back a row granted to the ticket."""
        return sa.text(
            f"SELECT {statements.function('queue_leave')}(CAST(:ticket AS bigint), "
            "CAST(:ls AS varchar), CAST(:lock_guid AS varchar), CAST(:give_back AS boolean)) "
            "AS given_back"
        ).columns(sa.column("given_back", sa.Boolean))

    def sweep_requests(self, statements: StatementParts) -> TextualSelect:
        """The table's ``sweep_requests``: how many tickets it deleted."""
        return sa.text(f"SELECT {statements.function('sweep_requests')}()").columns(
            sa.column("swept", sa.BigInteger)
        )

    def live_waiters(self, table: str) -> Executable | None:
        """A ticket is live while a session holds the advisory lock of its liveness key (a
        bigint key shows in ``pg_locks`` as classid, its high half, and objid, its low half)."""
        return sa.text(
            "SELECT q.lockstring, count(*) AS waiters"  # noqa: S608 (a checked table name)
            f" FROM {requests_table_name(table)} AS q"
            " WHERE EXISTS (SELECT FROM pg_catalog.pg_locks AS l"
            "  WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted"
            "   AND l.database = (SELECT oid FROM pg_catalog.pg_database"
            "                      WHERE datname = pg_catalog.current_database())"
            "   AND ((l.classid::bigint << 32) | l.objid::bigint) = q.liveness_key)"
            " GROUP BY q.lockstring"
        ).columns(sa.column("lockstring", sa.String), sa.column("waiters", sa.BigInteger))

    def take_over(self, statements: StatementParts) -> ReturningInsert[Any]:
        """Replace an expired holder's row with ours in one atomic statement.

        ``ON CONFLICT DO UPDATE ... WHERE expired`` replaces the row in place, including a fresh
        id from the sequence (``excluded.id``), so the fencing token still grows; of several
        acquirers racing for one expired row, the row lock lets exactly one match the WHERE.
        A row that is not (or no longer) expired makes it return no row.
        """
        c = statements.table.c
        insert = postgresql.insert(statements.table).from_select(
            list(statements.new_row), self._new_row_in_id_order(statements)
        )
        return insert.on_conflict_do_update(
            index_elements=[c.lockstring],
            set_={
                name: insert.excluded[name]
                for name in ("id", "guid", "created", "expires", "locked_by")
            },
            where=statements.expired_beyond_grace,
        ).returning(*statements.returned)

    def _new_row_in_id_order(
        self, statements: StatementParts, only_if: ColumnElement[bool] | None = None
    ) -> Select[Any]:
        """Our new row, as a SELECT to insert from, which first waits for any other acquirer
        of the lockstring to finish its INSERT's transaction; with ``only_if``, no row (and no
        wait) unless that holds, checked before the wait.

        The sequence gives a row its id when the INSERT forms the row, before the unique index
        is checked: an acquirer that drew id n and was then delayed could insert after a later
        acquirer had held and released the lock with id n + 1, and hold it with the smaller
        fencing token (tests/test_fencing.py makes it happen every time without this). The
        transaction-scoped advisory lock in FROM runs before the row is formed, so ids are
        drawn one acquirer at a time per lockstring, in the order the rows can be held. Its
        two-int4 key is a key space apart from the tickets' bigint liveness keys.
        """
        catalog = sa.func.pg_catalog
        in_turn = sa.select(
            catalog.pg_advisory_xact_lock(
                catalog.hashtext(sa.cast(sa.literal(statements.table_key), sa.Text)),
                catalog.hashtext(sa.cast(statements.lockstring_param, sa.Text)),
            ).label("drawn_in_turn")
        )
        # A WHERE without a FROM is a one-time filter, evaluated before the target list. It
        # bounds the wait for the key (a session outside sqllocker's protocol may hold it: see
        # ``id_order_blocker``), also where no session setting reaches (a transaction pooler);
        # the limit ends with the statement's transaction. Refused by ``only_if``, the INSERT
        # neither waits for others' turn nor makes them wait for its.
        in_turn = in_turn.where(
            catalog.set_config(
                sa.cast(sa.literal("lock_timeout"), sa.Text),
                sa.cast(sa.literal(f"{ID_ORDER_WAIT_MS}"), sa.Text),
                sa.true(),
            ).is_not(None)
        )
        if only_if is not None:
            in_turn = in_turn.where(only_if)
        return sa.select(*statements.new_row.values()).select_from(in_turn.subquery("ids_in_order"))

    def release(self, statements: StatementParts) -> Delete:
        """The release's transaction commits without waiting for its WAL to reach disk
        (``synchronous_commit`` off for that transaction only), so that a hand-off under
        contention waits for the disk once, at the next holder's acquire, not twice. A release
        lost in a server crash is safe: the row comes back, and the lock stays held until it
        expires. It cannot come back after someone else's acquire did, because that acquire's
        commit waits for the WAL to be flushed up to its own record, which the release's
        precedes. Acquire, extend, takeover, break and purge still wait: a lost acquire or
        extend would let a second holder in."""
        # Evaluated on the matched row, before it is deleted; the setting ends with the
        # statement's transaction.
        unflushed = sa.func.pg_catalog.set_config(
            sa.cast(sa.literal("synchronous_commit"), sa.Text),
            sa.cast(sa.literal("off"), sa.Text),
            sa.true(),
        )
        return super().release(statements).where(self.equal(unflushed, sa.literal("off")))

    def id_order_blocker(self, statements: StatementParts) -> TextualSelect | None:
        """The pid of another session holding the lockstring's id-order key, which an acquirer
        holds only for its INSERT: an acquire that waited out its bound for that key names it
        (a session of a role outside sqllocker's protocol, or a stuck one)."""
        return (
            sa.text(
                "SELECT l.pid FROM pg_catalog.pg_locks AS l "
                "WHERE l.locktype OPERATOR(pg_catalog.=) 'advisory'::text AND l.granted "
                "AND l.objsubid OPERATOR(pg_catalog.=) 2::smallint "
                "AND l.database OPERATOR(pg_catalog.=) (SELECT d.oid FROM pg_catalog.pg_database "
                "AS d WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database()) "
                "AND l.classid::bigint OPERATOR(pg_catalog.=) (pg_catalog.hashtext("
                "CAST(:table_key AS text))::bigint OPERATOR(pg_catalog.&) 4294967295::bigint) "
                "AND l.objid::bigint OPERATOR(pg_catalog.=) (pg_catalog.hashtext("
                "CAST(:ls AS text))::bigint OPERATOR(pg_catalog.&) 4294967295::bigint) "
                "AND l.pid OPERATOR(pg_catalog.<>) pg_catalog.pg_backend_pid() LIMIT 1"
            )
            .bindparams(sa.bindparam("table_key", statements.table_key, type_=sa.Text))
            .columns(sa.column("pid", sa.Integer))
        )

    # -- schema ------------------------------------------------------------------------------------

    @classmethod
    def holder_json_type(cls, dialect: Dialect) -> TypeEngine[Any]:
        return dialect.type_descriptor(postgresql.JSONB())

    @classmethod
    def foreign_guid_default(cls) -> str:
        from ..schema import FOREIGN_GUID_PREFIX

        # Every name qualified: the expression is stored resolved, but written by a migration
        # that may run with another role's schema ahead on its path.
        return (
            f"('{FOREIGN_GUID_PREFIX}'::text OPERATOR(pg_catalog.||) pg_catalog.substr("
            "pg_catalog.md5(pg_catalog.random()::text OPERATOR(pg_catalog.||) "
            "pg_catalog.clock_timestamp()::text), 1, 31))"
        )

    # -- errors ------------------------------------------------------------------------------------

    def is_unique_violation(self, error: sa.exc.DBAPIError) -> bool:
        return _sqlstate(error) == "23505"

    def is_transient_conflict(self, error: sa.exc.DBAPIError) -> bool:
        # serialization failure, deadlock, lock_timeout
        return _sqlstate(error) in {"40001", "40P01", "55P03"}

    def is_missing_table(self, error: sa.exc.DBAPIError) -> bool:
        return _sqlstate(error) == "42P01"

    def is_missing_function(self, error: sa.exc.DBAPIError) -> bool:
        return _sqlstate(error) == "42883"  # undefined_function

    # Where a ticket's grant key would be seen by others: then it is taken without one.
    others_read_tickets = staticmethod(grant_keys.others_read_tickets)
    binds_in_text = staticmethod(grant_keys.binds_in_text)

    def is_read_only(self, error: sa.exc.DBAPIError) -> bool:
        # read_only_sql_transaction: a standby, or a session opened read-only
        return _sqlstate(error) == "25006"

    # -- connections -------------------------------------------------------------------------------

    @classmethod
    def url_text(cls, text: str) -> str:
        """libpq's ``postgresql://user@host1:port1,host2:port2/db``, which SQLAlchemy does not
        parse, as ``postgresql://user@/db?host=host1:port1&host=host2:port2``, which it does."""
        scheme, separator, rest = text.partition("://")
        authority, _, path = rest.partition("/")
        user, at, hosts = authority.rpartition("@")
        if not separator or "," not in hosts:
            return text
        database, _, query = path.partition("?")
        extra = "&".join(f"host={host}" for host in hosts.split(","))
        query = f"{query}&{extra}" if query else extra
        return f"{scheme}://{user}{at}/{database}?{query}"

    @classmethod
    def connect_args(
        cls, url: URL, transaction_pooling: bool, default: Callable[[str, object], None]
    ) -> dict[str, Any]:
        connect_args: dict[str, Any] = {"connect_timeout": CONNECT_TIMEOUT_SECONDS}
        # libpq's own settings (not the server's), so they pass through a pooler too.
        default("keepalives", 1)
        default("keepalives_idle", DEAD_PEER_SECONDS // 3)
        default("keepalives_interval", DEAD_PEER_SECONDS // 6)
        default("keepalives_count", 3)
        default("tcp_user_timeout", DEAD_PEER_SECONDS * 1000)
        if transaction_pooling:
            # Each transaction may run on another server session: a statement prepared on one
            # is missing on the next (PgBouncer before 1.21), and PgBouncer refuses the
            # ``options`` startup parameter, whose settings would not reach later sessions
            # anyway. The settings check reads the server's own synchronous_commit instead.
            connect_args["prepare_threshold"] = None
        elif "options" not in url.query:
            # A lock row acknowledged and then lost in a crash would let a second holder in
            # with the same id; synchronous_commit=off does exactly that. Force it on for our
            # session.
            connect_args["options"] = (
                f"-c synchronous_commit=on -c lock_timeout={ROW_LOCK_TIMEOUT_SECONDS * 1000} "
                f"-c statement_timeout={STATEMENT_TIMEOUT_SECONDS * 1000} "
                # the WARNING of a cancelled wait for a standby (``statement_warnings``)
                "-c client_min_messages=warning"
            )
        if "application_name" not in url.query:
            connect_args["application_name"] = "sqllocker"
        if isinstance(url.query.get("host"), tuple):
            # Several hosts (a highly available cluster): connect to the one that takes writes,
            # as a client that found its primary demoted does when it reconnects.
            default("target_session_attrs", "read-write")
        return connect_args

    @classmethod
    def takes_tickets(cls, dialect: Dialect) -> bool:
        return dialect.driver == "psycopg"

    @classmethod
    def cap_connect(cls, dialect: Dialect, cparams: dict[str, Any], seconds: float) -> None:
        # libpq's connect_timeout covers the whole start-up, in whole seconds, at least 2.
        own = int(cparams.get("connect_timeout") or 0)
        capped = max(2, math.ceil(seconds))
        cparams["connect_timeout"] = capped if own <= 0 else min(own, capped)

    @classmethod
    def statement_warnings(cls, dbapi_connection: Any) -> list[str] | None:
        # A commit whose wait for a synchronous standby is cancelled (by anyone: a job's time
        # limit, Ctrl-C, pg_cancel_backend) ends with a WARNING and is visible here, maybe never
        # on the standbys. Known by the server function that warns, which no language of its
        # messages translates; other warnings (a wraparound's, a trigger's) are no concern.
        driver = getattr(dbapi_connection, "driver_connection", dbapi_connection)
        if not hasattr(driver, "add_notice_handler"):
            return None  # psycopg2, whose notices are text only: a psycopg 3 URL watches them
        warnings: list[str] | None = getattr(driver, _WARNINGS, None)
        if warnings is None:
            warnings = []
            driver.add_notice_handler(functools.partial(_record_warning, warnings))
            setattr(driver, _WARNINGS, warnings)
        return warnings

    @classmethod
    def interrupt(cls, dbapi_connection: Any) -> None:
        # A cancel request would need a new connection to the frozen server: the socket is
        # shut down instead (psycopg then reports the connection lost).
        shut_down_socket(dbapi_connection.pgconn.socket)

    # -- settings ----------------------------------------------------------------------------------

    @classmethod
    def in_transaction(cls, driver_connection: Any) -> bool | None:
        info = getattr(driver_connection, "info", None)  # psycopg's, sync and async
        status = getattr(info, "transaction_status", None)
        return None if status is None else int(status) in (_INTRANS, _INERROR)

    def reads_an_older_snapshot(self, conn: Connection, error: Exception | None) -> bool:
        if error is not None:
            # serialization_failure: the row changed after the transaction's snapshot (a
            # renewal), which cannot then lock it
            return isinstance(error, sa.exc.DBAPIError) and _sqlstate(error) == "40001"
        level = conn.exec_driver_sql(_ISOLATION).scalar()
        return level != "read committed"

    def bound_silence(self, conn: Connection, seconds: float) -> None:
        # SET LOCAL, as set_config(..., true): it ends with the transaction, whichever way, so
        # the caller's pooled connection keeps its own setting; a shorter one is kept.
        conn.execute(_BOUND_SILENCE, {"ms": min(math.ceil(seconds * 1000), _MOST_MILLISECONDS)})

    def read_settings(self, conn: Connection, table: str) -> ServerSettings:
        problems = []
        found = conn.exec_driver_sql(_SCHEMAS_WITH, {"table": table}).scalars().all()
        if len(found) > 1:
            # Which one a role's statements reach depends on its search path ("$user" comes
            # first): a role that may create a schema named like another role shadows the
            # lock table for it, and the two lock apart.
            raise UnsafeDatabase(
                f"lock table {table!r} is in more than one schema of the search path "
                f"({', '.join(found)}): roles whose search paths differ would lock in different "
                "tables; drop the one that is not the lock table, or give this role a search "
                "path with one of them (ALTER ROLE ... SET search_path)"
            )
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
        replication, replicated = _replication(conn)
        problems += replication
        return ServerSettings(
            problems,
            lock_stripes=False,
            schema=schema,
            has_line=bool(has_functions),
            foreign=self.foreign_table(conn, table),
            replicated=replicated,
        )

    def foreign_table(self, conn: Connection, table: str) -> str | None:
        columns: dict[str, str] = dict(conn.exec_driver_sql(_COLUMNS, {"table": table}).all())
        if not columns:
            return None
        if "guid" not in columns:
            return "it has no guid column"
        if columns.get("locked_by") not in ("jsonb", "json"):
            return f"its locked_by column is {columns.get('locked_by')}, not JSON"
        return None

    # -- migrations and adoption -------------------------------------------------------------------

    @classmethod
    @contextmanager
    def migration_connection(cls, engine: Engine) -> Iterator[Connection]:
        connection = engine.connect().execution_options(isolation_level="READ COMMITTED")
        with connection as conn, conn.begin():
            conn.execute(sa.select(sa.func.pg_advisory_xact_lock(_MIGRATION_LOCK_KEY)))
            yield conn

    def prepare_adoption(self, conn: Connection, table: str) -> None:
        conn.exec_driver_sql(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")

    def adoption_names(self, table: str) -> list[str]:
        return [f"{table}_held", f"{table}_requests"]

    def adoption_before_create(self, table: str) -> list[Executable | str]:
        # Perl processes that lock meanwhile wait for the lock, then find the new table by name.
        return [f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE", f"DROP TABLE {table}"]

    def adoption_refusal(self, conn: Connection, table: str) -> str | None:
        # DBIx::Locker writes local times without an offset: a timestamptz column read each
        # one in its Perl session's TimeZone, which the adoption cannot know.
        zoned = conn.exec_driver_sql(
            "SELECT pg_catalog.string_agg(attname::text, ', ' ORDER BY attname) "
            "FROM pg_catalog.pg_attribute WHERE attrelid = %(table)s::regclass "
            "AND attname IN ('created', 'expires') "
            "AND atttypid = 'pg_catalog.timestamptz'::regtype",
            {"table": table},
        ).scalar()
        if zoned:
            return (
                f"its {zoned} hold time zones, each read in the TimeZone of the Perl session "
                "that wrote it, which the adoption cannot know; make them plain timestamps "
                "of the Perl processes' zone first (ALTER TABLE ... ALTER COLUMN expires TYPE "
                "timestamp USING expires AT TIME ZONE 'ZONE')"
            )
        # The ids: the adoption starts above the last its sequence handed out, and DBD::Pg's
        # long-running Perl processes keep asking that sequence for the id they just inserted,
        # which must then fail (the sequence goes with the table), not answer an old one.
        owned = conn.exec_driver_sql(
            "SELECT pg_catalog.pg_get_serial_sequence(%(table)s::text, 'id'::text)",
            {"table": table},
        ).scalar()
        if owned is None:
            return (
                "its id is not drawn from a sequence it owns, whose ids handed out, and whose "
                "use by Perl processes after the adoption, cannot be followed; make it the "
                "column's own (ALTER SEQUENCE ... OWNED BY TABLE.id) first"
            )
        return None

    def grants_kept(
        self, conn: Connection, table: str, online: bool = True
    ) -> list[Executable | str]:
        # The Perl processes of other roles must go on inserting, reading the id they drew
        # (currval) and deleting, in the new table, and with its new sequence; so must those
        # of the table's owner, where another role adopts it (a DBA's): the new table is the
        # adopter's.
        steps: list[Executable | str] = []
        grants: list[tuple[str, str, str, bool]] = [
            (kind, grantee, privilege, grantable)
            for kind, grantee, privilege, grantable in conn.exec_driver_sql(
                _GRANTS, {"table": table}
            )
        ]
        # Printed (``--sql``), they may be applied by another role than this one (a DBA's).
        owner = conn.exec_driver_sql(_OTHER_OWNER if online else _OWNER, {"table": table}).scalar()
        if owner is not None:
            table_rights = ("SELECT", "INSERT", "UPDATE", "DELETE")
            grants += [("table", owner, privilege, False) for privilege in table_rights]
            grants += [("sequence", owner, privilege, False) for privilege in ("USAGE", "SELECT")]
        for kind, grantee, privilege, grantable in grants:
            if privilege not in _PRIVILEGES:
                continue
            option = " WITH GRANT OPTION" if grantable else ""
            if kind == "table":
                steps.append(f"GRANT {privilege} ON TABLE {table} TO {grantee}{option}")
            else:  # the new table's sequence, named as PostgreSQL names it
                sequence = f"pg_catalog.pg_get_serial_sequence({_literal(table)}, 'id')"
                steps.append(
                    f"DO $grant$BEGIN EXECUTE {_literal(f'GRANT {privilege} ON SEQUENCE ')} "
                    f"OPERATOR(pg_catalog.||) {sequence} OPERATOR(pg_catalog.||) "
                    f"{_literal(f' TO {grantee}{option}')}; END$grant$"
                )
        return steps

    def sequence_name_kept(self, conn: Connection, table: str) -> list[Executable | str]:
        # DBD::Pg remembers, per table, the name of the sequence it reads the id it drew from
        # (currval): a long-running Perl process asks the old name after the adoption. The new
        # table's sequence is named after the table; the old one may not be (a table renamed
        # since it was made): without its name, the Perl process's lock is taken with no id,
        # and its release fails, the row left for the clock margin.
        old = conn.exec_driver_sql(
            "SELECT c.relname::text FROM pg_catalog.pg_class AS c "
            "WHERE c.oid OPERATOR(pg_catalog.=) "
            "pg_catalog.pg_get_serial_sequence(%(table)s::text, 'id'::text)::regclass",
            {"table": table},
        ).scalar()
        if old is None or old == f"{table}_id_seq":
            return []
        made = f"pg_catalog.pg_get_serial_sequence({_literal(table)}, 'id')"
        return [
            f"DO $sequence$BEGIN EXECUTE {_literal('ALTER SEQUENCE ')} OPERATOR(pg_catalog.||) "
            f"{made} OPERATOR(pg_catalog.||) {_literal(' RENAME TO ')} OPERATOR(pg_catalog.||) "
            f"pg_catalog.quote_ident({_literal(old)}); END$sequence$"
        ]

    def ids_handed_out_below(self, conn: Connection, source: str, highest_row: int) -> int:
        last = conn.exec_driver_sql(
            "SELECT pg_catalog.pg_sequence_last_value(pg_catalog.pg_get_serial_sequence("
            "%(table)s::text, 'id'::text)::regclass)",
            {"table": source},
        ).scalar()
        return max(highest_row, int(last or 0)) + 1

    def next_id_at_least(self, table: str, first: int) -> list[Executable | str]:
        # is_called false: the next id is ``first`` itself, which may be 1 (a table that never
        # held a row), below which setval of a called sequence cannot go.
        return [
            sa.text(
                "SELECT pg_catalog.setval(pg_catalog.pg_get_serial_sequence("
                "CAST(:table AS text), 'id'::text)::regclass, CAST(:first AS bigint), false)"
            ).bindparams(table=table, first=first)
        ]


# What roles other than the owner may do with a table and with the sequence of its ids: each
# grantee quoted as an identifier (or PUBLIC), each privilege checked against _PRIVILEGES.
_GRANTS = (
    "SELECT k.kind, CASE WHEN a.grantee OPERATOR(pg_catalog.=) 0::oid THEN 'PUBLIC' "
    "ELSE pg_catalog.quote_ident(r.rolname::text) END, a.privilege_type, a.is_grantable "
    "FROM (SELECT 'table' AS kind, %(table)s::text::regclass AS oid UNION ALL "
    "SELECT 'sequence', pg_catalog.pg_get_serial_sequence(%(table)s::text, 'id'::text)::regclass"
    ") AS k JOIN pg_catalog.pg_class AS c ON c.oid OPERATOR(pg_catalog.=) k.oid "
    "CROSS JOIN LATERAL pg_catalog.aclexplode(c.relacl) AS a "
    "LEFT JOIN pg_catalog.pg_roles AS r ON r.oid OPERATOR(pg_catalog.=) a.grantee "
    "WHERE a.grantee OPERATOR(pg_catalog.<>) c.relowner"
)
# The table's owner, quoted as an identifier; and the same if it is not the role adopting it.
_OWNER = (
    "SELECT pg_catalog.quote_ident(r.rolname::text) FROM pg_catalog.pg_class AS c "
    "JOIN pg_catalog.pg_roles AS r ON r.oid OPERATOR(pg_catalog.=) c.relowner "
    "WHERE c.oid OPERATOR(pg_catalog.=) %(table)s::text::regclass"
)
_OTHER_OWNER = _OWNER + " AND r.rolname OPERATOR(pg_catalog.<>) CURRENT_USER"
_PRIVILEGES = frozenset(
    {"SELECT", "INSERT", "UPDATE", "DELETE", "TRUNCATE", "REFERENCES", "TRIGGER", "USAGE"}
)


def _literal(text: str) -> str:
    """``text`` as an SQL string literal."""
    return "'" + text.replace("'", "''") + "'"


_WARNINGS = "_sqllocker_warnings"


def _record_warning(warnings: list[str], diagnostic: Any) -> None:
    """psycopg's notice handler: the message of a cancelled wait for a synchronous standby,
    recorded in ``warnings``."""
    if diagnostic.source_function == _SYNCHRONOUS_REPLICATION_WAIT:
        warnings.append(diagnostic.message_primary or "a wait for the standby was cancelled")


# The server function that waits for synchronous standbys, and warns when the wait is cancelled.
_SYNCHRONOUS_REPLICATION_WAIT = "SyncRepWaitForLSN"


def _replication(conn: Connection) -> tuple[list[UnsafeSetting], bool]:
    """What is unsafe in this server's replication, and whether it replicates (standbys stream
    from it, or it names synchronous ones: ``ServerSettings.replicated``).

    A primary whose standbys are all asynchronous acknowledges a lock row before any standby
    has it: promote one (Patroni does, when the primary dies) and the row is gone, its lock free
    for a second holder, its id drawn again. So is a primary that waits for a synchronous
    standby but not for this session's commits (``synchronous_commit=local``)."""
    standbys, synchronous = conn.exec_driver_sql(_STANDBYS).one()
    names = conn.exec_driver_sql("SHOW synchronous_standby_names").scalar()
    replicated = bool(standbys or names)
    if not standbys:
        return [], replicated
    # Without pg_monitor a role sees the standbys but not their sync_state; the setting that
    # makes one synchronous is visible to everyone.
    if not synchronous and not names:
        setting = (
            f"asynchronous replication ({standbys} standby{'s' if standbys != 1 else ''}, none "
            "synchronous: set synchronous_standby_names, or Patroni's synchronous_mode)"
        )
        return [UnsafeSetting(setting, LOSES_ROWS_ON_FAILOVER)], replicated
    commit = conn.exec_driver_sql("SHOW synchronous_commit").scalar()
    if commit == "local":
        return [UnsafeSetting("synchronous_commit=local", LOSES_ROWS_ON_FAILOVER)], replicated
    shown = conn.exec_driver_sql("SHOW client_min_messages").scalar()
    if shown in ("error", "log", "fatal", "panic"):
        # The WARNING of a commit whose wait for its standby was cancelled never comes.
        return [UnsafeSetting(f"client_min_messages={shown}", LOSES_ROWS_ON_FAILOVER)], replicated
    return [], replicated


_STANDBYS = (
    "SELECT pg_catalog.count(*), pg_catalog.count(*) FILTER (WHERE r.sync_state::text "
    "OPERATOR(pg_catalog.=) ANY (ARRAY['sync', 'quorum']::text[])) "
    "FROM pg_catalog.pg_stat_replication AS r"
)
# The schemas of the search path (as the session resolves it, "$user" included) that hold a
# table of that name, or anything else a statement's INSERT or DELETE could be sent to (a view,
# a foreign or partitioned table), in the path's order.
_SCHEMAS_WITH = (
    "SELECT n.nspname::text FROM pg_catalog.unnest(pg_catalog.current_schemas(false)) "
    "WITH ORDINALITY AS p(name, place) "
    "JOIN pg_catalog.pg_namespace AS n ON n.nspname OPERATOR(pg_catalog.=) p.name "
    "JOIN pg_catalog.pg_class AS c ON c.relnamespace OPERATOR(pg_catalog.=) n.oid "
    "AND c.relname OPERATOR(pg_catalog.=) %(table)s::name "
    "AND c.relkind OPERATOR(pg_catalog.=) "
    "ANY (ARRAY['r', 'p', 'v', 'f', 'm']::pg_catalog.\"char\"[]) "
    "ORDER BY p.place"
)
_TABLE_SCHEMA = (
    "SELECT s.name, pg_catalog.to_regprocedure(pg_catalog.quote_ident(s.name) "
    "OPERATOR(pg_catalog.||) '.' OPERATOR(pg_catalog.||) %(table)s::text "
    "OPERATOR(pg_catalog.||) '_anyone_ahead(varchar,bigint)') IS NOT NULL "
    "FROM (SELECT COALESCE((SELECT n.nspname::text FROM pg_catalog.pg_class AS c "
    "JOIN pg_catalog.pg_namespace AS n ON n.oid OPERATOR(pg_catalog.=) c.relnamespace "
    "WHERE c.oid OPERATOR(pg_catalog.=) pg_catalog.to_regclass(%(table)s::text)), "
    "pg_catalog.current_schema()::text) AS name) AS s"
)
_COLUMNS = (
    "SELECT a.attname::text, pg_catalog.format_type(a.atttypid, a.atttypmod) "
    "FROM pg_catalog.pg_attribute AS a "
    "WHERE a.attrelid OPERATOR(pg_catalog.=) pg_catalog.to_regclass(%(table)s::text) "
    "AND a.attnum OPERATOR(pg_catalog.>) 0::smallint AND NOT a.attisdropped"
)


_ISOLATION = "SELECT pg_catalog.current_setting('transaction_isolation')"

# The session of a Locker's listener holds its tickets' liveness key: one whose client is gone
# (a partition, its host lost) must end on the server too, or its tickets live on, to be handed
# rows that nobody waits for. The server's keepalives for it as the client's own
# (``connect_args``), each where the server has it (tcp_user_timeout: PostgreSQL 12 on).
LISTENER_SESSION = (
    "SELECT pg_catalog.set_config(s.name, s.value, false) FROM (VALUES "  # noqa: S608 (integer constants)
    f"('tcp_keepalives_idle', '{DEAD_PEER_SECONDS // 3}'), "
    f"('tcp_keepalives_interval', '{DEAD_PEER_SECONDS // 6}'), "
    "('tcp_keepalives_count', '3'), "
    f"('tcp_user_timeout', '{DEAD_PEER_SECONDS * 1000}')) AS s(name, value) "
    "WHERE s.name OPERATOR(pg_catalog.=) ANY (SELECT p.name FROM pg_catalog.pg_settings AS p)"
)


def _sqlstate(error: sa.exc.DBAPIError) -> str | None:
    return getattr(error.orig, "sqlstate", None)
