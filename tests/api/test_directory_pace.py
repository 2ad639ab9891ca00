"""Each worker's directory reads are paced: a client reading in a tight loop waits its turn or
gets 429, and takes nothing from other workers' reads."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable

from fastapi import FastAPI
from fastapi.testclient import TestClient

from api.demo_fleet import fake_peer
from geometry.builders import ViewSpec, instance_body

VIEWS = [ViewSpec("target", layers=2, kv_heads=2, head_dim=16)]


def _workers(api: TestClient) -> list[str]:
    body = instance_body(role="context", views=VIEWS, tp=2, tokens_per_block=4)
    assert api.put("/v1/instances/ctx", json=body).status_code == 201
    ids = []
    for rank_body in body["ranks"]:
        answer = api.post(
            "/v1/workers",
            json={
                "instance": "ctx",
                "rank": rank_body["rank"],
                "peer": fake_peer(rank_body, f"ctx.r{rank_body['rank']}"),
            },
        )
        assert answer.status_code == 201, answer.text
        ids.append(answer.json()["id"])
    return ids


def _read_together(api: TestClient, worker: str, count: int) -> list[int]:
    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        answers = list(pool.map(lambda _: api.get(f"/v1/workers/{worker}/directory"), range(count)))
    for answer in answers:
        if answer.status_code == 429:
            assert answer.json()["code"] == "rate_limited"
            assert answer.headers["Retry-After"] == "1"
    return sorted(answer.status_code for answer in answers)


def test_a_tight_loop_of_directory_reads_is_paced(make_app: Callable[..., FastAPI]) -> None:
    # One read a second in bursts of 2, a wait of at most 1 s: of 8 reads at once, two pass,
    # the third waits 1 s for its turn, and the rest (2 s and more away) are refused.
    app = make_app(directory_reads_per_s=1, directory_burst=2)
    with TestClient(app) as api:
        first, second = _workers(api)
        assert _read_together(api, first, 8) == [200] * 3 + [429] * 5
        # Another worker's reads have their own pace.
        assert api.get(f"/v1/workers/{second}/directory").status_code == 200


def test_pacing_can_be_turned_off(make_app: Callable[..., FastAPI]) -> None:
    app = make_app(directory_reads_per_s=0)
    with TestClient(app) as api:
        first, _ = _workers(api)
        assert _read_together(api, first, 8) == [200] * 8
