"""The Django app: ``INSTALLED_APPS = [..., "sqllocker.django"]``."""

from __future__ import annotations

from django.apps import AppConfig


class SqllockerConfig(AppConfig):
    name = "sqllocker.django"
    label = "sqllocker"
    verbose_name = "sqllocker"

    def ready(self) -> None:
        from django.core.signals import request_finished

        request_finished.connect(restore_silence_limits, dispatch_uid="sqllocker-silence")


def restore_silence_limits(**_: object) -> None:
    """At the end of a request: a guard's bound on a session whose guarded transaction rolled
    back is given back (``guarding.restore_silence_limit``)."""
    from django.db import connections

    from .guarding import restore_silence_limit

    for connection in connections.all(initialized_only=True):
        restore_silence_limit(connection)
