"""Prometheus metrics of a worker process.

``kvplane worker --metrics-port P`` serves prometheus_client's default registry on ``P``
(``/metrics``): handovers by peer instance, side and outcome, their latency, bytes moved,
verified bytes, the record's backlog. An engine embedding :class:`~workers.agent.Worker` calls
:func:`instrument` itself (and ``prometheus_client.start_http_server`` or its own exporter).

:func:`instrument` subscribes to the worker's finished handles (``Worker.add_listener``): it
runs on the hot path's progress thread, so it only increments counters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from workers.agent import Worker
    from workers.handover import Handle

LATENCY_BUCKETS_S = (
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
)


@dataclass
class WorkerMetrics:
    """The worker's metric families, on one registry."""

    handovers: Counter
    bytes_moved: Counter
    handover_seconds: Histogram
    verified_bytes: Counter
    info: Gauge

    @classmethod
    def create(cls, registry: CollectorRegistry) -> WorkerMetrics:
        return cls(
            handovers=Counter(
                "kvplane_worker_handovers_total",
                "Handles resolved by this worker, by peer instance, side (send, receive) and "
                "outcome (released, arrived, failed)",
                ["peer", "side", "outcome"],
                registry=registry,
            ),
            bytes_moved=Counter(
                "kvplane_worker_bytes_moved_total",
                "Bytes of completed handovers, by peer instance and side",
                ["peer", "side"],
                registry=registry,
            ),
            handover_seconds=Histogram(
                "kvplane_worker_handover_seconds",
                "From send/expect to the handle's outcome, by peer instance, side and outcome",
                ["peer", "side", "outcome"],
                buckets=LATENCY_BUCKETS_S,
                registry=registry,
            ),
            verified_bytes=Counter(
                "kvplane_worker_verified_bytes_total",
                "Pool bytes checked after verified transfers (fill-pattern workers)",
                registry=registry,
            ),
            info=Gauge(
                "kvplane_worker_info",
                "The rank this worker serves (value 1)",
                ["kv_instance", "rank", "device", "worker_id"],
                registry=registry,
            ),
        )


_default: WorkerMetrics | None = None


def default_metrics() -> WorkerMetrics:
    """The metrics on prometheus_client's default registry (created once per process)."""
    global _default
    if _default is None:
        _default = WorkerMetrics.create(REGISTRY)
    return _default


def instrument(worker: Worker, metrics: WorkerMetrics | None = None) -> WorkerMetrics:
    """Count ``worker``'s handovers in ``metrics``; idempotent."""
    metrics = metrics or default_metrics()
    known: list[WorkerMetrics] = getattr(worker, "_kvplane_metrics", [])
    if any(m is metrics for m in known):
        return metrics
    verified = [worker.stats.verified_bytes]

    def observe(handle: Handle) -> None:
        peer = handle.peer
        metrics.handovers.labels(peer, handle.side, handle.state).inc()
        if handle.duration_s is not None:
            metrics.handover_seconds.labels(peer, handle.side, handle.state).observe(
                handle.duration_s
            )
        if handle.ok:
            metrics.bytes_moved.labels(peer, handle.side).inc(handle.bytes)
        now = worker.stats.verified_bytes
        metrics.verified_bytes.inc(max(0, now - verified[0]))
        verified[0] = now

    worker.add_listener(observe)
    worker._kvplane_metrics = [*known, metrics]  # type: ignore[attr-defined]
    return metrics


def describe_worker(worker: Worker, metrics: WorkerMetrics | None = None) -> None:
    """Publish ``kvplane_worker_info`` for an attached worker."""
    metrics = metrics or default_metrics()
    metrics.info.labels(
        worker.instance, str(worker.rank), worker.device, str(worker.worker_id)
    ).set(1)
