"""PostgreSQL: a release tells a waiting head from a gone one without reading pg_locks.

Migration 0005's release trigger grants a request only while its waiter's session still heads
the queue, and learned that by finding the session's queue lock in ``pg_locks``. ``pg_locks``
copies every lock of the server: 0.08-0.15 ms of a granting release on an idle server
(``scripts/release_parts.py``), and 1.8 ms more with 5,000 other locks held
(``scripts/contended_turns.py --ballast``), on the path of every hand-off.

Now the head also holds a lock of its own: a session advisory lock on a key drawn at random
when it heads the queue, kept with its request (``request_key``). The release asks for that
key with ``pg_try_advisory_xact_lock``: refused means the head is there (no other session holds
that key); granted means it is gone, and the release then holds the key until it commits,
which troubles nobody. One lookup in the lock manager, whatever else the server holds.

It tells exactly what 0005 told. A head that dies drops both its locks with its session; the
next head draws a new key, so a release that meets the dead head's request before the new head
has replaced it does not grant it (asking for the queue's own lock could not tell the two
heads apart). A request written before this migration has no key and is not granted: the
release's NOTIFY wakes its waiter, which tries for the row itself, as on a table without
hand-off.

Leaving the queue now releases every advisory lock of the session, which holds no others (a
queue connection serves one waiter at a time); heading the queue first releases any left from
before, as by a client of 0005's time, whose leave after a grant released only the queue's lock.
Nothing on the other backends.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-25
"""

from collections.abc import Sequence

from alembic import context, op

from sqllocker.validation import check_table_name

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Whether a request's head is still there: 0005's test, and this migration's.
HEAD_IN_PG_LOCKS = """EXISTS (
                       SELECT FROM pg_locks AS l
                        WHERE l.locktype = 'advisory' AND l.granted AND l.pid = q.pid
                          AND l.classid::bigint = (q.queue_key >> 32) & 4294967295
                          AND l.objid::bigint = q.queue_key & 4294967295
                          AND l.objsubid = 1)"""
HEAD_HOLDS_ITS_KEY = "NOT pg_try_advisory_xact_lock(q.request_key)"


def release_trigger(table: str, head_is_there: str) -> str:
    """0005's release trigger, with ``head_is_there`` as the test of a request's head."""
    return f"""
        CREATE OR REPLACE FUNCTION {table}_notify_release() RETURNS trigger
        LANGUAGE plpgsql AS $$
        DECLARE
            request record;
            granted record;
            now_ timestamptz;
        BEGIN
            IF EXISTS (SELECT FROM {table}_requests WHERE lockstring = OLD.lockstring)
               AND pg_try_advisory_xact_lock(hashtext('{table}'), hashtext(OLD.lockstring))
            THEN
                DELETE FROM {table}_requests AS q
                 WHERE q.lockstring = OLD.lockstring
                   AND q.guid <> OLD.guid
                   AND {head_is_there}
                RETURNING q.guid, q.locked_by, q.ttl INTO request;
                IF FOUND THEN
                    -- A release commits without waiting for the disk; a grant must not.
                    PERFORM set_config('synchronous_commit', 'on', true);
                    now_ := clock_timestamp();
                    INSERT INTO {table} (lockstring, guid, created, expires, locked_by)
                    VALUES (OLD.lockstring, request.guid, now_,
                            now_ + make_interval(secs => request.ttl), request.locked_by)
                    RETURNING id, created, expires INTO granted;
                    PERFORM pg_notify(
                        'sqllocker_{table}_granted',
                        concat_ws(' ', request.guid, granted.id,
                                  extract(epoch FROM granted.created),
                                  extract(epoch FROM granted.expires)));
                    RETURN NULL;
                END IF;
            END IF;
            PERFORM pg_notify('sqllocker_{table}', OLD.lockstring);
            RETURN NULL;
        END
        $$"""  # noqa: S608 -- {table} is a validated identifier; no values are interpolated


def upgrade() -> None:
    if op.get_context().dialect.name != "postgresql":
        return
    # A validated identifier (letters, digits, underscores): safe to write into DDL.
    table = check_table_name(context.config.attributes["table"])
    op.execute(f"ALTER TABLE {table}_requests ADD COLUMN request_key bigint")
    op.execute(release_trigger(table, HEAD_HOLDS_ITS_KEY))
    # The key is drawn from random() (ample: it need only differ from the keys held now); one
    # that some session holds already is drawn again.
    op.execute(
        f"""
        CREATE OR REPLACE FUNCTION {table}_queue_for_hand_off(
            queue_key bigint, patience_ms integer, ls varchar, request_guid varchar,
            holder jsonb, ttl double precision)
        RETURNS boolean LANGUAGE plpgsql AS $$
        DECLARE
            key bigint;
        BEGIN
            PERFORM pg_advisory_unlock_all();
            PERFORM set_config('lock_timeout', patience_ms::text, true);
            PERFORM pg_advisory_lock(queue_key);
            LOOP
                key := (random() * 4e18)::bigint;
                EXIT WHEN pg_try_advisory_lock(key);
            END LOOP;
            INSERT INTO {table}_requests
                (lockstring, guid, locked_by, ttl, queue_key, pid, request_key)
            VALUES (ls, request_guid, holder, ttl, queue_key, pg_backend_pid(), key)
            ON CONFLICT (lockstring) DO UPDATE
               SET guid = excluded.guid, locked_by = excluded.locked_by, ttl = excluded.ttl,
                   queue_key = excluded.queue_key, pid = excluded.pid,
                   request_key = excluded.request_key;
            RETURN true;
        EXCEPTION WHEN lock_not_available THEN
            RETURN false;
        END
        $$"""  # noqa: S608 -- {table} is a validated identifier; no values are interpolated
    )
    op.execute(queue_leave(table, "pg_advisory_unlock_all()"))


def queue_leave(table: str, unlock: str) -> str:
    """0005's leaving of the queue, releasing the queue's lock by ``unlock``."""
    return f"""
        CREATE OR REPLACE FUNCTION {table}_queue_leave(
            queue_key bigint, ls varchar, request_guid varchar, give_back boolean)
        RETURNS boolean LANGUAGE plpgsql AS $$
        DECLARE
            withdrawn boolean;
        BEGIN
            DELETE FROM {table}_requests WHERE lockstring = ls AND guid = request_guid;
            withdrawn := FOUND;
            IF NOT withdrawn AND give_back THEN
                DELETE FROM {table} WHERE lockstring = ls AND guid = request_guid;
            END IF;
            PERFORM {unlock};
            RETURN NOT withdrawn;
        END
        $$"""  # noqa: S608 -- {table} is a validated identifier; no values are interpolated


def downgrade() -> None:
    if op.get_context().dialect.name != "postgresql":
        return
    table = check_table_name(context.config.attributes["table"])
    op.execute(queue_leave(table, "pg_advisory_unlock(queue_key)"))
    op.execute(
        f"""
        CREATE OR REPLACE FUNCTION {table}_queue_for_hand_off(
            queue_key bigint, patience_ms integer, ls varchar, request_guid varchar,
            holder jsonb, ttl double precision)
        RETURNS boolean LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM set_config('lock_timeout', patience_ms::text, true);
            PERFORM pg_advisory_lock(queue_key);
            INSERT INTO {table}_requests (lockstring, guid, locked_by, ttl, queue_key, pid)
            VALUES (ls, request_guid, holder, ttl, queue_key, pg_backend_pid())
            ON CONFLICT (lockstring) DO UPDATE
               SET guid = excluded.guid, locked_by = excluded.locked_by, ttl = excluded.ttl,
                   queue_key = excluded.queue_key, pid = excluded.pid;
            RETURN true;
        EXCEPTION WHEN lock_not_available THEN
            RETURN false;
        END
        $$"""  # noqa: S608 -- {table} is a validated identifier; no values are interpolated
    )
    op.execute(release_trigger(table, HEAD_IN_PG_LOCKS))
    op.execute(f"ALTER TABLE {table}_requests DROP COLUMN request_key")
