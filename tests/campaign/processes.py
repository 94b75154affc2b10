"""How a campaign starts its processes: forked from servers that imported the workers, the
drivers and the command line once (``tests/fork_server.py``), each still a process of its own.

The campaign forks its launcher first thing, before it connects to anything or starts a
thread, so there is one per campaign, with the campaign's environment (a mutant is applied by
each worker and each ``run`` as it starts, never in a server). The launcher hands each worker
over to the campaign, its parent as before (a child subreaper), in a time namespace after a
clock fault; so too the nemesis's ``purge-expired`` and ``release --force``. A sync worker
forks a server of its own as it starts, before it applies its mutant or connects: its
``sqllocker run`` processes are that server's children, so the worker's descendants, and go
on when the worker is killed, as processes it had started itself would. They are named
``RUNNER_NAME``, which the nemesis looks for, since their command lines are the server's.
"""

from __future__ import annotations

import importlib

from tests import preloading
from tests.fork_server import Server, module_name, run_module

RUNNER = "tests.campaign.sqllocker_cli"  # the module a worker's ``sqllocker run`` runs
RUNNER_NAME = module_name(["-m", RUNNER])
IMPORTED = ("tests.campaign.worker", "tests.campaign.async_worker", "sqllocker.cli")


def preload(*backends: str) -> None:
    """Import what the campaign's processes run: the workers, the command line, and the
    drivers of ``backends`` (sync and asyncio)."""
    for module in IMPORTED:
        importlib.import_module(module)
    preloading.backends(*backends)


def launcher(backend: str) -> Server:
    """The campaign's fork server, with what its processes run on ``backend`` imported: call
    it before connecting or starting a thread."""
    preload(backend)
    return Server.fork(run_module)
