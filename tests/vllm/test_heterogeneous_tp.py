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
