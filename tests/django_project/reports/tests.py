"""Run by Django's own test runner (``manage.py test tests.django_project.reports``, from
tests/test_django.py): the test database gets the lock table from ``migrate``, and the Locker of
the SQLLOCKER setting works on it."""

from __future__ import annotations

import pytest
from django.db import transaction
from django.test import TestCase, TransactionTestCase

from sqllocker import LockError, LockLost
from sqllocker.django import get_locker, guard, lock
from tests.django_project.reports.models import Entry


class LockerTests(TestCase):
    def test_the_locker_is_on_the_test_database(self) -> None:
        from django.db import connection

        url = get_locker().url
        assert url.database is not None
        assert url.database.endswith(str(connection.settings_dict["NAME"]).rsplit("/", 1)[-1])
        with lock("report 2026-11-25") as held:
            assert get_locker().lock_info("report 2026-11-25") is not None
            # an atomic block nested in the test's own transaction: refused
            with transaction.atomic(), pytest.raises(LockError, match="outermost"):
                guard(held)

    def test_a_locked_view_runs_in_a_test_case(self) -> None:
        """The TestCase's own transaction (rolled back, never committed) is not the code's:
        ``@locked`` runs in it."""
        assert self.client.get("/reports/2026-11-30").status_code == 200


class GuardTests(TransactionTestCase):
    """Transactions that commit: guard() is for the outermost one."""

    def test_a_guarded_commit_and_a_broken_lock_rolled_back(self) -> None:
        with lock("account 8") as held, transaction.atomic():
            Entry.objects.create(text="guarded")
            guard(held)
        assert Entry.objects.filter(text="guarded").count() == 1
        broken = lock("account 9")
        get_locker().break_lock("account 9")
        try:
            with transaction.atomic():
                Entry.objects.create(text="after the break")
                guard(broken)
        except LockLost:
            pass
        else:
            raise AssertionError("guard() of a broken lock returned")
        assert Entry.objects.filter(text="after the break").count() == 0
