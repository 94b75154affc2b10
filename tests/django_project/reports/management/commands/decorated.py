"""``manage.py decorated``: ``locked`` refuses what it cannot protect. Inside a transaction
(``atomic()``, a view under ATOMIC_REQUESTS) its lock would be released before the commit,
and the next holder would not see the writes; a coroutine function would run unlocked, after
the release, as would a generator's, an async view's under ``method_decorator`` and a
streaming response's content; bad options fail when the function is decorated, not on each
call. Prints one line per outcome."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from django.core.management.base import BaseCommand
from django.db import DEFAULT_DB_ALIAS, connection, connections, transaction
from django.test import Client

from sqllocker import LockError
from sqllocker.django import get_locker, locked
from tests.django_project.reports.views import AsyncReportView


@locked("counter")
def count() -> str:
    return "ran"


async def coroutine_view() -> None:
    """Never run."""


def generator_view() -> Iterator[None]:
    """Never run."""
    yield None


def _in_a_new_thread() -> str:
    """``count()`` in a thread whose connection is not made yet, with autocommit turned off in
    the settings: its first statement would begin a transaction left open past the release."""
    said: list[str] = []

    def call() -> None:
        try:
            said.append(count())
        except LockError as error:
            said.append(type(error).__name__)
        finally:
            connection.close()

    connections.settings[DEFAULT_DB_ALIAS]["AUTOCOMMIT"] = False
    try:
        thread = threading.Thread(target=call)
        thread.start()
        thread.join()
    finally:
        connections.settings[DEFAULT_DB_ALIAS]["AUTOCOMMIT"] = True
    return said[0]


class Command(BaseCommand):
    def handle(self, *args: Any, **options: Any) -> None:
        self.stdout.write(f"outside a transaction: {count()}")
        try:
            with transaction.atomic():
                count()
        except LockError as error:
            self.stdout.write(f"inside atomic: {type(error).__name__}")
        transaction.set_autocommit(False)
        try:
            count()
        except LockError as error:
            self.stdout.write(f"autocommit off: {type(error).__name__}")
        finally:
            transaction.rollback()
            transaction.set_autocommit(True)
        self.stdout.write(f"autocommit off in the settings, a new thread: {_in_a_new_thread()}")
        connection.settings_dict["ATOMIC_REQUESTS"] = True
        try:
            try:
                Client().get("/reports/x")
            except LockError as error:
                self.stdout.write(f"under ATOMIC_REQUESTS: {type(error).__name__}")
            status = Client().get("/reports/non-atomic/x").status_code
            self.stdout.write(f"non_atomic_requests: {status}")
        finally:
            connection.settings_dict["ATOMIC_REQUESTS"] = False
        try:
            locked("coroutine")(coroutine_view)
        except LockError as error:
            self.stdout.write(f"coroutine function: {type(error).__name__}")
        try:
            locked("async view")(AsyncReportView.as_view())
        except LockError as error:
            self.stdout.write(f"async view's as_view(): {type(error).__name__}")
        try:
            locked("generator")(generator_view)
        except LockError as error:
            self.stdout.write(f"generator function: {type(error).__name__}")
        self.stdout.write(Client().get("/reports/rendered/x").content.decode())
        finished = Client().get("/reports/framework/x")
        self.stdout.write(f"finished by its framework: {finished.status_code}")
        for kind in ("async", "streamed"):
            try:
                Client().get(f"/reports/{kind}/x")
            except LockError as error:
                self.stdout.write(f"{kind} response: {type(error).__name__}")
            self.stdout.write(f"{kind} response: rows left {len(get_locker().locks())}")
        for option in ({"wait": -1}, {"expires": 0}, {"hold_at_least": -5}):
            try:
                locked("options", **option)
            except LockError as error:
                self.stdout.write(f"{option}: {type(error).__name__}")
