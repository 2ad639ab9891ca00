"""A worker says which UCX transports and devices its NIXL endpoint runs with: the registration's
``peer.ucx`` comes back in ``GET /v1/workers`` and on the dashboard's Workers view (null for a
worker that did not say)."""

from __future__ import annotations

from fastapi.testclient import TestClient

from api.demo import fake_peer
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
