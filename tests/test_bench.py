"""The benchmark's contended figures, on turns made up to show each one (the README's tables
come from them, so a wrong count there would be a wrong claim there)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sqlalchemy as sa

from scripts import bench
from scripts.bench import Turn, turn_figures

HOLD, HANDOFF, STEP_BACK = 1.0, 0.05, 2.0


def round_robin(processes: int, turns: int) -> list[Turn]:
    """Processes taking turns in order, as a first-come-first-served lock serves them: each
    holds for HOLD, hands off in HANDOFF, steps back for STEP_BACK and asks again."""
    made: list[Turn] = []
    for k in range(turns):
        got = k * (HOLD + 2 * HANDOFF)
        left = got + HOLD
        released = left + HANDOFF
        previous = made[k - processes] if k >= processes else None
        asked = previous[3] + STEP_BACK if previous is not None else -HANDOFF  # all at once
        made.append((asked, got, left, released))
    return made


def as_collected(turns: list[Turn]) -> list[Turn]:
    """The turns out of the order they happened in, as the benchmark collects them (each
    process's own, one process after another)."""
    return sorted(turns, key=lambda turn: hash(turn) % 7)


def test_turns_served_in_order_are_passed_by_at_most_the_others_once() -> None:
    figures = turn_figures(as_collected(round_robin(4, 400)))
    assert figures["violations"] == 0
    assert figures["overtaken_max"] == 3
    # The first four, asked for at once, pass by 0, 1, 2 and 3; every later turn waits out one
    # other's (STEP_BACK is about two turns).
    assert figures["overtaken_counts"] == {0: 1, 1: 1 + 396, 2: 1, 3: 1}
    assert figures["handoff_p50_ms"] == pytest.approx(HANDOFF * 1000)


def test_a_starved_waiter_shows_how_many_got_in_ahead_of_it() -> None:
    turns = round_robin(3, 30)
    last_got = turns[-1][1]
    # A fourth process asked before all of them and got the lock only after all of them.
    starved: Turn = (-1.0, last_got + 5.0, last_got + 6.0, last_got + 6.1)
    figures = turn_figures(as_collected([*turns, starved]))
    assert figures["overtaken_max"] == 30
    assert figures["overtaken_counts"][30] == 1
    assert figures["violations"] == 0


def test_two_holders_at_once_are_counted() -> None:
    turns = round_robin(4, 20)
    asked, got, _, _ = turns[10]
    # Another process got the lock while turn 10 still held it, and gave it back before turn 11.
    turns.append((asked, got + HOLD / 2, got + HOLD * 3 / 4, got + HOLD * 3 / 4 + 0.01))
    assert turn_figures(as_collected(turns))["violations"] == 1
    assert turn_figures(as_collected(round_robin(4, 20)))["violations"] == 0


@pytest.mark.parametrize("backend", ["postgresql", "mysql"])
def test_commit_flush_times_real_commits_and_leaves_no_table(
    backend: str, request: pytest.FixtureRequest
) -> None:
    """The contended rows are read against this figure (README): it must time committed
    INSERTs on the server named, and clean up after itself."""
    url = str(request.getfixturevalue(f"{backend}_url"))
    figures = bench.commit_flush(backend, url, count=5)
    assert figures["backend"] == backend
    assert figures["commit_p50_ms"] > 0
    assert figures["round_trip_p50_ms"] > 0
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        assert not sa.inspect(conn).has_table(bench.FLUSH_TABLE)
    engine.dispose()


SETTINGS = ("commit_delay", "commit_siblings", "synchronous_commit")


def test_the_performance_page_is_what_the_benchmark_wrote() -> None:
    """docs/performance.md is written by bench.py from docs/bench.json, never by hand: a page
    that differs from its rendering was edited, or its run's JSON was not committed with it."""
    docs = Path(__file__).resolve().parents[1] / "docs"
    results = json.loads((docs / "bench.json").read_text())
    assert (docs / "performance.md").read_text() == bench.performance_page(results)


def test_a_run_that_skips_the_scale_rows_keeps_the_earlier_ones_with_their_date() -> None:
    earlier = {
        "measured_at": "2026-11-28 07:44 UTC",
        "commit": "ab221b8",
        "scale": [{"backend": "sqlite", "row": "1 process(es)", "value": 10.0, "detail": "x"}],
        "otel": [{"backend": "sqlite"}],
        "otel_measured_at": "2026-11-29 04:19 UTC",
    }
    now = {"measured_at": "2026-11-29 12:00 UTC", "commit": "1dba70c", "uncontended": []}
    kept = bench.carry_over(earlier, now, {"scale"})
    assert kept["scale"] == earlier["scale"]
    assert (kept["scale_measured_at"], kept["scale_commit"]) == ("2026-11-28 07:44 UTC", "ab221b8")
    assert kept["otel"] == earlier["otel"]
    assert kept["measured_at"] == "2026-11-29 12:00 UTC"
    # Measured again, the scale rows are this run's own.
    assert "scale" not in bench.carry_over(earlier, now, set())


@pytest.mark.slow  # processes taking turns for a second
def test_the_durable_fifo_floor_takes_turns_in_line_one_holder_at_a_time(
    backend: str, url: str
) -> None:
    """The floor's row runs sqllocker's contended protocol as bare statements in the
    contenders' harness, on the table its migrations make (and so does each design tried as
    a floor, MariaDB's doorbell): one holder at a time and, where waiters take tickets, in
    line."""
    systems = bench.floors().FLOORS[backend]
    assert bench.FIFO_FLOOR in systems
    rows = bench.contended([(backend, system, url) for system in systems], 3, seconds=0.5)
    for system, row in zip(systems, rows, strict=True):
        assert row["system"] == system
        assert row["violations"] == 0
        assert row["acquisitions_per_s"] > 20
        if backend != "sqlite":  # there the kernel wakes the waiters, in an order of its own
            # No one passed by each of the others more than twice (one may ask after a
            # waiter, yet draw its ticket first); a free-for-all passes a waiter by dozens.
            # A turn counts from before its first statement: a contender the loaded machine
            # stops before it draws its ticket is passed by every turn meanwhile, so a few
            # turns in a hundred may count more.
            counts = row["overtaken_counts"]
            beyond = sum(turns for others, turns in counts.items() if int(others) > 2 * 2)
            assert beyond <= 0.05 * sum(counts.values()), counts
    bench.drop_table(url, bench.TABLE)


def test_the_page_sets_sqllocker_against_its_floor_and_the_goals_the_floor_bounds() -> None:
    """A run with the floor's rows: they show in the contended table, with sqllocker's ratios
    to them, and, for the goals against a server's own lock, where the floor itself stands."""
    docs = Path(__file__).resolve().parents[1] / "docs"
    floors = (bench.FIFO_FLOOR, bench.DOORBELL_FLOOR)
    results = json.loads((docs / "bench.json").read_text())
    # The page's run, as if it had measured no floor and kept no round's figures.
    rows = [row for row in results["contended"] if row["system"] not in floors]
    for row in rows:
        row.pop("acquisitions_by_round", None)
    results["contended"] = rows
    without_floors = bench.performance_page(results)
    assert bench.FIFO_FLOOR == bench.floors().FIFO_FLOOR  # the rows' name, and the page's
    assert bench.DOORBELL_FLOOR == bench.floors().DOORBELL_FLOOR
    floor_rows = []
    for row in rows:
        if row["system"] == "sqllocker":
            floor = dict(row, system=bench.FIFO_FLOOR)
            floor["acquisitions_per_s"] = row["acquisitions_per_s"] * 1.25
            floor["wait_p99_ms"] = row["wait_p99_ms"] / 2
            floor_rows.append(floor)
            if row["backend"] == "postgresql":  # a run that kept its rounds' figures
                row["acquisitions_by_round"] = [400.0, 300.0, 500.0]
                floor["acquisitions_by_round"] = [500.0, 450.0, 640.0]
        elif row["system"] == "advisory lock":
            row["acquisitions_by_round"] = [800.0, 600.0, 1000.0]
    results["contended"] = rows + floor_rows
    page = bench.performance_page(results)
    assert page.count("| durable FIFO floor |") == 3
    # The median of the rounds' ratios, and their lowest and highest.
    assert "| PostgreSQL | 0.78 | 0.67-0.80 | 2.00 |" in page
    assert "| MariaDB | 0.80 |  | 2.00 |" in page
    # Against the goals, the rounds' ratios too (0.50 in each; the floor's 0.62, 0.75, 0.64),
    # and the floor's own figure beside a goal it bounds.
    goal = "PostgreSQL: contended acquisitions/s x blocking `pg_advisory_lock`'s"
    assert f"| {goal} | at least 0.6x | 0.50x | 0.64x | **no** |" in page
    assert "| MariaDB: wait p99 x blocking `GET_LOCK`'s | at most 3x | " in page
    assert (
        "| PostgreSQL: contended acquisitions/s x the durable FIFO floor's | at least 0.8x |"
        in page
    )
    # The page of a run without them is as before.
    assert "| durable FIFO floor |" not in without_floors


def test_the_flat_cycle_takes_real_rows_and_is_the_bound_of_sqlites_uncontended_goal(
    tmp_path: Path,
) -> None:
    """The flat cycle (a lock cycle's duties done in one function each) runs the library's
    statements on a Locker's connections and gives every row back; on the page it is the floor
    the SQLite uncontended goal is set against."""
    url = f"sqlite:///{tmp_path}/flat.db"
    bench.fresh_table(url)
    cycle, close = bench.flat_cycle(url)
    seen = sa.create_engine(url)
    try:
        for n in range(200):  # past a checkpoint, which the Locker's releases make
            cycle(n)
        with seen.connect() as conn:
            rows = conn.execute(sa.text(f"SELECT count(*) FROM {bench.TABLE}")).scalar()
        assert rows == 0
    finally:
        close()
        seen.dispose()
    assert bench.FLAT == bench.goals().FLAT
    docs = Path(__file__).resolve().parents[1] / "docs"
    results = json.loads((docs / "bench.json").read_text())
    mine = next(
        row
        for row in results["uncontended"]
        if (row["backend"], row["system"]) == ("sqlite", "sqllocker")
    )
    results["uncontended"].append(dict(mine, system=bench.FLAT, ratio_to_floor=0.9))
    page = bench.performance_page(results)
    assert "| 0.90x (flat cycle) | **no** |" in page
    assert "| SQLite (WAL) | flat cycle (a design tried) |" in page
