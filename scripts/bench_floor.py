"""The durable FIFO floor: sqllocker's own contended protocol as bare statements.

A contended row of ``bench.py`` times sqllocker's blocking lock; this row times what that lock
sends and waits for, with no library around it: the same statements, compiled by the library
for its table (made by its migrations, so PostgreSQL's release trigger hands the row over),
with the values it sends, straight through the driver on one held autocommit connection per
process (made as the library makes its own; on MariaDB a second one gives the tickets up), in
the same contenders' harness. What the library adds to a turn beyond its protocol is the gap
between the two rows; what the protocol itself costs against a server's own blocking lock is
this row's gap to that lock's.

- PostgreSQL: a newcomer's INSERT gated on the line (``acquire_unless_queued``); refused, a
  ticket (``queue_join``, with a grant key), the gated INSERT again if the row was free, then
  the release trigger's grant, by NOTIFY, believed once its HMAC under the ticket's key checks
  out (a release's plain NOTIFY, or a quarter of a second, has it try again). The connection
  LISTENs and holds the tickets' liveness key itself, where the library keeps a second
  connection for both.
- MariaDB: the newcomer's gated INSERT; refused, a ticket, then the first waiter's polls (a
  read of the row, paced as the library paces them: ``Backoff.heading``) and, once the row is
  free, the gated INSERT; won, the ticket's DELETE, sent on a second connection without
  waiting for its answer (the library sends it from a thread of its own, on another of its
  connections, while the lock is held).
- SQLite: the byte of the lockstring's place in the queue file beside the database, taken at
  once or, after a look at the row, waited for in the kernel (``F_OFD_SETLKW``); the INSERT;
  the release's DELETE, then the place given up.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import random
import secrets
import statistics
import struct
import time
from collections.abc import Callable
from typing import Any

from sqllocker import Locker
from sqllocker.backends.mysql import liveness_name
from sqllocker.backoff import HEAD_FIRST_DELAY, HEAD_POLL_SHARE, MAX_DELAY
from sqllocker.execution import Prepared
from sqllocker.file_queue import SUFFIX, FileQueue
from sqllocker.identity import holder_details
from sqllocker.notifications import channel_for, grants_channel_for
from sqllocker.tickets import NEWCOMER

LockCalls = tuple[Callable[[int], Any], Callable[[Any], Any], Callable[[], Any]]
"""(take the lock, returning what gives it back; give it back; close), as ``bench.lock_calls``."""

FIFO_FLOOR = "durable FIFO floor"
# A design tried on MariaDB, as bare statements: its first waiters wait in the server for a
# doorbell the holder keeps, instead of polling the row (``_mariadb_doorbell``).
DOORBELL_FLOOR = "doorbell floor"
FLOORS = {"sqlite": [FIFO_FLOOR], "postgresql": [FIFO_FLOOR], "mysql": [FIFO_FLOOR, DOORBELL_FLOOR]}
# How long a doorbell floor's waiter waits for the bell before it looks at the row.
BELL_WAIT = 0.05
LOCKSTRING = "contended"  # as sqllocker's contended row's
EXPIRES = 60.0  # seconds, as sqllocker's contended row's
GRACE = 1.0
# PostgreSQL: how long a waiter in line waits for its grant before it tries the row anyway, as
# the library's (``backoff.MAX_DELAY``, which ``Backoff.await_hand_off`` waits at most).
HAND_OFF_PATIENCE = 0.25


class _Compiled:
    """The library's statements for its table, compiled for its dialect, and the values it
    sends with them (one process's: a guid is drawn for each acquisition)."""

    def __init__(self, url: str, table: str) -> None:
        self.locker = Locker(url, table=table, grace=GRACE)
        # Connect, set up, learn the backend: on a lockstring of this process's, as the
        # contenders all start at once.
        self.locker.lock(f"compile {os.getpid()}").unlock()
        operations = self.locker._operations
        self.backend = operations.backend
        self.statements = operations.statements
        self._dialect = self.locker.engine.dialect
        self.raw = self.locker.engine.raw_connection()
        connection: Any = self.raw.driver_connection
        self.connection = connection
        self.cursor = connection.cursor()
        holder = holder_details({})
        # An acquire's values (``Attempt.params``), and a ticket's (``WaitingLine.join_line``).
        self.values = {
            "ls": LOCKSTRING,
            "ttl": self.backend.seconds_value(EXPIRES),
            "holder": holder,
            **operations.database.expiry,
        }
        self.ticket_values = {"ls": LOCKSTRING, "ttl": EXPIRES, "holder": holder}
        self.queue_file = operations.queue_file

    def prepare(self, statement: Any) -> Prepared:
        return Prepared(statement, self._dialect)

    def run(self, prepared: Prepared, values: dict[str, Any]) -> list[Any]:
        """``prepared`` with ``values``: its rows as the driver returns them, if any."""
        self.cursor.execute(prepared.sql, prepared.parameters(values))
        return list(self.cursor.fetchall()) if prepared.returns_rows else []

    def look(self, prepared: Prepared, values: dict[str, Any]) -> tuple[int, bool, bool] | None:
        """The holder's row by ``prepared`` (``holder_for_acquirer``): its id, whether it may
        be taken over and whether it is ours; None if there is none."""
        rows = self.run(prepared, values)
        if not rows:
            return None
        row = prepared.row(rows[0])
        return row.id, bool(row.takeable), bool(row.ours)

    def close(self) -> None:
        self.cursor.close()
        self.raw.close()
        self.locker.close()


def fifo_floor_calls(url: str, table: str, system: str = FIFO_FLOOR) -> LockCalls:
    """The lock of ``system`` (``FIFO_FLOOR``, or MariaDB's ``DOORBELL_FLOOR``) on ``table``
    at ``url``, on a connection of its own."""
    compiled = _Compiled(url, table)
    if system == DOORBELL_FLOOR:
        return _mariadb_doorbell(compiled)
    make = {"postgresql": _postgresql, "mysql": _mariadb, "sqlite": _sqlite}
    return make[compiled.backend.name](compiled)


# -- PostgreSQL -----------------------------------------------------------------------------------


def _postgresql(floor: _Compiled) -> LockCalls:
    sql, connection = floor.statements, floor.connection
    gated, join = floor.prepare(sql.acquire_unless_queued), floor.prepare(sql.join_line)
    holder, extend = floor.prepare(sql.holder_for_acquirer), floor.prepare(sql.extend)
    release, leave = floor.prepare(sql.release), floor.prepare(sql.leave_line)
    table = sql.table.name
    released_channel, grants_channel = channel_for(table), grants_channel_for(table)
    assert connection.autocommit, "LISTEN and the statements must not wait for a COMMIT"
    floor.cursor.execute(f'LISTEN "{released_channel}"')
    floor.cursor.execute(f'LISTEN "{grants_channel}"')
    while True:  # the tickets' liveness key, a session advisory lock, as the listener's
        liveness_key = secrets.randbits(64) - 2**63
        floor.cursor.execute("SELECT pg_catalog.pg_try_advisory_lock(%s::bigint)", (liveness_key,))
        if floor.cursor.fetchone()[0]:
            break

    def take(_: int) -> tuple[int, str]:
        for _notice in connection.notifies(timeout=0):
            pass  # heard before this wait: the library's waiters register before they try
        guid = os.urandom(16).hex()
        values = {**floor.values, "lock_guid": guid, "queue_key": NEWCOMER}
        rows = floor.run(gated, values)
        if rows:
            return rows[0][0], guid
        key = os.urandom(32)  # a GrantKey: its HMAC pads go with the ticket
        padded = key.ljust(64, b"\0")
        pads = bytes(b ^ 0x36 for b in padded) + bytes(b ^ 0x5C for b in padded)
        joining = {**floor.ticket_values, "lock_guid": guid, "liveness_key": liveness_key}
        [(ticket, held)] = floor.run(join, {**joining, "grant_key": pads})
        digest = hashlib.sha256(guid.encode()).hexdigest()
        values["queue_key"] = ticket
        try_now = not held
        while True:
            if try_now:
                rows = floor.run(gated, values)
                if rows:  # won by our own INSERT: the ticket is given up at once, as the library
                    floor.run(leave, {**values, "ticket": ticket, "give_back": False})
                    return rows[0][0], guid
                row = floor.look(holder, values)  # the refusal's look (``learn_holder``)
                if row is not None and row[2]:  # handed to our ticket as we tried
                    floor.run(extend, {**values, "lock_id": row[0]})
                    return row[0], guid
            try_now = True  # unless granted: a release's notice, or no word at all
            for notice in connection.notifies(timeout=HAND_OFF_PATIENCE):
                if notice.channel == released_channel:
                    break
                granted = _signed_grant(notice.payload, digest, key)
                if granted is not None:
                    return granted, guid

    def give(token: tuple[int, str]) -> None:
        lock_id, guid = token
        floor.run(release, {"ls": LOCKSTRING, "lock_id": lock_id, "lock_guid": guid})

    return take, give, floor.close


def _signed_grant(payload: str, digest: str, key: bytes) -> int | None:
    """The row id a grant's notification hands to the waiter of ``digest``, if it is signed
    with ``key`` (``<id> <digest> <joined> <created> <expires> <hmac>``: migration 0003)."""
    fields = payload.split(" ")
    if len(fields) != 6 or fields[1] != digest:
        return None  # another waiter's
    message = payload[: payload.rindex(" ")].encode()
    mac = hmac.new(key, message, hashlib.sha256).hexdigest()
    return int(fields[0]) if hmac.compare_digest(mac, fields[5]) else None


# -- MariaDB --------------------------------------------------------------------------------------


class _MariaDBLine:
    """What both MariaDB floors send around their waits: the newcomer's gated INSERT, the
    ticket, the tickets' liveness key, the release, and the won ticket's DELETE, sent on a
    second connection without waiting for its answer (the library gives a ticket up from a
    thread of its own, on another connection, while the lock is held, and its release does
    not wait for it; on one connection the release waited behind the DELETE's commit)."""

    def __init__(self, floor: _Compiled) -> None:
        import pymysql

        self.floor = floor
        sql, cursor = floor.statements, floor.cursor
        assert floor.backend.insert_returning, "MariaDB 10.5 and later: INSERT ... RETURNING"
        self.gated, self.join = (
            floor.prepare(sql.acquire_unless_queued),
            floor.prepare(sql.join_line),
        )
        self.holder, self.extend = floor.prepare(sql.holder_for_acquirer), floor.prepare(sql.extend)
        self.release, self.leave = floor.prepare(sql.release), floor.prepare(sql.leave_line)
        self.duplicate = pymysql.err.IntegrityError
        while True:  # the tickets' liveness key, a GET_LOCK name, as the listener's
            self.liveness_key = secrets.randbits(64) - 2**63
            cursor.execute("SELECT GET_LOCK(%s, 0)", (liveness_name(self.liveness_key),))
            if cursor.fetchone()[0] == 1:
                break
        self._leaving_raw = floor.locker.engine.raw_connection()
        leaving: Any = self._leaving_raw.driver_connection
        self._leaving = leaving
        assert self._leaving.get_autocommit(), "each DELETE commits by itself, as the library's"
        self._unread = False  # a DELETE sent, its answer not yet read

    def insert(self, values: dict[str, Any]) -> int | None:
        try:
            rows = self.floor.run(self.gated, values)
        except self.duplicate:
            return None  # held: the duplicate key
        return rows[0][0] if rows else None  # nothing inserted: a live ticket ahead

    def ticket(self, values: dict[str, Any]) -> int:
        """A ticket for the waiter of ``values``, which from now on gates its INSERTs."""
        joining = {**self.floor.ticket_values, "lock_guid": values["lock_guid"]}
        cursor = self.floor.cursor
        cursor.execute(
            self.join.sql, self.join.parameters({**joining, "liveness_key": self.liveness_key})
        )
        values["queue_key"] = ticket = int(cursor.lastrowid)
        return ticket

    def give_up(self, values: dict[str, Any], ticket: int) -> None:
        """The won ticket's DELETE, unwaited for."""
        from pymysql.constants import COMMAND

        leaving = self._leaving
        if self._unread:
            leaving._read_query_result()
        sql = self.floor.cursor.mogrify(
            self.leave.sql, self.leave.parameters({**values, "ticket": ticket})
        )
        leaving._execute_command(COMMAND.COM_QUERY, sql.encode(leaving.encoding))
        self._unread = True

    def give(self, token: tuple[int, str]) -> None:
        lock_id, guid = token
        self.floor.run(self.release, {"ls": LOCKSTRING, "lock_id": lock_id, "lock_guid": guid})

    def close(self) -> None:
        if self._unread:
            self._leaving._read_query_result()
        self._leaving_raw.close()
        self.floor.close()


def _head_poll_delay(heading_since: float) -> float:
    """A first waiter's pause before its next look, as ``Backoff.heading`` paces it."""
    ceiling = min(
        MAX_DELAY, max(HEAD_FIRST_DELAY, (time.monotonic() - heading_since) * HEAD_POLL_SHARE)
    )
    return random.uniform(ceiling / 2, ceiling)


def _mariadb(floor: _Compiled) -> LockCalls:
    line = _MariaDBLine(floor)

    def take(_: int) -> tuple[int, str]:
        guid = os.urandom(16).hex()
        values = {**floor.values, "lock_guid": guid, "queue_key": NEWCOMER}
        lock_id = line.insert(values)
        if lock_id is not None:
            return lock_id, guid
        ticket = line.ticket(values)
        heading_since, seen = time.monotonic(), None  # Backoff.heading: polls paced by the hold

        def refused_by(row: tuple[int, bool, bool] | None) -> bool:
            nonlocal heading_since, seen
            if row is None or row[1] or row[2]:
                return False  # free, takeable or ours
            if row[0] != seen:  # a new hold: polls paced by its age
                heading_since, seen = time.monotonic(), row[0]
            return True

        while True:
            time.sleep(_head_poll_delay(heading_since))
            row = floor.look(line.holder, values)  # the first waiter's look
            if refused_by(row):
                continue
            if row is not None and row[2]:  # an INSERT of ours whose answer was lost
                floor.run(line.extend, {**values, "lock_id": row[0]})
                lock_id = row[0]
            else:
                lock_id = line.insert(values)
                if lock_id is None:
                    refused_by(floor.look(line.holder, values))  # the refusal's (``learn_holder``)
                    continue
            line.give_up(values, ticket)  # won: the ticket goes, unwaited for
            return lock_id, guid

    return take, line.give, line.close


def _mariadb_doorbell(floor: _Compiled) -> LockCalls:
    """A design tried: the polls replaced by a doorbell, a ``GET_LOCK`` name per lockstring
    that the holder keeps, on a second connection, from its INSERT until its DELETE has
    committed, and that each process's first waiter waits for in the server. Whoever the
    server gives the bell tries the row at once, and keeps the bell if it wins; refused (a
    ticket ahead of it, or a holder that took no bell), it lets the bell go and tries again
    after a head waiter's pause. A bell not given within ``BELL_WAIT`` has the waiter look at
    the row, as a poll."""
    line = _MariaDBLine(floor)
    bell_raw = floor.locker.engine.raw_connection()
    bell_connection: Any = bell_raw.driver_connection
    bell = bell_connection.cursor()
    name = (
        "sqllocker-bell:"
        + hashlib.sha256(f"{floor.statements.table.name}\0{LOCKSTRING}".encode()).hexdigest()[:40]
    )
    ringing = False  # this process holds the bell

    def get_bell(timeout: float) -> bool:
        nonlocal ringing
        bell.execute("SELECT GET_LOCK(%s, %s)", (name, timeout))
        ringing = bool(bell.fetchone()[0] == 1)
        return ringing

    def let_go() -> None:
        nonlocal ringing
        if ringing:
            bell.execute("SELECT RELEASE_LOCK(%s)", (name,))
            bell.fetchone()
            ringing = False

    def take(_: int) -> tuple[int, str]:
        guid = os.urandom(16).hex()
        values = {**floor.values, "lock_guid": guid, "queue_key": NEWCOMER}
        lock_id = line.insert(values)
        if lock_id is not None:
            get_bell(0)  # for waiters to come; held by a waiter, they poll instead
            return lock_id, guid
        ticket = line.ticket(values)
        heading_since = time.monotonic()
        while True:
            if get_bell(BELL_WAIT):
                lock_id = line.insert(values)
                if lock_id is None:
                    let_go()  # not our turn, or a holder that rings no bell
                    time.sleep(_head_poll_delay(heading_since))
                    continue
            else:
                row = floor.look(line.holder, values)
                if row is not None and not row[1]:
                    continue  # held: wait for the bell again
                lock_id = line.insert(values)
                if lock_id is None:
                    continue
            line.give_up(values, ticket)
            return lock_id, guid

    def give(token: tuple[int, str]) -> None:
        line.give(token)
        let_go()  # after the DELETE's commit: the bell wakes the next holder

    def close() -> None:
        let_go()
        bell_raw.close()
        line.close()

    return take, give, close


# -- SQLite ---------------------------------------------------------------------------------------

_FLOCK = struct.Struct("@hhqqixxxx")  # struct flock on 64-bit Linux, as sqllocker.file_queue's


def _sqlite(floor: _Compiled) -> LockCalls:
    import fcntl

    sql = floor.statements
    acquire, release = floor.prepare(sql.acquire), floor.prepare(sql.release)
    look = floor.prepare(sql.holder)
    # What a floor's connection runs first: SQLite's default checkpoint (bench.FloorStatements).
    floor.cursor.execute("PRAGMA wal_autocheckpoint=1000")
    assert floor.queue_file is not None, "a database in a file"
    fd = os.open(floor.queue_file + SUFFIX, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    offset = FileQueue.offset(sql.table.name, LOCKSTRING)
    place = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, offset, 1, 0)
    leave = _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, offset, 1, 0)

    def take(_: int) -> tuple[int, str]:
        guid = os.urandom(16).hex()
        values = {**floor.values, "lock_guid": guid}
        try:
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, place)
        except OSError:  # taken: a look at the row, then in the kernel's queue
            floor.run(look, values)
            fcntl.fcntl(fd, fcntl.F_OFD_SETLKW, place)
        while not (rows := floor.run(acquire, values)):
            time.sleep(0.001)  # held by someone outside the queue: never, in this harness
        return rows[0][0], guid

    def give(token: tuple[int, str]) -> None:
        lock_id, guid = token
        floor.run(release, {"ls": LOCKSTRING, "lock_id": lock_id, "lock_guid": guid})
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, leave)

    def close() -> None:
        os.close(fd)
        floor.close()

    return take, give, close


# -- the performance page -------------------------------------------------------------------------

# sqllocker's contended throughput against the floor's, on every backend: at least this.
OF_THE_FLOOR = 0.8


def page_section(rows: list[dict[str, Any]], backend_names: dict[str, str]) -> list[str]:
    """What the performance page says of the floor's contended rows (none if the run has
    none): sqllocker against its floor (the goals it bounds are in ``bench_goals``)."""
    by = {(row["backend"], row["system"]): row for row in rows}
    backends = [row["backend"] for row in rows if row["system"] == FIFO_FLOOR]
    if not backends:
        return []
    lines = [
        "",
        "The *durable FIFO floor* rows are sqllocker's own contended protocol as bare",
        "statements, with no library around them: the same statements, with the values it sends,",
        "straight through the driver on one held connection per process, in the same processes",
        "taking turns (`scripts/bench_floor.py`). On PostgreSQL a ticket, and the release",
        "trigger's hand-off, believed once its signature checks out, on a connection that also",
        "listens; on MariaDB a ticket, the first waiter's polls, the INSERT, and the ticket's",
        "DELETE on a second connection, unwaited for, as the library sends it from a thread; on",
        "SQLite the place in the kernel's queue, a look at the row, the INSERT and the DELETE.",
        "On MariaDB the *doorbell floor* is a design tried, as bare statements too: the",
        "holder keeps a `GET_LOCK` name of the lockstring's on a second connection until its",
        "DELETE has committed, and the first waiter of each process waits for that name in the",
        "server instead of polling the row.",
        "The floor is what the protocol costs; sqllocker's gap to it is the library's own (the",
        f"goal: at least {OF_THE_FLOOR}x the floor's acquisitions/s on every backend). Ratios",
        "of acquisitions/s, here and below, are the medians of the rounds' (the lowest and",
        "highest beside them); those of wait p99 are the rows' above.",
    ]
    cells = []
    for backend in backends:
        ours, floor = by[backend, "sqllocker"], by[backend, FIFO_FLOOR]
        ratios = round_ratios(ours, floor)
        cells.append(
            [
                backend_names[backend],
                f"{statistics.median(ratios):.2f}",
                f"{min(ratios):.2f}-{max(ratios):.2f}" if len(ratios) > 1 else "",
                f"{ours['wait_p99_ms'] / floor['wait_p99_ms']:.2f}",
            ]
        )
    header = "backend | sqllocker's acquisitions/s x the floor's | rounds | wait p99 x the floor's"
    lines += _table(header, cells)
    return lines


def round_ratios(row: dict[str, Any], other: dict[str, Any]) -> list[float]:
    """``row``'s acquisitions/s over ``other``'s, round by round (their medians' alone, for a
    run that kept no rounds)."""
    if "acquisitions_by_round" in row and "acquisitions_by_round" in other:
        pairs = zip(row["acquisitions_by_round"], other["acquisitions_by_round"], strict=True)
        return [mine / its for mine, its in pairs]
    return [row["acquisitions_per_s"] / other["acquisitions_per_s"]]


def _table(header: str, cells: list[list[str]]) -> list[str]:
    """A Markdown table after a blank line, its first column left-aligned, the others right."""
    columns = header.count("|") + 1
    rule = "|".join(["---", *["---:"] * (columns - 1)])
    return ["", f"| {header} |", f"|{rule}|", *(f"| {' | '.join(row)} |" for row in cells)]
