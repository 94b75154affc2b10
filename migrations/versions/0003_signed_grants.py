"""PostgreSQL: a hand-off's notification carries its proof, signed with its waiter's key.

A grant's ``NOTIFY sqllocker_<table>_granted`` named the new row's id and the SHA-256 of its
waiter's guid, which anyone who can connect could send too: the waiter read its row back
before it believed it, one round trip per hand-off. Now a waiter passes a key of its own to
``<table>_queue_join`` (a secret: kept in the owner-only ``<table>_requests`` and deleted
with the ticket), and the release trigger signs what the waiter needs with it:

    <id> <sha256(guid)> <joined> <created> <expires> <hmac>

``joined`` (when the ticket was taken), ``created`` and ``expires`` (the new row's) are UTC
times to the microsecond, by the server's ``clock_timestamp()``; ``hmac`` is the hex
HMAC-SHA256, under the waiter's key, of the text before it. The function gets the key as
its HMAC pads (``K xor ipad || K xor opad``, 128 bytes), so that PostgreSQL's own
``sha256`` (11+) computes it, with no extension. A ticket taken without a key (by an older
sqllocker, whose 5-argument call still reaches ``queue_join``) is told ``<id> <sha256(guid)>``
as before, and read back (see ``sqllocker.notifications``).

The functions are dropped and made again (never ``OR REPLACE``: see 0002); ``queue_join``
keeps the roles granted EXECUTE on it.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29
"""

from collections.abc import Sequence

from alembic import context, op
from alembic.script import ScriptDirectory

from sqllocker.migration_functions import (
    backend_name,
    carry_execute_grants,
    create_pinned_functions,
    drop_functions,
)
from sqllocker.validation import check_table_name

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_FUNCTION = "LANGUAGE plpgsql SECURITY DEFINER"

_RELEASE = "{table}_notify_release()"
_OLD_JOIN = "{table}_queue_join(varchar, varchar, jsonb, double precision, bigint)"
_NEW_JOIN = "{table}_queue_join(varchar, varchar, jsonb, double precision, bigint, bytea)"

# As 0001's: skipped once the server's queue of notifications is this full.
_NOTIFY_UNLESS_QUEUE_FULL = """
    IF pg_catalog.pg_notification_queue_usage() OPERATOR(pg_catalog.<) COALESCE(
           NULLIF(pg_catalog.current_setting('sqllocker.notify_queue_limit', true), '')
               ::double precision,
           0.5::double precision)
    THEN
        PERFORM pg_catalog.pg_notify({channel}, {payload});
    END IF;"""


def _utc_text(value: str) -> str:
    """A timestamptz as UTC text to the microsecond, whatever the session's settings."""
    return (
        f"pg_catalog.to_char(pg_catalog.timezone('UTC'::text, {value}), "
        """'YYYY-MM-DD"T"HH24:MI:SS.US'::text)"""
    )


def _functions(table: str) -> list[str]:
    notify_release = _NOTIFY_UNLESS_QUEUE_FULL.format(
        channel=f"'sqllocker_{table}'::text", payload="OLD.lockstring::text"
    )
    notify_grant = _NOTIFY_UNLESS_QUEUE_FULL.format(
        channel=f"'sqllocker_{table}_granted'::text", payload="said"
    )
    # As 0001's, but the grant's notification says, besides the row's id and the SHA-256 of
    # the waiter's guid (which finds the waiter), when its ticket was taken and the row's
    # times, signed with the ticket's key (HMAC-SHA256 from the pads the waiter computed):
    # only this trigger, which alone can read the key, can sign it, so the waiter believes it
    # without reading its row back.
    release = f"""
        CREATE FUNCTION {table}_notify_release() RETURNS trigger {_FUNCTION} AS $$
        DECLARE
            waiting record;
            request record;
            granted record;
            now_ timestamptz;
            said text;
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
                    RETURNING q.guid, q.locked_by, q.ttl, q.liveness_key, q.grant_key, q.joined
                         INTO request;
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
                    RETURNING id, created, expires INTO granted;
                    said := granted.id::text OPERATOR(pg_catalog.||) ' '::text
                        OPERATOR(pg_catalog.||) pg_catalog.encode(pg_catalog.sha256(
                            pg_catalog.convert_to(request.guid::text, 'UTF8'::name)), 'hex'::text);
                    IF request.grant_key IS NOT NULL AND request.joined IS NOT NULL THEN
                        said := said
                            OPERATOR(pg_catalog.||) ' '::text
                            OPERATOR(pg_catalog.||) {_utc_text("request.joined")}
                            OPERATOR(pg_catalog.||) ' '::text
                            OPERATOR(pg_catalog.||) {_utc_text("granted.created")}
                            OPERATOR(pg_catalog.||) ' '::text
                            OPERATOR(pg_catalog.||) {_utc_text("granted.expires")};
                        said := said OPERATOR(pg_catalog.||) ' '::text
                            OPERATOR(pg_catalog.||) pg_catalog.encode(pg_catalog.sha256(
                                pg_catalog.substr(request.grant_key, 65, 64)
                                OPERATOR(pg_catalog.||) pg_catalog.sha256(
                                    pg_catalog.substr(request.grant_key, 1, 64)
                                    OPERATOR(pg_catalog.||)
                                    pg_catalog.convert_to(said, 'UTF8'::name))),
                                'hex'::text);
                    END IF;
                    {notify_grant}
                    RETURN NULL;
                END LOOP;
            END IF;
            {notify_release}
            RETURN NULL;
        END
        $$"""
    # As 0001's, and the ticket keeps grant_key (the HMAC pads of its waiter's key; NULL: an
    # older caller, told its grant unsigned) and when it was taken. clock_timestamp(), not
    # now(): the waiter counts from before it sent this call, and the moment the ticket is
    # taken must come after that (now() is its transaction's start).
    queue_join = f"""
        CREATE FUNCTION {table}_queue_join(
            ls varchar, request_guid varchar, holder jsonb, ttl double precision,
            liveness_key bigint, grant_key bytea DEFAULT NULL)
        RETURNS TABLE (ticket bigint, held boolean) {_FUNCTION} AS $$
        DECLARE
            drawn bigint;
        BEGIN
            IF grant_key IS NOT NULL
               AND pg_catalog.length(grant_key) OPERATOR(pg_catalog.<>) 128 THEN
                RAISE EXCEPTION 'a grant key is 128 bytes, not %',
                    pg_catalog.length(grant_key);
            END IF;
            INSERT INTO {table}_requests AS q
                   (lockstring, guid, locked_by, ttl, liveness_key, grant_key, joined)
            VALUES (ls, request_guid, holder, ttl, liveness_key, grant_key,
                    pg_catalog.clock_timestamp())
            RETURNING q.ticket INTO drawn;
            PERFORM FROM {table} AS l
             WHERE l.lockstring::text OPERATOR(pg_catalog.=) ls::text
               AND l.expires OPERATOR(pg_catalog.>) pg_catalog.clock_timestamp()
               FOR KEY SHARE;
            RETURN QUERY SELECT drawn, FOUND;
        END
        $$"""
    return [release, queue_join]


def _release_trigger(table: str) -> None:
    op.execute(
        f"CREATE TRIGGER {table}_released AFTER DELETE ON {table} "
        f"FOR EACH ROW EXECUTE FUNCTION {table}_notify_release()"
    )


def upgrade() -> None:
    if backend_name() != "postgresql":
        return
    table = check_table_name(context.config.attributes["table"])
    op.execute(
        f"ALTER TABLE {table}_requests ADD COLUMN grant_key bytea, ADD COLUMN joined timestamptz"
    )
    op.execute(f"DROP TRIGGER {table}_released ON {table}")
    drop_functions(table, (_RELEASE,))
    create_pinned_functions(table, _functions(table), (_RELEASE, _NEW_JOIN))
    carry_execute_grants(table, _OLD_JOIN, _NEW_JOIN)
    drop_functions(table, (_OLD_JOIN,))
    _release_trigger(table)


def downgrade() -> None:
    if backend_name() != "postgresql":
        return
    table = check_table_name(context.config.attributes["table"])
    # 0001's functions, as it made them.
    first = ScriptDirectory.from_config(context.config).get_revision("0001")
    assert first is not None
    release, queue_join = first.module._postgresql_functions(table)[:2]
    op.execute(f"DROP TRIGGER {table}_released ON {table}")
    drop_functions(table, (_RELEASE,))
    create_pinned_functions(table, [release, queue_join], (_RELEASE, _OLD_JOIN))
    carry_execute_grants(table, _NEW_JOIN, _OLD_JOIN)
    drop_functions(table, (_NEW_JOIN,))
    _release_trigger(table)
    op.execute(f"ALTER TABLE {table}_requests DROP COLUMN grant_key, DROP COLUMN joined")
