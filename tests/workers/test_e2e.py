"""End to end: a real control plane, real worker processes, real NIXL transfers on loopback.

Every generation byte is checked by its worker (``--fill-pattern``: written bytes must carry the
sending rank's pattern, all others must be untouched) and every route's crc32 must agree; the byte
count must equal what the planning core computes. Failures (a worker killed mid-job, a peer that
re-registers mid-transfer) must end in a retry or a clear failure: never a hang, never a "done"
without the bytes.
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
from api.geometry import compile_plan, expand, parse_instance
from api.geometry.builders import ViewSpec, instance_body

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
pytest.importorskip("nixl")
pytest.importorskip("torch")

VIEWS = [ViewSpec("target", 2, 4, 16), ViewSpec("draft", 1, 2, 16)]
LEASE_TTL_S = 3.0


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
            "KVPLANE_LEASE_TTL_S": str(LEASE_TTL_S),
        }
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.client = Client(self.url, retries=3, backoff_s=0.1)

    def spawn(self, name: str, *args: str, env: dict[str, str] | None = None) -> None:
        with (self.tmp_path / f"{name}.log").open("wb") as log:  # the child keeps its copy
            self.processes[name] = subprocess.Popen(
                [sys.executable, "-m", "api.cli", *args], stdout=log, stderr=subprocess.STDOUT,
                env={**self.env, **(env or {})}, start_new_session=True,
            )

    def start_server(self) -> None:
        self.spawn("server", "serve", "--port", str(self.port))
        self.wait(lambda: httpx.get(f"{self.url}/readyz").status_code == 200, "the server")

    def start_worker(self, instance: str, rank: int, tag: str = "",
                     env: dict[str, str] | None = None) -> str:
        name = f"worker-{instance}-{rank}{tag}"
        self.spawn(name, "worker", "--control-plane", self.url, "--instance", instance,
                   "--rank", str(rank), "--fill-pattern", "--staging-mib", "16", env=env)
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
        ctx = instance_body(role="context", views=VIEWS, tp=ctx_tp, tokens_per_block=8,
                            num_slots=32)
        gen = instance_body(role="generation", views=VIEWS, tp=gen_tp, tokens_per_block=8,
                            num_slots=32)
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
    body = {"context": "ctx", "generation": "gen", "request_id": request_id, "blocks": BLOCKS,
            "execute": True, "verify": True, **extra}
    created: dict[str, Any] = fleet.client.create_transfer(body)
    return created


@pytest.mark.parametrize("mode", ["staged", "fragments"])
def test_transfer_moves_exactly_the_planned_bytes_and_every_byte_verifies(
    fleet: Fleet, mode: str
) -> None:
    ctx, gen = fleet.register(ctx_tp=2, gen_tp=1)
    for instance, world in (("ctx", 2), ("gen", 1)):
        for rank in range(world):
            fleet.start_worker(instance, rank)
    fleet.wait(lambda: fleet.alive_workers() == 3, "three workers")
    created = _transfer(fleet, f"req-{mode}", mode=mode)
    done = fleet.client.get_transfer(created["id"], wait_s=60)
    assert done["status"] == "done", done["error"]
    assert done["bytes"] == _expected_bytes(ctx, gen)
    jobs = fleet.client.list_jobs(transfer_id=created["id"])
    assert {job["state"] for job in jobs} == {"done"}
    sent = sum(job["result"]["bytes"] for job in jobs if job["kind"] == "send")
    assert sent == done["bytes"]
    # Both modes have a receive job with verify: staged scatters, fragments only checks.
    (receive,) = [job for job in jobs if job["kind"] == "receive"]
    pool = gen["ranks"][0]["pools"][0]
    assert receive["result"]["verified_bytes"] == pool["num_slots"] * pool["slot_bytes"]
    assert sum(route["bytes"] for route in receive["result"]["routes"]) == done["bytes"]
    # The receiver moves the bytes in staged mode; in fragments mode it only checks them.
    assert receive["result"]["bytes"] == (done["bytes"] if mode == "staged" else 0)
    sent_sums = {(r["sender_rank"], r["receiver_rank"]): r["checksum"]
                 for job in jobs if job["kind"] == "send" for r in job["result"]["routes"]}
    received = {(r["sender_rank"], r["receiver_rank"]): r["checksum"]
                for r in receive["result"]["routes"]}
    assert received == sent_sums
    assert None not in received.values()


def test_fragments_without_verify_have_no_receive_job(fleet: Fleet) -> None:
    fleet.register(ctx_tp=2, gen_tp=1)
    for instance, world in (("ctx", 2), ("gen", 1)):
        for rank in range(world):
            fleet.start_worker(instance, rank)
    fleet.wait(lambda: fleet.alive_workers() == 3, "three workers")
    created = _transfer(fleet, "req-plain", mode="fragments", verify=False)
    done = fleet.client.get_transfer(created["id"], wait_s=60)
    assert done["status"] == "done", done["error"]
    jobs = fleet.client.list_jobs(transfer_id=created["id"])
    assert {job["kind"] for job in jobs} == {"send"}


def test_worker_killed_mid_job_is_retried_on_another_worker_of_its_rank(fleet: Fleet) -> None:
    fleet.register(ctx_tp=1, gen_tp=1)
    fleet.start_worker("gen", 0)
    # this sender freezes after claiming, like a process that died mid-transfer
    doomed = fleet.start_worker("ctx", 0, "-doomed",
                                env={"KVPLANE_WORKER_PAUSE_AFTER_CLAIM_S": "600"})
    fleet.wait(lambda: fleet.alive_workers() == 2, "two workers")
    created = _transfer(fleet, "req-kill")

    def leased_send() -> bool:
        jobs = fleet.client.list_jobs(transfer_id=created["id"])
        return any(j["kind"] == "send" and j["state"] == "leased" for j in jobs)

    fleet.wait(leased_send, "the doomed worker to claim the send job")
    fleet.start_worker("ctx", 0, "-standby")
    fleet.wait(lambda: fleet.alive_workers() == 3, "the standby worker")
    fleet.kill(doomed)
    assert fleet.client.get_transfer(created["id"])["status"] in ("queued", "running")
    done = fleet.client.get_transfer(created["id"], wait_s=60)
    assert done["status"] == "done", done["error"]
    assert done["attempt"] == 2
    jobs = fleet.client.list_jobs(transfer_id=created["id"])
    first = [j for j in jobs if j["attempt"] == 1]
    assert first and {j["state"] for j in first} == {"failed"}
    assert any("lease expired" in (j["error"] or "") for j in first)
    (receive,) = [j for j in jobs if j["kind"] == "receive" and j["state"] == "done"]
    assert receive["result"]["verified_bytes"] > 0


def test_peer_reregistering_mid_transfer_fails_it_with_peer_restarted(fleet: Fleet) -> None:
    ctx, gen = fleet.register(ctx_tp=1, gen_tp=1)
    fleet.start_worker("gen", 0)
    fleet.start_worker("ctx", 0, env={"KVPLANE_WORKER_PAUSE_AFTER_CLAIM_S": "3"})
    fleet.wait(lambda: fleet.alive_workers() == 2, "two workers")
    created = _transfer(fleet, "req-restart")
    fleet.wait(
        lambda: any(j["state"] == "leased"
                    for j in fleet.client.list_jobs(transfer_id=created["id"])),
        "a job to be leased",
    )
    gen["ranks"][0]["pools"][0]["num_slots"] = 16  # the restarted engine has another layout
    fleet.client.register_instance("gen", gen)
    final = fleet.client.get_transfer(created["id"], wait_s=30)
    assert final["status"] == "failed"
    assert final["error"].startswith("peer_restarted")
    # the paused sender wakes up, finds its lease gone, and reports nothing: still failed
    time.sleep(4)
    assert fleet.client.get_transfer(created["id"])["status"] == "failed"
    jobs = fleet.client.list_jobs(transfer_id=created["id"])
    assert all(j["state"] == "failed" and j["result"] is None for j in jobs)
