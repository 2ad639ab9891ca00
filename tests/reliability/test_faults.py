"""Faults: a held SQLite write lock (503 + Retry-After, and the client rides it), two operators
racing on one instance with ``If-Match`` (exactly one wins, the other gets 412), and a transfer
pushed to workers that attached but had not opened their command streams yet."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
from fastapi import FastAPI
from fastapi.testclient import TestClient

from api.client import Client

from .conftest import FakeFleet, Server, fleet_bodies, setup_fleet, transfer_body


class Recording(httpx.HTTPTransport):
    """An HTTP transport that remembers every status it saw (retries included)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, str | None]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        self.seen.append((response.status_code, response.headers.get("retry-after")))
        return response


def test_client_rides_a_held_sqlite_write_lock(
    sqlite_url: str, start_server: Callable[..., Server]
) -> None:
    server = start_server(sqlite_url, sqlite_busy_timeout_ms="100")
    ctx, _ = fleet_bodies()
    holder = sqlite3.connect(
        sqlite_url.removeprefix("sqlite:///"), isolation_level=None, check_same_thread=False
    )
    try:
        holder.execute("BEGIN IMMEDIATE")
        release = threading.Timer(1.0, lambda: holder.execute("ROLLBACK"))
        transport = Recording()
        with Client(
            server.url, retries=10, backoff_s=0.1, max_backoff_s=1.0, transport=transport
        ) as client:
            started = time.monotonic()
            release.start()
            read = client.register_instance("ctx", ctx)
            waited_s = time.monotonic() - started
        release.join()
    finally:
        holder.close()
    assert read["generation"] == 1 and read["status"] == "ready"
    busy = [seen for seen in transport.seen if seen[0] == 503]
    assert busy, transport.seen  # the lock really was in the way
    assert all(retry_after == "1" for _, retry_after in busy)
    assert transport.seen[-1][0] == 201
    assert waited_s >= 0.9
    print(f"busy: {len(busy)} x 503 then 201 after {waited_s:.2f} s")


def race(app: FastAPI, body: dict[str, Any], generation: int) -> list[Any]:
    """Two clients PUT at once, both with ``If-Match: generation``; their responses."""
    barrier = threading.Barrier(2)
    results: list[Any] = [None, None]

    def update(slot: int) -> None:
        own = TestClient(app)  # one client per thread; the test's client owns the lifespan
        try:
            barrier.wait()
            results[slot] = own.put(
                "/v1/instances/ctx",
                json={**body, "model": f"{body['model']}-{slot}"},
                headers={"If-Match": f'"{generation}"'},
            )
        finally:
            own.close()

    threads = [threading.Thread(target=update, args=(slot,)) for slot in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def test_if_match_race_has_exactly_one_winner(app: FastAPI) -> None:
    ctx, _ = fleet_bodies()
    with TestClient(app) as client:
        assert client.put("/v1/instances/ctx", json=ctx).status_code == 201
        for round_ in range(6):
            generation = client.get("/v1/instances/ctx").json()["generation"]
            results = race(app, {**ctx, "model": f"m{round_}"}, generation)
            codes = sorted(r.status_code for r in results)
            assert codes == [200, 412], [r.text for r in results]
            loser = next(r for r in results if r.status_code == 412)
            assert loser.json()["code"] == "precondition_failed"
            winner = next(r for r in results if r.status_code == 200)
            stored = client.get("/v1/instances/ctx").json()
            assert stored["generation"] == generation + 1 == winner.json()["generation"]
            assert stored["model"] == winner.json()["model"]


def test_commands_wait_for_a_stream_that_is_not_open_yet(
    sqlite_url: str, start_server: Callable[..., Server]
) -> None:
    """A router may dispatch the moment workers attached (``POST /v1/workers``), before they
    opened their command streams: the commands wait for the streams, nothing is lost."""
    server = start_server(sqlite_url)
    with Client(server.url) as client:
        workers = setup_fleet(client)
        assert not any(w["connected"] for w in client.list_workers()["items"])
        transfer = client.create_transfer(transfer_body("early", execute=True))
        with FakeFleet(server.url, workers) as fleet:
            done = client.get_transfer(transfer["id"], wait_s=30)
            assert done["status"] == "done", done
            assert {len(worker.commands) for worker in fleet} == {1}
