"""Every SQL statement sqllocker runs, built once per (table, backend) and nowhere else.

Statements take bound parameters only; the table name is the one identifier that reaches SQL, and
it is validated (``validation.check_table_name``) before the Table is built. Parameter names:

``ls`` lockstring, ``lock_guid`` the acquisition's secret, ``holder`` the locked_by JSON,
``lock_id`` the lock id; ``ttl``, ``minus_grace`` and ``minus_foreign_grace`` are seconds to
add to the server's clock (the last two negative), converted by ``Backend.seconds_value``.
"""

from __future__ import annotations

from functools import cached_property, lru_cache
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.sql import Delete, Select, Update
from sqlalchemy.sql.dml import ReturningInsert
from sqlalchemy.sql.selectable import TextualSelect

from .backends import Backend
from .schema import FOREIGN_GUID_PREFIX, ID_ORDER_STRIPES

# How long an acquire waits (PostgreSQL) for the lockstring's id-order key, which others hold only
# for their INSERT: a wait this long means a session outside the protocol holds it.
ID_ORDER_WAIT_MS = 1000


class Statements:
    """The statements for one lock table on one backend."""

    def __init__(
        self,
        table: sa.Table,
        backend: Backend,
        id_order: sa.Table | None = None,
        schema: str | None = None,
        *,
        has_functions: bool = False,
    ) -> None:
        """``id_order``: MySQL/MariaDB, the stripes table that acquires lock, where the server
        needs it (``server_settings.ServerSettings.lock_stripes``); see :attr:`acquire`.
        ``schema``: PostgreSQL, the schema the table was found in, which the advisory keys and
        the queue's function names include (same-named tables in two schemas stay apart);
        ``has_functions``, whether the table has the functions its migration makes there."""
        self.table = table
        self.backend = backend
        self.id_order = id_order
        self.schema = schema
        self.has_functions = has_functions
        self.table_key = table.name if schema is None else f"{schema}.{table.name}"
        c = table.c
        self._now = backend.now()
        # A row may be taken over or purged only once it has been expired for `grace` seconds,
        # so that a holder whose local deadline just passed has stopped before anyone else starts;
        # a row DBIx::Locker wrote, once its local-time expiry is past in every time zone
        # (``schema.FOREIGN_CLOCK_MARGIN``). The first test alone still bounds the index scan.
        self._foreign = backend.starts_with(c.guid, FOREIGN_GUID_PREFIX)
        self._expired_beyond_grace = sa.and_(
            c.expires <= backend.shifted_now("minus_grace"),
            sa.or_(
                sa.not_(self._foreign),
                c.expires <= backend.shifted_now("minus_foreign_grace"),
            ),
        )
        # One acquisition's row, named by id *and* guid: a stale holder can never match another's.
        self._ours = sa.and_(
            c.id == sa.bindparam("lock_id"),
            backend.equal(c.guid, sa.bindparam("lock_guid", type_=c.guid.type)),
        )
        self._ours_and_live = sa.and_(self._ours, c.expires > self._now)
        self._this_lockstring = backend.equal(
            c.lockstring, sa.bindparam("ls", type_=c.lockstring.type)
        )

    @cached_property
    def acquire(self) -> sa.Insert | ReturningInsert[Any]:
        """Insert our row, or nothing if the lockstring has one (live or expired).

        PostgreSQL and SQLite: ``ON CONFLICT DO NOTHING`` returns no row when held, with no ERROR
        in the server log, and (PostgreSQL) without locking the holder's row: an upsert that
        decides not to update still locks the row it met and must flush its commit to disk, and
        the holder's release then waits for that refused acquirer. MySQL: an INSERT (of a SELECT,
        see below) whose duplicate-key error means held (never ``INSERT IGNORE``: it truncates
        over-long keys).
        An expired row is taken over by ``take_over`` (PostgreSQL) or ``take_over_expired`` and
        this statement again (the others), once the holder's row shows it expired.
        """
        c = self.table.c
        if self.backend.name == "postgresql":
            pg = postgresql.insert(self.table).from_select(
                list(self._new_row), self._new_row_in_id_order()
            )
            return pg.on_conflict_do_nothing(index_elements=[c.lockstring]).returning(
                *self._returned
            )
        if self.backend.name == "sqlite":
            lite = sqlite.insert(self.table).values(self._new_row)
            lite = lite.on_conflict_do_nothing(index_elements=[c.lockstring])
            return lite.returning(*self._returned) if self.backend.insert_returning else lite
        # MySQL: INSERT ... SELECT, for the order of fencing tokens. InnoDB draws the
        # auto-increment value before the unique check, so an acquirer delayed between its draw
        # and its check could insert after a later acquirer had held and released the lock, and
        # hold it with the smaller id (seen once in the 8-process test; tests/test_fencing.py
        # pauses an acquirer there with gdb). With innodb_autoinc_lock_mode 0 or 1 (MariaDB's
        # default) InnoDB keeps the table's AUTO-INC lock to the end of an INSERT ... SELECT
        # (never of an INSERT ... VALUES), so no one else draws an id meanwhile. With 2 (MySQL
        # 8's default) it takes no such lock, and the SELECT first locks the row of the
        # lockstring's stripe (``id_order``) until the statement commits, so
        # acquirers of one lockstring draw their ids one at a time, in the order they can hold
        # the row. Mode 2 without that table is reported by the settings check.
        new_row = sa.select(*self._new_row.values())
        if self.id_order is not None:
            # CRC32 of the lockstring's UTF-8 bytes, whatever the connection's character set.
            utf8 = sa.cast(
                sa.bindparam("ls", type_=c.lockstring.type), mysql.CHAR(charset="utf8mb4")
            )
            stripe = sa.func.crc32(utf8) % ID_ORDER_STRIPES
            new_row = new_row.where(self.id_order.c.stripe == stripe).with_for_update()
        mine = sa.insert(self.table).from_select(list(self._new_row), new_row)
        return mine.returning(*self._returned) if self.backend.insert_returning else mine

    @cached_property
    def acquire_unless_queued(self) -> ReturningInsert[Any]:
        """PostgreSQL: ``acquire``, unless waiters are queued for the lockstring (see
        ``sqllocker.waiting_room``): then insert nothing, as if refused.

        A waiting acquirer's first attempt uses this, so that it cannot take the row in the
        moment between a release and the head of the queue's INSERT, which let a few
        processes take turns while queued waiters waited on. The queue's advisory lock, held
        by its head and asked for by those behind, is tried in shared mode for this statement's
        transaction only (``queue_key``): that fails while anyone holds or waits for it.
        """
        c = self.table.c
        nobody_queued = sa.func.pg_catalog.pg_try_advisory_xact_lock_shared(
            sa.cast(sa.bindparam("queue_key", type_=sa.BigInteger), sa.BigInteger)
        )
        pg = postgresql.insert(self.table).from_select(
            list(self._new_row), self._new_row_in_id_order(only_if=nobody_queued)
        )
        return pg.on_conflict_do_nothing(index_elements=[c.lockstring]).returning(*self._returned)

    @cached_property
    def take_over(self) -> ReturningInsert[Any]:
        """PostgreSQL: replace an expired holder's row with ours in one atomic statement.

        ``ON CONFLICT DO UPDATE ... WHERE expired`` replaces the row in place, including a fresh
        id from the sequence (``excluded.id``), so the fencing token still grows; of several
        acquirers racing for one expired row, the row lock lets exactly one match the WHERE.
        A row that is not (or no longer) expired makes it return no row.
        """
        c = self.table.c
        pg = postgresql.insert(self.table).from_select(
            list(self._new_row), self._new_row_in_id_order()
        )
        return pg.on_conflict_do_update(
            index_elements=[c.lockstring],
            set_={
                name: pg.excluded[name]
                for name in ("id", "guid", "created", "expires", "locked_by")
            },
            where=self._expired_beyond_grace,
        ).returning(*self._returned)

    @cached_property
    def _new_row(self) -> dict[str, Any]:
        c = self.table.c
        return {
            "lockstring": sa.bindparam("ls", type_=c.lockstring.type),
            "guid": sa.bindparam("lock_guid", type_=c.guid.type),
            "created": self._now,
            "expires": self.backend.shifted_now("ttl"),
            "locked_by": sa.bindparam("holder", type_=c.locked_by.type),
        }

    def _new_row_in_id_order(self, only_if: sa.ColumnElement[bool] | None = None) -> Select[Any]:
        """PostgreSQL: our new row, as a SELECT to insert from, which first waits for any other
        acquirer of the lockstring to finish its INSERT's transaction; with ``only_if``, no row
        (and no wait) unless that holds, checked before the wait.

        The sequence gives a row its id when the INSERT forms the row, before the unique index
        is checked: an acquirer that drew id n and was then delayed (descheduled on a busy
        server) could insert after a later acquirer had held and released the lock with id
        n + 1, and hold it with the smaller fencing token (seen once in the 8-process test;
        tests/test_fencing.py makes it happen every time). The transaction-scoped advisory lock
        in FROM runs before the row is formed, so ids are drawn one acquirer at a time per
        lockstring, in the order the rows can be held. Its two-int4 key is a key space apart
        from the queue's bigint keys (``waiting_room``); two lockstrings whose hashes meet only
        wait for each other's INSERT, a matter of microseconds.
        """
        catalog = sa.func.pg_catalog
        in_turn = sa.select(
            catalog.pg_advisory_xact_lock(
                catalog.hashtext(sa.cast(sa.literal(self.table_key), sa.Text)),
                catalog.hashtext(sa.cast(self._lockstring_param, sa.Text)),
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
        return sa.select(*self._new_row.values()).select_from(in_turn.subquery("ids_in_order"))

    @property
    def _lockstring_param(self) -> sa.BindParameter[str]:
        return sa.bindparam("ls", type_=self.table.c.lockstring.type)

    @cached_property
    def id_order_blocker(self) -> TextualSelect | None:
        """PostgreSQL: the pid of another session holding the lockstring's id-order key, which
        an acquirer holds only for its INSERT; an acquire that waited out its bound for that
        key names it (a session of a role outside sqllocker's protocol, or a stuck one)."""
        if self.backend.name != "postgresql":
            return None
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
            .bindparams(sa.bindparam("table_key", self.table_key, type_=sa.Text))
            .columns(sa.column("pid", sa.Integer))
        )

    @property
    def _returned(self) -> tuple[sa.ColumnElement[Any], ...]:
        """What a successful acquire returns: the id, and the times as the driver reads them
        (text on SQLite), unconverted. A Lock converts them when they are first read
        (``LockHandle.created``), which most callers never do; converting both on every acquire
        was a tenth of the uncontended cycle's Python on SQLite (measured in scripts/bench.py's
        cycle, on the 2-CPU test machine)."""
        c = self.table.c
        return (
            c.id,
            sa.type_coerce(c.created, sa.types.NullType()).label("created"),
            sa.type_coerce(c.expires, sa.types.NullType()).label("expires"),
        )

    @cached_property
    def take_over_expired(self) -> Delete:
        """Delete the lockstring's row if it has expired (by the server's clock) beyond grace."""
        return sa.delete(self.table).where(self._this_lockstring, self._expired_beyond_grace)

    @cached_property
    def _rows(self) -> Select[Any]:
        """Rows (all but the secret guid), with whether each has expired and the server's
        time, both by its clock."""
        c = self.table.c
        return sa.select(
            c.id,
            c.lockstring,
            c.created,
            c.expires,
            c.locked_by,
            sa.case((c.expires <= self._now, True), else_=False).label("expired"),
            self._now.label("server_now"),
            sa.case((self._foreign, True), else_=False).label("dbix_locker"),
        )

    @cached_property
    def holder(self) -> Select[Any]:
        """The row of one lockstring: who holds it, for a refused caller or an operator."""
        return self._rows.where(self._this_lockstring)

    @cached_property
    def holder_for_acquirer(self) -> Select[Any]:
        """The holder's row for a refused acquirer, with whether it may be taken over now
        (expired beyond grace, by the server's clock) and whether it is ours (under our guid:
        compared here, so that no guid is ever read back)."""
        c = self.table.c
        takeable = sa.case((self._expired_beyond_grace, True), else_=False).label("takeable")
        mine = self.backend.equal(c.guid, sa.bindparam("lock_guid", type_=c.guid.type))
        ours = sa.case((mine, True), else_=False).label("ours")
        return self.holder.add_columns(takeable, ours)

    def list_locks(self, pattern: bool = False) -> Select[Any]:
        """Every row, or those whose lockstring matches the bound shell-style ``pattern``
        (converted by ``Backend.glob_value``)."""
        rows = self._rows.order_by(self.table.c.lockstring)
        return rows.where(self.backend.matches_glob(self.table.c.lockstring)) if pattern else rows

    @cached_property
    def count_live(self) -> Select[Any]:
        """How many rows whose lockstring matches the bound ``pattern`` cannot be taken over
        now (a semaphore's permits: see ``sqllocker.semaphore``)."""
        lockstring = self.table.c.lockstring
        return sa.select(sa.func.count().label("live")).where(
            self.backend.matches_glob(lockstring), sa.not_(self._expired_beyond_grace)
        )

    @cached_property
    def purgeable(self) -> Select[Any]:
        """The rows a purge would delete now: expired beyond grace."""
        return self._rows.where(self._expired_beyond_grace).order_by(self.table.c.expires)

    @cached_property
    def break_lock(self) -> Delete:
        """An operator's forced release of one acquisition, named by lockstring and id."""
        return sa.delete(self.table).where(
            self._this_lockstring, self.table.c.id == sa.bindparam("lock_id")
        )

    @cached_property
    def own_row(self) -> Select[Any]:
        """Our unexpired row, with the server's time: a hand-off notification claims a row for
        us, and only the table can say whether it is so (anyone may send a NOTIFY)."""
        c = self.table.c
        return sa.select(c.id, c.created, c.expires, self._now.label("server_now")).where(
            self._ours_and_live
        )

    @cached_property
    def times_of(self) -> Select[Any]:
        """created/expires of our row, where INSERT or UPDATE cannot return them (MySQL)."""
        c = self.table.c
        return sa.select(c.created, c.expires).where(self._ours)

    @cached_property
    def release(self) -> Delete:
        """Delete our row, matched by id *and* guid: a stale holder can never delete another's.

        PostgreSQL: the release's transaction commits without waiting for its WAL to reach
        disk (``synchronous_commit`` off for that transaction only), so that a hand-off under
        contention waits for the disk once, at the next holder's acquire, not twice (bench.py's
        contended rows, three interleaved rounds: 4-38% more acquisitions/s, relative to
        advisory locks). A release lost in a server crash is safe: the row comes back, and the
        lock stays held until it expires. It cannot come back after someone else's acquire
        did, because that acquire's commit waits for the WAL to be flushed up to its own
        record, which the release's precedes. Acquire, extend, takeover, break and purge still
        wait: a lost acquire or extend would let a second holder in.
        """
        release = sa.delete(self.table).where(self._ours)
        if self.backend.name == "postgresql":
            # Evaluated on the matched row, before it is deleted; the setting ends with the
            # statement's transaction.
            unflushed = sa.func.pg_catalog.set_config(
                sa.cast(sa.literal("synchronous_commit"), sa.Text),
                sa.cast(sa.literal("off"), sa.Text),
                sa.true(),
            )
            release = release.where(self.backend.equal(unflushed, sa.literal("off")))
        return release

    @cached_property
    def finish_within_window(self) -> Update:
        """A release before ``created + hold`` (``hold_at_least``): the row stays, expiring at
        the end of that window, and says when its holder finished (``locked_by.finished``), so
        that a scheduled job whose next run comes within the window is refused. Only our own
        unexpired row, and only while the window is still open: otherwise the release deletes
        the row as usual."""
        c = self.table.c
        window_ends = self.backend.shifted(c.created, "hold")
        return (
            sa.update(self.table)
            .where(self._ours_and_live, window_ends > self._now)
            .values(
                expires=window_ends,
                locked_by=self.backend.with_json_key(c.locked_by, "finished", self._now),
            )
        )

    @cached_property
    def extend(self) -> Update:
        """Push our row's expiry to server now + ttl, unless it is gone or has already expired.

        ``expires > now`` is what keeps an extend from reviving a lock that lapsed (DBIx::Locker's
        setter revived them): once expired, someone else may already have acted.
        """
        c = self.table.c
        update = (
            sa.update(self.table)
            .where(self._ours_and_live)
            .values(expires=self.backend.shifted_now("ttl"))
        )
        return update.returning(c.expires) if self.backend.update_returning else update

    @lru_cache(maxsize=8)  # noqa: B019 -- one entry per batch size; Statements live as long as their Locker
    def purge_batch(self, batch_size: int) -> Delete:
        """Delete at most ``batch_size`` rows expired beyond grace.

        Batches keep a purge of a million stale rows from holding one long transaction. The
        expiry test is repeated on the deleted row itself, so a row taken over (new id, new
        expiry) between the sub-select and the delete is left alone.
        """
        c = self.table.c
        if self.backend.name == "mysql":
            # MySQL refuses LIMIT in an IN (sub-select) on the same table; DELETE ... LIMIT is fine.
            return (
                sa.delete(self.table)
                .where(self._expired_beyond_grace)
                .with_dialect_options(mysql_limit=batch_size)
            )
        expired_ids = sa.select(c.id).where(self._expired_beyond_grace).limit(batch_size)
        return sa.delete(self.table).where(c.id.in_(expired_ids), self._expired_beyond_grace)

    @cached_property
    def checkpoint(self) -> TextualSelect | None:
        """SQLite: copy what the write-ahead log holds back into the database file, now, without
        waiting for (or blocking) anyone; None elsewhere.

        A purge batch writes thousands of WAL pages. Left alone, they are copied back by SQLite's
        auto-checkpoint in whichever connection next commits past the log's limit: usually a
        lock operation, which then takes milliseconds instead of a fraction of one. The purge
        runs this after each batch, so that it pays for its own pages.
        """
        if self.backend.name != "sqlite":
            return None
        return sa.text("PRAGMA wal_checkpoint(PASSIVE)").columns(
            sa.column("busy", sa.Integer),
            sa.column("log", sa.Integer),
            sa.column("checkpointed", sa.Integer),
        )

    @cached_property
    def sweep_stale_requests(self) -> TextualSelect | None:
        """PostgreSQL: delete the hand-off requests whose session no longer heads its
        lockstring's queue (the table's ``_sweep_requests`` function); None elsewhere.

        A head whose process died leaves its request standing until the next head of that
        lockstring replaces it, which for a lockstring never contended again is never. Such a
        request is never granted (a release grants only to a session that holds its request's
        own key), so deleting it changes no outcome; it only spares every later release of that
        lockstring the look-up.
        """
        if not self.has_functions:
            return None
        return sa.text(f"SELECT {self.function('sweep_requests')}()").columns(
            sa.column("swept", sa.BigInteger)
        )

    def function(self, name: str) -> str:
        """PostgreSQL: the schema-qualified name of the table's function ``<table>_<name>``,
        as SQL: called by its full name, so that no function of that name in another schema
        on the caller's path can stand in for it."""
        assert self.schema is not None, "the schema is PostgreSQL's, known once connected"
        quoted = self.backend.quote_identifier(self.schema)
        return f"{quoted}.{self.table.name}_{name}"

    @cached_property
    def guard(self) -> Select[Any]:
        """Our unexpired row, share-locked until the caller's transaction ends (PostgreSQL
        ``FOR SHARE``, MySQL ``LOCK IN SHARE MODE``): takeover and purge must wait for it."""
        return sa.select(self.table.c.id).where(self._ours_and_live).with_for_update(read=True)

    @cached_property
    def guard_by_writing(self) -> Update:
        """SQLite's guard: a no-op write to our unexpired row, which takes the database's write
        lock for the rest of the caller's transaction."""
        c = self.table.c
        return sa.update(self.table).where(self._ours_and_live).values(expires=c.expires)
