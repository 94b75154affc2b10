"""What a campaign prints: the seed, what the seed fixed, the counts (operations, faults by kind,
checks), each violation with the shortest window of the history that shows it, and last the
one-line summary."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from typing import Any

from tests.campaign import plan
from tests.campaign.checker import Verdict, Violation
from tests.campaign.history import Event
from tests.campaign.nemesis import OPERATOR_COMMANDS, schedule
from tests.campaign.sections import next_operation

WINDOW_LINES = 60
SLOW_OPERATOR = 45.0  # seconds: an operator's command that took longer is noted
SHOWN_PER_CHECK = 3  # violations shown with their window, per check; the rest are counted


def plan_fingerprint(settings: plan.Settings) -> str:
    """A digest of what the seed fixed (the nemesis's schedule, the first operations of each
    worker): equal on every run of one seed and settings."""
    digest = hashlib.sha256(json.dumps([f.__dict__ for f in schedule(settings)]).encode())
    for number in range(settings.workers):
        operations = list(settings.operations_for(settings.worker_is_async(number)))
        for step in range(1, 51) if operations else ():
            rng = plan.operation_rng(settings.seed, number, 0, step)
            digest.update(next_operation(rng, operations).encode())
    return digest.hexdigest()[:12]


def operations(events: list[Event]) -> int:
    return sum(1 for event in events if event["type"] == "invoke")


def faults(events: list[Event]) -> Counter[str]:
    return Counter(event["kind"] for event in events if event["type"] == "fault")


def operator_ends(events: list[Event]) -> Counter[str]:
    """How the operators' commands ended: by kind and exit status (``killed`` after the
    timeout, ``unrun`` if none was started)."""
    ends: Counter[str] = Counter()
    for event in events:
        if event["type"] == "fault_end" and "operator" in event:
            if "error" in event:
                how = "unrun"
            elif event.get("timed_out"):
                how = "killed"
            else:
                how = f"exit {event.get('status')}"
            ends[f"{event['kind']} {how}"] += 1
    return ends


def summary(settings: plan.Settings, events: list[Event], violations: int) -> str:
    return (
        f"campaign: {settings.backend} seed {settings.seed}: {operations(events)} operations, "
        f"{sum(faults(events).values())} faults, {violations} violations"
    )


def render(settings: plan.Settings, events: list[Event], verdict: Verdict, began: float) -> str:
    lines = [
        f"seed {settings.seed}, backend {settings.backend}, {settings.seconds:g}s of faults, "
        f"{settings.workers} workers (half asyncio), expires {settings.expires:g}s, grace "
        f"{settings.grace:g}s"
        + (", on a private server" if settings.private_server else "")
        + (f", MUTANT {settings.mutant}" if settings.mutant else ""),
        f"plan {plan_fingerprint(settings)}: fixed by the seed (the nemesis's schedule, each "
        "worker's operations and timings); not fixed: the interleavings, so which target each "
        "fault finds, how many operations fit, and their outcomes (the counts below)",
        "operations: "
        + ", ".join(f"{op} {n}" for op, n in sorted(_operations_by_kind(events).items())),
        "outcomes: " + ", ".join(f"{kind} {n}" for kind, n in sorted(_outcomes(events).items())),
        "faults: " + (", ".join(f"{k} {n}" for k, n in sorted(faults(events).items())) or "none"),
        "operator commands: "
        + (", ".join(f"{k}: {n}" for k, n in sorted(operator_ends(events).items())) or "none"),
        "checks: " + ", ".join(f"{k} {n}" for k, n in sorted(verdict.checks.items())),
    ]
    slow = [
        event
        for event in events
        if event["type"] == "fault_end"
        and event.get("seconds", 0) > SLOW_OPERATOR
        and event.get("kind") in {"break", *OPERATOR_COMMANDS}
    ]
    for event in slow:
        if "error" in event:
            outcome = event["error"]
        elif "status" in event:
            outcome = f"exit status {event['status']}; stderr: {event.get('stderr') or '(empty)'}"
        else:
            outcome = f"broken: {event.get('broken')}"
        outcome = outcome.replace("\n", " | ")
        of = f" of lock id {event['id']}" if "id" in event else ""
        lines.append(
            f"note: the operator's {event['kind']}{of} took {event['seconds']:.1f}s ({outcome})"
        )
    shown: Counter[str] = Counter()
    for number, violation in enumerate(verdict.violations, 1):
        shown[violation.check] += 1
        if shown[violation.check] > SHOWN_PER_CHECK:
            continue
        lines.append(f"VIOLATION {number} [{violation.check}]: {violation.message}")
        lines += ["  " + line for line in window(events, violation, began)]
    hidden = {check: n - SHOWN_PER_CHECK for check, n in shown.items() if n > SHOWN_PER_CHECK}
    if hidden:
        lines.append(
            "not shown: " + ", ".join(f"{n} more [{check}]" for check, n in sorted(hidden.items()))
        )
    lines.append(
        "violations: "
        + (", ".join(f"[{check}] {n}" for check, n in sorted(shown.items())) or "none")
    )
    return "\n".join(lines)


def _operations_by_kind(events: list[Event]) -> Counter[str]:
    return Counter(event["op"] for event in events if event["type"] == "invoke")


def _outcomes(events: list[Event]) -> Counter[str]:
    return Counter(event["type"] for event in events if event["type"] in {"ok", "fail", "info"})


def _concerns(event: Event, violation: Violation) -> bool:
    if event["type"] in {"fault", "fault_end", "faults_undone", "faults_stop"}:
        return True
    lockstrings = event.get("ls")
    lockstrings = lockstrings if isinstance(lockstrings, list) else [lockstrings]
    ids = event.get("ids") or [event.get("id")]
    return (
        bool(violation.ids.intersection(ids))
        or bool(violation.pids and event["pid"] in violation.pids)
        or (not violation.ids and bool(violation.lockstrings.intersection(lockstrings)))
    )


def window(events: list[Event], violation: Violation, began: float) -> list[str]:
    """The history from ``violation.start`` to ``end``, only what concerns it (its lockstrings'
    or ids' events, its processes', the faults); the middle elided past WINDOW_LINES."""
    chosen = [
        event
        for event in events
        if violation.start - 0.001 <= event["t"] <= violation.end + 0.001
        and _concerns(event, violation)
        and not (event["type"] == "cmd" and event.get("phase") == "tick")
    ]
    lines = [_line(event, began) for event in chosen]
    if len(lines) > WINDOW_LINES:
        half = WINDOW_LINES // 2
        lines = [*lines[:half], f"... {len(lines) - 2 * half} events ...", *lines[-half:]]
    return lines


def _line(event: Event, began: float) -> str:
    rest: dict[str, Any] = {k: v for k, v in event.items() if k not in {"t", "w", "pid", "type"}}
    fields = " ".join(f"{k}={v}".replace("\n", " | ") for k, v in rest.items())
    return (
        f"{event['t'] - began:9.3f} {event['w']:>8} {event['pid']:>7} {event['type']:<10} {fields}"
    )
