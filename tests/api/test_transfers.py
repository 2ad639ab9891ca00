"""Transfers: planning from a pairing, idempotency keys, fragments, execute=true."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

from api.demo_fleet import instance_body


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


def test_a_longer_generation_list_needs_num_tokens_to_place_it(client: TestClient) -> None:
    """A generation list longer than the context's is either the context's prefix reuse or
    blocks allocated past the prompt: refused without num_tokens, placed exactly with it."""
    pairing_id = _setup(client)
    plan = client.get(f"/v1/pairings/{pairing_id}/plan").json()
    tokens_per_block = plan["tokens_per_block"]
    body = _transfer()
    body["blocks"] = {"0": {"context": [0, 1, 2, 3], "generation": [10, 11, 12, 13, 14]}}
    refused = client.post("/v1/transfers", json=body)
    assert (refused.status_code, refused.json()["code"]) == (422, "invalid_blocks")
    assert "num_tokens" in refused.json()["detail"]
    # the prompt spans 4 blocks: the fifth generation block lies past it
    body["num_tokens"] = 4 * tokens_per_block
    assert client.post("/v1/transfers", json=body).status_code == 422
    # the context reused 1 block of a 5-block prompt: 4 pairs, the generation's last 4
    body["num_tokens"] = 4 * tokens_per_block + 1
    placed = client.post("/v1/transfers", json=body).json()
    assert placed["num_tokens"] == 4 * tokens_per_block + 1
    assert placed["bytes"] == 4 * plan["bytes_per_block"]
    fragments = client.get(f"/v1/transfers/{placed['id']}/fragments").json()
    assert sum(row[4] for r in fragments["routes"] for row in r["fragments"]) == placed["bytes"]


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
    assert (
        client.post(
            "/v1/transfers", json={**_transfer(request_id="r-other"), "generation": "gen-c"}
        ).status_code
        == 201
    )
    response = client.post("/v1/transfers", json=_transfer(blocks=4))
    assert response.status_code == 201, response.json()
    transfer = response.json()
    assert transfer["pairing_id"] == pairing_id != other["id"]
    fragments = client.get(f"/v1/transfers/{transfer['id']}/fragments").json()
    receivers = {route["receiver_rank"] for route in fragments["routes"]}
    assert receivers == {route["receiver_rank"] for route in transfer["routes"]} == {0, 1}
    assert (
        sum(row[4] for route in fragments["routes"] for row in route["fragments"])
        == (transfer["bytes"])
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


def _rows(page: dict) -> list[tuple[int, int, list[int]]]:
    return [
        (route["sender_rank"], route["receiver_rank"], row)
        for route in page["routes"]
        for row in route["fragments"]
    ]


def test_fragments_page_through_the_whole_transfer(client: TestClient) -> None:
    """``?offset=&limit=`` pages through the fragments in the order of the full list."""
    _setup(client)
    transfer = client.post("/v1/transfers", json=_transfer(blocks=4)).json()
    path = f"/v1/transfers/{transfer['id']}/fragments"
    full = client.get(path).json()
    assert full["total"] == transfer["fragments"] and full["next_offset"] is None
    rows: list[tuple[int, int, list[int]]] = []
    offset: int | None = 0
    pages = 0
    while offset is not None:
        page = client.get(path, params={"offset": offset, "limit": 7}).json()
        assert page["offset"] == offset and page["limit"] == 7
        assert len(_rows(page)) == min(7, transfer["fragments"] - offset)
        rows += _rows(page)
        offset = page["next_offset"]
        pages += 1
    assert pages == -(-transfer["fragments"] // 7)
    assert rows == _rows(full)
    beyond = client.get(path, params={"offset": transfer["fragments"] + 5}).json()
    assert _rows(beyond) == [] and beyond["next_offset"] is None


def test_fragments_above_the_page_limit_are_a_4xx_naming_it(make_app: Any) -> None:
    """The whole fragment list of a big transfer is refused, never built: its memory would be
    unbounded."""
    with TestClient(make_app(max_fragments_per_page=10)) as client:
        _setup(client)
        transfer = client.post("/v1/transfers", json=_transfer(blocks=4)).json()
        assert transfer["fragments"] > 10
        path = f"/v1/transfers/{transfer['id']}/fragments"
        for params in ({}, {"limit": 11}, {"offset": 3}):
            refused = client.get(path, params=params)
            assert refused.status_code == 422, refused.text
            problem = refused.json()
            assert problem["code"] == "too_many_fragments"
            assert problem["max_fragments_per_page"] == 10
            assert "10" in problem["detail"] and "limit" in problem["detail"]
        assert len(_rows(client.get(path, params={"limit": 10}).json())) == 10


def test_fragment_pages_stay_small_whatever_the_transfer(client: TestClient) -> None:
    """The probe's case: NHD, TP4 → TP2, 16,384 tokens per block, here 64 blocks (8.4 M
    fragments, gigabytes if expanded at once). A page costs memory by its own size only."""
    import tracemalloc

    from geometry.builders import ViewSpec
    from geometry.builders import instance_body as build

    nhd = [ViewSpec("target", layers=1, kv_heads=8, head_dim=128, layout="NHD")]
    for name, role, tp in (("ctx-a", "context", 4), ("gen-b", "generation", 2)):
        body = build(role=role, views=nhd, tp=tp, tokens_per_block=16384, num_slots=64)
        assert client.put(f"/v1/instances/{name}", json=body).status_code == 201
    assert client.post("/v1/pairings", json={"context": "ctx-a", "generation": "gen-b"}).json()[
        "compatible"
    ]
    transfer = client.post("/v1/transfers", json=_transfer(blocks=64)).json()
    assert transfer["fragments"] == 64 * 4 * 2 * 16384
    path = f"/v1/transfers/{transfer['id']}/fragments"
    assert client.get(path).json()["code"] == "too_many_fragments"
    tracemalloc.start()
    try:
        last = transfer["fragments"] - 50_000  # the last full page: the far end of the arrays
        page = client.get(path, params={"offset": last, "limit": 50_000})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert page.status_code == 200, page.text
    assert len(_rows(page.json())) == 50_000 and page.json()["next_offset"] is None
    first = client.get(path, params={"limit": 50_000}).json()
    assert len(_rows(first)) == 50_000
    assert peak < 64 << 20, f"one page of fragments peaked at {peak >> 20} MiB"


def test_duplicate_block_ids_are_422_invalid_blocks(client: TestClient) -> None:
    _setup(client)
    body = _transfer()
    body["blocks"] = {"0": {"context": [5, 5, 5, 5], "generation": [0, 1, 2, 3]}}
    response = client.post("/v1/transfers", json=body)
    assert response.status_code == 422, response.json()
    problem = response.json()
    assert problem["code"] == "invalid_blocks"
    assert problem["errors"][0]["loc"] == ["body", "blocks", "0", "context"]
    assert client.get("/v1/transfers").json()["total"] == 0


def test_helix_generation_block_tables_per_cp_rank(client: TestClient) -> None:
    from geometry.builders import ViewSpec
    from geometry.builders import instance_body as build

    views = [ViewSpec("target", 2, 4, 8)]
    ctx = build(role="context", views=views, tp=2, tokens_per_block=4, num_slots=16)
    gen = build(role="generation", views=views, tp=2, cp=2, tokens_per_block=4, num_slots=16)
    assert client.put("/v1/instances/ctx-h", json=ctx).status_code == 201
    assert client.put("/v1/instances/gen-h", json=gen).status_code == 201
    pairing = client.post("/v1/pairings", json={"context": "ctx-h", "generation": "gen-h"})
    assert pairing.json()["compatible"] is True, pairing.json()
    per_block = client.get(f"/v1/pairings/{pairing.json()['id']}/plan").json()["bytes_per_block"]
    body = {
        "context": "ctx-h",
        "generation": "gen-h",
        "request_id": "helix-1",
        # 5 logical blocks: CP rank 0 holds 0, 2, 4 and CP rank 1 holds 1, 3 (prefix 1 reused)
        "blocks": {"0": {"context": [0, 1, 2, 3, 4], "generation": [[7, 8, 9], [6]]}},
    }
    response = client.post("/v1/transfers", json=body)
    assert response.status_code == 201, response.json()
    transfer = response.json()
    # logical blocks 0, 2, 4 (rank 0) and 3 (rank 1) move: 4 of 5; per_block counts both
    # CP ranks' routes, each block goes to one of them
    assert transfer["bytes"] == 4 * per_block // 2
    fragments = client.get(f"/v1/transfers/{transfer['id']}/fragments").json()
    rows = [row for route in fragments["routes"] for row in route["fragments"]]
    assert sum(row[4] for row in rows) == transfer["bytes"]
    wrong = dict(body, request_id="helix-2")
    wrong["blocks"] = {"0": {"context": [0, 1], "generation": [[1], [2], [3]]}}
    response = client.post("/v1/transfers", json=wrong)
    assert response.status_code == 422
    assert response.json()["code"] == "invalid_blocks"
    assert response.json()["errors"][0]["loc"] == ["body", "blocks", "0", "generation"]
