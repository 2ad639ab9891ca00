"""The 20-token prompt with 16-token context blocks and 4-token generation blocks, moved by real
worker processes over NIXL on loopback, through REST ``execute`` and through the engine API.

Context ``[5, 6]`` (C0 = tokens 0-15, C1 = tokens 16-19 of 16), generation ``[10 … 14]`` (G0-G4):
every token lands in its generation block and nothing past token 19 is written. The receiving
worker runs in fill mode and verifies its receive: written bytes carry the sender's pattern
where the plan (aligned by token position) says, every other byte of its pools is untouched.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from api.client import ApiError
from geometry import compile_plan, expand, parse_instance
from geometry.builders import ViewSpec, instance_body

from .test_e2e import Fleet, _serving

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
pytest.importorskip("nixl")
pytest.importorskip("torch")

VIEWS = [ViewSpec("target", 2, 4, 16)]


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    running = Fleet(tmp_path)
    try:
        running.start_server()
        yield running
    finally:
        running.stop()


CONTEXT, GENERATION, TOKENS = [5, 6], [10, 11, 12, 13, 14], 20
# 20 tokens × 4 heads × 16 dims × 2 bytes × K/V × 2 layers
PROMPT_BYTES = TOKENS * 4 * 16 * 2 * 2 * 2


def _register(fleet: Fleet) -> tuple[dict[str, Any], dict[str, Any]]:
    ctx = instance_body(role="context", views=VIEWS, tp=1, tokens_per_block=16, num_slots=16)
    gen = instance_body(role="generation", views=VIEWS, tp=1, tokens_per_block=4, num_slots=32)
    fleet.client.register_instance("ctx", ctx)
    fleet.client.register_instance("gen", gen)
    assert fleet.client.create_pairing("ctx", "gen")["compatible"]
    plan = compile_plan(parse_instance(ctx, "ctx"), parse_instance(gen, "gen"))
    assert expand(plan, {0: (CONTEXT, GENERATION)}, TOKENS).bytes == PROMPT_BYTES
    return ctx, gen


def test_rest_execute_moves_the_20_token_16_to_4_case_exactly(fleet: Fleet) -> None:
    _register(fleet)
    fleet.start_worker("ctx", 0)
    fleet.start_worker("gen", 0)
    _serving(fleet, 2)
    blocks = {"0": {"context": CONTEXT, "generation": GENERATION}}
    for mode in ("staged", "fragments"):
        created = fleet.client.create_transfer({
            "context": "ctx", "generation": "gen", "request_id": f"r20-{mode}", "blocks": blocks,
            "num_tokens": TOKENS, "execute": True, "verify": True, "timeout_s": 30, "mode": mode,
        })  # fmt: skip
        assert created["num_tokens"] == TOKENS
        done = fleet.client.get_transfer(created["id"], wait_s=60)
        assert done["status"] == "done", done["error"]
        assert done["bytes"] == PROMPT_BYTES
        parts = fleet.client.list_parts(created["id"])["items"]
        (receive,) = [p for p in parts if p["kind"] == "receive"]
        assert receive["result"]["verified_bytes"] > 0
        fragments = fleet.client.get_fragments(created["id"])
        moved = sum(f[4] for route in fragments["routes"] for f in route["fragments"])
        assert moved == PROMPT_BYTES
    with pytest.raises(ApiError) as refused:
        fleet.client.create_transfer(
            {"context": "ctx", "generation": "gen", "request_id": "no-tokens", "blocks": blocks}
        )
    assert (refused.value.status, refused.value.code) == (422, "ambiguous_alignment")


RANK = r"""
import json, sys, time
from api.client import Client
from workers.agent import Worker

url, instance, peer, role, mode = sys.argv[1:6]
blocks = json.loads(sys.argv[6])
client = Client(url, retries=3, backoff_s=0.1)
worker = Worker(client, instance, 0, fill=True, staging_bytes=16 << 20)
worker.attach()
worker.start()
deadline = time.monotonic() + 60
while time.monotonic() < deadline:  # both ranks attached: the directory names the peer
    worker.refresh_directory()
    if worker.directory.peer(peer, 0) is not None:
        break
    time.sleep(0.2)
call = worker.send if role == "context" else worker.expect
handle = call("engine-r20-" + mode, peer, blocks, num_tokens=20, mode=mode, verify=True,
              timeout_s=30)
state = handle.wait(60)
print(json.dumps({"state": state, "reason": handle.reason, "bytes": handle.bytes,
                  "verified": handle.verified_bytes}), flush=True)
worker.stop()
"""


@pytest.mark.parametrize("mode", ["staged", "fragments"])
def test_engine_api_moves_the_20_token_16_to_4_case_exactly(fleet: Fleet, mode: str) -> None:
    _register(fleet)
    blocks = json.dumps({"0": {"context": CONTEXT, "generation": GENERATION}})
    ranks = {
        role: subprocess.Popen(
            [sys.executable, "-c", RANK, fleet.url, instance, peer, role, mode, blocks],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=fleet.env,
        )  # fmt: skip
        for role, instance, peer in (("context", "ctx", "gen"), ("generation", "gen", "ctx"))
    }
    results = {}
    for role, process in ranks.items():
        out, _ = process.communicate(timeout=180)
        lines = [line for line in out.decode(errors="replace").splitlines() if line.startswith("{")]
        assert lines, out.decode(errors="replace")[-3000:]
        results[role] = json.loads(lines[-1])
    assert results["context"]["state"] == "released", results
    assert results["generation"]["state"] == "arrived", results
    assert results["context"]["bytes"] == results["generation"]["bytes"] == PROMPT_BYTES
    assert results["generation"]["verified"], results


def test_a_route_larger_than_staging_goes_pool_to_pool(fleet: Fleet) -> None:
    """A long prompt's head-sliced NHD route (small fragments: ``auto`` stages them) larger
    than a worker's whole staging buffer moves pool to pool instead of failing with
    ``staging_too_small``, whichever side's buffer is the small one; ``mode=staged`` still
    refuses it, naming the staging it needs."""
    views = [ViewSpec("target", 2, 4, 16, "NHD")]
    ctx = instance_body(role="context", views=views, tp=2, tokens_per_block=16, num_slots=400)
    gen = instance_body(role="generation", views=views, tp=1, tokens_per_block=16, num_slots=400)
    fleet.client.register_instance("ctx", ctx)
    fleet.client.register_instance("gen", gen)
    assert fleet.client.create_pairing("ctx", "gen")["compatible"]
    blocks = 300  # 4,800 tokens: 300 blocks x 2 layers x K/V x 16 tokens x 2 heads x 32 B
    route_bytes = blocks * 2 * 2 * 16 * 2 * 16 * 2  # 1.2 MiB per route, staging 1 MiB
    fleet.start_worker("ctx", 0, staging_mib=1)
    fleet.start_worker("ctx", 1, staging_mib=16)
    fleet.start_worker("gen", 0, staging_mib=1)
    _serving(fleet, 3)
    lists = {"0": {"context": list(range(blocks)), "generation": list(range(50, 50 + blocks))}}
    body = {"context": "ctx", "generation": "gen", "blocks": lists, "execute": True}
    created = fleet.client.create_transfer({**body, "request_id": "long", "verify": True})
    done = fleet.client.get_transfer(created["id"], wait_s=60)
    assert done["status"] == "done", done["error"]
    assert done["bytes"] == 2 * route_bytes
    parts = fleet.client.list_parts(created["id"])["items"]
    (receive,) = [p for p in parts if p["kind"] == "receive"]
    assert receive["result"]["verified_bytes"] == 2 * route_bytes
    refused = fleet.client.create_transfer({**body, "request_id": "staged", "mode": "staged"})
    failed = fleet.client.get_transfer(refused["id"], wait_s=60)
    assert failed["status"] == "failed" and "staging bytes" in str(failed["error"]), failed
