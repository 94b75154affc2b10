"""What a check of the database's settings finds: the settings the locks' guarantees rest on
(each backend's ``read_settings`` reads them; ``LockOperations.ensure_setup`` reports them).

A lock row that the database acknowledged and then lost in a crash lets a second holder in, and
the lost id can be handed out again, breaking the fencing token. These settings allow exactly
that (each observed on this project's test machine): PostgreSQL ``synchronous_commit=off``,
``fsync=off`` or an UNLOGGED table; MariaDB/MySQL ``innodb_flush_log_at_trx_commit`` other than 1;
SQLite ``synchronous=OFF`` or a journal that is off or in memory.

MariaDB/MySQL ``innodb_autoinc_lock_mode=2`` can hand out lock ids out of holding order without
the stripes table (see ``backends.mysql``), and a session whose ``timestamp`` is set judges
expiry by that clock, not the server's.
"""

from __future__ import annotations

from typing import NamedTuple

LOSES_ROWS = (
    "can lose acknowledged lock rows in a crash, which lets a second holder in and reuses its "
    "lock id"
)
LOSES_ROWS_ON_FAILOVER = (
    "can lose acknowledged lock rows when a replica is promoted, which lets a second holder in "
    "and reuses its lock id"
)
TAKES_NO_FILE_LOCKS = (
    "takes no file locks (SQLite), so that two processes may write the database at once, which "
    "lets a second holder in"
)
SPLITS_THE_DATABASE = (
    "gives connections databases in memory of their own (each thread's, or each operation's), "
    "which lets a second holder in; pass sqllocker the URL, or an Engine with "
    "poolclass=StaticPool that nothing else uses"
)
MOVES_THE_CLOCK = (
    "gives this session a clock of its own, by which it judges expiry: a live lock can look "
    "expired to it, which lets a second holder in, or it writes locks expired already"
)
REORDERS_IDS = (
    "can hand out lock ids out of holding order, so a later holder may carry a smaller fencing "
    "token"
)


class UnsafeSetting(NamedTuple):
    setting: str  # as the operator would set it, e.g. "innodb_autoinc_lock_mode=2"
    harm: str


class ServerSettings(NamedTuple):
    unsafe: list[UnsafeSetting]  # what breaks a guarantee of the locks, with what each breaks
    # MySQL with innodb_autoinc_lock_mode=2: acquires lock their stripe of the stripes table
    # (see ``backends.mysql``). With 0 or 1 the AUTO-INC lock that InnoDB keeps to the
    # end of an INSERT ... SELECT orders the ids already, and the stripe lock would only cost.
    lock_stripes: bool
    # PostgreSQL: the schema the lock table is in (where the search path finds it; where it
    # would be made, if it is not there yet). Its functions are called by their full names,
    # and its advisory keys include it.
    schema: str | None = None
    # Whether the table has the line of tickets its migration makes (PostgreSQL: the requests
    # table and its functions; MySQL: the requests table). A table made by
    # ``lock_table().create()`` has none: without it waiters back off, as on SQLite.
    has_line: bool = False
    # Why the table, if it exists, is not sqllocker's (a DBIx::Locker table): no operation may
    # run on it (see each backend's ``foreign_table``).
    foreign: str | None = None
    # A Galera node (``wsrep_on``). A group's rows are read back by guid after its commit, in
    # case the node replayed the transaction (no run of tests/test_galera.py has seen a group's
    # rows differ from what its INSERTs answered).
    replays_inserts: bool = False
    # A Galera node whose session runs an autocommit statement that a replicated write aborted
    # again by itself (``wsrep_retry_autocommit`` > 0), after its client was told of the first
    # attempt's row, which may then carry another id or not exist (tests/test_galera.py saw
    # both). A lone acquire's row is then read back by guid after commit too. sqllocker's own
    # connections turn the retries off (``backends.mysql``).
    retries_autocommit: bool = False
    # PostgreSQL: standbys stream from this server, or it names synchronous ones. A commit
    # waiting for a synchronous standby becomes visible without it if the wait is cancelled
    # (by anyone: a job's time limit, Ctrl-C, pg_cancel_backend), so a waiter makes sure of a
    # row a release handed it, by a commit of its own, before it counts on it
    # (``Acquirer.confirm_grant``).
    replicated: bool = False
