"""The lock operations on one table, shared by the sync and the async front ends.

Each operation checks out a connection, runs its statement(s), each one an autocommit
transaction of its own, and gives the connection back, so holding a lock holds no connection,
and a caller's own transaction never contains (or waits on, or rolls back) a lock row. No
operation needs a transaction around several statements: every write checks, in its own WHERE
clause, what makes it right (our id and guid, or expiry by the server's clock), so a row that
changed between two statements makes the second do nothing rather than something wrong.

The code here is synchronous. ``Locker`` calls it directly; ``sqllocker.asyncio.AsyncLocker``
calls it inside SQLAlchemy's ``greenlet_spawn`` on its AsyncEngine's ``sync_engine``, where every
driver call becomes an await on the event loop. So both front ends send the very same
statements with the very same retries and error handling; they differ only in how they wait,
hold locks and keep them alive.

Each kind of operation has a module of its own: ``database`` (connections through ``pool``, the
set-up on first use through ``setup``, retries and errors), ``acquire`` (with ``attempt``, the
statements of one attempt and the takeover of an expired row), ``release`` (release, extend,
guard, checkpoints), ``line`` (the waiting line's tickets), ``inspection`` (reading the table,
breaking a lock) and ``purge``. ``LockOperations`` puts them together for the front ends.
"""

from __future__ import annotations

from sqlalchemy.engine import Engine

from ..backends import Backend
from ..statements import Statements
from .acquire import Acquirer
from .attempt import Attempt
from .database import Database
from .inspection import Inspection
from .line import WaitingLine
from .outcomes import Acquired, Joined, LockInfo, Refused
from .purge import Purge
from .release import Releaser
from .waits import THREADS, Waits

__all__ = ["Acquired", "Joined", "LockInfo", "LockOperations", "Refused"]


class LockOperations:
    """The lock operations on ``table_name`` through ``engine``: what the front ends call, each
    answered by the collaborator whose job it is. The arguments are ``Database``'s."""

    def __init__(
        self,
        engine: Engine,
        table_name: str,
        *,
        owns_engine: bool,
        grace: float,
        auto_create: bool | None,
        strict: bool,
        transaction_pooling: bool = False,
        direct_connections: bool = False,
        waits: Waits = THREADS,
    ) -> None:
        database = Database(
            engine,
            table_name,
            owns_engine=owns_engine,
            grace=grace,
            auto_create=auto_create,
            strict=strict,
            transaction_pooling=transaction_pooling,
            direct_connections=direct_connections,
            waits=waits,
        )
        self.database = database
        self.engine = engine
        self.table = database.table
        self.auto_create = database.auto_create
        releaser = Releaser(database)
        acquirer = Acquirer(database, Attempt(database, releaser), releaser)
        line = WaitingLine(database)
        inspection = Inspection(database)
        # acquiring and taking over
        self.try_acquire = acquirer.try_acquire
        self.try_acquire_all = acquirer.try_acquire_all
        self.claim_grant = acquirer.claim_grant
        self.confirm_grant = acquirer.confirm_grant
        # releasing, extending and guarding
        self.release = releaser.release
        self.forget_attempt = releaser.forget_attempt
        self.extend = releaser.extend
        self.guard = releaser.guard
        self.checkpoint_due = releaser.checkpoint_due
        self.checkpoint = releaser.checkpoint
        # the waiting line
        self.join_line = line.join_line
        self.leave_line = line.leave_line
        # inspection and purge
        self.locks = inspection.locks
        self.overview = inspection.overview
        self.lock_info = inspection.lock_info
        self.count_live = inspection.count_live
        self.announce_leader = inspection.announce_leader
        self.count_permits = inspection.count_permits
        self.permits = inspection.permits
        self.expired_locks = inspection.expired_locks
        self.break_lock = inspection.break_lock
        self.purge_expired = Purge(database, releaser).purge_expired
        # the database and its connections
        self.ensure_setup = database.ensure_setup
        self.create_table = database.create_table
        self.close = database.pool.close
        self.forget_connections = database.pool.forget_connections
        self.reserve_for_waiting = database.pool.reserve_for_waiting
        self.connections = database.pool.connections

    @property
    def is_set_up(self) -> bool:
        """Whether a connection has taught the backend (``Database.is_set_up``)."""
        return self.database.is_set_up

    @property
    def backend(self) -> Backend:
        """The backend (set up on first use)."""
        return self.database.backend

    @property
    def statements(self) -> Statements:
        """Every statement for this table (set up on first use)."""
        return self.database.statements

    @property
    def waits_by_ticket(self) -> bool:
        """Whether waiters take tickets (``Database.waits_by_ticket``)."""
        return self.database.waits_by_ticket

    @property
    def confirms_grants(self) -> bool:
        """Whether a waiter makes sure of a row handed to it (``Database.confirms_grants``)."""
        return self.database.confirms_grants

    @property
    def hands_over(self) -> bool:
        """Whether a release hands the row to the first live ticket (``Backend.hands_over``)."""
        return self.database.hands_over

    @property
    def connects_locally(self) -> bool:
        """Whether a new connection opens a local file (``Backend.connects_locally``)."""
        return self.database.connects_locally

    @property
    def statements_await(self) -> bool:
        """Whether, under asyncio, a lock statement gives the event loop a turn
        (``Backend.statements_await``)."""
        return self.database.statements_await

    @property
    def queue_file(self) -> str | None:
        """The database file beside which waiters queue in the kernel (SQLite), or None."""
        return self.database.queue_file
