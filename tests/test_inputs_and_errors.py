"""Bad input is refused before any SQL is sent; keys compare exactly alike on every backend; errors
name the lock, the holder and the fix, and pickle."""

from __future__ import annotations

import logging
import pickle
import subprocess
import sys
import unicodedata
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from sqllocker import (
    DatabaseError,
    LockBusy,
    Locker,
    LockError,
    LockLost,
    LockTypeError,
    LockValueError,
    TableMissing,
)
from sqllocker.engine import resolve_url
from sqllocker.reserved_words import RESERVED_WORDS
from sqllocker.schema import DEFAULT_TABLE
from tests.helpers import count_rows

Sent = Callable[[], list[str]]


@pytest.fixture
def statements_sent(locker: Locker, caplog: pytest.LogCaptureFixture) -> Sent:
    """A function returning every statement the locker has sent since the fixture was set up
    (sqllocker logs each at DEBUG on the sqllocker.sql logger)."""
    locker.lock("warm up").unlock()  # the first connection's set-up is not under test
    caplog.set_level(logging.DEBUG, logger="sqllocker.sql")
    caplog.clear()
    return lambda: [r.getMessage() for r in caplog.records if r.name == "sqllocker.sql"]


def test_statements_sent_sees_what_the_locker_sends(locker: Locker, statements_sent: Sent) -> None:
    assert statements_sent() == []
    locker.lock("job").unlock()
    sent = statements_sent()
    assert any(statement.startswith("INSERT") for statement in sent)
    assert any(statement.startswith("DELETE") for statement in sent)


BAD_LOCKSTRINGS: list[tuple[object, type[Exception]]] = [
    ("", LockValueError),
    ("x" * 129, LockValueError),
    ("nul\x00byte", LockValueError),
    ("lone \udc80 surrogate", LockValueError),
    (None, LockTypeError),
    (42, LockTypeError),
    (b"bytes", LockTypeError),
    (["list"], LockTypeError),
]


@pytest.mark.parametrize(("lockstring", "error"), BAD_LOCKSTRINGS)
def test_bad_lockstring_is_refused_and_nothing_is_sent(
    locker: Locker,
    statements_sent: Sent,
    lockstring: object,
    error: type[Exception],
) -> None:
    with pytest.raises(error) as caught:
        locker.lock(lockstring)  # type: ignore[arg-type]
    assert isinstance(caught.value, LockError)
    assert statements_sent() == []
    assert count_rows(locker) == 0


BAD_OPTIONS: list[tuple[dict[str, Any], type[Exception]]] = [
    ({"expires": 0}, LockValueError),
    ({"expires": -1}, LockValueError),
    ({"expires": float("nan")}, LockValueError),
    ({"expires": float("inf")}, LockValueError),
    ({"expires": 10**12}, LockValueError),
    ({"expires": "60"}, LockTypeError),
    ({"expires": True}, LockTypeError),
    ({"wait": -1}, LockValueError),
    ({"wait": float("nan")}, LockValueError),
    ({"wait": "5"}, LockTypeError),
    ({"locked_by": {"when": object()}}, LockValueError),
    ({"locked_by": {"x": float("nan")}}, LockValueError),
    ({"locked_by": {1: "int key"}}, LockTypeError),
    ({"locked_by": ["not", "a", "mapping"]}, LockTypeError),
    ({"locked_by": {"guid": "forged"}}, LockValueError),
    ({"locked_by": {"pid": 1}}, LockValueError),
    ({"locked_by": {"blob": "x" * 8192}}, LockValueError),
]


@pytest.mark.parametrize(("options", "error"), BAD_OPTIONS)
def test_bad_options_are_refused_and_nothing_is_sent(
    locker: Locker,
    statements_sent: Sent,
    options: dict[str, Any],
    error: type[Exception],
) -> None:
    with pytest.raises(error):
        locker.lock("job", **options)
    assert statements_sent() == []
    assert count_rows(locker) == 0


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"batch_size": 0}, LockTypeError),
        ({"batch_size": 2.5}, LockTypeError),
        ({"pause_ratio": -1}, LockValueError),
        ({"pause_ratio": float("nan")}, LockValueError),
        ({"pause_ratio": float("inf")}, LockValueError),
        ({"pause_ratio": "1"}, LockTypeError),
        ({"pause_ratio": True}, LockTypeError),
    ],
)
def test_bad_purge_options_are_refused_and_nothing_is_sent(
    locker: Locker, statements_sent: Sent, options: dict[str, Any], error: type[Exception]
) -> None:
    with pytest.raises(error):
        locker.purge_expired_locks(**options)
    assert statements_sent() == []


def test_bad_extend_is_refused_and_the_row_is_untouched(locker: Locker) -> None:
    with locker.lock("job", expires=60) as lock:
        before = lock.expires
        for bad in (0, -5, float("nan"), "10"):
            with pytest.raises(LockError):
                lock.extend(bad)  # type: ignore[arg-type]
        (row,) = locker.locks()
        assert row.expires == before
        assert lock.is_locked


@pytest.mark.parametrize(
    "table",
    [
        "semaphores; DROP TABLE x",
        "1starts_with_digit",
        "has space",
        "dot.ted",
        "",
        "a" * 33,
        "é",
        "AuditMixed",
        "Semaphores",
    ],
)
def test_bad_table_names_are_refused(table: str) -> None:
    with pytest.raises(LockValueError, match="plain identifier"):
        Locker("sqlite://", table=table)


@pytest.mark.parametrize("table", ["order", "select", "user", "group", "table"])
def test_reserved_words_are_refused_as_table_names(table: str) -> None:
    with pytest.raises(LockValueError, match="reserved word"):
        Locker("sqlite://", table=table)


def test_every_word_a_dialect_reserves_is_refused_and_the_default_table_name_is_none() -> None:
    """sqllocker keeps its own list (``sqllocker/reserved_words.py``): reading the dialects'
    imports every driver's dialect with them. Should SQLAlchemy reserve a word more, the list
    must take it in."""
    from sqlalchemy.dialects.mysql import reserved_words
    from sqlalchemy.dialects.postgresql.base import RESERVED_WORDS as POSTGRESQL
    from sqlalchemy.dialects.sqlite.base import SQLiteIdentifierPreparer

    listed = (
        POSTGRESQL
        | reserved_words.RESERVED_WORDS_MARIADB
        | reserved_words.RESERVED_WORDS_MYSQL
        | SQLiteIdentifierPreparer.reserved_words
    )
    assert sorted(listed - RESERVED_WORDS) == []
    assert DEFAULT_TABLE not in RESERVED_WORDS


def test_a_locker_on_a_table_of_its_own_name_imports_no_postgresql_dialect(tmp_path: Path) -> None:
    """The PostgreSQL dialect's package imports every PostgreSQL driver's dialect: a start-up
    cost that a process on SQLite or MariaDB must not pay to check a table name of its own
    against the words PostgreSQL reserves."""
    url = f"sqlite:///{tmp_path}/jobs.db"
    maker = Locker(url, table="jobs")
    maker.create_table()  # made here: no migration runs in the child
    maker.close()
    script = (
        "import sys\n"
        "from sqllocker import Locker\n"
        f"Locker({url!r}, table='jobs').lock('x').unlock()\n"
        "print('sqlalchemy.dialects.postgresql' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_locked_by_of_8_kib_is_accepted_and_one_byte_more_refused(locker: Locker) -> None:
    filler = "x" * (8192 - len('{"blob": ""}'))
    with locker.lock("job", locked_by={"blob": filler}) as lock:
        assert lock.locked_by["blob"] == filler
    with pytest.raises(LockValueError, match="at most 8192 bytes"):
        locker.lock("job", locked_by={"blob": filler + "x"})
    assert count_rows(locker) == 0


@pytest.mark.parametrize("fraction", [0.9, 0.95, 1, 0, -0.1, True])
def test_a_keep_alive_fraction_that_could_renew_past_the_deadline_is_refused(
    fraction: object,
) -> None:
    with pytest.raises(LockValueError, match="keep_alive_fraction"):
        Locker("sqlite://", keep_alive_fraction=fraction)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://app:hunter2@127.0.0.1:1/test?sslpassword=hunter2",
        "postgresql://app@127.0.0.1:1/test?password=hunter2",
        "mysql://app@127.0.0.1:1/test?password=hunter2",
    ],
)
def test_passwords_in_a_url_never_reach_a_message(url: str) -> None:
    locker = Locker(url)
    with pytest.raises(DatabaseError) as caught:
        locker.lock("job")
    assert "hunter2" not in str(caught.value)
    assert "127.0.0.1:1" in str(caught.value)
    assert "hunter2" not in repr(locker)


@pytest.mark.parametrize("url", ["nonsense", "foo://host/db", "postgresql://u:hunter2@h:port/db"])
def test_a_bad_url_is_a_lock_error_that_hides_its_password(url: str) -> None:
    with pytest.raises(LockValueError) as caught:
        Locker(url)
    assert "hunter2" not in str(caught.value)
    assert "\n" not in str(caught.value)


def test_non_string_table_name_is_refused() -> None:
    with pytest.raises(LockTypeError):
        Locker("sqlite://", table=None)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf")])
def test_bad_default_expiry_is_refused(bad: float) -> None:
    with pytest.raises(LockValueError):
        Locker("sqlite://", expires=bad)


def test_sql_metacharacters_are_ordinary_lockstrings(locker: Locker) -> None:
    hostile = [
        "'; DROP TABLE semaphores; --",
        "%",
        "_",
        "\\",
        "a%b_c\\d",
        '"q"',
        "x' OR '1'='1",
    ]
    locks = [locker.lock(text) for text in hostile]
    assert sorted(row.lockstring for row in locker.locks()) == sorted(hostile)
    for text in hostile:
        assert locker.try_lock(text) is None
    assert locker.try_lock("a") is not None  # "%" and "_" are not patterns
    for lock in locks:
        lock.unlock()


def test_longest_lockstring_round_trips(locker: Locker) -> None:
    longest = "ü" * 128
    with locker.lock(longest) as lock:
        assert lock.lockstring == longest
        (row,) = locker.locks()
        assert row.lockstring == longest


def test_keys_compare_exactly_on_every_backend(locker: Locker) -> None:
    nfc = unicodedata.normalize("NFC", "Foö")
    nfd = unicodedata.normalize("NFD", "Foö")
    assert nfc != nfd
    keys = ["Foo", "foo", "Foo ", "FOO", nfc, nfd, " Foo"]
    locks = [locker.lock(key) for key in keys]  # each a different lock: none is refused
    assert len({lock.lock_id for lock in locks}) == len(keys)
    for key in keys:
        with pytest.raises(LockBusy):
            locker.lock(key)
    for lock in locks:
        lock.unlock()


def test_missing_table_names_the_command_that_creates_it(url: str) -> None:
    locker = Locker(url, table="no_such_table", auto_create=False)
    with pytest.raises(TableMissing) as caught:
        locker.lock("job")
    message = str(caught.value)
    assert "no_such_table" in message
    assert "`sqllocker --url URL --table no_such_table migrate`" in message
    assert caught.value.lockstring == "job"
    with pytest.raises(TableMissing):
        locker.purge_expired_locks()
    with pytest.raises(TableMissing):
        locker.locks()
    locker.close()


def test_sqlite_creates_its_table_on_first_use(tmp_path: Any) -> None:
    locker = Locker(f"sqlite:///{tmp_path / 'fresh.db'}")
    with locker.lock("job") as lock:
        assert lock.lock_id == 1
    from sqllocker.migrations import current_revision, head_revision

    assert current_revision(locker.engine) == head_revision()
    locker.close()


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://postgres@127.0.0.1:1/test",
        "mysql://root@127.0.0.1:1/test",
        "sqlite:////nonexistent-directory/for/sure/locks.db",
    ],
)
def test_unreachable_database_raises_a_lock_error_chained_to_the_driver(url: str) -> None:
    locker = Locker(url)
    with pytest.raises(DatabaseError) as caught:
        locker.lock("job")
    assert isinstance(caught.value.__cause__, sa.exc.DBAPIError)
    assert "127.0.0.1:1" in str(caught.value) or "nonexistent" in str(caught.value)
    assert "check the URL" in str(caught.value)


def test_unknown_url_or_engine_type_is_refused() -> None:
    with pytest.raises(LockTypeError):
        Locker(42)  # type: ignore[arg-type]


ERRORS: list[Callable[[], LockError]] = [
    lambda: LockError("plain", "job"),
    lambda: LockBusy("job", holder={"host": "h", "pid": 7}, lock_id=3, waited=1.5),
    lambda: LockLost("gone", "job", 9),
    lambda: TableMissing("missing", "job"),
    lambda: DatabaseError("down"),
    lambda: LockValueError("bad", "job"),
    lambda: LockTypeError("bad type"),
]


@pytest.mark.parametrize("make_error", ERRORS)
def test_errors_pickle_with_their_attributes(make_error: Callable[[], LockError]) -> None:
    error = make_error()
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert str(copy) == str(error)
    assert copy.__dict__ == error.__dict__
    assert copy.lockstring == error.lockstring


def test_errors_form_one_hierarchy() -> None:
    for cls in (LockBusy, LockLost, TableMissing, DatabaseError, LockValueError, LockTypeError):
        assert issubclass(cls, LockError)
    assert issubclass(LockValueError, ValueError)
    assert issubclass(LockTypeError, TypeError)


def test_database_gone_after_first_use_is_a_lock_error(tmp_path: Any) -> None:
    import shutil

    directory = tmp_path / "db"
    directory.mkdir()
    locker = Locker(f"sqlite:///{directory / 'locks.db'}")
    locker.lock("job").unlock()
    locker.engine.dispose()  # no pooled connection left: the next operation must connect
    shutil.rmtree(directory)
    with pytest.raises(DatabaseError) as caught:
        locker.lock("job")
    assert "cannot connect" in str(caught.value)


def test_a_pool_with_no_connection_free_is_a_lock_error(url: str, table_name: str) -> None:
    """SQLAlchemy's pool raises its own TimeoutError when it lends nothing within its timeout;
    a caller catching LockError must see that too."""
    engine = sa.create_engine(
        resolve_url(url), pool_size=1, max_overflow=0, pool_timeout=0.3, poolclass=sa.QueuePool
    )
    locker = Locker(engine, table=table_name, auto_create=True)
    locker.lock("warm up").unlock()
    # The pool's only connection, held elsewhere:
    with engine.connect(), pytest.raises(DatabaseError, match="came free in time"):
        locker.lock("job")
    locker.lock("job").unlock()
    engine.dispose()


def test_every_statement_and_connection_of_a_locker_is_bounded(url: str, backend: str) -> None:
    """Connect, statement and socket timeouts on the engine a Locker makes (each overridable
    by a URL parameter of the same name)."""
    locker = Locker(url)
    with locker.engine.connect() as conn:
        driver = conn.connection.dbapi_connection
        if backend == "postgresql":
            assert conn.exec_driver_sql("SHOW statement_timeout").scalar() == "1min"
            parameters = driver.info.get_parameters()  # type: ignore[union-attr]
            assert parameters["tcp_user_timeout"] == "15000"
            assert parameters["keepalives"] == "1"
            assert parameters["connect_timeout"] == "10"
        elif backend == "mysql":
            assert driver._read_timeout == 60  # type: ignore[union-attr]
            assert driver._write_timeout == 60  # type: ignore[union-attr]
            assert driver.connect_timeout == 10  # type: ignore[union-attr]
    locker.close()


# Rows another writer left that no Python value holds: (created, expires, locked_by) as SQL.
UNREADABLE_ROWS = {
    "sqlite": [
        ("'yesterday'", "'tomorrow'", "'{}'"),
        ("'2020-01-01 00:00:00.000'", "'2999-01-01 00:00:00.000'", "'{not json'"),
    ],
    "postgresql": [("now()", "'infinity'", "'{}'")],
}


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_row_no_python_value_holds_is_a_lock_error(
    make_locker: Callable[..., Locker], url: str, table_name: str, backend: str
) -> None:
    """A row an operator's SQL (or another program) wrote with a timestamp out of range or not
    one, or locked_by that is not JSON: lock(), lock_info() and locks() raised ValueError or
    JSONDecodeError, not a LockError, and the CLI printed a traceback."""
    locker = make_locker()
    engine = sa.create_engine(resolve_url(url))
    with engine.begin() as conn:
        for n, (created, expires, locked_by) in enumerate(UNREADABLE_ROWS[backend]):
            conn.exec_driver_sql(
                f"INSERT INTO {table_name} (lockstring, guid, created, expires, locked_by) "
                f"VALUES ('written by hand {n}', 'guid {n}', {created}, {expires}, {locked_by})"
            )
    engine.dispose()
    for n in range(len(UNREADABLE_ROWS[backend])):
        with pytest.raises(LockError, match=r"cannot be read|out of range|too large|infinity"):
            locker.lock(f"written by hand {n}")
        with pytest.raises(LockError):
            locker.lock_info(f"written by hand {n}")
    with pytest.raises(LockError):
        locker.locks()
    locker.lock("another name").unlock()  # the rest of the table serves on
