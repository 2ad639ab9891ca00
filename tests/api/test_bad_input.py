"""Bad input: every rejection is 4xx problem+json naming the field, and nothing is stored."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.demo_fleet import instance_body, rank_body

PROBLEM = "application/problem+json"


def _assert_problem(response: Any, status: int, loc: list[Any] | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == PROBLEM
    problem = response.json()
    assert problem["status"] == status
    assert problem["code"]
    if loc is not None:
        locs = [error["loc"] for error in problem["errors"]]
        assert loc in locs, locs
    return problem


def _nothing_stored(client: TestClient) -> None:
    assert client.get("/v1/instances").json()["total"] == 0


def _body() -> dict[str, Any]:
    return instance_body(role="context", tp=2, draft_heads=2)


def test_malformed_json_is_400(client: TestClient) -> None:
    response = client.put(
        "/v1/instances/ctx-a",
        content=b'{"role": "context", "tp": ',
        headers={"content-type": "application/json"},
    )
    problem = _assert_problem(response, 400)
    assert problem["code"] == "malformed_json"
    _nothing_stored(client)


def test_not_an_object_is_422(client: TestClient) -> None:
    _assert_problem(client.put("/v1/instances/ctx-a", json=[1, 2]), 422, ["body"])
    _nothing_stored(client)


@pytest.mark.parametrize(
    ("mutate", "loc"),
    [
        (lambda b: b.update(tp=True), ["body", "tp"]),
        (lambda b: b.update(tp="2"), ["body", "tp"]),
        (lambda b: b.update(attention_dp=0), ["body", "attention_dp"]),
        (lambda b: b.update(tokens_per_block=32.0), ["body", "tokens_per_block"]),
        (lambda b: b.update(tokens_per_block=-1), ["body", "tokens_per_block"]),
        (lambda b: b.update(tokens_per_block=10**30), ["body", "tokens_per_block"]),
        (lambda b: b.update(role="prefill"), ["body", "role"]),
        (lambda b: b.update(colour="red"), ["body", "colour"]),
        (lambda b: b["ranks"][0].update(rank=False), ["body", "ranks", 0, "rank"]),
        (
            lambda b: b["ranks"][0]["pools"][0].update(slot_bytes=-5),
            ["body", "ranks", 0, "pools", 0, "slot_bytes"],
        ),
        (
            lambda b: b["ranks"][0]["pools"][0].update(num_slots=1 << 60),
            ["body", "ranks", 0, "pools", 0, "num_slots"],
        ),
        (
            lambda b: b["ranks"][1]["views"][0]["buffers"][0].update(size="16384"),
            ["body", "ranks", 1, "views", 0, "buffers", 0, "size"],
        ),
        (
            lambda b: b["ranks"][1]["views"][0].update(extra_field=1),
            ["body", "ranks", 1, "views", 0, "extra_field"],
        ),
    ],
)
def test_wrong_types_and_sizes_are_422(client: TestClient, mutate: Any, loc: list[Any]) -> None:
    body = _body()
    mutate(body)
    problem = _assert_problem(client.put("/v1/instances/ctx-a", json=body), 422, loc)
    assert problem["code"] == "validation_error"
    _nothing_stored(client)


def test_duplicate_rank_is_422(client: TestClient) -> None:
    body = _body()
    body["ranks"][1] = copy.deepcopy(body["ranks"][0])
    _assert_problem(client.put("/v1/instances/ctx-a", json=body), 422, ["body", "ranks", 1, "rank"])
    _nothing_stored(client)


def test_rank_outside_world_size_is_422(client: TestClient) -> None:
    body = _body()
    body["ranks"][1]["rank"] = 2
    _assert_problem(client.put("/v1/instances/ctx-a", json=body), 422, ["body", "ranks", 1, "rank"])
    _nothing_stored(client)
    client.put("/v1/instances/ctx-a", json=instance_body(role="context", tp=2, with_ranks=False))
    response = client.put("/v1/instances/ctx-a/ranks/5", json=rank_body(5, group_size=2))
    _assert_problem(response, 422, ["body", "rank"])
    assert client.get("/v1/instances/ctx-a").json()["ranks"] == []


def test_view_breaking_page_table_rules_is_422(client: TestClient) -> None:
    body = _body()
    view = body["ranks"][0]["views"][0]
    view["num_kv_heads"] = 3  # TP2 over 8 heads holds 4 per rank
    problem = _assert_problem(client.put("/v1/instances/ctx-a", json=body), 422)
    assert problem["code"] == "invalid_geometry"
    assert problem["errors"][0]["loc"][:5] == ["body", "ranks", 0, "views", 0]
    _nothing_stored(client)


def test_overlapping_buffers_are_422(client: TestClient) -> None:
    body = _body()
    buffers = body["ranks"][0]["views"][0]["buffers"]
    buffers[1]["offset"] = buffers[0]["offset"] + 1
    problem = _assert_problem(client.put("/v1/instances/ctx-a", json=body), 422)
    assert problem["code"] == "invalid_geometry"
    _nothing_stored(client)


@pytest.mark.parametrize("name", ["has space", "-leading-dash", "x" * 129, "semi;colon"])
def test_bad_names_are_422(client: TestClient, name: str) -> None:
    _assert_problem(client.put(f"/v1/instances/{name}", json=_body()), 422, ["path", "name"])
    _nothing_stored(client)


def test_name_with_slash_is_not_a_route(client: TestClient) -> None:
    response = client.put("/v1/instances/a/b", json=_body())
    assert response.status_code in (404, 405)
    assert response.headers["content-type"] == PROBLEM
    _nothing_stored(client)


@pytest.mark.parametrize("method", ["PUT", "GET", "DELETE"])
def test_name_with_an_encoded_slash_is_422_naming_it(client: TestClient, method: str) -> None:
    response = client.request(method, "/v1/instances/a%2Fb", json=_body())
    problem = _assert_problem(response, 422, ["path", "name"])
    assert "'/'" in problem["errors"][0]["msg"]
    _nothing_stored(client)


def test_an_encoded_slash_never_reaches_another_route(client: TestClient) -> None:
    # Decoded, this would be POST /v1/transfers/x/retry: the retry of transfer "x".
    _assert_problem(client.post("/v1/transfers/x%2Fretry"), 422, ["path", "id"])
    _assert_problem(client.get("/v1/pairings/a%2fb"), 422, ["path", "id"])


def test_ten_megabyte_body_is_413(client: TestClient) -> None:
    body = _body()
    body["model"] = "x" * (10 << 20)
    problem = _assert_problem(client.put("/v1/instances/ctx-a", json=body), 413, ["body"])
    assert problem["code"] == "payload_too_large"
    _nothing_stored(client)


def test_streamed_body_over_the_limit_is_413(client: TestClient) -> None:
    payload = json.dumps({**_body(), "model": "y" * (2 << 20)}).encode()

    def chunks():  # no Content-Length: the limit is enforced while reading
        for start in range(0, len(payload), 65536):
            yield payload[start : start + 65536]

    response = client.put(
        "/v1/instances/ctx-a", content=chunks(), headers={"content-type": "application/json"}
    )
    _assert_problem(response, 413)
    _nothing_stored(client)


def test_pairing_and_transfer_bodies_are_strict(client: TestClient) -> None:
    _assert_problem(
        client.post("/v1/pairings", json={"context": "a", "generation": 1}),
        422,
        ["body", "generation"],
    )
    _assert_problem(
        client.post("/v1/pairings", json={"context": "a b", "generation": "c"}),
        422,
        ["body", "context"],
    )
    transfer = {
        "context": "a",
        "generation": "b",
        "request_id": "r",
        "blocks": {"0": {"context": [0, -1], "generation": [0, 1]}},
    }
    _assert_problem(
        client.post("/v1/transfers", json=transfer),
        422,
        ["body", "blocks", "0", "context", 1],
    )
    transfer["blocks"] = {"0": {"context": [0], "generation": [0]}}
    transfer["execute"] = "true"
    _assert_problem(client.post("/v1/transfers", json=transfer), 422, ["body", "execute"])


def test_unknown_route_is_problem(client: TestClient) -> None:
    problem = _assert_problem(client.get("/v1/nothing-here"), 404)
    assert problem["code"] == "not_found"
    assert _assert_problem(client.post("/healthz"), 405)["code"] == "method_not_allowed"


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b'{"role": "context", "model": "\xff\xfe"}', "UTF-8"),
        (b"[" * 1000 + b"]" * 1000, "nested"),
        (b'{"tp": ' + b"9" * 5000 + b"}", "digits"),
    ],
    ids=["invalid-utf8", "nested-1000-deep", "5000-digit-integer"],
)
def test_undecodable_bodies_are_malformed_json_with_a_detail(
    client: TestClient, content: bytes, says: str
) -> None:
    """Undecodable bodies are ``400 malformed_json`` with a detail that says what is wrong."""
    for method, path in (("PUT", "/v1/instances/ctx-a"), ("POST", "/v1/transfers")):
        response = client.request(
            method, path, content=content, headers={"content-type": "application/json"}
        )
        problem = _assert_problem(response, 400)
        assert problem["code"] == "malformed_json", problem
        assert says in problem["detail"], problem
    _nothing_stored(client)


def test_405_lists_every_method_of_the_path(client: TestClient) -> None:
    """A 405's ``Allow`` header names every method of the path, not just one."""
    response = client.post("/v1/instances/ctx-a")
    problem = _assert_problem(response, 405)
    assert problem["code"] == "method_not_allowed"
    allowed = {method.strip() for method in response.headers["allow"].split(",")}
    assert {"GET", "PUT", "DELETE"} <= allowed, allowed
    assert "POST" not in allowed
    response = client.delete("/v1/transfers")
    assert {m.strip() for m in response.headers["allow"].split(",")} >= {"GET", "POST"}
