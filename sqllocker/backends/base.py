"""The base class of the backends: what every database must answer (see ``sqllocker.backends``)."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import sqlalchemy as sa
from sqlalchemy.engine import URL, Connection, Dialect, Engine
from sqlalchemy.sql.elements import ClauseElement, ColumnElement
from sqlalchemy.sql.expression import Executable
from sqlalchemy.types import TypeEngine

if TYPE_CHECKING:
    from sqlalchemy.pool import Pool
    from sqlalchemy.sql import Delete, Insert
    from sqlalchemy.sql.dml import ReturningInsert
    from sqlalchemy.sql.selectable import TextualSelect

    from ..execution import OneCall
    from ..server_settings import ServerSettings


class StatementParts(Protocol):
    """What a backend's statement variants build on: the table's shared statements and their
    parts (``statements.Statements``)."""

    table: sa.Table
    backend: Backend
    id_order: sa.Table | None
    table_key: str
    expired_beyond_grace: ColumnElement[bool]
    ours: ColumnElement[bool]

    @property
    def new_row(self) -> dict[str, Any]:
        """The values of a new row (see ``Statements.new_row``)."""

    @property
    def lockstring_param(self) -> sa.BindParameter[str]:
        """The lockstring's bound parameter."""

    @property
    def returned(self) -> tuple[ColumnElement[Any], ...]:
        """What a successful acquire returns (see ``Statements.returned``)."""

    @property
    def requests(self) -> sa.Table:
        """MySQL/MariaDB: the table's tickets."""

    def function(self, name: str) -> str:
        """PostgreSQL: the schema-qualified name of the table's function ``<table>_<name>``."""


class Backend:
    """One database family: its clock, statements, errors, connections and settings."""

    name: ClassVar[str]
    sync_driver: ClassVar[str]
    async_driver: ClassVar[str]
    # PostgreSQL takes over an expired row in one statement (ON CONFLICT DO UPDATE ... WHERE
    # expired); the others delete the row if still expired and insert again.
    atomic_takeover: ClassVar[bool] = False
    # A release hands the row to the first live ticket and says so by NOTIFY (PostgreSQL);
    # elsewhere the first waiter of each Locker polls the row (``sqllocker.tickets``).
    hands_over: ClassVar[bool] = False
    # A Locker's ``max_connections`` sizes its engine's pool: connections to a server (not
    # SQLite's, which are to a file of the Locker's own machine).
    limits_connections: ClassVar[bool] = True
    # SQLite: the connections of an engine sqllocker makes do not checkpoint the write-ahead
    # log as they commit; releases do, every CHECKPOINT_EVERY of them (``checkpoint``).
    checkpoints_after_releases: ClassVar[bool] = False
    # PostgreSQL and MySQL can share-lock one row until the caller's transaction ends (FOR
    # SHARE); SQLite can only take its database-wide write lock, by writing to the row.
    share_locks_rows: ClassVar[bool] = True
    # Whether a Locker creates a missing table on first use (SQLite, the zero-set-up default);
    # on a server, creating tables is a DBA's decision (`sqllocker migrate`).
    creates_table_on_first_use: ClassVar[bool] = False
    # Whether the driver returns timestamps as the text the database holds (``schema.to_utc``
    # reads them).
    reads_timestamps_as_text: ClassVar[bool] = False
    # How a transaction of several lock statements starts.
    begin: ClassVar[str] = "BEGIN"
    # Adoption of a DBIx::Locker table, where DDL cannot be rolled back: the new table is built
    # under a name of its own and swapped in (``swap_in``), not made in place in a transaction.
    adoption_swaps: ClassVar[bool] = False
    # The longest a lock operation's statements can wait, in all, on a connection of an engine
    # sqllocker made, whatever the server does; None: no bound (a frozen server, which only
    # ``interrupt`` ends). A deadline further off needs no watching (``sqllocker.deadlines``).
    operation_wait_bound: ClassVar[float | None] = None
    # Whether ``interrupt`` ends the connection (a server's: its socket shut down), so that it
    # must not serve again, even when the interrupt came as its statements had ended.
    interrupt_ends_connection: ClassVar[bool] = True
    # A new connection opens a file of this machine (SQLite): nothing to give up on, so no
    # ``cap_connect``, and a wait's acquire sets no deadline for its connections.
    connects_locally: ClassVar[bool] = False

    def __init__(self, insert_returning: bool, update_returning: bool) -> None:
        self.insert_returning = insert_returning
        self.update_returning = update_returning

    @classmethod
    def for_dialect(cls, dialect: Dialect) -> Backend:
        return cls(insert_returning=True, update_returning=True)

    # -- the server's clock ------------------------------------------------------------------

    def now(self) -> ColumnElement[Any]:
        """The server's current time, re-read per statement (not frozen at transaction start)."""
        raise NotImplementedError

    def shifted_now(self, param: str) -> ColumnElement[Any]:
        """The server's time plus the bound parameter ``param`` (see :meth:`seconds_value`)."""
        raise NotImplementedError

    def shifted(self, moment: ColumnElement[Any], param: str) -> ColumnElement[Any]:
        """A timestamp column (or expression) plus the bound parameter ``param``."""
        raise NotImplementedError

    def seconds_value(self, seconds: float) -> Any:
        """A number of seconds as :meth:`shifted_now` wants its parameter."""
        return seconds

    # -- expressions ---------------------------------------------------------------------------

    def with_json_key(
        self, document: ColumnElement[Any], key: str, text: ColumnElement[Any]
    ) -> ColumnElement[Any]:
        """JSON ``document`` with ``key`` set to the string ``text`` (an SQL expression)."""
        return sa.func.json_set(document, sa.literal(f"$.{key}"), sa.cast(text, sa.String))

    def json_key_absent(self, document: ColumnElement[Any], key: str) -> ColumnElement[bool]:
        """Whether JSON ``document`` has no ``key``."""
        return sa.func.json_extract(document, sa.literal(f"$.{key}")).is_(None)

    def equal(self, left: ColumnElement[Any], right: ColumnElement[Any]) -> ColumnElement[bool]:
        """``left = right`` for strings."""
        return self.as_text(left) == self.as_text(right)

    def as_text(self, value: ColumnElement[Any]) -> ColumnElement[Any]:
        """``value`` as the type whose comparisons are the database's own."""
        return value

    def readable_text(self, column: ColumnElement[str]) -> ColumnElement[str]:
        """A text ``column`` that a writer other than sqllocker fills (a Perl job's
        lockstring), read so that every value of it can be read: for listing, not matching."""
        return column

    def quote_identifier(self, name: str) -> str:
        """``name`` as a quoted SQL identifier (PostgreSQL's rules)."""
        return '"' + name.replace('"', '""') + '"'

    def matches_glob(self, column: ColumnElement[str]) -> ColumnElement[bool]:
        """``column`` matches the bound ``pattern`` (see :meth:`glob_value`), case-sensitively."""
        pattern = sa.bindparam("pattern", type_=sa.String())
        return self.as_text(column).like(pattern, escape="\\")

    def literal_glob(self, text: str) -> str:
        """``text`` as the start of a :meth:`matches_glob` pattern that matches only itself:
        nothing in it is a wildcard, ``*`` and ``?`` included."""
        return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")

    def glob_value(self, pattern: str) -> str:
        """A shell-style pattern (``*`` and ``?`` are the wildcards) as :meth:`matches_glob`
        wants it; every other character, SQL's own wildcards included, matches only itself."""
        escaped = pattern.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        return escaped.replace("*", "%").replace("?", "_")

    def starts_with(self, column: ColumnElement[str], prefix: str) -> ColumnElement[bool]:
        """``column`` starts with the constant ``prefix`` (which holds no wildcard), exactly."""
        return column.like(sa.literal(prefix + "%"))

    # -- statements that differ (the others are in ``sqllocker.statements``) -----------------

    def acquire(self, statements: StatementParts) -> Insert:
        """Insert our row, or nothing if the lockstring has one (see ``Statements.acquire``)."""
        raise NotImplementedError

    def acquire_unless_queued(self, statements: StatementParts) -> ReturningInsert[Any]:
        """``acquire``, unless a live ticket lower than ``:queue_key`` stands."""
        raise NotImplementedError(f"{self.name} has no tickets")

    def join_line(self, statements: StatementParts) -> ClauseElement:
        """Take a ticket (see ``Statements.join_line``)."""
        raise NotImplementedError(f"{self.name} has no tickets")

    def join_line_unsigned(self, statements: StatementParts) -> ClauseElement:
        """Take a ticket whose grant is not signed (see ``Statements.join_line_unsigned``):
        where releases hand nothing over, the same as ``join_line``."""
        return self.join_line(statements)

    def leave_line(self, statements: StatementParts) -> ClauseElement:
        """Give up a ticket (see ``Statements.leave_line``)."""
        raise NotImplementedError(f"{self.name} has no tickets")

    def leader_notice(self, statements: StatementParts) -> ClauseElement | None:
        """Tell observers of an election (param ``ls``, its name) to read its leader again;
        None where nothing can be told (observers poll)."""
        return None

    def sweep_requests(self, statements: StatementParts) -> ClauseElement:
        """Delete the tickets nobody keeps alive (see ``Statements.sweep_stale_requests``)."""
        raise NotImplementedError(f"{self.name} has no tickets")

    def take_over(self, statements: StatementParts) -> ReturningInsert[Any]:
        """Replace an expired row with ours in one statement (where ``atomic_takeover``)."""
        raise NotImplementedError(f"{self.name} takes over by delete and insert")

    def release(self, statements: StatementParts) -> Delete:
        """Delete our row, matched by id *and* guid."""
        return sa.delete(statements.table).where(statements.ours)

    def purge_batch(self, statements: StatementParts, batch_size: int) -> Delete:
        """Delete at most ``batch_size`` rows expired beyond grace. The expiry test is repeated
        on the deleted row itself, so a row taken over (new id, new expiry) between the
        sub-select and the delete is left alone."""
        c = statements.table.c
        expired = statements.expired_beyond_grace
        expired_ids = sa.select(c.id).where(expired).limit(batch_size)
        return sa.delete(statements.table).where(c.id.in_(expired_ids), expired)

    def checkpoint(self) -> TextualSelect | None:
        """What a purge runs after each batch to pay for the log it wrote; None: nothing."""
        return None

    def id_order_blocker(self, statements: StatementParts) -> TextualSelect | None:
        """Who holds the key an acquire waited for in vain (PostgreSQL); None elsewhere."""
        return None

    @classmethod
    def system_name(cls, dialect: Dialect) -> str:
        """OpenTelemetry's ``db.system.name`` of a dialect's database (its stable database
        conventions: ``sqlite``, ``postgresql``, ``mysql``, ``mariadb``)."""
        return cls.name

    def live_waiters(self, table: str) -> Executable | None:
        """Rows ``(lockstring, waiters)``: how many live tickets (``sqllocker.tickets``) stand
        for each lockstring of lock table ``table`` (a checked name), reading only their
        lockstring and liveness key; None where waiters keep no tickets in the database."""
        return None

    # -- schema --------------------------------------------------------------------------------

    @classmethod
    def lockstring_type(cls, dialect: Dialect, length: int) -> TypeEngine[Any]:
        """VARCHAR(``length``) that compares exactly (binary, no padding)."""
        return dialect.type_descriptor(sa.String(length))

    @classmethod
    def timestamp_type(cls, dialect: Dialect) -> TypeEngine[Any]:
        """How a UTC instant is stored."""
        return dialect.type_descriptor(sa.DateTime(timezone=True))

    @classmethod
    def holder_json_type(cls, dialect: Dialect) -> TypeEngine[Any]:
        """How the JSON of who holds a lock is stored."""
        return dialect.type_descriptor(sa.JSON())

    @classmethod
    def timestamp_bind(cls, value: Any) -> Any:
        """An aware UTC datetime as the driver takes it for :meth:`timestamp_type`."""
        return value

    @classmethod
    def foreign_guid_default(cls) -> str:
        """SQL for the guid column's default (``schema.ForeignGuidDefault``)."""
        raise NotImplementedError

    # -- errors --------------------------------------------------------------------------------

    def is_unique_violation(self, error: sa.exc.DBAPIError) -> bool:
        raise NotImplementedError

    def is_transient_conflict(self, error: sa.exc.DBAPIError) -> bool:
        """Contention the database resolved by failing us: try again, it is not a fault."""
        raise NotImplementedError

    def is_missing_table(self, error: sa.exc.DBAPIError) -> bool:
        raise NotImplementedError

    def is_missing_function(self, error: sa.exc.DBAPIError) -> bool:
        """No function of that name takes those arguments: one of the table's, as an older
        revision of its migrations made it (where the table has functions)."""
        return False

    def binds_in_text(self, dbapi_connection: Any) -> bool:
        """Whether ``dbapi_connection``'s driver writes a statement's parameters into the
        statement's text, where the server shows them to others (where releases hand rows
        over: see ``PostgreSQLBackend.binds_in_text``)."""
        return False

    def others_read_tickets(self, table: str) -> ClauseElement | None:
        """Where releases hand rows over: a statement answering one row, one column, whether
        a role other than the owner of ``table``'s tickets (and roles acting as the owner, and
        superusers) may read them, grant keys included; None where tickets keep no key."""
        return None

    def is_read_only(self, error: sa.exc.DBAPIError) -> bool:
        """The server accepts no writes: a standby, or a primary demoted by a failover. The
        connection is dropped and the operation tried again on a fresh one, which a URL naming
        several hosts takes to whichever is the primary now."""
        raise NotImplementedError

    # -- connections ---------------------------------------------------------------------------

    @classmethod
    def driver_scheme(cls, name: str, asynchronous: bool) -> str:
        """The scheme that a URL naming no driver (``name://``, one of
        ``backends.url_names``) gets: sqllocker's driver for this backend."""
        return cls.async_driver if asynchronous else cls.sync_driver

    @classmethod
    def url_text(cls, text: str) -> str:
        """A URL as its users write it, in the form SQLAlchemy parses (PostgreSQL's several
        hosts); unchanged elsewhere."""
        return text

    @classmethod
    def connect_args(
        cls, url: URL, transaction_pooling: bool, default: Callable[[str, object], None]
    ) -> dict[str, Any]:
        """The driver arguments of an engine sqllocker makes; ``default(name, value)`` sets
        one unless the URL gives its own."""
        return {}

    @classmethod
    def pool_class(cls, url: URL) -> type[Pool] | None:
        """The pool of an engine sqllocker makes for ``url``, where SQLAlchemy's choice does not
        serve lock operations on every release sqllocker supports; None: SQLAlchemy's."""
        return None

    @classmethod
    def in_one_call(cls, dbapi_connection: Any, configured: bool) -> OneCall | None:
        """A function that runs a statement on ``dbapi_connection`` in one call of the driver,
        where the cursor takes several (an execute and a fetch, a cursor opened and closed)
        that cost more; None where it takes one. ``configured``: the connection is of an
        engine sqllocker made, with the settings ``configure_engine`` gives it."""
        return None

    @classmethod
    def statements_await(cls, configured: bool) -> bool:
        """Whether, under asyncio, a lock statement awaits its driver (giving the event loop a
        turn); ``configured`` as for ``in_one_call``."""
        return True

    @classmethod
    def configure_engine(cls, engine: Engine) -> None:
        """Anything an engine sqllocker made needs on each new connection."""

    @classmethod
    def in_memory(cls, url: URL) -> bool:
        """Whether ``url``'s database lives in its connections (SQLite's in memory): closed,
        they take it with them, every lock in it."""
        return False

    @classmethod
    def missing_database(cls, url: URL) -> str | None:
        """The file connecting to ``url`` would make, not being there yet (SQLite's); None if
        it is there, or a server's (a database in memory: ``in_memory``)."""
        return None

    @classmethod
    def queue_file(cls, url: URL) -> str | None:
        """The database file whose waiters queue in the kernel (SQLite on Linux: see
        ``sqllocker.file_queue``), or None."""
        return None

    @classmethod
    def takes_tickets(cls, dialect: Dialect) -> bool:
        """Whether waiters can take tickets (``sqllocker.tickets``) through ``dialect``'s
        driver: a session lock to keep them alive, and (where ``hands_over``) LISTEN."""
        return False

    # -- a statement past its deadline ---------------------------------------------------------

    @classmethod
    def cap_connect(cls, dialect: Dialect, cparams: dict[str, Any], seconds: float) -> None:
        """Make the connection ``cparams`` describe give up within about ``seconds`` (or its
        own timeout, if shorter), until it is established (``sqllocker.deadlines``)."""

    @classmethod
    def interrupt(cls, dbapi_connection: Any) -> None:
        """End the statement ``dbapi_connection`` (a sync driver's) is waiting on, from another
        thread, at once: its lock's life is over (``sqllocker.deadlines``). The driver then
        raises, most often as for a lost connection; the connection is not used again."""

    @classmethod
    def statement_warnings(cls, dbapi_connection: Any) -> list[str] | None:
        """The list the server's warnings on ``dbapi_connection`` are recorded in, where a
        warning can mean that a statement that succeeded wrote what may not last (PostgreSQL:
        ``DriverSession`` looks after each statement); None where none can."""
        return None

    @classmethod
    def abandon(cls, dbapi_connection: Any, cursor: Any) -> None:
        """Before ``dbapi_connection`` is closed in the middle of a lock operation (its caller
        cancelled, or interrupted), ``cursor`` the one the operation used: end what it still
        runs or has left unfinished, its writes rolled back, so that no lock in the database
        outlives the close. On a server, closing the connection ends its session, and the
        server rolls back: nothing to do. Never raises an ``Exception``."""

    @classmethod
    def settle(cls, dbapi_connection: Any) -> None:
        """Before an operation on the one connection a database in memory lives in (which an
        operation cut short leaves open, ``abandon`` done): roll back a transaction it left
        open, so that none of this operation's statements falls into it (nor out with its
        rollback)."""

    @classmethod
    def bound_waits(cls, dbapi_connection: Any, seconds: float) -> object | None:
        """Before a lock operation's statements on ``dbapi_connection`` that must end within
        ``seconds`` (``sqllocker.deadlines``): cut their waits for other connections' locks to
        that, where ``interrupt`` cannot end such a wait and the driver's own may be longer
        (SQLite's busy handler). What ``unbound_waits`` needs to undo it after them, or None
        if nothing was cut."""
        return None

    @classmethod
    def unbound_waits(cls, dbapi_connection: Any, undo: object) -> None:
        """Undo ``bound_waits`` (which returned ``undo``), once the statements have ended (not
        after a cancellation: that connection is discarded). A connection that cannot be given
        its own waits back is closed, never left to the next operation with the cut."""

    # -- a guarded transaction ---------------------------------------------------------------

    @classmethod
    def in_transaction(cls, driver_connection: Any) -> bool | None:
        """Whether the driver's connection is inside a transaction now (after a statement of
        it), or None where the driver does not say: a "transaction" of SQLAlchemy's on a
        driver in autocommit commits each statement, and a row lock with it."""
        return None

    def reads_an_older_snapshot(self, conn: Connection, error: Exception | None) -> bool:
        """After a guard statement that failed with ``error`` (a driver's) or found no row
        (None): whether ``conn``'s transaction reads the snapshot it took first, in which a row
        made or renewed since cannot be seen or share-locked, so that the guard proved nothing
        either way (PostgreSQL above READ COMMITTED; MySQL's locking reads see the newest
        rows at every level)."""
        return False

    def bound_silence(self, conn: Connection, seconds: float) -> None:
        """Have the server end ``conn``'s open transaction, rolling it back, once its client
        has been silent in it for ``seconds`` (or less, if the session's own limit is less),
        for that transaction only: a client cut off by the network must not keep a guard's
        row lock until TCP gives up."""
        raise NotImplementedError

    # -- settings the guarantees rest on --------------------------------------------------------

    def read_settings(self, conn: Connection, table: str) -> ServerSettings:
        """The settings of ``conn``'s database that the locks' guarantees rest on (see
        ``sqllocker.server_settings``)."""
        raise NotImplementedError

    def foreign_table(self, conn: Connection, table: str) -> str | None:
        """Why ``table``, if it exists, is not a table sqllocker made, or None."""
        raise NotImplementedError

    # -- migrations and adoption ---------------------------------------------------------------

    @classmethod
    def migration_connection(cls, engine: Engine) -> AbstractContextManager[Connection]:
        """A connection in a transaction for a migration, serialised against concurrent ones."""
        raise NotImplementedError

    def reflected_default(self, conn: Connection, table: str, column: str) -> str | None:
        """A column's default as the database shows it, where SQLAlchemy reflects none."""
        return None

    def adoption_refusal(self, conn: Connection, table: str) -> str | None:
        """Why DBIx::Locker table ``table`` (its columns there) cannot be adopted safely as it
        is, or None."""
        return None

    def adoption_names(self, table: str) -> list[str]:
        """The tables and views an adoption of ``table`` makes beside it, which must not exist
        before it starts."""
        return [f"{table}_held"]

    def reopen_for_perl(self, conn: Connection, table: str) -> None:
        """Where ``adoption_swaps``: let Perl write to the DBIx::Locker table ``table`` again,
        which an adoption that stopped before its swap (``swap_in``) left closed."""

    def prepare_adoption(self, conn: Connection, table: str) -> None:
        """Before an adoption reads the rows: keep Perl processes from changing them until the
        migration's transaction ends (where ``adoption_swaps`` is false)."""

    def adoption_before_create(self, table: str) -> list[Executable | str]:
        """What moves the DBIx::Locker table out of the way of the new one (in the migration's
        transaction, where ``adoption_swaps`` is false)."""
        raise NotImplementedError

    def grants_kept(
        self, conn: Connection, table: str, online: bool = True
    ) -> list[Executable | str]:
        """Statements that give the roles other than its owner what they may do with the
        DBIx::Locker table ``table`` (and the sequence of its ids) on the new one that replaces
        it (where ``adoption_swaps`` is false: a swap keeps the grants of the name); and its
        owner, where another role makes the new one: this connection's, if ``online``, else
        whoever applies them."""
        return []

    def sequence_name_kept(self, conn: Connection, table: str) -> list[Executable | str]:
        """Statements that give the new table's id sequence the name of the DBIx::Locker
        table ``table``'s, where it has one (read before the table goes)."""
        return []

    def ids_handed_out_below(self, conn: Connection, source: str, highest_row: int) -> int:
        """An id above every id the DBIx::Locker table ``source`` has handed out."""
        return highest_row + 1

    def next_id_at_least(self, table: str, first: int) -> list[Executable | str]:
        """Statements that make the new table's next id ``first`` or more."""
        raise NotImplementedError

    def lockstring_like(
        self, conn: Connection, source: str, table: str, exact_lockstrings: bool
    ) -> list[Executable | str]:
        """What makes the new table's lockstrings compare as the old table's did, unless
        ``exact_lockstrings`` (where they did not compare exactly)."""
        return []

    def swap_in(
        self,
        conn: Connection,
        table: str,
        new: str,
        aside: str,
        copy_rows: Callable[[Connection], list[int]],
    ) -> int:
        """Where ``adoption_swaps``: fill ``new`` with ``copy_rows`` (the ids it copied) while
        nobody can write to ``table``, and swap the two names in one step, ``table`` going to
        ``aside``; returns how many rows it copied."""
        raise NotImplementedError


def shut_down_socket(fd: int) -> None:
    """Shut a connection's socket down (both ways) from another thread, without closing the
    driver's descriptor: a driver waiting on it wakes at once to a closed connection, whatever
    the peer does (a frozen server's kernel still acknowledges)."""
    duplicate = socket.socket(fileno=os.dup(fd))
    try:
        duplicate.shutdown(socket.SHUT_RDWR)
    finally:
        duplicate.close()
