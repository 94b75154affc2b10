"""``sqllocker exporter``: the lock table as Prometheus metrics, read on each scrape.

Needs ``prometheus_client`` (``pip install 'sqllocker[exporter]'``). Each scrape takes a
census of the table (``sqllocker.census``) on its own; when the database cannot be reached the
scrape still answers, with ``sqllocker_up 0`` and nothing else about the table, so that the
outage is a series to alert on rather than a failed scrape.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from .census import TableCensus, take_census
from .errors import UNREADABLE_VALUE, LockError, LockValueError, one_line, unreadable_row

if TYPE_CHECKING:
    from prometheus_client.registry import CollectorRegistry

logger = logging.getLogger("sqllocker")

DEFAULT_MAX_SERIES = 100
# Prometheus gives up on a scrape after its scrape_timeout (10 s by default): the census must
# answer sooner, with sqllocker_up 0, when the database is slow to, or a network stalls.
DEFAULT_SCRAPE_TIMEOUT = 5.0


@dataclass(frozen=True)
class ExporterOptions:
    table: str
    per_lock: str | None = None  # glob of the lockstrings that get series of their own
    max_series: int = DEFAULT_MAX_SERIES  # at most this many lockstrings get them
    timeout: float = DEFAULT_SCRAPE_TIMEOUT  # how long a census may take


class TableCollector:
    """A prometheus_client collector whose every ``collect`` reads the table anew."""

    def __init__(self, engine: sa.Engine, options: ExporterOptions) -> None:
        self._engine = engine
        self._options = options
        # One census at a time: concurrent scrapes would each open a connection.
        self._turn = threading.Lock()

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        options = self._options
        census = self._census()
        up = GaugeMetricFamily(
            "sqllocker_up", "1 when the database answered this scrape, else 0", labels=["table"]
        )
        up.add_metric([options.table], 0 if census is None else 1)
        yield up
        if census is None:
            return
        table = [census.table]
        families = {
            "held": GaugeMetricFamily(
                "sqllocker_locks_held",
                "Unexpired locks (a writer's two rows count once; semaphores' turns not at all)",
                labels=["table"],
            ),
            "kinds": GaugeMetricFamily(
                "sqllocker_locks_held_by_kind",
                "Unexpired locks told apart by their rows: readers, writers and permits",
                labels=["table", "kind"],
            ),
            "turns": GaugeMetricFamily(
                "sqllocker_semaphore_turns",
                "Semaphores' turns: waiters with a smaller limit holding newcomers back",
                labels=["table"],
            ),
            "expired": GaugeMetricFamily(
                "sqllocker_locks_expired",
                "Expired rows the purge has not deleted yet",
                labels=["table"],
            ),
            "oldest": GaugeMetricFamily(
                "sqllocker_lock_oldest_held_seconds",
                "How long the oldest unexpired lock has been held (0: none is)",
                labels=["table"],
            ),
        }
        families["held"].add_metric(table, census.held)
        for kind, count in census.held_by_kind.items():
            families["kinds"].add_metric([census.table, kind], count)
        families["turns"].add_metric(table, census.turns)
        families["expired"].add_metric(table, census.expired)
        families["oldest"].add_metric(table, census.oldest_held_seconds)
        yield from families.values()
        if census.waiters is not None:
            waiters = GaugeMetricFamily(
                "sqllocker_waiters", "Waiters queued for locks (live tickets)", labels=["table"]
            )
            waiters.add_metric(table, census.waiters)
            yield waiters
        if options.per_lock is None:
            return
        per_lock = {
            "held": GaugeMetricFamily(
                "sqllocker_lock_held",
                "1 while the lockstring's row is unexpired, 0 once expired",
                labels=["table", "lockstring"],
            ),
            "age": GaugeMetricFamily(
                "sqllocker_lock_held_seconds",
                "How long the lockstring's row has existed",
                labels=["table", "lockstring"],
            ),
            "left": GaugeMetricFamily(
                "sqllocker_lock_expires_in_seconds",
                "Seconds until the lockstring's row expires (negative once expired)",
                labels=["table", "lockstring"],
            ),
            "waiters": GaugeMetricFamily(
                "sqllocker_lock_waiters",
                "Waiters queued for the lockstring",
                labels=["table", "lockstring"],
            ),
            "kind": GaugeMetricFamily(
                "sqllocker_lock_kind",
                "1, labelled by what the row is: lock, permit, turn, reader or writer",
                labels=["table", "lockstring", "kind"],
            ),
        }
        for lock in census.locks:
            labels = [census.table, lock.lockstring]
            per_lock["held"].add_metric(labels, 0 if lock.expired else 1)
            per_lock["age"].add_metric(labels, lock.held_seconds)
            per_lock["left"].add_metric(labels, lock.seconds_left)
            if lock.waiters is not None:
                per_lock["waiters"].add_metric(labels, lock.waiters)
            per_lock["kind"].add_metric([*labels, lock.kind], 1)
        yield from per_lock.values()
        truncated = GaugeMetricFamily(
            "sqllocker_lock_series_truncated",
            "1 when more lockstrings matched --per-lock than --max-series allows",
            labels=["table"],
        )
        truncated.add_metric(table, 1 if census.more_locks else 0)
        yield truncated

    def _census(self) -> TableCensus | None:
        """The census, or None if the database did not answer within the timeout. A census
        still running from an earlier scrape (a stalled connection) is not joined: it ends on
        its own, at the latest when the driver's timeouts end its statement."""
        options = self._options
        deadline = time.monotonic() + options.timeout
        if not self._turn.acquire(timeout=options.timeout):
            logger.warning("scrape: an earlier census is still waiting for the database")
            return None
        result: list[TableCensus | None] = []

        def take() -> None:
            try:
                result.append(
                    take_census(self._engine, options.table, options.per_lock, options.max_series)
                )
            except (*UNREADABLE_VALUE, sa.exc.DataError) as error:
                # (DataError: the driver's own, PostgreSQL's 'infinity' to psycopg.)
                logger.warning("scrape: %s", unreadable_row(options.table, "", error))
                result.append(None)
            except sa.exc.SQLAlchemyError as error:
                logger.warning("scrape: the database did not answer: %s", one_line(error))
                result.append(None)
            except Exception:
                logger.exception("scrape: the census failed")
                result.append(None)
            finally:
                self._turn.release()

        worker = threading.Thread(target=take, name="sqllocker-census", daemon=True)
        worker.start()
        worker.join(max(0.0, deadline - time.monotonic()))
        if not result:
            if worker.is_alive():
                logger.warning("scrape: the database did not answer within %gs", options.timeout)
            return None
        return result[0]


def registry_for(engine: sa.Engine, options: ExporterOptions) -> CollectorRegistry:
    """A registry holding only the table's collector (not the exporter process's own
    metrics, which would tell operators about this process rather than about their locks)."""
    registry: CollectorRegistry = _prometheus().CollectorRegistry(auto_describe=False)
    registry.register(TableCollector(engine, options))
    return registry


def serve(engine: sa.Engine, options: ExporterOptions, host: str, port: int) -> None:
    """Serve ``/metrics`` on ``host:port`` until the process is stopped."""
    prometheus = _prometheus()
    try:
        server, thread = prometheus.start_http_server(port, host, registry_for(engine, options))
    except OSError as error:  # the port taken, an address not this machine's
        raise LockError(f"cannot serve on {host}:{port}: {one_line(error)}") from None
    logger.info("serving /metrics on %s:%d", host, server.server_port)
    thread.join()


def parse_listen(listen: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:9100`` for IPv6) as host and port."""
    host, colon, port = listen.rpartition(":")
    if not colon or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise LockValueError(f"--listen must be HOST:PORT, not {listen!r}")
    return host.strip("[]") or "0.0.0.0", int(port)  # noqa: S104 (HOST left out: every address)


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise LockValueError(
            "the exporter needs prometheus_client: pip install 'sqllocker[exporter]'"
        ) from None
    return prometheus_client
