"""The lock table, its view of held locks, and (PostgreSQL) the queue and hand-off machinery.

- ``<table>``: one row per held lock (``sqllocker.schema.lock_table`` is the same definition).
- ``<table>_held``: the unexpired rows, with the holder's host, pid and program as columns, and
  without any secret: what read-only roles should be granted.
- PostgreSQL: ``<table>_requests`` (one ticket per waiter, in the order they came, readable
  only by the owner: a ticket holds its waiter's secret guid), the functions waiters take,
  check and give up tickets through, the purge's sweep of tickets whose Locker is gone, and the
  DELETE trigger that hands a released row to the first live ticket, or tells waiters it is
  free (see ``sqllocker/tickets.py``).
- MySQL/MariaDB: ``<table>_id_order``, one row per stripe of lockstrings, which an acquire locks
  where ``innodb_autoinc_lock_mode=2`` would otherwise let ids come out of holding order (see
  ``Statements.acquire``); ``<table>_requests``, one ticket per waiter, in the order they came
  (no secret in it: there the first waiter of each Locker takes the row itself).

Every PostgreSQL function runs with its ``search_path`` pinned to ``pg_catalog``, the table's
own schema and ``pg_temp`` (last), and calls catalog functions and operators with their exact
argument types, so that nothing another role creates in a schema on a caller's path can run in
its place (CVE-2018-1058; see ``sqllocker.migration_functions``). The functions are
``SECURITY DEFINER``: they reach the requests table for the roles that take locks, which need
no privilege on it, only EXECUTE, which PUBLIC does not get.

Revision ID: 0001
Revises:
Create Date: 2026-11-25
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import context, op
from sqlalchemy.dialects import postgresql

from sqllocker.migration_functions import backend_name, create_pinned_functions, drop_functions
from sqllocker.schema import ForeignGuidDefault, Lockstring, UTCDateTime, mysql_options
from sqllocker.validation import check_table_name

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# sqllocker.schema.ID_ORDER_STRIPES when this was written: a snapshot, as every migration is
# (tests/test_migrations.py checks that the two agree).
STRIPES = 1024

# The table name is a validated identifier (lower-case letters, digits, underscores, no reserved
# word), so it can be written into DDL; nothing else here comes from outside.
_HELD_VIEWS = {
    "postgresql": """
        SELECT id AS lock_id, lockstring, created, expires,
               locked_by ->> 'host' AS host,
               (locked_by ->> 'pid')::bigint AS pid,
               locked_by ->> 'program' AS program,
               locked_by - 'guid' AS locked_by
        FROM {table}
        WHERE expires > clock_timestamp()""",
    "mysql": """
        SELECT id AS lock_id, lockstring, created, expires,
               JSON_UNQUOTE(JSON_EXTRACT(locked_by, '$.host')) AS host,
               CAST(JSON_EXTRACT(locked_by, '$.pid') AS SIGNED) AS pid,
               JSON_UNQUOTE(JSON_EXTRACT(locked_by, '$.program')) AS program,
               JSON_REMOVE(locked_by, '$.guid') AS locked_by
        FROM {table}
        WHERE expires > UTC_TIMESTAMP(6)""",
    "sqlite": """
        SELECT id AS lock_id, lockstring, created, expires,
               json_extract(locked_by, '$.host') AS host,
               json_extract(locked_by, '$.pid') AS pid,
               json_extract(locked_by, '$.program') AS program,
               json_remove(locked_by, '$.guid') AS locked_by
        FROM {table}
        WHERE expires > strftime('%Y-%m-%d %H:%M:%f', 'now')""",
}

# What the functions share: the owner's rights (and a pinned path: see _pinned_path).
_FUNCTION = "LANGUAGE plpgsql SECURITY DEFINER"

# Notifications are skipped once the server's queue of them is this full (a listener somewhere
# that stopped reading): a release must never fail because a NOTIFY cannot be queued, and a
# skipped one only makes waiters find out by their own timers. Settable per session or role as
# ``sqllocker.notify_queue_limit``.
_NOTIFY_UNLESS_QUEUE_FULL = """
    IF pg_catalog.pg_notification_queue_usage() OPERATOR(pg_catalog.<) COALESCE(
           NULLIF(pg_catalog.current_setting('sqllocker.notify_queue_limit', true), '')
               ::double precision,
           0.5::double precision)
    THEN
        PERFORM pg_catalog.pg_notify({channel}, {payload});
    END IF;"""


def _postgresql_functions(table: str) -> list[str]:
    notify_release = _NOTIFY_UNLESS_QUEUE_FULL.format(
        channel=f"'sqllocker_{table}'::text", payload="OLD.lockstring::text"
    )
    notify_grant = _NOTIFY_UNLESS_QUEUE_FULL.format(
        channel=f"'sqllocker_{table}_granted'::text",
        payload="granted.id::text OPERATOR(pg_catalog.||) ' '::text OPERATOR(pg_catalog.||) "
        "pg_catalog.encode(pg_catalog.sha256(pg_catalog.convert_to(request.guid::text, "
        "'UTF8'::name)), 'hex'::text)",
    )
    # The release trigger. Nobody waiting for the lockstring: nothing to do (no notification; a
    # waiter that has not taken its ticket yet tries the row once more after taking it). Else
    # the row is inserted, in this transaction, for the waiter with the lowest ticket whose
    # Locker is still there (its listener holds the ticket's liveness key, so this release
    # cannot take that key), and it is told the new row's id and the SHA-256 of its guid (which
    # finds it among the waiters of every process listening, and gives the guid away to
    # nobody); it reads its row back from the table before it believes it. Tickets of Lockers
    # that are gone are deleted on the way. The grant takes the lockstring's id-order lock (see
    # Statements._new_row_in_id_order) only if it is free: an acquirer holding it is waiting for
    # this very DELETE to commit, and waiting for it in turn would be a deadlock; such a release
    # only notifies, and the waiters first in line in each process try for the row themselves.
    release = f"""
        CREATE FUNCTION {table}_notify_release() RETURNS trigger {_FUNCTION} AS $$
        DECLARE
            waiting record;
            request record;
            granted record;
            now_ timestamptz;
        BEGIN
            IF NOT EXISTS (
                SELECT FROM {table}_requests
                 WHERE lockstring::text OPERATOR(pg_catalog.=) OLD.lockstring::text)
            THEN
                RETURN NULL;
            END IF;
            IF pg_catalog.pg_try_advisory_xact_lock(
                   pg_catalog.hashtext(
                       TG_TABLE_SCHEMA::text OPERATOR(pg_catalog.||) '.'::text
                       OPERATOR(pg_catalog.||) TG_TABLE_NAME::text),
                   pg_catalog.hashtext(OLD.lockstring::text))
            THEN
                FOR waiting IN
                    SELECT q.ticket FROM {table}_requests AS q
                     WHERE q.lockstring::text OPERATOR(pg_catalog.=) OLD.lockstring::text
                     ORDER BY q.ticket
                LOOP
                    -- Not found: withdrawn meanwhile, or the releasing holder's own.
                    DELETE FROM {table}_requests AS q
                     WHERE q.ticket OPERATOR(pg_catalog.=) waiting.ticket
                       AND q.guid::text OPERATOR(pg_catalog.<>) OLD.guid::text
                    RETURNING q.guid, q.locked_by, q.ttl, q.liveness_key INTO request;
                    CONTINUE WHEN NOT FOUND;
                    -- Its Locker is gone (nobody holds the key): deleted, and passed over.
                    CONTINUE WHEN
                        pg_catalog.pg_try_advisory_xact_lock_shared(request.liveness_key);
                    -- A release commits without waiting for the disk; a grant must not.
                    PERFORM pg_catalog.set_config('synchronous_commit'::text, 'on'::text, true);
                    now_ := pg_catalog.clock_timestamp();
                    INSERT INTO {table} (lockstring, guid, created, expires, locked_by)
                    VALUES (OLD.lockstring, request.guid, now_,
                            now_ OPERATOR(pg_catalog.+)
                                pg_catalog.make_interval(secs => request.ttl),
                            request.locked_by)
                    RETURNING id INTO granted;
                    {notify_grant}
                    RETURN NULL;
                END LOOP;
            END IF;
            {notify_release}
            RETURN NULL;
        END
        $$"""
    # Take a ticket for ls: the next in line, alive while liveness_key is held (by the Locker's
    # listening session), granted the row by a release while it stands. Also says whether the
    # row is held, as it stands once a release of it under way has committed (FOR KEY SHARE waits
    # for its DELETE; a DELETE that comes after waits for this ticket, and its trigger sees it):
    # a release this ticket came too late for has left the row free, and the waiter tries it.
    queue_join = f"""
        CREATE FUNCTION {table}_queue_join(
            ls varchar, request_guid varchar, holder jsonb, ttl double precision,
            liveness_key bigint)
        RETURNS TABLE (ticket bigint, held boolean) {_FUNCTION} AS $$
        DECLARE
            drawn bigint;
        BEGIN
            INSERT INTO {table}_requests AS q (lockstring, guid, locked_by, ttl, liveness_key)
            VALUES (ls, request_guid, holder, ttl, liveness_key)
            RETURNING q.ticket INTO drawn;
            PERFORM FROM {table} AS l
             WHERE l.lockstring::text OPERATOR(pg_catalog.=) ls::text
               AND l.expires OPERATOR(pg_catalog.>) pg_catalog.clock_timestamp()
               FOR KEY SHARE;
            RETURN QUERY SELECT drawn, FOUND;
        END
        $$"""
    # Whether a live ticket lower than before_ticket waits for ls: the gate of an acquire that
    # must not take the row ahead of them. A ticket is dead once nobody holds its liveness key.
    anyone_ahead = f"""
        CREATE FUNCTION {table}_anyone_ahead(ls varchar, before_ticket bigint)
        RETURNS boolean {_FUNCTION} AS $$
        BEGIN
            RETURN EXISTS (
                SELECT FROM {table}_requests AS q
                 WHERE q.lockstring::text OPERATOR(pg_catalog.=) ls::text
                   AND q.ticket OPERATOR(pg_catalog.<) before_ticket
                   AND NOT pg_catalog.pg_try_advisory_xact_lock_shared(q.liveness_key));
        END
        $$"""
    # Give up a ticket; with give_back, a row already granted to it is deleted again (its waiter
    # stopped waiting). Returns whether such a row was given back. Without a ticket, every
    # ticket of request_guid for ls: one whose answer was lost with its connection may stand,
    # or may have been granted the row already.
    queue_leave = f"""
        CREATE FUNCTION {table}_queue_leave(
            request_ticket bigint, ls varchar, request_guid varchar, give_back boolean)
        RETURNS boolean {_FUNCTION} AS $$
        BEGIN
            IF request_ticket IS NULL THEN
                DELETE FROM {table}_requests
                 WHERE lockstring::text OPERATOR(pg_catalog.=) ls::text
                   AND guid::text OPERATOR(pg_catalog.=) request_guid::text;
                IF NOT give_back THEN
                    RETURN false;
                END IF;
            ELSE
                DELETE FROM {table}_requests
                 WHERE ticket OPERATOR(pg_catalog.=) request_ticket
                   AND guid::text OPERATOR(pg_catalog.=) request_guid::text;
                IF FOUND OR NOT give_back THEN
                    RETURN false;
                END IF;
            END IF;
            DELETE FROM {table}
             WHERE lockstring::text OPERATOR(pg_catalog.=) ls::text
               AND guid::text OPERATOR(pg_catalog.=) request_guid::text;
            RETURN FOUND;
        END
        $$"""
    # The purge's sweep: the tickets of Lockers that are gone are never granted, and a
    # lockstring never released again would keep them for ever.
    sweep = f"""
        CREATE FUNCTION {table}_sweep_requests() RETURNS bigint {_FUNCTION} AS $$
        DECLARE
            swept bigint;
        BEGIN
            DELETE FROM {table}_requests AS q
             WHERE pg_catalog.pg_try_advisory_xact_lock_shared(q.liveness_key);
            GET DIAGNOSTICS swept = ROW_COUNT;
            RETURN swept;
        END
        $$"""
    return [release, queue_join, anyone_ahead, queue_leave, sweep]


_FUNCTION_SIGNATURES = (
    "{table}_notify_release()",
    "{table}_queue_join(varchar, varchar, jsonb, double precision, bigint)",
    "{table}_anyone_ahead(varchar, bigint)",
    "{table}_queue_leave(bigint, varchar, varchar, boolean)",
    "{table}_sweep_requests()",
)


def upgrade() -> None:
    table = check_table_name(context.config.attributes["table"])
    dialect = backend_name()
    # Adopting a DBIx::Locker table (sqllocker/adoption.py): its statements that move the old
    # table out of the way, and those that bring its rows in once everything here exists.
    adoption = context.config.attributes.get("adoption")
    for step in adoption.before_create if adoption else ():
        _run(step)
    # MySQL adopts by building the table under a name of its own and swapping it in.
    created_as = adoption.create_as if adoption and adoption.create_as else table
    op.create_table(
        created_as,
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            primary_key=True,
            autoincrement=True,
            comment="fencing token: strictly increasing, never reused",
        ),
        sa.Column("lockstring", Lockstring(), nullable=False),
        # The default is for DBIx::Locker, which leaves the column out (see sqllocker.schema).
        sa.Column("guid", sa.String(36), nullable=False, server_default=ForeignGuidDefault()),
        sa.Column("created", UTCDateTime(), nullable=False),
        sa.Column("expires", UTCDateTime(), nullable=False),
        sa.Column(
            "locked_by", sa.JSON().with_variant(postgresql.JSONB(), "postgresql"), nullable=False
        ),
        sa.UniqueConstraint("lockstring", name=f"uq_{table}_lockstring"),
        sqlite_autoincrement=True,
        **mysql_options(engine="InnoDB", charset="utf8mb4"),
    )
    op.create_index(f"ix_{table}_expires", created_as, ["expires"])
    op.execute(f"CREATE VIEW {table}_held AS {_HELD_VIEWS[dialect].format(table=table)}")
    if dialect == "postgresql":
        _upgrade_postgresql(table)
    elif dialect == "mysql":
        op.create_table(
            f"{table}_id_order",
            sa.Column("stripe", sa.SmallInteger(), primary_key=True, autoincrement=False),
            **mysql_options(engine="InnoDB"),
        )
        # One statement, also in the SQL that `sqllocker migrate --sql` prints for a DBA.
        stripes = ", ".join(f"({stripe})" for stripe in range(STRIPES))
        op.execute(f"INSERT INTO {table}_id_order (stripe) VALUES {stripes}")
        # One ticket per waiter; a ticket is alive while the GET_LOCK name of its liveness key
        # is held (sqllocker.backends.mysql.liveness_name). In memory, as PostgreSQL's is
        # unlogged: taking and giving up a ticket need no flush to disk, and a restart that
        # empties the table also ended every session that kept a ticket alive. Not replicated
        # by Galera either, as GET_LOCK names are not: each node keeps its own line.
        op.create_table(
            f"{table}_requests",
            sa.Column("ticket", sa.BigInteger(), primary_key=True, autoincrement=True),
            sa.Column("lockstring", Lockstring(), nullable=False),
            sa.Column("guid_sha256", sa.String(64), nullable=False),
            sa.Column("liveness_key", sa.BigInteger(), nullable=False),
            **mysql_options(engine="MEMORY", charset="utf8mb4"),
        )
        op.create_index(
            f"ix_{table}_requests_line",
            f"{table}_requests",
            ["lockstring", "ticket"],
            **mysql_options(using="btree"),
        )
    for step in adoption.after_create if adoption else ():
        _run(step)


def _run(step: object) -> None:
    """An adoption's step: SQL, or (on a live connection only) a function of the connection."""
    if callable(step):
        step(op.get_bind())
    else:
        op.execute(step)


def _upgrade_postgresql(table: str) -> None:
    # Tickets live in an UNLOGGED table: taking one needs no flush to disk, and a crash that
    # empties it also ended every listening session that kept one alive.
    op.execute(
        f"""
        CREATE UNLOGGED TABLE {table}_requests (
            ticket bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            lockstring varchar(128) NOT NULL,
            guid varchar(36) NOT NULL,
            locked_by jsonb NOT NULL,
            ttl double precision NOT NULL,
            liveness_key bigint NOT NULL
        )"""
    )
    op.execute(f"CREATE INDEX ix_{table}_requests_line ON {table}_requests (lockstring, ticket)")
    op.execute(f"REVOKE ALL ON {table}_requests FROM PUBLIC")
    create_pinned_functions(table, _postgresql_functions(table), _FUNCTION_SIGNATURES)
    op.execute(
        f"CREATE TRIGGER {table}_released AFTER DELETE ON {table} "
        f"FOR EACH ROW EXECUTE FUNCTION {table}_notify_release()"
    )


def downgrade() -> None:
    table = check_table_name(context.config.attributes["table"])
    dialect = backend_name()
    if dialect == "postgresql":
        op.execute(f"DROP TRIGGER {table}_released ON {table}")
        drop_functions(table, _FUNCTION_SIGNATURES)
        op.execute(f"DROP TABLE {table}_requests")
    elif dialect == "mysql":
        op.drop_table(f"{table}_requests")
        op.drop_table(f"{table}_id_order")
    op.execute(f"DROP VIEW {table}_held")
    op.drop_index(f"ix_{table}_expires", table_name=table)
    op.drop_table(table)
