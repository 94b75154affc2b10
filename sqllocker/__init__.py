"""sqllocker: distributed locks kept as rows in an SQL table.

    from sqllocker import Locker

    locker = Locker("postgresql://db/app")
    with locker.lock("digest 42", expires=60):
        ...

See README.md for the table, the guarantees, and what happens when a lock expires.
"""

from .election import Election, Leadership
from .elections import Leader
from .errors import (
    DatabaseError,
    ForeignTable,
    LockBusy,
    LockError,
    LockLost,
    LockTypeError,
    LockValueError,
    TableMissing,
    UnsafeDatabase,
    UnsafeDatabaseWarning,
)
from .group import LockGroup
from .lock import Lock
from .locker import Locker
from .operations import LockInfo
from .rwlock import RWLock
from .schema import lock_table
from .semaphore import Semaphore
from .version import __version__

__all__ = [
    "DatabaseError",
    "Election",
    "ForeignTable",
    "Leader",
    "Leadership",
    "Lock",
    "LockBusy",
    "LockError",
    "LockGroup",
    "LockInfo",
    "LockLost",
    "LockTypeError",
    "LockValueError",
    "Locker",
    "RWLock",
    "Semaphore",
    "TableMissing",
    "UnsafeDatabase",
    "UnsafeDatabaseWarning",
    "__version__",
    "lock_table",
]
