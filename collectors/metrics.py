"""The collector's own Prometheus metrics: how long scrapes take, what fails, what is written."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


@dataclass
class CollectorMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.scrape_seconds = Histogram(
            "kvctl_collector_scrape_duration_seconds",
            "Time to scrape one target.",
            ["kind"],
            registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.errors = Counter(
            "kvctl_collector_scrape_errors_total", "Scrapes that failed.", ["kind"], registry=r
        )
        self.rows = Counter(
            "kvctl_collector_rows_written_total", "Rows written, per table.", ["table"], registry=r
        )
        self.cycle_seconds = Histogram(
            "kvctl_collector_cycle_duration_seconds",
            "Time of one whole scrape cycle, writes included.",
            registry=r,
        )
        self.nodes = Gauge(
            "kvctl_collector_nodes",
            "Nodes in the last cycle, by state: up, down, token_refused, starting (the last two "
            "answered, their figures unread).",
            ["state"],
            registry=r,
        )
        self.rejected = Counter(
            "kvctl_collector_rejected_values_total",
            "Figures of answers rejected as impossible (not finite, negative, a ratio outside "
            "[0, 1], beyond BIGINT, missing) and stored as unknown.",
            ["kind"],
            registry=r,
        )
        self.db_errors = Counter(
            "kvctl_collector_db_errors_total", "Batches the database refused.", registry=r
        )

    def serve(self, host: str, port: int) -> tuple[Any, int]:
        """Serve /metrics on ``host:port`` in a thread; returns the server and its bound port."""
        from prometheus_client import start_http_server

        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server, server.server_port
