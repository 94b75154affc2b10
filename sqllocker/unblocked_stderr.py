"""sqllocker's own lines on stderr, while ``sqllocker run`` holds a lock, written by a thread of
their own: a stderr that blocks (a full pipe nobody reads) must hold up neither the run's main
thread, which stops what the command left and releases the lock, nor the keep-alive, which
logs a lost lock before it calls the run's ``on_lost``, which stops the command."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import queue
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

# How long the end of a run waits for its last lines to be written.
FLUSH_SECONDS = 1.0


class _Writer(io.TextIOBase):
    """A stream whose writes are queued and written to ``stream`` by a daemon thread: with
    ``os.write`` where it has a file descriptor, so that a thread blocked in it holds none of
    the stream's own locks, which the interpreter takes at exit."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__()
        self._stream = stream
        with contextlib.suppress(OSError, ValueError):  # what was written to it before, first
            stream.flush()
        try:
            self._fd: int | None = stream.fileno()
        except (OSError, ValueError):  # io.UnsupportedOperation: a StringIO, say
            self._fd = None
        self._lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._write, name="sqllocker-stderr", daemon=True)
        self._thread.start()

    def write(self, text: str) -> int:
        self._lines.put(text)
        return len(text)

    def flush(self) -> None:
        pass

    def end(self, within: float) -> None:
        """Write what is queued, waiting ``within`` seconds at most."""
        self._lines.put(None)
        self._thread.join(within)

    def _write(self) -> None:
        while (text := self._lines.get()) is not None:
            with contextlib.suppress(OSError, ValueError):  # closed, or its reader gone
                if self._fd is None:
                    self._stream.write(text)
                    self._stream.flush()
                    continue
                data = text.encode(self._stream.encoding or "utf-8", "replace")
                while data:
                    data = data[os.write(self._fd, data) :]


@contextmanager
def unblocked_stderr() -> Iterator[None]:
    """Within: ``sys.stderr``, and the logging handlers that write to it, write through a
    ``_Writer``."""
    stream = sys.stderr
    if stream is None:  # closed when sqllocker started (``2>&-``)
        yield
        return
    writer = _Writer(stream)
    handlers = [
        handler
        for logger in (logging.getLogger(), logging.getLogger("sqllocker"))
        for handler in logger.handlers
        if isinstance(handler, logging.StreamHandler) and handler.stream is stream
    ]
    sys.stderr = writer
    for handler in handlers:
        handler.setStream(writer)
    try:
        yield
    finally:
        sys.stderr = stream
        for handler in handlers:
            handler.setStream(stream)
        writer.end(FLUSH_SECONDS)
