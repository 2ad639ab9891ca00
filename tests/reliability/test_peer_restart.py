"""A peer restarting (re-registering with a new epoch) over HTTP, with auth on: its pairings go
stale, queued and leased jobs fail with ``peer_restarted``, a stale lease is fenced (409), and a
worker drops the cached NIXL agent of a restarted peer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from api.auth import create_token
from api.client import Client, ConflictError, LeaseLostError
from api.db import Database

from .conftest import Server, fleet_bodies, transfer_body, worker_body


def token(db_url: str, scope: str, instance: str | None = None) -> str:
    db = Database(db_url)
    try:
        with db.write() as session:
            return create_token(session=session, scope=scope, instance=instance)[1]
    finally:
        db.dispose()


def test_reregistration_fails_active_jobs_over_http(
    sqlite_url: str, start_server: Callable[..., Server]
) -> None:
    server = start_server(sqlite_url, auth="true")
    ctx, gen = fleet_bodies(ctx_tp=1, gen_tp=1)
    clients = {
        name: Client(server.url, token=token(sqlite_url, scope, instance), retries=2)
        for name, scope, instance in (
            ("ctx", "instance", "ctx"),
            ("gen", "instance", "gen"),
            ("op", "operator", None),
            ("ctx-worker", "worker", "ctx"),
            ("gen-worker", "worker", "gen"),
        )
    }
    try:
        clients["ctx"].register_instance("ctx", ctx)
        clients["gen"].register_instance("gen", gen)
        pairing = clients["op"].create_pairing("ctx", "gen")
        sender = clients["ctx-worker"].register_worker(worker_body("ctx", ctx["ranks"][0], "c"))
        clients["gen-worker"].register_worker(worker_body("gen", gen["ranks"][0], "g"))
        leased_transfer = clients["op"].create_transfer(transfer_body("r1", execute=True))
        lease = clients["ctx-worker"].claim_job(sender["id"])
        assert lease is not None and lease["transfer_id"] == leased_transfer["id"]
        queued_transfer = clients["op"].create_transfer(transfer_body("r2", execute=True))

        # The context engine restarts with another layout: new epoch.
        restarted = {**ctx, "ranks": [{**ctx["ranks"][0]}]}
        restarted["ranks"][0]["pools"] = [{**ctx["ranks"][0]["pools"][0], "num_slots": 32}]
        clients["ctx"].register_instance("ctx", restarted)

        assert clients["op"].get_pairing(pairing["id"])["status"] == "stale"
        for transfer in (leased_transfer, queued_transfer):
            read = clients["op"].get_transfer(transfer["id"])
            assert read["status"] == "failed"
            assert read["error"].startswith("peer_restarted"), read["error"]
        jobs: list[dict[str, Any]] = clients["op"].list_jobs(limit=100)
        assert {job["state"] for job in jobs} == {"failed"}
        with pytest.raises(LeaseLostError):
            clients["ctx-worker"].complete_job(
                lease["id"], {"lease_token": lease["lease_token"], "bytes": 1, "duration_s": 0.0}
            )
        # The old worker must attach again before it may claim.
        with pytest.raises(ConflictError):
            clients["ctx-worker"].claim_job(sender["id"])
    finally:
        for client in clients.values():
            client.close()


class FakeTransport:
    def __init__(self) -> None:
        self.peers: set[str] = set()
        self.log: list[tuple[str, str]] = []

    def add_peer(self, peer: Any) -> None:
        self.peers.add(str(peer["agent"]))
        self.log.append(("add", str(peer["agent"])))

    def remove_peer(self, agent: str) -> None:
        self.peers.discard(agent)
        self.log.append(("remove", agent))


def test_worker_drops_a_restarted_peers_agent() -> None:
    pytest.importorskip("torch")
    from workers.agent import Worker

    worker = object.__new__(Worker)
    worker.transport = FakeTransport()  # type: ignore[assignment]
    worker._peer_of_rank = {}
    assert worker._peer({"agent": "gen.r0.aaaa"}, "generation", 0) == "gen.r0.aaaa"
    assert worker._peer({"agent": "gen.r0.aaaa"}, "generation", 0) == "gen.r0.aaaa"  # cached
    assert worker._peer({"agent": "gen.r0.bbbb"}, "generation", 0) == "gen.r0.bbbb"  # restarted
    assert worker.transport.log == [  # type: ignore[attr-defined]
        ("add", "gen.r0.aaaa"),
        ("remove", "gen.r0.aaaa"),
        ("add", "gen.r0.bbbb"),
    ]
    assert worker.transport.peers == {"gen.r0.bbbb"}  # type: ignore[attr-defined]
