"""A worker says which UCX transports and devices its NIXL endpoint runs with: the registration's
``peer.ucx`` comes back in ``GET /v1/workers`` and on the dashboard's Workers view (null for a
worker that did not say)."""

from __future__ import annotations

from fastapi.testclient import TestClient

from api.demo_fleet import fake_peer
from api.geometry.builders import ViewSpec, instance_body

VIEWS = [ViewSpec("target", layers=2, kv_heads=4, head_dim=8)]


def test_workers_report_their_ucx_settings(client: TestClient) -> None:
    body = instance_body(role="context", views=VIEWS, tp=2, tokens_per_block=4)
    assert client.put("/v1/instances/ctx", json=body).status_code == 201
    ucx = {"backend": "UCX", "tls": "tcp", "net_devices": "eth1"}
    for rank_body in body["ranks"]:
        peer = fake_peer(rank_body, f"ctx.r{rank_body['rank']}")
        if rank_body["rank"] == 0:
            peer["ucx"] = ucx
        answer = client.post(
            "/v1/workers", json={"instance": "ctx", "rank": rank_body["rank"], "peer": peer}
        )
        assert answer.status_code == 201, answer.text
    items = {w["rank"]: w for w in client.get("/v1/workers").json()["items"]}
    assert items[0]["ucx"] == ucx
    assert items[1]["ucx"] is None
    page = client.get("/ui/workers")
    assert page.status_code == 200
    assert "UCX tcp on eth1" in page.text


def test_ucx_settings_are_validated(client: TestClient) -> None:
    body = instance_body(role="context", views=VIEWS, tp=1, tokens_per_block=4)
    assert client.put("/v1/instances/ctx", json=body).status_code == 201
    peer = fake_peer(body["ranks"][0], "ctx.r0")
    peer["ucx"] = {"backend": "UCX", "tls": "", "net_devices": "default"}
    answer = client.post("/v1/workers", json={"instance": "ctx", "rank": 0, "peer": peer})
    assert answer.status_code == 422


UCX_IN_USE = {
    "transports": ["tcp/lo", "cma/memory"],
    "lanes": {"rma_am": ["tcp/lo"], "am": ["tcp/lo", "cma/memory"], "ka": ["tcp/lo"]},
    "peers": ["intra-node"],
    "shared_memory": True,
}


def _attach(client: TestClient) -> str:
    body = instance_body(role="context", views=VIEWS, tp=1, tokens_per_block=4)
    assert client.put("/v1/instances/ctx", json=body).status_code == 201
    peer = fake_peer(body["ranks"][0], "ctx.r0")
    answer = client.post("/v1/workers", json={"instance": "ctx", "rank": 0, "peer": peer})
    assert answer.status_code == 201, answer.text
    worker_id: str = answer.json()["id"]
    return worker_id


def test_a_heartbeat_reports_what_ucx_uses(client: TestClient) -> None:
    worker_id = _attach(client)
    (listed,) = client.get("/v1/workers").json()["items"]
    assert listed["ucx_in_use"] is None  # not known until the worker says
    beat = client.post(f"/v1/workers/{worker_id}/heartbeat", json={"ucx_in_use": UCX_IN_USE})
    assert beat.status_code == 200, beat.text
    assert beat.json()["ucx_in_use"] == UCX_IN_USE
    (listed,) = client.get("/v1/workers").json()["items"]
    assert listed["ucx_in_use"] == UCX_IN_USE
    page = client.get("/ui/workers").text
    assert "cma/memory" in page and "shared memory" in page
    # A heartbeat without a report (an older worker, or nothing known yet) keeps the last one.
    assert client.post(f"/v1/workers/{worker_id}/heartbeat").status_code == 200
    assert client.post(f"/v1/workers/{worker_id}/heartbeat", json={}).status_code == 200
    (listed,) = client.get("/v1/workers").json()["items"]
    assert listed["ucx_in_use"] == UCX_IN_USE


def test_a_ucx_report_is_validated(client: TestClient) -> None:
    worker_id = _attach(client)
    for bad in (
        {**UCX_IN_USE, "transports": ["tcp lo"]},
        {**UCX_IN_USE, "extra": 1},
        {**UCX_IN_USE, "transports": ["x"] * 1000},
        {"transports": []},
    ):
        beat = client.post(f"/v1/workers/{worker_id}/heartbeat", json={"ucx_in_use": bad})
        assert beat.status_code == 422, bad
