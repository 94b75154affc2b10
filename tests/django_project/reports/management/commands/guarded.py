"""``manage.py guarded``: the guard on Django's own connection. A write guarded while the lock is
held commits; once the lock has been broken, the guard raises LockLost and the write is rolled
back; a view locked, as a function or a class (by `method_decorator`), answers 409 while
the lock is held; guard outside transaction.atomic() is refused. Prints one line per outcome."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

from django.core.management.base import BaseCommand
from django.db import connection, transaction
from django.test import Client

from sqllocker import LockError, LockLost
from sqllocker.django import get_locker, guard, lock
from tests.django_project.reports.models import Entry


def _silence_limit() -> object:
    """The session's bound on a client's silence in a transaction (MySQL: any silence)."""
    if connection.vendor == "sqlite":
        return "none"  # nothing to bound: SQLite's transactions are the process's own
    if connection.vendor == "postgresql":
        variable = "current_setting('idle_in_transaction_session_timeout')"
    elif connection.mysql_is_mariadb:
        variable = "@@session.idle_transaction_timeout"
    else:
        variable = "@@session.wait_timeout"
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {variable}")
        return cursor.fetchone()[0]


class Command(BaseCommand):
    def handle(self, *args: Any, **options: Any) -> None:
        with lock("report x"):
            held = lock("account 1")
            breaker = threading.Thread(target=get_locker().break_lock, args=["account 1"])
            with transaction.atomic():
                Entry.objects.create(text="while held")
                guard(held)
                breaker.start()  # an operator breaking the lock meanwhile waits for the commit
                breaker.join(2)
                self.stdout.write(f"break waits: {breaker.is_alive()}")
            breaker.join()
            self.stdout.write(f"held: {Entry.objects.filter(text='while held').count()}")
            with contextlib.suppress(LockLost):
                held.unlock()
            for view in ("", "class/", "method/"):
                status = Client().get(f"/reports/{view}x").status_code
                self.stdout.write(f"conflict{view and ' ' + view[:-1]}: {status}")

        for view in ("", "class/", "method/"):
            status = Client().get(f"/reports/{view}x").status_code
            self.stdout.write(f"free{view and ' ' + view[:-1]}: {status}")

        broken = lock("account 2")
        get_locker().break_lock("account 2")
        try:
            with transaction.atomic():
                Entry.objects.create(text="after the break")
                guard(broken)
        except LockLost:
            self.stdout.write("refused: LockLost")
        self.stdout.write(f"after: {Entry.objects.filter(text='after the break').count()}")
        with contextlib.suppress(LockLost):
            broken.unlock()

        with lock("account 4", expires=60) as shorter, lock("account 5", expires=7200) as longer:
            before = _silence_limit()
            with transaction.atomic():
                guard(shorter)
                guard(longer)  # a longer limit: the session's own is still what comes back
                during = _silence_limit()
            self.stdout.write(f"silence bounded while guarded: {before != during != 0}")
            self.stdout.write(f"silence limit after the commit: {_silence_limit() == before}")
            with contextlib.suppress(RuntimeError), transaction.atomic():
                guard(shorter)
                raise RuntimeError("the guarded work failed: rolled back")
            Client().get("/reports/class/y")  # a request ends: the bound is given back
            restored = _silence_limit() == before
            self.stdout.write(f"silence limit after a rollback and a request: {restored}")

        try:
            guard(lock("account 3"))
        except LockError as error:
            self.stdout.write(f"outside atomic: {type(error).__name__}")
