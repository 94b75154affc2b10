"""A Django project for tests/test_django.py: the database is ``$SQLLOCKER_DJANGO_URL`` (one of
the test fixtures' SQLAlchemy URLs), the lock table ``$SQLLOCKER_DJANGO_TABLE``."""

from __future__ import annotations

import json
import os

import pymysql
from sqlalchemy.engine import make_url

# Django's MySQL backend wants mysqlclient; PyMySQL stands in for it (as its docs suggest).
pymysql.version_info = (2, 2, 1, "final", 0)
pymysql.install_as_MySQLdb()

_url = make_url(os.environ["SQLLOCKER_DJANGO_URL"])
_ENGINES = {
    "sqlite": "django.db.backends.sqlite3",
    "postgresql": "django.db.backends.postgresql",
    "mysql": "django.db.backends.mysql",
}

SECRET_KEY = "tests"
DEBUG = False
ALLOWED_HOSTS = ["testserver"]
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
ROOT_URLCONF = "tests.django_project.urls"
TEST_RUNNER = "sqllocker.django.testing.DiscoverRunner"
INSTALLED_APPS = ["sqllocker.django", "tests.django_project.reports"]
# tests/test_django.py adds the docs' example as an app of its own.
INSTALLED_APPS += [app for app in os.environ.get("SQLLOCKER_DJANGO_APPS", "").split(",") if app]
DATABASES = {
    "default": {
        "ENGINE": _ENGINES[_url.get_backend_name()],
        "NAME": _url.database,
        "USER": _url.username or "",
        "PASSWORD": _url.password or "",
        "HOST": _url.host or "",
        "PORT": str(_url.port or ""),
        # Django's SQLite test database is in memory unless named: locks need a file.
        "TEST": {"NAME": f"{_url.database}.test"} if _url.get_backend_name() == "sqlite" else {},
    }
}
SQLLOCKER = {
    "database": "default",
    "table": os.environ["SQLLOCKER_DJANGO_TABLE"],
    "grace": float(os.environ.get("SQLLOCKER_DJANGO_GRACE", "0")),
}
SQLLOCKER.update(json.loads(os.environ.get("SQLLOCKER_DJANGO_SETTING", "{}")))  # a test's
STATE = os.environ.get("SQLLOCKER_DJANGO_STATE", ".")
LOGGING = {
    "version": 1,
    "handlers": {"stderr": {"class": "logging.StreamHandler"}},
    "loggers": {"sqllocker.django": {"handlers": ["stderr"], "level": "INFO"}},
}
