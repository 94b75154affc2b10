"""Write the sync front end from the async one: ``python -m tests.unasync`` (``--check`` in CI).

The wait loop, the lock handle, the group, the semaphore and the release listener are written
once, for asyncio, in ``sqllocker/asyncio/``; their sync twins in
``sqllocker/`` are generated from them, as httpcore generates its sync code. A line-based
rewrite, as psycopg's ``async_to_sync`` does it:

- ``async def``/``async with``/``async for`` lose ``async``; ``await`` goes; ``__aenter__``,
  ``__aexit__`` and ``aclose`` become their sync names; ``AsyncX`` becomes ``X``;
  ``Awaitable[T]`` becomes ``T``; ``from ..x`` becomes ``from .x``.
- A block under ``if True:  # ASYNC`` is the async code only: the sync code is its ``else:``
  block (or nothing). The rest of what differs between threads and asyncio lives in the two
  hand-written ``concurrency`` modules, which the generated code imports under the same name.

The output is then formatted and its imports sorted by ruff, so that it passes the same checks
as hand-written code.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ASYNC_DIR = ROOT / "sqllocker" / "asyncio"
SYNC_DIR = ROOT / "sqllocker"
MODULES = [
    "acquirer.py",
    "acquiring.py",
    "attempts.py",
    "decorating.py",
    "election.py",
    "group.py",
    "listener.py",
    "lock.py",
    "locker.py",
    "queue_wait.py",
    "rwlock.py",
    "semaphore.py",
    "ticket_wait.py",
]

ASYNC_BLOCK = re.compile(r"^(?P<indent> *)if True:  # ASYNC$")
SUBSTITUTIONS = [
    (re.compile(r"\basync (def|with|for)\b"), r"\1"),
    (re.compile(r"\bawait "), ""),
    (re.compile(r"\b__aenter__\b"), "__enter__"),
    (re.compile(r"\b__aexit__\b"), "__exit__"),
    (re.compile(r"\baclose\b"), "close"),
    (re.compile(r"\b([Aa])n Async(?=[A-Z])"), r"\1 "),
    (re.compile(r"(?<!sqllocker\.asyncio\.)\bAsync(?=[A-Z])"), ""),
    (re.compile(r"\bAcquiring\b"), "Lock"),
    (re.compile(r"\bsqlalchemy\.ext\.asyncio\b"), "sqlalchemy.engine"),
    (re.compile(r"^(\s*)from \.\.(?=[ \w])", re.MULTILINE), r"\1from ."),
]


def header(source: str) -> str:
    return (
        f"# Generated from sqllocker/asyncio/{source} by tests/unasync.py: edit that file, then\n"
        "# run `python -m tests.unasync`.\n"
    )


def strip_awaitable(line: str) -> str:
    """``Awaitable[X]`` becomes ``X``, brackets inside ``X`` and all."""
    while (start := line.find("Awaitable[")) != -1:
        depth, end = 0, start + len("Awaitable")
        for end in range(end, len(line)):
            depth += {"[": 1, "]": -1}.get(line[end], 0)
            if depth == 0:
                break
        line = line[:start] + line[start + len("Awaitable[") : end] + line[end + 1 :]
    return line


def _block_end(lines: list[str], start: int, indent: int) -> int:
    """The index after the block whose first body line is ``start`` (deeper than ``indent``)."""
    end = start
    while end < len(lines) and (
        not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) > indent
    ):
        end += 1
    while end > start and not lines[end - 1].strip():
        end -= 1  # trailing blank lines belong to what follows
    return end


def drop_async_blocks(lines: list[str]) -> list[str]:
    """Each ``if True:  # ASYNC`` block replaced by its ``else:`` block's body, dedented."""
    out: list[str] = []
    index = 0
    while index < len(lines):
        match = ASYNC_BLOCK.match(lines[index])
        if match is None:
            out.append(lines[index])
            index += 1
            continue
        indent = len(match["indent"])
        index = _block_end(lines, index + 1, indent)
        following = index
        while following < len(lines) and not lines[following].strip():
            following += 1
        if following < len(lines) and lines[following].rstrip() == " " * indent + "else:":
            end = _block_end(lines, following + 1, indent)
            out.extend(line[4:] if line.strip() else line for line in lines[following + 1 : end])
            index = end
    return out


def unasync(text: str) -> str:
    lines = drop_async_blocks(text.splitlines())
    converted = "\n".join(lines) + "\n"
    for pattern, replacement in SUBSTITUTIONS:
        converted = pattern.sub(replacement, converted)
    return "\n".join(strip_awaitable(line) for line in converted.splitlines()) + "\n"


def _ruff(arguments: list[str], text: str, path: Path) -> str:
    command = [sys.executable, "-m", "ruff", *arguments, "--stdin-filename", str(path), "-"]
    done = subprocess.run(command, input=text, capture_output=True, text=True, cwd=ROOT)
    if done.returncode not in (0, 1) or not done.stdout:
        raise RuntimeError(f"ruff {' '.join(arguments)} failed on {path}: {done.stderr}")
    return done.stdout


def generate(source: str) -> str:
    """The sync module generated from ``sqllocker/asyncio/<source>``."""
    target = SYNC_DIR / source
    text = unasync((ASYNC_DIR / source).read_text())
    fixes = ["check", "--fix", "--quiet", "--select", "I,F401,RUF022", "--exit-zero"]
    text = _ruff(fixes, text, target)
    return header(source) + _ruff(["format", "--quiet"], text, target)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a generated file is stale")
    check = parser.parse_args(argv).check
    stale = []
    for source in MODULES:
        target = SYNC_DIR / source
        text = generate(source)
        if target.exists() and target.read_text() == text:
            continue
        stale.append(str(target.relative_to(ROOT)))
        if not check:
            target.write_text(text)
    if stale:
        verb = "stale (run `python -m tests.unasync`)" if check else "written"
        print(f"{verb}: {', '.join(stale)}")
    return 1 if check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
