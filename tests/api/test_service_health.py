"""Health, readiness, metrics, and the database-busy path."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from fastapi.testclient import TestClient

from api.app import create_app
from api.demo_fleet import instance_body
from api.settings import Settings


def test_readyz_ok_when_migrated(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").json() == {"status": "ok"}


def test_readyz_503_when_not_migrated(tmp_path: Path) -> None:
    app = create_app(Settings(database_url=f"sqlite:///{tmp_path / 'empty.db'}"))
    with TestClient(app) as client:
        response = client.get("/readyz")
    assert response.status_code == 503
    assert response.headers["content-type"] == "application/problem+json"
    assert response.json()["code"] == "not_ready"
    assert "kvplane migrate" in response.json()["detail"]


def test_migrate_on_startup(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    with TestClient(create_app(Settings(database_url=url, migrate_on_startup=True))) as client:
        assert client.get("/readyz").status_code == 200


def test_demo_fleet_is_registered_and_paired(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'demo.db'}"
    settings = Settings(database_url=url, migrate_on_startup=True, demo_fleet=True)
    with TestClient(create_app(settings)) as client:
        instances = client.get("/v1/instances").json()
        pairings = client.get("/v1/pairings").json()
    assert {item["status"] for item in instances["items"]} == {"ready"}
    assert instances["total"] == 2
    assert [item["status"] for item in pairings["items"]] == ["compatible"]


def test_locked_sqlite_is_503_with_retry_after(sqlite_url: str) -> None:
    app = create_app(Settings(database_url=sqlite_url, sqlite_busy_timeout_ms=50))
    path = sqlite_url.removeprefix("sqlite:///")
    holder = sqlite3.connect(path, isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")
        with TestClient(app) as client:
            response = client.put("/v1/instances/c", json=instance_body(role="context", tp=1))
            assert response.status_code == 503
            assert response.headers["retry-after"] == "1"
            assert response.json()["code"] == "database_busy"
            holder.execute("ROLLBACK")
            assert client.get("/v1/instances").json()["total"] == 0
            retried = client.put("/v1/instances/c", json=instance_body(role="context", tp=1))
            assert retried.status_code == 201
    finally:
        holder.close()


def test_metrics(client: TestClient) -> None:
    client.put("/v1/instances/ctx-a", json=instance_body(role="context", tp=4, draft_heads=2))
    client.put("/v1/instances/gen-b", json=instance_body(role="generation", tp=2, draft_heads=2))
    client.post("/v1/pairings", json={"context": "ctx-a", "generation": "gen-b"})
    client.post(
        "/v1/transfers",
        json={
            "context": "ctx-a",
            "generation": "gen-b",
            "request_id": "r",
            "blocks": {"0": {"context": [0, 1], "generation": [2, 3]}},
        },
    )
    response = client.get("/metrics")
    assert response.status_code == 200
    text = response.text
    assert 'kvplane_registrations_total{kind="instance",outcome="created"} 2.0' in text
    assert 'kvplane_pairings{status="compatible"} 1.0' in text
    assert 'kvplane_pairings{status="stale"} 0.0' in text
    assert "kvplane_transfers_total 1.0" in text
    assert "kvplane_transfer_bytes_total" in text
    assert 'route="/v1/instances/{name}"' in text
