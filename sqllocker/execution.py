"""Running sqllocker's statements on the driver's cursor, compiled once.

A lock cycle is two short statements, and SQLAlchemy's per-execution machinery (cache lookup,
parameter construction, result set-up, transaction bookkeeping) cost more than the database
round trips themselves on SQLite, and a good part of them on the servers (CHANGELOG.md).
So each statement built in ``statements.py`` is compiled once per dialect,
its literal parameters and SQLAlchemy's own bind and result processors are kept, and it runs
straight on the pooled DBAPI connection's cursor (or, on a driver whose cursor takes several
calls where one would do, in that one: ``Backend.in_one_call``).
The SQL is exactly what SQLAlchemy would send.
"""

from __future__ import annotations

import logging
from collections import namedtuple
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy.engine import Dialect
from sqlalchemy.sql import ClauseElement
from sqlalchemy.sql.compiler import SQLCompiler

from .errors import NotDurable, one_line
from .identity import HolderDetails
from .schema import HolderJSON
from .sqlalchemy_internals import bind_order, literal_binds

# A statement run in one call of the driver (``Backend.in_one_call``): given its SQL, its
# parameters and whether it returns rows, its rows, or how many rows it changed.
OneCall = Callable[[str, Any, bool], "tuple[list[Any], int]"]

# Every statement sqllocker sends, at DEBUG (like SQLAlchemy's echo); the values are in the
# record's ``sqllocker_values``.
sql_logger = logging.getLogger("sqllocker.sql")

# In Prepared's plan: a parameter the caller must supply (no literal of the statement's own).
_REQUIRED = object()


class Prepared:
    """One statement compiled for one dialect, with what it takes to run it on a cursor."""

    def __init__(self, statement: ClauseElement, dialect: Dialect) -> None:
        compiled = cast(SQLCompiler, statement.compile(dialect=dialect))
        self.sql: str = compiled.string
        self._positions = bind_order(compiled)
        every = literal_binds(compiled)
        processors: dict[str, Callable[[Any], Any]] = {}
        for bind in compiled.binds.values():
            processor: Callable[[Any], Any] | None
            processor = bind.type.dialect_impl(dialect).bind_processor(dialect)
            if processor is not None and isinstance(bind.type, HolderJSON):
                processor = _sending_holder_json(processor)
            if processor is not None:
                processors[compiled.bind_names[bind]] = processor
        # One step per parameter, in the order the driver takes them: its name, its processor,
        # and (for a literal SQLAlchemy bound itself: 'now', a format string) the value to send,
        # processed once here rather than on every execution.
        self._plan: list[tuple[str, Callable[[Any], Any] | None, Any]] = []
        for name in self._positions if self._positions is not None else list(every):
            process = processors.get(name)
            constant = every.get(name)
            if constant is None:
                constant = _REQUIRED
            elif process is not None:
                constant = process(constant)
            self._plan.append((name, process, constant))
        self._names = tuple(name for name, _, _ in self._plan)
        # The same plan, for ``parameters``: the constants in place, then each value to fill in
        # (its place, name and processor); a constant is replaced only by a value given for it.
        self._template = [
            None if constant is _REQUIRED else constant for _, _, constant in self._plan
        ]
        self._filled = [
            (place, name, process)
            for place, (name, process, constant) in enumerate(self._plan)
            if constant is _REQUIRED
        ]
        self._constants = frozenset(
            name for name, _, constant in self._plan if constant is not _REQUIRED
        )
        self._fill = self._filler()
        columns = list(getattr(statement, "exported_columns", ()))
        # Known to return rows (a SELECT, a RETURNING): fetched without asking the cursor
        # first, as psycopg builds its ``description`` anew on every call.
        self.returns_rows = bool(columns)
        self._row: Any = namedtuple("_Row", [column.key for column in columns])  # type: ignore[misc]
        self._result_processors = [
            column.type.dialect_impl(dialect).result_processor(dialect, None) for column in columns
        ]
        # Rows with nothing to convert (an acquire's: see Statements._returned) skip the loop.
        self.unprocessed = all(process is None for process in self._result_processors)

    def parameters(self, values: Mapping[str, Any]) -> Sequence[Any] | dict[str, Any]:
        """The driver's parameters: ``values`` by name, processed as SQLAlchemy would, with the
        statement's own literals where ``values`` has none."""
        if self._constants.isdisjoint(values):
            return self._fill(values)  # every statement of every lock cycle
        sent = self._template.copy()
        for place, name, processor in self._filled:
            value = values[name]
            sent[place] = value if processor is None else processor(value)
        for place, (name, processor, _constant) in enumerate(self._plan):
            if name in self._constants and name in values:
                value = values[name]
                sent[place] = value if processor is None else processor(value)
        if self._positions is not None:
            return tuple(sent)
        return dict(zip(self._names, sent, strict=True))

    def _filler(self) -> Callable[[Mapping[str, Any]], Sequence[Any] | dict[str, Any]]:
        """``parameters`` where ``values`` give none of the statement's constants: one
        expression, made once per statement as ``collections.namedtuple`` makes its methods:
        a loop over the plan was a measurable share of a lock cycle's own work (CHANGELOG.md).
        Its source holds no name or value, only places: each is looked up in its namespace."""
        namespace: dict[str, Any] = {}
        items = []
        for place, (name, process, constant) in enumerate(self._plan):
            namespace[f"n{place}"] = name
            if constant is not _REQUIRED:
                namespace[f"c{place}"] = constant
                item = f"c{place}"
            elif process is None:
                item = f"values[n{place}]"
            else:
                namespace[f"p{place}"] = process
                item = f"p{place}(values[n{place}])"
            items.append(item if self._positions is not None else f"n{place}: {item}")
        if self._positions is not None:
            body = f"({', '.join(items)},)" if items else "()"
        else:
            body = f"{{{', '.join(items)}}}"
        exec(f"def fill(values):\n    return {body}\n", namespace)  # noqa: S102
        fill: Callable[[Mapping[str, Any]], Sequence[Any] | dict[str, Any]] = namespace["fill"]
        return fill

    def row(self, values: Sequence[Any]) -> Any:
        if self.unprocessed:
            return self._row._make(values)
        return self._row._make(
            [
                value if process is None else process(value)
                for process, value in zip(self._result_processors, values, strict=True)
            ]
        )


def _sending_holder_json(process: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A JSON parameter's processor that sends a HolderDetails' own JSON text as it is (every
    backend's statement reads the parameter as JSON text: PostgreSQL's casts it to JSONB)."""

    def send(value: Any) -> Any:
        if type(value) is HolderDetails and value.json is not None:
            return value.json
        return process(value)

    return send


def _shown(values: Mapping[str, Any]) -> Mapping[str, Any]:
    """``values`` as the SQL log shows them: a ticket's grant key, with which anyone who can
    NOTIFY could sign a grant to its waiter, is left out."""
    if values.get("grant_key") is None:
        return values
    return {**values, "grant_key": "<secret>"}


class Result:
    __slots__ = ("lastrowid", "rowcount", "rows")

    def __init__(self, rows: list[Any], rowcount: int, lastrowid: int | None) -> None:
        self.rows = rows
        self.rowcount = rowcount
        self.lastrowid = lastrowid

    def first(self) -> Any:
        return self.rows[0] if self.rows else None

    def one(self) -> Any:
        if len(self.rows) != 1:
            raise sa.exc.NoResultFound(f"expected one row, got {len(self.rows)}")
        return self.rows[0]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.rows)


# Where a connection of SQLAlchemy's pool keeps its cursor (in the pool's per-connection
# ``info``), next to the DBAPI connection it belongs to.
_CURSOR_KEY = "sqllocker.cursor"


def kept_cursor(pooled: Any) -> Any:
    """The cursor of ``pooled`` (a checked-out ``PoolProxiedConnection``), made on its first use
    and kept for every later operation on that connection.

    A fresh psycopg or PyMySQL cursor per operation rebuilt its adapters each time, a
    noticeable share of a cycle, and an async driver's cursor is made and closed with an await
    each. The pool hands a connection to one thread or task at a time, so its cursor is never
    shared.
    """
    dbapi_connection = pooled.dbapi_connection
    kept = pooled.info.get(_CURSOR_KEY)
    # The identity check: a record that reconnected must not hand out the old cursor.
    if kept is not None and kept[0] is dbapi_connection:
        return kept[1]
    cursor = dbapi_connection.cursor()
    pooled.info[_CURSOR_KEY] = (dbapi_connection, cursor)
    return cursor


def forget_cursor(pooled: Any) -> None:
    """Make ``pooled``'s next operation use a cursor of its own: the kept one was closed with
    an operation abandoned on a connection that serves on."""
    pooled.info.pop(_CURSOR_KEY, None)


class DriverSession:
    """A DBAPI connection and its cursor, for the length of one operation."""

    __slots__ = ("_one_call", "_prepared", "_warnings", "cursor", "dbapi_connection", "dialect")

    def __init__(
        self,
        dbapi_connection: Any,
        cursor: Any,
        prepared: PreparedCache,
        one_call: OneCall | None = None,
        warnings: list[str] | None = None,
    ) -> None:
        self.dbapi_connection = dbapi_connection
        self.cursor = cursor
        self.dialect = prepared.dialect
        self._prepared = prepared
        # Backend.in_one_call: for first_row and affected, whose callers read nothing but the
        # rows, or the count of rows changed, of a statement of one lockstring's few rows.
        self._one_call = one_call
        # Backend.statement_warnings: what the server warned of during a statement, which then
        # does not count (``_check_warnings``).
        self._warnings = warnings
        if warnings:
            warnings.clear()  # of statements not of this session's (an earlier operation's)

    def execute(self, statement: ClauseElement, values: Mapping[str, Any] | None = None) -> Result:
        prepared = self._prepared[statement]
        rows = self._send(prepared, values or {})
        cursor = self.cursor
        return Result(
            [prepared.row(row) for row in rows], cursor.rowcount, getattr(cursor, "lastrowid", None)
        )

    def transaction_control(self, sql: str) -> None:
        """BEGIN, COMMIT or ROLLBACK (as the backend spells it) on this autocommit connection:
        for the rare operation that must take several rows or none."""
        if sql_logger.isEnabledFor(logging.DEBUG):
            sql_logger.debug("%s", sql)
        try:
            self.cursor.execute(sql)
        except self.dialect.loaded_dbapi.Error as error:
            raise self._failed(error, sql) from error
        if self._warnings:
            raise self._warned(sql)

    def affected(self, statement: ClauseElement, values: Mapping[str, Any]) -> int:
        """How many rows ``statement`` (a DELETE or UPDATE without RETURNING of one
        lockstring's rows) changed. Like ``first_row``'s, a statement of a few rows: on
        aiosqlite one that need not wait runs on the event loop's thread (``in_one_call``)."""
        prepared = self._prepared[statement]
        if self._one_call is not None and not prepared.returns_rows:
            return self._in_one_call(prepared, values)[1]
        self._send(prepared, values)
        return self.cursor.rowcount  # type: ignore[no-any-return]

    def first_row(self, statement: ClauseElement, values: Mapping[str, Any]) -> Any:
        """The first row of ``statement``, or None, read by position: a plain tuple when its
        columns need no conversion, as an acquire's do (see ``Statements.returned``): the
        acquire's path, where a Result and a named row were a measurable share of the library's
        own Python (timed against a stub cursor: ``git log -S stub-driver -- scripts``)."""
        prepared = self._prepared[statement]
        if self._one_call is not None and prepared.returns_rows:
            rows = self._in_one_call(prepared, values)[0]
        else:
            rows = self._send(prepared, values)
        if not rows:
            return None
        return rows[0] if prepared.unprocessed else prepared.row(rows[0])

    def _in_one_call(self, prepared: Prepared, values: Mapping[str, Any]) -> tuple[list[Any], int]:
        """Run ``prepared`` by the driver's one call: its rows as the driver returned them, or
        how many rows it changed."""
        assert self._one_call is not None
        if sql_logger.isEnabledFor(logging.DEBUG):
            shown = _shown(values)
            sql_logger.debug("%s %r", prepared.sql, shown, extra={"sqllocker_values": shown})
        try:
            done = self._one_call(prepared.sql, prepared.parameters(values), prepared.returns_rows)
        except self.dialect.loaded_dbapi.Error as error:
            raise self._failed(error, prepared.sql) from error
        if self._warnings:
            raise self._warned(prepared.sql)
        return done

    def _send(self, prepared: Prepared, values: Mapping[str, Any]) -> list[Any]:
        """Run ``prepared`` on the cursor: its rows as the driver returned them, if any."""
        cursor = self.cursor
        if sql_logger.isEnabledFor(logging.DEBUG):
            shown = _shown(values)
            sql_logger.debug("%s %r", prepared.sql, shown, extra={"sqllocker_values": shown})
        try:
            cursor.execute(prepared.sql, prepared.parameters(values))
            rows = cursor.fetchall() if prepared.returns_rows or cursor.description else []
        except self.dialect.loaded_dbapi.Error as error:
            raise self._failed(error, prepared.sql) from error
        if self._warnings:
            raise self._warned(prepared.sql)
        return rows

    def _warned(self, sql: str) -> NotDurable:
        """The error of a statement the server warned of (``Backend.statement_warnings``): on
        PostgreSQL, a commit whose wait for its synchronous standbys was cancelled, visible
        here and maybe never on them, lost with a failover. What it wrote is not counted on:
        a waiting acquire tries again (an outage), and finds a row it inserted ours."""
        assert self._warnings is not None
        said = "; ".join(one_line(warning) for warning in self._warnings)
        self._warnings.clear()
        first_words = " ".join(sql.split()[:2])
        return NotDurable(
            f"the server warned of a lock statement ({first_words} ...): {said}; what it "
            "wrote may be lost with a failover, and is not counted on"
        )

    def _failed(self, error: Exception, sql: str) -> sa.exc.DBAPIError:
        """``_wrap``, and what the server warned of during the failed statement forgotten: it
        must not fail the next statement on this connection."""
        if self._warnings:
            self._warnings.clear()
        return self._wrap(error, sql)

    def _wrap(self, error: Exception, sql: str) -> sa.exc.DBAPIError:
        """The driver's exception as SQLAlchemy would have raised it (IntegrityError, ...),
        marked connection_invalidated when the connection is dead."""
        lost = self.dialect.is_disconnect(error, self.dbapi_connection, self.cursor)  # type: ignore[arg-type]
        wrapped = sa.exc.DBAPIError.instance(
            sql,
            None,
            error,
            self.dialect.loaded_dbapi.Error,
            connection_invalidated=lost,
            dialect=self.dialect,
        )
        assert isinstance(wrapped, sa.exc.DBAPIError)
        return wrapped


class PreparedCache:
    """The Prepared form of each statement, made on first use, per dialect. Statements are made
    once each (``statements``); should one be made per call all the same, the cache is
    emptied at ``MOST`` entries rather than grow without end."""

    MOST = 1024

    def __init__(self, dialect: Dialect) -> None:
        self.dialect = dialect
        self._prepared: dict[int, tuple[ClauseElement, Prepared]] = {}

    def __getitem__(self, statement: ClauseElement) -> Prepared:
        found = self._prepared.get(id(statement))
        if found is None or found[0] is not statement:
            if len(self._prepared) >= self.MOST:
                self._prepared.clear()
            found = (statement, Prepared(statement, self.dialect))
            self._prepared[id(statement)] = found
        return found[1]
