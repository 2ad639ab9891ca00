"""End to end: a real control plane, real worker processes, real NIXL transfers on loopback.

Every generation byte is checked by its worker (``--fill-pattern``: written bytes must carry the
sending rank's pattern, all others must be untouched) and every route's crc32 must agree; the byte
count must equal what the planning core computes. Failures (a sender or a receiver killed
mid-transfer, a peer that re-registers mid-transfer) must end in a clear failure on both sides
within the deadline, never a hang, never a "done" without the bytes, and the rank must work
again afterwards without restarting anything else.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.client import ApiError, Client
from geometry import compile_plan, expand, parse_instance
from geometry.builders import ViewSpec, instance_body

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
pytest.importorskip("nixl")
pytest.importorskip("torch")

VIEWS = [ViewSpec("target", 2, 4, 16), ViewSpec("draft", 1, 2, 16)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Fleet:
    """A control plane and worker processes; everything is stopped at teardown."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "KVPLANE_DATABASE_URL": f"sqlite:///{tmp_path / 'kvplane.db'}",
        }
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.client = Client(self.url, retries=3, backoff_s=0.1)

    def spawn(self, name: str, *args: str, env: dict[str, str] | None = None) -> None:
        with (self.tmp_path / f"{name}.log").open("wb") as log:  # the child keeps its copy
            self.processes[name] = subprocess.Popen(
                [sys.executable, "-m", "cli", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**self.env, **(env or {})},
                start_new_session=True,
            )

    def start_server(self) -> None:
        self.spawn("server", "serve", "--port", str(self.port))
        self.wait(lambda: httpx.get(f"{self.url}/readyz").status_code == 200, "the server")

    def start_worker(
        self,
        instance: str,
        rank: int,
        tag: str = "",
        env: dict[str, str] | None = None,
        staging_mib: int = 16,
    ) -> str:
        name = f"worker-{instance}-{rank}{tag}"
        self.spawn(
            name,
            "worker",
            "--control-plane",
            self.url,
            "--instance",
            instance,
            "--rank",
            str(rank),
            "--fill-pattern",
            "--staging-mib",
            str(staging_mib),
            env=env,
        )
        return name

    def wait(self, predicate: Any, what: str, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if predicate():
                    return
            except (ApiError, httpx.HTTPError):
                pass
            time.sleep(0.1)
        logs = "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}"
            for p in self.tmp_path.glob("*.log")
        )
        raise AssertionError(f"timed out waiting for {what}\n{logs}")

    def alive_workers(self) -> int:
        return sum(w["status"] == "alive" for w in self.client.list_workers()["items"])

    def register(self, ctx_tp: int = 2, gen_tp: int = 1) -> tuple[dict[str, Any], ...]:
        ctx = instance_body(
            role="context", views=VIEWS, tp=ctx_tp, tokens_per_block=8, num_slots=32
        )
        gen = instance_body(
            role="generation", views=VIEWS, tp=gen_tp, tokens_per_block=8, num_slots=32
        )
        self.client.register_instance("ctx", ctx)
        self.client.register_instance("gen", gen)
        pairing = self.client.create_pairing("ctx", "gen")
        assert pairing["compatible"], pairing["errors"]
        return ctx, gen

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        process = self.processes[name]
        os.killpg(process.pid, sig)
        process.wait(timeout=30)

    def stop(self) -> None:
        self.client.close()
        for process in reversed(list(self.processes.values())):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=5)


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    running = Fleet(tmp_path)
    try:
        running.start_server()
        yield running
    finally:
        running.stop()


BLOCKS = {"0": {"context": list(range(10)), "generation": [20 + i for i in range(8)]}}


def _expected_bytes(ctx: dict[str, Any], gen: dict[str, Any]) -> int:
    plan = compile_plan(parse_instance(ctx, "ctx"), parse_instance(gen, "gen"))
    return expand(plan, {0: (BLOCKS["0"]["context"], BLOCKS["0"]["generation"])}).bytes


def _transfer(fleet: Fleet, request_id: str, **extra: Any) -> dict[str, Any]:
    body = {
        "context": "ctx",
        "generation": "gen",
        "request_id": request_id,
        "blocks": BLOCKS,
        "execute": True,
        "verify": True,
        "timeout_s": 30,
        **extra,
    }
    created: dict[str, Any] = fleet.client.create_transfer(body)
    return created


def _start_all(fleet: Fleet, ctx_tp: int, gen_tp: int, **env: str) -> None:
    for instance, world in (("ctx", ctx_tp), ("gen", gen_tp)):
        for rank in range(world):
            fleet.start_worker(instance, rank, env=env or None)
    _serving(fleet, ctx_tp + gen_tp)


def _serving(fleet: Fleet, workers: int) -> None:
    """Wait until ``workers`` workers are alive and hold their command streams."""
    fleet.wait(
        lambda: (
            sum(
                w["status"] == "alive" and w["connected"]
                for w in fleet.client.list_workers()["items"]
            )
            == workers
        ),
        f"{workers} workers serving",
    )


@pytest.mark.parametrize("mode", ["staged", "fragments"])
def test_transfer_moves_exactly_the_planned_bytes_and_every_byte_verifies(
    fleet: Fleet, mode: str
) -> None:
    ctx, gen = fleet.register(ctx_tp=2, gen_tp=1)
    _start_all(fleet, 2, 1)
    created = _transfer(fleet, f"req-{mode}", mode=mode)
    done = fleet.client.get_transfer(created["id"], wait_s=60)
    assert done["status"] == "done", done["error"]
    assert done["bytes"] == _expected_bytes(ctx, gen)
    # The receiving rank compared each route's crc32 with its sender's before it said arrived
    # (its part carries both): the senders' parts decide nothing and come in their next batch
    # (about a second), with or without verify.
    fleet.wait(lambda: len(fleet.client.list_parts(created["id"])["items"]) == 3, "send parts")
    parts = fleet.client.list_parts(created["id"])["items"]
    assert {part["state"] for part in parts} == {"done"}
    assert sorted((p["kind"], p["rank"]) for p in parts) == [
        ("receive", 0),
        ("send", 0),
        ("send", 1),
    ]
    sent = sum(part["result"]["bytes"] for part in parts if part["kind"] == "send")
    assert sent == done["bytes"]
    (receive,) = [part for part in parts if part["kind"] == "receive"]
    pool = gen["ranks"][0]["pools"][0]
    # Every byte this transfer wrote, and every other byte of the slots it wrote (untouched
    # since the fill), was checked: the generation's 8 slots (the demo and the engine loop sweep
    # the rest of the pools with Worker.verify_untouched).
    slots = len(BLOCKS["0"]["generation"])
    assert receive["result"]["verified_bytes"] == slots * pool["slot_bytes"]
    assert sum(route["bytes"] for route in receive["result"]["routes"]) == done["bytes"]
    sent_sums = {
        (r["sender_rank"], r["receiver_rank"]): r["checksum"]
        for part in parts
        if part["kind"] == "send"
        for r in part["result"]["routes"]
    }
    received = {
        (r["sender_rank"], r["receiver_rank"]): r["checksum"] for r in receive["result"]["routes"]
    }
    told = {
        (r["sender_rank"], r["receiver_rank"]): r["sender_checksum"]
        for r in receive["result"]["routes"]
    }
    assert received == sent_sums == told
    assert None not in received.values()


def test_a_post_with_wait_answers_once_the_transfer_settled(fleet: Fleet) -> None:
    """``POST /v1/transfers?wait=`` (with execute) answers in one round trip once the transfer
    is done, a replay of it too; at the end of the wait it answers as the transfer is (still
    running: ``GET ?wait=`` goes on); without execute, at once."""
    ctx, gen = fleet.register(ctx_tp=2, gen_tp=1)
    body = {
        "context": "ctx",
        "generation": "gen",
        "request_id": "waited",
        "blocks": BLOCKS,
        "execute": True,
        "verify": True,
        "timeout_s": 30,
    }
    for rank in range(2):
        fleet.start_worker("ctx", rank)
    # The receiver holds its grants 2.5 s after each handle starts: a slow peer.
    fleet.start_worker("gen", 0, env={"KVPLANE_WORKER_HOLD_S": "2.5"})
    _serving(fleet, 3)
    started = time.monotonic()
    planned = fleet.client.create_transfer({**body, "execute": False}, wait_s=30)
    assert planned["status"] == "planned" and time.monotonic() - started < 10
    started = time.monotonic()
    slow = fleet.client.create_transfer({**body, "request_id": "slow"}, wait_s=0.5)
    assert slow["status"] in ("queued", "running")
    assert 0.4 <= time.monotonic() - started < 10
    assert fleet.client.get_transfer(slow["id"], wait_s=60)["status"] == "done"
    done = fleet.client.create_transfer(body, idempotency_key="waited-1", wait_s=60)
    assert done["status"] == "done", done["error"]
    assert done["bytes"] == _expected_bytes(ctx, gen)
    again = fleet.client.create_transfer(body, idempotency_key="waited-1", wait_s=60)
    assert again["id"] == done["id"] and again["status"] == "done"
    # the answer came when the transfer settled: every rank's part is in
    parts = fleet.client.list_parts(done["id"])["items"]
    assert {part["state"] for part in parts} == {"done"} and len(parts) == 3


def test_a_later_verified_transfer_judges_only_its_own_bytes(fleet: Fleet) -> None:
    """An unverified transfer into some slots, then a verified one into others: no false
    alarm about the first one's bytes (they were legitimately written)."""
    fleet.register(ctx_tp=2, gen_tp=1)
    _start_all(fleet, 2, 1)
    first = _transfer(
        fleet,
        "unverified",
        verify=False,
        blocks={"0": {"context": [0, 1, 2], "generation": [3, 4, 5]}},
    )
    assert fleet.client.get_transfer(first["id"], wait_s=60)["status"] == "done"
    second = _transfer(fleet, "verified")
    done = fleet.client.get_transfer(second["id"], wait_s=60)
    assert done["status"] == "done", done["error"]


@pytest.mark.parametrize("tls", ["", "tcp"])
def test_workers_report_the_transports_ucx_uses(tmp_path: Path, tls: str) -> None:
    """On one machine UCX's defaults move the bytes through shared memory, ``tcp`` through the
    network stack: GET /v1/workers says which, once the workers have talked to each other."""
    fleet = Fleet(tmp_path)
    fleet.env = {k: v for k, v in fleet.env.items() if not k.startswith("UCX_")}
    try:
        fleet.start_server()
        fleet.register(ctx_tp=1, gen_tp=1)
        _start_all(fleet, 1, 1, **({"UCX_TLS": tls} if tls else {}))
        done = fleet.client.get_transfer(_transfer(fleet, "ucx")["id"], wait_s=60)
        assert done["status"] == "done", done["error"]
        fleet.wait(
            lambda: all(w["ucx_in_use"] for w in fleet.client.list_workers()["items"]),
            "both workers' UCX reports",
        )
        for worker in fleet.client.list_workers()["items"]:
            in_use = worker["ucx_in_use"]
            assert in_use["peers"] == ["intra-node"]
            assert in_use["shared_memory"] is (tls != "tcp"), in_use
            if tls == "tcp":
                assert all(t.startswith("tcp/") for t in in_use["transports"]), in_use
            else:
                assert any(t.endswith("/memory") for t in in_use["lanes"]["am"]), in_use
    finally:
        fleet.stop()


def test_rest_transfers_without_verify_complete_back_to_back(fleet: Fleet) -> None:
    fleet.register(ctx_tp=2, gen_tp=1)
    _start_all(fleet, 2, 1)
    for i, mode in enumerate(["fragments", "staged"] * 5):
        created = _transfer(fleet, f"plain-{i}", mode=mode, verify=False)
        done = fleet.client.get_transfer(created["id"], wait_s=30)
        assert done["status"] == "done", done["error"]


def test_a_sender_killed_mid_transfer_fails_it_on_both_sides_and_the_rank_recovers(
    fleet: Fleet,
) -> None:
    fleet.register(ctx_tp=1, gen_tp=1)
    fleet.start_worker("gen", 0)
    # This sender holds every granted write for 600 s: a process frozen mid-transfer.
    doomed = fleet.start_worker("ctx", 0, "-doomed", env={"KVPLANE_WORKER_HOLD_S": "600"})
    _serving(fleet, 2)
    created = _transfer(fleet, "req-kill", timeout_s=4)
    doomed_id = next(
        w["id"] for w in fleet.client.list_workers()["items"] if w["instance"] == "ctx"
    )
    time.sleep(1.0)
    fleet.kill(doomed)
    done = fleet.client.get_transfer(created["id"], wait_s=30)
    assert done["status"] == "failed"
    assert any(why in done["error"] for why in ("did not write", "deadline", "peer_unreachable")), (
        done["error"]
    )
    # The receiver gave its staging back: a new sender on the same rank moves the next one.
    fleet.start_worker("ctx", 0, "-standby")

    def standby_serves() -> bool:
        ctx = [w for w in fleet.client.list_workers()["items"] if w["instance"] == "ctx"]
        return any(w["id"] != doomed_id and w["status"] == "alive" and w["connected"] for w in ctx)

    fleet.wait(standby_serves, "the standby worker", timeout_s=60)
    time.sleep(1.5)  # one heartbeat: the receiver's directory names the standby now
    again = _transfer(fleet, "req-after-kill")
    final = fleet.client.get_transfer(again["id"], wait_s=60)
    assert final["status"] == "done", final["error"]


def test_a_receiver_killed_mid_transfer_fails_the_sender_with_a_reason(fleet: Fleet) -> None:
    fleet.register(ctx_tp=1, gen_tp=1)
    fleet.start_worker("ctx", 0)
    doomed = fleet.start_worker("gen", 0, "-doomed", env={"KVPLANE_WORKER_HOLD_S": "600"})
    _serving(fleet, 2)
    created = _transfer(fleet, "req-kill-receiver", timeout_s=3)
    time.sleep(1.0)
    fleet.kill(doomed)
    done = fleet.client.get_transfer(created["id"], wait_s=30)
    assert done["status"] == "failed"
    # The sender's part is recorded with its reason (it never got a grant).
    fleet.wait(
        lambda: any(
            p["kind"] == "send" and p["state"] == "failed"
            for p in fleet.client.list_parts(created["id"])["items"]
        ),
        "the sender's failed part",
        timeout_s=15,
    )
    (send,) = [p for p in fleet.client.list_parts(created["id"])["items"] if p["kind"] == "send"]
    assert "no grant" in send["error"], send["error"]


def test_peer_reregistering_mid_transfer_fails_it_with_peer_restarted(fleet: Fleet) -> None:
    ctx, gen = fleet.register(ctx_tp=1, gen_tp=1)
    fleet.start_worker("gen", 0)
    fleet.start_worker("ctx", 0, env={"KVPLANE_WORKER_HOLD_S": "3"})
    _serving(fleet, 2)
    created = _transfer(fleet, "req-restart")
    time.sleep(0.5)
    gen["ranks"][0]["pools"][0]["num_slots"] = 16  # the restarted engine has another layout
    fleet.client.register_instance("gen", gen)
    final = fleet.client.get_transfer(created["id"], wait_s=30)
    assert final["status"] == "failed"
    assert final["error"].startswith("peer_restarted")
    # The held sender wakes up: its peer's epoch changed, so it must not write; still failed.
    time.sleep(4)
    assert fleet.client.get_transfer(created["id"])["status"] == "failed"
    fleet.wait(
        lambda: any(p["kind"] == "send" for p in fleet.client.list_parts(created["id"])["items"]),
        "the sender's part",
        timeout_s=15,
    )
    (send,) = [p for p in fleet.client.list_parts(created["id"])["items"] if p["kind"] == "send"]
    assert send["state"] == "failed" and "peer_restarted" in send["error"], send


@pytest.mark.parametrize("tpb", [(8, 8), (8, 2), (2, 8)])
def test_hybrid_state_rides_rest_execute_and_every_byte_verifies(fleet: Fleet, tpb) -> None:
    """A hybrid model (paged attention + per-request Mamba state), TP 2 → TP 1: the conv-state
    sections and SSM heads of both context ranks land in the generation's state slot. With a
    block-size ratio the attention blocks align by token position (``num_tokens``; the last block
    partial) and the state still moves as one slot pair."""
    from geometry.state_builders import HybridSpec, hybrid_body

    spec = HybridSpec(
        num_layers=4,
        attention_layers=(1,),
        kv_heads=4,
        head_dim=16,
        ssm_heads=8,
        ssm_head_dim=8,
        d_state=4,
        conv_channels=(64, 16, 16),
        d_conv=4,
    )
    bodies = {}
    for name, role, tp, t in (("ctx", "context", 2, tpb[0]), ("gen", "generation", 1, tpb[1])):
        bodies[name] = hybrid_body(
            role=role, spec=spec, tp=tp, tokens_per_block=t, num_slots=32, state_slots=4
        )
        fleet.client.register_instance(name, bodies[name])
    assert fleet.client.create_pairing("ctx", "gen")["compatible"]
    _start_all(fleet, 2, 1)
    blocks = {"0": BLOCKS["0"], "1": {"context": [3], "generation": [1]}}
    # the prompt ends one token into the last block of the side whose list reaches furthest
    num_tokens = max(9 * tpb[0], 7 * tpb[1]) + 1
    plan = compile_plan(parse_instance(bodies["ctx"], "ctx"), parse_instance(bodies["gen"], "gen"))
    want = expand(plan, {0: (blocks["0"]["context"], blocks["0"]["generation"]), 1: ([3], [1])},
                  num_tokens)  # fmt: skip
    for mode in ("staged", "fragments"):
        created = _transfer(fleet, f"hybrid-{mode}", mode=mode, blocks=blocks,
                            num_tokens=num_tokens)  # fmt: skip
        done = fleet.client.get_transfer(created["id"], wait_s=60)
        assert done["status"] == "done", done["error"]
        assert done["bytes"] == want.bytes
    with pytest.raises(ApiError) as refused:
        _transfer(
            fleet,
            "hybrid-bad",
            num_tokens=num_tokens,
            blocks={**blocks, "1": {"context": [0, 1], "generation": [1]}},
        )
    assert refused.value.status == 422


def test_helix_per_cp_rank_block_tables_ride_rest_execute(fleet: Fleet) -> None:
    """Helix (context cp 1 → generation cp 2): the generation gives one block table per CP rank;
    each CP rank's worker receives the logical blocks ``j % 2 == cp_rank`` and verifies them."""
    views = [ViewSpec("target", 2, 2, 16)]
    ctx = instance_body(role="context", views=views, tp=1, tokens_per_block=8, num_slots=32)
    gen = instance_body(
        role="generation", views=views, tp=1, cp=2, tokens_per_block=8, num_slots=32
    )
    fleet.client.register_instance("ctx", ctx)
    fleet.client.register_instance("gen", gen)
    assert fleet.client.create_pairing("ctx", "gen")["compatible"]
    _start_all(fleet, 1, 2)
    # 7 logical blocks; the generation reuses a prefix: CP rank 0 holds 0, 2, 4, 6 (its last 3
    # here), CP rank 1 holds 1, 3, 5 (its last 2).
    blocks = {"0": {"context": [10, 11, 12, 13, 14, 15, 16], "generation": [[7, 8, 9], [5, 6]]}}
    plan = compile_plan(parse_instance(ctx, "ctx"), parse_instance(gen, "gen"))
    want = expand(plan, {0: (blocks["0"]["context"], blocks["0"]["generation"])})
    assert want.bytes > 0
    created = _transfer(fleet, "helix", blocks=blocks)
    done = fleet.client.get_transfer(created["id"], wait_s=60)
    assert done["status"] == "done", done["error"]
    assert done["bytes"] == want.bytes
    parts = fleet.client.list_parts(created["id"])["items"]
    received = {
        p["rank"]: sum(r["bytes"] for r in p["result"]["routes"])
        for p in parts
        if p["kind"] == "receive"
    }
    assert sorted(received) == [0, 1] and sum(received.values()) == want.bytes
