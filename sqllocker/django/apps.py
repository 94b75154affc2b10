"""The Django app: ``INSTALLED_APPS = [..., "sqllocker.django"]``."""

from __future__ import annotations

from django.apps import AppConfig


class SqllockerConfig(AppConfig):
    name = "sqllocker.django"
    label = "sqllocker"
    verbose_name = "sqllocker"
