"""Prometheus metrics: one ``CollectorRegistry`` per app (tests build many apps in one process)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.routing import Match, Mount
from starlette.types import ASGIApp, Message, Receive, Scope, Send

PAIRING_STATUSES = ("compatible", "incompatible", "stale")
JOB_STATES = ("done", "failed")
WORKER_STATUSES = ("alive", "gone", "stopped", "stale")
#: Fragments and template runs per transfer span orders of magnitude (1 to millions).
COUNT_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576)

Counts = Callable[[], dict[str, int]]


def pairing_label(context: str, generation: str) -> str:
    """The ``pairing`` label value of a (context, generation) pair."""
    return f"{context}->{generation}"


class Metrics:
    """The app's metrics; ``pairing_counts`` is read from the database at scrape time."""

    def __init__(
        self,
        pairing_counts: Counts,
        *,
        job_counts: Counts | None = None,
        worker_counts: Counts | None = None,
    ) -> None:
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
        self.part_results = Counter(
            "kvplane_recorded_parts_total",
            "Transfer parts (one rank's side) that workers recorded, by outcome",
            ["state"],
            registry=self.registry,
        )
        self.moved_bytes = Counter(
            "kvplane_moved_bytes_total",
            "Bytes workers recorded moved, by side (send or receive)",
            ["kind"],
            registry=self.registry,
        )
        self.record_batches = Counter(
            "kvplane_record_batches_total",
            "Batches of transfer records that workers posted",
            registry=self.registry,
        )
        self.transfer_duration = Histogram(
            "kvplane_transfer_duration_seconds",
            "Executed transfers: creation to done or failed, by final status",
            ["status"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=self.registry,
        )
        self.transfers_finished = Counter(
            "kvplane_transfers_finished_total",
            "Executed transfers that reached done or failed, by status",
            ["status"],
            registry=self.registry,
        )
        self.transfer_fragments = Histogram(
            "kvplane_transfer_fragments",
            "Contiguous fragments per planned transfer, by pairing",
            ["pairing"],
            buckets=COUNT_BUCKETS,
            registry=self.registry,
        )
        self.transfer_runs = Histogram(
            "kvplane_transfer_runs",
            "Template runs (strided copies) per planned transfer, by pairing",
            ["pairing"],
            buckets=COUNT_BUCKETS,
            registry=self.registry,
        )
        self.overdue = Counter(
            "kvplane_transfers_overdue_total",
            "Dispatched transfers failed by the control plane: no report by their deadline",
            registry=self.registry,
        )
        self.registry.register(
            _CountsCollector(
                "kvplane_pairings", "Pairings by status", "status", PAIRING_STATUSES, pairing_counts
            )
        )
        if job_counts is not None:
            self.registry.register(
                _CountsCollector(
                    "kvplane_transfer_parts",
                    "Recorded transfer parts by state",
                    "state",
                    JOB_STATES,
                    job_counts,
                )
            )
        if worker_counts is not None:
            self.registry.register(
                _CountsCollector(
                    "kvplane_workers",
                    "Registered workers by status",
                    "status",
                    WORKER_STATUSES,
                    worker_counts,
                )
            )

    def transfer_planned(
        self, *, context: str, generation: str, bytes_: int, fragments: int, runs: int
    ) -> None:
        """A new transfer was planned (not a replay)."""
        pairing = pairing_label(context, generation)
        self.transfers.inc()
        self.transfer_bytes.inc(bytes_)
        self.transfer_fragments.labels(pairing).observe(fragments)
        self.transfer_runs.labels(pairing).observe(runs)

    def transfers_settled(self, finished: Iterable[tuple[str, float]]) -> None:
        """Transfers that just became done or failed: ``(status, seconds since creation)``."""
        for status, seconds in finished:
            self.transfers_finished.labels(status).inc()
            self.transfer_duration.labels(status).observe(max(0.0, seconds))


class _CountsCollector(Collector):
    """A gauge family read from the database at scrape time (same value in every process)."""

    def __init__(
        self, name: str, documentation: str, label: str, known: tuple[str, ...], counts: Counts
    ) -> None:
        self._name = name
        self._documentation = documentation
        self._label = label
        self._known = known
        self._counts = counts

    def _family(self) -> GaugeMetricFamily:
        return GaugeMetricFamily(self._name, self._documentation, labels=[self._label])

    def describe(self) -> Iterable[Metric]:
        return [self._family()]

    def collect(self) -> Iterable[Metric]:
        family = self._family()
        try:
            counts = self._counts()
        except Exception:  # a scrape must not fail because the database is busy
            return [family]
        for value in sorted(set(self._known) | set(counts)):
            family.add_metric([value], counts.get(value, 0))
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

        # The router rewrites ``root_path`` for mounts: match on the scope as it came in.
        incoming = dict(scope)
        try:
            await self.app(scope, receive, _send)
        finally:
            self.metrics.http_duration.labels(
                scope["method"], _route_template(scope, incoming), str(status)
            ).observe(time.perf_counter() - start)


def _route_template(scope: Scope, incoming: Scope) -> str:
    """The path template that served ``scope``, or ``unmatched``.

    FastAPI's API routes leave themselves in ``scope["route"]``; Starlette's plain routes
    (``/openapi.json``) and mounts (static files) do not, so they are matched here again
    against the ``incoming`` scope.
    """
    route: Any = scope.get("route")
    template = getattr(route, "path", None)
    if template:
        return str(template)
    app: Any = scope.get("app")
    for candidate in getattr(getattr(app, "router", None), "routes", ()):
        match, _ = candidate.matches(incoming)
        if match is Match.FULL:
            path = str(getattr(candidate, "path", "") or "")
            return path + "/{path}" if isinstance(candidate, Mount) else path or "unmatched"
    return "unmatched"
