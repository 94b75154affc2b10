"""The integrations are optional extras: importing sqllocker (its API, its command line, its
asyncio front end) never imports a framework, which need not even be installed."""

from __future__ import annotations

import json
import subprocess
import sys

FRAMEWORKS = ["celery", "kombu", "apscheduler", "django", "fastapi", "starlette"]


def test_importing_sqllocker_imports_no_framework() -> None:
    program = (
        "import json, sys\n"
        "import sqllocker, sqllocker.cli, sqllocker.asyncio\n"
        f"print(json.dumps([m for m in {FRAMEWORKS!r} if m in sys.modules]))\n"
    )
    output = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, check=True
    ).stdout
    assert json.loads(output) == []


def test_each_integration_imports_its_framework_only_when_imported() -> None:
    program = (
        "import json, sys\n"
        "import sqllocker.celery\n"
        f"print(json.dumps([m for m in {FRAMEWORKS!r} if m in sys.modules]))\n"
    )
    output = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, check=True
    ).stdout
    assert "celery" in json.loads(output)
