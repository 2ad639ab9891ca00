"""Registration bodies from a model shape and a parallelism: what an engine would report.

Used by the demo fleet, ``kvplane describe``, the benchmarks and the tests. Layout of one rank:
one pool per layer group; each slot holds, for every layer of the rank's pipeline stage, the K
buffer then the V buffer (K only for MLA-style views), target layers first, then draft layers.
Buffer bytes are ``heads_per_rank × tokens_per_block × head_dim × element_bytes`` (exact for
sub-byte types: ``nvfp4`` is half a byte per element).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

ELEMENT_BYTES: dict[str, Fraction] = {
    "float32": Fraction(4),
    "bfloat16": Fraction(2),
    "float16": Fraction(2),
    "float8_e4m3fn": Fraction(1),
    "float8_e5m2": Fraction(1),
    "nvfp4": Fraction(1, 2),
}


@dataclass(frozen=True)
class ViewSpec:
    """One class of layers: ``owner``, heads (model-wide), ``head_dim`` and layout."""

    owner: str
    layers: int
    kv_heads: int
    head_dim: int
    layout: str = "HND"
    dtype: str = "bfloat16"
    k_only: bool = False  # MLA-style latent cache: one buffer per layer
    replicated: bool = False  # REPLICATED layout: every rank holds the whole buffer


def pipeline_stages(layers: int, pp: int, split: Sequence[int] | None = None) -> list[range]:
    """Global layer ids per PP stage: ``split`` (e.g. ``[30, 10]``) or as even as possible."""
    if split is None:
        base, extra = divmod(layers, pp)
        split = [base + (1 if stage < extra else 0) for stage in range(pp)]
    if len(split) != pp or sum(split) != layers:
        raise ValueError(f"pp split {list(split)} does not cover {layers} layers in {pp} stages")
    stages, start = [], 0
    for count in split:
        stages.append(range(start, start + count))
        start += count
    return stages


def heads_per_rank(total_heads: int, tp: int, attention_dp: bool) -> int:
    """``h = H / min(G, H)`` for the attention TP group of the instance."""
    group = 1 if attention_dp else tp
    return total_heads // min(group, total_heads)


def instance_body(
    *,
    role: str,
    views: Sequence[ViewSpec],
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    attention_dp: bool = False,
    tokens_per_block: int = 32,
    num_slots: int = 64,
    pp_split: Sequence[int] | None = None,
    model: str | None = None,
    legacy: bool = False,
    slot_padding_bytes: int = 0,
) -> dict[str, Any]:
    """A complete ``PUT /v1/instances/{name}`` body.

    The first view spec is the target; draft layers get global ids after the target's and live on
    the last pipeline stage. ``legacy=True`` omits per-view head counts (rank-wide fallback only).
    """
    target = views[0]
    stages = pipeline_stages(target.layers, pp, pp_split)
    world = tp * pp * cp
    ranks = []
    for rank in range(world):
        pp_rank = rank // (tp * cp)
        offset = 0
        view_bodies = []
        next_layer = target.layers
        for spec in views:
            if spec.owner == "target" and spec is target:
                layer_ids: Sequence[int] = stages[pp_rank]
            else:
                layer_ids = range(next_layer, next_layer + spec.layers) if pp_rank == pp - 1 else ()
                next_layer += spec.layers
            if not layer_ids:
                continue
            heads = 1 if spec.replicated else heads_per_rank(spec.kv_heads, tp, attention_dp)
            size_exact = (
                heads
                * tokens_per_block
                * spec.head_dim
                * ELEMENT_BYTES.get(spec.dtype, Fraction(1))
            )
            if size_exact.denominator != 1:
                raise ValueError(f"{spec} gives a fractional buffer size {size_exact}")
            size = int(size_exact)
            buffers = []
            for layer in layer_ids:
                for _ in range(1 if spec.k_only else 2):
                    buffers.append({"layer": layer, "offset": offset, "size": size})
                    offset += size
            body: dict[str, Any] = {
                "pool": 0,
                "owner": spec.owner,
                "roles": ["key"] if spec.k_only else ["key", "value"],
                "layout": "REPLICATED" if spec.replicated else spec.layout,
                "head_dim": spec.head_dim,
                "dtype": spec.dtype,
                "buffers": buffers,
            }
            if not legacy and not spec.replicated:
                body["num_kv_heads"] = heads
                body["total_kv_heads"] = spec.kv_heads
            view_bodies.append(body)
        slot_bytes = offset + slot_padding_bytes
        ranks.append(
            {
                "rank": rank,
                "pools": [
                    {
                        "id": 0,
                        "layer_group": 0,
                        "slot_bytes": slot_bytes,
                        "slot_stride_bytes": slot_bytes,
                        "num_slots": num_slots,
                        "base_address": 0,
                    }
                ],
                "views": view_bodies,
            }
        )
    body = {
        "role": role,
        "tp": tp,
        "pp": pp,
        "cp": cp,
        "attention_dp": attention_dp,
        "tokens_per_block": tokens_per_block,
        "kv_heads_per_rank": heads_per_rank(target.kv_heads, tp, attention_dp),
        "total_kv_heads": target.kv_heads,
        "ranks": ranks,
    }
    if model is not None:
        body["model"] = model
    return body
