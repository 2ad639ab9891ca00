"""Helpers for tests and benchmarks: hand-built head-slice templates and naive oracles.

The naive oracles walk every fragment in Python; they are slow by design and exist only to check
the executors byte for byte. The template builders build the planner's templates by hand for one
slot layout: a slot holds ``layers × buffers`` buffers (K then V per layer), each
``heads × tokens × head_dim`` elements, in HND (head-major) or NHD (token-major) order. HND gives
one run per layer and buffer, NHD one run per layer and buffer repeated per token, a conversion
one run per layer, buffer and head repeated per token, as in docs/planning.md ("Templates").
"""

from __future__ import annotations

import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from workers.executors import Blocks, Route, Run, Segment, as_route, staging_layout
from workers.pools import Pool, PoolSpec, allocate_pools, fill_pattern

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class HeadSlice:
    """Geometry of one sender→receiver head slice (same layout, dtype and head_dim both sides)."""

    layout: Literal["HND", "NHD"]
    layers: int
    tokens_per_block: int
    head_dim: int
    elem_bytes: int
    sender_heads: int  # heads per rank on the sender
    receiver_heads: int  # heads per rank on the receiver
    src_head: int  # first sender-local head copied
    dst_head: int  # first receiver-local head written
    heads: int  # heads copied
    buffers_per_layer: int = 2
    receiver_layout: Literal["HND", "NHD", None] = None  # None: same as ``layout``

    def slot_bytes(self, heads: int) -> int:
        return self.layers * self.buffers_per_layer * self.buffer_bytes(heads)

    def buffer_bytes(self, heads: int) -> int:
        return heads * self.tokens_per_block * self.head_dim * self.elem_bytes

    def sender_spec(self, num_slots: int, pool_id: int = 0, pad: int = 0) -> PoolSpec:
        b = self.slot_bytes(self.sender_heads)
        return PoolSpec(pool_id, b, b + pad, num_slots)

    def receiver_spec(self, num_slots: int, pool_id: int = 0, pad: int = 0) -> PoolSpec:
        b = self.slot_bytes(self.receiver_heads)
        return PoolSpec(pool_id, b, b + pad, num_slots)

    def route(self, src_pool: int = 0, dst_pool: int = 0, layer_group: int = 0) -> Route:
        """The template: one run per (layer, buffer); NHD runs repeat per token; a layout
        conversion has one run per (layer, buffer, head) repeating per token."""
        hb = self.head_dim * self.elem_bytes
        sbuf, dbuf = self.buffer_bytes(self.sender_heads), self.buffer_bytes(self.receiver_heads)
        tb = self.tokens_per_block * hb
        runs = []
        for i in range(self.layers * self.buffers_per_layer):
            if self.receiver_layout not in (None, self.layout):
                # HND head h: h·tb, token step hb; NHD head h: h·hb, token step heads·hb
                for h in range(self.heads):
                    src_h, dst_h = self.src_head + h, self.dst_head + h
                    if self.layout == "HND":
                        src, src_step = src_h * tb, hb
                        dst, dst_step = dst_h * hb, self.receiver_heads * hb
                    else:
                        src, src_step = src_h * hb, self.sender_heads * hb
                        dst, dst_step = dst_h * tb, hb
                    runs.append(
                        Run(
                            i * sbuf + src,
                            i * dbuf + dst,
                            hb,
                            count=self.tokens_per_block,
                            src_step=src_step,
                            dst_step=dst_step,
                        )
                    )
            elif self.layout == "HND":
                tb = self.tokens_per_block * hb
                runs.append(
                    Run(
                        i * sbuf + self.src_head * tb,
                        i * dbuf + self.dst_head * tb,
                        self.heads * tb,
                    )
                )
            else:
                runs.append(
                    Run(
                        i * sbuf + self.src_head * hb,
                        i * dbuf + self.dst_head * hb,
                        self.heads * hb,
                        count=self.tokens_per_block,
                        src_step=self.sender_heads * hb,
                        dst_step=self.receiver_heads * hb,
                    )
                )
        return Route(0, 0, (Segment(src_pool, dst_pool, tuple(runs), layer_group),))


def _ids(blocks: Mapping[int, object] | object, g: int, sub_block: int = 0) -> list[int]:
    v = np.asarray(blocks[g] if isinstance(blocks, Mapping) else blocks)
    if v.ndim == 2:  # a block-size ratio's small side: one column per sub-block
        v = v[:, sub_block]
    return [int(x) for x in v.reshape(-1)]


def reference_copy(
    route: Route | Mapping,
    src_pools: Mapping[int, Pool],
    dst_pools: Mapping[int, Pool],
    src_blocks: object,
    dst_blocks: object,
) -> None:
    """Naive oracle of :func:`workers.executors.copy_local`: one slice copy per fragment."""
    route = as_route(route)
    for seg in route.segments:
        sp, dp = src_pools[seg.src_pool], dst_pools[seg.dst_pool]
        for bs, bd in zip(
            _ids(src_blocks, seg.layer_group, seg.sub_block),
            _ids(dst_blocks, seg.layer_group, seg.sub_block),
            strict=True,
        ):
            for r in seg.runs:
                for c in range(r.count):
                    s = bs * sp.spec.slot_stride_bytes + r.src + c * r.src_step
                    d = bd * dp.spec.slot_stride_bytes + r.dst + c * r.dst_step
                    dp.tensor[d : d + r.len] = sp.tensor[s : s + r.len]


def reference_staging(
    route: Route | Mapping, src_pools: Mapping[int, Pool], src_blocks: Blocks
) -> torch.Tensor:
    """Naive oracle of :func:`workers.executors.gather`: fragments appended in layout order."""
    import torch

    route = as_route(route)
    parts = []
    for g in route.layer_groups:
        for j in range(len(_ids(src_blocks, g))):
            for seg in route.segments:
                if seg.layer_group != g:
                    continue
                bs = _ids(src_blocks, g, seg.sub_block)[j]
                sp = src_pools[seg.src_pool]
                for r in seg.runs:
                    for c in range(r.count):
                        s = bs * sp.spec.slot_stride_bytes + r.src + c * r.src_step
                        parts.append(sp.tensor[s : s + r.len].cpu())
    out = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    assert out.numel() == staging_layout(route, src_blocks).nbytes
    return out


# --- NIXL loopback peers (multiprocessing ``spawn`` targets for tests) -----------------------
# Long-lived peer processes run one job (a dict) per command, so a test pays torch's import once.
# Metadata goes receiver → parent → sender over queues; in production it travels through the
# control plane instead.

LOOPBACK_TIMEOUT_S = 60.0


def _pools(rank: int, specs: list[dict[str, Any]]) -> dict[int, Pool]:
    pools = allocate_pools([PoolSpec(**s) for s in specs])
    for p in pools.values():
        fill_pattern(rank, p)
    return pools


def _receive_job(cfg: dict[str, Any], out: Any) -> dict[str, int]:
    """Register, publish, receive every writer, then compare every byte with the oracle."""
    import torch

    from workers.transport.nixl import NixlTransport

    pools = _pools(cfg["rank"], cfg["specs"])
    with NixlTransport(cfg["agent"], pools, staging_bytes=cfg["staging_bytes"]) as tr:
        out.put(("info", tr.peer_info().to_json()))
        for w in cfg["writers"]:
            if w["mode"] == "staged":
                tr.receive_staged(
                    w["agent"], w["route"], w["dst_blocks"], offset=w["offset"],
                    tag=w["tag"].encode(), chunk_blocks=w["chunk_blocks"],
                    timeout_s=LOOPBACK_TIMEOUT_S,
                )  # fmt: skip
            else:
                tr.wait_notif(w["agent"], [w["tag"].encode()], LOOPBACK_TIMEOUT_S)
    initial = _pools(cfg["rank"], cfg["specs"])
    expected = _pools(cfg["rank"], cfg["specs"])
    for w in cfg["writers"]:
        src = _pools(w["rank"], w["specs"])
        reference_copy(w["route"], src, expected, w["src_blocks"], w["dst_blocks"])
    mismatched = changed = 0
    for pid, pool in pools.items():
        mismatched += int(torch.count_nonzero(pool.tensor != expected[pid].tensor))
        changed += int(torch.count_nonzero(pool.tensor != initial[pid].tensor))
    return {"mismatched": mismatched, "changed": changed}


def _send_job(cfg: dict[str, Any], out: Any) -> dict[str, int]:
    """Fill with this rank's pattern and write the route (staged or per fragment)."""
    from workers.transport.nixl import NixlTransport

    pools = _pools(cfg["rank"], cfg["specs"])
    with NixlTransport(cfg["agent"], pools, staging_bytes=cfg["staging_bytes"]) as tr:
        peer = tr.add_peer(cfg["peer"])
        if cfg["mode"] == "staged":
            n = tr.write_staged(
                peer, cfg["route"], cfg["src_blocks"], dst_offset=cfg["offset"],
                tag=cfg["tag"].encode(), chunk_blocks=cfg["chunk_blocks"],
                timeout_s=LOOPBACK_TIMEOUT_S,
            )  # fmt: skip
        else:
            n = tr.write_fragments(
                peer, cfg["route"], cfg["src_blocks"], cfg["dst_blocks"],
                tag=cfg["tag"].encode(), timeout_s=LOOPBACK_TIMEOUT_S,
            )  # fmt: skip
    return {"bytes": n}


def _serve(job: Any, cmds: Any, out: Any) -> None:
    while True:
        cfg = cmds.get()
        if cfg is None:
            return
        try:
            out.put(("result", job(cfg, out)))
        except BaseException:
            out.put(("error", traceback.format_exc()))


def loopback_receiver(cmds: Any, out: Any) -> None:
    """Process body: run receiver jobs from ``cmds`` until ``None``."""
    _serve(_receive_job, cmds, out)


def loopback_sender(cmds: Any, out: Any) -> None:
    """Process body: run sender jobs (each carrying the peer's info) until ``None``."""
    _serve(_send_job, cmds, out)
