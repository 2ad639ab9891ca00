"""HND ↔ NHD conversion and any TP ratio (range intersection), judged by the byte oracle.

Shapes: ``head_dim = 4`` bfloat16, ``tokens_per_block = 2``: one head of one token is 8 bytes,
one HND head 16 bytes, one NHD token row ``8 × heads`` bytes.
"""

from __future__ import annotations

from typing import Any

import pytest

from geometry import compile_plan, parse_instance, validate_pairing
from geometry.builders import ViewSpec, instance_body

TPB = 2
HT = 4 * 2  # bytes of one head of one token


def pair(ctx_layout: str, gen_layout: str, ctx: dict[str, Any], gen: dict[str, Any], **kw: Any):
    heads = kw.pop("heads", 8)
    dtype = kw.pop("dtype", "bfloat16")
    head_dim = kw.pop("head_dim", 4)
    out = []
    for role, layout, opts in (("context", ctx_layout, ctx), ("generation", gen_layout, gen)):
        views = [ViewSpec("target", 2, heads, head_dim, layout, dtype)]
        raw = instance_body(role=role, views=views, tokens_per_block=TPB, num_slots=8, **opts)
        out.append(parse_instance(raw, role[:3]))
    return out


BLOCKS = ([3, 0, 5], [1, 6, 2])


def test_hnd_to_nhd_same_split_is_one_strided_run_per_layer_buffer_and_head(oracle) -> None:
    ctx, gen = pair("HND", "NHD", {"tp": 1}, {"tp": 1}, heads=2)
    report = validate_pairing(ctx, gen)
    assert report.compatible, report.to_dict()
    (warning,) = [w for w in report.warnings if w.code == "layout_conversion"]
    assert warning.detail["fragments_per_block_layer_buffer"] == 2 * TPB
    assert (warning.detail["local"], warning.detail["peer"]) == ("NHD", "HND")
    plan = compile_plan(ctx, gen)
    (route,) = plan.routes
    rows = [row for segment in route.segments for row in segment.runs.tolist()]
    # buffer bytes 2 heads × 2 tokens × 8 = 32; HND head h at 16h, token step 8;
    # NHD head h at 8h, token step 16
    assert rows[:2] == [[0, 0, HT, TPB, HT, 2 * HT], [16, HT, HT, TPB, HT, 2 * HT]]
    assert len(rows) == 2 * 2 * 2  # layers × buffers × heads
    oracle.check_transfer(ctx, gen, BLOCKS)


@pytest.mark.parametrize(
    ("ctx_layout", "gen_layout", "ctx_tp", "gen_tp", "heads"),
    [
        ("HND", "NHD", 4, 2, 8),
        ("NHD", "HND", 2, 4, 8),
        ("NHD", "HND", 8, 2, 4),  # duplication on the sender
        ("HND", "NHD", 2, 8, 4),  # duplication on the receiver
        ("HND", "HND", 3, 2, 6),  # 3 shards → 2: no divisibility
        ("NHD", "NHD", 2, 3, 12),
        ("HND", "NHD", 3, 2, 12),
        ("NHD", "HND", 6, 4, 12),
        ("HND", "HND", 6, 3, 3),  # replicas of 3 shards → 3 ranks
    ],
)
def test_conversion_and_any_ratio_move_every_byte_once(
    oracle, ctx_layout, gen_layout, ctx_tp, gen_tp, heads
) -> None:
    ctx, gen = pair(ctx_layout, gen_layout, {"tp": ctx_tp}, {"tp": gen_tp}, heads=heads)
    report = validate_pairing(ctx, gen)
    assert report.compatible, report.to_dict()
    result = oracle.check_transfer(ctx, gen, BLOCKS)
    assert oracle.load_balance_violations(result.plan, ctx, gen) == []


def test_tp3_to_tp2_receiver_rank0_takes_heads_0_to_6_from_two_senders() -> None:
    ctx, gen = pair("HND", "HND", {"tp": 3}, {"tp": 2}, heads=12)
    plan = compile_plan(ctx, gen)
    slices = {(r.sender_rank, r.receiver_rank): r.slices[0]["global_heads"] for r in plan.routes}
    # context ranks hold [0,4) [4,8) [8,12); generation ranks [0,6) [6,12)
    assert slices == {(0, 0): [0, 4], (1, 0): [4, 6], (1, 1): [6, 8], (2, 1): [8, 12]}


def test_conversion_with_pipeline_and_attention_dp(oracle) -> None:
    ctx, gen = pair("NHD", "HND", {"tp": 2, "pp": 2}, {"tp": 4, "attention_dp": True})
    for dp in range(4):
        oracle.check_transfer(ctx, gen, BLOCKS, None, dp)


def test_sub_byte_conversion_pairs_on_head_token_bytes() -> None:
    # nvfp4, head_dim 2: one byte per head and token on both sides
    ctx, gen = pair("HND", "NHD", {"tp": 1}, {"tp": 2}, heads=2, dtype="nvfp4", head_dim=2)
    assert validate_pairing(ctx, gen).compatible


def test_conversion_refused_when_head_token_bytes_differ() -> None:
    ctx, gen = pair("HND", "NHD", {"tp": 1}, {"tp": 1}, heads=2)
    raw = instance_body(
        role="generation", views=[ViewSpec("target", 2, 2, 8, "NHD")], tokens_per_block=TPB
    )
    report = validate_pairing(ctx, parse_instance(raw, "gen"))
    (error,) = [e for e in report.errors if e.code == "head_geometry_mismatch"]
    assert (error.detail["field"], error.detail["local"], error.detail["peer"]) == (
        "head_token_bytes",
        16,
        8,
    )


def test_replicated_still_pairs_only_with_replicated() -> None:
    mla = [ViewSpec("target", 2, 1, 8, "REPLICATED", "bfloat16", True, True)]
    ctx = parse_instance(instance_body(role="context", views=mla, tokens_per_block=TPB), "ctx")
    raw = instance_body(
        role="generation", views=[ViewSpec("target", 2, 1, 8, "NHD", k_only=True)],
        tokens_per_block=TPB,
    )  # fmt: skip
    report = validate_pairing(ctx, parse_instance(raw, "gen"))
    assert "layout_mismatch" in report.codes()


# --- different tokens_per_block (HND): one large block pairs with r small ones ----------------


def ratio_pair(ctx_tpb: int, gen_tpb: int, ctx: dict[str, Any], gen: dict[str, Any], **kw: Any):
    heads = kw.pop("heads", 8)
    out = []
    for role, tpb, opts in (("context", ctx_tpb, ctx), ("generation", gen_tpb, gen)):
        views = [ViewSpec("target", kw.get("layers", 2), heads, 4, "HND")]
        raw = instance_body(role=role, views=views, tokens_per_block=tpb, num_slots=12, **opts)
        out.append(parse_instance(raw, role[:3]))
    return out


def test_ratio_template_is_one_strided_run_per_layer_buffer_and_sub_block() -> None:
    # context tpb 2 (small), generation tpb 8 (large, r = 4); 2 heads on both sides
    ctx, gen = ratio_pair(2, 8, {"tp": 1}, {"tp": 1}, heads=2, layers=1)
    plan = compile_plan(ctx, gen)
    (route,) = plan.routes
    assert (route.block_ratio, route.large_side) == (4, "generation")
    assert [s.sub_block for s in route.segments] == [0, 1, 2, 3]
    b = TPB * HT  # bytes of one head of one small block: 16; a large block holds 64 per head
    for sub, segment in enumerate(route.segments):
        # K then V: small buffers 2 × 16 = 32 bytes apart, large ones 2 × 64 = 128
        assert segment.runs.tolist() == [
            [0, sub * b, b, 2, b, 4 * b],
            [2 * b, 8 * b + sub * b, b, 2, b, 4 * b],
        ]
    assert plan.to_dict()["generation_tokens_per_block"] == 8


@pytest.mark.parametrize(
    ("ctx_tpb", "gen_tpb", "ctx_tp", "gen_tp", "heads"),
    [
        (2, 8, 1, 1, 2),
        (8, 2, 1, 1, 2),
        (2, 4, 4, 2, 8),  # finer sender, larger receiver blocks
        (6, 2, 2, 4, 8),  # coarser sender, larger sender blocks (r = 3)
        (2, 16, 8, 2, 4),  # duplication on the sender, r = 8
        (4, 2, 3, 2, 6),  # shard counts that do not divide
        (2, 4, 2, 8, 4),  # duplication on the receiver
    ],
)
@pytest.mark.parametrize(
    "blocks",
    [
        ([3, 0, 5, 7, 1, 2, 9, 10], [4, 6, 11]),
        ([1, 2], [0, 3, 4, 5, 6, 7, 8, 9, 10, 11]),
        ([0], [0]),  # the small side has less than one large block: nothing moves
    ],
)
def test_block_size_ratio_moves_every_byte_once(
    oracle, ctx_tpb, gen_tpb, ctx_tp, gen_tp, heads, blocks
) -> None:
    ctx, gen = ratio_pair(ctx_tpb, gen_tpb, {"tp": ctx_tp}, {"tp": gen_tp}, heads=heads)
    report = validate_pairing(ctx, gen)
    assert report.compatible, report.to_dict()
    assert "tokens_per_block_ratio" in {w.code for w in report.warnings}
    # the fewest tokens both lists hold: the longer side's last block holds one token
    num_tokens = max((len(blocks[0]) - 1) * ctx_tpb, (len(blocks[1]) - 1) * gen_tpb) + 1
    for tokens in (num_tokens, num_tokens + 1):
        result = oracle.check_transfer(ctx, gen, blocks, num_tokens=tokens)
        assert oracle.load_balance_violations(result.plan, ctx, gen) == []


def test_ratio_pairs_small_blocks_by_token_position_from_the_start(oracle) -> None:
    # small 2, large 8 (r = 4), 13 tokens: context small blocks 0..6 (the last holds token 12
    # only), generation large blocks 7 (tokens 0-7) and 8 (tokens 8-12 of 8-15)
    ctx, gen = ratio_pair(2, 8, {"tp": 1}, {"tp": 1})
    result = oracle.check_transfer(ctx, gen, ([0, 1, 2, 3, 4, 5, 6], [7, 8]), num_tokens=13)
    parts = [part for route in result.expansion.routes for part in route.parts]
    assert [p.segment.sub_block for p in parts] == [0, 1, 2, 2, 3]
    assert [(p.src_blocks.tolist(), p.dst_blocks.tolist()) for p in parts] == [
        ([0, 4], [7, 8]), ([1, 5], [7, 8]), ([2], [7]), ([6], [8]), ([3], [7])
    ]  # fmt: skip
    whole, tail = parts[2], parts[3]
    assert (tail.segment.runs[:, 2] * 2 == whole.segment.runs[:, 2]).all()  # 1 of 2 tokens


def test_ratio_with_pipeline_and_attention_dp(oracle) -> None:
    ctx, gen = ratio_pair(8, 2, {"tp": 2, "pp": 2}, {"tp": 4, "attention_dp": True})
    for dp in range(4):
        oracle.check_transfer(
            ctx, gen, ([1, 2, 3], [0, 4, 5, 6, 7, 8, 9, 10, 11]), None, dp, num_tokens=18
        )


def test_ratio_plan_round_trips() -> None:
    from geometry import Plan

    ctx, gen = ratio_pair(8, 2, {"tp": 2}, {"tp": 1})
    plan = compile_plan(ctx, gen)
    data = plan.to_dict()
    assert Plan.from_dict(data).to_dict() == data
    assert Plan.from_dict(data).block_ratio == (4, "context")
