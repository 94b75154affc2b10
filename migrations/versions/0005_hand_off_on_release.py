"""PostgreSQL: a release hands the row to the head of the lockstring's queue, in its own
transaction.

Before this, a contended hand-off took a release (one round trip), a NOTIFY, and then the next
holder's INSERT (another round trip, and the commit's flush to disk) before the next holder had
the lock. Now the head of a lockstring's queue (``sqllocker.waiting_room``) leaves a *request*
when it starts heading the queue: its guid, holder details and expiry period. The DELETE
trigger of migration 0003, on finding a request, inserts the requester's row in the deleting
transaction and tells the requester so by ``NOTIFY sqllocker_<table>_granted``, whose payload
carries the new row's id, created and expires: the next holder has the lock when the release
commits, with no round trip of its own.

Who holds a lock is still decided by the row alone, under the same unique constraint; a grant is
only an INSERT made on the requester's behalf. What a grant can cost is liveness: a row given
to a requester that is no longer there is held by nobody until it expires. So a request is
granted only while its requester's session still heads the queue (holds the queue's advisory
lock, as pg_locks shows); never to the request of the very row being deleted (a head that got
the row by its own INSERT has not withdrawn its request yet); and a requester that stops waiting
withdraws its request, or gives back a row granted meanwhile, in one statement
(``<table>_queue_leave``).

Requests live in an UNLOGGED table: writing one needs no flush to disk, and a crash that empties
it also ended every session that could have been waiting on one. Nothing on the other backends.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-24
"""

from collections.abc import Sequence

from alembic import context, op

from sqllocker.validation import check_table_name

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    if op.get_context().dialect.name != "postgresql":
        return
    # A validated identifier (letters, digits, underscores): safe to write into DDL.
    table = check_table_name(context.config.attributes["table"])
    op.execute(
        f"""
        CREATE UNLOGGED TABLE {table}_requests (
            lockstring varchar(128) PRIMARY KEY,
            guid varchar(36) NOT NULL,
            locked_by jsonb NOT NULL,
            ttl double precision NOT NULL,
            queue_key bigint NOT NULL,
            pid integer NOT NULL
        )"""
    )
    # The release trigger. The grant takes the lockstring's id-order lock (see
    # Statements._new_row_in_id_order) only if it is free: an acquirer holding it is waiting for
    # this very DELETE to commit, and waiting for it in turn would be a deadlock. Such a release
    # notifies as before, and the head of the queue tries for the row itself.
    op.execute(
        f"""
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
                   AND EXISTS (
                       SELECT FROM pg_locks AS l
                        WHERE l.locktype = 'advisory' AND l.granted AND l.pid = q.pid
                          AND l.classid::bigint = (q.queue_key >> 32) & 4294967295
                          AND l.objid::bigint = q.queue_key & 4294967295
                          AND l.objsubid = 1)
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
    )
    # 0004's queue wait, which also leaves the request once the wait is won.
    op.execute(
        f"""
        CREATE FUNCTION {table}_queue_for_hand_off(
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
    # Leave the queue, withdrawing the request; returns whether it had been granted already.
    # With give_back, a granted row is deleted again (its requester stopped waiting).
    op.execute(
        f"""
        CREATE FUNCTION {table}_queue_leave(
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
            PERFORM pg_advisory_unlock(queue_key);
            RETURN NOT withdrawn;
        END
        $$"""  # noqa: S608 -- {table} is a validated identifier; no values are interpolated
    )


def downgrade() -> None:
    if op.get_context().dialect.name != "postgresql":
        return
    table = check_table_name(context.config.attributes["table"])
    op.execute(f"DROP FUNCTION {table}_queue_leave(bigint, varchar, varchar, boolean)")
    op.execute(
        f"DROP FUNCTION {table}_queue_for_hand_off"
        "(bigint, integer, varchar, varchar, jsonb, double precision)"
    )
    op.execute(
        f"""
        CREATE OR REPLACE FUNCTION {table}_notify_release() RETURNS trigger
        LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM pg_notify('sqllocker_{table}', OLD.lockstring);
            RETURN NULL;
        END
        $$"""
    )
    op.execute(f"DROP TABLE {table}_requests")
