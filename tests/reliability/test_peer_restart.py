"""A peer restarting, over HTTP with auth on.

- The context instance re-registers (new epoch) while a transfer is dispatched: its pairing goes
  stale, the running transfer fails with ``peer_restarted`` (its ``?wait=`` waiter wakes with
  it), and the parts its workers record afterwards change nothing. The old worker is fenced: its
  heartbeat, directory and command stream answer 409 ``worker_stale`` (for good: attaching again
  gives a new worker id). Once it attached again and the pairing is validated again, the peer's
  directory names the new epoch and the new endpoint, and a transfer runs.
- A worker process that restarts (same epoch, new NIXL agent): the peer's handover drops the old
  agent when its refreshed directory arrives, and fails the receive it had granted to it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from api.auth import create_token
from api.client import Client, ConflictError
from api.db import Database

from .conftest import FakeWorker, Server, fleet_bodies, transfer_body, wait_until, worker_body


def token(db_url: str, scope: str, instance: str | None = None) -> str:
    db = Database(db_url)
    try:
        with db.write() as session:
            return create_token(session=session, scope=scope, instance=instance)[1]
    finally:
        db.dispose()


@pytest.fixture
def tokens(sqlite_url: str) -> dict[str, str]:
    """Instance tokens of ctx and gen, an operator's, and worker tokens bound to ctx and gen."""
    return {
        name: token(sqlite_url, scope, instance)
        for name, scope, instance in (
            ("ctx", "instance", "ctx"),
            ("gen", "instance", "gen"),
            ("op", "operator", None),
            ("ctx-worker", "worker", "ctx"),
            ("gen-worker", "worker", "gen"),
        )
    }


def test_reregistration_fails_running_transfers_and_fences_the_old_worker(
    sqlite_url: str, start_server: Callable[..., Server], tokens: dict[str, str]
) -> None:
    server = start_server(sqlite_url, auth="true")
    ctx, gen = fleet_bodies(ctx_tp=1, gen_tp=1)
    c = {name: Client(server.url, token=secret, retries=2) for name, secret in tokens.items()}
    workers: list[FakeWorker] = []
    try:
        c["ctx"].register_instance("ctx", ctx)
        c["gen"].register_instance("gen", gen)
        pairing = c["op"].create_pairing("ctx", "gen")
        sender = c["ctx-worker"].register_worker(worker_body("ctx", ctx["ranks"][0], "ctx.a"))
        receiver = c["gen-worker"].register_worker(worker_body("gen", gen["ranks"][0], "gen.a"))
        for worker, secret in ((sender, tokens["ctx-worker"]), (receiver, tokens["gen-worker"])):
            workers.append(FakeWorker(server.url, worker["id"], token=secret, hold=True))
            workers[-1].wait_streams()
        old_sender, fake_receiver = workers
        revision = c["gen-worker"].heartbeat(receiver["id"])["directory_revision"]

        transfer = c["op"].create_transfer(transfer_body("r1", execute=True))
        for worker in workers:
            worker.wait_commands(1)
        assert c["op"].get_transfer(transfer["id"])["status"] == "running"
        waited: dict[str, Any] = {}
        waiter = threading.Thread(
            target=lambda: waited.update(c["op"].get_transfer(transfer["id"], wait_s=30))
        )
        waiter.start()

        # The context engine restarts with another layout: new epoch.
        restarted = {**ctx, "ranks": [{**ctx["ranks"][0]}]}
        restarted["ranks"][0]["pools"] = [{**ctx["ranks"][0]["pools"][0], "num_slots": 32}]
        c["ctx"].register_instance("ctx", restarted)

        waiter.join(40)
        assert waited["status"] == "failed", waited
        assert waited["error"].startswith("peer_restarted"), waited["error"]
        assert c["op"].get_pairing(pairing["id"])["status"] == "stale"

        # The old sender is fenced: heartbeat, directory and command stream all refuse.
        for call in (
            lambda: c["ctx-worker"].heartbeat(sender["id"]),
            lambda: c["ctx-worker"].get_directory(sender["id"]),
            lambda: next(iter(c["ctx-worker"].stream_commands(sender["id"]))),
        ):
            with pytest.raises(ConflictError) as caught:
                call()
            assert caught.value.code == "worker_stale"
        # What both workers record about the dead attempt is kept, and changes nothing.
        assert old_sender.release() == 1 and fake_receiver.release() == 1
        wait_until(
            lambda: len(c["op"].list_parts(transfer["id"])["items"]) == 2,
            "the late parts to be recorded",
        )
        final = c["op"].get_transfer(transfer["id"])
        assert (final["status"], final["error"]) == (waited["status"], waited["error"])

        # Attaching again (a new worker id) and validating the pairing again: back in service.
        again = c["ctx-worker"].register_worker(worker_body("ctx", restarted["ranks"][0], "ctx.b"))
        assert again["epoch"] != sender["epoch"]
        workers.append(FakeWorker(server.url, again["id"], token=tokens["ctx-worker"]))
        workers[-1].wait_streams()
        assert c["op"].validate_pairing(pairing["id"])["status"] == "compatible"
        beat = c["gen-worker"].heartbeat(receiver["id"])
        assert beat["directory_revision"] != revision  # the receiver refetches its directory
        directory = c["gen-worker"].get_directory(receiver["id"])
        assert directory["peers"]["ctx"]["epoch"] == again["epoch"]
        assert {w["worker_id"] for w in directory["peers"]["ctx"]["ranks"].values()} == {
            again["id"]
        }
        assert directory["pairings"][0]["context_epoch"] == again["epoch"]

        fresh = c["op"].create_transfer(transfer_body("r2", execute=True))
        done = c["op"].get_transfer(fresh["id"], wait_s=30)
        assert done["status"] == "done", done
        assert [len(w.commands) for w in workers] == [1, 2, 1]  # nothing more for the old one
        # Still fenced after the new attach: the old id never comes back.
        with pytest.raises(ConflictError):
            c["ctx-worker"].heartbeat(sender["id"])
    finally:
        for worker in workers:
            worker.close()
        for client in c.values():
            client.close()


class FakeTransport:
    """The slice of ``NixlTransport`` a handover uses, remembering which agents it loaded."""

    def __init__(self, pools: dict[int, Any], staging: Any) -> None:
        self.pools, self.staging = pools, staging
        self.peers: set[str] = set()
        self.infos: dict[str, Any] = {}
        self.log: list[tuple[str, str]] = []

    def add_peer(self, info: Any) -> str:
        self.peers.add(str(info["agent"]))
        self.log.append(("add", str(info["agent"])))
        self.infos[str(info["agent"])] = info
        return str(info["agent"])

    def peer_info_of(self, agent: str) -> Any:
        from types import SimpleNamespace

        from workers.transport import TransportError

        if agent not in self.peers:
            raise TransportError(f"unknown peer {agent!r}")
        staging = self.infos[agent].get("staging") or {}
        return SimpleNamespace(staging_bytes=int(staging.get("bytes", 1 << 20)))

    def remove_peer(self, agent: str) -> None:
        self.peers.discard(agent)
        self.log.append(("remove", agent))

    def send_notif(self, agent: str, msg: bytes) -> None:
        self.log.append(("notif", f"{agent}:{msg.split(b'|')[0].decode()}"))

    def drain_notifications(self) -> dict[str, list[bytes]]:
        return {}

    def release(self, pending: Any) -> None:
        pass

    def poll(self, pending: Any) -> str:
        return "DONE"


def test_worker_drops_a_restarted_peers_agent(
    sqlite_url: str, start_server: Callable[..., Server]
) -> None:
    pytest.importorskip("torch")
    import torch

    from workers.directory import Directory
    from workers.handover import FAILED, Handover
    from workers.pools import PoolSpec, allocate_pools

    server = start_server(sqlite_url)
    ctx, gen = fleet_bodies(ctx_tp=1, gen_tp=1)
    with Client(server.url) as client:
        client.register_instance("ctx", ctx)
        client.register_instance("gen", gen)
        assert client.create_pairing("ctx", "gen")["compatible"]
        client.register_worker(worker_body("ctx", ctx["ranks"][0], "ctx.r0.aaaa"))
        receiver = client.register_worker(worker_body("gen", gen["ranks"][0], "gen.r0"))
        before = client.get_directory(receiver["id"])

        pools = allocate_pools([PoolSpec.from_dict(p) for p in gen["ranks"][0]["pools"]], "cpu")
        transport = FakeTransport(pools, torch.empty(1 << 20, dtype=torch.uint8))
        handover = Handover(
            transport,  # type: ignore[arg-type]
            instance="gen",
            rank=0,
            directory=Directory.from_json(before),
        )
        try:
            handle = handover.expect("r1", "ctx", {0: ([0, 1], [2, 3])}, timeout_s=60)
            wait_until(
                lambda: ("notif", "ctx.r0.aaaa:G") in transport.log,
                "the grant to the sender's agent",
            )
            assert transport.peers == {"ctx.r0.aaaa"}

            # The sender's worker process restarts: same epoch, a new NIXL agent.
            client.register_worker(worker_body("ctx", ctx["ranks"][0], "ctx.r0.bbbb"))
            beat = client.heartbeat(receiver["id"])
            assert beat["directory_revision"] != before["revision"]
            handover.set_directory(Directory.from_json(client.get_directory(receiver["id"])))

            assert handle.wait(30) == FAILED
            assert handle.reason is not None and handle.reason.startswith("peer_restarted"), (
                handle.reason
            )
            assert ("remove", "ctx.r0.aaaa") in transport.log
            assert "ctx.r0.aaaa" not in transport.peers
            # The next request goes to the new agent.
            again = handover.expect("r2", "ctx", {0: ([0, 1], [4, 5])}, timeout_s=60)
            wait_until(
                lambda: ("notif", "ctx.r0.bbbb:G") in transport.log,
                "the grant to the restarted agent",
            )
            assert transport.peers == {"ctx.r0.bbbb"} and not again.done
        finally:
            handover.close()
