"""What a process that forks many sqllocker processes imports before it forks: each backend's
module, SQLAlchemy dialects and drivers (sync and asyncio).

The library imports a backend and its driver when a URL first names it, so a child forked from
a process that imported only ``sqllocker`` would import them itself: about a tenth of a second
of CPU each time (psycopg's the most), paid by every command and worker the suite forks.
"""

from __future__ import annotations

from sqlalchemy.engine import make_url

from sqllocker.backends import backend_class
from sqllocker.engine import resolve_url

BACKENDS = ("sqlite", "postgresql", "mysql")  # every backend the suite tests


def backends(*names: str) -> None:
    """Import the backends ``names`` (all three by default): sqllocker's module of each, and
    its SQLAlchemy dialect and driver, sync and asyncio. Nothing is connected."""
    for name in names or BACKENDS:
        backend_class(name)
        for asynchronous in (False, True):
            url = make_url(resolve_url(f"{name}://", asynchronous=asynchronous))
            url.get_dialect().import_dbapi()
