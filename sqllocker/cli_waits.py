"""The command line's periods: ``--wait``, seconds (0 or more) or ``forever``, and the others
(``Seconds``), finite numbers of seconds."""

from __future__ import annotations

import math
from typing import Any

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


class Seconds(click.types.FloatParamType):
    """A finite number of seconds, above 0 (``positive``) or at least 0: a bad value is a usage
    error (exit 2), as click's ``FloatRange`` gives, which lets ``nan`` and ``inf`` through."""

    name = "seconds"

    def __init__(self, *, positive: bool) -> None:
        self.positive = positive

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> float:
        seconds = super().convert(value, param, ctx)
        if not math.isfinite(seconds) or seconds < 0 or (self.positive and seconds == 0):
            wanted = "more than 0" if self.positive else "0 or more"
            self.fail(f"{value!r} is not {wanted} seconds", param, ctx)
        return seconds


POSITIVE_SECONDS = Seconds(positive=True)
SECONDS = Seconds(positive=False)
