"""sqllocker in Django: ``pip install 'sqllocker[django]'`` and add ``"sqllocker.django"`` to
``INSTALLED_APPS``.

- ``SQLLOCKER = {"database": "default", "table": "semaphores", ...}`` in the settings: the
  Locker is built from that entry of ``DATABASES`` (PostgreSQL, MySQL/MariaDB, SQLite), with any
  other key passed to ``Locker`` (``expires``, ``grace``, ``strict``, ...); ``get_locker()``
  returns it (one per process).
- ``manage.py migrate`` creates the lock table with sqllocker's own migrations (the table
  ``sqllocker migrate`` makes), on that database only.
- ``manage.py sqllocker purge-expired|list|show|release ...`` is the ``sqllocker`` command line
  on that table.
- ``lock()`` and ``locked()`` take locks for views and management commands
  (``sqllocker.django.locking``); ``guard(lock)`` proves a lock is held inside
  ``transaction.atomic()`` on Django's own connection (``sqllocker.django.guarding``).
- ``TEST_RUNNER = "sqllocker.django.testing.DiscoverRunner"`` closes the Lockers before the
  test databases are dropped.

This module imports nothing of Django's itself, so that Django can import it while it loads
its apps; the functions import what they need when called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..lock import Lock
    from ..locker import Locker

__all__ = ["get_locker", "guard", "lock", "locked"]


def get_locker() -> Locker:
    """The Locker the ``SQLLOCKER`` setting describes (made on first use, once per process)."""
    from .configuration import get_locker as get

    return get()


def lock(lockstring: str, **options: Any) -> Lock:
    """``get_locker().lock(lockstring, **options)``: a context manager for views and commands."""
    return get_locker().lock(lockstring, **options)


def locked(lockstring: str, **options: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator for views, management commands' ``handle`` and any function: see
    ``sqllocker.django.locking.locked``."""
    from .locking import locked as decorator

    return decorator(lockstring, **options)


def guard(lock: Lock, using: str | None = None) -> None:
    """Prove ``lock`` is still held, inside ``transaction.atomic()`` on Django's connection
    ``using``: see ``sqllocker.django.guarding.guard``."""
    from .guarding import guard as prove

    prove(lock, using)
