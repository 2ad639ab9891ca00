"""vLLM's six KV cache layouts through the connector's registration, on CPU tensors.

Run with the vLLM environment's Python (``tests/vllm/test_layouts.py`` does)::

    .venv-vllm/bin/python tests/vllm/layouts.py [--device cuda]

For each layout, vLLM's own ``create_kv_cache_views`` builds the per-layer ``[B, H, N, C]`` views
of a 3-layer, 4-KV-head model over one flat buffer, as its workers do, and
``workers.connectors.layouts.describe`` turns them into pools and views. Then, for every pair
of layouts kvplane describes, a TP 2 context (2 heads per rank) sends 5 blocks to a TP 1
generation (4 heads) with the plan that ``geometry`` compiles and kvplane's executors
(``copy_local``); every destination block must equal a reference gather of the source views,
head by head, and every other block stay zero. Prints one JSON object: each layout's pools and
views (or its refusal), and each pair's result.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from geometry import compile_plan, parse_instance
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from workers.connectors.layouts import LayoutError, describe
from workers.executors import Route, copy_local
from workers.pools import attach_pools

LAYERS, HEADS, BLOCK, HEAD_DIM, BLOCKS = 3, 4, 32, 16, 12
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
DEVICE = "cpu"


def views(
    layout: KVCacheLayout, heads: int, seed: int | None, *, mla: bool = False
) -> dict[str, torch.Tensor]:
    """One rank's per-layer views over a fresh buffer (random bytes, or zeros for None); ``mla``:
    a DeepSeek-style latent cache (one 576-wide latent per token, 16-token blocks)."""
    spec = (
        MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
        if mla
        else FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=heads, head_size=HEAD_DIM, dtype=torch.bfloat16
        )
    )
    layer_stride, block_stride, *_ = compute_layout_strides(spec, BLOCKS, LAYERS, layout)
    size = spec.page_size_bytes * BLOCKS * LAYERS
    raw = torch.zeros(size, dtype=torch.int8, device=DEVICE)
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
        raw.copy_(torch.randint(-128, 128, (size,), dtype=torch.int8, generator=generator))
    tensor = KVCacheTensor(
        size=size, layers=NAMES, layer_stride=layer_stride, block_stride=block_stride
    )
    made = create_kv_cache_views(raw, spec, BLOCKS, layout, tensor)
    return dict(zip(NAMES, made, strict=True))


def body(role: str, tp: int, ranks: list[dict[str, Any]], *, mla: bool = False) -> dict[str, Any]:
    return {
        "role": role,
        "model": "layouts",
        "tp": tp,
        "tokens_per_block": 16 if mla else BLOCK,
        "kv_heads_per_rank": 1 if mla else HEADS // tp,
        "total_kv_heads": 1 if mla else HEADS,
        "ranks": ranks,
    }


def rank(
    index: int, kv: dict[str, torch.Tensor], heads: int, *, mla: bool = False
) -> tuple[dict[str, Any], Any]:
    pools, described, tensors = describe(
        kv,
        heads=heads,
        total_heads=1 if mla else HEADS,
        block_size=16 if mla else BLOCK,
        head_dim=576 if mla else HEAD_DIM,
        latent=mla,
    )
    return {"rank": index, "pools": pools, "views": described}, attach_pools(pools, tensors)


def transfer(src: KVCacheLayout, dst: KVCacheLayout) -> dict[str, Any]:
    """TP 2 (``src``) → TP 1 (``dst``): 5 blocks, compared with a reference gather."""
    senders = [views(src, HEADS // 2, seed) for seed in (1, 2)]
    receiver = views(dst, HEADS, None)
    context = [rank(i, kv, HEADS // 2) for i, kv in enumerate(senders)]
    generation = rank(0, receiver, HEADS)
    plan = compile_plan(
        parse_instance(body("context", 2, [c[0] for c in context]), "ctx"),
        parse_instance(body("generation", 1, [generation[0]]), "gen"),
    )
    src_blocks, dst_blocks = [0, 3, 4, 7, 11], [9, 1, 2, 5, 6]
    moved = 0
    for route in plan.routes:
        moved += copy_local(
            Route.from_dict(route.to_dict()),
            context[route.sender_rank][1],
            generation[1],
            {0: src_blocks},
            {0: dst_blocks},
        )
    mismatched = 0
    for name in NAMES:
        got = receiver[name]
        for sb, db in zip(src_blocks, dst_blocks, strict=True):
            for sender, kv in enumerate(senders):
                want = kv[name][sb].view(torch.int16)  # [H/2, N, C], bits (random bf16: NaNs)
                heads = slice(sender * HEADS // 2, (sender + 1) * HEADS // 2)
                mismatched += int(not torch.equal(got[db, heads].view(torch.int16), want))
        untouched = [b for b in range(BLOCKS) if b not in dst_blocks]
        mismatched += int(bool(got[untouched].view(torch.int16).any()))
    return {"routes": len(plan.routes), "bytes": moved, "mismatched": mismatched}


def latent(layout: KVCacheLayout) -> dict[str, Any]:
    """MLA, TP 2 → TP 1: both context ranks hold the same latents (REPLICATED); the plan has
    one of them write each block, whole."""
    senders = [views(layout, 1, 7, mla=True) for _ in range(2)]  # replicas: equal bytes
    receiver = views(layout, 1, None, mla=True)
    context = [rank(i, kv, 1, mla=True) for i, kv in enumerate(senders)]
    generation = rank(0, receiver, 1, mla=True)
    plan = compile_plan(
        parse_instance(body("context", 2, [c[0] for c in context], mla=True), "ctx"),
        parse_instance(body("generation", 1, [generation[0]], mla=True), "gen"),
    )
    src_blocks, dst_blocks = [0, 3, 4], [9, 1, 2]
    moved = sum(
        copy_local(
            Route.from_dict(route.to_dict()),
            context[route.sender_rank][1],
            generation[1],
            {0: src_blocks},
            {0: dst_blocks},
        )
        for route in plan.routes
    )
    mismatched = sum(
        int(not torch.equal(receiver[n][db].view(torch.int16), senders[0][n][sb].view(torch.int16)))
        for n in NAMES
        for sb, db in zip(src_blocks, dst_blocks, strict=True)
    )
    layouts = {v["layout"] for v in generation[0]["views"]}
    return {
        "routes": len(plan.routes),
        "bytes": moved,
        "mismatched": mismatched,
        "views": sorted(layouts),
    }


def main() -> None:
    global DEVICE
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    DEVICE = parser.parse_args().device
    described: dict[str, Any] = {}
    for layout in KVCacheLayout:
        try:
            info, pools = rank(0, views(layout, HEADS, 0), HEADS)
            described[layout.name] = {
                "pools": info["pools"],
                "views": info["views"],
                "attached": len(pools),
            }
        except LayoutError as error:
            described[layout.name] = {"refused": str(error)}
    pairs = {
        f"{src.name}->{dst.name}": transfer(src, dst)
        for src in KVCacheLayout
        for dst in KVCacheLayout
        if "refused" not in described[src.name] and "refused" not in described[dst.name]
    }
    mla = {layout.name: latent(layout) for layout in (KVCacheLayout.LBHNC, KVCacheLayout.BLHNC)}
    print(json.dumps({"layouts": described, "pairs": pairs, "mla": mla}))


if __name__ == "__main__":
    main()
