"""Pairings: validation reports, stale on re-registration, re-validation, plans, compatibility."""

from __future__ import annotations

from fastapi.testclient import TestClient

from api.demo_fleet import instance_body


def _register_pair(client: TestClient, *, gen_heads: int = 8) -> None:
    ctx = instance_body(role="context", tp=4, draft_heads=2)
    gen = instance_body(role="generation", tp=2, draft_heads=2, target_heads=gen_heads)
    assert client.put("/v1/instances/ctx-a", json=ctx).status_code == 201
    assert client.put("/v1/instances/gen-b", json=gen).status_code == 201


def _pair(client: TestClient) -> dict:
    response = client.post("/v1/pairings", json={"context": "ctx-a", "generation": "gen-b"})
    assert response.status_code == 201, response.json()
    return response.json()


def test_compatible_pairing_is_stored(client: TestClient) -> None:
    _register_pair(client)
    pairing = _pair(client)
    assert pairing["compatible"] is True
    assert pairing["status"] == "compatible"
    assert pairing["errors"] == []
    assert client.get(f"/v1/pairings/{pairing['id']}").json() == pairing
    listed = client.get("/v1/pairings").json()
    assert [item["id"] for item in listed["items"]] == [pairing["id"]]


def test_incompatible_pairing_is_stored_with_its_report(client: TestClient) -> None:
    _register_pair(client, gen_heads=4)
    pairing = _pair(client)
    assert pairing["compatible"] is False
    assert pairing["status"] == "incompatible"
    codes = {error["code"] for error in pairing["errors"]}
    assert "head_count_mismatch" in codes
    assert all({"code", "message", "detail"} <= set(error) for error in pairing["errors"])
    plan = client.get(f"/v1/pairings/{pairing['id']}/plan")
    assert plan.status_code == 409
    assert plan.json()["code"] == "pairing_incompatible"


def test_unknown_instance_is_404(client: TestClient) -> None:
    client.put("/v1/instances/ctx-a", json=instance_body(role="context", tp=1))
    response = client.post("/v1/pairings", json={"context": "ctx-a", "generation": "ghost"})
    assert response.status_code == 404
    assert response.json()["code"] == "instance_not_found"
    assert client.get("/v1/pairings").json()["total"] == 0


def test_wrong_roles_are_409(client: TestClient) -> None:
    _register_pair(client)
    response = client.post("/v1/pairings", json={"context": "gen-b", "generation": "ctx-a"})
    assert response.status_code == 409
    assert response.json()["code"] == "wrong_role"


def test_incomplete_instance_is_reported_not_ready(client: TestClient) -> None:
    client.put("/v1/instances/ctx-a", json=instance_body(role="context", tp=4, draft_heads=2))
    header = instance_body(role="generation", tp=2, with_ranks=False)
    client.put("/v1/instances/gen-b", json=header)
    pairing = _pair(client)
    assert pairing["compatible"] is False
    assert "instance_not_ready" in {error["code"] for error in pairing["errors"]}


def test_reregistration_stales_pairing_until_revalidated(client: TestClient) -> None:
    _register_pair(client)
    pairing = _pair(client)
    assert client.get(f"/v1/pairings/{pairing['id']}/plan").status_code == 200

    changed = instance_body(role="generation", tp=2, draft_heads=2, num_slots=512)
    client.put("/v1/instances/gen-b", json=changed)
    stale = client.get(f"/v1/pairings/{pairing['id']}").json()
    assert stale["status"] == "stale"
    plan = client.get(f"/v1/pairings/{pairing['id']}/plan")
    assert plan.status_code == 409
    assert plan.json()["code"] == "pairing_stale"

    revalidated = client.post(f"/v1/pairings/{pairing['id']}/validate")
    assert revalidated.status_code == 200
    assert revalidated.json()["status"] == "compatible"
    assert revalidated.json()["generation_epoch"] != pairing["generation_epoch"]
    assert client.get(f"/v1/pairings/{pairing['id']}/plan").status_code == 200


def test_plan_matches_the_contract_and_is_cached(client: TestClient) -> None:
    _register_pair(client)
    pairing = _pair(client)
    first = client.get(f"/v1/pairings/{pairing['id']}/plan")
    assert first.status_code == 200
    plan = first.json()
    assert {route["receiver_rank"] for route in plan["routes"]} == {0, 1}
    run = plan["routes"][0]["segments"][0]["runs"][0]
    assert set(run) >= {"src", "dst", "len", "count", "src_step", "dst_step"}
    assert {receiver["rank"] for receiver in plan["receivers"]} == {0, 1}
    assert client.get(f"/v1/pairings/{pairing['id']}/plan").json() == plan


def test_plan_dp_rank_out_of_range_is_422(client: TestClient) -> None:
    _register_pair(client)
    pairing = _pair(client)
    response = client.get(f"/v1/pairings/{pairing['id']}/plan", params={"context_dp_rank": "x"})
    assert response.status_code == 422
    assert response.json()["errors"][0]["loc"] == ["query", "context_dp_rank"]


def test_unknown_pairing_is_404(client: TestClient) -> None:
    for path in ("/v1/pairings/nope", "/v1/pairings/nope/plan"):
        response = client.get(path)
        assert response.status_code == 404
        assert response.json()["code"] == "pairing_not_found"
    assert client.post("/v1/pairings/nope/validate").status_code == 404


def test_delete_instance_deletes_its_pairings(client: TestClient) -> None:
    _register_pair(client)
    pairing = _pair(client)
    assert client.delete("/v1/instances/gen-b").status_code == 204
    assert client.get(f"/v1/pairings/{pairing['id']}").status_code == 404


def test_compatibility_stores_nothing(client: TestClient) -> None:
    ctx = {**instance_body(role="context", tp=4, draft_heads=2), "name": "c"}
    gen = {**instance_body(role="generation", tp=2, draft_heads=2), "name": "g"}
    response = client.post("/v1/compatibility", json={"context": ctx, "generation": gen})
    assert response.status_code == 200, response.json()
    assert response.json()["compatible"] is True
    assert response.json()["plan"]["routes"] == 4
    bad_gen = {**instance_body(role="generation", tp=2, target_heads=4), "name": "g"}
    report = client.post("/v1/compatibility", json={"context": ctx, "generation": bad_gen}).json()
    assert report["compatible"] is False
    assert report["plan"] is None
    assert client.get("/v1/instances").json()["total"] == 0
    assert client.get("/v1/pairings").json()["total"] == 0


def test_compatibility_of_two_bodies_with_the_same_name_plans_each_side(
    client: TestClient,
) -> None:
    ctx = instance_body(role="context", tp=4, draft_heads=2)
    gen = instance_body(role="generation", tp=2, draft_heads=2)
    apart = client.post(
        "/v1/compatibility",
        json={"context": {**ctx, "name": "c"}, "generation": {**gen, "name": "g"}},
    ).json()
    same = client.post(
        "/v1/compatibility",
        json={"context": {**ctx, "name": "llama"}, "generation": {**gen, "name": "llama"}},
    ).json()
    assert apart["compatible"] is True
    assert same == apart


def test_compatibility_reports_a_tp_rank_that_lacks_a_layer(client: TestClient) -> None:
    ctx = {**instance_body(role="context", tp=2), "name": "c"}
    view = ctx["ranks"][1]["views"][0]
    view["buffers"] = [b for b in view["buffers"] if b["layer"] != 1]
    gen = {**instance_body(role="generation", tp=1), "name": "g"}
    response = client.post("/v1/compatibility", json={"context": ctx, "generation": gen})
    assert response.status_code == 200, response.json()  # was a 500 from compile_plan
    report = response.json()
    assert report["compatible"] is False and report["plan"] is None
    assert "missing_peer_shard" in {error["code"] for error in report["errors"]}


def test_block_size_ratio_is_compatible_with_a_warning_and_plans(client: TestClient) -> None:
    ctx = {**instance_body(role="context", tp=4, tokens_per_block=16), "name": "c"}
    gen = {**instance_body(role="generation", tp=2, tokens_per_block=64), "name": "g"}
    response = client.post("/v1/compatibility", json={"context": ctx, "generation": gen})
    assert response.status_code == 200, response.json()
    report = response.json()
    assert report["compatible"] is True, report["errors"]
    (warning,) = [w for w in report["warnings"] if w["code"] == "tokens_per_block_ratio"]
    assert (warning["detail"]["ratio"], warning["detail"]["larger_side"]) == (4, "generation")
    client.put("/v1/instances/ctx-a", json=instance_body(role="context", tp=4, tokens_per_block=16))
    client.put(
        "/v1/instances/gen-b", json=instance_body(role="generation", tp=2, tokens_per_block=64)
    )
    pairing = _pair(client)
    assert pairing["compatible"] is True
    plan = client.get(f"/v1/pairings/{pairing['id']}/plan").json()
    assert (plan["tokens_per_block"], plan["generation_tokens_per_block"]) == (16, 64)
    route = plan["routes"][0]
    assert (route["block_ratio"], route["large_side"]) == (4, "generation")
    assert sorted({s["sub_block"] for s in route["segments"]}) == [0, 1, 2, 3]
    # 136 tokens: 9 small context blocks (the last holds 8 of 16 tokens) and 3 large generation
    # blocks; every token moves, by token position from the request's start
    blocks = {"0": {"context": list(range(9)), "generation": [7, 8, 9]}}
    body = {"context": "ctx-a", "generation": "gen-b", "request_id": "r", "blocks": blocks}
    refused = client.post("/v1/transfers", json=body)
    assert (refused.status_code, refused.json()["code"]) == (422, "ambiguous_alignment")
    assert "num_tokens" in refused.json()["detail"]
    transfer = client.post("/v1/transfers", json={**body, "num_tokens": 136}).json()
    assert transfer["num_tokens"] == 136
    assert transfer["bytes"] == 136 * plan["bytes_per_block"] // 64
    fragments = client.get(f"/v1/transfers/{transfer['id']}/fragments").json()
    rows = [row for r in fragments["routes"] for row in r["fragments"]]
    assert sum(row[4] for row in rows) == transfer["bytes"]
    # the dashboard's head-slice picture draws one large block as 4 small ones
    page = client.get(f"/ui/pairings/{pairing['id']}?receiver=1")
    assert page.status_code == 200
    html = page.text
    assert 'class="block-ratio" data-ratio="4"' in html
    assert "generation block k (64 tokens)" in html
    assert html.count("context 4k+") == 3 and "context 4k<" in html
    assert "one generation block (64 tokens) = 4 context blocks (16 tokens each)" in html
    assert "per head 4 runs of 16 tokens per generation block, one per context block" in html
    assert "Bytes / generation block (64 tokens)" in html


def test_refused_block_size_ratio_is_a_report_never_a_500(client: TestClient) -> None:
    ctx = instance_body(role="context", tp=2, tokens_per_block=16)
    gen = instance_body(role="generation", tp=2, tokens_per_block=24)
    gen["ranks"][0]["views"][0]["layout"] = "NHD"
    gen["ranks"][1]["views"][0]["layout"] = "NHD"
    response = client.post(
        "/v1/compatibility",
        json={"context": {**ctx, "name": "c"}, "generation": {**gen, "name": "g"}},
    )
    assert response.status_code == 200, response.json()
    (error,) = [e for e in response.json()["errors"] if e["code"] == "tokens_per_block_mismatch"]
    assert error["detail"]["reasons"] == ["not_a_multiple", "layout"]
    assert client.put("/v1/instances/ctx-a", json=ctx).status_code == 201
    assert client.put("/v1/instances/gen-b", json=gen).status_code == 201
    pairing = _pair(client)
    assert pairing["compatible"] is False
    assert "tokens_per_block_mismatch" in {e["code"] for e in pairing["errors"]}


def test_the_pairing_page_counts_in_words(client: TestClient) -> None:
    """One route from one sender rank reads "1 route" and "1 sender rank", not "1 routes"."""
    client.put("/v1/instances/ctx-a", json=instance_body(role="context", tp=1))
    client.put("/v1/instances/gen-b", json=instance_body(role="generation", tp=1))
    pairing = _pair(client)
    html = client.get(f"/ui/pairings/{pairing['id']}").text
    assert "1 route from 1 sender rank to 1 receiver rank" in html
    assert " in 1 route, " in html
    assert "1 routes" not in html and "1 sender ranks" not in html
    client.put("/v1/instances/ctx-a", json=instance_body(role="context", tp=2))
    again = client.post("/v1/pairings", json={"context": "ctx-a", "generation": "gen-b"})
    html = client.get(f"/ui/pairings/{again.json()['id']}").text
    assert "2 routes from 2 sender ranks to 1 receiver rank" in html
