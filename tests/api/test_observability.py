"""Prometheus metrics where the events happen, the Grafana dashboard's names, JSON logs."""

from __future__ import annotations

import io
import json
import logging
import re
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from api.db import utcnow
from api.demo_fleet import fake_peer
from api.logs import ContextFilter, JsonFormatter, log_context, set_process_context
from geometry.builders import ViewSpec, instance_body
from workers.metrics import WorkerMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "monitoring" / "grafana-dashboard.json"
VIEWS = [ViewSpec("target", layers=2, kv_heads=4, head_dim=8)]
SUFFIXES = ("_bucket", "_sum", "_count", "_total", "_created")


def exposed_names(text: str) -> set[str]:
    """Every family and sample name in a Prometheus text exposition."""
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
        kind_suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
        names.update(family.name + suffix for suffix in kind_suffixes.get(family.type, ()))
    return names


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """``{sorted label items: value}`` of one sample name."""
    found: dict[tuple[tuple[str, str], ...], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                found[tuple(sorted(sample.labels.items()))] = sample.value
    return found


def value(text: str, name: str, **labels: str) -> float:
    return samples(text, name).get(tuple(sorted(labels.items())), 0.0)


def dashboard_metric_names() -> set[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(dashboard["panels"]) >= 8 and all(exprs)
    return {name for expr in exprs for name in re.findall(r"\bkvplane_[a-z0-9_]+", expr)}


def test_every_metric_of_the_grafana_dashboard_is_exposed(client: TestClient) -> None:
    app_names = exposed_names(client.get("/metrics").text)
    registry = CollectorRegistry()
    WorkerMetrics.create(registry)
    worker_names = exposed_names(generate_latest(registry).decode())
    referenced = dashboard_metric_names()
    assert any(
        n.startswith("kvplane_worker_") and n != "kvplane_worker_heartbeats_total"
        for n in referenced
    )
    missing = sorted(
        name
        for name in referenced
        if name
        not in (
            worker_names
            if name.startswith("kvplane_worker_") and name != "kvplane_worker_heartbeats_total"
            else app_names
        )
    )
    assert not missing, f"the dashboard queries metrics nobody exposes: {missing}"


def test_metric_names_follow_prometheus_conventions(client: TestClient) -> None:
    for family in text_string_to_metric_families(client.get("/metrics").text):
        assert family.name.startswith("kvplane_"), family.name
        if "duration" in family.name:
            assert family.name.endswith("_seconds"), family.name
        if family.name.endswith("bytes"):
            assert family.type == "counter", family.name


# --- metrics updated where the events happen -----------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = utcnow()

    def __call__(self) -> datetime:
        return self.now


def _fleet(api: TestClient) -> dict[tuple[str, int], str]:
    bodies = {
        "ctx": instance_body(role="context", views=VIEWS, tp=2, tokens_per_block=4),
        "gen": instance_body(role="generation", views=VIEWS, tp=1, tokens_per_block=4),
    }
    workers = {}
    for name, body in bodies.items():
        assert api.put(f"/v1/instances/{name}", json=body).status_code == 201
        for rank_body in body["ranks"]:
            answer = api.post(
                "/v1/workers",
                json={
                    "instance": name,
                    "rank": rank_body["rank"],
                    "peer": fake_peer(rank_body, f"{name}.r{rank_body['rank']}"),
                },
            )
            assert answer.status_code == 201, answer.text
            workers[(name, rank_body["rank"])] = answer.json()["id"]
    assert api.post("/v1/pairings", json={"context": "ctx", "generation": "gen"}).json()[
        "compatible"
    ]
    return workers


def _submit(api: TestClient, request_id: str) -> str:
    answer = api.post(
        "/v1/transfers",
        json={
            "context": "ctx",
            "generation": "gen",
            "request_id": request_id,
            "execute": True,
            "blocks": {"0": {"context": [0, 1, 2, 3], "generation": [4, 5, 6, 7]}},
        },
    )
    assert answer.status_code == 201, answer.text
    return str(answer.json()["id"])


def _record(
    api: TestClient, worker_id: str, transfer_id: str, side: str, rank: int, nbytes: int = 1
) -> None:
    """What a worker posts when its part of the transfer finished."""
    directory = api.get(f"/v1/workers/{worker_id}/directory").json()
    (pairing,) = directory["pairings"]
    answer = api.post(
        "/v1/transfers/records",
        json={
            "worker_id": worker_id,
            "records": [
                {
                    "transfer_id": transfer_id,
                    "request_id": "r",
                    "pairing_id": pairing["id"],
                    "context": "ctx",
                    "generation": "gen",
                    "context_epoch": pairing["context_epoch"],
                    "generation_epoch": pairing["generation_epoch"],
                    "side": side,
                    "rank": rank,
                    "status": "done",
                    "bytes": nbytes,
                    "started_at": time.time(),
                    "finished_at": time.time() + 0.01,
                }
            ],
        },
    )
    assert answer.status_code == 200, answer.text


def test_metrics_follow_registrations_transfers_parts_and_overdue_transfers(
    make_app: Callable[..., FastAPI],
) -> None:
    app = make_app()
    clock = Clock()
    app.state.clock = clock
    with TestClient(app) as api:
        workers = _fleet(api)
        first = _submit(api, "r1")
        text = api.get("/metrics").text
        assert value(text, "kvplane_registrations_total", kind="instance", outcome="created") == 2
        assert value(text, "kvplane_pairings", status="compatible") == 1
        assert value(text, "kvplane_workers", status="alive") == 3
        transfer = api.get(f"/v1/transfers/{first}").json()
        assert value(text, "kvplane_transfer_bytes_total") == transfer["bytes"] > 0
        assert value(text, "kvplane_transfer_fragments_count", pairing="ctx->gen") == 1
        assert (
            value(text, "kvplane_transfer_fragments_sum", pairing="ctx->gen")
            == transfer["fragments"]
        )
        assert (
            value(text, "kvplane_transfer_runs_sum", pairing="ctx->gen")
            == sum(route["runs"] for route in transfer["routes"])
            > 0
        )

        # run it: duration observed once, when the transfer settles
        clock.now = utcnow() + timedelta(seconds=2)  # transfers are created on the wall clock
        for worker, side, rank in ((("ctx", 0), "send", 0), (("ctx", 1), "send", 1)):
            _record(api, workers[worker], first, side, rank, nbytes=10)
            text = api.get("/metrics").text
            assert value(text, "kvplane_transfer_duration_seconds_count", status="done") == 0
        _record(api, workers[("gen", 0)], first, "receive", 0, nbytes=20)
        done = api.get(f"/v1/transfers/{first}").json()
        assert done["status"] == "done"
        waited = (
            datetime.fromisoformat(done["finished_at"]) - datetime.fromisoformat(done["created_at"])
        ).total_seconds()
        text = api.get("/metrics").text
        assert value(text, "kvplane_transfer_duration_seconds_count", status="done") == 1
        assert waited >= 2.0
        assert value(text, "kvplane_transfer_duration_seconds_sum", status="done") == pytest.approx(
            waited
        )
        assert value(text, "kvplane_transfers_finished_total", status="done") == 1
        assert value(text, "kvplane_transfer_parts", state="done") == 3
        assert value(text, "kvplane_recorded_parts_total", state="done") == 3
        assert value(text, "kvplane_moved_bytes_total", kind="send") == 20
        assert value(text, "kvplane_moved_bytes_total", kind="receive") == 20
        assert value(text, "kvplane_record_batches_total") == 3

        # a transfer nobody reports by its deadline is failed (and counted) by a waiting read
        second = _submit(api, "r2")
        clock.now += timedelta(seconds=120)
        answer = api.get(f"/v1/transfers/{second}", params={"wait": 1.5}).json()
        assert answer["status"] == "failed" and answer["error"].startswith("deadline")
        text = api.get("/metrics").text
        assert value(text, "kvplane_transfers_overdue_total") == 1
        assert value(text, "kvplane_transfers_finished_total", status="failed") == 1
        text = api.get("/metrics").text
        assert value(text, "kvplane_workers", status="gone") == 3


def test_a_transfer_failed_by_reregistration_is_observed(
    make_app: Callable[..., FastAPI],
) -> None:
    app = make_app()
    with TestClient(app) as api:
        _fleet(api)
        _submit(api, "r1")
        body = instance_body(
            role="generation", views=VIEWS, tp=1, tokens_per_block=4, model="changed"
        )
        assert api.put("/v1/instances/gen", json=body).status_code == 200
        text = api.get("/metrics").text
        assert value(text, "kvplane_transfers_finished_total", status="failed") == 1
        assert value(text, "kvplane_transfer_duration_seconds_count", status="failed") == 1


# --- logs ----------------------------------------------------------------------------------


def _json_logger(name: str) -> tuple[logging.Logger, io.StringIO]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(ContextFilter())
    logger = logging.getLogger(name)
    logger.handlers = [handler]
    logger.setLevel(logging.INFO)
    logger.propagate = False
    return logger, stream


def test_json_log_lines_carry_level_logger_message_and_context_ids() -> None:
    logger, stream = _json_logger("kvplane.test.json")
    set_process_context(worker_id="w-1")
    try:
        with log_context(transfer_id="t-1", job_id="j-1"):
            logger.warning("moved %d bytes", 42, extra={"job_id": "j-explicit", "rank": 3})
        logger.info("outside")
    finally:
        set_process_context(worker_id=None)
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["level"] == "WARNING" and first["logger"] == "kvplane.test.json"
    assert first["message"] == "moved 42 bytes"
    assert datetime.fromisoformat(first["timestamp"]).utcoffset() == timedelta(0)
    assert (first["transfer_id"], first["job_id"], first["worker_id"], first["rank"]) == (
        "t-1",
        "j-explicit",
        "w-1",
        3,
    )
    assert second["message"] == "outside" and "transfer_id" not in second
    assert second["worker_id"] == "w-1"


def test_request_id_is_echoed_and_bound_to_the_request_logs(client: TestClient) -> None:
    _, stream = _json_logger("kvplane.access")
    answer = client.get("/v1/instances/nope", headers={"X-Request-ID": "req-abc.123"})
    assert answer.status_code == 404
    assert answer.headers["X-Request-ID"] == "req-abc.123"
    generated = client.get("/healthz").headers["X-Request-ID"]
    assert re.fullmatch(r"[0-9a-f]{32}", generated)
    # a malformed id is replaced, not echoed into headers and logs
    assert (
        client.get("/healthz", headers={"X-Request-ID": "a b\tc"}).headers["X-Request-ID"]
        != "a b\tc"
    )
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    mine = next(line for line in lines if line["request_id"] == "req-abc.123")
    assert mine["path"] == "/v1/instances/nope" and mine["status"] == 404


def test_logs_inside_a_sync_route_carry_the_request_id(
    make_app: Callable[..., FastAPI], caplog: pytest.LogCaptureFixture
) -> None:
    app = make_app()

    @app.get("/probe")
    def probe() -> dict[str, str]:  # runs in the threadpool, like every sync route
        logging.getLogger("kvplane.test.route").warning("inside the route")
        return {}

    caplog.handler.addFilter(ContextFilter())
    with TestClient(app) as api, caplog.at_level(logging.WARNING, logger="kvplane.test.route"):
        api.get("/probe", headers={"X-Request-ID": "req-probe"})
    record = next(r for r in caplog.records if r.getMessage() == "inside the route")
    assert getattr(record, "request_id", None) == "req-probe"


def test_docs_routes_have_their_own_metric_labels(client: TestClient) -> None:
    for path in ("/docs", "/redoc", "/openapi.json", "/docs-assets/swagger-ui.css"):
        assert client.get(path).status_code == 200, path
    assert client.get("/no/such/route").status_code == 404
    text = client.get("/metrics").text
    routes = {
        dict(labels)["route"]
        for labels in samples(text, "kvplane_http_request_duration_seconds_count")
    }
    assert {"/docs", "/redoc", "/openapi.json", "/docs-assets/{path}"} <= routes
    counted = samples(text, "kvplane_http_request_duration_seconds_count")
    unmatched = [dict(labels) for labels in counted if dict(labels)["route"] == "unmatched"]
    assert [label["status"] for label in unmatched] == ["404"]


def test_readyz_logs_nothing_but_its_access_line(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG), caplog.at_level(logging.DEBUG, "kvplane.access"):
        for _ in range(3):
            assert client.get("/readyz").status_code == 200
    # (httpx lines come from the test's own client, not from the server)
    noisy = [
        (r.name, r.getMessage())
        for r in caplog.records
        if r.name not in ("kvplane.access", "httpx") and r.levelno >= logging.INFO
    ]
    assert noisy == []
    assert sum(r.name == "kvplane.access" for r in caplog.records) == 3


def test_heartbeats_and_probes_log_at_debug_unless_they_fail(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    """A served fleet heartbeats once a second per rank: those access lines (and health probes)
    are DEBUG while they succeed; a failed heartbeat and every other request stay INFO."""
    with caplog.at_level(logging.DEBUG, logger="kvplane.access"):
        assert client.get("/healthz").status_code == 200
        assert client.post("/v1/workers/w-none/heartbeat", json={}).status_code >= 400
        assert client.get("/v1/instances").status_code == 200
    levels = {
        r.getMessage().split()[1]: r.levelname for r in caplog.records if r.name == "kvplane.access"
    }
    assert levels == {
        "/healthz": "DEBUG",
        "/v1/workers/w-none/heartbeat": "INFO",
        "/v1/instances": "INFO",
    }
    from api.logs import ROUTINE_PATHS

    assert ROUTINE_PATHS.match("/v1/workers/w-1/heartbeat")
    assert ROUTINE_PATHS.match("/v1/workers/w-1/commands")
    assert not ROUTINE_PATHS.match("/v1/workers/w-1/directory")


def test_configured_logging_keeps_http_client_polls_out_of_the_log() -> None:
    import httpx

    from api.logs import configure_logging

    root = logging.getLogger()
    saved_level, saved_handlers = root.level, list(root.handlers)
    saved = {name: logging.getLogger(name).level for name in ("httpx", "httpcore")}
    handler = configure_logging(json_lines=True)
    stream = io.StringIO()
    handler.setStream(stream)  # type: ignore[attr-defined]
    try:
        transport = httpx.MockTransport(lambda request: httpx.Response(200, json={}))
        with httpx.Client(transport=transport, base_url="http://cp") as http:
            for _ in range(5):  # what a worker's heartbeat thread and claim loop do
                http.post("/v1/workers/w/heartbeat")
        logging.getLogger("kvplane.worker").info("transfer t-1 done")
    finally:
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [line["message"] for line in lines] == ["transfer t-1 done"]
