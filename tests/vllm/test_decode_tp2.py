"""Decode TP 2 between real vLLM engines, through kvplane: prefill TP 1 → decode TP 2 (each
decode rank takes two of the prefill rank's four KV heads) and prefill TP 2 → decode TP 2 (rank
to rank). Float32, as in ``test_heterogeneous_tp.py``: in bfloat16 TP 2 and TP 1 disagree on
some greedy tokens without any handover. The oracle is the decode engine by itself, over 8
greedy tokens: a TP 1 and a TP 2 engine still sum in different orders in float32, and over
longer continuations a near-tie flipped one token in one run of several (measured).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from workers.testing.vllm_bed import engine_bed, handover, prompts, recorded, write_model

from .conftest import require_vllm

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    require_vllm()
    workdir = tmp_path_factory.mktemp("vllm-decode-tp2")
    model = write_model(workdir)
    engines = [
        ("decode", "vllm-decode-tp2", "0|1", {"tp": 2, "dtype": "float32"}),
        ("prefill", "vllm-prefill-tp1", "0", {"tp": 1, "dtype": "float32"}),
        ("prefill", "vllm-prefill-tp2", "1|0", {"tp": 2, "dtype": "float32"}),
    ]
    with engine_bed(workdir, model, engines) as (plane, started):
        # Paired before the first request, and every rank's directory refreshed (one heartbeat):
        # this module is about head slices across TP layouts; first contact has its own test
        # (test_hostile.py). In two full-suite runs of several, a prefill TP 1 rank learned of
        # a pairing made by the first request only after the decode's 30 s receive deadline.
        for prefill in ("vllm-prefill-tp1", "vllm-prefill-tp2"):
            pairing = {"context": prefill, "generation": "vllm-decode-tp2"}
            answer = httpx.post(f"{plane.url}/v1/pairings", json=pairing, timeout=30)
            assert answer.status_code == 201 and answer.json()["compatible"], answer.text
        time.sleep(3)
        yield {
            "plane": plane,
            "decode": started["vllm-decode-tp2"],
            "prefill-tp1": started["vllm-prefill-tp1"],
            "prefill-tp2": started["vllm-prefill-tp2"],
        }


@pytest.mark.parametrize(
    ("prefill", "routes"),
    [
        ("prefill-tp1", {(0, 0), (0, 1)}),  # one prefill rank writes both decode ranks
        ("prefill-tp2", {(0, 0), (1, 1)}),  # rank to rank
    ],
)
def test_decode_tp2_equals_one_engine(bed: dict[str, Any], prefill: str, routes: set) -> None:
    url = bed["plane"].url
    name = f"vllm-{prefill}"
    batch = prompts(41 + len(prefill), (40, 130))
    alone = bed["decode"].generate(batch, 8)["tokens"]
    assert handover(bed[prefill], bed["decode"], batch, batch, 8, context=name) == alone
    mine = recorded(url, len(batch), context=name)
    assert len(mine) == len(batch), mine
    for transfer in mine:
        assert {(r["sender_rank"], r["receiver_rank"]) for r in transfer["routes"]} == routes
    assert bed[prefill].call(op="idle", timeout_s=30) == {"idle": True}
    assert bed["decode"].call(op="idle", timeout_s=10) == {"idle": True}
