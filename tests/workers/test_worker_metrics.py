"""Worker metrics and per-job log context (``workers/metrics.py``), without NIXL or a server."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from api.client import LeaseLostError
from api.logs import ContextFilter
from workers.agent import JobError, Worker
from workers.metrics import WorkerMetrics, describe_worker, instrument

ROOT = Path(__file__).resolve().parents[2]


class StubClient:
    """Records reports; ``complete_job`` raises ``complete_error`` when set."""

    def __init__(self) -> None:
        self.completed: list[str] = []
        self.failed: list[str] = []
        self.complete_error: Exception | None = None

    def complete_job(self, job_id: str, body: Mapping[str, Any]) -> None:
        if self.complete_error is not None:
            raise self.complete_error
        self.completed.append(job_id)

    def fail_job(self, job_id: str, body: Mapping[str, Any]) -> None:
        self.failed.append(job_id)


def job(job_id: str, kind: str = "send") -> dict[str, Any]:
    return {"id": job_id, "kind": kind, "transfer_id": f"t-{job_id}", "lease_token": "tok",
            "payload": {"timeout_s": 60.0}}


@pytest.fixture
def setup() -> tuple[Worker, StubClient, CollectorRegistry]:
    client = StubClient()
    worker = Worker(client, "ctx", 1, device="cpu")  # type: ignore[arg-type]
    worker.worker_id = "w-1"
    registry = CollectorRegistry()
    instrument(worker, WorkerMetrics.create(registry))
    instrument(worker, WorkerMetrics.create(CollectorRegistry()))  # idempotent: not wrapped twice
    return worker, client, registry


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def test_done_failed_and_lost_jobs_are_counted_by_outcome(
    setup: tuple[Worker, StubClient, CollectorRegistry], monkeypatch: pytest.MonkeyPatch
) -> None:
    worker, client, registry = setup
    outcomes = iter(
        [
            {"bytes": 4096, "routes": []},
            JobError("peer gone", retryable=False),
            {"bytes": 10, "routes": []},
        ]
    )

    def fake_send(lease: Mapping[str, Any]) -> dict[str, Any]:
        item = next(outcomes)
        if isinstance(item, Exception):
            raise item
        return dict(item)

    monkeypatch.setattr(worker, "_send", fake_send)
    worker.run_job(job("a"))
    worker.run_job(job("b"))
    client.complete_error = LeaseLostError(409, "lease_lost", "gone")
    worker.run_job(job("c"))

    assert (client.completed, client.failed) == (["a"], ["b"])
    assert value(registry, "kvplane_worker_jobs_total", kind="send", outcome="done") == 1
    assert value(registry, "kvplane_worker_jobs_total", kind="send", outcome="failed") == 1
    assert value(registry, "kvplane_worker_jobs_total", kind="send", outcome="lease_lost") == 1
    # only completed jobs count bytes and executor time
    assert value(registry, "kvplane_worker_bytes_moved_total", kind="send") == 4096
    assert value(registry, "kvplane_worker_executor_seconds_total", kind="send") > 0
    assert (
        value(registry, "kvplane_worker_job_duration_seconds_count", kind="send", outcome="done")
        == 1
    )


def test_a_report_that_raises_counts_as_error(
    setup: tuple[Worker, StubClient, CollectorRegistry], monkeypatch: pytest.MonkeyPatch
) -> None:
    worker, client, registry = setup
    monkeypatch.setattr(worker, "_send", lambda lease: {"bytes": 1, "routes": []})
    client.complete_error = RuntimeError("control plane unreachable")
    with pytest.raises(RuntimeError):
        worker.run_job(job("x"))
    assert value(registry, "kvplane_worker_jobs_total", kind="send", outcome="error") == 1


def test_logs_during_a_job_carry_its_ids(
    setup: tuple[Worker, StubClient, CollectorRegistry],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    worker, _client, _registry = setup

    def noisy_send(lease: Mapping[str, Any]) -> dict[str, Any]:
        logging.getLogger("kvplane.worker").warning("writing")
        return {"bytes": 1, "routes": []}

    monkeypatch.setattr(worker, "_send", noisy_send)
    caplog.handler.addFilter(ContextFilter())
    with caplog.at_level(logging.WARNING, logger="kvplane.worker"):
        worker.run_job(job("j9"))
        logging.getLogger("kvplane.worker").warning("idle")
    during, after = (r for r in caplog.records if r.getMessage() in ("writing", "idle"))
    assert (getattr(during, "job_id", None), getattr(during, "transfer_id", None)) == ("j9", "t-j9")
    assert getattr(after, "job_id", None) is None


def test_worker_info_names_the_rank(setup: tuple[Worker, StubClient, CollectorRegistry]) -> None:
    worker, _client, _registry = setup
    registry = CollectorRegistry()
    describe_worker(worker, WorkerMetrics.create(registry))
    labels = {"kv_instance": "ctx", "rank": "1", "device": "cpu", "worker_id": "w-1"}
    assert registry.get_sample_value("kvplane_worker_info", labels) == 1
    assert "kvplane_worker_info{" in generate_latest(registry).decode()


def test_worker_metrics_import_neither_fastapi_nor_sqlalchemy() -> None:
    code = (
        "import sys, workers.metrics, api.logs; "
        "bad = [m for m in ('fastapi', 'sqlalchemy', 'starlette') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_serve_rides_an_outage_and_stops_on_a_refused_token(
    setup: tuple[Worker, StubClient, CollectorRegistry], monkeypatch: pytest.MonkeyPatch
) -> None:
    from api.client import ApiError, TransportError, UnavailableError
    from workers import agent

    worker, client, _ = setup
    monkeypatch.setattr(agent, "OUTAGE_BACKOFF_S", 0.01)
    worker.heartbeat_interval_s = 3600.0  # no heartbeats in this test
    answers: list[Any] = [
        TransportError(0, "transport_error", "connection refused"),
        UnavailableError(503, "database_busy", "retry"),
        None,  # a poll that found no job: the control plane is back
        ApiError(403, "forbidden", "token revoked"),
    ]
    calls = []

    def claim_job(worker_id: str, wait_s: float = 0.0) -> Any:
        answer = answers[len(calls)]
        calls.append(worker_id)
        if isinstance(answer, Exception):
            raise answer
        return answer

    client.claim_job = claim_job  # type: ignore[attr-defined]
    with pytest.raises(ApiError) as stopped:
        worker.serve()
    assert stopped.value.status == 403
    assert len(calls) == 4  # two failed claims were retried, then the refusal ended serve
