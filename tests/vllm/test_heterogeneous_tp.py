"""Prefill TP 2 → decode TP 1 between two real vLLM engines, through kvplane.

The prefill engine's two ranks (one core each) register one instance of two ranks, each with
half of the KV heads; the decode engine's single rank holds all four. The control plane's plan
sends each prefill rank's heads into its place in the decode rank's blocks. The engines run in
float32: in bfloat16, TP 2 and TP 1 sum in different orders and disagree on some greedy
continuations even without a handover (measured), so the oracle would not be about KV.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from workers.testing.engine import ControlPlane
from workers.testing.vllm_bed import Engine, handover, prompts, write_model

from .conftest import require_vllm

# Two cores hold three engine processes here (the prefill's two ranks and the decode). Each
# engine steps without pause while KV is held or on its way; the connector's ranks wait for
# their handles in those steps instead, or the busy ranks starve the workers' threads and the
# decode's loads time out.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tp_bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    require_vllm()
    workdir = tmp_path_factory.mktemp("vllm-tp")
    model = write_model(workdir)
    plane = ControlPlane(workdir)
    plane.start()
    engines: list[Engine] = []
    try:
        prefill = Engine(
            workdir,
            model,
            "prefill",
            "0|1",
            instance="vllm-prefill",
            control_plane=plane.url,
            tp=2,
            dtype="float32",
        )
        engines.append(prefill)
        assert prefill.read() == {"ready": True}
        decode = Engine(
            workdir,
            model,
            "decode",
            "1",
            instance="vllm-decode",
            control_plane=plane.url,
            dtype="float32",
        )
        engines.append(decode)
        assert decode.read() == {"ready": True}
        yield {"plane": plane, "prefill": prefill, "decode": decode}
    finally:
        for engine in engines:
            engine.stop()
        plane.stop()


def test_prefill_tp2_to_decode_tp1_equals_one_engine(tp_bed: dict[str, Any]) -> None:
    url = tp_bed["plane"].url
    prefill = httpx.get(f"{url}/v1/instances/vllm-prefill", timeout=10).json()
    assert prefill["tp"] == 2 and prefill["kv_heads_per_rank"] == 2, prefill
    batch = prompts(21, (40, 100, 170))
    alone = tp_bed["decode"].generate(batch, 12)["tokens"]  # the decode engine by itself
    assert handover(tp_bed["prefill"], tp_bed["decode"], batch, batch, 12) == alone
    # Each request moved from both prefill ranks into the decode's one rank.
    plan = httpx.get(f"{url}/v1/pairings", timeout=10).json()["items"][0]
    assert plan["status"] == "compatible", plan
    listed = httpx.get(f"{url}/v1/transfers", params={"limit": 100}, timeout=10).json()["items"]
    for transfer in listed:
        assert {(r["sender_rank"], r["receiver_rank"]) for r in transfer["routes"]} == {
            (0, 0),
            (1, 0),
        }, transfer
    assert tp_bed["prefill"].call(op="idle", timeout_s=30) == {"idle": True}
    assert tp_bed["decode"].call(op="idle", timeout_s=10) == {"idle": True}


def test_a_prefill_rank_no_route_uses_frees_its_blocks_at_once(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A one-layer model with one KV head on a prefill TP 2: both ranks hold the head, and
    the plan elects one of them to write (a layer is the unit of election), so the other is
    never asked. It reports each request sent as soon as it holds it, and vLLM frees the blocks
    then, not after ``hold_s`` (60 s): a decode's release notices go only to the ranks that
    write to it."""
    require_vllm()
    workdir = tmp_path_factory.mktemp("vllm-routeless")
    model = write_model(workdir, layers=1, kv_heads=1)
    plane = ControlPlane(workdir)
    plane.start()
    engines: list[Engine] = []
    try:
        for role, core, tp in (("prefill", "0|1", 2), ("decode", "1", 1)):
            engine = Engine(
                workdir,
                model,
                role,
                core,
                instance=f"vllm-{role}",
                control_plane=plane.url,
                tp=tp,
                dtype="float32",
            )
            engines.append(engine)
            assert engine.read() == {"ready": True}
        prefill, decode = engines
        batch = prompts(22, (60, 100))
        alone = decode.generate(batch, 8)["tokens"]
        assert handover(prefill, decode, batch, batch, 8) == alone
        routes = {
            (r["sender_rank"], r["receiver_rank"])
            for t in httpx.get(f"{plane.url}/v1/transfers", timeout=10).json()["items"]
            for r in t["routes"]
        }
        assert len(routes) == 1, routes  # one of the two prefill ranks writes
        # Well before hold_s: both ranks reported the requests sent, so every block is free.
        assert prefill.call(op="idle", timeout_s=5) == {"idle": True}
    finally:
        for engine in engines:
            engine.stop()
        plane.stop()
