"""Per-request recurrent state over the API: registration, pairing, plans and transfers."""

from __future__ import annotations

import copy
from typing import Any

from fastapi.testclient import TestClient

from geometry.state_builders import HybridSpec, hybrid_body

SPEC = HybridSpec(
    num_layers=4,
    attention_layers=(1,),
    kv_heads=4,
    head_dim=8,
    ssm_heads=8,
    ssm_head_dim=4,
    d_state=4,
    conv_channels=(32, 16, 16),
    d_conv=4,
)
STATE_BYTES = 3 * ((32 + 16 + 16) * 3 * 2 + 8 * 4 * 4 * 4)  # 3 recurrent layers, aggregated


def _body(role: str, **kw: Any) -> dict[str, Any]:
    return hybrid_body(role=role, spec=SPEC, tokens_per_block=4, num_slots=16, **kw)


def _setup(client: TestClient) -> str:
    for name, body in (("ctx-s", _body("context", tp=2)), ("gen-s", _body("generation", tp=1))):
        response = client.put(f"/v1/instances/{name}", json=body)
        assert response.status_code == 201, response.json()
    pairing = client.post("/v1/pairings", json={"context": "ctx-s", "generation": "gen-s"})
    assert pairing.json()["compatible"] is True, pairing.json()
    return str(pairing.json()["id"])


def _transfer(state: dict[str, Any], request_id: str = "req-s") -> dict[str, Any]:
    return {
        "context": "ctx-s",
        "generation": "gen-s",
        "request_id": request_id,
        "blocks": {"0": {"context": [3, 4], "generation": [1, 2]}, "1": state},
    }


def test_a_hybrid_registration_reads_back_and_re_registers_as_a_no_op(client: TestClient) -> None:
    body = _body("context", tp=2)
    assert client.put("/v1/instances/ctx-s", json=body).status_code == 201
    read = client.get("/v1/instances/ctx-s").json()
    assert read["layer_groups"] == body["layer_groups"]
    conv = read["ranks"][0]["views"][1]
    assert conv["layout"] == "SECTIONED" and conv["section_bytes"] == list(SPEC.section_bytes)
    assert read["ranks"][0]["views"][2]["d_state"] == 4
    again = client.put("/v1/instances/ctx-s", json=body)
    assert again.status_code == 200 and again.json()["generation"] == read["generation"]


def test_a_transfer_names_one_state_slot_per_side(client: TestClient) -> None:
    pairing_id = _setup(client)
    plan = client.get(f"/v1/pairings/{pairing_id}/plan").json()
    state_segments = [s for r in plan["routes"] for s in r["segments"] if s["state"]]
    assert {s["layer_group"] for s in state_segments} == {1}
    kv_only = client.post("/v1/transfers", json=_transfer({"context": [], "generation": [0]}))
    assert kv_only.status_code == 201, kv_only.json()
    full = client.post("/v1/transfers", json=_transfer({"context": [5], "generation": [0]}, "r2"))
    assert full.status_code == 201, full.json()
    assert full.json()["bytes"] - kv_only.json()["bytes"] == STATE_BYTES
    fragments = client.get(f"/v1/transfers/{full.json()['id']}/fragments").json()
    moved = sum(row[4] for r in fragments["routes"] for row in r["fragments"])
    assert moved == full.json()["bytes"]


def test_wrong_state_slot_counts_are_422_invalid_blocks(client: TestClient) -> None:
    _setup(client)
    for side, state in (
        ("context", {"context": [1, 2], "generation": [0]}),
        ("generation", {"context": [1], "generation": [0, 3]}),
    ):
        response = client.post("/v1/transfers", json=_transfer(state, f"bad-{side}"))
        assert response.status_code == 422, response.json()
        problem = response.json()
        assert problem["code"] == "invalid_blocks"
        assert problem["errors"][0]["loc"] == ["body", "blocks", "1", side]
        assert "exactly one" in problem["errors"][0]["msg"]
    assert client.get("/v1/transfers").json()["total"] == 0


def test_bad_state_bodies_are_422_invalid_geometry_naming_every_field(client: TestClient) -> None:
    body = _body("context", tp=2)
    broken = copy.deepcopy(body)
    broken["ranks"][0]["views"][1]["section_bytes"] = [191, 97, 96]
    broken["ranks"][1]["views"][2]["layout"] = "NHD"
    response = client.put("/v1/instances/ctx-s", json=broken)
    assert response.status_code == 422, response.json()
    problem = response.json()
    assert problem["code"] == "invalid_geometry"
    where = {(".".join(map(str, e["loc"])), e["code"]) for e in problem["errors"]}
    assert ("body.ranks.0.views.1.section_bytes.0", "state_geometry_invalid") in where
    assert ("body.ranks.1.views.2.layout", "state_geometry_invalid") in where
    unlisted = copy.deepcopy(body)
    del unlisted["layer_groups"]  # SECTIONED views in a group nobody declared as state
    response = client.put("/v1/instances/ctx-s", json=unlisted)
    assert response.status_code == 422
    assert "tokens_per_slot null" in response.json()["errors"][0]["msg"]
    bad_group = dict(body, layer_groups=[{"id": 1, "tokens_per_slot": 0}])
    response = client.put("/v1/instances/ctx-s", json=bad_group)
    assert response.status_code == 422
    assert response.json()["errors"][0]["loc"][:3] == ["body", "layer_groups", 0]


def test_state_on_one_side_only_is_an_incompatible_pairing(client: TestClient) -> None:
    from geometry.builders import ViewSpec, instance_body

    plain = instance_body(role="context", views=[ViewSpec("target", 4, 4, 8)], tokens_per_block=4)
    assert client.put("/v1/instances/ctx-p", json=plain).status_code == 201
    assert client.put("/v1/instances/gen-s", json=_body("generation")).status_code == 201
    pairing = client.post("/v1/pairings", json={"context": "ctx-p", "generation": "gen-s"})
    assert pairing.status_code == 201
    assert pairing.json()["compatible"] is False
    assert "state_group_mismatch" in {e["code"] for e in pairing.json()["errors"]}


def test_the_dashboard_shows_state_views(client: TestClient) -> None:
    assert client.put("/v1/instances/ctx-s", json=_body("context", tp=2)).status_code == 201
    page = client.get("/ui/instances/ctx-s")
    assert page.status_code == 200, page.text
    assert "conv sections 192 + 96 + 96 bytes (all ranks), split over 2 ranks" in page.text
    assert "SECTIONED" in page.text and "ssm_state" in page.text


def test_a_hybrid_pairing_with_a_block_size_ratio_moves_state_once_and_kv_by_tokens(
    client: TestClient,
) -> None:
    """Paged groups align by token position (4 context blocks of 4 tokens per generation block
    of 16, a partial last block);
    the state group has no tokens, so its one slot pair moves as with equal block sizes."""
    ctx = hybrid_body(role="context", spec=SPEC, tp=2, tokens_per_block=4, num_slots=16)
    gen = hybrid_body(role="generation", spec=SPEC, tp=1, tokens_per_block=16, num_slots=16)
    for name, body in (("ctx-s", ctx), ("gen-s", gen)):
        assert client.put(f"/v1/instances/{name}", json=body).status_code == 201
    pairing = client.post("/v1/pairings", json={"context": "ctx-s", "generation": "gen-s"}).json()
    assert pairing["compatible"] is True, pairing["errors"]
    (warning,) = [w for w in pairing["warnings"] if w["code"] == "tokens_per_block_ratio"]
    assert (warning["detail"]["ratio"], warning["detail"]["larger_side"]) == (4, "generation")
    plan = client.get(f"/v1/pairings/{pairing['id']}/plan").json()
    assert (plan["tokens_per_block"], plan["generation_tokens_per_block"]) == (4, 16)
    segments = [s for r in plan["routes"] for s in r["segments"]]
    assert {(s["layer_group"], s["state"], s["sub_block"]) for s in segments} == {
        (1, True, 0),
        *((0, False, i) for i in range(4)),
    }

    def transfer(state: dict[str, Any], request_id: str) -> dict[str, Any]:
        blocks = {"0": {"context": list(range(9)), "generation": [7, 8, 9]}, "1": state}
        response = client.post(
            "/v1/transfers",
            json={"context": "ctx-s", "generation": "gen-s", "request_id": request_id,
                  "blocks": blocks, "num_tokens": 34},
        )  # fmt: skip
        assert response.status_code == 201, response.json()
        return dict(response.json())

    kv_only = transfer({"context": [], "generation": [0]}, "r1")
    full = transfer({"context": [5], "generation": [0]}, "r2")
    # 34 tokens (the context's 9th block holds 2 of 4, the generation's 3rd 2 of 16), all moved:
    # 1 attention layer × K/V × 4 heads × 34 tokens × 8 dims × 2 bytes
    assert kv_only["bytes"] == 2 * 4 * 34 * 8 * 2
    assert full["bytes"] - kv_only["bytes"] == STATE_BYTES
    fragments = client.get(f"/v1/transfers/{full['id']}/fragments").json()
    assert sum(row[4] for r in fragments["routes"] for row in r["fragments"]) == full["bytes"]
    page = client.get(f"/ui/pairings/{pairing['id']}?receiver=0")
    assert page.status_code == 200, page.text
    assert 'class="block-ratio" data-ratio="4"' in page.text
