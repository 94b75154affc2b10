"""The checker: judges a campaign's history and its database's rows against sqllocker's promise.

- ``guarded-writes``: for each lockstring the counter equals the number of committed guarded
  writes, each wrote a distinct value (no lost update), the fencing tokens never go back in
  commit order, and every write acknowledged to its worker is in the table;
- ``stale-holder``: no release, extend or guarded write of a lock succeeds once another holder
  of its lockstring had been handed it before that operation began (the row is no longer ours:
  each must fail with LockLost);
- ``exclusion``: no two holders' valid intervals overlap, an interval running from the moment
  the acquire returned to the last moment ``is_valid()`` was seen True (cut at the moment an
  operator started breaking that lock: a broken holder is not told until it next extends or
  releases);
- ``run-exclusion``: no two ``run`` COMMAND families (from their own processes' events) of a
  lockstring overlap, except for a family whose lock an operator broke, for as long as ``run``
  takes to notice (a renewal period) and stop it (``--kill-after``) plus a margin;
- ``decorated-exclusion``: no two bodies of a decorated function under one lockstring overlap,
  except bodies during which the nemesis had their process stopped (a body has no handle to ask
  ``is_valid()``);
- ``semaphore``: at no moment more than ``limit`` valid permit holders;
- ``groups``: a group holds every lockstring it asked for;
- ``liveness``: every worker still running when the faults stopped is served each lock it asks
  for then (with a wait longer than any lock lasts), and ends;
- ``held-by-nobody``: from the moment the faults stop until every worker has ended and the
  rows left have expired, the lock table is read again and again (``Snapshot``), and every live
  row (by the server's clock) of a worker must belong to a holder the history says still holds
  it: not one its holder released, gave up or failed to acquire (nor one of a worker that ended)
  more than ``NOBODY_SLACK`` before. A killed worker's rows may stay until they expire; so may
  the rows given up while the faults were in force (a release whose statement never reached
  the server), until the faults stopped and they expire after. Rows of other processes (a
  ``run``'s sqllocker) are not judged;
- ``operators``: every command an operator ran (``sqllocker release --force``, ``sqllocker
  purge-expired``) ended as the command line says it may (``OPERATOR_ENDS``), not with a
  traceback, a usage error, a signal or another status (a command that fails unnoticed would
  leave the campaign testing less than it claims).
"""

from __future__ import annotations

import itertools
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from tests.campaign import plan
from tests.campaign.history import Event

ACQUIRES = {
    "lock_wait",
    "lock_nowait",
    "try_lock",
    "hold_at_least",
    "lock_all",
    "semaphore",
    "cancelled",
    "dawdle",
    "liveness",
}
BREAKS = {"break", "release_force"}
# How an operator's command may end besides exit status 0 (done: a lock broken, rows purged):
# status 1 with, last on stderr, the one line of sqllocker's LockError (``sqllocker.cli.main``:
# a database unreachable while the nemesis restarts it, a row a guarded transaction holds), or
# for ``release`` the lock not held (``cli_inspect.release``: released, expired and taken
# over, purged or broken already). Anything else (a traceback, click's usage error, exit 2, a
# signal) is a failure the campaign would otherwise not see.
OPERATOR_ENDS = {
    "release_force": re.compile(r"sqllocker: (error: .+|lock '.*'( with id \d+)? is not held)"),
    "purge": re.compile(r"sqllocker: error: .+"),
}
# How long a `run` may take to stop its command's family once its lock is broken, beyond a
# renewal period and --kill-after: the margin for a loaded machine.
RUN_STOP_MARGIN = 1.0
# How long a row may outlive its holder's giving it up (a loaded machine, a give-back that
# runs beside the caller after a cancelled acquire).
NOBODY_SLACK = 1.0


@dataclass
class Violation:
    check: str
    message: str
    start: float
    end: float
    lockstrings: set[str] = field(default_factory=set)
    ids: set[int] = field(default_factory=set)
    pids: set[int] = field(default_factory=set)


@dataclass
class Holding:
    lockstring: str
    lock_id: int
    worker: str
    pid: int
    start: float
    last_valid: float | None = None
    op: str = ""  # the operation that acquired it

    @property
    def end(self) -> float | None:
        return self.last_valid


@dataclass(frozen=True)
class Snapshot:
    """The lock table's live rows as read at ``t`` (monotonic, taken before the read): each
    with ``ls``, ``id``, ``pid`` (its ``locked_by``'s) and ``left`` (seconds until it expires
    by the server's clock)."""

    t: float
    rows: list[dict[str, Any]]


@dataclass
class Verdict:
    violations: list[Violation]
    checks: Counter[str]


def check(
    events: list[Event],
    rows: list[dict[str, Any]],
    counters: dict[str, int],
    exits: dict[str, int | None],
    settings: plan.Settings,
    origin: float = 0.0,
    snapshots: list[Snapshot] | None = None,
) -> Verdict:
    """``origin``: the moment the campaign began, which the messages' times count from."""
    checks: Counter[str] = Counter()
    violations: list[Violation] = []
    holdings = _holdings(events)
    violations += _guarded_writes(events, rows, counters, holdings, checks)
    violations += _stale_holders(events, holdings, checks)
    violations += _exclusion(holdings, checks, origin)
    violations += _semaphore(holdings, checks)
    violations += _run_families(events, settings, checks, origin)
    violations += _decorated(events, checks)
    violations += _groups(events, checks)
    violations += _liveness(events, exits, checks)
    violations += _held_by_nobody(
        events, snapshots or [], holdings, exits, settings, checks, origin
    )
    violations += _operators(events, checks, origin)
    return Verdict(violations, checks)


# The checks that more history cannot take back: a violation of one in the history so far is
# one in the whole (holders and families only come, intervals only grow, and a break is
# recorded before it is done). A campaign run with ``--stop-on`` runs them as it goes.
EARLY_CHECKS = ("stale-holder", "exclusion", "semaphore", "run-exclusion")


def early(events: list[Event], settings: plan.Settings, origin: float = 0.0) -> list[Violation]:
    """The violations of ``EARLY_CHECKS`` in a history still being written."""
    checks: Counter[str] = Counter()
    holdings = _holdings(events)
    return [
        *_stale_holders(events, holdings, checks),
        *_exclusion(holdings, checks, origin),
        *_semaphore(holdings, checks),
        *_run_families(events, settings, checks, origin),
    ]


# -- holdings -------------------------------------------------------------------------------


def _holdings(events: list[Event]) -> dict[tuple[str, int], Holding]:
    """Every acquisition a worker was handed, with its valid interval."""
    holdings: dict[tuple[str, int], Holding] = {}
    for event in events:
        if event["type"] == "ok" and event.get("op") in ACQUIRES:
            members = (
                zip(event["ls"], event["ids"], strict=True)
                if "ids" in event
                else [(event["ls"], event["id"])]
            )
            for lockstring, lock_id in members:
                holdings[(lockstring, lock_id)] = Holding(
                    lockstring, lock_id, event["w"], event["pid"], event["t"], op=event["op"]
                )
    cuts = {
        (event["ls"], event["id"]): event["t"]
        for event in events
        if event["type"] == "fault" and event.get("kind") in BREAKS
    }
    for event in events:
        if event["type"] == "valid" and event["v"]:
            holding = holdings.get((event["ls"], event["id"]))
            if holding is not None and event["t"] >= holding.start:
                holding.last_valid = max(holding.last_valid or event["t"], event["t"])
    for key, cut in cuts.items():
        holding = holdings.get(key)
        if holding is not None and holding.last_valid is not None and holding.last_valid > cut:
            holding.last_valid = cut if cut >= holding.start else None
    return holdings


def _valid(holdings: dict[tuple[str, int], Holding]) -> list[Holding]:
    return [holding for holding in holdings.values() if holding.last_valid is not None]


# -- the checks -----------------------------------------------------------------------------


def _guarded_writes(
    events: list[Event],
    rows: list[dict[str, Any]],
    counters: dict[str, int],
    holdings: dict[tuple[str, int], Holding],
    checks: Counter[str],
) -> list[Violation]:
    found: list[Violation] = []
    by_lockstring: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        by_lockstring[row["lockstring"]].append(row)

    def around(lockstring: str, ids: set[int], message: str) -> Violation:
        times = [h.start for h in holdings.values() if h.lock_id in ids] or [0.0]
        ends = [h.last_valid or h.start for h in holdings.values() if h.lock_id in ids] or [0.0]
        return Violation("guarded-writes", message, min(times), max(ends), {lockstring}, ids)

    for lockstring, value in sorted(counters.items()):
        written = sorted(by_lockstring.get(lockstring, []), key=lambda row: (row["seq"], row["id"]))
        checks["guarded-writes: counters"] += 1
        if value != len(written):
            ids = {row["lock_id"] for row in written[-2:]}
            found.append(
                around(
                    lockstring,
                    ids,
                    f"{lockstring!r}: counter is {value} but {len(written)} guarded writes "
                    "committed (a lost update)",
                )
            )
        for before, after in itertools.pairwise(written):
            checks["guarded-writes: successive writes"] += 1
            if after["seq"] == before["seq"]:
                found.append(
                    around(
                        lockstring,
                        {before["lock_id"], after["lock_id"]},
                        f"{lockstring!r}: two committed writes read the same counter (seq "
                        f"{after['seq']}): lock ids {before['lock_id']} ({before['worker']}, "
                        f"{before['op']}) and {after['lock_id']} ({after['worker']}, "
                        f"{after['op']})",
                    )
                )
            elif after["lock_id"] < before["lock_id"]:
                found.append(
                    around(
                        lockstring,
                        {before["lock_id"], after["lock_id"]},
                        f"{lockstring!r}: fencing token went back in commit order: seq "
                        f"{before['seq']} by lock id {before['lock_id']} ({before['worker']}), "
                        f"seq {after['seq']} by lock id {after['lock_id']} ({after['worker']})",
                    )
                )
    committed = {(row["lockstring"], row["seq"], row["lock_id"]) for row in rows}
    for event in events:
        if event["type"] == "ok" and event.get("op") == "write":
            for lockstring, lock_id, seq in zip(
                event["ls"], event["ids"], event["seqs"], strict=True
            ):
                checks["guarded-writes: acknowledged writes"] += 1
                if (lockstring, seq, lock_id) not in committed:
                    found.append(
                        Violation(
                            "guarded-writes",
                            f"{lockstring!r}: write seq {seq} by lock id {lock_id} was "
                            "acknowledged but is not in the table",
                            event["t"] - 1,
                            event["t"],
                            {lockstring},
                            {lock_id},
                        )
                    )
    return found


def _stale_holders(
    events: list[Event], holdings: dict[tuple[str, int], Holding], checks: Counter[str]
) -> list[Violation]:
    """Operations on a lock that succeeded although another holder had been handed it before
    they began."""
    by_id = {holding.lock_id: holding for holding in holdings.values()}
    successors: dict[str, list[Holding]] = defaultdict(list)
    for holding in holdings.values():
        successors[holding.lockstring].append(holding)
    invoked: dict[tuple[int, str], float] = {}
    found = []
    for event in events:
        if event.get("op") not in {"release", "extend", "write"} or "ids" not in event:
            continue
        key = (event["pid"], event["op"])
        if event["type"] == "invoke":
            invoked[key] = event["t"]
            continue
        began = invoked.pop(key, None)
        if event["type"] != "ok" or began is None:
            continue
        for lock_id in event["ids"]:
            mine = by_id.get(lock_id)
            if mine is None:
                continue
            checks[f"stale-holder: {event['op']}s"] += 1
            later = [
                other
                for other in successors[mine.lockstring]
                if other.lock_id > lock_id and other.start < began
            ]
            if later:
                other = min(later, key=lambda holding: holding.start)
                found.append(
                    Violation(
                        "stale-holder",
                        f"{mine.lockstring!r}: {event['op']} of lock id {lock_id} ({mine.worker}) "
                        f"succeeded, but lock id {other.lock_id} ({other.worker}) had been handed "
                        f"the lockstring {began - other.start:.3f}s before it began",
                        mine.start,
                        event["t"],
                        {mine.lockstring},
                        {lock_id, other.lock_id},
                    )
                )
    return found


def _overlaps(intervals: list[tuple[float, float, Any]]) -> list[tuple[Any, Any, float, float]]:
    """Pairs of intervals (start, end, tag) that overlap, with the overlap."""
    pairs = []
    active: list[tuple[float, float, Any]] = []
    for start, end, tag in sorted(intervals, key=lambda interval: interval[0]):
        active = [interval for interval in active if interval[1] > start]
        for other in active:
            pairs.append((other[2], tag, start, min(end, other[1])))
        active.append((start, end, tag))
    return pairs


def _exclusion(
    holdings: dict[tuple[str, int], Holding], checks: Counter[str], origin: float
) -> list[Violation]:
    found = []
    by_lockstring: dict[str, list[tuple[float, float, Holding]]] = defaultdict(list)
    for holding in _valid(holdings):
        assert holding.last_valid is not None
        by_lockstring[holding.lockstring].append((holding.start, holding.last_valid, holding))
    for lockstring, intervals in sorted(by_lockstring.items()):
        checks["exclusion: valid intervals"] += len(intervals)
        for first, second, start, end in _overlaps(intervals):
            found.append(
                Violation(
                    "exclusion",
                    f"{lockstring!r}: two valid holders at once for {end - start:.3f}s: lock id "
                    f"{first.lock_id} ({first.worker}, valid until it was seen valid at "
                    f"{first.last_valid - origin:.3f}) and lock id {second.lock_id} "
                    f"({second.worker}, acquired at {second.start - origin:.3f})",
                    first.start,
                    max(first.last_valid, second.last_valid),
                    {lockstring},
                    {first.lock_id, second.lock_id},
                )
            )
    return found


def _semaphore(holdings: dict[tuple[str, int], Holding], checks: Counter[str]) -> list[Violation]:
    prefix = plan.SEMAPHORE + " (permit "
    permits = sorted(
        (holding for holding in _valid(holdings) if holding.lockstring.startswith(prefix)),
        key=lambda holding: holding.start,
    )
    checks["semaphore: permits"] += len(permits)
    found = []
    active: list[Holding] = []
    for permit in permits:
        active = [other for other in active if (other.last_valid or 0) > permit.start]
        active.append(permit)
        if len(active) > plan.SEMAPHORE_LIMIT:
            found.append(
                Violation(
                    "semaphore",
                    f"semaphore {plan.SEMAPHORE!r} (limit {plan.SEMAPHORE_LIMIT}): "
                    f"{len(active)} valid holders at once: "
                    + ", ".join(
                        f"lock id {h.lock_id} ({h.worker}, {h.lockstring})" for h in active
                    ),
                    min(h.start for h in active),
                    permit.start,
                    {h.lockstring for h in active},
                    {h.lock_id for h in active},
                )
            )
    return found


def _broken_families(
    breaks: list[tuple[float, str]],
    by_lockstring: dict[str, list[tuple[float, float, int]]],
    expires: float,
) -> dict[int, float]:
    """When each family's lock was broken, by family (its token). A plain ``run`` holds the
    write side of a read-write lock (``sqllocker.rwlocks``): the row an operator breaks is its
    claim, named by the lockstring, while the family's token is the id of the writer's other
    row. So a break of a lockstring belongs to the family running under it then, or, broken
    before its command started, to the one that started within an expiry after."""
    broken: dict[int, float] = {}
    for at, lockstring in breaks:
        families = sorted(by_lockstring.get(lockstring, []))
        running = [lock_id for start, end, lock_id in families if start <= at <= end]
        starting = [lock_id for start, _, lock_id in families if at < start <= at + expires]
        for lock_id in running or starting[:1]:
            broken.setdefault(lock_id, at)
    return broken


def _run_families(
    events: list[Event], settings: plan.Settings, checks: Counter[str], origin: float
) -> list[Violation]:
    families: dict[int, list[Event]] = defaultdict(list)
    for event in events:
        if event["type"] == "cmd":
            families[event["id"]].append(event)
    breaks = [
        (event["t"], event["ls"])
        for event in events
        if event["type"] == "fault" and event.get("kind") in BREAKS
    ]
    allowance = settings.expires / 3 + settings.kill_after + RUN_STOP_MARGIN
    stopped_runners = {
        event["id"]: (event["t"], event["seconds"])
        for event in events
        if event["type"] == "fault" and event.get("kind") == "pause_runner" and event.get("id")
    }
    by_lockstring: dict[str, list[tuple[float, float, int]]] = defaultdict(list)
    for lock_id, family in families.items():
        times = [event["t"] for event in family]
        by_lockstring[family[0]["ls"]].append((min(times), max(times), lock_id))
    broken = _broken_families(breaks, by_lockstring, settings.expires)
    found = []
    for lockstring, intervals in sorted(by_lockstring.items()):
        checks["run-exclusion: command families"] += len(intervals)
        ends = {lock_id: end for _, end, lock_id in intervals}
        for first, second, start, end in _overlaps(intervals):
            cut = broken.get(first)
            # Excused: the second began once the first's lock was broken, and the first
            # stopped within the allowance of the break.
            if cut is not None and start >= cut and ends[first] <= cut + allowance:
                checks["run-exclusion: overlaps after a break, within the allowance"] += 1
                continue
            why = (
                f"; lock id {first} was broken at {cut - origin:.3f} and its family ran on for "
                f"{ends[first] - cut:.3f}s after (allowed: {allowance:.3f}s)"
                if cut is not None
                else ""
            )
            window_start = min(start, cut or start) - settings.expires
            if first in stopped_runners:
                stopped_at, seconds = stopped_runners[first]
                window_start = min(window_start, stopped_at - 0.05)
                why += (
                    f"; the sqllocker of lock id {first} was stopped (SIGSTOP) at "
                    f"{stopped_at - origin:.3f} for {seconds:.3f}s, longer than its expiry "
                    f"({settings.expires:g}s)"
                    if seconds > settings.expires
                    else f"; the sqllocker of lock id {first} was stopped for {seconds:.3f}s"
                )
            found.append(
                Violation(
                    "run-exclusion",
                    f"{lockstring!r}: the COMMAND families of lock ids {first} and {second} ran "
                    f"at once for {end - start:.3f}s{why}",
                    window_start,
                    max(ends[first], ends[second]),
                    {lockstring},
                    {first, second},
                )
            )
    return found


def _decorated(events: list[Event], checks: Counter[str]) -> list[Violation]:
    stopped: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for event in events:
        if event["type"] == "fault" and event.get("kind") in {"pause", "kill", "clock"}:
            stopped[event["target"]].append(
                (event["t"], event["t"] + event.get("seconds", 0) + 0.5)
            )
    entered: dict[int, Event] = {}
    bodies: dict[str, list[tuple[float, float, Event]]] = defaultdict(list)
    for event in events:
        if event["type"] != "deco":
            continue
        if event["phase"] == "enter":
            entered[event["pid"]] = event
            continue
        enter = entered.pop(event["pid"], None)
        if enter is None:
            continue
        start, end = enter["t"], event["t"]
        if any(s < end and start < e for s, e in stopped[event["pid"]]):
            checks["decorated-exclusion: bodies left out (process stopped)"] += 1
            continue
        bodies[event["ls"]].append((start, end, enter))
    found = []
    for lockstring, intervals in sorted(bodies.items()):
        checks["decorated-exclusion: bodies"] += len(intervals)
        for first, second, start, end in _overlaps(intervals):
            found.append(
                Violation(
                    "decorated-exclusion",
                    f"{lockstring!r}: decorated bodies of {first['w']} and {second['w']} ran at "
                    f"once for {end - start:.3f}s",
                    first["t"],
                    end,
                    {lockstring},
                    pids={first["pid"], second["pid"]},
                )
            )
    return found


def _groups(events: list[Event], checks: Counter[str]) -> list[Violation]:
    found = []
    for event in events:
        if event["type"] == "ok" and event.get("op") == "lock_all":
            checks["groups: granted groups"] += 1
            if sorted(event["ls"]) != sorted(event["asked"]) or len(set(event["ids"])) != len(
                event["asked"]
            ):
                found.append(
                    Violation(
                        "groups",
                        f"group {event['asked']} was granted {event['ls']} (ids {event['ids']})",
                        event["t"] - 1,
                        event["t"],
                        set(event["asked"]),
                    )
                )
    return found


def _liveness(
    events: list[Event], exits: dict[str, int | None], checks: Counter[str]
) -> list[Violation]:
    killed = {
        event["target"]
        for event in events
        if event["type"] == "fault" and event.get("kind") in {"kill", "clock"}
    }
    stop = next((event["t"] for event in events if event["type"] == "faults_stop"), None)
    found = []
    started = {event["w"]: event for event in events if event["type"] == "start"}
    for worker, start in sorted(started.items()):
        if start["pid"] in killed:
            continue
        checks["liveness: workers"] += 1
        mine = [event for event in events if event["w"] == worker and event.get("op") == "liveness"]
        served = {event.get("sem") or event["ls"] for event in mine if event["type"] == "ok"}
        wanted = {*plan.LOCKS, plan.SEMAPHORE}
        status = exits.get(worker)
        done = any(event["type"] == "done" and event["w"] == worker for event in events)
        if served >= wanted and done and status == 0:
            continue
        missing = sorted(wanted - served)
        if missing:
            what = f"was not served {missing} after the faults stopped"
        elif status is None:
            what = "did not end, and was killed"
        else:
            what = "failed (see its log)"
        found.append(
            Violation(
                "liveness",
                f"worker {worker} (pid {start['pid']}) {what} (exit status {status})",
                stop if stop is not None else start["t"],
                max([event["t"] for event in mine], default=start["t"]),
                pids={start["pid"]},
            )
        )
    return found


def _held_by_nobody(
    events: list[Event],
    snapshots: list[Snapshot],
    holdings: dict[tuple[str, int], Holding],
    exits: dict[str, int | None],
    settings: plan.Settings,
    checks: Counter[str],
    origin: float,
) -> list[Violation]:
    workers = {event["pid"]: event["w"] for event in events if event["type"] == "start"}
    killed = {
        event["target"]: event["t"]
        for event in events
        if event["type"] == "fault" and event.get("kind") in {"kill", "clock"}
    }
    ended = {event["pid"]: event["t"] for event in events if event["type"] == "done"}
    for pid, worker in workers.items():
        if pid not in ended and exits.get(worker, 0) != 0:
            killed.setdefault(pid, float("inf"))  # killed when it would not end, or it crashed
    stop = next((e["t"] for e in events if e["type"] == "faults_undone"), float("inf"))
    by_pid: dict[int, list[Event]] = defaultdict(list)
    for event in events:
        if event["pid"] in workers:
            by_pid[event["pid"]].append(event)
    holders = {holding.lock_id: holding for holding in holdings.values()}
    checks["held-by-nobody: reads of the table"] += len(snapshots)
    found: dict[int, Violation] = {}
    for snapshot in snapshots:
        for row in snapshot.rows:
            pid, lock_id = row["pid"], row["id"]
            if pid not in workers:
                checks["held-by-nobody: rows of other processes (not judged)"] += 1
                continue
            checks["held-by-nobody: live rows of workers"] += 1
            if pid in killed or lock_id in found:
                continue
            gave_up = _given_up(row, snapshot.t, by_pid[pid], holders.get(lock_id), ended.get(pid))
            if gave_up is None:
                continue
            moment, what, since = gave_up
            # Given up while the faults were in force: the row may stay until it expires.
            allowed = moment + NOBODY_SLACK
            if moment < stop:
                allowed = max(moment, stop) + settings.expires + NOBODY_SLACK
            if snapshot.t <= allowed:
                continue
            found[lock_id] = Violation(
                "held-by-nobody",
                f"{row['ls']!r}: lock id {lock_id} (pid {pid}, {workers[pid]}) was live at "
                f"{snapshot.t - origin:.3f} with {row['left']:.3f}s left by the server's clock, "
                f"held by nobody: {what} at {moment - origin:.3f}",
                since,
                snapshot.t,
                {row["ls"]},
                {lock_id},
                {pid},
            )
    return list(found.values())


def _given_up(
    row: dict[str, Any],
    at: float,
    mine: list[Event],
    holding: Holding | None,
    ended: float | None,
) -> tuple[float, str, float] | None:
    """When and how the holder of ``row`` (a worker's) gave it up before ``at``, per the history
    (with the moment its operation began), or None if it may hold it still."""
    lockstring, lock_id = row["ls"], row["id"]
    if holding is not None:
        for event in mine:
            if event["t"] > at or event["t"] < holding.start:
                continue
            if event.get("op") == "release" and lock_id in event.get("ids", ()):
                if event["type"] == "invoke":
                    continue
                if event["type"] == "ok" and holding.op == "hold_at_least":
                    return None  # kept until its window ends
                said = "released it" if event["type"] == "ok" else f"its release {event['type']}ed"
                return event["t"], f"{holding.worker} {said}", holding.start
        if ended is not None and ended < at:
            return ended, f"{holding.worker} ended without releasing it", holding.start
        return None
    # Never handed to its worker: the operation that asked for it must be in progress.
    invoked: Event | None = None
    last: tuple[float, str, float] | None = None
    for event in mine:
        if event["t"] > at:
            break
        if event.get("op") not in ACQUIRES | {"decorator"} or not _asks_for(event, lockstring):
            continue
        if event["type"] == "invoke":
            invoked = event
        elif invoked is not None and event["op"] == invoked["op"]:
            said = event.get("error") or event["type"]
            what = f"{event['w']}'s {event['op']} ended ({event['type']}: {said})"
            if event["type"] == "ok" and event["op"] != "decorator":
                what = f"{event['w']}'s {event['op']} was handed another lock ({said})"
            if event["type"] == "ok" and event["op"] == "decorator":
                what = f"{event['w']}'s decorated call returned"
            last = (event["t"], what, invoked["t"])
            invoked = None
    if invoked is not None:
        return None  # its operation is still under way
    if last is None and ended is not None and ended < at:
        return ended, "its worker ended, never having been handed it", ended
    return last


def _asks_for(event: Event, lockstring: str) -> bool:
    """Whether the operation of ``event`` may win ``lockstring``'s row."""
    if event.get("op") == "cancelled" or "kind" in event:
        return True  # its invoke names no lockstring
    if lockstring.startswith(plan.SEMAPHORE + " (permit "):
        return event.get("sem") == plan.SEMAPHORE or (
            isinstance(event.get("ls"), str) and event["ls"] == lockstring
        )
    asked = event.get("ls")
    return lockstring in asked if isinstance(asked, list) else asked == lockstring


# -- operators ------------------------------------------------------------------------------


def _operators(events: list[Event], checks: Counter[str], origin: float) -> list[Violation]:
    """Each operator's command (a ``fault`` with an ``operator`` number) ended as it may."""
    ends = {
        event["operator"]: event
        for event in events
        if event["type"] == "fault_end" and "operator" in event
    }
    violations = []
    for fault in events:
        if fault["type"] != "fault" or "operator" not in fault:
            continue
        checks["operators: commands"] += 1
        end = ends.get(fault["operator"])
        wrong = _operator_wrong(fault["kind"], end)
        if wrong is None:
            continue
        violations.append(
            Violation(
                "operators",
                f"the operator's `{fault['command']}` (started at {fault['t'] - origin:.3f}s) "
                f"{wrong}",
                fault["t"],
                fault["t"] if end is None else end["t"],
                {fault["ls"]} if "ls" in fault else set(),
                {fault["id"]} if "id" in fault else set(),
            )
        )
    return violations


def _operator_wrong(kind: str, end: Event | None) -> str | None:
    """What is wrong with how an operator's command ended (``end``: its ``fault_end``), if
    anything."""
    if end is None:
        return "never ended (no exit status recorded)"
    if "error" in end:
        return f"could not be run: {end['error']}"
    status = end.get("status")
    stderr = str(end.get("stderr", ""))
    said = f"; stderr: {' | '.join(stderr.splitlines()) or '(empty)'}"
    if end.get("timed_out"):
        return f"ran {end['timed_out']:g}s and was killed (exit status {status}){said}"
    if end.get("traceback"):
        return f"exited with status {status} after a Python traceback{said}"
    last = stderr.splitlines()[-1] if stderr else ""
    if status == 0 or (status == 1 and OPERATOR_ENDS[kind].fullmatch(last)):
        return None
    usage = " (click's usage error)" if status == 2 else ""
    return (
        f"exited with status {status}{usage}, not 0, nor 1 with the line "
        f"/{OPERATOR_ENDS[kind].pattern}/ last on stderr{said}"
    )
