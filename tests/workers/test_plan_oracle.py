"""Executors against the planning core: ``compile_plan`` + ``expand`` fragments are the oracle.

Whole fleets (every sender and receiver rank) are moved with the executors, directly and through
per-receiver staging at the plan's exact writer offsets, and every receiver byte is compared with
the result of copying ``expand``'s fragment list one by one.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from api import geometry
from api.geometry.builders import ViewSpec, instance_body
from workers.executors import align_blocks, copy_local, gather, scatter, staging_layout
from workers.pools import PoolSpec, allocate_pools, fill_pattern

CASES = [
    # (layouts, context tp, generation tp, kv heads): finer sender, coarser sender, duplication
    ("HND", 4, 2, 8),
    ("NHD", 2, 4, 8),
    ("HND", 4, 1, 2),
    ("NHD", 8, 2, 4),
    # HND <-> NHD conversion (strided runs per head), and shard counts that do not divide
    ("HND>NHD", 4, 2, 8),
    ("NHD>HND", 2, 4, 8),
    ("HND", 3, 2, 6),
    ("NHD>HND", 2, 3, 12),
]


def _fleet(body, rank_offset: int):
    """Pools per rank, filled with the pattern of (rank + rank_offset)."""
    out = {}
    for r in body["ranks"]:
        pools = allocate_pools([PoolSpec.from_dict(p) for p in r["pools"]])
        for p in pools.values():
            fill_pattern(r["rank"] + rank_offset, p)
        out[r["rank"]] = pools
    return out


@pytest.mark.parametrize(("layout", "ctx_tp", "gen_tp", "heads"), CASES)
def test_fleet_transfer_matches_expanded_fragments(layout, ctx_tp, gen_tp, heads):
    ctx_layout, _, gen_layout = layout.partition(">")
    ctx_view = [ViewSpec("target", layers=3, kv_heads=heads, head_dim=16, layout=ctx_layout)]
    gen_view = [ViewSpec("target", 3, heads, 16, layout=gen_layout or ctx_layout)]
    ctx_body = instance_body(role="context", views=ctx_view, tp=ctx_tp, tokens_per_block=8,
                             num_slots=24, slot_padding_bytes=32)  # fmt: skip
    gen_body = instance_body(role="generation", views=gen_view, tp=gen_tp, tokens_per_block=8,
                             num_slots=20)  # fmt: skip
    plan = geometry.compile_plan(
        geometry.parse_instance(ctx_body, "ctx"), geometry.parse_instance(gen_body, "gen")
    )
    # Prefix caching on the generation side: the context list is longer; suffixes align.
    blocks = {0: ([5, 6, 7, 8, 9, 1, 2, 3, 23, 0], [19, 4, 5, 6, 0, 11, 12, 13])}
    expansion = geometry.expand(plan, blocks)

    senders = _fleet(ctx_body, 0)
    want = _fleet(gen_body, 100)
    for route in expansion.routes:
        rows = route.fragment_rows()
        src_pools, dst_pools = senders[route.route.sender_rank], want[route.route.receiver_rank]
        for sp, so, dp, do, ln in rows.tolist():
            dst_pools[dp].tensor[do : do + ln] = src_pools[sp].tensor[so : so + ln]

    direct = _fleet(gen_body, 100)
    staged = _fleet(gen_body, 100)
    routes = [r.to_dict() for r in plan.routes]
    staging = {}
    for recv in plan.receivers:
        per_block = sum(recv.writer_bytes)
        staging[recv.rank] = torch.zeros(per_block * 8, dtype=torch.uint8)
    for route in routes:
        bs, bd = align_blocks(route, blocks)
        copy_local(route, senders[route["sender_rank"]], direct[route["receiver_rank"]], bs, bd)
        recv = next(r for r in plan.receivers if r.rank == route["receiver_rank"])
        offset = recv.staging_offsets[recv.writers.index(route["sender_rank"])] * bs[0].size
        assert staging_layout(route, bs).nbytes == route["bytes_per_block"] * bs[0].size
        gather(route, senders[route["sender_rank"]], bs, out=staging[recv.rank], offset=offset)
        scatter(route, staging[recv.rank], staged[route["receiver_rank"]], bd, offset=offset)

    moved = 0
    for rank, pools in want.items():
        for pid, pool in pools.items():
            initial = _fleet(gen_body, 100)[rank][pid].tensor
            moved += int(torch.count_nonzero(pool.tensor != initial))
            assert torch.equal(direct[rank][pid].tensor, pool.tensor), f"direct rank {rank}"
            assert torch.equal(staged[rank][pid].tensor, pool.tensor), f"staged rank {rank}"
    assert moved > 0
    assert expansion.bytes == sum(
        r["bytes_per_block"] * align_blocks(r, blocks)[0][0].size for r in routes
    )
    assert np.all([s.numel() for s in staging.values()])


@pytest.mark.parametrize(
    ("ctx", "gen", "state"),
    [
        ({"tp": 4}, {"tp": 2}, ([2], [1])),
        ({"tp": 2}, {"tp": 4}, ([0], [3])),
        ({"tp": 1}, {"tp": 2}, ([1], [0])),
        ({"tp": 2}, {"tp": 2, "cp": 2}, ([2], [[1], [3]])),  # helix: a slot per CP rank
    ],
)
def test_hybrid_state_moves_through_the_local_executor_like_the_fragments(ctx, gen, state):
    from api.geometry.state_builders import HybridSpec, hybrid_body

    spec = HybridSpec(num_layers=4, attention_layers=(1,), kv_heads=4, head_dim=8, ssm_heads=8,
                      ssm_head_dim=4, d_state=4, conv_channels=(32, 16, 16), d_conv=4)  # fmt: skip
    ctx_body = hybrid_body(role="context", spec=spec, tokens_per_block=4, num_slots=8, **ctx)
    gen_body = hybrid_body(role="generation", spec=spec, tokens_per_block=4, num_slots=8, **gen)
    plan = geometry.compile_plan(
        geometry.parse_instance(ctx_body, "ctx"), geometry.parse_instance(gen_body, "gen")
    )
    blocks = {0: ([5, 6, 1], [4, 0]), 1: state}
    expansion = geometry.expand(plan, blocks)
    senders = _fleet(ctx_body, 0)
    want = _fleet(gen_body, 100)
    for route in expansion.routes:
        src_pools, dst_pools = senders[route.route.sender_rank], want[route.route.receiver_rank]
        for sp, so, dp, do, ln in route.fragment_rows().tolist():
            dst_pools[dp].tensor[do : do + ln] = src_pools[sp].tensor[so : so + ln]

    direct = _fleet(gen_body, 100)
    staged = _fleet(gen_body, 100)
    state_bytes = 0
    for route in (r.to_dict() for r in plan.routes):
        bs, bd = align_blocks(route, blocks)
        assert bs[1].size == bd[1].size == 1  # the state group: one slot pair per route
        copy_local(route, senders[route["sender_rank"]], direct[route["receiver_rank"]], bs, bd)
        layout = staging_layout(route, bs)
        area = torch.zeros(layout.nbytes, dtype=torch.uint8)
        gather(route, senders[route["sender_rank"]], bs, out=area)
        scatter(route, area, staged[route["receiver_rank"]], bd)
        state_bytes += layout.group(1)[1]
    # 3 recurrent layers: conv (32 + 16 + 16) × 3 × 2 bytes and 8 heads × 4 × 4 × 4 bytes each
    assert state_bytes == 3 * (64 * 3 * 2 + 8 * 4 * 4 * 4)
    for rank, pools in want.items():
        for pid, pool in pools.items():
            assert torch.equal(direct[rank][pid].tensor, pool.tensor), f"direct rank {rank}"
            assert torch.equal(staged[rank][pid].tensor, pool.tensor), f"staged rank {rank}"
