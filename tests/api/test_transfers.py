"""Transfers: planning from a pairing, idempotency keys, fragments, execute=true."""

from __future__ import annotations

from fastapi.testclient import TestClient

from api.demo import instance_body


def _setup(client: TestClient) -> str:
    client.put("/v1/instances/ctx-a", json=instance_body(role="context", tp=4, draft_heads=2))
    client.put("/v1/instances/gen-b", json=instance_body(role="generation", tp=2, draft_heads=2))
    pairing = client.post("/v1/pairings", json={"context": "ctx-a", "generation": "gen-b"})
    return str(pairing.json()["id"])


def _transfer(blocks: int = 8, request_id: str = "req-1", **extra: object) -> dict:
    return {
        "context": "ctx-a",
        "generation": "gen-b",
        "request_id": request_id,
        "blocks": {"0": {"context": list(range(blocks)), "generation": list(range(blocks))}},
        **extra,
    }


def test_transfer_is_planned_and_readable(client: TestClient) -> None:
    pairing_id = _setup(client)
    plan = client.get(f"/v1/pairings/{pairing_id}/plan").json()
    response = client.post("/v1/transfers", json=_transfer(blocks=8))
    assert response.status_code == 201, response.json()
    transfer = response.json()
    assert transfer["status"] == "planned"
    assert transfer["pairing_id"] == pairing_id
    assert transfer["bytes"] == 8 * plan["bytes_per_block"]
    assert sum(route["bytes"] for route in transfer["routes"]) == transfer["bytes"]
    assert client.get(f"/v1/transfers/{transfer['id']}").json() == transfer


def test_fragments_cover_the_transfer(client: TestClient) -> None:
    _setup(client)
    transfer = client.post("/v1/transfers", json=_transfer(blocks=4)).json()
    fragments = client.get(f"/v1/transfers/{transfer['id']}/fragments").json()
    rows = [row for route in fragments["routes"] for row in route["fragments"]]
    assert len(rows) == transfer["fragments"]
    assert sum(row[4] for row in rows) == transfer["bytes"]


def test_prefix_cached_blocks_transfer_the_common_suffix(client: TestClient) -> None:
    _setup(client)
    body = _transfer()
    body["blocks"] = {"0": {"context": [5, 6, 7, 8], "generation": [1, 2]}}
    two = client.post("/v1/transfers", json=body).json()
    full = client.post("/v1/transfers", json=_transfer(blocks=2, request_id="r2")).json()
    assert two["bytes"] == full["bytes"]


def test_idempotency_key(client: TestClient) -> None:
    _setup(client)
    headers = {"Idempotency-Key": "key-1"}
    first = client.post("/v1/transfers", json=_transfer(), headers=headers)
    again = client.post("/v1/transfers", json=_transfer(), headers=headers)
    assert first.status_code == 201
    assert again.status_code == 200
    assert again.json()["id"] == first.json()["id"]
    other = client.post("/v1/transfers", json=_transfer(blocks=3), headers=headers)
    assert other.status_code == 409
    assert other.json()["code"] == "idempotency_key_reused"
    fresh = client.post("/v1/transfers", json=_transfer(), headers={"Idempotency-Key": "key-2"})
    assert fresh.status_code == 201
    assert fresh.json()["id"] != first.json()["id"]


def test_execute_without_workers_is_503_and_stores_nothing(client: TestClient) -> None:
    _setup(client)
    response = client.post("/v1/transfers", json=_transfer(execute=True))
    assert response.status_code == 503
    assert response.headers["Retry-After"]
    problem = response.json()
    assert problem["code"] == "workers_unavailable"
    assert "context rank 0" in problem["detail"]
    metrics = client.get("/metrics").text
    assert "kvplane_transfers_total 0.0" in metrics
    assert client.get("/v1/transfers").json()["total"] == 0


def test_unknown_pairing_and_instances(client: TestClient) -> None:
    response = client.post("/v1/transfers", json=_transfer())
    assert response.status_code == 404
    assert response.json()["code"] == "instance_not_found"
    client.put("/v1/instances/ctx-a", json=instance_body(role="context", tp=1))
    client.put("/v1/instances/gen-b", json=instance_body(role="generation", tp=1))
    response = client.post("/v1/transfers", json=_transfer())
    assert response.status_code == 404
    assert response.json()["code"] == "pairing_not_found"


def test_block_id_out_of_range_is_422_naming_the_field(client: TestClient) -> None:
    _setup(client)
    body = _transfer()
    body["blocks"] = {"0": {"context": [0, 10_000], "generation": [0, 1]}}
    response = client.post("/v1/transfers", json=body)
    assert response.status_code == 422
    assert response.json()["code"] == "invalid_blocks"
    assert response.json()["errors"][0]["loc"][0] == "body"
    unknown_group = _transfer()
    unknown_group["blocks"] = {"7": {"context": [0], "generation": [0]}}
    assert client.post("/v1/transfers", json=unknown_group).status_code == 422


def test_a_first_transfer_that_fails_leaves_no_dangling_plan_in_the_cache(
    client: TestClient,
) -> None:
    # The pairing's plan is compiled and stored by the first transfer, whose transaction then
    # rolls back (a block id out of range, then no live worker): later transfers must neither
    # fail on the vanished plan row nor reference another pairing's plan that reused its id.
    pairing_id = _setup(client)
    bad = _transfer(blocks=2)
    bad["blocks"]["0"]["generation"] = [0, 10**6]
    assert client.post("/v1/transfers", json=bad).status_code == 422
    executed = client.post("/v1/transfers", json=_transfer(request_id="r-exec", execute=True))
    assert executed.status_code == 503
    client.put("/v1/instances/gen-c", json=instance_body(role="generation", tp=1))
    other = client.post("/v1/pairings", json={"context": "ctx-a", "generation": "gen-c"}).json()
    assert client.post(
        "/v1/transfers", json={**_transfer(request_id="r-other"), "generation": "gen-c"}
    ).status_code == 201
    response = client.post("/v1/transfers", json=_transfer(blocks=4))
    assert response.status_code == 201, response.json()
    transfer = response.json()
    assert transfer["pairing_id"] == pairing_id != other["id"]
    fragments = client.get(f"/v1/transfers/{transfer['id']}/fragments").json()
    receivers = {route["receiver_rank"] for route in fragments["routes"]}
    assert receivers == {route["receiver_rank"] for route in transfer["routes"]} == {0, 1}
    assert sum(row[4] for route in fragments["routes"] for row in route["fragments"]) == (
        transfer["bytes"]
    )


def test_stale_pairing_refuses_transfers(client: TestClient) -> None:
    _setup(client)
    client.put("/v1/instances/gen-b", json=instance_body(role="generation", tp=2, num_slots=9))
    response = client.post("/v1/transfers", json=_transfer())
    assert response.status_code == 409
    assert response.json()["code"] == "pairing_stale"


def test_transfers_survive_instance_deletion(client: TestClient) -> None:
    _setup(client)
    transfer = client.post("/v1/transfers", json=_transfer()).json()
    client.delete("/v1/instances/ctx-a")
    kept = client.get(f"/v1/transfers/{transfer['id']}")
    assert kept.status_code == 200
    assert kept.json()["pairing_id"] is None
    gone = client.get(f"/v1/transfers/{transfer['id']}/fragments")
    assert gone.status_code == 409
    assert gone.json()["code"] == "plan_gone"
