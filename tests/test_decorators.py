"""``@locker.locked(...)``: a function (or coroutine function) that runs under a lock named from
its arguments."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from sqllocker import LockBusy, Locker, LockLost, LockTypeError, LockValueError
from sqllocker.asyncio import AsyncLocker
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
