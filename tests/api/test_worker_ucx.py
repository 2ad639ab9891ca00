"""A worker says which UCX transports and devices its NIXL endpoint runs with: the registration's
``peer.ucx`` comes back in ``GET /v1/workers`` and on the dashboard's Workers view (null for a
worker that did not say); what UCX really uses comes with its heartbeats, and the Workers view
marks a network device in use that the worker did not pin."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from api.demo_fleet import fake_peer
from api.schemas_exec import UcxInUse, UcxSettings
from api.services.workers import ucx_outside_pinned
from geometry.builders import ViewSpec, instance_body

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


def _attach(client: TestClient, ucx: dict | None = None) -> str:
    body = instance_body(role="context", views=VIEWS, tp=1, tokens_per_block=4)
    assert client.put("/v1/instances/ctx", json=body).status_code == 201
    peer = fake_peer(body["ranks"][0], "ctx.r0")
    if ucx is not None:
        peer["ucx"] = ucx
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


def _in_use(*transports: str) -> UcxInUse:
    return UcxInUse(
        transports=list(transports),
        lanes={"am": list(transports)},
        peers=["inter-node"],
        shared_memory=any(t.endswith("/memory") for t in transports),
    )


@pytest.mark.parametrize(
    ("net_devices", "transports", "outside"),
    [
        # The independent check's finding: pinned to the data NIC, half the lanes on eth0.
        ("data0", ["tcp/data0", "tcp/eth0"], ["tcp/eth0"]),
        ("data0", ["tcp/data0"], []),
        ("data0,data1", ["tcp/data1", "tcp/data0"], []),
        (" data0 , data1", ["tcp/data1", "tcp/eth0"], ["tcp/eth0"]),
        # RDMA devices carry their port; shared memory and an accelerator are no network device.
        ("mlx5_0:1", ["rc_mlx5/mlx5_0:1", "rc_mlx5/mlx5_1:1", "cma/memory"], ["rc_mlx5/mlx5_1:1"]),
        ("mlx5_0:1", ["rc_mlx5/mlx5_0:1", "cuda_ipc/cuda", "cuda_copy/cuda"], []),
        ("mlx5_0", ["rc_mlx5/mlx5_0:1"], ["rc_mlx5/mlx5_0:1"]),  # UCX wants the port too
        # Nothing pinned, or everything.
        ("default", ["tcp/data0", "tcp/eth0"], []),
        ("all", ["tcp/data0", "tcp/eth0"], []),
    ],
)
def test_transports_outside_the_pinned_devices(
    net_devices: str, transports: list[str], outside: list[str]
) -> None:
    ucx = UcxSettings(tls="tcp", net_devices=net_devices)
    assert ucx_outside_pinned(ucx, _in_use(*transports)) == outside


def test_nothing_is_outside_while_unknown() -> None:
    pinned = UcxSettings(tls="tcp", net_devices="data0")
    assert ucx_outside_pinned(pinned, None) == []
    assert ucx_outside_pinned(None, _in_use("tcp/eth0")) == []


def test_the_dashboard_marks_a_device_outside_the_pinned_ones(client: TestClient) -> None:
    worker_id = _attach(client, {"backend": "UCX", "tls": "tcp", "net_devices": "data0"})
    beat = client.post(
        f"/v1/workers/{worker_id}/heartbeat",
        json={"ucx_in_use": _in_use("tcp/data0").model_dump()},
    )
    assert beat.status_code == 200, beat.text
    page = client.get("/ui/workers").text
    assert "UCX tcp on data0" in page and "in use: tcp/data0" in page
    assert "data-ucx-outside" not in page and "outside the pinned devices" not in page

    beat = client.post(
        f"/v1/workers/{worker_id}/heartbeat",
        json={"ucx_in_use": _in_use("tcp/data0", "tcp/eth0").model_dump()},
    )
    assert beat.status_code == 200, beat.text
    page = client.get("/ui/workers").text
    assert "in use: tcp/eth0 — outside the pinned devices data0</strong>" in page
    assert 'class="bad" data-ucx-outside' in page
