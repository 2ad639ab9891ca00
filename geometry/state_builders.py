"""Registration bodies of hybrid models: paged attention layers plus per-request recurrent state.

Layout of one rank (what ``kvplane describe`` reports for a Mamba2/Jamba-style config):

- pool 0, layer group 0 (paged, ``tokens_per_block``): K then V of every attention layer of the
  rank's pipeline stage, HND, ``heads_per_rank × tokens_per_block × head_dim × itemsize`` each;
- pool 1, layer group ``state_group`` (``tokens_per_slot: null``): per recurrent layer of the
  stage, its conv state (``SECTIONED``, roles ``["conv_state"]``) then its SSM state (``HND`` over
  SSM heads, roles ``["ssm_state"]``). Sizes follow :mod:`geometry.state`: the conv buffer is
  ``Σ S_i / G_s`` with ``S_i = channels_i × (d_conv − 1) × itemsize``; the SSM buffer is
  ``h × head_dim × d_state × itemsize`` with ``h = H / min(G_s, H)``.

A stage without attention layers has no pool 0, one without recurrent layers no pool 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from geometry.builders import ELEMENT_BYTES, pipeline_stages


@dataclass(frozen=True)
class HybridSpec:
    """A hybrid model's shape: which global layers attend, which carry recurrent state."""

    num_layers: int
    attention_layers: tuple[int, ...]
    kv_heads: int
    head_dim: int
    ssm_heads: int
    ssm_head_dim: int
    d_state: int
    conv_channels: tuple[int, ...]  # per section, e.g. (d_inner, G × d_state, G × d_state)
    d_conv: int
    dtype: str = "bfloat16"
    ssm_dtype: str = "float32"
    conv_dtype: str | None = None  # defaults to dtype
    state_layers: tuple[int, ...] = field(default=())  # default: every non-attention layer
    ssm_groups: int = 0  # Mamba2 B/C groups (0: not grouped); must split over the state axis

    def recurrent_layers(self) -> tuple[int, ...]:
        if self.state_layers:
            return self.state_layers
        attention = set(self.attention_layers)
        return tuple(layer for layer in range(self.num_layers) if layer not in attention)

    @property
    def section_bytes(self) -> tuple[int, ...]:
        """TP-aggregated bytes of each conv section of one layer."""
        item = ELEMENT_BYTES[self.conv_dtype or self.dtype]
        return tuple(
            _whole(channels * (self.d_conv - 1) * item, "conv section")
            for channels in self.conv_channels
        )


def _whole(value: Fraction, what: str) -> int:
    if value.denominator != 1:
        raise ValueError(f"{what} of {value} bytes is not a whole number of bytes")
    return int(value)


def _share(total: int, group: int, what: str) -> tuple[int, int]:
    """``(shards, per_shard)`` of ``total`` units over ``group`` ranks (replicas when fewer)."""
    shards = min(group, total)
    if group % shards or total % shards:
        raise ValueError(f"{total} {what} cannot be sharded over {group} ranks")
    return shards, total // shards


def hybrid_body(
    *,
    role: str,
    spec: HybridSpec,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    attention_dp: bool = False,
    tokens_per_block: int = 32,
    num_slots: int = 64,
    state_slots: int = 16,
    state_group: int = 1,
    pp_split: Sequence[int] | None = None,
    model: str | None = None,
) -> dict[str, Any]:
    """A complete ``PUT /v1/instances/{name}`` body of a hybrid model."""
    stages = pipeline_stages(spec.num_layers, pp, pp_split)
    group = 1 if attention_dp else tp
    axis = 1 if attention_dp else tp * cp
    _, kv_per_rank = _share(spec.kv_heads, group, "KV heads")
    _, ssm_per_rank = _share(spec.ssm_heads, axis, "SSM heads")
    sections = spec.section_bytes
    if spec.ssm_groups % axis:
        raise ValueError(
            f"{spec.ssm_groups} Mamba2 groups do not split over a state axis of {axis} ranks "
            "(tp × cp): engines then replicate the B and C conv sections, which a SECTIONED "
            "view cannot describe"
        )
    if any(size % axis for size in sections):
        raise ValueError(
            f"conv sections {list(sections)} bytes do not split over a state axis of {axis} "
            "ranks (tp × cp)"
        )
    kv_size = _whole(
        kv_per_rank * tokens_per_block * spec.head_dim * ELEMENT_BYTES[spec.dtype], "KV buffer"
    )
    conv_size = sum(sections) // axis
    ssm_size = _whole(
        ssm_per_rank * spec.ssm_head_dim * spec.d_state * ELEMENT_BYTES[spec.ssm_dtype],
        "SSM buffer",
    )
    attention = set(spec.attention_layers)
    recurrent = set(spec.recurrent_layers())
    ranks = []
    for rank in range(tp * pp * cp):
        stage = stages[rank // (tp * cp)]
        pools: list[dict[str, Any]] = []
        views: list[dict[str, Any]] = []
        kv_layers = [layer for layer in stage if layer in attention]
        if kv_layers:
            buffers = [
                {"layer": layer, "offset": (2 * i + kv) * kv_size, "size": kv_size}
                for i, layer in enumerate(kv_layers)
                for kv in range(2)
            ]
            pools.append(_pool(0, 0, 2 * kv_size * len(kv_layers), num_slots))
            views.append(
                {
                    "pool": 0,
                    "owner": "target",
                    "roles": ["key", "value"],
                    "layout": "HND",
                    "num_kv_heads": kv_per_rank,
                    "total_kv_heads": spec.kv_heads,
                    "head_dim": spec.head_dim,
                    "dtype": spec.dtype,
                    "buffers": buffers,
                }
            )
        state_layers = [layer for layer in stage if layer in recurrent]
        if state_layers:
            step = conv_size + ssm_size
            pools.append(_pool(1, state_group, step * len(state_layers), state_slots))
            views.append(
                {
                    "pool": 1,
                    "owner": "target",
                    "roles": ["conv_state"],
                    "layout": "SECTIONED",
                    "section_bytes": list(sections),
                    "dtype": spec.conv_dtype or spec.dtype,
                    "buffers": [
                        {"layer": layer, "offset": i * step, "size": conv_size}
                        for i, layer in enumerate(state_layers)
                    ],
                }
            )
            views.append(
                {
                    "pool": 1,
                    "owner": "target",
                    "roles": ["ssm_state"],
                    "layout": "HND",
                    "num_kv_heads": ssm_per_rank,
                    "total_kv_heads": spec.ssm_heads,
                    "head_dim": spec.ssm_head_dim,
                    "d_state": spec.d_state,
                    "dtype": spec.ssm_dtype,
                    "buffers": [
                        {"layer": layer, "offset": i * step + conv_size, "size": ssm_size}
                        for i, layer in enumerate(state_layers)
                    ],
                }
            )
        ranks.append({"rank": rank, "pools": pools, "views": views})
    body: dict[str, Any] = {
        "role": role,
        "tp": tp,
        "pp": pp,
        "cp": cp,
        "attention_dp": attention_dp,
        "tokens_per_block": tokens_per_block,
        "kv_heads_per_rank": kv_per_rank,
        "total_kv_heads": spec.kv_heads,
        "layer_groups": [
            {"id": 0, "tokens_per_slot": tokens_per_block},
            {"id": state_group, "tokens_per_slot": None},
        ],
        "ranks": ranks,
    }
    if model is not None:
        body["model"] = model
    return body


def _pool(pool_id: int, layer_group: int, slot_bytes: int, num_slots: int) -> dict[str, Any]:
    return {
        "id": pool_id,
        "layer_group": layer_group,
        "slot_bytes": slot_bytes,
        "slot_stride_bytes": slot_bytes,
        "num_slots": num_slots,
        "base_address": 0,
    }
