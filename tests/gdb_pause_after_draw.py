"""Sourced by gdb, attached in non-stop mode to a private mariadbd (tests/test_fencing.py).

The next server thread to draw an auto-increment value stops right after the draw, before its
row meets the table's indexes, and stays stopped until gdb is told ``python release_paused()``;
every other thread runs on. This is the moment in which MariaDB's InnoDB, like PostgreSQL's
sequence, has handed out an id for a row that may not be inserted yet. MariaDB runs no trigger
there (a BEFORE INSERT trigger runs before the draw), so only a debugger can widen it.

Nothing blocks in these handlers: gdb must stay free to let the server's new threads run.
"""

from __future__ import annotations

import os
from typing import Any

import gdb  # type: ignore[import-not-found]

SIGNALS = os.environ["PAUSE_DIR"]  # where "armed" and "drawn" files tell the test how far it got
DRAW = "handler::update_auto_increment"

state: dict[str, Any] = {"phase": "armed", "paused": None}
entry = int(gdb.parse_and_eval(f"(long)&'{DRAW}'"))
# At the function's first instruction the stack's top is the return address (no prologue yet).
draw_breakpoint = gdb.Breakpoint(f"*{entry:#x}", internal=True)


def signal_test(name: str) -> None:
    open(os.path.join(SIGNALS, name), "w").close()


def resume(thread: Any) -> None:
    def go() -> None:
        thread.switch()
        gdb.execute("continue &")

    gdb.post_event(go)


def release_paused() -> None:
    state["phase"] = "released"
    resume(state["paused"])


def on_stop(event: Any) -> None:
    thread = getattr(event, "inferior_thread", None)
    if thread is None:
        return
    if isinstance(event, gdb.BreakpointEvent) and state["phase"] == "armed":
        thread.switch()
        back = int(gdb.parse_and_eval("*(unsigned long *)$sp"))
        draw_breakpoint.enabled = False
        gdb.Breakpoint(f"*{back:#x}", temporary=True, internal=True)
        state["phase"] = "drawing"
    elif isinstance(event, gdb.BreakpointEvent) and state["phase"] == "drawing":
        state["phase"] = "paused"
        state["paused"] = thread
        signal_test("drawn")
        return  # stays stopped, its id drawn
    resume(thread)  # the draw's entry, or a thread stopped by the attach


gdb.events.stop.connect(on_stop)
gdb.execute("continue -a &")
signal_test("armed")
