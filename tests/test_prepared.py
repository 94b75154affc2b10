"""A compiled statement's parameters (``execution.Prepared.parameters``), as SQLAlchemy sends
them: the caller's values by name, processed, and the statement's own literals where the
values have none, in the driver's order or by name."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import mysql, postgresql, sqlite

from sqllocker.execution import _REQUIRED, Prepared, PreparedCache


class _Upper(sa.TypeDecorator[str]):
    """A type whose values a processor changes, on every dialect."""

    impl = sa.String
    cache_ok = True

    def process_bind_param(self, value: str | None, dialect: sa.Dialect) -> str | None:
        return None if value is None else value.upper()


_TABLE = sa.table("t", sa.column("a", sa.String), sa.column("b", _Upper), sa.column("c"))


def _statement() -> sa.Select[tuple[str]]:
    return sa.select(_TABLE.c.a).where(
        _TABLE.c.a == sa.bindparam("a", type_=sa.String),
        _TABLE.c.b == sa.bindparam("b", type_=_Upper),
        _TABLE.c.c == sa.bindparam("c", "fixed", type_=sa.String),
        _TABLE.c.a != sa.literal("constant"),
    )


@pytest.mark.parametrize(
    "dialect",
    [sqlite.dialect(), postgresql.psycopg.dialect(), mysql.pymysql.dialect()],
    ids=["sqlite", "postgresql", "mysql"],
)
def test_values_by_name_processed_and_the_statements_own_where_none_is_given(
    dialect: sa.Dialect,
) -> None:
    prepared = Prepared(_statement(), dialect)
    sent = prepared.parameters({"a": "x", "b": "y"})
    overridden = prepared.parameters({"a": "x", "b": "z", "c": "given"})
    as_list = list(sent.values()) if isinstance(sent, dict) else list(sent)
    over_list = list(overridden.values()) if isinstance(overridden, dict) else list(overridden)
    assert as_list[:3] == ["x", "Y", "fixed"]
    assert over_list[:3] == ["x", "Z", "given"]
    assert "constant" in as_list[3:]
    assert "constant" in over_list[3:]
    with pytest.raises(KeyError):
        prepared.parameters({"a": "x"})
    assert prepared.parameters({"a": "x", "b": "y"}) == sent  # nothing kept between calls


def test_the_cache_of_compiled_statements_stays_bounded() -> None:
    """A statement made anew per call (as the table's listings were) is compiled and kept anew
    each time: past ``MOST`` the cache starts again rather than grow without end."""
    cache = PreparedCache(sqlite.dialect())
    kept = _statement()
    assert cache[kept] is cache[kept]
    for _ in range(PreparedCache.MOST + 10):
        cache[_statement()]
    assert len(cache._prepared) <= PreparedCache.MOST
    assert cache[kept].sql == Prepared(kept, sqlite.dialect()).sql


def _by_the_plan(prepared: Prepared, values: dict[str, object]) -> object:
    """What ``parameters`` must send, step by step from the plan."""
    sent = []
    for name, process, constant in prepared._plan:
        if name in values:
            value = values[name]
            sent.append(value if process is None else process(value))
        else:
            assert constant is not _REQUIRED, name
            sent.append(constant)
    if prepared._positions is not None:
        return tuple(sent)
    return dict(zip(prepared._names, sent, strict=True))


@pytest.mark.parametrize(
    "dialect",
    [sqlite.dialect(), postgresql.psycopg.dialect(), mysql.pymysql.dialect()],
    ids=["sqlite", "postgresql", "mysql"],
)
def test_the_parameters_made_in_one_expression_are_the_plans(dialect: sa.Dialect) -> None:
    """Values that give none of the statement's constants take the expression made once per
    statement: the same parameters, in the same order, as the plan gives them; a name used
    twice (twice in the driver's order where it takes them by place), and no parameter at all,
    too."""
    twice = sa.select(_TABLE.c.a).where(
        sa.or_(_TABLE.c.a == sa.bindparam("a"), _TABLE.c.b == sa.bindparam("a", type_=_Upper)),
        _TABLE.c.c == sa.bindparam("c", "fixed"),
    )
    none = sa.select(_TABLE.c.a).where(_TABLE.c.a.is_(None))
    for statement, values in [
        (_statement(), {"a": "x", "b": "y"}),
        (twice, {"a": "q"}),
        (none, {}),
        (none, {"unused": 1}),
    ]:
        prepared = Prepared(statement, dialect)
        sent = prepared.parameters(values)
        assert sent == _by_the_plan(prepared, values)
        assert type(sent) is type(_by_the_plan(prepared, values))
        if isinstance(sent, dict):
            assert list(sent) == list(prepared._names)
