"""Registered page tables are untrusted: corrupted bodies get problem+json 4xx, never a 500, and
never a half-stored instance (a refused PUT leaves the previous registration exactly as it was).

Hypothesis starts from valid bodies (several parallelisms, with and without a draft view) and
corrupts them: a value anywhere in the tree replaced by a hostile one (huge or negative numbers,
floats, strings, nulls, containers), a key dropped, a list element duplicated or dropped, an unknown
key added. Whole registrations and rank-by-rank reports are both exercised.
"""

from __future__ import annotations

import copy
from typing import Any

from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from api.demo_fleet import instance_body

HOSTILE = st.one_of(
    st.integers(min_value=-(1 << 70), max_value=1 << 70),
    st.sampled_from([0, -1, 1, 2, 3, 7, 1 << 31, 1 << 32, 1 << 63, (1 << 64) - 1, 1 << 64]),
    st.floats(allow_nan=False, allow_infinity=False) | st.just(1.5),
    st.text(max_size=8),
    st.sampled_from(["HND", "NHD", "REPLICATED", "key", "draft", "target", "nvfp4", ""]),
    st.none(),
    st.booleans(),
    st.just([]),
    st.just({}),
    st.just([{"layer": 0, "offset": 0, "size": 1}]),
)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    paths = [prefix]
    if isinstance(node, dict):
        for key, value in node.items():
            paths += _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            paths += _paths(value, (*prefix, index))
    return paths


def _parent(body: Any, path: tuple[Any, ...]) -> Any:
    for part in path[:-1]:
        body = body[part]
    return body


@st.composite
def corrupted(draw: st.DrawFn, base: dict[str, Any]) -> dict[str, Any]:
    body = copy.deepcopy(base)
    for _ in range(draw(st.integers(min_value=0, max_value=3))):
        paths = [path for path in _paths(body) if path]
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = _parent(body, path)
        action = draw(st.sampled_from(["replace", "replace", "drop", "duplicate", "extra"]))
        # Copies: st.just() hands out one shared object, which later actions would mutate
        # (even into a cycle that contains itself).
        if action == "replace":
            parent[path[-1]] = copy.deepcopy(draw(HOSTILE))
        elif action == "drop":
            del parent[path[-1]]
        elif action == "duplicate" and isinstance(parent, list):
            parent.append(copy.deepcopy(parent[path[-1]]))
        elif action == "extra" and isinstance(parent, dict):
            parent["unexpected"] = copy.deepcopy(draw(HOSTILE))
    return body


BASES = [
    instance_body(role="context", tp=2),
    instance_body(role="context", tp=4, draft_heads=2),
    instance_body(role="generation", tp=1, target_layers=2),
    instance_body(role="generation", tp=2, pp=2, target_layers=4),
]


def _state(client: TestClient, name: str) -> Any:
    response = client.get(f"/v1/instances/{name}")
    return response.status_code, response.json()


def _check(response: Any) -> bool:
    """True when accepted; a refusal must be problem+json 4xx (never 5xx)."""
    assert response.status_code < 500, response.text
    if response.status_code in (200, 201):
        return True
    assert 400 <= response.status_code < 500
    assert response.headers["content-type"] == "application/problem+json", response.text
    assert response.json()["code"]
    return False


def test_corrupted_page_tables_never_500_nor_half_stored(app: FastAPI) -> None:
    with TestClient(app) as client:
        for index, base in enumerate(BASES):
            assert client.put(f"/v1/instances/i{index}", json=base).status_code == 201

        @given(data=st.data())
        @settings(
            max_examples=120,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def run(data: st.DataObject) -> None:
            index = data.draw(st.integers(min_value=0, max_value=len(BASES) - 1))
            name = f"i{index}"
            before = _state(client, name)
            if data.draw(st.booleans()):
                body = data.draw(corrupted(BASES[index]))
                response = client.put(f"/v1/instances/{name}", json=body)
            else:
                ranks = BASES[index]["ranks"]
                rank = data.draw(st.integers(min_value=0, max_value=len(ranks) - 1))
                body = data.draw(corrupted(ranks[rank]))
                target = data.draw(st.sampled_from([rank, rank, len(ranks), 1023]))
                response = client.put(f"/v1/instances/{name}/ranks/{target}", json=body)
            accepted = _check(response)
            outcomes.append(accepted)
            if accepted:
                # Accepted: the stored state is what the server answered.
                assert _state(client, name) == (200, response.json())
                # Put the base back for the next example (identical body: no new epoch needed).
                assert _check(client.put(f"/v1/instances/{name}", json=BASES[index]))
            else:
                assert _state(client, name) == before

        outcomes: list[bool] = []
        run()
        # Both paths were exercised: some corruptions are harmless, most are refused.
        assert any(outcomes) and not all(outcomes), outcomes.count(True)
