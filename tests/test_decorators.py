"""``@locker.locked(...)``: a function (or coroutine function) that runs under a lock named from
its arguments."""

from __future__ import annotations

import asyncio
import datetime as dt
import decimal as dec
import enum
import functools
import itertools
import json
import logging
import tempfile
import uuid
import warnings
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from sqllocker import LockBusy, Locker, LockLost, LockTypeError, LockValueError
from sqllocker.asyncio import AsyncLocker
from sqllocker.decorators import LockstringTemplate
from tests.fleet import Fleet
from tests.helpers import count_rows
from tests.workers import async_url


def test_the_lock_is_named_from_the_arguments_and_held_while_the_function_runs(
    locker: Locker,
) -> None:
    seen: list[object] = []

    @locker.locked("report {day} {kind}")
    def report(day: str, kind: str = "full") -> str:
        """Make the report."""
        info = locker.lock_info(f"report {day} {kind}")
        seen.append(info is not None and info.locked_by["pid"])
        return f"{day}/{kind}"

    assert report("2026-11-25") == "2026-11-25/full"
    assert report(day="2026-11-26", kind="short") == "2026-11-26/short"
    assert len(seen) == 2
    assert all(seen)
    assert count_rows(locker) == 0  # released each time
    assert report.__name__ == "report"
    assert report.__doc__ == "Make the report."


def test_a_busy_lock_skips_the_call_or_raises(
    locker: Locker, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[int] = []

    @locker.locked("job {n}")
    def skipped(n: int) -> int:
        calls.append(n)
        return n

    @locker.locked("job {n}", on_busy="raise")
    def raised(n: int) -> int:
        calls.append(n)
        return n

    with locker.lock("job 1"), caplog.at_level(logging.INFO, logger="sqllocker"):
        assert skipped(1) is None
        with pytest.raises(LockBusy):
            raised(1)
        assert skipped(2) == 2  # another lockstring
    assert calls == [2]
    assert any("skipped" in record.getMessage() for record in caplog.records)


def test_the_lock_is_released_when_the_function_raises(locker: Locker) -> None:
    @locker.locked("job")
    def fails() -> None:
        raise RuntimeError("body")

    with pytest.raises(RuntimeError, match="body"):
        fails()
    assert count_rows(locker) == 0


def test_a_lock_lost_while_the_function_ran_is_raised_at_its_end(locker: Locker) -> None:
    @locker.locked("job")
    def broken_meanwhile() -> str:
        locker.break_lock("job")
        return "done"

    with pytest.raises(LockLost):
        broken_meanwhile()


def test_hold_at_least_keeps_the_lock_after_the_function_returns(locker: Locker) -> None:
    @locker.locked("nightly", hold_at_least=30)
    def nightly() -> str:
        return "ran"

    assert nightly() == "ran"
    assert nightly() is None  # the window is still held
    assert locker.lock_info("nightly") is not None


@pytest.mark.parametrize(
    ("template", "options", "error"),
    [
        ("report {month}", {}, LockValueError),
        ("report {}", {}, LockValueError),
        ("report {day", {}, LockValueError),
        (42, {}, LockTypeError),
        ("report {day}", {"on_busy": "wait"}, LockValueError),
        ("report {day}", {"expires": 0}, LockValueError),
        ("report {day}", {"hold_at_least": -1}, LockValueError),
    ],
)
def test_bad_decorations_are_refused_before_any_call(
    locker: Locker, template: object, options: dict[str, object], error: type[Exception]
) -> None:
    with pytest.raises(error):

        @locker.locked(template, **options)  # type: ignore[arg-type]
        def report(day: str) -> None:
            pass

    assert count_rows(locker) == 0


def test_a_coroutine_function_needs_the_async_locker(locker: Locker) -> None:
    with pytest.raises(LockTypeError, match="AsyncLocker"):

        @locker.locked("job")
        async def job() -> None:
            pass


def test_a_function_marked_as_a_coroutine_function_needs_the_async_locker(locker: Locker) -> None:
    """Django marks an async view's ``as_view()`` so (asgiref's ``markcoroutinefunction``),
    which ``inspect`` before Python 3.12 does not see: the lock was released before the view
    ran, and the wrapper, marked too, was awaited from the event loop."""
    from asgiref.sync import markcoroutinefunction

    def view() -> None:
        pass

    with pytest.raises(LockTypeError, match="AsyncLocker"):
        locker.locked("job")(markcoroutinefunction(view))


@pytest.mark.parametrize("kind", ["generator", "async generator"])
def test_a_generator_function_is_refused_as_its_body_would_run_after_the_release(
    locker: Locker, kind: str
) -> None:
    def numbers() -> Iterator[int]:
        yield 1

    async def async_numbers() -> AsyncIterator[int]:
        yield 1

    function = numbers if kind == "generator" else async_numbers
    with pytest.raises(LockTypeError, match="generator function"):
        locker.locked("job")(function)  # type: ignore[arg-type]
    with pytest.raises(LockTypeError, match="generator function"):
        AsyncLocker("sqlite+aiosqlite://").locked("job")(function)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["coroutine", "generator"])
def test_work_returned_to_run_later_is_refused_while_the_lock_is_held(
    locker: Locker, kind: str
) -> None:
    """A function that returns its work undone (a partial of a coroutine function, Django's
    ``dispatch`` of an async view) ran it after the release, beside the next holder, every
    time. Refused at the call, the work closed unrun, and the lock released."""
    ran: list[bool] = []

    async def later() -> None:
        ran.append(True)

    def numbers() -> Iterator[int]:
        ran.append(True)
        yield 1

    @locker.locked("job")
    def job() -> object:
        return later() if kind == "coroutine" else numbers()

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a coroutine never awaited, not closed, warns
        with pytest.raises(LockTypeError, match="would run after the lock is released"):
            job()
    assert ran == []
    assert count_rows(locker) == 0


def test_a_task_returned_to_run_later_is_refused_and_cancelled(locker: Locker) -> None:
    """A sync function that starts its work as a task and returns it: refused, and the task
    cancelled before it ran (it ran after the release)."""
    ran: list[bool] = []

    async def later() -> None:
        ran.append(True)

    @locker.locked("job")
    def job() -> object:
        return asyncio.ensure_future(later())

    async def main() -> None:
        with pytest.raises(LockTypeError, match="would run after the lock is released"):
            job()
        await asyncio.sleep(0.1)

    asyncio.run(main())
    assert ran == []
    assert count_rows(locker) == 0


async def test_a_coroutine_function_runs_under_an_async_lock(
    url: str, make_locker: Callable[..., Locker], table_name: str
) -> None:
    sync = make_locker()
    alocker = AsyncLocker(async_url(url), table=table_name, grace=0)
    held: list[bool] = []

    @alocker.locked("job {n}", on_busy="raise")
    async def job(n: int) -> int:
        held.append(sync.lock_info(f"job {n}") is not None)
        return n * 2

    assert await job(21) == 42
    assert held == [True]
    with sync.lock("job 1"), pytest.raises(LockBusy):
        await job(1)
    with pytest.raises(LockTypeError, match=r"Locker\.locked"):

        @alocker.locked("plain")
        def plain() -> None:
            pass

    assert await alocker.locks() == []
    await alocker.aclose()


# -- names that identify their call -----------------------------------------------------------


class Account:
    """An object with no text of its own: its default str() is its memory address."""

    def __init__(self, number: int) -> None:
        self.number = number


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Level(enum.IntEnum):
    LOW = 1


def names(locker: Locker, template: str, calls: list[tuple[object, ...]]) -> list[str]:
    """The lockstring each call of a two-argument function decorated with ``template`` takes."""
    taken: list[str] = []

    @locker.locked(template)
    def job(a: object, b: object = None) -> None:
        taken.extend(info.lockstring for info in locker.locks())

    for call in calls:
        job(*call)
    return taken


@pytest.mark.parametrize(
    "value",
    [Account(1), {"a": 1}, [1, 2], (1, 2), {1, 2}, 1.5, b"bytes", object()],
    ids=lambda value: type(value).__name__,
)
def test_a_field_whose_text_may_not_identify_its_value_is_refused_at_the_call(
    locker: Locker, value: object
) -> None:
    calls: list[object] = []

    @locker.locked("sync {account}")
    def sync(account: object) -> None:
        calls.append(account)

    with pytest.raises(LockTypeError, match=r"sync.*\{account\}.*key=") as refused:
        sync(value)
    assert "\n" not in str(refused.value)
    assert type(value).__name__ in str(refused.value)
    assert calls == []
    assert count_rows(locker) == 0


def test_a_field_of_an_object_names_its_identifying_attribute(locker: Locker) -> None:
    @locker.locked("sync {account.number}", on_busy="raise")
    def sync(account: object) -> str | None:
        return locker.locks()[0].lockstring

    assert sync(Account(7)) == "sync 7"
    with pytest.raises(LockTypeError, match=r"\{account\.number\}.*cannot be read"):
        sync("no number")
    assert count_rows(locker) == 0


def test_values_whose_text_is_their_identity_are_accepted_and_plain_names_unchanged(
    locker: Locker,
) -> None:
    ident = uuid.UUID("12345678-1234-5678-1234-567812345678")
    utc = dt.datetime(2026, 11, 25, 9, 30, tzinfo=dt.timezone.utc)
    paris = utc.astimezone(dt.timezone(dt.timedelta(hours=1)))
    assert names(
        locker,
        "digest {a}",
        [
            (42,),
            ("a b-c%",),  # one field: nothing is encoded
            (True,),
            (dec.Decimal("1.50"),),
            (dec.Decimal("-0.00"),),
            (dt.date(2026, 11, 25),),
            (dt.datetime(2026, 11, 25, 9, 30),),
            (paris,),
            (dt.time(9, 30),),
            (ident,),
            (Colour.RED,),
            (Level.LOW,),
            (None,),
        ],
    ) == [
        "digest 42",
        "digest a b-c%",
        "digest True",
        "digest 1.5",
        "digest 0",
        "digest 2026-11-25",
        "digest 2026-11-25 09:30:00",
        "digest 2026-11-25 09:30:00+00:00",
        "digest 09:30:00",
        f"digest {ident}",
        "digest red",
        "digest 1",
        "digest None",
    ]
    assert names(locker, "report {a} {b}", [("2026-11-25", "full")]) == ["report 2026-11-25 full"]


def test_equal_values_written_differently_take_one_lock(locker: Locker) -> None:
    utc = dt.datetime(2026, 11, 25, 9, 30, tzinfo=dt.timezone.utc)
    tokyo = utc.astimezone(dt.timezone(dt.timedelta(hours=9)))
    for first, second in [
        (dec.Decimal("1.5"), dec.Decimal("1.500")),
        (dec.Decimal("100"), dec.Decimal("1E+2")),
        (utc, tokyo),
        (1, Level.LOW),
    ]:
        assert first == second
        assert len(set(names(locker, "job {a}", [(first,), (second,)]))) == 1


def test_an_aware_time_not_in_utc_is_refused(locker: Locker) -> None:
    """Equal aware times written in other offsets printed differently: two locks for one
    value, so two calls that may not run together both ran. A time has no date to bring it
    to UTC by (00:30+01:00 is not 23:30 UTC to Python): refused, as a float is."""
    utc = dt.time(9, 30, tzinfo=dt.timezone.utc)
    paris = dt.time(10, 30, tzinfo=dt.timezone(dt.timedelta(hours=1)))
    assert utc == paris
    assert names(locker, "job {a}", [(utc,)]) == ["job 09:30:00+00:00"]
    with pytest.raises(LockTypeError, match="time"):
        names(locker, "job {a}", [(paris,)])


def test_an_enum_member_whose_value_has_no_identifying_text_is_refused(locker: Locker) -> None:
    class Ratio(enum.Enum):
        HALF = 0.5

    with pytest.raises(LockTypeError, match=r"Ratio\.HALF, an Enum member whose value is a float"):
        names(locker, "job {a}", [(Ratio.HALF,)])
    assert count_rows(locker) == 0


def test_a_decimal_nan_is_refused(locker: Locker) -> None:
    with pytest.raises(LockValueError, match="NaN"):
        names(locker, "job {a}", [(dec.Decimal("NaN"),)])
    assert count_rows(locker) == 0


def test_arguments_split_differently_between_fields_take_different_locks(locker: Locker) -> None:
    seen: list[str] = []

    @locker.locked("job {a}-{b}", on_busy="raise")
    def job(a: str, b: str, inner: tuple[str, str] | None = None) -> None:
        seen.extend(info.lockstring for info in locker.locks())
        if inner is not None:
            job(*inner)  # another lock: runs, not skipped nor refused

    job("a-b", "c", inner=("a", "b-c"))
    assert seen == ["job a%2Db-c", "job a%2Db-c", "job a-b%2Dc"]
    assert count_rows(locker) == 0


def test_distinct_arguments_always_give_distinct_names(locker: Locker) -> None:
    """Every pair of short strings over the characters that could confuse a reader (the
    separators' characters, '%', hex digits), for templates with two and three fields."""
    alphabet = ["a", "-", "%", "2", "5", "D", " ", "x"]
    texts = [""] + alphabet + ["".join(pair) for pair in itertools.product(alphabet, repeat=2)]
    for template in ["{a}-{b}", "x{a}2{b}x", "{a} - {b}", "{a}5{b}", "{a}D-{b}"]:
        rendered: dict[str, tuple[str, str]] = {}
        lockstrings = LockstringTemplate(template, lambda a, b: None)
        for a, b in itertools.product(texts, repeat=2):
            name = lockstrings.render((a, b), {})
            assert rendered.setdefault(name, (a, b)) == (a, b), (template, name)
    three = LockstringTemplate("{a}-{b}-{c}", lambda a, b, c: None)
    seen: dict[str, tuple[str, ...]] = {}
    for call in itertools.product(["", "-", "%", "a-", "-%2D", "%2D"], repeat=3):
        name = three.render(call, {})
        assert seen.setdefault(name, call) == call


def test_dicts_are_refused_rather_than_named_by_their_key_order(locker: Locker) -> None:
    @locker.locked("sync {options}")
    def sync(options: dict[str, int]) -> None:
        pass

    with pytest.raises(LockTypeError, match="dict"):
        sync({"a": 1, "b": 2})


@pytest.mark.parametrize(
    "template",
    ["job {a}{b}", "job {a}%{b}", "job {a:.3}", "job {a!r}", "job {a:%Y}"],
)
def test_templates_that_could_give_two_calls_one_name_are_refused_when_decorated(
    locker: Locker, template: str
) -> None:
    with pytest.raises(LockValueError, match="key="):

        @locker.locked(template)
        def job(a: str, b: str = "") -> None:
            pass


def test_key_names_the_lock_from_the_calls_arguments(locker: Locker) -> None:
    @locker.locked(key=lambda account, **_: f"sync {account.number}", on_busy="raise")
    def sync(account: Account, full: bool = False) -> str:
        return locker.locks()[0].lockstring

    assert sync(Account(3), full=True) == "sync 3"

    @locker.locked(key=lambda account: account)
    def bad(account: object) -> None:
        pass

    with pytest.raises(LockTypeError, match="returned Account"):
        bad(Account(1))
    with pytest.raises(LockValueError, match="not both"):

        @locker.locked("sync {account}", key=lambda account: "x")
        def both(account: object) -> None:
            pass

    with pytest.raises(LockValueError, match="needs a lockstring"):

        @locker.locked()
        def nothing() -> None:
            pass

    assert count_rows(locker) == 0


def test_a_field_may_name_what_a_functions_keywords_take(locker: Locker) -> None:
    """A template's field that no parameter names is read from the function's ``**kwargs``, as
    Django's views take the URL's values; a call without it is refused before any SQL."""

    @locker.locked("page {day}", on_busy="raise")
    def page(request: object, *args: object, **kwargs: object) -> str:
        return locker.locks()[0].lockstring

    assert page("request", day="2026-11-30") == "page 2026-11-30"
    with pytest.raises(LockTypeError, match="cannot be read"):
        page("request")
    with pytest.raises(LockValueError, match="by position"):
        locker.locked("page {}")(page)
    assert count_rows(locker) == 0


def test_a_partial_of_a_bound_method_is_named_by_its_own_arguments(locker: Locker) -> None:
    """Django's ``method_decorator`` hands a decorator a partial of the bound method, its
    ``__wrapped__`` the plain function, whose ``self`` the calls do not pass."""

    class View:
        def get(self, request: object, day: str) -> str:
            return locker.locks()[0].lockstring

    def another(function: Callable[..., str]) -> Callable[..., str]:
        """A decorator method_decorator applies before ``locked`` (listed after it)."""

        @functools.wraps(function)
        def wrapper(*args: object, **kwargs: object) -> str:
            return function(*args, **kwargs)

        return wrapper

    bound = functools.wraps(View.get)(functools.partial(View().get))
    assert locker.locked("view {day}")(bound)("request", "2026-11-30") == "view 2026-11-30"
    assert locker.locked("view {request}")(bound)(request="r", day="d") == "view r"
    assert locker.locked("view {day}")(another(bound))("request", "12-01") == "view 12-01"
    assert count_rows(locker) == 0


async def test_the_async_decorator_refuses_and_separates_the_same_way(
    url: str, make_locker: Callable[..., Locker], table_name: str
) -> None:
    make_locker()
    alocker = AsyncLocker(async_url(url), table=table_name, grace=0)
    seen: list[str] = []

    @alocker.locked("job {a}-{b}", on_busy="raise")
    async def job(a: object, b: object, inner: tuple[str, str] | None = None) -> None:
        seen.extend(info.lockstring for info in await alocker.locks())
        if inner is not None:
            await job(*inner)

    with pytest.raises(LockTypeError, match="Account"):
        await job(Account(1), "c")
    assert await alocker.locks() == []
    await job("a-b", "c", inner=("a", "b-c"))
    assert seen == ["job a%2Db-c", "job a%2Db-c", "job a-b%2Dc"]
    await alocker.aclose()


def _run_workers(
    url: str, table: str, state: Path, calls: list[list[str]], asyncio: bool = False
) -> list[dict[str, object]]:
    """One ``tests.decorated_worker`` process per entry of ``calls`` (its extra arguments), all
    at once, forked from one launcher that imported it once (``tests/fleet.py``): their
    reports."""
    base = ["--url", url, "--table", table, "--state", str(state)]
    base += ["--asyncio"] if asyncio else []
    directory = Path(tempfile.mkdtemp(prefix="fleet-", dir=state))  # one of each call's own
    fleet = Fleet("tests.decorated_worker", [base + extra for extra in calls], directory)
    try:
        outcomes = fleet.wait(timeout=120)
    finally:
        fleet.kill()
    reports = []
    for outcome in outcomes:
        assert outcome.returncode == 0, outcome.err
        reports.append(json.loads(outcome.out.strip().splitlines()[-1]))
    return reports


@pytest.mark.slow
@pytest.mark.parametrize("asyncio", [False, True], ids=["sync", "asyncio"])
def test_processes_calling_with_one_name_exclude_each_other_and_with_two_run_together(
    url: str, make_locker: Callable[..., Locker], table_name: str, tmp_path: Path, asyncio: bool
) -> None:
    make_locker()
    # The same arguments: one lock, one holder at a time, every call run (wait=None).
    same = ["--a", "a-b", "--b", "c", "--marker", "same", "--count", "30"]
    reports = _run_workers(url, table_name, tmp_path, [same, same, same], asyncio)
    assert [report["overlaps"] for report in reports] == [0, 0, 0]
    assert [report["ran"] for report in reports] == [30, 30, 30]
    # Arguments split differently: two locks, so both calls are inside at once.
    first = ["--a", "a-b", "--b", "c", "--marker", "first", "--meet", "a,b-c"]
    second = ["--a", "a", "--b", "b-c", "--marker", "second", "--meet", "a-b,c"]
    reports = _run_workers(url, table_name, tmp_path, [first, second], asyncio)
    assert [report["met"] for report in reports] == [True, True]
