"""The sync front end is generated from the async one (tests/unasync.py): it must be up to date,
marked as generated, and the hand-written async modules must not repeat their sync twins."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests import unasync

SYNC_DIR = unasync.SYNC_DIR
ASYNC_DIR = unasync.ASYNC_DIR
# Lines too common to say anything: imports, and short idioms such as ``) -> None:``.
SHORTEST_COUNTED = 16


@pytest.mark.parametrize("source", unasync.MODULES)
def test_each_generated_module_is_up_to_date(source: str) -> None:
    written = (SYNC_DIR / source).read_text()
    assert written.startswith("# Generated from sqllocker/asyncio/"), f"{source} is not marked"
    assert written == unasync.generate(source), (
        f"sqllocker/{source} is stale: edit sqllocker/asyncio/{source}, then run "
        "`python -m tests.unasync`"
    )


def _generated(path: Path) -> bool:
    return path.read_text().startswith("# Generated")


def _normalised(line: str) -> str:
    """A line as it would read in sync code."""
    line = line.strip()
    line = re.sub(r"\basync (def|with|for)\b", r"\1", line)
    line = re.sub(r"\bawait ", "", line)
    return re.sub(r"\bAsync(?=[A-Z])", "", line)


def _counted(line: str) -> bool:
    return not line.startswith(("#", "import ", "from ")) and len(line) >= SHORTEST_COUNTED


def repeated_lines(async_dir: Path = ASYNC_DIR, sync_dir: Path = SYNC_DIR) -> dict[str, list[str]]:
    """Per hand-written module of ``async_dir``: its lines that repeat a line of its
    hand-written sync twin (the module of the same name in ``sync_dir``)."""
    repeated: dict[str, list[str]] = {}
    for path in sorted(async_dir.glob("*.py")):
        twin = sync_dir / path.name
        if not twin.exists() or _generated(twin):
            continue
        sync_lines = {_normalised(line) for line in twin.read_text().splitlines()}
        lines = [_normalised(line) for line in path.read_text().splitlines()]
        repeated[path.name] = [line for line in lines if _counted(line) and line in sync_lines]
    return repeated


def test_the_async_front_end_repeats_fewer_than_100_lines_of_the_sync_one() -> None:
    repeated = repeated_lines()
    total = sum(map(len, repeated.values()))
    print(f"repeated lines: {total}", {name: len(lines) for name, lines in repeated.items()})
    assert total < 100, repeated


def test_the_count_sees_a_hand_written_twin(tmp_path: Path) -> None:
    """The count is not vacuous: the sync locker, were it written by hand (the generated one
    without its mark), would repeat hundreds of lines of the async one."""
    (tmp_path / "async").mkdir()
    (tmp_path / "sync").mkdir()
    (tmp_path / "async" / "locker.py").write_text((ASYNC_DIR / "locker.py").read_text())
    generated = (SYNC_DIR / "locker.py").read_text()
    (tmp_path / "sync" / "locker.py").write_text(generated.replace("# Generated", "#", 1))
    repeated = repeated_lines(tmp_path / "async", tmp_path / "sync")
    assert len(repeated["locker.py"]) > 200


# -- the rewrite itself ----------------------------------------------------------------------------


def test_an_async_block_becomes_its_else_block() -> None:
    source = """\
class Thing:
    async def go(self) -> None:
        if True:  # ASYNC
            await asyncio.sleep(1)

        else:
            time.sleep(1)
            if x:
                y()
        done()

    if True:  # ASYNC

        async def only_async(self) -> None:
            pass
"""
    expected = """\
class Thing:
    def go(self) -> None:
        time.sleep(1)
        if x:
            y()
        done()

"""  # the blank line before the dropped block stays: ruff's formatting removes it
    assert unasync.unasync(source) == expected


def test_names_and_types_become_their_sync_twins() -> None:
    source = """\
from ..errors import LockError
from .lock import AsyncLock
async def f(g: Callable[[AsyncLock], Awaitable[list[int]]]) -> AsyncLockGroup:
    \"\"\"Returns an AsyncLockGroup; see sqllocker.asyncio.AsyncLocker.\"\"\"
    async with x:
        return await g(await h())
"""
    expected = """\
from .errors import LockError
from .lock import Lock
def f(g: Callable[[Lock], list[int]]) -> LockGroup:
    \"\"\"Returns a LockGroup; see sqllocker.asyncio.AsyncLocker.\"\"\"
    with x:
        return g(h())
"""
    assert unasync.unasync(source) == expected
