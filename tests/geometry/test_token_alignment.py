"""Block lists aligned by token position (``num_tokens``), draft layers compared like target
layers, and per-view head counts that only imply their duplication.

Each of the first five groups is a case that moved wrong bytes, or refused a valid pair, when
block lists were aligned from their ends: the byte oracle (``conftest.py``) says which bytes a
receiver must get, and that nothing past the prompt is written.
"""

from __future__ import annotations

from typing import Any

import pytest

from geometry import GeometryError, compile_plan, expand, parse_instance, validate_pairing
from geometry.builders import ViewSpec, instance_body


def kv(heads: int = 4, layers: int = 2, **kw: Any) -> ViewSpec:
    return ViewSpec("target", layers, heads, 4, **kw)


def build(role: str, views: list[ViewSpec], tokens_per_block: int, **kw: Any):
    kw.setdefault("num_slots", 40)
    raw = instance_body(role=role, views=views, tokens_per_block=tokens_per_block, **kw)
    return parse_instance(raw, role[:3])


def two_groups(role: str, tokens_per_block: int, **kw: Any):
    """Layer 0 full attention (group 0), layer 1 sliding window (group 1)."""
    raw = instance_body(role=role, views=[kv()], tokens_per_block=tokens_per_block, num_slots=24,
                        **kw)  # fmt: skip
    for rank in raw["ranks"]:
        (pool,) = rank["pools"]
        rank["pools"] = [pool, dict(pool, id=1, layer_group=1)]
        (view,) = rank["views"]
        rank["views"] = [
            dict(view, pool=g, buffers=[b for b in view["buffers"] if b["layer"] == g])
            for g in (0, 1)
        ]
    return parse_instance(raw, role[:3])


# --- 1. block-size ratio with a partial last block ----------------------------------------------


def test_ratio_16_to_4_with_a_20_token_prompt_writes_g0_to_g4_with_tokens_0_to_19(oracle) -> None:
    ctx, gen = build("context", [kv()], 16), build("generation", [kv()], 4)
    # context C0 = tokens 0-15 (slot 5), C1 = 16-19 (slot 6); generation G0..G4 = slots 10..14
    result = oracle.check_transfer(ctx, gen, ([5, 6], [10, 11, 12, 13, 14]), num_tokens=20)
    parts = [p for route in result.expansion.routes for p in route.parts if p.src_blocks.size]
    pairs = sorted(
        (int(s), int(d), p.segment.sub_block)
        for p in parts
        for s, d in zip(p.src_blocks, p.dst_blocks, strict=True)
    )
    assert pairs == [(5, 10, 0), (5, 11, 1), (5, 12, 2), (5, 13, 3), (6, 14, 0)]
    # 20 tokens × 4 heads × 4 dims × 2 bytes × K/V × 2 layers: nothing past token 19
    assert result.bytes == 20 * 4 * 4 * 2 * 2 * 2


@pytest.mark.parametrize("num_tokens", [17, 18, 19, 20, 21, 31, 32])
@pytest.mark.parametrize(("ctx_tpb", "gen_tpb"), [(16, 4), (4, 16), (8, 2), (2, 8)])
def test_ratio_partial_last_block_moves_exactly_the_tokens_that_exist(
    oracle, ctx_tpb: int, gen_tpb: int, num_tokens: int
) -> None:
    ctx, gen = build("context", [kv()], ctx_tpb), build("generation", [kv()], gen_tpb)
    n_ctx, n_gen = -(-num_tokens // ctx_tpb), -(-num_tokens // gen_tpb)
    blocks = (list(range(n_ctx)), list(range(10, 10 + n_gen)))
    result = oracle.check_transfer(ctx, gen, blocks, num_tokens=num_tokens)
    assert result.bytes == num_tokens * 4 * 4 * 2 * 2 * 2  # every prompt token, no more


def test_ratio_without_num_tokens_is_refused_with_the_rule() -> None:
    ctx, gen = build("context", [kv()], 16), build("generation", [kv()], 4)
    plan = compile_plan(ctx, gen)
    with pytest.raises(GeometryError) as error:
        expand(plan, {0: ([5, 6], [10, 11, 12, 13, 14])})
    assert error.value.code == "ambiguous_alignment"
    assert "num_tokens" in error.value.problems[0].message
    assert expand(plan, {0: ([], [10])}).bytes == 0  # nothing to move: nothing to place


def test_ratio_warning_says_transfers_align_by_token_position() -> None:
    ctx, gen = build("context", [kv()], 16), build("generation", [kv()], 4)
    (warning,) = [w for w in validate_pairing(ctx, gen).warnings
                  if w.code == "tokens_per_block_ratio"]  # fmt: skip
    assert "token position" in warning.message and "num_tokens" in warning.message
    assert "end at the same token" not in warning.message


# --- 2. context parallelism with a sliding-window group -----------------------------------------


def test_window_group_under_context_cp_is_read_from_the_cp_rank_of_its_request_index(
    oracle,
) -> None:
    # 4 blocks of 2 tokens; the window group keeps only logical block 3 (CP rank 1 of 2)
    ctx, gen = two_groups("context", 2, cp=2), two_groups("generation", 2)
    blocks = {0: ([0, 1, 2, 3], [10, 11, 12, 13]), 1: ([7], [17])}
    result = oracle.check_transfer(ctx, gen, blocks, num_tokens=8)
    senders = {
        route.route.sender_rank
        for route in result.expansion.routes
        for p in route.parts
        if p.segment.layer_group == 1 and p.src_blocks.size
    }
    assert senders == {1}  # rank = cp_rank here (tp 1): CP rank 1 holds block 3


def test_window_group_under_helix_cp_accepts_per_rank_lists_and_writes_rank_1(oracle) -> None:
    ctx, gen = two_groups("context", 2), two_groups("generation", 2, cp=2)
    blocks = {0: ([0, 1, 2, 3], [[10, 12], [11, 13]]), 1: ([7], [[], [17]])}
    result = oracle.check_transfer(ctx, gen, blocks, num_tokens=8)
    receivers = {
        route.route.receiver_rank
        for route in result.expansion.routes
        for p in route.parts
        if p.segment.layer_group == 1 and p.dst_blocks.size
    }
    assert receivers == {1}
    # a flat generation list for the window group goes to the same rank
    oracle.check_transfer(ctx, gen, {0: blocks[0], 1: ([7], [17])}, num_tokens=8)


def test_cp_groups_of_different_lengths_without_num_tokens_are_refused() -> None:
    ctx, gen = two_groups("context", 2, cp=2), two_groups("generation", 2)
    with pytest.raises(GeometryError) as error:
        expand(compile_plan(ctx, gen), {0: ([0, 1, 2, 3], [10, 11, 12, 13]), 1: ([7], [17])})
    assert error.value.code == "ambiguous_alignment"
    assert "mod 2" in error.value.problems[0].message


def test_cp_single_group_with_both_lists_omitting_a_prefix_follows_num_tokens(oracle) -> None:
    ctx, gen = build("context", [kv()], 2), build("generation", [kv()], 2, cp=2)
    # 5 blocks; both sides reused blocks 0..1: logical 2, 3, 4 on CP ranks 0, 1, 0
    result = oracle.check_transfer(ctx, gen, ([2, 3, 4], [12, 13, 14]), num_tokens=10)
    per_rank = {
        route.route.receiver_rank: sorted(int(b) for p in route.parts for b in p.dst_blocks)
        for route in result.expansion.routes
    }
    assert per_rank == {0: [12, 14], 1: [13]}


# --- 3. draft layers are compared like target layers --------------------------------------------


def _with_draft(role: str, draft: ViewSpec, first_draft_layer: int | None = None):
    raw = instance_body(role=role, views=[kv(), draft], tokens_per_block=2, num_slots=8)
    if first_draft_layer is not None:
        for rank in raw["ranks"]:
            for row in rank["views"][1]["buffers"]:
                row["layer"] = first_draft_layer
    return parse_instance(raw, role[:3])


def test_draft_layers_numbered_differently_are_refused() -> None:
    draft = ViewSpec("draft", 1, 2, 4)
    ctx, gen = _with_draft("context", draft, 4), _with_draft("generation", draft, 5)
    report = validate_pairing(ctx, gen)
    assert not report.compatible
    (error,) = [e for e in report.errors if e.code == "draft_layer_mismatch"]
    assert (error.detail["local"], error.detail["peer"]) == ([5], [4])
    assert "missing_peer_view" in {e.code for e in report.errors}
    assert "missing_peer_view" not in {w.code for w in report.warnings}
    with pytest.raises(GeometryError):
        compile_plan(ctx, gen)


def test_draft_layers_with_other_head_geometry_are_refused() -> None:
    ctx = _with_draft("context", ViewSpec("draft", 1, 2, 4))
    gen = _with_draft("generation", ViewSpec("draft", 1, 2, 8))
    report = validate_pairing(ctx, gen)
    assert "head_dim_mismatch" in {e.code for e in report.errors}


def test_a_drafter_on_the_generation_side_alone_is_only_a_warning() -> None:
    ctx = build("context", [kv()], 2)
    gen = _with_draft("generation", ViewSpec("draft", 1, 2, 4))
    report = validate_pairing(ctx, gen)
    assert report.compatible
    (warning,) = [w for w in report.warnings if w.code == "missing_peer_view"]
    assert "no draft layers" in warning.message


# --- 4. a generation list longer than the context's ---------------------------------------------


def test_generation_list_longer_than_the_contexts_is_refused_without_num_tokens() -> None:
    # 16 tokens in 4 context blocks; the generation allocated 5 (one ahead for decoding)
    ctx, gen = build("context", [kv()], 4), build("generation", [kv()], 4)
    plan = compile_plan(ctx, gen)
    blocks = {0: ([0, 1, 2, 3], [10, 11, 12, 13, 14])}
    for num_tokens in (None, 16):
        with pytest.raises(GeometryError) as error:
            expand(plan, blocks, num_tokens)
        assert error.value.code == "invalid_blocks"
        assert error.value.problems[0].loc[:3] == ("blocks", "0", "generation")


def test_generation_list_longer_than_the_contexts_is_exact_with_num_tokens(oracle) -> None:
    # the context reused blocks 0..1 of a 16-token request: its list starts at block 2
    ctx, gen = build("context", [kv()], 4), build("generation", [kv()], 4)
    result = oracle.check_transfer(ctx, gen, ([2, 3], [10, 11, 12, 13]), num_tokens=16)
    pairs = [
        (int(s), int(d))
        for route in result.expansion.routes
        for p in route.parts
        for s, d in zip(p.src_blocks, p.dst_blocks, strict=True)
    ]
    assert pairs == [(2, 12), (3, 13)]


# --- 5. per-view head counts without a total ----------------------------------------------------


def _draft_without_total(role: str, tp: int, keep_total: bool):
    raw = instance_body(
        role=role, views=[kv(heads=8), ViewSpec("draft", 1, 2, 4)], tp=tp, tokens_per_block=2,
        num_slots=8,
    )  # fmt: skip
    if not keep_total:
        for rank in raw["ranks"]:
            del rank["views"][1]["total_kv_heads"]
    return parse_instance(raw, role[:3])


def test_duplication_is_derived_from_per_view_counts_as_trtllm_does() -> None:
    # a 2-head draft: context TP 8 holds 1 head per rank (4 replicas each), generation TP 2
    # holds 1 head per rank; neither gives total_kv_heads
    ctx = _draft_without_total("context", 8, keep_total=False)
    gen = _draft_without_total("generation", 2, keep_total=False)
    report = validate_pairing(ctx, gen)
    assert report.compatible, report.to_dict()
    stated = compile_plan(
        _draft_without_total("context", 8, True), _draft_without_total("generation", 2, True)
    )
    assert compile_plan(ctx, gen).to_dict()["routes"] == stated.to_dict()["routes"]


def test_head_counts_no_duplication_explains_are_refused_naming_total_kv_heads() -> None:
    # generation TP 2 with 3 heads per rank: 6 heads; context TP 8 with 1 per rank: no total
    # over 8 ranks gives 1 head per rank and matches 6
    ctx = _draft_without_total("context", 8, keep_total=False)
    raw = instance_body(
        role="generation", views=[kv(heads=8), ViewSpec("draft", 1, 6, 4)], tp=2,
        tokens_per_block=2, num_slots=8,
    )  # fmt: skip
    for rank in raw["ranks"]:
        del rank["views"][1]["total_kv_heads"]
    report = validate_pairing(ctx, parse_instance(raw, "gen"))
    (error,) = {e.code: e for e in report.errors if e.code == "head_count_mismatch"}.values()
    assert "total_kv_heads" in error.message
