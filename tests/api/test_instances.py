"""Instance registration: PUT whole or rank by rank, generations, epochs, If-Match, listing."""

from __future__ import annotations

import copy

from fastapi.testclient import TestClient

from api.demo_fleet import instance_body, rank_body


def test_put_creates_then_identical_put_changes_nothing(client: TestClient) -> None:
    body = instance_body(role="context", tp=4, draft_heads=2)
    first = client.put("/v1/instances/ctx-a", json=body)
    assert first.status_code == 201
    created = first.json()
    assert created["status"] == "ready"
    assert created["generation"] == 1
    assert created["world_size"] == 4
    assert created["missing_ranks"] == []
    assert first.headers["etag"] == '"1"'

    again = client.put("/v1/instances/ctx-a", json=body)
    assert again.status_code == 200
    assert again.json()["generation"] == 1
    assert again.json()["epoch"] == created["epoch"]


def test_changed_body_bumps_generation_and_epoch(client: TestClient) -> None:
    body = instance_body(role="context", tp=2)
    created = client.put("/v1/instances/ctx-a", json=body).json()
    changed = copy.deepcopy(body)
    changed["model"] = "other-model"
    replaced = client.put("/v1/instances/ctx-a", json=changed)
    assert replaced.status_code == 200
    assert replaced.json()["generation"] == 2
    assert replaced.json()["epoch"] != created["epoch"]
    assert replaced.json()["model"] == "other-model"


def test_header_change_drops_ranks_not_in_the_body(client: TestClient) -> None:
    client.put("/v1/instances/ctx-a", json=instance_body(role="context", tp=2))
    header = instance_body(role="context", tp=2, with_ranks=False, model="restarted")
    response = client.put("/v1/instances/ctx-a", json=header)
    assert response.json()["status"] == "incomplete"
    assert response.json()["missing_ranks"] == [0, 1]
    assert response.json()["ranks"] == []


def test_same_header_without_ranks_keeps_reported_ranks(client: TestClient) -> None:
    client.put("/v1/instances/ctx-a", json=instance_body(role="context", tp=2))
    header = instance_body(role="context", tp=2, with_ranks=False)
    response = client.put("/v1/instances/ctx-a", json=header)
    assert response.status_code == 200
    assert response.json()["generation"] == 1
    assert response.json()["status"] == "ready"


def test_ranks_one_by_one_until_ready(client: TestClient) -> None:
    header = instance_body(role="generation", tp=2, with_ranks=False)
    created = client.put("/v1/instances/gen-b", json=header).json()
    assert created["status"] == "incomplete"
    assert created["missing_ranks"] == [0, 1]

    first = client.put("/v1/instances/gen-b/ranks/1", json=rank_body(1, group_size=2))
    assert first.status_code == 201
    assert first.json()["status"] == "incomplete"
    assert first.json()["missing_ranks"] == [0]
    assert first.json()["generation"] == 2

    second = client.put("/v1/instances/gen-b/ranks/0", json=rank_body(0, group_size=2))
    assert second.json()["status"] == "ready"
    assert second.json()["missing_ranks"] == []

    same = client.put("/v1/instances/gen-b/ranks/0", json=rank_body(0, group_size=2))
    assert same.status_code == 200
    assert same.json()["generation"] == second.json()["generation"]

    listed = client.get("/v1/instances", params={"status": "ready"}).json()
    assert [item["name"] for item in listed["items"]] == ["gen-b"]


def test_rank_for_unknown_instance_is_404(client: TestClient) -> None:
    response = client.put("/v1/instances/nope/ranks/0", json=rank_body(0, group_size=1))
    assert response.status_code == 404
    assert response.json()["code"] == "instance_not_found"


def test_rank_body_must_match_path(client: TestClient) -> None:
    client.put("/v1/instances/gen-b", json=instance_body(role="generation", tp=2, with_ranks=False))
    response = client.put("/v1/instances/gen-b/ranks/0", json=rank_body(1, group_size=2))
    assert response.status_code == 422
    assert response.json()["errors"][0]["loc"] == ["body", "rank"]


def test_if_match(client: TestClient) -> None:
    body = instance_body(role="context", tp=1)
    assert client.put("/v1/instances/c", json=body, headers={"If-Match": "1"}).status_code == 412
    client.put("/v1/instances/c", json=body)
    changed = {**body, "model": "m2"}
    stale = client.put("/v1/instances/c", json=changed, headers={"If-Match": "7"})
    assert stale.status_code == 412
    assert stale.headers["content-type"] == "application/problem+json"
    assert stale.json()["code"] == "precondition_failed"
    assert client.get("/v1/instances/c").json()["model"] == body["model"]
    ok = client.put("/v1/instances/c", json=changed, headers={"If-Match": '"1"'})
    assert ok.status_code == 200
    assert ok.json()["generation"] == 2
    assert client.delete("/v1/instances/c", headers={"If-Match": "1"}).status_code == 412


def test_list_filters_and_paginates(client: TestClient) -> None:
    for index in range(3):
        client.put(f"/v1/instances/ctx-{index}", json=instance_body(role="context", tp=1))
    client.put("/v1/instances/gen-0", json=instance_body(role="generation", tp=1))
    page = client.get("/v1/instances", params={"role": "context", "limit": 2}).json()
    assert page["total"] == 3
    assert [item["name"] for item in page["items"]] == ["ctx-0", "ctx-1"]
    rest = client.get("/v1/instances", params={"role": "context", "limit": 2, "offset": 2}).json()
    assert [item["name"] for item in rest["items"]] == ["ctx-2"]
    gens = client.get("/v1/instances", params={"role": "generation"}).json()
    assert [item["name"] for item in gens["items"]] == ["gen-0"]


def test_get_and_delete(client: TestClient) -> None:
    body = instance_body(role="context", tp=2)
    client.put("/v1/instances/ctx-a", json=body)
    got = client.get("/v1/instances/ctx-a").json()
    assert [rank["rank"] for rank in got["ranks"]] == [0, 1]
    assert got["ranks"][0]["views"][0]["num_kv_heads"] == 4
    assert client.delete("/v1/instances/ctx-a").status_code == 204
    missing = client.get("/v1/instances/ctx-a")
    assert missing.status_code == 404
    assert missing.json()["code"] == "instance_not_found"
    assert client.delete("/v1/instances/ctx-a").status_code == 404
