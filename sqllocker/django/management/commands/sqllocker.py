"""``manage.py sqllocker purge-expired|list|show|release ...``: the ``sqllocker`` command line,
on the lock table of the ``SQLLOCKER`` setting's database."""

from __future__ import annotations

import argparse
import io
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser, OutputWrapper

from sqllocker.cli import OutputClosed, answer
from sqllocker.django.configuration import database_alias, database_url, setting, table_name
from sqllocker.errors import LockError
from sqllocker.exit_statuses import EXIT_ERROR

SUBCOMMANDS = ("purge-expired", "list", "show", "release")


class Command(BaseCommand):
    help = (
        "sqllocker's command line on the lock table: purge-expired, list, show, release "
        "(their own --help says more)"
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("subcommand", choices=SUBCOMMANDS)
        parser.add_argument("arguments", nargs=argparse.REMAINDER)

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            url = database_url(database_alias()).render_as_string(hide_password=False)
            table, grace = table_name(), setting().get("grace")
        except LockError as error:  # the setting: one line and the command line's status
            raise CommandError(str(error), returncode=EXIT_ERROR) from None
        command = ["--url", url, "--table", table, options["subcommand"]]
        arguments = list(options["arguments"])
        given = any(word.partition("=")[0] == "--grace" for word in arguments)
        if options["subcommand"] == "purge-expired" and grace is not None and not given:
            # The grace the setting's Lockers take rows over after: purged no sooner.
            arguments = ["--grace", str(grace), *arguments]
        try:
            answer([*command, *arguments])
        except OutputClosed:
            # Django says a CommandError on stderr, which may be what was closed (its write
            # failing would exit 1, the negative answer): said nowhere, as the command line's.
            self.stderr = OutputWrapper(io.StringIO())
            raise CommandError("output closed (broken pipe)", returncode=EXIT_ERROR) from None
        except SystemExit as done:
            if done.code:
                raise CommandError(
                    f"sqllocker {options['subcommand']} failed", returncode=int(done.code)
                ) from None
