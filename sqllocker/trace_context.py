"""``sqllocker run`` in its caller's trace: W3C trace context in and out through the environment.

A caller that traces (a cron wrapper, a CI job, a parent process) passes its context in
``TRACEPARENT`` (and ``TRACESTATE``), as the W3C Trace Context's environment carrier does.
``run`` records its ``sqllocker.run`` span under it, with the lock's spans inside it, and gives
COMMAND the context of that span in the same variables, so that COMMAND's own spans join the
trace too. Without ``opentelemetry-api`` the variables pass on untouched; with it but no
tracer provider set (``opentelemetry-instrument`` sets one), nothing is recorded and COMMAND
gets its caller's context.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger("sqllocker")

TRACEPARENT = "TRACEPARENT"
TRACESTATE = "TRACESTATE"


@contextmanager
def joined_trace(lockstring_name: str) -> Iterator[None]:
    """Within: the current context is the caller's (from the environment), a ``sqllocker.run``
    span is current, and ``os.environ`` carries that span's context for COMMAND."""
    try:
        from opentelemetry import context, trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    except ImportError:
        yield
        return
    propagator = TraceContextTextMapPropagator()
    carrier = {
        key.lower(): os.environ[key] for key in (TRACEPARENT, TRACESTATE) if key in os.environ
    }
    parent = propagator.extract(carrier)
    token = context.attach(parent)
    try:
        attributes = {"sqllocker.kind": "lock", "sqllocker.name": lockstring_name}
        try:
            span = trace.get_tracer("sqllocker").start_span("sqllocker.run", attributes=attributes)
        except Exception:
            # A tracer or span processor that fails: the run goes on, unrecorded, and COMMAND
            # gets its caller's context.
            logger.exception("sqllocker: recording telemetry failed")
            span = None
        if span is None:
            yield
            return
        with trace.use_span(span, end_on_exit=False):
            outgoing: dict[str, str] = {}
            propagator.inject(outgoing)
            for key in (TRACEPARENT, TRACESTATE):
                os.environ.pop(key, None)  # the caller's state belongs to the caller's span
                if key.lower() in outgoing:
                    os.environ[key] = outgoing[key.lower()]
            try:
                yield
            finally:
                try:
                    span.end()
                except Exception:
                    logger.exception("sqllocker: recording telemetry failed")
    finally:
        context.detach(token)
