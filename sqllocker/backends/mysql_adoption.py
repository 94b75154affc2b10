"""How a DBIx::Locker table on MySQL or MariaDB becomes sqllocker's: its rows, counter and
collation carried over, and the names swapped while Perl's processes wait."""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Callable

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.sql.expression import Executable

from ..errors import LockError

# How long the adoption's table locks and RENAME wait for Perl's statements to end.
_ADOPTION_LOCK_WAIT_SECONDS = 60
# A character set or collation name, as information_schema gives it.
_NAME = re.compile(r"[A-Za-z0-9_]+")
# MySQL 8 knows information_schema_stats_expiry; MariaDB answers "unknown system variable".
_UNKNOWN_SYSTEM_VARIABLE = 1193
# What the old table does, from the copy of its rows until the swap (``swap_in``), with each
# kind of statement of Perl's: a new lock is refused, a release is made in the new table too.
_CLOSED_TO = ("INSERT", "UPDATE", "DELETE")


def lockstring_like(
    conn: Connection, source: str, table: str, exact_lockstrings: bool
) -> list[Executable | str]:
    """Without ``exact_lockstrings``, the new lockstring column gets the old one's character
    set and collation, so that the same lockstrings collide as before."""
    if exact_lockstrings:
        return []
    charset, collation = conn.exec_driver_sql(
        "SELECT character_set_name, collation_name FROM information_schema.columns "
        "WHERE table_schema = DATABASE() AND table_name = %(table)s "
        "AND column_name = 'lockstring'",
        {"table": source},
    ).one()
    if not all(name and _NAME.fullmatch(name) for name in (charset, collation)):
        return []
    return [
        f"ALTER TABLE {table} MODIFY lockstring VARCHAR(128) CHARACTER SET "
        f"{charset} COLLATE {collation} NOT NULL"
    ]


def swap_in(
    conn: Connection,
    table: str,
    new: str,
    aside: str,
    copy_rows: Callable[[Connection], list[int]],
) -> int:
    """``LOCK TABLES ... WRITE`` on both tables keeps every Perl process out of the old one
    (they wait) while its rows are copied and the new one's counter set above every id the
    old one handed out. MariaDB refuses RENAME TABLE under LOCK TABLES, so another
    connection asks for ``RENAME TABLE table TO aside, new TO table`` meanwhile, which
    waits for the table locks; only once it waits are they released. A waiting RENAME's
    exclusive metadata lock goes before every waiting INSERT and DELETE, which then open the
    table by its name: the new one. Nobody writes to the old table after the copy, and
    the name never stands for an empty table, nor for none."""
    engine = conn.engine
    conn.exec_driver_sql(f"SET SESSION lock_wait_timeout = {_ADOPTION_LOCK_WAIT_SECONDS}")
    conn.exec_driver_sql(f"LOCK TABLES {table} WRITE, {new} WRITE")
    renamer: _Renamer | None = None
    try:
        ids = copy_rows(conn)
        next_id = max(max(ids, default=0) + 1, next_auto_increment(conn, table))
        conn.exec_driver_sql(f"ALTER TABLE {new} AUTO_INCREMENT = {int(next_id)}")
        # Copied, the old table takes no new lock until the RENAME sets it aside: should this
        # connection end before the RENAME waits (killed, cut off), its table locks go with
        # it, and Perl's statements that waited for them would write to the old table, about
        # to be set aside, and the RENAME follow: a Perl lock held there, and the same
        # lockstring free in the new table. A lock is refused there instead (Perl is told to
        # try again), and a release made in the new table too.
        for statement in _closing(table, new):
            conn.exec_driver_sql(statement)
        renamer = _Renamer(engine, f"RENAME TABLE {table} TO {aside}, {new} TO {table}")
        renamer.wait_until_queued(conn)
    finally:
        with contextlib.suppress(sa.exc.SQLAlchemyError):  # a connection that ended holds none
            conn.exec_driver_sql("UNLOCK TABLES")
        if renamer is not None:
            renamer.join()
    if renamer.error is not None:
        raise renamer.error
    # Nothing can have reached the old table after the copy; should anything have, its
    # rows are kept where they are, and the adoption says so.
    old_ids = sa.select(sa.table(aside, sa.column("id")).c.id)
    left = set(conn.execute(old_ids).scalars()) - set(ids)
    if left:
        raise LockError(
            f"rows {sorted(left)} were written to {table!r} after its rows were copied; "
            f"they are in {aside!r}, and {table!r} is sqllocker's without them"
        )
    return len(ids)


def closing_triggers(table: str) -> list[str]:
    """The triggers by which the DBIx::Locker table ``table`` takes no new lock while it is
    swapped out (``swap_in``)."""
    return [f"{table}_sqllocker_closed_{event.lower()}" for event in _CLOSED_TO]


def _closing(table: str, new: str) -> list[str]:
    """The triggers on ``table``, its rows copied to ``new``: an INSERT or UPDATE fails, a
    DELETE deletes the row's copy too."""
    message = f"{table} is being adopted by sqllocker; if that stopped, run the adoption again"
    refuse = f"SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = '{message}'"
    copy_too = f"DELETE FROM {new} WHERE id = OLD.id"  # noqa: S608 (a checked table name)
    return [
        f"CREATE TRIGGER {name} BEFORE {event} ON {table} FOR EACH ROW "
        f"{copy_too if event == 'DELETE' else refuse}"
        for name, event in zip(closing_triggers(table), _CLOSED_TO, strict=True)
    ]


def reopen(conn: Connection, table: str) -> None:
    """Drop the triggers that closed ``table`` to new locks, left by an adoption that
    stopped before its swap: Perl locks in it again."""
    for name in closing_triggers(table):
        conn.exec_driver_sql(f"DROP TRIGGER IF EXISTS {name}")


class _Renamer:
    """A RENAME TABLE on a connection of its own, in a thread, which waits for the caller's
    table locks (see ``swap_in``)."""

    def __init__(self, engine: Engine, statement: str) -> None:
        self.error: BaseException | None = None
        self._statement = statement
        self._connection = engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        self.connection_id = int(
            self._connection.exec_driver_sql("SELECT CONNECTION_ID()").scalar() or 0
        )
        self._connection.exec_driver_sql(
            f"SET SESSION lock_wait_timeout = {_ADOPTION_LOCK_WAIT_SECONDS}"
        )
        self._thread = threading.Thread(target=self._run, name="sqllocker-rename", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._connection.exec_driver_sql(self._statement)
        except BaseException as error:  # reported by join()'s caller
            self.error = error

    def wait_until_queued(self, conn: Connection) -> None:
        """Until the RENAME waits for the table locks; if it does not within the bound, its
        connection is killed (so it never runs after the locks go)."""
        deadline = time.monotonic() + _ADOPTION_LOCK_WAIT_SECONDS
        while time.monotonic() < deadline and self._thread.is_alive():
            state = conn.exec_driver_sql(
                "SELECT state FROM information_schema.processlist WHERE id = %(id)s",
                {"id": self.connection_id},
            ).scalar()
            if state and "metadata lock" in str(state):
                return
            time.sleep(0.005)
        if self._thread.is_alive():
            conn.exec_driver_sql(f"KILL CONNECTION {self.connection_id}")
            raise LockError("the RENAME TABLE of the adoption never came to wait for its locks")

    def join(self) -> None:
        self._thread.join()
        self._connection.close()


def next_auto_increment(conn: Connection, table: str) -> int:
    """The next id InnoDB would draw for ``table``, read now (MySQL 8 caches the value in
    information_schema unless told not to; MariaDB has no such setting)."""
    try:
        conn.exec_driver_sql("SET SESSION information_schema_stats_expiry = 0")
    except sa.exc.DBAPIError as error:
        if getattr(error.orig, "args", ())[:1] != (_UNKNOWN_SYSTEM_VARIABLE,):
            raise
    next_id = conn.exec_driver_sql(
        "SELECT auto_increment FROM information_schema.tables "
        "WHERE table_schema = DATABASE() AND table_name = %(table)s",
        {"table": table},
    ).scalar()
    return int(next_id or 0)
