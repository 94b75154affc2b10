"""The Django app: ``INSTALLED_APPS = [..., "sqllocker.django"]``."""

from __future__ import annotations

from django.apps import AppConfig


class SqllockerConfig(AppConfig):
    name = "sqllocker.django"
    label = "sqllocker"
    verbose_name = "sqllocker"

    def ready(self) -> None:
        from django.core.signals import request_finished

        from .guarding import restore_silence_limits

        request_finished.connect(restore_silence_limits, dispatch_uid="sqllocker-silence")
