"""Explicit numeric plans: concrete parallelism, concrete byte offsets, checked by hand and oracle.

Shapes are tiny on purpose so the numbers can be read off: ``head_dim = 4`` in bfloat16 and
``tokens_per_block = 2`` give ``bytes_per_head = 2 × 4 × 2 = 16`` (HND).
"""

from __future__ import annotations

import copy

import pytest

from geometry import (
    GeometryError,
    Plan,
    Route,
    Segment,
    compile_plan,
    expand,
    parse_instance,
    view_geometry,
)
from geometry.builders import ViewSpec, instance_body

TPB = 2
BPH = TPB * 4 * 2  # bytes per head of a head_dim-4 bfloat16 HND buffer


def spec(owner: str = "target", layers: int = 2, heads: int = 8, **kw) -> ViewSpec:
    return ViewSpec(owner, layers, heads, kw.pop("head_dim", 4), **kw)


def body(role: str, views, **kw):
    kw.setdefault("tokens_per_block", TPB)
    kw.setdefault("num_slots", 8)
    return instance_body(role=role, views=views, **kw)


def pair(ctx_views, gen_views=None, ctx=None, gen=None):
    ctx_body = body("context", ctx_views, **(ctx or {}))
    gen_body = body("generation", gen_views or ctx_views, **(gen or {}))
    return parse_instance(ctx_body, "ctx"), parse_instance(gen_body, "gen")


def route(plan, sender: int, receiver: int) -> Route:
    (found,) = [r for r in plan.routes if (r.sender_rank, r.receiver_rank) == (sender, receiver)]
    return found


def runs(r: Route) -> list[list[int]]:
    return [row for segment in r.segments for row in segment.runs.tolist()]


def receiver(plan, rank: int):
    (found,) = [r for r in plan.receivers if r.rank == rank]
    return found


BLOCKS = ([3, 0, 5], [1, 6, 2])


def test_tp4_to_tp2_context_rank1_writes_generation_rank0_at_head_offset_2(oracle) -> None:
    ctx, gen = pair([spec()], ctx={"tp": 4}, gen={"tp": 2})
    plan = compile_plan(ctx, gen)
    assert sorted((r.sender_rank, r.receiver_rank) for r in plan.routes) == [
        (0, 0),
        (1, 0),
        (2, 1),
        (3, 1),
    ]
    # context buffers hold 2 heads (32 bytes), generation buffers 4 heads (64 bytes):
    # rank 1's heads 2..3 land 2 heads (32 bytes) into each generation K and V buffer.
    assert runs(route(plan, 1, 0)) == [
        [0, 2 * BPH, 2 * BPH, 1, 0, 0],
        [32, 64 + 2 * BPH, 2 * BPH, 1, 0, 0],
        [64, 128 + 2 * BPH, 2 * BPH, 1, 0, 0],
        [96, 192 + 2 * BPH, 2 * BPH, 1, 0, 0],
    ]
    assert runs(route(plan, 0, 0)) == [
        [0, 0, 32, 1, 0, 0],
        [32, 64, 32, 1, 0, 0],
        [64, 128, 32, 1, 0, 0],
        [96, 192, 32, 1, 0, 0],
    ]
    (piece,) = route(plan, 1, 0).slices
    assert piece["global_heads"] == [2, 4]
    assert piece["sender_local_heads"] == [0, 2]
    assert piece["receiver_local_heads"] == [2, 4]
    assert route(plan, 3, 1).slices[0]["global_heads"] == [6, 8]
    r0 = receiver(plan, 0)
    assert r0.writers == (0, 1) and r0.staging_offsets == (0, 128) and r0.writer_bytes == (128, 128)
    assert r0.equal_split_safe is True
    oracle.check_transfer(ctx, gen, BLOCKS)


def test_tp8_with_four_heads_to_tp2_duplicate_pairs_split_the_layers(oracle) -> None:
    ctx, gen = pair([spec(heads=4)], ctx={"tp": 8}, gen={"tp": 2})
    # context: shards = 4, replicas = 2 → ranks (0,1) hold head 0, (2,3) head 1, ...
    assert [
        view_geometry(ctx, ctx.table(r), ctx.table(r).views[0]).head_range for r in range(8)
    ] == [(0, 1), (0, 1), (1, 2), (1, 2), (2, 3), (2, 3), (3, 4), (3, 4)]
    plan = compile_plan(ctx, gen)
    # each head's 2 layers are split over its 2 replicas: layer 0 from the even rank, layer 1
    # from the odd one (no replica sends more than ⌈total / replicas⌉)
    assert sorted((r.sender_rank, r.receiver_rank) for r in plan.routes) == [
        (0, 0),
        (1, 0),
        (2, 0),
        (3, 0),
        (4, 1),
        (5, 1),
        (6, 1),
        (7, 1),
    ]
    assert [route(plan, s, s // 4).slices[0]["layers"] for s in range(8)] == [[0], [1]] * 4
    assert receiver(plan, 0).writers == (0, 1, 2, 3)
    assert receiver(plan, 0).overlapping == (0, 1, 2, 3)
    # every overlapping rank writes the same bytes: the legacy equal split would be right
    assert receiver(plan, 0).equal_split_safe is True
    assert plan.to_dict()["receivers"][1]["writers"] == 4
    assert runs(route(plan, 2, 0))[0] == [0, BPH, BPH, 1, 0, 0]
    assert oracle.load_balance_violations(plan, ctx, gen) == []
    oracle.check_transfer(ctx, gen, BLOCKS)


def test_tp2_with_four_heads_to_tp8_source_head_per_receiver(oracle) -> None:
    ctx, gen = pair([spec(heads=4)], ctx={"tp": 2}, gen={"tp": 8})
    plan = compile_plan(ctx, gen)
    by_receiver = {r.receiver_rank: r for r in plan.routes}
    assert sorted(by_receiver) == list(range(8)) and len(plan.routes) == 8
    assert [by_receiver[g].sender_rank for g in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    source_heads = [by_receiver[g].slices[0]["sender_local_heads"][0] for g in range(8)]
    assert source_heads == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [by_receiver[g].slices[0]["global_heads"] for g in range(8)] == [
        [0, 1],
        [0, 1],
        [1, 2],
        [1, 2],
        [2, 3],
        [2, 3],
        [3, 4],
        [3, 4],
    ]
    # K of layer 0: source offset = local head × bytes_per_head, the whole 1-head receiver buffer
    assert [runs(by_receiver[g])[0][:3] for g in range(8)] == [
        [h * BPH, 0, BPH] for h in source_heads
    ]
    assert all(receiver(plan, g).equal_split_safe for g in range(8))
    oracle.check_transfer(ctx, gen, BLOCKS)


def test_tp1_with_eight_heads_to_tp8_each_receiver_one_head(oracle) -> None:
    ctx, gen = pair([spec(layers=1)], ctx={"tp": 1}, gen={"tp": 8})
    plan = compile_plan(ctx, gen)
    assert [runs(route(plan, 0, g)) for g in range(8)] == [
        [[g * BPH, 0, BPH, 1, 0, 0], [8 * BPH + g * BPH, BPH, BPH, 1, 0, 0]] for g in range(8)
    ]
    oracle.check_transfer(ctx, gen, BLOCKS)


def test_draft_view_with_two_heads_beside_eight_head_target_in_one_pool(oracle) -> None:
    views = [spec(layers=2, heads=8), spec("draft", layers=1, heads=2)]
    ctx, gen = pair(views, ctx={"tp": 2}, gen={"tp": 4})
    table = ctx.table(0)
    target, draft = table.views
    assert target.pool == draft.pool == 0
    assert view_geometry(ctx, table, draft).heads == 1  # not the target's 4
    assert view_geometry(gen, gen.table(3), gen.table(3).views[1]).head_range == (1, 2)
    plan = compile_plan(ctx, gen)
    # context target region: 2 layers × K,V × 4 heads × 16 bytes = 256; draft K at 256, V at 272
    drafts = {r.receiver_rank: [s for s in r.slices if s["owner"] == "draft"] for r in plan.routes}
    assert {g: [(s["global_heads"], s["sender_view"]) for s in d] for g, d in drafts.items()} == {
        0: [([0, 1], 1)],
        1: [([0, 1], 1)],
        2: [([1, 2], 1)],
        3: [([1, 2], 1)],
    }
    # context rank 0 → generation rank 1: target heads 2..3 of each 64-byte buffer (32 bytes),
    # then the whole 16-byte draft K and V buffers (context 256/272 → generation 128/144); the
    # last target run and both draft runs are contiguous on both sides and merge into one.
    assert runs(route(plan, 0, 1)) == [
        [32, 0, 32, 1, 0, 0],
        [96, 32, 32, 1, 0, 0],
        [160, 64, 32, 1, 0, 0],
        [224, 96, 32 + 16 + 16, 1, 0, 0],
    ]
    oracle.check_transfer(ctx, gen, BLOCKS)


def test_uneven_pipeline_30_10_against_20_20(oracle) -> None:
    views = [spec(layers=40, heads=2)]
    ctx, gen = pair(views, ctx={"pp": 2, "pp_split": [30, 10]}, gen={"pp": 2, "pp_split": [20, 20]})
    plan = compile_plan(ctx, gen)
    layers = {
        (r.sender_rank, r.receiver_rank): [s["layers"] for s in r.slices] for r in plan.routes
    }
    assert layers == {
        (0, 0): [list(range(0, 20))],
        (0, 1): [list(range(20, 30))],
        (1, 1): [list(range(30, 40))],
    }
    # the stage-0 → stage-0 copy is contiguous on both sides: one merged run of 20 layers
    assert runs(route(plan, 0, 0)) == [[0, 0, 20 * 2 * 2 * BPH, 1, 0, 0]]
    # context stage 0 holds layers 0..29: layer 20 starts at 20 × 64 bytes, generation stage 1 at 0
    assert runs(route(plan, 0, 1)) == [[20 * 64, 0, 10 * 64, 1, 0, 0]]
    assert runs(route(plan, 1, 1)) == [[0, 10 * 64, 10 * 64, 1, 0, 0]]
    assert receiver(plan, 1).writers == (0, 1)
    assert receiver(plan, 1).staging_offsets == (0, 640)
    # both writers carry 640 bytes, but two pipeline stages write: equal split is not safe
    assert receiver(plan, 1).equal_split_safe is False
    assert receiver(plan, 0).equal_split_safe is True
    oracle.check_transfer(ctx, gen, BLOCKS)


def test_attention_dp_context_sends_only_from_context_dp_rank_2(oracle) -> None:
    ctx, gen = pair([spec()], ctx={"tp": 4, "attention_dp": True}, gen={"tp": 2})
    # attention-DP: G = 1, every context rank holds all 8 heads (its own requests)
    assert view_geometry(ctx, ctx.table(2), ctx.table(2).views[0]).head_range == (0, 8)
    plan = compile_plan(ctx, gen, context_dp_rank=2)
    assert sorted((r.sender_rank, r.receiver_rank) for r in plan.routes) == [(2, 0), (2, 1)]
    assert {rank for side, rank, _ in plan.pools if side == "context"} == {2}
    assert route(plan, 2, 1).slices[0]["sender_local_heads"] == [4, 8]
    assert runs(route(plan, 2, 1))[0] == [4 * BPH, 0, 4 * BPH, 1, 0, 0]
    oracle.check_transfer(ctx, gen, BLOCKS, context_dp_rank=2)
    with pytest.raises(GeometryError) as missing:
        compile_plan(ctx, gen)
    assert missing.value.code == "dp_rank_required"
    with pytest.raises(GeometryError) as outside:
        compile_plan(ctx, gen, context_dp_rank=4)
    assert outside.value.code == "dp_rank_out_of_range"
    assert outside.value.problems[0].loc == ("context_dp_rank",)


def test_attention_dp_generation_receives_only_on_generation_dp_rank(oracle) -> None:
    ctx, gen = pair([spec()], ctx={"tp": 2}, gen={"tp": 4, "pp": 2, "attention_dp": True})
    plan = compile_plan(ctx, gen, generation_dp_rank=3)
    # generation rank = pp × 4 + tp: dp rank 3 is ranks 3 (stage 0) and 7 (stage 1)
    assert sorted({r.receiver_rank for r in plan.routes}) == [3, 7]
    assert [p.rank for p in plan.receivers] == [3, 7]
    oracle.check_transfer(ctx, gen, BLOCKS, generation_dp_rank=3)


def test_mla_replicated_k_only_views_copy_whole_regions_round_robin(oracle) -> None:
    mla = ViewSpec("target", 3, 1, 8, "REPLICATED", "bfloat16", k_only=True, replicated=True)
    ctx, gen = pair([mla], ctx={"tp": 4}, gen={"tp": 2})
    region = TPB * 8 * 2  # latent of 8 elements, bf16, per token
    assert [len(v.buffers_by_layer[0]) for v in ctx.table(0).views] == [1]
    plan = compile_plan(ctx, gen)
    # every context rank holds the whole latent cache; the 6 (receiver, layer) units are cut
    # into one contiguous chunk per holder: 2, 1, 2, 1 layers
    assert sorted((r.sender_rank, r.receiver_rank) for r in plan.routes) == [
        (0, 0),
        (1, 0),
        (2, 1),
        (3, 1),
    ]
    assert runs(route(plan, 0, 0)) == [[0, 0, 2 * region, 1, 0, 0]]  # 2 layers merged
    assert runs(route(plan, 1, 0)) == [[2 * region, 2 * region, region, 1, 0, 0]]
    assert route(plan, 3, 1).slices[0]["global_heads"] is None
    assert receiver(plan, 0).overlapping == (0, 1, 2, 3)
    oracle.check_transfer(ctx, gen, BLOCKS)


def test_mla_replicated_to_more_receivers_than_holders_is_balanced(oracle) -> None:
    mla = ViewSpec("target", 1, 1, 8, "REPLICATED", "bfloat16", k_only=True, replicated=True)
    ctx, gen = pair([mla], ctx={"tp": 2}, gen={"tp": 8})
    plan = compile_plan(ctx, gen)
    senders = [r.sender_rank for r in sorted(plan.routes, key=lambda r: r.receiver_rank)]
    assert senders == [0, 0, 0, 0, 1, 1, 1, 1]
    assert oracle.load_balance_violations(plan, ctx, gen) == []
    oracle.check_transfer(ctx, gen, BLOCKS)


def test_nhd_head_slicing_one_run_per_buffer_with_count_tokens_per_block(oracle) -> None:
    nhd = spec(layers=1, heads=2, layout="NHD")
    ctx, gen = pair(
        [nhd], ctx={"tp": 1, "tokens_per_block": 4}, gen={"tp": 2, "tokens_per_block": 4}
    )
    plan = compile_plan(ctx, gen)
    # context token row: 2 heads × 8 bytes = 16; generation token row: 1 head = 8 bytes
    assert runs(route(plan, 0, 1)) == [[8, 0, 8, 4, 16, 8], [64 + 8, 32, 8, 4, 16, 8]]
    assert runs(route(plan, 0, 0)) == [[0, 0, 8, 4, 16, 8], [64, 32, 8, 4, 16, 8]]
    assert plan.routes[0].segments[0].fragments_per_block == 2 * 4
    (warning,) = [w for w in plan.warnings if w["code"] == "nhd_head_slicing"]
    assert warning["detail"]["fragments_per_block_layer_buffer"] == 4
    expansion = expand(plan, {0: ([0, 1, 2], [0, 1, 2])})
    assert expansion.fragments == 2 * 3 * 2 * 4  # routes × blocks × buffers × tokens
    oracle.check_transfer(ctx, gen, BLOCKS)


def test_nhd_gathering_heads_warns_two_fragments_per_token(oracle) -> None:
    nhd = spec(layers=1, heads=2, layout="NHD")
    ctx, gen = pair([nhd], ctx={"tp": 2}, gen={"tp": 1})
    plan = compile_plan(ctx, gen)
    (warning,) = [w for w in plan.warnings if w["code"] == "nhd_head_slicing"]
    assert warning["detail"]["fragments_per_token"] == 2
    assert runs(route(plan, 1, 0)) == [[0, 8, 8, TPB, 8, 16], [16, 32 + 8, 8, TPB, 8, 16]]
    oracle.check_transfer(ctx, gen, BLOCKS)


def test_nhd_same_split_copies_whole_buffers_without_warning(oracle) -> None:
    nhd = spec(layers=2, heads=4, layout="NHD")
    ctx, gen = pair([nhd], ctx={"tp": 2}, gen={"tp": 2})
    plan = compile_plan(ctx, gen)
    assert runs(route(plan, 1, 1)) == [[0, 0, 4 * 2 * BPH, 1, 0, 0]]
    assert not plan.warnings
    oracle.check_transfer(ctx, gen, BLOCKS)


def test_prefix_caching_pairs_the_last_blocks_of_each_list(oracle) -> None:
    ctx, gen = pair([spec(layers=1, heads=1)])  # one 16-byte K and V buffer, stride 32
    plan = compile_plan(ctx, gen)
    # context has 4 blocks, generation cached the first one: pairs (1,7), (2,6), (3,0)
    rows = expand(plan, {0: ([5, 1, 2, 3], [7, 6, 0])}).routes[0].fragment_rows()
    assert rows.tolist() == [[0, 32, 0, 224, 32], [0, 64, 0, 192, 32], [0, 96, 0, 0, 32]]
    # generation has more blocks (context cached a prefix; 3 blocks of 2 tokens): only the
    # last one pairs
    rows = expand(plan, {0: ([4], [0, 1, 2])}, num_tokens=6).routes[0].fragment_rows()
    assert rows.tolist() == [[0, 128, 0, 64, 32]]
    oracle.check_transfer(ctx, gen, ([5, 1, 2, 3], [7, 6, 0]))
    oracle.check_transfer(ctx, gen, ([4], [0, 1, 2]), num_tokens=6)
    assert expand(plan, {0: ([], [1, 2])}).bytes == 0


def test_slot_stride_larger_than_slot_bytes_is_used_for_block_offsets(oracle) -> None:
    ctx_body = body("context", [spec(layers=1, heads=2)], tp=2)
    gen_body = body("generation", [spec(layers=1, heads=2)], tp=1)
    for rank in gen_body["ranks"]:
        rank["pools"][0]["slot_stride_bytes"] = 100
    ctx, gen = parse_instance(ctx_body, "ctx"), parse_instance(gen_body, "gen")
    plan = compile_plan(ctx, gen)
    rows = expand(plan, {0: ([2], [3])}).routes[1].fragment_rows()
    assert rows.tolist()[0] == [0, 2 * 32, 0, 3 * 100 + BPH, BPH]
    oracle.check_transfer(ctx, gen, BLOCKS)


def test_legacy_rank_wide_kv_heads_per_rank_gives_the_same_plan(oracle) -> None:
    ctx, gen = pair([spec()], ctx={"tp": 4}, gen={"tp": 2})
    legacy_ctx = parse_instance(body("context", [spec()], tp=4, legacy=True), "ctx")
    legacy_gen = parse_instance(body("generation", [spec()], tp=2, legacy=True), "gen")
    view = legacy_ctx.table(1).views[0]
    assert view.num_kv_heads is None and view.total_kv_heads is None
    assert view_geometry(legacy_ctx, legacy_ctx.table(1), view).head_range == (2, 4)
    assert compile_plan(legacy_ctx, legacy_gen).to_dict() == compile_plan(ctx, gen).to_dict()
    oracle.check_transfer(legacy_ctx, legacy_gen, BLOCKS)


def test_legacy_without_total_heads_assumes_no_duplication(oracle) -> None:
    raw = body("context", [spec()], tp=4, legacy=True)
    del raw["total_kv_heads"]
    ctx = parse_instance(raw, "ctx")
    geometry = view_geometry(ctx, ctx.table(3), ctx.table(3).views[0])
    assert (geometry.total_heads, geometry.heads, geometry.head_range) == (8, 2, (6, 8))


def test_rank_kv_heads_per_rank_overrides_the_instance_value() -> None:
    raw = body("context", [spec()], tp=4, legacy=True)
    raw["kv_heads_per_rank"] = 3  # wrong instance-wide value ...
    with pytest.raises(GeometryError) as wrong:
        parse_instance(copy.deepcopy(raw), "ctx")
    assert wrong.value.problems[0].code == "head_count_mismatch"
    for rank in raw["ranks"]:
        rank["kv_heads_per_rank"] = 2  # ... overridden per rank
    ctx = parse_instance(raw, "ctx")
    assert view_geometry(ctx, ctx.table(0), ctx.table(0).views[0]).heads == 2


def test_a_view_never_borrows_another_views_head_count(oracle) -> None:
    views = [spec(layers=1, heads=8), spec("draft", layers=1, heads=2)]
    raw = body("context", views, tp=2)
    del raw["kv_heads_per_rank"]
    for rank in raw["ranks"]:
        assert rank["views"][0]["num_kv_heads"] == 4
        del rank["views"][1]["num_kv_heads"]  # draft: only total_kv_heads = 2
    ctx = parse_instance(raw, "ctx")
    draft = ctx.table(1).views[1]
    geometry = view_geometry(ctx, ctx.table(1), draft)
    assert (geometry.heads, geometry.head_range) == (1, (1, 2))
    gen = parse_instance(body("generation", views, tp=1), "gen")
    oracle.check_transfer(ctx, gen, BLOCKS)


def test_equal_split_safe_for_plain_one_to_one(oracle) -> None:
    ctx, gen = pair([spec()], ctx={"tp": 2}, gen={"tp": 2})
    plan = compile_plan(ctx, gen)
    assert [(p.writers, p.equal_split_safe) for p in plan.receivers] == [((0,), True), ((1,), True)]
    oracle.check_transfer(ctx, gen, BLOCKS)


def test_equal_split_unsafe_when_writers_carry_different_bytes(oracle) -> None:
    # 3 layers over context PP 2 (2 + 1): the receiver gets 2 layers from one rank, 1 from the other
    ctx, gen = pair([spec(layers=3, heads=1)], ctx={"pp": 2, "pp_split": [2, 1]})
    plan = compile_plan(ctx, gen)
    (only,) = plan.receivers
    assert only.writers == (0, 1) and only.writer_bytes == (64, 32)
    assert only.staging_offsets == (0, 64)
    assert only.equal_split_safe is False
    oracle.check_transfer(ctx, gen, BLOCKS)


def test_two_layer_groups_use_their_own_block_lists(oracle) -> None:
    views = [spec(layers=2, heads=2), spec("draft", layers=1, heads=2)]

    def two_groups(role: str):
        raw = body(role, views, tp=1)
        rank = raw["ranks"][0]
        draft = rank["views"][1]
        shift = draft["buffers"][0]["offset"]
        for row in draft["buffers"]:
            row["offset"] -= shift
        draft["pool"] = 1
        rank["pools"][0]["slot_bytes"] = rank["pools"][0]["slot_stride_bytes"] = shift
        rank["pools"].append(
            {"id": 1, "layer_group": 1, "slot_bytes": 64, "slot_stride_bytes": 64, "num_slots": 4}
        )
        return parse_instance(raw, role[:3])

    ctx, gen = two_groups("context"), two_groups("generation")
    plan = compile_plan(ctx, gen)
    assert [(s.src_pool, s.dst_pool, s.layer_group) for s in plan.routes[0].segments] == [
        (0, 0, 0),
        (1, 1, 1),
    ]
    blocks = {0: ([4, 5, 6], [0, 1, 2]), 1: ([3, 2], [0, 1])}
    oracle.check_transfer(ctx, gen, blocks)
    only_group_1 = expand(plan, {0: ([], []), 1: ([3], [0])})
    assert only_group_1.bytes == 64


def test_plan_round_trips_through_to_dict(oracle) -> None:
    views = [spec(layers=3, heads=4), spec("draft", layers=1, heads=2)]
    ctx, gen = pair(views, ctx={"tp": 8, "pp": 2, "pp_split": [1, 2]}, gen={"tp": 2})
    plan = compile_plan(ctx, gen)
    data = plan.to_dict()
    rebuilt = Plan.from_dict(data)
    assert rebuilt.to_dict() == data
    blocks = {0: ([1, 2], [3, 4])}
    assert expand(rebuilt, blocks).to_fragments() == expand(plan, blocks).to_fragments()
    assert compile_plan(ctx, gen).to_dict() == data


def test_oracle_rejects_a_corrupted_plan(oracle) -> None:
    """The oracle itself can fail: shifted, dropped and duplicated runs are all caught."""
    ctx, gen = pair([spec()], ctx={"tp": 4}, gen={"tp": 2})
    plan = compile_plan(ctx, gen)

    def with_routes(routes):
        return Plan(
            plan.context,
            plan.generation,
            None,
            None,
            plan.tokens_per_block,
            tuple(routes),
            plan.receivers,
            plan.warnings,
            plan.pools,
        )

    def shifted(r: Route, delta: int) -> Route:
        segment = r.segments[0]
        moved = segment.runs.copy()
        moved[0, 1] += delta
        return Route(
            r.sender_rank,
            r.receiver_rank,
            (Segment(segment.src_pool, segment.dst_pool, segment.layer_group, moved),),
            r.slices,
        )

    corrupted = [
        with_routes([shifted(plan.routes[0], 1), *plan.routes[1:]]),
        with_routes([shifted(plan.routes[0], BPH), *plan.routes[1:]]),  # a whole head off
        with_routes(plan.routes[1:]),
        with_routes([*plan.routes, plan.routes[0]]),
    ]
    for bad in corrupted:
        with pytest.raises(AssertionError):
            oracle.check_transfer(ctx, gen, BLOCKS, plan=bad)


def test_replicas_share_a_shard_split_over_receiver_pipeline_stages(oracle) -> None:
    # context TP4 with 2 heads: ranks (0,1) both hold head 0, (2,3) head 1. Generation TP2 × PP2:
    # head 0 is needed by rank 0 (layers 0..1) and rank 2 (layers 2..3), 64 bytes per block each.
    views = [spec(layers=4, heads=2)]
    ctx, gen = pair(views, ctx={"tp": 4}, gen={"tp": 2, "pp": 2})
    plan = compile_plan(ctx, gen)
    oracle.check_transfer(ctx, gen, BLOCKS)  # correct bytes, only the balance is off
    sent = {rank: 0 for rank in range(4)}
    for r in plan.routes:
        sent[r.sender_rank] += r.bytes_per_block
    # 128 bytes of each shard per block over 2 holders: no holder may send more than 64
    assert sent == {0: 64, 1: 64, 2: 64, 3: 64}  # today {0: 128, 1: 0, 2: 128, 3: 0}


def test_plan_does_not_depend_on_the_order_ranks_reported() -> None:
    views = [spec(layers=3, heads=4), spec("draft", layers=1, heads=2)]
    ctx_body = body("context", views, tp=8, pp=2, pp_split=[1, 2])
    gen_body = body("generation", views, tp=2, pp=2, pp_split=[2, 1])
    plan = compile_plan(parse_instance(ctx_body, "ctx"), parse_instance(gen_body, "gen"))
    ctx_body["ranks"].reverse()
    gen_body["ranks"] = gen_body["ranks"][1::2] + gen_body["ranks"][::2]
    again = compile_plan(parse_instance(ctx_body, "ctx"), parse_instance(gen_body, "gen"))
    assert again.to_dict() == plan.to_dict()


def test_interleaved_pipeline_stages_fill_alternate_layers(oracle) -> None:
    # virtual pipeline: context stage 0 holds layers 0 and 2, stage 1 holds 1 and 3
    ctx_body = body("context", [spec(layers=4, heads=4)], tp=4, pp=2)
    relabel = {0: 0, 1: 2, 2: 1, 3: 3}
    for rank in ctx_body["ranks"]:
        for row in rank["views"][0]["buffers"]:
            row["layer"] = relabel[row["layer"]]
    ctx = parse_instance(ctx_body, "ctx")
    gen = parse_instance(body("generation", [spec(layers=4, heads=4)], tp=2), "gen")
    plan = compile_plan(ctx, gen)
    # context rank 4 (stage 1, heads 0..1) writes layers 1 and 3 of generation rank 0:
    # generation buffers are 32 bytes (2 heads), layer 1 K at 64, layer 3 K at 192
    assert runs(route(plan, 4, 0)) == [
        [0, 64, 16, 1, 0, 0],
        [16, 96, 16, 1, 0, 0],
        [32, 192, 16, 1, 0, 0],
        [48, 224, 16, 1, 0, 0],
    ]
    oracle.check_transfer(ctx, gen, BLOCKS)
