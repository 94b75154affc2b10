"""Could MariaDB's waiters be woken by a ``GET_LOCK`` name (or a ``KILL QUERY``) instead of
polling, or be handed the row by the release? (#34's goal 1)

Raw statements through PyMySQL, no library: 4 processes take turns on one row, each holding it
1 ms and stepping back 2 ms, as the bench's contended rows do, in one of five ways:

- ``get_lock``: blocking ``GET_LOCK`` itself (the bench's baseline);
- ``poll``: INSERT, and after a duplicate key sleep a quarter of the wait so far (as a polling
  first waiter does; no tickets, so no order);
- ``wake``: INSERT; the holder's second session holds a name while it holds the row and lets
  it go after its DELETE; a refused waiter blocks on that name
  (``IF(GET_LOCK(name, 0.25) = 1, RELEASE_LOCK(name), 0)``) before its next INSERT;
- ``hand_over``: as PostgreSQL's release trigger does, the release hands the row to the lowest
  ticket in its own transaction (a stored procedure: MariaDB's triggers cannot insert into
  their own table), one durable commit a turn instead of two; a refused waiter takes a ticket
  (an ``ENGINE=MEMORY`` table, as the library's) and polls, at a quarter of its wait so far,
  until the row is its own, or free with no ticket ahead of its own;
- ``kill``: first come, first served by tickets, each naming a second session of its waiter
  that sleeps (``SELECT SLEEP``, a quarter of the wait so far) between the waiter's attempts;
  the release, after its DELETE, cuts the lowest ticket's sleep short with ``KILL QUERY``
  (which a user may send to its own sessions), so that the head tries at once.

    .venv/bin/python scripts/wake_by_get_lock.py get_lock poll wake hand_over kill
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import random
import statistics
import sys
import time
from typing import Any

import pymysql

HOLD, STEP, SECONDS, PROCESSES = 0.001, 0.002, 6.0, 4
NAME = "wake-prototype"
Turn = tuple[float, float, float, float]  # asked, got, began releasing, released


def _connect() -> Any:
    return pymysql.connect(host="127.0.0.1", user="root", database="test", autocommit=True)


def _pause(began: float) -> None:
    """A quarter of the wait so far, jittered, as a polling waiter sleeps."""
    ceiling = max(0.00025, min(0.25, (time.monotonic() - began) / 4))
    time.sleep(random.uniform(ceiling / 2, ceiling))


def _handed_over(cursor: Any) -> int:
    """Take the row, or a ticket and then the row when the release hands it over (or leaves it
    free with no ticket ahead); how many polls it took."""
    pid = os.getpid()
    try:
        cursor.execute(
            "INSERT INTO wake_prototype (ls, pid) SELECT 'x', %s FROM DUAL "
            "WHERE NOT EXISTS (SELECT 1 FROM wake_tickets WHERE ls = 'x')",
            (pid,),
        )
        if cursor.rowcount == 1:
            return 0
    except pymysql.err.IntegrityError:
        pass
    cursor.execute("INSERT INTO wake_tickets (ls, pid) VALUES ('x', %s)", (pid,))
    ticket, polls, began = cursor.lastrowid, 0, time.monotonic()
    while True:
        _pause(began)
        polls += 1
        cursor.execute("SELECT pid FROM wake_prototype WHERE ls = 'x'")
        row = cursor.fetchone()
        if row is not None and row[0] == pid:
            return polls  # handed over: the release gave our ticket up
        if row is None:
            try:
                cursor.execute(
                    "INSERT INTO wake_prototype (ls, pid) SELECT 'x', %s FROM DUAL WHERE NOT "
                    "EXISTS (SELECT 1 FROM wake_tickets WHERE ls = 'x' AND id < %s)",
                    (pid, ticket),
                )
                if cursor.rowcount == 1:
                    cursor.execute("DELETE FROM wake_tickets WHERE id = %s", (ticket,))
                    return polls
            except pymysql.err.IntegrityError:
                pass


def _woken_by_kill(cursor: Any, sleeper: Any) -> int:
    """Take the row, or a ticket naming the session that sleeps for it, and then the row once
    the release's ``KILL QUERY`` cuts that sleep short (or it runs out) and no ticket is ahead
    of ours; how many sleeps it took."""
    pid = os.getpid()
    gated = (
        "INSERT INTO wake_prototype (ls, pid) SELECT 'x', %s FROM DUAL WHERE NOT "
        "EXISTS (SELECT 1 FROM wake_tickets WHERE ls = 'x' AND id < %s)"
    )
    try:
        cursor.execute(gated, (pid, 2**62))
        if cursor.rowcount == 1:
            return 0
    except pymysql.err.IntegrityError:
        pass
    sleeper.execute("SELECT CONNECTION_ID()")
    session = sleeper.fetchone()[0]
    # The ticket names the sleeping session, for the release to KILL QUERY.
    cursor.execute("INSERT INTO wake_tickets (ls, pid) VALUES ('x', %s)", (session,))
    ticket, sleeps, began = cursor.lastrowid, 0, time.monotonic()
    while True:
        try:
            cursor.execute(gated, (pid, ticket))
            if cursor.rowcount == 1:
                cursor.execute("DELETE FROM wake_tickets WHERE id = %s", (ticket,))
                return sleeps
        except pymysql.err.IntegrityError:
            pass
        sleeps += 1
        ceiling = max(0.00025, min(0.25, (time.monotonic() - began) / 4))
        try:
            sleeper.execute("SELECT SLEEP(%s)", (ceiling,))
            sleeper.fetchall()
        except pymysql.err.OperationalError as error:
            if error.args[0] != 1317:  # interrupted: the wake-up
                raise


def _take(mode: str, cursor: Any, waker: Any) -> int:
    """Take the row (or the named lock); how many refusals (or polls) it met."""
    if mode == "kill":
        return _woken_by_kill(cursor, waker)
    if mode == "get_lock":
        cursor.execute("SELECT GET_LOCK('wake-prototype-baseline', 60)")
        cursor.fetchall()
        return 0
    if mode == "hand_over":
        return _handed_over(cursor)
    refusals, began = 0, time.monotonic()
    while True:
        try:
            cursor.execute("INSERT INTO wake_prototype (ls, pid) SELECT 'x', %s", (os.getpid(),))
            break
        except pymysql.err.IntegrityError:
            refusals += 1
        if mode == "poll":
            _pause(began)
            continue
        cursor.execute(
            "SELECT IS_USED_LOCK(%s) IS NOT NULL, IF(GET_LOCK(%s, 0.25) = 1, RELEASE_LOCK(%s), 0)",
            (NAME, NAME, NAME),
        )
        if not cursor.fetchone()[0]:
            time.sleep(0.00025)  # nobody holds the name: the holder has not taken it yet
    if mode == "wake":
        waker.execute("SELECT GET_LOCK(%s, 1)", (NAME,))
        waker.fetchall()
    return refusals


def _give(mode: str, cursor: Any, waker: Any) -> None:
    if mode == "get_lock":
        cursor.execute("SELECT RELEASE_LOCK('wake-prototype-baseline')")
        cursor.fetchall()
        return
    if mode == "hand_over":
        cursor.execute("CALL wake_hand_over(%s)", (os.getpid(),))
        return
    cursor.execute("DELETE FROM wake_prototype WHERE ls = 'x' AND pid = %s", (os.getpid(),))
    if mode == "kill":
        cursor.execute("SELECT pid FROM wake_tickets WHERE ls = 'x' ORDER BY id LIMIT 1")
        head = cursor.fetchone()
        if head is not None:
            cursor.execute("KILL QUERY %s", (head[0],))
    if mode == "wake":
        waker.execute("SELECT RELEASE_LOCK(%s)", (NAME,))
        waker.fetchall()


def _contender(mode: str, ready: Any, results: Any) -> None:
    cursor, waker = _connect().cursor(), _connect().cursor()
    turns: list[Turn] = []
    refusals = 0
    ready.wait()
    started = time.monotonic()
    while time.monotonic() < started + 1 + SECONDS:  # the first second warms up
        asked = time.monotonic()
        refused = _take(mode, cursor, waker)
        got = time.monotonic()
        time.sleep(HOLD)
        left = time.monotonic()
        _give(mode, cursor, waker)
        if asked > started + 1:
            turns.append((asked, got, left, time.monotonic()))
            refusals += refused
        time.sleep(STEP)
    results.put((turns, refusals))


def measure(mode: str) -> str:
    cursor = _connect().cursor()
    cursor.execute("DROP TABLE IF EXISTS wake_prototype")
    cursor.execute(
        "CREATE TABLE wake_prototype (id bigint AUTO_INCREMENT PRIMARY KEY, "
        "ls varchar(100) NOT NULL UNIQUE, pid int)"
    )
    cursor.execute("DROP TABLE IF EXISTS wake_tickets")
    cursor.execute(
        "CREATE TABLE wake_tickets (id bigint AUTO_INCREMENT PRIMARY KEY, "
        "ls varchar(100) NOT NULL, pid int, KEY (ls, id)) ENGINE=MEMORY"
    )
    cursor.execute("DROP PROCEDURE IF EXISTS wake_hand_over")
    cursor.execute(
        """CREATE PROCEDURE wake_hand_over(holder int) BEGIN
          DECLARE next_ticket bigint DEFAULT NULL;
          DECLARE next_pid int DEFAULT NULL;
          START TRANSACTION;
          DELETE FROM wake_prototype WHERE ls = 'x' AND pid = holder;
          SELECT id, pid INTO next_ticket, next_pid FROM wake_tickets
            WHERE ls = 'x' ORDER BY id LIMIT 1;
          IF next_ticket IS NOT NULL THEN
            INSERT INTO wake_prototype (ls, pid) VALUES ('x', next_pid);
            DELETE FROM wake_tickets WHERE id = next_ticket;
          END IF;
          COMMIT;
        END"""
    )
    context = multiprocessing.get_context("fork")
    results, ready = context.Queue(), context.Barrier(PROCESSES + 1)
    workers = [
        context.Process(target=_contender, args=(mode, ready, results)) for _ in range(PROCESSES)
    ]
    for worker in workers:
        worker.start()
    ready.wait()
    reports = [results.get() for _ in workers]
    for worker in workers:
        worker.join()
    turns = sorted((turn for report in reports for turn in report[0]), key=lambda turn: turn[1])
    releases = [(turn[3] - turn[2]) * 1000 for turn in turns]
    hand_offs = [
        (after[1] - before[3]) * 1000
        for before, after in itertools.pairwise(turns)
        if after[0] < before[3]
    ]
    waits = sorted((turn[1] - turn[0]) * 1000 for turn in turns)
    refusals = sum(report[1] for report in reports)
    return (
        f"{mode:9s} acquisitions/s {len(turns) / SECONDS:5.0f}  "
        f"release p50 {statistics.median(releases):.3f} ms  "
        f"hand-off p50 {statistics.median(hand_offs):.3f} ms  "
        f"wait p99 {waits[int(len(waits) * 0.99)]:.2f} ms  "
        f"refusals (hand_over: polls) a turn {refusals / len(turns):.1f}"
    )


if __name__ == "__main__":
    for mode in sys.argv[1:] or ["get_lock", "poll", "wake", "hand_over", "kill"]:
        print(measure(mode), flush=True)
