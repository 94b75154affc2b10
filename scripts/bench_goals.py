"""The speed goals the performance page reports on, each judged from the run's own figures.

A goal is a ratio to a baseline of the same run (or a latency), so that it holds or fails in
one run, whatever the machine's speed. Where the library's protocol bounds a contended goal, the
page shows the protocol's bare statements beside it (the durable FIFO floor,
``bench_floor``): the gap that is the library's, and the gap no library could close.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from scripts.bench_floor import FIFO_FLOOR, FLOORS, OF_THE_FLOOR, round_ratios

FLAT = "flat cycle"  # bench.FLAT: the uncontended row of a lock cycle's duties done flat

Rows = dict[tuple[str, str], dict[str, Any]]
Figure = Callable[[Rows, str], float | None]  # of the rows, for sqllocker or its floor's row


@dataclass(frozen=True)
class Goal:
    """``what`` at least (``higher``) or at most ``target`` (``unit``: "x" a ratio, "ms")."""

    what: str
    higher: bool
    target: float
    unit: str
    figure: Figure
    bounded_by_floor: bool = False  # the floor's own figure is shown beside it
    floors: tuple[str, ...] = ()  # that floor's rows: if none named, the backend's FLOORS

    def reached(self, value: float) -> bool:
        shown = round(value, 2)  # judged as the page shows it
        return shown >= self.target if self.higher else shown <= self.target


def _uncontended(backend: str, system: str) -> Figure:
    """The ratio to the raw floor of ``system``'s row, or of a floor's row (``who``)."""

    def figure(rows: Rows, who: str) -> float | None:
        row = system if who == "sqllocker" else who
        return _get(rows, ("uncontended", backend, row), "ratio_to_floor")

    return figure


def _of_blocking(backend: str, blocking: str, measure: str) -> Figure:
    def figure(rows: Rows, who: str) -> float | None:
        mine = rows.get(("contended", f"{backend}|{who}"))
        theirs = rows.get(("contended", f"{backend}|{blocking}"))
        if mine is None or theirs is None:
            return None
        if measure == "acquisitions_per_s":
            return statistics.median(round_ratios(mine, theirs))
        return float(mine[measure] / theirs[measure])

    return figure


def _contended(backend: str, measure: str) -> Figure:
    return lambda rows, who: _get(rows, ("contended", f"{backend}|{who}"), measure)


def _of_floor(backend: str) -> Figure:
    def figure(rows: Rows, _who: str) -> float | None:
        mine = rows.get(("contended", f"{backend}|sqllocker"))
        floor = rows.get(("contended", f"{backend}|{FIFO_FLOOR}"))
        if mine is None or floor is None:
            return None
        return statistics.median(round_ratios(mine, floor))

    return figure


def _get(rows: Rows, key: tuple[str, ...], field: str) -> float | None:
    row = rows.get((key[0], "|".join(key[1:])))
    return None if row is None or row.get(field) is None else float(row[field])


GOALS = [
    Goal("SQLite: uncontended cycles/s x the raw floor's", True, 0.85, "x",
         _uncontended("sqlite", "sqllocker"), True, (FLAT,)),
    Goal("SQLite: asyncio cycles/s x the async raw floor's", True, 0.75, "x",
         _uncontended("sqlite", "sqllocker.asyncio")),
    Goal("PostgreSQL: asyncio cycles/s x the async raw floor's", True, 0.85, "x",
         _uncontended("postgresql", "sqllocker.asyncio")),
    Goal("MariaDB: asyncio cycles/s x the async raw floor's", True, 0.85, "x",
         _uncontended("mysql", "sqllocker.asyncio")),
    Goal("PostgreSQL: contended acquisitions/s x blocking `pg_advisory_lock`'s", True, 0.6, "x",
         _of_blocking("postgresql", "advisory lock", "acquisitions_per_s"), True),
    Goal("PostgreSQL: hand-off p50", False, 0.15, "ms",
         _contended("postgresql", "handoff_p50_ms"), True),
    Goal("MariaDB: hand-off p50", False, 0.99, "ms", _contended("mysql", "handoff_p50_ms"),
         True),
    Goal("MariaDB: wait p99 x blocking `GET_LOCK`'s", False, 3.0, "x",
         _of_blocking("mysql", "GET_LOCK", "wait_p99_ms"), True),
    *(
        Goal(f"{name}: contended acquisitions/s x the durable FIFO floor's", True, OF_THE_FLOOR,
             "x", _of_floor(backend))
        for backend, name in (("sqlite", "SQLite"), ("postgresql", "PostgreSQL"),
                              ("mysql", "MariaDB"))
    ),
]  # fmt: skip


def section(results: dict[str, Any]) -> list[str]:
    """The page's goals: each one's figure in this run, whether it is reached, and, for a
    contended goal the protocol bounds, the durable FIFO floor's own figure."""
    rows: Rows = {}
    for part in ("uncontended", "contended"):
        for row in results.get(part) or []:
            rows[part, f"{row['backend']}|{row['system']}"] = row
    cells = []
    for goal in GOALS:
        value = goal.figure(rows, "sqllocker")
        if value is None:
            continue  # not measured in this run (a backend left out, contended skipped)
        floor = _best_floor(goal, rows) if goal.bounded_by_floor else ""
        at = "at least" if goal.higher else "at most"
        cells.append(
            [
                goal.what,
                f"{at} {goal.target:g}{' ms' if goal.unit == 'ms' else 'x'}",
                _shown(value, goal.unit),
                floor,
                "yes" if goal.reached(value) else "**no**",
            ]
        )
    if not cells:
        return []
    return [
        "## Goals",
        "",
        "The speed goals, each judged by this run's figures below (a ratio: the median of the",
        "rounds' ratios). *The floor's*: where the library's own protocol bounds a contended",
        "goal or a hand-off, what its bare statements reach in the same run (the durable FIFO",
        "floor, under *Contended*, or a design tried, where it does better): a goal the floors",
        "miss too is out of the reach of the protocols they are. For SQLite's uncontended",
        "cycle, where the statements are the raw floor and the rest is Python, the *flat",
        "cycle* (under *Uncontended*): what a lock cycle must do around them, in one function",
        "each.",
        "",
        "| goal | target | this run | the floor's | reached |",
        "|---|---|---:|---:|---|",
        *(f"| {' | '.join(row)} |" for row in cells),
        "",
    ]


def _best_floor(goal: Goal, rows: Rows) -> str:
    """The best figure among the floors measured for ``goal``'s backend (the durable FIFO
    floor, and any design tried), named where it is not the durable FIFO floor's."""
    backend = next(b for b, name in BACKENDS.items() if goal.what.startswith(name + ":"))
    figures = [
        (value, floor)
        for floor in goal.floors or FLOORS[backend]
        if (value := goal.figure(rows, floor)) is not None
    ]
    if not figures:
        return ""
    value, floor = (max if goal.higher else min)(figures)
    return _shown(value, goal.unit) + ("" if floor == FIFO_FLOOR else f" ({floor})")


BACKENDS = {"sqlite": "SQLite", "postgresql": "PostgreSQL", "mysql": "MariaDB"}


def _shown(value: float, unit: str) -> str:
    return f"{value:.2f} ms" if unit == "ms" else f"{value:.2f}x"
