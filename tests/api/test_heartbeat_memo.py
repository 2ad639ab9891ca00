"""A live worker's heartbeat writes ``heartbeat_at`` at most every 2 s and is answered from
memory in between; anything its answer depends on (a stop, a supersession, a new epoch, a
pairing) is answered at once, never from a stale memory."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import event

from api.demo_fleet import fake_peer
from api.services.liveness import WRITE_WINDOW_S
from geometry.builders import ViewSpec, instance_body

VIEWS = [ViewSpec("target", layers=2, kv_heads=4, head_dim=8)]


class Clock:
    """The app's clock, moved by the test."""

    def __init__(self) -> None:
        self.now = datetime.now().astimezone()

    def __call__(self) -> datetime:
        return self.now


def _statements(client: TestClient) -> list[str]:
    """Every statement the app's database runs from now on (a list the test reads)."""
    seen: list[str] = []
    engine = client.app.state.db.engine  # type: ignore[attr-defined]
    event.listen(engine, "before_cursor_execute", lambda *args: seen.append(args[2]))
    return seen


def _attach(client: TestClient, name: str, body: dict[str, Any], agent: str) -> str:
    answer = client.post(
        "/v1/workers",
        json={"instance": name, "rank": 0, "peer": fake_peer(body["ranks"][0], agent)},
    )
    assert answer.status_code == 201, answer.text
    return str(answer.json()["id"])


def _fleet(client: TestClient) -> tuple[str, str]:
    """ctx and gen, one rank each, a worker attached to each (not paired)."""
    workers = []
    for name, role in (("ctx", "context"), ("gen", "generation")):
        body = instance_body(role=role, views=VIEWS, tp=1, tokens_per_block=4)
        assert client.put(f"/v1/instances/{name}", json=body).status_code == 201
        workers.append(_attach(client, name, body, f"{name}.r0"))
    return workers[0], workers[1]


def _beat(client: TestClient, worker: str) -> Any:
    return client.post(f"/v1/workers/{worker}/heartbeat")


def test_heartbeats_between_writes_touch_no_database(client: TestClient) -> None:
    clock = Clock()
    client.app.state.clock = clock  # type: ignore[attr-defined]
    ctx, _ = _fleet(client)
    first = _beat(client, ctx)
    assert first.status_code == 200 and first.json()["status"] == "alive"
    seen = _statements(client)
    clock.now += timedelta(seconds=WRITE_WINDOW_S / 2)
    answer = _beat(client, ctx)
    assert answer.status_code == 200, answer.text
    assert answer.json()["directory_revision"] == first.json()["directory_revision"]
    assert answer.json()["heartbeat_at"] == first.json()["heartbeat_at"]  # the last written
    assert answer.json()["heartbeat_age_s"] == WRITE_WINDOW_S / 2
    assert seen == []
    clock.now += timedelta(seconds=WRITE_WINDOW_S)
    written = _beat(client, ctx).json()
    updates = [s for s in seen if s.lstrip().upper().startswith("UPDATE")]
    assert len(updates) == 1 and "heartbeat_at" in updates[0], seen
    assert datetime.fromisoformat(written["heartbeat_at"]) == clock.now


def test_a_pairing_reaches_the_next_heartbeat_at_once(client: TestClient) -> None:
    clock = Clock()
    client.app.state.clock = clock  # type: ignore[attr-defined]
    ctx, _ = _fleet(client)
    before = _beat(client, ctx).json()["directory_revision"]
    paired = client.post("/v1/pairings", json={"context": "ctx", "generation": "gen"})
    assert paired.status_code == 201, paired.text
    assert _beat(client, ctx).json()["directory_revision"] != before


def test_a_stopped_or_superseded_worker_is_told_at_once(client: TestClient) -> None:
    clock = Clock()
    client.app.state.clock = clock  # type: ignore[attr-defined]
    ctx, gen = _fleet(client)
    assert _beat(client, ctx).status_code == 200 and _beat(client, gen).status_code == 200
    assert client.delete(f"/v1/workers/{gen}").status_code == 204
    answer = _beat(client, gen)
    assert answer.status_code == 409 and answer.json()["code"] == "worker_retired", answer.text
    body = instance_body(role="context", views=VIEWS, tp=1, tokens_per_block=4)
    _attach(client, "ctx", body, "ctx.r0.b")  # a second worker on rank 0
    answer = _beat(client, ctx)
    assert answer.status_code == 409 and answer.json()["code"] == "worker_superseded"


def test_a_new_epoch_is_told_at_once(client: TestClient) -> None:
    clock = Clock()
    client.app.state.clock = clock  # type: ignore[attr-defined]
    ctx, _ = _fleet(client)
    assert _beat(client, ctx).status_code == 200
    changed = instance_body(role="context", views=VIEWS, tp=1, tokens_per_block=8)
    assert client.put("/v1/instances/ctx", json=changed).status_code == 200
    answer = _beat(client, ctx)
    assert answer.status_code == 409 and answer.json()["code"] == "worker_stale", answer.text


def test_a_worker_back_from_gone_is_written_at_once(client: TestClient) -> None:
    clock = Clock()
    client.app.state.clock = clock  # type: ignore[attr-defined]
    ctx, gen = _fleet(client)
    client.post("/v1/pairings", json={"context": "ctx", "generation": "gen"})
    assert _beat(client, ctx).status_code == 200
    before = _beat(client, gen).json()["directory_revision"]
    clock.now += timedelta(seconds=30)  # ctx is gone for its peers
    assert _beat(client, ctx).json()["status"] == "alive"  # written: back in the directories
    after = _beat(client, gen).json()
    assert after["directory_revision"] != before
