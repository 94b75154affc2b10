"""The integrations are optional extras: importing sqllocker (its API, its command line, its
asyncio front end) never imports a framework, which need not even be installed; each
integration's module imports its own framework and no other."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

FRAMEWORKS = {
    "celery": "celery",
    "apscheduler": "apscheduler",
}


def imported_frameworks(*modules: str) -> set[str]:
    program = (
        "import json, sys\n"
        + "".join(f"import {module}\n" for module in modules)
        + f"print(json.dumps([m for m in {sorted(FRAMEWORKS.values())!r} if m in sys.modules]))\n"
    )
    output = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, check=True
    ).stdout
    return set(json.loads(output))


def test_importing_sqllocker_imports_no_framework() -> None:
    assert imported_frameworks("sqllocker", "sqllocker.cli", "sqllocker.asyncio") == set()


@pytest.mark.parametrize("integration", sorted(FRAMEWORKS))
def test_an_integration_imports_its_own_framework_only(integration: str) -> None:
    pytest.importorskip(FRAMEWORKS[integration])
    assert imported_frameworks(f"sqllocker.{integration}") == {FRAMEWORKS[integration]}
