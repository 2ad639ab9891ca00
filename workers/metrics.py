"""Prometheus metrics of a worker process, and per-job log context.

``kvplane worker --metrics-port P`` serves prometheus_client's default registry on ``P``
(``/metrics``): jobs by kind and outcome, bytes moved, executor seconds, verified bytes.
An engine embedding :class:`~workers.agent.Worker` calls :func:`instrument` itself (and
``prometheus_client.start_http_server`` or its own exporter).

:func:`instrument` wraps the worker's ``run_job``: every record logged while a job runs carries
``job_id`` and ``transfer_id``, and the outcome is read from the worker's ``WorkerStats`` deltas
(done, failed, ``lease_lost`` when neither moved: the job was dropped, or ``error`` when the
report itself raised).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from api.logs import log_context

if TYPE_CHECKING:
    from workers.agent import Worker

JOB_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


@dataclass
class WorkerMetrics:
    """The worker's metric families, on one registry."""

    jobs: Counter
    bytes_moved: Counter
    executor_seconds: Counter
    job_duration: Histogram
    verified_bytes: Counter
    info: Gauge

    @classmethod
    def create(cls, registry: CollectorRegistry) -> WorkerMetrics:
        return cls(
            jobs=Counter(
                "kvplane_worker_jobs_total",
                "Jobs run by this worker, by kind and outcome (done, failed, lease_lost, error)",
                ["kind", "outcome"],
                registry=registry,
            ),
            bytes_moved=Counter(
                "kvplane_worker_bytes_moved_total",
                "Bytes moved by completed jobs, by kind",
                ["kind"],
                registry=registry,
            ),
            executor_seconds=Counter(
                "kvplane_worker_executor_seconds_total",
                "Seconds spent executing completed jobs, by kind",
                ["kind"],
                registry=registry,
            ),
            job_duration=Histogram(
                "kvplane_worker_job_duration_seconds",
                "Wall-clock time of one job (run and report), by kind and outcome",
                ["kind", "outcome"],
                buckets=JOB_BUCKETS_S,
                registry=registry,
            ),
            verified_bytes=Counter(
                "kvplane_worker_verified_bytes_total",
                "Pool bytes checked after verified transfers",
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
    """Count ``worker``'s jobs in ``metrics`` and bind job ids to its logs; idempotent."""
    metrics = metrics or default_metrics()
    original: Callable[[Mapping[str, Any]], None] = worker.run_job
    if getattr(original, "_kvplane_instrumented", False):
        return metrics

    @functools.wraps(original)
    def run_job(job: Mapping[str, Any]) -> None:
        kind = str(job.get("kind", "?"))
        stats = worker.stats
        done, failed = stats.jobs_done, stats.jobs_failed
        moved, busy, verified = stats.bytes_moved, stats.busy_s, stats.verified_bytes
        started = time.perf_counter()
        with log_context(job_id=str(job.get("id")), transfer_id=job.get("transfer_id")):
            raised = True
            try:
                original(job)
                raised = False
            finally:
                if stats.jobs_done > done:
                    outcome = "done"
                elif stats.jobs_failed > failed:
                    outcome = "failed"
                else:
                    outcome = "error" if raised else "lease_lost"
                metrics.jobs.labels(kind, outcome).inc()
                metrics.job_duration.labels(kind, outcome).observe(time.perf_counter() - started)
                metrics.bytes_moved.labels(kind).inc(max(0, stats.bytes_moved - moved))
                metrics.executor_seconds.labels(kind).inc(max(0.0, stats.busy_s - busy))
                metrics.verified_bytes.inc(max(0, stats.verified_bytes - verified))

    run_job._kvplane_instrumented = True  # type: ignore[attr-defined]
    worker.run_job = run_job  # type: ignore[method-assign]
    return metrics


def describe_worker(worker: Worker, metrics: WorkerMetrics | None = None) -> None:
    """Publish ``kvplane_worker_info`` for an attached worker."""
    metrics = metrics or default_metrics()
    metrics.info.labels(
        worker.instance, str(worker.rank), worker.device, str(worker.worker_id)
    ).set(1)
