"""An engine's per-layer KV views as kvplane pools and views, decided by their strides.

vLLM (0.32) hands every attention backend one 4-D view per layer, ``[B, H, N, C]`` (blocks,
KV heads, tokens of a block, content bytes of one head and token: keys and values), whose
strides follow one of six layouts (``vllm/v1/kv_cache_layout.py``): the physical order of
``L`` (layer), ``B``, ``H`` and ``N``. kvplane describes four of them:

============  ============================  =============================================
layout        a block of one layer          pools
============  ============================  =============================================
``LBHNC``     ``[H, N, C]``: ``HND``        one per layer, slot = block
``LBNHC``     ``[N, H, C]``: ``NHD``        one per layer, slot = block
``BLHNC``     ``[H, N, C]``: ``HND``        one for the layers that share each block, one
                                            buffer per layer at its offset in the block
``BLNHC``     ``[N, H, C]``: ``NHD``        likewise
============  ============================  =============================================

``LHBNC`` and ``BHLNC`` put a layer's heads apart, with other blocks or other layers between
them: no slot holds one block of one layer, so they are refused, naming the layout. The strides,
never the shape alone, decide: an ``NHD`` cache registered as ``HND`` would move the wrong heads.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
DESCRIBED = ("LBHNC", "LBNHC", "BLHNC", "BLNHC")


class LayoutError(ValueError):
    """A KV view kvplane cannot describe as pools and views."""


@dataclass(frozen=True)
class LayerView:
    """One layer's ``[B, H, N, C]`` view, read from its strides (bytes)."""

    layer: int
    tensor: torch.Tensor
    inner: str  # "HND" or "NHD": how a block of this layer holds its heads and tokens
    page_bytes: int  # one block of this layer
    block_stride_bytes: int
    address: int  # block 0 of this layer
    storage: int  # the address of the allocation it views


def layer_index(name: str, default: int) -> int:
    """The global layer id in a vLLM layer name (``model.layers.3.self_attn.attn`` → 3)."""
    match = _LAYER.search(name)
    return int(match.group(1)) if match else default


def layout_name(tensor: torch.Tensor) -> str:
    """The vLLM layout name of a ``[B, H, N, C]`` view, read from its strides."""
    s_block, s_head, s_token, _ = (int(s) for s in tensor.stride())
    _, heads, tokens, content = (int(n) for n in tensor.shape)
    page = heads * tokens * content
    if s_head > s_block:
        return "LHBNC"  # a layer's blocks lie between its heads
    if s_head > s_token:
        if s_head > tokens * content:
            return "BHLNC"  # other layers lie between a block's heads
        return "LBHNC" if s_block == page else "BLHNC"
    return "LBNHC" if s_block == page else "BLNHC"


def read_layer(
    name: str, index: int, tensor: torch.Tensor, heads: int, block_size: int
) -> LayerView:
    """``tensor`` (one layer's view) as a :class:`LayerView`; :class:`LayoutError` says why not."""
    shape = tuple(int(n) for n in tensor.shape)
    if len(shape) != 4 or shape[1:3] != (heads, block_size):
        raise LayoutError(
            f"KvplaneConnector: layer {name}: a KV view of shape {shape}; kvplane reads vLLM's "
            f"[blocks, heads, block_size, content] views ({heads} KV heads, block size "
            f"{block_size})"
        )
    item = tensor.element_size()
    s_block, s_head, s_token, s_content = (int(s) for s in tensor.stride())
    content = shape[3]
    page = heads * block_size * content * item
    if s_content != 1:
        inner = None
    elif s_token == content and s_head == block_size * content:
        inner = "HND"
    elif s_head == content and s_token == heads * content:
        inner = "NHD"
    else:
        inner = None
    if inner is None or s_block * item < page:
        name_of = layout_name(tensor)
        raise LayoutError(
            f"KvplaneConnector: layer {name} uses KV cache layout {name_of} (strides "
            f"{tuple(tensor.stride())}): a layer's heads lie apart, with other blocks or layers "
            f"between them, so no slot holds one block of one layer. kvplane describes "
            f"{', '.join(DESCRIBED)}; the connector asks vLLM for LBHNC "
            "(get_required_kvcache_layout), and VLLM_KV_CACHE_LAYOUT can name another"
        )
    return LayerView(
        layer=layer_index(name, index),
        tensor=tensor,
        inner=inner,
        page_bytes=page,
        block_stride_bytes=s_block * item,
        address=int(tensor.data_ptr()),
        storage=int(tensor.untyped_storage().data_ptr()),
    )


def describe(
    kv_caches: Mapping[str, torch.Tensor],
    *,
    heads: int,
    total_heads: int,
    block_size: int,
    head_dim: int,
    latent: bool = False,
    groups: Mapping[str, int] | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[int, torch.Tensor]]:
    """``(pools, views, {pool id: uint8 tensor})`` of one rank's per-layer KV views.

    Layers whose blocks interleave in one allocation (block-outermost layouts) share a pool:
    a slot is one block of all of them, and each layer is a buffer at its offset in it.
    ``latent``: multi-head latent attention (MLA), one compressed latent per token that every
    TP rank holds whole: ``REPLICATED`` views with a single (``key``) buffer per layer.
    ``groups``: each layer's KV cache group by name (vLLM's hybrid KV cache manager), the
    layer group of its pool; a pool holds layers of one group."""
    group_of = {
        layer_index(name, index): (groups or {}).get(name, 0)
        for index, name in enumerate(
            sorted(kv_caches, key=lambda name: (layer_index(name, 1 << 30), name))
        )
    }
    layers = [
        read_layer(name, index, tensor, heads, block_size)
        for index, (name, tensor) in enumerate(
            sorted(kv_caches.items(), key=lambda item: (layer_index(item[0], 1 << 30), item[0]))
        )
    ]
    shared: dict[tuple[int, int, str, int, int], list[LayerView]] = {}
    for view in layers:
        group = group_of[view.layer]
        if view.block_stride_bytes == view.page_bytes:  # a layer of its own (layer-outermost)
            key = (view.address, view.block_stride_bytes, view.inner, view.layer, group)
        else:
            key = (view.storage, view.block_stride_bytes, view.inner, -1, group)
        shared.setdefault(key, []).append(view)
    pools: list[dict[str, Any]] = []
    views: list[dict[str, Any]] = []
    tensors: dict[int, torch.Tensor] = {}
    for (*_, group), members in shared.items():
        base = min(view.address for view in members)
        stride = members[0].block_stride_bytes
        if max(view.address for view in members) - base + members[0].page_bytes > stride:
            parts = [[view] for view in members]  # not one block's pages: a pool per layer
        else:
            parts = [members]
        for part in parts:
            _add_pool(
                part,
                pools,
                views,
                tensors,
                total_heads=total_heads,
                head_dim=head_dim,
                latent=latent,
                layer_group=group,
            )
    return pools, views, tensors


def _add_pool(
    members: list[LayerView],
    pools: list[dict[str, Any]],
    views: list[dict[str, Any]],
    tensors: dict[int, torch.Tensor],
    *,
    total_heads: int,
    head_dim: int,
    latent: bool,
    layer_group: int,
) -> None:
    import torch

    first = members[0]
    base = min(view.address for view in members)
    stride = first.block_stride_bytes
    slot = max(view.address for view in members) - base + first.page_bytes
    num_slots = int(first.tensor.shape[0])
    flat = torch.empty(0, dtype=torch.uint8, device=first.tensor.device)
    nbytes = (num_slots - 1) * stride + slot
    # the pool's bytes, in place: slot s starts at s × stride
    flat.set_(first.tensor.untyped_storage(), base - first.storage, (nbytes,), (1,))
    pool_id = len(pools)
    pools.append(
        {
            "id": pool_id,
            "layer_group": layer_group,
            "slot_bytes": slot,
            "slot_stride_bytes": stride,
            "num_slots": num_slots,
            "base_address": base,
        }
    )
    view: dict[str, Any] = {
        "pool": pool_id,
        "owner": "target",
        "roles": ["key"] if latent else ["key", "value"],
        "layout": "REPLICATED" if latent else first.inner,
        "head_dim": head_dim,
        "dtype": str(first.tensor.dtype).removeprefix("torch."),
        "buffers": [
            {"layer": view.layer, "offset": view.address - base, "size": view.page_bytes}
            for view in sorted(members, key=lambda v: v.layer)
        ],
    }
    if not latent:
        view["num_kv_heads"] = int(first.tensor.shape[1])
        view["total_kv_heads"] = total_heads
    views.append(view)
    tensors[pool_id] = flat
