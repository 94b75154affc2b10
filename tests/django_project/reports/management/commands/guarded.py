"""``manage.py guarded``: the guard on Django's own connection. A write guarded while the lock is
held commits; once the lock has been broken, the guard raises LockLost and the write is rolled
back; a view locked, as a function or a class (by `method_decorator`), answers 409 while
the lock is held; guard outside transaction.atomic() is refused. Prints one line per outcome."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

from django.core.management.base import BaseCommand
from django.db import transaction
from django.test import Client

from sqllocker import LockError, LockLost
from sqllocker.django import get_locker, guard, lock
from tests.django_project.reports.models import Entry


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

        try:
            guard(lock("account 3"))
        except LockError as error:
            self.stdout.write(f"outside atomic: {type(error).__name__}")
