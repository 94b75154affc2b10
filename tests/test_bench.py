"""The benchmark's contended figures, on turns made up to show each one (the README's tables
come from them, so a wrong count there would be a wrong claim there)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import sqlalchemy as sa

from scripts import bench
from scripts.async_layers import Layers
from scripts.bench import Turn, turn_figures
from scripts.flat_cycle import SYSTEMS, FlatCycles, rounds
from sqllocker import Locker
from sqllocker.asyncio import AsyncLocker

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


def test_the_flat_cycles_take_and_give_back_real_rows(tmp_path: Path) -> None:
    """scripts/flat_cycle.py reaches into the library's internals (its connection stack and
    Lock): a change to those must not leave it timing something else, or nothing."""
    url = f"sqlite:///{tmp_path}/flat.db"
    bench.fresh_table(url)
    locker = Locker(url, table=bench.TABLE)
    flat = FlatCycles(locker)
    seen: list[int] = []
    locker._table._stack._idle[-1].connection.set_trace_callback(
        lambda sql: seen.append(1) if sql.startswith(("INSERT", "DELETE")) else None
    )
    flat.flat(1)
    flat.flat_lock(1)
    assert len(seen) == 4  # an INSERT and a DELETE each
    assert locker.locks() == []
    took = rounds(url, 20, 2)
    assert set(took) == set(SYSTEMS)
    assert all(len(figures) == 2 and min(figures) > 0 for figures in took.values())
    assert locker.locks() == []
    locker.close()


def test_release_parts_times_real_grants_and_puts_the_trigger_back(
    postgresql_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """scripts/release_parts.py rewrites the release trigger (migration 0005's) into variants:
    a change to the trigger must make it stop with a message, not time something else."""
    import scripts.release_parts as release_parts

    monkeypatch.setattr(sys, "argv", ["release_parts.py", "--rounds", "1", "--url", postgresql_url])
    assert release_parts.main() == 0  # each grant is checked: it exits if none was made
    printed = capsys.readouterr().out
    assert [line.split("  ")[0] for line in printed.splitlines()] == list(
        release_parts.variants(release_parts.LIVENESS + release_parts.FLUSH)
    )
    engine = sa.create_engine(postgresql_url)
    with engine.connect() as conn:  # the scratch table and its functions are gone
        left = conn.exec_driver_sql(
            "SELECT count(*) FROM pg_proc WHERE proname LIKE 'release_parts%%'"
        ).scalar()
        assert left == 0
        assert not sa.inspect(conn).has_table(release_parts.TABLE)
    engine.dispose()


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


def test_slow_flush_slows_only_its_own_database(postgresql_url: str) -> None:
    """contended_turns.py --flush-delay-ms: the delay must reach the sessions the library opens
    there (with the library's own settings kept) and nothing outside its scratch database."""
    from scripts.contended_turns import slow_flush

    def settings(url: str) -> list[str]:
        locker = Locker(url, table=bench.TABLE)
        with locker.engine.connect() as conn:
            shown = [str(conn.exec_driver_sql(f"SHOW {name}").scalar()) for name in SETTINGS]
        locker.close()
        return shown

    outside = settings(postgresql_url)
    with slow_flush(postgresql_url, 2.5) as url:
        assert settings(url) == ["2500", "0", "on"]
        database = sa.make_url(url).database
    assert settings(postgresql_url) == outside
    engine = sa.create_engine(postgresql_url)
    with engine.connect() as conn:
        left = conn.exec_driver_sql(
            "SELECT count(*) FROM pg_database WHERE datname = %(name)s", {"name": database}
        ).scalar()
    engine.dispose()
    assert left == 0


async def test_each_async_layer_takes_and_gives_back_a_row(tmp_path: Path) -> None:
    """scripts/async_layers.py reaches into the library's internals (its engine, kept cursors
    and floor statements): a change to those must not leave it timing nothing."""
    url = f"sqlite:///{tmp_path}/layers.db"
    bench.fresh_table(url)
    locker = AsyncLocker(url, table=bench.TABLE)
    layers = Layers(locker)
    await layers.open()
    for n, (name, cycle) in enumerate(layers.cycles().items()):
        before = await locker.lock(f"before {n}")
        await before.unlock()
        await cycle(n)
        after = await locker.lock(f"after {n}")
        await after.unlock()
        assert after.lock_id == before.lock_id + 2, name  # the cycle's own row came between
    assert await locker.locks() == []
    await layers.close()
    await locker.aclose()
