"""Every SQL statement sqllocker runs, built once per (table, backend) and nowhere else.

Statements take bound parameters only; the table name is the one identifier that reaches SQL, and
it is validated (``validation.check_table_name``) before the Table is built. Parameter names:

``ls`` lockstring, ``lock_guid`` the acquisition's secret, ``holder`` the locked_by JSON,
``lock_id`` the lock id; ``ttl``, ``minus_grace``, ``minus_foreign_grace`` and ``minus_margin``
are seconds to add to the server's clock (the last three negative), converted by
``Backend.seconds_value``.

Each statement object is made once and then reused (a ``cached_property``, or ``_made_once``
for each variant): the compiled form of each is kept by the statement object
(``execution.PreparedCache``), and one made anew per call was compiled, and kept, anew each
time, a leak in a process that lists the table every second.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from functools import cached_property
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.sql import Delete, Select, Update
from sqlalchemy.sql.dml import ReturningInsert
from sqlalchemy.sql.elements import ClauseElement
from sqlalchemy.sql.selectable import TextualSelect

from .backends import Backend
from .schema import FOREIGN_GUID_PREFIX, requests_table

S = TypeVar("S")
# The most statements _made_once keeps for one Statements: the listings' few variants, and
# purge_batch's one a batch size, which a caller may vary.
_MOST_MADE = 64


def _made_once(build: Callable[[Statements, Any], S]) -> Callable[[Statements, Any], S]:
    """A method of ``Statements`` whose statement for each argument is made once, for each
    Statements (an ``lru_cache`` is one for the class: Lockers evicted each other's)."""
    name = build.__name__

    @functools.wraps(build)
    def made(self: Statements, argument: Any) -> S:
        key = (name, argument)
        found: S | None = self._made.get(key)
        if found is None:
            if len(self._made) >= _MOST_MADE:  # purge_batch's: one a batch size asked for
                self._made.clear()
            found = self._made.setdefault(key, build(self, argument))
        return found

    return made


class Statements:
    """The statements for one lock table on one backend."""

    def __init__(
        self,
        table: sa.Table,
        backend: Backend,
        id_order: sa.Table | None = None,
        schema: str | None = None,
        *,
        has_line: bool = False,
    ) -> None:
        """``id_order``: MySQL/MariaDB, the stripes table that acquires lock, where the server
        needs it (``server_settings.ServerSettings.lock_stripes``); see :attr:`acquire`.
        ``schema``: PostgreSQL, the schema the table was found in, which the advisory keys and
        the queue's function names include (same-named tables in two schemas stay apart);
        ``has_line``, whether the table has the line of tickets its migration makes beside it
        (``sqllocker.tickets``)."""
        self.table = table
        self.backend = backend
        self.id_order = id_order
        self.schema = schema
        self.has_line = has_line
        self._made: dict[tuple[str, Any], Any] = {}  # see _made_once
        self.table_key = table.name if schema is None else f"{schema}.{table.name}"
        c = table.c
        self._now = backend.now()
        # A row may be taken over or purged only once it has been expired for `grace` seconds,
        # so that a holder whose local deadline just passed has stopped before anyone else starts;
        # a row DBIx::Locker wrote, once its local-time expiry is past in every time zone
        # (``schema.FOREIGN_CLOCK_MARGIN``). The first test alone still bounds the index scan.
        self._foreign = backend.starts_with(c.guid, FOREIGN_GUID_PREFIX)
        self.expired_beyond_grace = self._expired_by(
            backend.shifted_now("minus_grace"), backend.shifted_now("minus_foreign_grace")
        )
        self._this_lockstring = backend.equal(
            c.lockstring, sa.bindparam("ls", type_=c.lockstring.type)
        )
        # One acquisition's row, named by id *and* guid: a stale holder can never match
        # another's. And by its lockstring: a row an operator renamed (its lock then free for
        # anyone) is no longer the holder's to renew or release, and the holder is told so.
        self.ours = sa.and_(
            c.id == sa.bindparam("lock_id"),
            backend.equal(c.guid, sa.bindparam("lock_guid", type_=c.guid.type)),
            self._this_lockstring,
        )
        self._ours_and_live = sa.and_(self.ours, c.expires > self._now)

    @cached_property
    def acquire(self) -> sa.Insert | ReturningInsert[Any]:
        """Insert our row, or nothing if the lockstring has one (live or expired).

        A refusal must be quiet and cheap: no error in the server log where avoidable, no lock
        on the holder's row. An expired row is taken over by ``take_over`` (where the backend
        does it in one statement) or by ``take_over_expired`` and this statement again. Each
        backend draws ids in the order the rows can be held (see its ``acquire``), so that the
        fencing token grows with every holder.
        """
        return self.backend.acquire(self)

    @cached_property
    def acquire_unless_queued(self) -> ReturningInsert[Any]:
        """``acquire``, unless a live ticket lower than ``:queue_key`` stands
        (``sqllocker.tickets``)."""
        return self.backend.acquire_unless_queued(self)

    @cached_property
    def take_over(self) -> ReturningInsert[Any]:
        """Replace an expired holder's row with ours in one atomic statement, with a fresh id
        (where ``Backend.atomic_takeover``)."""
        return self.backend.take_over(self)

    @cached_property
    def new_row(self) -> dict[str, Any]:
        c = self.table.c
        return {
            "lockstring": sa.bindparam("ls", type_=c.lockstring.type),
            "guid": sa.bindparam("lock_guid", type_=c.guid.type),
            "created": self._now,
            "expires": self.backend.shifted_now("ttl"),
            "locked_by": sa.bindparam("holder", type_=c.locked_by.type),
        }

    @property
    def lockstring_param(self) -> sa.BindParameter[str]:
        return sa.bindparam("ls", type_=self.table.c.lockstring.type)

    @cached_property
    def id_order_blocker(self) -> TextualSelect | None:
        """Who holds the lockstring's id-order key an acquire waited for in vain, where the
        backend has such a key (PostgreSQL); None elsewhere."""
        return self.backend.id_order_blocker(self)

    @cached_property
    def join_line(self) -> ClauseElement:
        """Takes a ticket for ``:ls`` alive while ``:liveness_key`` is held (see
        ``sqllocker.tickets``). PostgreSQL's returns the ticket and whether the row is held;
        MySQL's inserts a row, whose id is the ticket."""
        return self.backend.join_line(self)

    @cached_property
    def join_line_unsigned(self) -> ClauseElement:
        """``join_line`` without ``:grant_key``: a ticket whose grant is not signed, where the
        table's ``queue_join`` is older than the key (PostgreSQL, revision 0002 and before)."""
        return self.backend.join_line_unsigned(self)

    @cached_property
    def leave_line(self) -> ClauseElement:
        """Gives up the ticket ``:ticket`` of ``:ls`` and ``:lock_guid`` (a NULL ticket: every
        one of theirs); PostgreSQL's, with ``:give_back``, also gives back a row granted to it,
        and says whether it did."""
        return self.backend.leave_line(self)

    @property
    def returned(self) -> tuple[sa.ColumnElement[Any], ...]:
        """What a successful acquire returns: the id, and the times as the driver reads them
        (text on SQLite), unconverted. A Lock converts them when they are first read
        (``LockHandle.created``), which most callers never do, and converting both on every
        acquire was a tenth of the uncontended cycle's Python on SQLite."""
        c = self.table.c
        return (
            c.id,
            sa.type_coerce(c.created, sa.types.NullType()).label("created"),
            sa.type_coerce(c.expires, sa.types.NullType()).label("expires"),
        )

    @cached_property
    def take_over_expired(self) -> Delete:
        """Delete the lockstring's row if it has expired (by the server's clock) beyond grace."""
        return sa.delete(self.table).where(self._this_lockstring, self.expired_beyond_grace)

    @cached_property
    def _rows(self) -> Select[Any]:
        """Rows (all but the secret guid), with whether each has expired and the server's
        time, both by its clock."""
        c = self.table.c
        return sa.select(
            c.id,
            self.backend.readable_text(c.lockstring).label("lockstring"),
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
        (expired beyond grace, by the server's clock) and whether it is ours: under our guid
        (compared here, so that no guid is ever read back) and unexpired, by the server's
        clock. An expired row of ours is nobody's lock: past grace anyone may take it over
        this very moment, so the acquirer takes it over too, or is refused, as by anyone's."""
        c = self.table.c
        takeable = sa.case((self.expired_beyond_grace, True), else_=False).label("takeable")
        mine = sa.and_(
            self.backend.equal(c.guid, sa.bindparam("lock_guid", type_=c.guid.type)),
            c.expires > self._now,
        )
        ours = sa.case((mine, True), else_=False).label("ours")
        return self.holder.add_columns(takeable, ours)

    @_made_once
    def list_locks(self, pattern: bool) -> Select[Any]:
        """Every row, or those whose lockstring matches the bound shell-style ``pattern``
        (converted by ``Backend.glob_value``)."""
        return self._matching(self._rows, pattern).order_by(self.table.c.lockstring)

    @_made_once
    def held_rows(self, pattern: bool) -> Select[Any]:
        """``top``'s held rows, oldest first: those not expired by the bound ``since`` (the
        server's time as ``count_expired`` read it; ``since_foreign``, that time less
        ``schema.FOREIGN_CLOCK_MARGIN``, for DBIx::Locker's rows), which ``row_info`` then
        tells apart; with ``pattern``, those whose lockstring matches it."""
        c = self.table.c
        expired = self._expired_by(
            sa.bindparam("since", type_=c.expires.type),
            sa.bindparam("since_foreign", type_=c.expires.type),
        )
        rows = self._matching(self._rows, pattern)
        return rows.where(sa.not_(expired)).order_by(c.created, c.id)

    @_made_once
    def expired_rows(self, pattern: bool) -> Select[Any]:
        """``top``'s expired rows, longest expired first, at most the bound ``most``."""
        c = self.table.c
        rows = self._matching(self._rows, pattern).where(self._expired_now)
        return rows.order_by(c.expires, c.id).limit(sa.bindparam("most", type_=sa.Integer()))

    @_made_once
    def count_expired(self, pattern: bool) -> Select[Any]:
        """How many rows ``expired_rows`` has, unlimited, and the server's time it counted at.
        Expired as ``row_info`` tells: a DBIx::Locker row once ``schema.FOREIGN_CLOCK_MARGIN``
        past its expiry."""
        counted = sa.select(sa.func.count().label("expired"), self._now.label("server_now"))
        return self._matching(counted.where(self._expired_now), pattern)

    def _matching(self, rows: Select[Any], pattern: bool) -> Select[Any]:
        return rows.where(self.backend.matches_glob(self.table.c.lockstring)) if pattern else rows

    @cached_property
    def _expired_now(self) -> sa.ColumnElement[bool]:
        """Expired by the server's clock now (no grace); a DBIx::Locker row, once it is in every
        time zone (``schema.FOREIGN_CLOCK_MARGIN``): what ``row_info`` calls expired."""
        return self._expired_by(self._now, self.backend.shifted_now("minus_margin"))

    def _expired_by(
        self, moment: sa.ColumnElement[Any], foreign_moment: sa.ColumnElement[Any]
    ) -> sa.ColumnElement[bool]:
        """The row expired by ``moment``; one DBIx::Locker wrote (its expiry in its client's
        local time), by ``foreign_moment``, earlier by that time's margin."""
        c = self.table.c
        return sa.and_(
            c.expires <= moment, sa.or_(sa.not_(self._foreign), c.expires <= foreign_moment)
        )

    @cached_property
    def count_live(self) -> Select[Any]:
        """How many rows whose lockstring matches the bound ``pattern`` cannot be taken over
        now (a semaphore's permits: see ``sqllocker.permits``)."""
        lockstring = self.table.c.lockstring
        return sa.select(sa.func.count().label("live")).where(
            self.backend.matches_glob(lockstring), sa.not_(self.expired_beyond_grace)
        )

    @cached_property
    def purgeable(self) -> Select[Any]:
        """The rows a purge would delete now: expired beyond grace."""
        return self._rows.where(self.expired_beyond_grace).order_by(self.table.c.expires)

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
        return sa.select(c.created, c.expires).where(self.ours)

    @cached_property
    def release(self) -> Delete:
        """Delete our row, matched by id *and* guid: a stale holder can never delete another's."""
        return self.backend.release(self)

    @cached_property
    def forget_attempt(self) -> Delete:
        """Delete the row of ``:ls`` an acquire that failed may have inserted, by its guid
        alone (the acquire never learnt its id): never another acquisition's row."""
        c = self.table.c
        return sa.delete(self.table).where(
            self._this_lockstring,
            self.backend.equal(c.guid, sa.bindparam("lock_guid", type_=c.guid.type)),
        )

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
        setter revived them): once expired, someone else may already have acted. Nor does it
        touch a row its holder finished (``finish_within_window``): an extend of the holder's
        that reaches the server late would end the window early.
        """
        c = self.table.c
        update = (
            sa.update(self.table)
            .where(self._ours_and_live, self.backend.json_key_absent(c.locked_by, "finished"))
            .values(expires=self.backend.shifted_now("ttl"))
        )
        return update.returning(c.expires) if self.backend.update_returning else update

    @_made_once
    def purge_batch(self, batch_size: int) -> Delete:
        """Delete at most ``batch_size`` rows expired beyond grace. Batches keep a purge of a
        million stale rows from holding one long transaction."""
        return self.backend.purge_batch(self, batch_size)

    @cached_property
    def checkpoint(self) -> TextualSelect | None:
        """What a purge runs after each batch to pay for the log it wrote (SQLite's WAL), or
        None."""
        return self.backend.checkpoint()

    @cached_property
    def leader_notice(self) -> ClauseElement | None:
        """Tell an election's observers to read its leader again (PostgreSQL), or None."""
        return self.backend.leader_notice(self)

    @cached_property
    def sweep_stale_requests(self) -> ClauseElement | None:
        """Delete the tickets whose Locker is gone (nobody holds their liveness key); None
        where the table has no line.

        A Locker whose process died leaves its tickets standing until a release of their
        lockstring passes over them (PostgreSQL) or a purge sweeps them, which for a
        lockstring never contended again is never. Such a ticket is never served, so deleting
        it changes no outcome; it only spares every later waiter of that lockstring the
        look-up.
        """
        if not self.has_line:
            return None
        return self.backend.sweep_requests(self)

    @cached_property
    def requests(self) -> sa.Table:
        """MySQL/MariaDB: the table's tickets (``schema.requests_table``); PostgreSQL's are
        reached only through its functions."""
        return requests_table(self.table.name)

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
