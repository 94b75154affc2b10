"""The fault campaign (``tests/campaign``) in the suite: a short campaign on each backend, and
campaigns against libraries broken on purpose, which the checker must catch.

The short campaigns run a fixed seed per backend, and one fresh seed (drawn when the test runs,
so that both xdist workers collect the same tests, and printed with its report) on a backend it
picks; a failure prints the campaign's report, whose windows of
history show each violation, and ``python -m tests.campaign --backend B --seed N`` replays its
schedule. Each campaign is forked from a server that imported it once (``tests/forked_cli.py``).
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from tests import forked_cli
from tests.campaign.checker import EARLY_CHECKS
from tests.campaign.found import FOUND, Found
from tests.conftest import BACKENDS, IN_CI
from tests.private_servers import private_servers_missing

pytestmark = pytest.mark.slow  # real workers, schedulers or processes

ROOT = Path(__file__).resolve().parents[1]
SECONDS = 6
FIXED_SEEDS = {"sqlite": 101, "postgresql": 202, "mysql": 303}
SUMMARY = re.compile(
    r"^campaign: (\w+) seed (\d+): (\d+) operations, (\d+) faults, (\d+) violations$"
)


def campaign(backend: str, seed: int, *options: str, seconds: float = SECONDS) -> tuple[int, str]:
    argv = ["--backend", backend, "--seed", str(seed), "--seconds", str(seconds), *options]
    done = forked_cli.run(argv, cwd=ROOT, timeout=600, program="campaign")
    return done.returncode, done.stdout + done.stderr[-3000:]


def summary(output: str) -> re.Match[str]:
    lines = [line for line in output.splitlines() if line.startswith("campaign: ")]
    found = SUMMARY.match(lines[-1]) if lines else None
    assert found is not None, output
    return found


@pytest.mark.parametrize(
    ("backend", "seed"),
    [*FIXED_SEEDS.items(), ("fresh", None)],
    ids=[*(f"{b}-seed{s}" for b, s in FIXED_SEEDS.items()), "fresh-seed"],
)
def test_a_short_campaign_finds_no_violation(
    backend: str, seed: int | None, request: pytest.FixtureRequest
) -> None:
    if seed is None:
        seed = random.SystemRandom().randrange(1, 10**6)
        backend = BACKENDS[seed % len(BACKENDS)]
        request.node.user_properties.append(("campaign seed", seed))
    if backend != "sqlite":
        request.getfixturevalue(f"{backend}_url")  # skips (or fails under CI) if unreachable
    print(f"campaign: {backend} seed {seed}")
    status, output = campaign(backend, seed)
    found = summary(output)
    assert found.group(1, 2) == (backend, str(seed))
    assert int(found.group(3)) > 0, output  # operations
    assert int(found.group(4)) > 0, output  # faults
    assert (status, found.group(5)) == (0, "0"), output


# Restarts of a private server (fast and immediate), among pauses, kills and cut connections.
RESTARTS = "--private-server --faults=restart,pause,cut,kill --fault-gap=0.5,1.5"
RESTART_SEEDS = {"postgresql": 124, "mysql": 66}  # the first restart immediate; fast


@pytest.mark.parametrize("backend", sorted(RESTART_SEEDS))
def test_a_campaign_with_server_restarts_finds_no_violation(backend: str) -> None:
    missing = private_servers_missing()
    if missing is not None:
        if IN_CI:
            pytest.fail(missing)
        pytest.skip(missing)
    seed = RESTART_SEEDS[backend]
    status, output = campaign(backend, seed, *RESTARTS.split(), seconds=6)
    found = summary(output)
    assert re.search(r"^faults: .*restart [1-9]", output, re.MULTILINE), output
    assert (status, found.group(5)) == (0, "0"), output


# Holders that dawdle past their expiry, or are stopped past it, and others taking over.
STALE_HOLDERS = (
    "--operations=dawdle,lock_wait,lock_nowait --faults=pause --fault-gap=0.3,1 --workers=6"
)
# Each mutant with the operations and faults that give it its chance, and what must catch it.
MUTANTS = {
    "release-skips-guid": (STALE_HOLDERS, {"stale-holder", "exclusion"}),
    "renewal-revives": (STALE_HOLDERS, {"stale-holder", "exclusion"}),
    "run-never-stops": (
        "--operations=run_command --faults=break --fault-gap=0.3,0.8 --workers=6",
        {"run-exclusion"},
    ),
    "semaphore-limit-plus-one": ("--operations=semaphore --faults=purge", {"semaphore"}),
    # Seen in the liveness phase, after 3 s of faults: rows outliving their release.
    "release-keeps-row": ("--faults=purge --workers=2", {"held-by-nobody"}),
}
SECONDS_OF_MUTANTS = {"release-keeps-row": 3}


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_the_checker_catches_a_broken_library(mutant: str) -> None:
    options, catchers = MUTANTS[mutant]
    seconds = SECONDS_OF_MUTANTS.get(mutant, 20)
    # The faults end once the history so far shows what must catch the mutant (the 20 s are
    # its chance to appear); the verdict is still the full check's, at the end.
    early = sorted(catchers & set(EARLY_CHECKS))
    stop_on = [f"--stop-on={','.join(early)}"] if early else []
    status, output = campaign(
        "sqlite", 7, "--mutant", mutant, *options.split(), *stop_on, seconds=seconds
    )
    caught = set(re.findall(r"^VIOLATION \d+ \[([\w-]+)\]", output, re.MULTILINE))
    assert status == 1, output
    assert int(summary(output).group(5)) > 0, output
    assert caught & catchers, output
    # Each violation shown comes with its window of history.
    assert re.search(r"^VIOLATION .*\n  +\d", output, re.MULTILINE), output


@pytest.mark.parametrize("found", FOUND, ids=[f"{f.backend}-seed{f.seed}" for f in FOUND])
def test_a_campaign_that_found_a_bug_finds_none(found: Found) -> None:
    status, output = campaign(
        found.backend, found.seed, *found.options.split(), seconds=found.seconds
    )
    assert status == 0, f"{found.showed}\n{output}"


def _family(lock_id: int, start: float, end: float) -> list[dict[str, object]]:
    return [
        {"t": t, "type": "cmd", "phase": phase, "ls": "r0", "id": lock_id, "child": False}
        for t, phase in ((start, "start"), (end, "stop"))
    ]


@pytest.mark.parametrize(
    ("second_starts", "first_stops", "violations"),
    [(10.1, 10.3, 0), (9.5, 10.3, 1), (10.1, 20.0, 1)],
    ids=["after the break, stopped soon", "before the break", "never stopped"],
)
def test_a_run_whose_claim_was_broken_may_overlap_the_next_only_as_it_stops(
    second_starts: float, first_stops: float, violations: int
) -> None:
    """A plain run holds two rows (the write side, sqllocker.rwlocks): an operator breaks the
    claim, named by the lockstring, whose id is not the family's token. The break still
    excuses the overlap it causes, and only that: a second family that started before the
    break, or a first that runs on past the allowance, is a violation."""
    from collections import Counter

    from tests.campaign import checker, plan

    broken = {"t": 10.0, "type": "fault", "kind": "break", "ls": "r0", "id": 6}
    events = [*_family(7, 5.0, first_stops), broken, *_family(9, second_starts, 12.0)]
    settings = plan.Settings(backend="sqlite", seconds=20, seed=1)
    found = checker._run_families(events, settings, Counter(), 0.0)
    assert len(found) == violations, found


OPERATOR_ENDS = [
    ("release_force", {"status": 0, "stderr": "sqllocker: broke lock 'r0' (id 6) held by h:1"}, 0),
    ("release_force", {"status": 1, "stderr": "sqllocker: lock 'r0' with id 6 is not held"}, 0),
    ("release_force", {"status": 1, "stderr": "sqllocker: error: connection refused"}, 0),
    ("purge", {"status": 0, "stderr": ""}, 0),
    ("purge", {"status": 1, "stderr": "sqllocker: error: server closed the connection"}, 0),
    ("purge", {"status": 1, "stderr": "sqllocker: lock 'r0' is not held"}, 1),
    ("purge", {"status": 2, "stderr": "Usage: sqllocker purge-expired\nError: No such option"}, 1),
    (
        "release_force",
        {
            "status": 1,
            "stderr": "Traceback (most recent call last):\n...\nsqllocker: error: x",
            "traceback": True,
        },
        1,
    ),
    ("release_force", {"status": -9, "stderr": ""}, 1),
    ("purge", {"status": -9, "stderr": "", "timed_out": 300.0}, 1),
    ("purge", {"error": "OSError('the fork server could not start sqllocker')"}, 1),
    ("purge", None, 1),
]


@pytest.mark.parametrize(("kind", "end", "violations"), OPERATOR_ENDS)
def test_an_operator_command_must_end_as_the_command_line_says_it_may(
    kind: str, end: dict[str, object] | None, violations: int
) -> None:
    """Exit 0, or 1 with sqllocker's one line (its LockError; for release, the lock not held):
    anything else, or no end at all, is a violation naming the command, status and stderr."""
    from collections import Counter

    from tests.campaign import checker

    command = f"sqllocker {kind}"
    events: list[dict[str, object]] = [
        {"t": 1.0, "pid": 9, "type": "fault", "kind": kind, "command": command, "operator": 1}
    ]
    if end is not None:
        events.append({"t": 2.0, "pid": 9, "type": "fault_end", "kind": kind, "operator": 1, **end})
    checks: Counter[str] = Counter()
    found = checker._operators(events, checks, 0.0)
    assert checks["operators: commands"] == 1
    assert len(found) == violations, found
    for violation in found:
        assert violation.check == "operators"
        assert f"`{command}`" in violation.message
        if end is not None and "status" in end:
            assert f"status {end['status']}" in violation.message
