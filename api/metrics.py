"""Prometheus metrics: one ``CollectorRegistry`` per app (tests build many apps in one process)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

PAIRING_STATUSES = ("compatible", "incompatible", "stale")


class Metrics:
    """The app's metrics; ``pairing_counts`` is read from the database at scrape time."""

    def __init__(self, pairing_counts: Callable[[], dict[str, int]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registrations = Counter(
            "kvplane_registrations_total",
            "Instance and rank registrations, by kind and outcome",
            ["kind", "outcome"],
            registry=self.registry,
        )
        self.transfers = Counter(
            "kvplane_transfers_total", "Transfers planned", registry=self.registry
        )
        self.transfer_bytes = Counter(
            "kvplane_transfer_bytes_total", "Bytes of planned transfers", registry=self.registry
        )
        self.http_duration = Histogram(
            "kvplane_http_request_duration_seconds",
            "HTTP request duration by route template, method and status",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.worker_heartbeats = Counter(
            "kvplane_worker_heartbeats_total",
            "Worker registrations and heartbeats",
            registry=self.registry,
        )
        self.jobs_claimed = Counter(
            "kvplane_jobs_claimed_total", "Jobs leased by workers", registry=self.registry
        )
        self.job_results = Counter(
            "kvplane_job_results_total",
            "Jobs reported by workers, by outcome",
            ["state"],
            registry=self.registry,
        )
        self.moved_bytes = Counter(
            "kvplane_moved_bytes_total",
            "Bytes workers reported moved, by job kind",
            ["kind"],
            registry=self.registry,
        )
        self.transfer_duration = Histogram(
            "kvplane_transfer_duration_seconds",
            "Executed transfers: creation to done",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=self.registry,
        )
        self.registry.register(_PairingCollector(pairing_counts))


class _PairingCollector(Collector):
    def __init__(self, pairing_counts: Callable[[], dict[str, int]]) -> None:
        self._counts = pairing_counts

    def describe(self) -> Iterable[Metric]:
        return [GaugeMetricFamily("kvplane_pairings", "Pairings by status", labels=["status"])]

    def collect(self) -> Iterable[Metric]:
        family = GaugeMetricFamily("kvplane_pairings", "Pairings by status", labels=["status"])
        try:
            counts = self._counts()
        except Exception:  # a scrape must not fail because the database is busy
            return [family]
        for status in sorted(set(PAIRING_STATUSES) | set(counts)):
            family.add_metric([status], counts.get(status, 0))
        return [family]


class TimingMiddleware:
    """Observes every HTTP request's duration, labelled by the matched route template."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def _send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, _send)
        finally:
            route: Any = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            self.metrics.http_duration.labels(scope["method"], template, str(status)).observe(
                time.perf_counter() - start
            )
