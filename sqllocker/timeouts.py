"""How long sqllocker waits for the database: the limits every backend's connections get."""

CONNECT_TIMEOUT_SECONDS = 10
# Within a lock(wait=W), a new connection gives up after what is left of W plus this much, if
# that is sooner (sqllocker.deadlines.connections_by); PostgreSQL's is at least 2 s.
CONNECT_SLACK_SECONDS = 1.0
# How long an SQLite connection waits for another process's write transaction. Lock operations
# hold the write lock for microseconds; this only has to outlast a burst of 8+ writers or a purge
# batch, and keeps "database is locked" from reaching users.
SQLITE_BUSY_TIMEOUT_SECONDS = 60
# PostgreSQL/MariaDB: a lock statement waits on another session's uncommitted row only if that
# session inserted inside a long transaction (not sqllocker's way). Bound the wait; a timeout is
# treated as contention, not as a failure.
ROW_LOCK_TIMEOUT_SECONDS = 10
# The longest any one statement may take, waits included (a purge batch, a migration step), and
# the longest a driver waits for an answer: past it, a statement stuck on a dead connection or a
# hung server fails, and an unlock() queued behind it gets its turn. A URL parameter of the same
# name (statement_timeout, read_timeout, ...) overrides it.
STATEMENT_TIMEOUT_SECONDS = 60
# A lock(wait=W)'s statements end by what is left of W plus this much. A server that works ends
# a statement sooner, by the statement timeout above (and a row lock's wait by
# ROW_LOCK_TIMEOUT_SECONDS), rolled back; this ends one on a frozen server or pooler, whose
# kernel still acknowledges, where libpq would wait for ever. On SQLite it ends the waits for
# another connection's write lock, each as long as the busy timeout, and tried again.
ACQUIRE_SLACK_SECONDS = STATEMENT_TIMEOUT_SECONDS + 5.0
# PostgreSQL: a connection whose peer stopped answering is given up after this long (TCP
# keepalives for an idle one, tcp_user_timeout for unacknowledged data).
DEAD_PEER_SECONDS = 15
