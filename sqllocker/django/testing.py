"""``TEST_RUNNER = "sqllocker.django.testing.DiscoverRunner"``: Django's test runner, which first
closes sqllocker's Lockers when it destroys the test databases. PostgreSQL refuses to drop a
database that a Locker's pooled connections are still connected to."""

from __future__ import annotations

from typing import Any

from django.test.runner import DiscoverRunner as DjangosRunner

from .configuration import close_lockers


class DiscoverRunner(DjangosRunner):
    def teardown_databases(self, old_config: Any, **kwargs: Any) -> None:
        close_lockers()
        super().teardown_databases(old_config, **kwargs)
