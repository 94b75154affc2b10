"""The command line's ``--wait``: seconds (0 or more), or ``forever``."""

from __future__ import annotations

import math

import click

FOREVER = math.inf


def wait_seconds(ctx: click.Context, param: click.Parameter, value: str | None) -> float | None:
    """A click callback: ``value`` as seconds (``FOREVER`` for ``forever``), None if not given."""
    if value is None:
        return None
    text = value.strip()
    if text.lower() == "forever":
        return FOREVER
    try:
        seconds = float(text)
    except ValueError:
        raise click.BadParameter(f"{text!r} is neither seconds nor 'forever'", ctx, param) from None
    if math.isnan(seconds) or seconds < 0 or math.isinf(seconds):
        raise click.BadParameter(f"{text!r} is not 0 or more seconds", ctx, param)
    return seconds
