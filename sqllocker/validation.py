"""Checks on every caller-supplied value, run before any SQL is sent.

The three backends disagree about bad input (SQLite stores 1,000 characters in a VARCHAR(128) and
keeps NUL bytes; MariaDB's ``INSERT IGNORE`` truncates; psycopg refuses NUL before sending), so
sqllocker decides here, identically for all of them, and a refused call writes nothing anywhere.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

from .errors import LockTypeError, LockValueError
from .reserved_words import RESERVED_WORDS

MAX_LOCKSTRING_LENGTH = 128
# Longer expiries than ten years are almost certainly unit mistakes (milliseconds passed as
# seconds) and would overflow some backends' timestamp ranges.
MAX_SECONDS = 10 * 365 * 24 * 3600
# Table names are embedded in derived identifiers (index, view, alembic version table), and the
# longest of those must stay under MySQL's 64-character identifier limit.
MAX_TABLE_NAME_LENGTH = 32
RESERVED_LOCKED_BY_KEYS = frozenset(
    {"guid", "host", "pid", "thread", "task", "program", "user", "finished"}
)
# A caller's locked_by details, as JSON: enough for a job's description, not a way to store data
# in every lock row (or to fill an operator's screen).
MAX_LOCKED_BY_BYTES = 8192
# A renewal later than this fraction of the expiry period could come after the lock's validity
# deadline, whose safety margin is at most a tenth of the period.
MAX_KEEP_ALIVE_FRACTION = 0.9

# Lower case only: an unquoted identifier folds to lower case on PostgreSQL and keeps its case on
# MySQL, so a mixed-case name would name two different tables.
_TABLE_NAME = re.compile(r"[a-z_][a-z0-9_]*")


def check_lockstring(lockstring: object) -> str:
    if not isinstance(lockstring, str):
        raise LockTypeError(f"a lockstring must be a str, not {type(lockstring).__name__}")
    if not lockstring:
        raise LockValueError("a lockstring must not be empty", lockstring)
    if len(lockstring) > MAX_LOCKSTRING_LENGTH:
        raise LockValueError(
            f"a lockstring is at most {MAX_LOCKSTRING_LENGTH} characters; "
            f"this one has {len(lockstring)}: {lockstring[:40]!r}...",
            lockstring,
        )
    if "\x00" in lockstring:
        raise LockValueError(f"a lockstring must not contain NUL: {lockstring!r}", lockstring)
    try:
        lockstring.encode("utf-8")
    except UnicodeEncodeError as error:
        raise LockValueError(
            f"a lockstring must be encodable as UTF-8 (it has a lone surrogate?): {lockstring!r}",
            lockstring,
        ) from error
    return lockstring


def check_seconds(value: object, name: str, lockstring: str | None = None) -> float:
    """A positive, finite number of seconds (expires, extend's ttl, grace excepted)."""
    number = _number(value, name, lockstring)
    if not math.isfinite(number) or number <= 0:
        raise LockValueError(
            f"{name} must be a positive, finite number of seconds, not {value!r}", lockstring
        )
    if number > MAX_SECONDS:
        raise LockValueError(
            f"{name} must be at most {MAX_SECONDS} seconds (ten years), not {value!r}", lockstring
        )
    return number


def check_wait(value: object, lockstring: str | None = None) -> float | None:
    """``None`` or infinity means wait forever; otherwise a finite number of seconds >= 0."""
    if value is None:
        return None
    number = _number(value, "wait", lockstring)
    if math.isnan(number) or number < 0:
        raise LockValueError(
            f"wait must be None (forever) or a number of seconds >= 0, not {value!r}", lockstring
        )
    return None if math.isinf(number) else number


def check_seconds_or_zero(value: object, name: str, lockstring: str | None = None) -> float:
    """A finite number of seconds >= 0 (grace, an interval)."""
    number = _number(value, name, lockstring)
    if not math.isfinite(number) or number < 0 or number > MAX_SECONDS:
        raise LockValueError(
            f"{name} must be a finite number of seconds >= 0, not {value!r}", lockstring
        )
    return number


def check_grace(value: object) -> float:
    return check_seconds_or_zero(value, "grace")


def check_table_name(name: object) -> str:
    """A table name that every backend reads as the same table without quoting: it is written
    into SQL as it is (and into the names derived from it: index, view, functions)."""
    if not isinstance(name, str):
        raise LockTypeError(f"a table name must be a str, not {type(name).__name__}")
    if not _TABLE_NAME.fullmatch(name) or len(name) > MAX_TABLE_NAME_LENGTH:
        raise LockValueError(
            f"table name {name!r} is not a plain identifier: use lower-case letters, digits and "
            f"underscores, not starting with a digit, at most {MAX_TABLE_NAME_LENGTH} characters"
        )
    if name in RESERVED_WORDS:
        raise LockValueError(
            f"table name {name!r} is a reserved word in SQL on some backend: choose another"
        )
    return name


def check_locked_by(details: object, lockstring: str | None = None) -> dict[str, Any]:
    """Caller-supplied ``locked_by`` details: a JSON-serialisable mapping with string keys."""
    if details is None:
        return {}
    if not isinstance(details, Mapping):
        raise LockTypeError(
            f"locked_by must be a mapping of details, not {type(details).__name__}", lockstring
        )
    for key in details:
        if not isinstance(key, str):
            raise LockTypeError(f"locked_by keys must be str, not {key!r}", lockstring)
    clashes = sorted(RESERVED_LOCKED_BY_KEYS.intersection(details))
    if clashes:
        raise LockValueError(
            f"locked_by must not set {', '.join(clashes)}: sqllocker fills those in itself",
            lockstring,
        )
    try:
        encoded = json.dumps(details, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise LockValueError(f"locked_by must be JSON-serialisable: {error}", lockstring) from error
    size = len(encoded.encode("utf-8", "surrogatepass"))
    if size > MAX_LOCKED_BY_BYTES:
        raise LockValueError(
            f"locked_by is at most {MAX_LOCKED_BY_BYTES} bytes of JSON; this one has {size}",
            lockstring,
        )
    return dict(details)


def check_on_lost(callback: object) -> None:
    if callback is not None and not callable(callback):
        raise LockTypeError(f"on_lost must be callable, not {type(callback).__name__}")


def check_telemetry_options(
    meter_provider: object, tracer_provider: object, telemetry_name: object
) -> None:
    """A Locker's OpenTelemetry options: providers (or None) and a callable ``telemetry_name``
    (or None), refused now rather than at the first lock recorded."""
    if telemetry_name is not None and not callable(telemetry_name):
        raise LockTypeError(
            "telemetry_name must be callable (a lockstring to its sqllocker.name), not "
            f"{type(telemetry_name).__name__}"
        )
    for value, name, method in (
        (meter_provider, "meter_provider", "get_meter"),
        (tracer_provider, "tracer_provider", "get_tracer"),
    ):
        if value is not None and not callable(getattr(value, method, None)):
            raise LockTypeError(
                f"{name} must be an OpenTelemetry {name.replace('_', ' ')} (with {method}()), "
                f"not {type(value).__name__}"
            )


def check_flag(value: object, name: str) -> bool:
    # A string "false" is truthy: taking any truthy value would turn an option on by mistake.
    if not isinstance(value, bool):
        raise LockTypeError(f"{name} must be True or False, not {type(value).__name__}")
    return value


def check_max_connections(value: object, owns_engine: bool) -> int | None:
    """A Locker's ``max_connections``: None, or a whole number of at least 1, and only for an
    engine the Locker makes (an engine of one's own brings its pool's limits)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise LockTypeError(f"max_connections must be an int, not {type(value).__name__}")
    if value < 1:
        raise LockValueError(f"max_connections must be at least 1, not {value}")
    if not owns_engine:
        raise LockValueError(
            "max_connections is for a Locker that makes its engine; size the pool of your "
            "engine instead (pool_size + max_overflow)"
        )
    return value


def check_keep_alive_fraction(value: object) -> float:
    if isinstance(value, bool) or not (
        isinstance(value, int | float) and 0 < value < MAX_KEEP_ALIVE_FRACTION
    ):
        raise LockValueError(
            f"keep_alive_fraction must be above 0 and below {MAX_KEEP_ALIVE_FRACTION}, not "
            f"{value!r}: a renewal any later could come after the lock's validity deadline "
            "(its expiry less a safety margin of up to a tenth of it)"
        )
    return float(value)


def check_batch_size(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LockTypeError(f"batch_size must be a positive int, not {value!r}")
    return value


def check_pause_ratio(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise LockTypeError(f"pause_ratio must be a number, not {type(value).__name__}")
    if not math.isfinite(value) or value < 0:
        raise LockValueError(f"pause_ratio must be 0 or more, not {value!r}")
    return float(value)


def check_pattern(pattern: object) -> str | None:
    if pattern is not None and not isinstance(pattern, str):
        raise LockTypeError(f"pattern must be a str, not {type(pattern).__name__}")
    return pattern


def check_locker_options(
    table: object, expires: object, grace: object, keep_alive_fraction: object, on_lost: object
) -> tuple[str, float, float, float]:
    """A Locker's (or AsyncLocker's) options: the table name, default expiry, grace and
    keep-alive fraction."""
    check_on_lost(on_lost)
    return (
        check_table_name(table),
        check_seconds(expires, "expires"),
        check_grace(grace),
        check_keep_alive_fraction(keep_alive_fraction),
    )


def check_lock_request(
    lockstring: object,
    expires: object,
    default_expires: float,
    wait: object,
    locked_by: object,
    on_lost: object,
) -> tuple[str, float, float | None, dict[str, Any]]:
    """The arguments of ``lock()``: lockstring, expiry period, wait and extra holder details."""
    check_on_lost(on_lost)
    checked = check_lockstring(lockstring)
    ttl = default_expires if expires is None else check_seconds(expires, "expires", checked)
    return checked, ttl, check_wait(wait, checked), check_locked_by(locked_by, checked)


def check_hold_at_least(value: object, lockstring: str | None = None) -> float | None:
    """``hold_at_least``: None, or a positive number of seconds."""
    return None if value is None else check_seconds(value, "hold_at_least", lockstring)


def _number(value: object, name: str, lockstring: str | None) -> float:
    # bool is an int subclass, and expires=True meaning "1 second" would be a surprise.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise LockTypeError(
            f"{name} must be a number of seconds, not {type(value).__name__}", lockstring
        )
    return float(value)


def canonical_order(lockstrings: object) -> list[str]:
    """``lockstrings`` checked (a non-empty sequence of distinct valid lockstrings) and in the
    one order every group takes its rows in, so that two groups that overlap never wait for
    each other in a circle: by code point, which is also the order of their UTF-8 bytes."""
    if isinstance(lockstrings, str) or not isinstance(lockstrings, Iterable):
        raise LockValueError(
            f"lock_all takes a list of lockstrings, not {type(lockstrings).__name__}"
        )
    checked = [check_lockstring(lockstring) for lockstring in lockstrings]
    if not checked:
        raise LockValueError("lock_all needs at least one lockstring")
    duplicates = sorted({name for name in checked if checked.count(name) > 1})
    if duplicates:
        raise LockValueError(
            f"lock_all was given {', '.join(map(repr, duplicates))} more than once", duplicates[0]
        )
    return sorted(checked)
