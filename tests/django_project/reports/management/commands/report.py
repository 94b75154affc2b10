"""``manage.py report DAY SECONDS``: holds "report DAY" for SECONDS, with an O_EXCL marker file
in the state directory (a second holder at once records an overlap)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandParser

from sqllocker.django import locked


class Command(BaseCommand):
    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("day")
        parser.add_argument("seconds", type=float)

    @locked("report {options[day]}")
    def handle(self, *args: Any, **options: Any) -> None:
        state = Path(settings.STATE)
        marker = state / f"report {options['day']}.holder"
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            (state / "overlaps").touch()
        with (state / "runs").open("a") as runs:
            runs.write(f"{os.getpid()}\n")
        time.sleep(options["seconds"])
        marker.unlink()
