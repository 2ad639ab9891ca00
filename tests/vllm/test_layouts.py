"""vLLM's six KV cache layouts, on CPU tensors, through the connector's registration
(``tests/vllm/layouts.py``, run in the vLLM environment): strides decide pools and views, the
two layouts kvplane cannot describe are refused by name, and a TP 2 → TP 1 head slice between
any two described layouts moves exactly the bytes a reference gather says."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest

from workers.testing.vllm_bed import HERE, VLLM_PYTHON

from .conftest import require_vllm


@pytest.fixture(scope="module")
def result() -> dict[str, Any]:
    require_vllm()
    run = subprocess.run(
        [str(VLLM_PYTHON), str(HERE / "layouts.py")],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=HERE.parents[1],
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return dict(json.loads(run.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize(
    ("layout", "view_layout", "pools"),
    [("LBHNC", "HND", 3), ("LBNHC", "NHD", 3), ("BLHNC", "HND", 1), ("BLNHC", "NHD", 1)],
)
def test_strides_decide_the_pools_and_views(
    result: dict[str, Any], layout: str, view_layout: str, pools: int
) -> None:
    described = result["layouts"][layout]
    assert len(described["pools"]) == pools == described["attached"]
    assert {view["layout"] for view in described["views"]} == {view_layout}
    page = 4 * 32 * 2 * 16 * 2  # heads x tokens x (keys and values) x head_dim x bf16
    buffers = [b for view in described["views"] for b in view["buffers"]]
    assert sorted(b["layer"] for b in buffers) == [0, 1, 2]
    assert {b["size"] for b in buffers} == {page}
    if pools == 1:  # block-outermost: one slot is a block of every layer
        (pool,) = described["pools"]
        assert pool["slot_stride_bytes"] == 3 * page
        assert sorted(b["offset"] for b in buffers) == [0, page, 2 * page]
    else:
        assert {p["slot_stride_bytes"] for p in described["pools"]} == {page}


@pytest.mark.parametrize("layout", ["LHBNC", "BHLNC"])
def test_layouts_kvplane_cannot_describe_are_refused_by_name(
    result: dict[str, Any], layout: str
) -> None:
    refusal = result["layouts"][layout]["refused"]
    assert f"layout {layout}" in refusal and "LBHNC" in refusal


def test_a_head_slice_between_any_two_layouts_moves_the_right_bytes(
    result: dict[str, Any],
) -> None:
    pairs = result["pairs"]
    assert len(pairs) == 16
    for name, outcome in pairs.items():
        # 2 routes x 5 blocks x 3 layers x half a page (2 of 4 heads)
        assert outcome == {"routes": 2, "bytes": 2 * 5 * 3 * 4096, "mismatched": 0}, name


@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC"])
def test_mla_latents_register_replicated_and_move_whole(
    result: dict[str, Any], layout: str
) -> None:
    """A DeepSeek-style latent cache (one 576-wide latent per token, 16-token blocks): REPLICATED
    views; TP 2 → TP 1 moves each block's latents once (the two replicas share the work)."""
    outcome = result["mla"][layout]
    assert outcome["views"] == ["REPLICATED"]
    assert outcome["mismatched"] == 0
    assert outcome["bytes"] == 3 * 3 * 16 * 576 * 2  # blocks x layers x tokens x latent x bf16
