"""Executors against the planning core: ``compile_plan`` + ``expand`` fragments are the oracle.

Whole fleets (every sender and receiver rank) are moved with the executors, directly and through
per-receiver staging at the plan's exact writer offsets, and every receiver byte is compared with
the result of copying ``expand``'s fragment list one by one.
"""

from __future__ import annotations

import pytest
import torch

import geometry
from geometry.builders import ViewSpec, instance_body
from workers.executors import (
    align_request,
    copy_local,
    expand_fragments,
    gather,
    scatter,
    staging_layout,
)
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
# Different tokens_per_block (HND): (context tpb, generation tpb) → one large block, r small ones
RATIO_CASES = [
    ("HND", 4, 2, 8, (8, 2)),
    ("HND", 2, 4, 8, (2, 8)),
    ("HND", 8, 2, 4, (4, 2)),
    ("HND", 3, 2, 6, (2, 6)),
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


@pytest.mark.parametrize(
    ("layout", "ctx_tp", "gen_tp", "heads", "tpb"),
    [(*case, (8, 8)) for case in CASES] + RATIO_CASES,
)
def test_fleet_transfer_matches_expanded_fragments(layout, ctx_tp, gen_tp, heads, tpb):
    ctx_layout, _, gen_layout = layout.partition(">")
    ctx_view = [ViewSpec("target", layers=3, kv_heads=heads, head_dim=16, layout=ctx_layout)]
    gen_view = [ViewSpec("target", 3, heads, 16, layout=gen_layout or ctx_layout)]
    ctx_body = instance_body(role="context", views=ctx_view, tp=ctx_tp, tokens_per_block=tpb[0],
                             num_slots=24, slot_padding_bytes=32)  # fmt: skip
    gen_body = instance_body(role="generation", views=gen_view, tp=gen_tp, tokens_per_block=tpb[1],
                             num_slots=20)  # fmt: skip
    plan = geometry.compile_plan(
        geometry.parse_instance(ctx_body, "ctx"), geometry.parse_instance(gen_body, "gen")
    )
    # Prefix caching on the generation side: the context list is longer; suffixes align. The
    # prompt ends one token into the context's last block (with a ratio: a partial last block).
    blocks = {0: ([5, 6, 7, 8, 9, 1, 2, 3, 23, 0], [19, 4, 5, 6, 0, 11, 12, 13])}
    num_tokens = max(9 * tpb[0], 7 * tpb[1]) + 1
    expansion = geometry.expand(plan, blocks, num_tokens)

    senders = _fleet(ctx_body, 0)
    want = _fleet(gen_body, 100)
    for route in expansion.routes:
        rows = route.fragment_rows()
        src_pools, dst_pools = senders[route.route.sender_rank], want[route.route.receiver_rank]
        for sp, so, dp, do, ln in rows.tolist():
            dst_pools[dp].tensor[do : do + ln] = src_pools[sp].tensor[so : so + ln]

    direct = _fleet(gen_body, 100)
    staged = _fleet(gen_body, 100)
    indexed = _fleet(gen_body, 100)  # the CUDA default path (index_select), run on CPU
    routes = [r.to_dict() for r in plan.routes]
    staged_bytes = 0
    for plan_route, expanded in zip(routes, expansion.routes, strict=True):
        # with a ratio: the route as this request runs it (one lane per sub-block, and one for
        # the partial last small block)
        route, bs, bd = align_request(plan_route, blocks, num_tokens)
        sender, receiver = plan_route["sender_rank"], plan_route["receiver_rank"]
        copy_local(route, senders[sender], direct[receiver], bs, bd)
        copy_local(route, senders[sender], indexed[receiver], bs, bd, method="index")
        layout = staging_layout(route, bs)
        assert layout.nbytes == expanded.bytes
        staged_bytes += layout.nbytes
        area = torch.zeros(layout.nbytes + 8, dtype=torch.uint8)
        gather(route, senders[sender], bs, out=area, offset=8)
        scatter(route, area, staged[receiver], bd, offset=8)

    moved = 0
    for rank, pools in want.items():
        for pid, pool in pools.items():
            initial = _fleet(gen_body, 100)[rank][pid].tensor
            moved += int(torch.count_nonzero(pool.tensor != initial))
            assert torch.equal(direct[rank][pid].tensor, pool.tensor), f"direct rank {rank}"
            assert torch.equal(indexed[rank][pid].tensor, pool.tensor), f"indexed rank {rank}"
            assert torch.equal(staged[rank][pid].tensor, pool.tensor), f"staged rank {rank}"
    assert moved > 0
    assert expansion.bytes == staged_bytes > 0


@pytest.mark.parametrize(
    ("ctx", "gen", "state", "tpb"),
    [
        ({"tp": 4}, {"tp": 2}, ([2], [1]), (4, 4)),
        ({"tp": 2}, {"tp": 4}, ([0], [3]), (4, 4)),
        ({"tp": 1}, {"tp": 2}, ([1], [0]), (4, 4)),
        ({"tp": 2}, {"tp": 2, "cp": 2}, ([2], [[1], [3]]), (4, 4)),  # helix: a slot per CP rank
        # block-size ratios: the paged group pairs [n, r]; the state group still one slot pair
        ({"tp": 4}, {"tp": 2}, ([2], [1]), (8, 4)),
        ({"tp": 2}, {"tp": 4}, ([0], [3]), (4, 16)),
    ],
)
def test_hybrid_state_moves_through_the_local_executor_like_the_fragments(ctx, gen, state, tpb):
    from geometry.state_builders import HybridSpec, hybrid_body

    spec = HybridSpec(num_layers=4, attention_layers=(1,), kv_heads=4, head_dim=8, ssm_heads=8,
                      ssm_head_dim=4, d_state=4, conv_channels=(32, 16, 16), d_conv=4)  # fmt: skip
    ctx_body = hybrid_body(role="context", spec=spec, tokens_per_block=tpb[0], num_slots=8, **ctx)
    gen_body = hybrid_body(role="generation", spec=spec, tokens_per_block=tpb[1], num_slots=8,
                           **gen)  # fmt: skip
    plan = geometry.compile_plan(
        geometry.parse_instance(ctx_body, "ctx"), geometry.parse_instance(gen_body, "gen")
    )
    paged = ([5, 6, 1, 2, 3, 7], [4, 0]) if tpb[1] > tpb[0] else ([5, 6, 1], [4, 0])
    blocks = {0: paged, 1: state}
    num_tokens = max((len(paged[0]) - 1) * tpb[0], (len(paged[1]) - 1) * tpb[1]) + 1
    expansion = geometry.expand(plan, blocks, num_tokens)
    senders = _fleet(ctx_body, 0)
    want = _fleet(gen_body, 100)
    for route in expansion.routes:
        src_pools, dst_pools = senders[route.route.sender_rank], want[route.route.receiver_rank]
        for sp, so, dp, do, ln in route.fragment_rows().tolist():
            dst_pools[dp].tensor[do : do + ln] = src_pools[sp].tensor[so : so + ln]

    direct = _fleet(gen_body, 100)
    staged = _fleet(gen_body, 100)
    state_bytes = 0
    for plan_route in (r.to_dict() for r in plan.routes):
        route, bs, bd = align_request(plan_route, blocks, num_tokens)
        assert bs[1].size == bd[1].size == 1  # the state group: one slot pair per route
        if tpb[0] != tpb[1]:  # the paged group runs as lanes of sub-blocks, never the state
            assert {s.layer_group for s in route.segments} - {1} == set(bs) - {1}
            assert all(g < 0 for g in set(bs) - {1})
        sender, receiver = plan_route["sender_rank"], plan_route["receiver_rank"]
        copy_local(route, senders[sender], direct[receiver], bs, bd)
        layout = staging_layout(route, bs)
        area = torch.zeros(layout.nbytes, dtype=torch.uint8)
        gather(route, senders[sender], bs, out=area)
        scatter(route, area, staged[receiver], bd)
        state_bytes += layout.group(1)[1]
    # 3 recurrent layers: conv (32 + 16 + 16) × 3 × 2 bytes and 8 heads × 4 × 4 × 4 bytes each
    assert state_bytes == 3 * (64 * 3 * 2 + 8 * 4 * 4 * 4)
    for rank, pools in want.items():
        for pid, pool in pools.items():
            assert torch.equal(direct[rank][pid].tensor, pool.tensor), f"direct rank {rank}"
            assert torch.equal(staged[rank][pid].tensor, pool.tensor), f"staged rank {rank}"


@pytest.mark.parametrize(("layout", "ctx_tp", "gen_tp", "heads", "tpb"), RATIO_CASES)
def test_ratio_fragments_of_the_nixl_path_match_the_planning_core(
    layout, ctx_tp, gen_tp, heads, tpb
):
    """``expand_fragments`` (the per-fragment NIXL WRITE) over ``align_request``'s lanes lists
    exactly the fragments the planning core expands, partial last block included."""
    bodies = [
        instance_body(
            role=role,
            views=[ViewSpec("target", 2, heads, 16)],
            tp=tp,
            tokens_per_block=t,
            num_slots=24,
        )  # fmt: skip
        for role, tp, t in (("context", ctx_tp, tpb[0]), ("generation", gen_tp, tpb[1]))
    ]
    ctx, gen = (geometry.parse_instance(b, b["role"][:3]) for b in bodies)
    plan = geometry.compile_plan(ctx, gen)
    blocks = {0: ([5, 6, 7, 8, 9, 1, 2, 3, 23, 0], [19, 4, 5, 6, 0, 11, 12, 13, 14])}
    num_tokens = max(9 * tpb[0], 8 * tpb[1]) + 1  # a partial last block
    expansion = geometry.expand(plan, blocks, num_tokens)
    pools = {
        side: {r["rank"]: {p["id"]: PoolSpec.from_dict(p) for p in r["pools"]} for r in b["ranks"]}
        for side, b in zip(("context", "generation"), bodies, strict=True)
    }
    for expanded in expansion.routes:
        plan_route = expanded.route.to_dict()
        route, bs, bd = align_request(plan_route, blocks, num_tokens)
        frags = expand_fragments(
            route, pools["context"][plan_route["sender_rank"]],
            pools["generation"][plan_route["receiver_rank"]], bs, bd,
        )  # fmt: skip
        got = sorted(
            (sp, int(s), dp, int(d), int(n))
            for (sp, dp), arrays in frags.items()
            for s, d, n in zip(*arrays, strict=True)
        )
        assert got == sorted(map(tuple, expanded.fragment_rows().tolist()))
        assert got
