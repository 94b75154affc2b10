"""The integrations are optional extras: importing sqllocker (its API, its command line, its
asyncio front end) never imports a framework, which need not even be installed; each
integration's module imports its own framework and what that brings along, no other."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# Each integration's module that uses its framework; that framework, and the framework's part
# the module uses (which can bring others along: Celery's Task looks for Django).
FRAMEWORKS = {
    "sqllocker.celery": ("celery", "from celery import Task"),
    "sqllocker.apscheduler": ("apscheduler", "import apscheduler.executors.pool"),
    "sqllocker.django.configuration": ("django", "import django.db"),
}
NAMES = sorted(framework for framework, _ in FRAMEWORKS.values())


def imported_frameworks(*statements: str) -> set[str]:
    program = (
        "import json, sys\n"
        + "".join(f"{statement}\n" for statement in statements)
        + f"print(json.dumps([m for m in {NAMES!r} if m in sys.modules]))\n"
    )
    output = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, check=True
    ).stdout
    return set(json.loads(output))


def test_importing_sqllocker_imports_no_framework() -> None:
    modules = ("sqllocker", "sqllocker.cli", "sqllocker.asyncio", "sqllocker.django")
    assert imported_frameworks(*(f"import {module}" for module in modules)) == set()


@pytest.mark.parametrize("integration", sorted(FRAMEWORKS))
def test_an_integration_imports_its_own_framework_only(integration: str) -> None:
    framework, its_part = FRAMEWORKS[integration]
    pytest.importorskip(framework)
    expected = imported_frameworks(its_part) | {framework}
    assert imported_frameworks(f"import {integration}") == expected
