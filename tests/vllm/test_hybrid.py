"""A model that mixes sliding-window and full-attention layers, between two real vLLM engines.

The tier's Llama with layers 1 and 3 on a 64-token sliding window (``tiny_model.py --sliding``):
vLLM's hybrid KV cache manager (which the connector opts into with ``SupportsHMA``) keeps two KV
cache groups, full attention (layers 0, 2) and sliding window (layers 1, 3), and frees a
sliding-window layer's blocks once they fall out of the window. Each group registers as a
kvplane layer group; the prefill answers each group's blocks (null where the window dropped
one), and the decode loads, group by group, the blocks its own allocation holds. The oracle is
one engine, over prompts longer than the window.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from workers.testing.vllm_bed import engine_bed, handover, prompts, recorded, write_model

from .conftest import require_vllm

pytestmark = pytest.mark.slow

BLOCK = 32  # tests/vllm/engine.py's block size


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    require_vllm()
    workdir = tmp_path_factory.mktemp("vllm-hybrid")
    model = write_model(workdir, sliding=True)
    engines = [
        ("prefill", "vllm-prefill-swa", "0", {}),
        ("decode", "vllm-decode-swa", "1", {}),
    ]
    with engine_bed(workdir, model, engines) as (plane, started):
        yield {
            "plane": plane,
            "prefill": started["vllm-prefill-swa"],
            "decode": started["vllm-decode-swa"],
        }


def test_each_kv_cache_group_registers_as_a_layer_group(bed: dict[str, Any]) -> None:
    for name in ("vllm-prefill-swa", "vllm-decode-swa"):
        body = httpx.get(f"{bed['plane'].url}/v1/instances/{name}", timeout=10).json()
        (rank,) = body["ranks"]
        group_of = {pool["id"]: pool["layer_group"] for pool in rank["pools"]}
        layers = {
            buffer["layer"]: group_of[view["pool"]]
            for view in rank["views"]
            for buffer in view["buffers"]
        }
        assert layers == {0: 0, 1: 1, 2: 0, 3: 1}, body


def test_a_hybrid_model_equals_one_engine(bed: dict[str, Any]) -> None:
    batch = prompts(61, (40, 130, 300, 700))  # the longer ones outgrow the window
    alone = bed["decode"].generate(batch, 12)["tokens"]
    context = "vllm-prefill-swa"
    assert handover(bed["prefill"], bed["decode"], batch, batch, 12, context=context) == alone
    mine = recorded(bed["plane"].url, len(batch), context="vllm-prefill-swa")
    assert len(mine) == len(batch), mine
    # The sliding-window group moves its window's blocks only: 700 tokens are 22 blocks of
    # full attention, and at most 4 (64 tokens, over a block boundary, plus the last partial
    # block) of the window, on both of its layers.
    page = 2 * 4 * BLOCK * 32 * 2  # K and V, 4 heads, 32 tokens, head_dim 32, bfloat16
    sizes = sorted(t["bytes"] for t in mine)
    assert sizes[-1] <= (22 + 4) * 2 * page, sizes
    assert sizes[-1] >= (22 + 2) * 2 * page, sizes
    assert bed["prefill"].call(op="idle", timeout_s=30) == {"idle": True}
    assert bed["decode"].call(op="idle", timeout_s=10) == {"idle": True}


def test_a_prompt_that_leaves_the_window_computes_locally(bed: dict[str, Any]) -> None:
    """The decode's prompt shares only the first 3 blocks with the prefilled one: continuing at
    token 96 reads tokens 33 on, which the prefill's window dropped. The decode computes the
    prompt itself and tells the prefill to free its blocks."""
    (prefilled,) = prompts(62, (400,))
    (other,) = prompts(63, (300,))
    decoded = prefilled[: 3 * BLOCK] + other[3 * BLOCK :]
    alone = bed["decode"].generate([decoded], 8)["tokens"]
    loaded = handover(
        bed["prefill"], bed["decode"], [prefilled], [decoded], 8, context="vllm-prefill-swa"
    )
    assert loaded == alone
    assert "no longer holds the blocks of KV cache group 1" in bed["decode"].log()
    assert bed["prefill"].call(op="idle", timeout_s=30) == {"idle": True}
    assert bed["decode"].call(op="idle", timeout_s=10) == {"idle": True}


def test_a_failed_load_of_a_hybrid_model_fails_its_request_only(bed: dict[str, Any]) -> None:
    """With several KV cache groups vLLM takes load failures per request (block ids name a
    block of one group only; block-level errors would stop the engine). Forged ids in the
    sliding-window group make the prefill refuse the ask: the request finishes with an error
    (this decode's ``kv_load_failure_policy`` is "fail"), the prefill frees its blocks, and the
    next handover decodes as one engine does."""
    prefill, decode = bed["prefill"], bed["decode"]
    (prompt,) = prompts(64, (200,))
    (params,) = prefill.generate([prompt], 1, [{"do_remote_decode": True}])["params"]
    groups = params["remote_block_ids"]
    assert len(groups) == 2 and None in groups[1], groups  # the window dropped some
    groups[1] = [None if b is None else b + 5000 for b in groups[1]]
    failed = decode.generate([prompt], 8, [params])
    assert failed["finish"] == ["error"] and failed["tokens"] == [[]], failed
    assert "holds other blocks" in decode.log()
    assert prefill.call(op="idle", timeout_s=30) == {"idle": True}
    assert decode.call(op="idle", timeout_s=10) == {"idle": True}
    batch = prompts(65, (150,))
    alone = decode.generate(batch, 8)["tokens"]
    assert handover(prefill, decode, batch, batch, 8, context="vllm-prefill-swa") == alone
