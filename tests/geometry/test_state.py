"""Per-request recurrent state (Mamba/SSM conv + SSM state), judged byte by byte by the oracle.

Shapes: a 4-layer hybrid (layer 1 attends, layers 0, 2, 3 are recurrent); conv sections
``(x, B, C) = (24, 12, 12)`` channels × ``(d_conv − 1) = 1`` × 2 bytes, i.e. TP-aggregated
``S = (48, 24, 24)`` bytes; 12 SSM heads of ``head_dim 2 × d_state 2 × 4`` = 16 bytes. Everything
divides over state axes 1, 2, 3, 4, 6 and 12.
"""

from __future__ import annotations

from typing import Any

import pytest

from geometry import GeometryError, Plan, compile_plan, expand, parse_instance
from geometry import validate_pairing as validate
from geometry.state_builders import HybridSpec, hybrid_body

from .conftest import HYBRID_SPEC

SPEC = HYBRID_SPEC
KV_BLOCKS = ([3, 0, 5], [1, 6, 2])


def hybrid(role: str, spec: HybridSpec = SPEC, **kw: Any):
    kw.setdefault("tokens_per_block", 2)
    kw.setdefault("num_slots", 8)
    kw.setdefault("state_slots", 4)
    return parse_instance(hybrid_body(role=role, spec=spec, **kw), role[:3])


def pair(ctx: dict[str, Any], gen: dict[str, Any], spec: HybridSpec = SPEC):
    return hybrid("context", spec, **ctx), hybrid("generation", spec, **gen)


@pytest.mark.parametrize(
    ("ctx_tp", "gen_tp"),
    [(4, 2), (2, 4), (1, 2), (2, 1), (3, 2), (2, 3), (4, 6), (2, 2), (1, 1)],
)
def test_hybrid_tp_ratios_move_every_state_and_kv_byte_exactly_once(oracle, ctx_tp, gen_tp):
    kv_heads = 12 if 3 in (ctx_tp, gen_tp) or 6 in (ctx_tp, gen_tp) else 4
    spec = HybridSpec(**{**SPEC.__dict__, "kv_heads": kv_heads})
    ctx, gen = pair({"tp": ctx_tp}, {"tp": gen_tp}, spec)
    report = validate(ctx, gen)
    assert report.compatible, report.to_dict()
    result = oracle.check_transfer(ctx, gen, {0: KV_BLOCKS, 1: ([2], [3])})
    plan = result.plan
    assert plan.state_groups == {1}
    state_bytes = 3 * (sum(SPEC.section_bytes) + 12 * 16)  # 3 recurrent layers, aggregated
    kv_bytes = 3 * 2 * kv_heads * 2 * 4 * 2  # 3 blocks × K/V × heads × tokens × dim × 2 B
    assert result.bytes == state_bytes + kv_bytes


def test_equal_state_axes_copy_each_layer_in_one_run(oracle) -> None:
    ctx, gen = pair({"tp": 2}, {"tp": 2})
    plan = compile_plan(ctx, gen)
    for route in plan.routes:
        (state,) = [s for s in route.segments if s.state]
        assert state.layer_group == 1
        assert len(state.runs) == 1  # conv + ssm of all 3 layers are contiguous on both sides


def test_sectioned_tp4_to_tp2_cuts_one_run_per_section(oracle) -> None:
    ctx, gen = pair({"tp": 4}, {"tp": 2})
    plan = compile_plan(ctx, gen)
    route = next(r for r in plan.routes if (r.sender_rank, r.receiver_rank) == (1, 0))
    conv = next(p for p in route.slices if p["roles"] == ["conv_state"])
    assert conv["layout"] == "SECTIONED"
    (state,) = [s for s in route.segments if s.state]
    # sender rank 1 of 4 holds x[12:24], B[6:12], C[6:12] (12 + 6 + 6 bytes); receiver 0 of 2
    # holds x[0:24] at 0, B[0:12] at 24, C[0:12] at 36: the first layer's conv runs
    rows = state.runs.tolist()
    assert [0, 12, 12, 1, 0, 0] in rows
    assert [12, 24 + 6, 6, 1, 0, 0] in rows
    assert [18, 36 + 6, 6, 1, 0, 0] in rows
    oracle.check_transfer(ctx, gen, {0: KV_BLOCKS, 1: ([0], [1])})


def test_ssm_heads_duplicated_over_the_state_axis_are_sent_once_and_balanced(oracle) -> None:
    spec = HybridSpec(**{**SPEC.__dict__, "ssm_heads": 2, "conv_channels": (24, 12, 12)})
    ctx, gen = pair({"tp": 4}, {"tp": 1}, spec)  # 2 SSM heads over 4 ranks: 2 replicas each
    result = oracle.check_transfer(ctx, gen, {0: KV_BLOCKS, 1: ([1], [0])})
    assert oracle.load_balance_violations(result.plan, ctx, gen) == []


def test_helix_generation_shards_state_over_tp_times_cp(oracle) -> None:
    ctx, gen = pair({"tp": 2}, {"tp": 2, "cp": 2})
    assert oracle.state_axis(gen, 3) == (4, 3)
    plan = compile_plan(ctx, gen)
    # one state slot per generation CP rank, or the same slot on all of them
    oracle.check_transfer(ctx, gen, {0: KV_BLOCKS, 1: ([2], [[1], [3]])}, plan=plan)
    oracle.check_transfer(ctx, gen, {0: KV_BLOCKS, 1: ([2], [1])}, plan=plan)


def test_attention_dp_holds_whole_state_on_each_dp_rank(oracle) -> None:
    ctx, gen = pair({"tp": 2, "attention_dp": True}, {"tp": 2})
    assert oracle.state_axis(ctx, 1) == (1, 0)
    for dp in (0, 1):
        oracle.check_transfer(ctx, gen, {0: KV_BLOCKS, 1: ([3], [0])}, context_dp_rank=dp)
    ctx, gen = pair({"tp": 4}, {"tp": 2, "attention_dp": True})
    result = oracle.check_transfer(ctx, gen, {0: KV_BLOCKS, 1: ([3], [0])}, generation_dp_rank=1)
    assert {r.receiver_rank for r in result.plan.routes} == {1}


def test_pipeline_stages_split_attention_and_state_layers(oracle) -> None:
    ctx, gen = pair({"tp": 2, "pp": 2}, {"tp": 1})  # stage 0: layers 0, 1; stage 1: 2, 3
    assert oracle.check_transfer(ctx, gen, {0: KV_BLOCKS, 1: ([1], [2])}).bytes > 0
    ctx, gen = pair({"tp": 1}, {"tp": 2, "pp": 2, "pp_split": [1, 3]})  # stage 0: no attention
    oracle.check_transfer(ctx, gen, {0: KV_BLOCKS, 1: ([1], [2])})


def test_an_empty_state_list_moves_no_state(oracle) -> None:
    ctx, gen = pair({"tp": 2}, {"tp": 1})
    full = oracle.check_transfer(ctx, gen, {0: KV_BLOCKS, 1: ([1], [2])})
    for state in (([], [2]), ([1], [])):
        kv_only = oracle.check_transfer(ctx, gen, {0: KV_BLOCKS, 1: state})
        assert full.bytes - kv_only.bytes == 3 * (sum(SPEC.section_bytes) + 12 * 16)


@pytest.mark.parametrize(
    ("state", "where"),
    [
        (([1, 2], [0]), ["blocks", "1", "context"]),
        (([1], [0, 3]), ["blocks", "1", "generation"]),
        (([1], [[0], [1]]), ["blocks", "1", "generation"]),  # nested without CP
    ],
)
def test_wrong_slot_counts_are_invalid_blocks(state, where) -> None:
    ctx, gen = pair({"tp": 2}, {"tp": 1})
    plan = compile_plan(ctx, gen)
    with pytest.raises(GeometryError) as caught:
        expand(plan, {0: KV_BLOCKS, 1: state})
    (problem,) = caught.value.problems
    assert problem.code == "invalid_blocks"
    assert list(problem.loc) == where
    assert "state" in problem.message


def test_helix_slot_lists_must_name_one_slot_per_cp_rank() -> None:
    ctx, gen = pair({"tp": 1}, {"tp": 1, "cp": 2})
    plan = compile_plan(ctx, gen)
    for bad in ([[0], [1], [2]], [[0, 1], [2]], [[0], []]):
        with pytest.raises(GeometryError) as caught:
            expand(plan, {0: KV_BLOCKS, 1: ([1], bad)})
        assert caught.value.code == "invalid_blocks"
    with pytest.raises(GeometryError) as caught:
        expand(plan, {0: KV_BLOCKS, 1: ([9], [1])})
    assert caught.value.code == "block_out_of_range"


def test_state_plans_round_trip_and_are_never_equal_split(oracle) -> None:
    ctx, gen = pair({"tp": 2}, {"tp": 1})
    plan = compile_plan(ctx, gen)
    again = Plan.from_dict(plan.to_dict())
    assert again.state_groups == {1}
    blocks = {0: KV_BLOCKS, 1: ([1], [2])}
    assert expand(again, blocks).to_fragments() == expand(plan, blocks).to_fragments()
    (receiver,) = plan.receivers
    assert len(receiver.writers) == 2 and not receiver.equal_split_safe
    assert all(
        seg["state"] == (seg["layer_group"] == 1)
        for route in plan.to_dict()["routes"]
        for seg in route["segments"]
    )


# ---------------------------------------------------------------------------------------------
# validation: every error, with stable codes and both values


def _body(role: str, spec: HybridSpec = SPEC, **kw: Any) -> dict[str, Any]:
    kw.setdefault("tokens_per_block", 2)
    kw.setdefault("num_slots", 8)
    kw.setdefault("state_slots", 4)
    return hybrid_body(role=role, spec=spec, **kw)


def _views(body: dict[str, Any], roles: list[str]) -> list[dict[str, Any]]:
    return [v for r in body["ranks"] for v in r["views"] if v["roles"] == roles]


def test_state_mismatches_are_all_reported_with_codes_and_both_values() -> None:
    ctx = _body("context", tp=2)
    gen = _body("generation", tp=1)
    for view in _views(gen, ["conv_state"]):  # same aggregated bytes, other sections
        view["section_bytes"] = [56, 20, 20]
    for view in _views(ctx, ["ssm_state"]):
        view["d_state"] = 4
        view["dtype"] = "float16"
        view["head_dim"] = None
    report = validate(parse_instance(ctx, "c"), parse_instance(gen, "g"))
    codes = sorted(set(report.codes()))
    assert codes == ["d_state_mismatch", "dtype_mismatch", "section_bytes_mismatch"]
    (sections,) = [e for e in report.errors if e.code == "section_bytes_mismatch"]
    assert sections.detail["local"] == [56, 20, 20] and sections.detail["peer"] == [48, 24, 24]
    assert sections.detail["sections"] == [0, 1, 2]
    assert sections.detail["layers"] == [0, 2, 3]
    assert sections.detail["context_ranks"] == [0, 1]


def test_aggregated_bytes_section_count_and_ssm_heads_differ() -> None:
    ctx = _body("context", tp=2)
    other = HybridSpec(**{**SPEC.__dict__, "ssm_heads": 6, "conv_channels": (24, 24)})
    gen = _body("generation", other, tp=2)
    report = validate(parse_instance(ctx, "c"), parse_instance(gen, "g"))
    by_code = {}
    for issue in report.errors:
        by_code.setdefault(issue.code, []).append(issue)
    assert set(by_code) == {"section_count_mismatch", "state_bytes_mismatch", "head_count_mismatch"}
    # the conv sections differ in count, not in aggregated bytes (96 both): only the SSM does
    aggregated = {
        e.detail["view"]: (e.detail["local"], e.detail["peer"])
        for e in by_code["state_bytes_mismatch"]
    }
    assert aggregated == {"target[ssm_state]@pool1": (6 * 16, 12 * 16)}
    assert by_code["section_count_mismatch"][0].detail["local"] == 2


def test_state_on_one_side_only_is_an_error() -> None:
    from geometry.builders import ViewSpec, instance_body

    plain = instance_body(role="context", views=[ViewSpec("target", 4, 4, 4)], tokens_per_block=2)
    report = validate(parse_instance(plain, "c"), hybrid("generation"))
    codes = set(report.codes())
    assert "state_group_mismatch" in codes
    (issue,) = [e for e in report.errors if e.code == "state_group_mismatch"]
    assert issue.detail["side"] == "generation" and issue.detail["state_layer_groups"] == [1]
    with pytest.raises(GeometryError):
        compile_plan(parse_instance(plain, "c"), hybrid("generation"))


def test_a_group_that_is_state_on_one_side_and_paged_on_the_other_is_refused() -> None:
    ctx = _body("context", tp=1)
    gen = _body("generation", tp=1)
    ctx["layer_groups"] = [{"id": 0, "tokens_per_slot": 2}, {"id": 1, "tokens_per_slot": None}]
    # the generation side keeps its SSM view in a paged group 2 (as if state were paged)
    for rank in gen["ranks"]:
        for view in rank["views"]:
            if view["roles"] == ["conv_state"]:
                view["pool"] = 2
                view["layout"] = "HND"
                view.pop("section_bytes")
                view["num_kv_heads"] = view["total_kv_heads"] = 1
        conv = [v for v in rank["views"] if v["pool"] == 2]
        size = conv[0]["buffers"][0]["size"]
        for i, buffer in enumerate(conv[0]["buffers"]):
            buffer["offset"] = i * size
        rank["pools"].append({"id": 2, "layer_group": 2, "slot_bytes": 3 * size, "num_slots": 4})
    report = validate(parse_instance(ctx, "c"), parse_instance(gen, "g"))
    kinds = [e for e in report.errors if e.code == "state_group_mismatch"]
    assert kinds and kinds[0].detail["local"] == "paged"
    assert kinds[0].detail["peer"] == "per-request state"


# ---------------------------------------------------------------------------------------------
# registration: bad state bodies are refused with every problem and its field


def _problems(body: dict[str, Any]) -> list[tuple[str, str, str]]:
    with pytest.raises(GeometryError) as caught:
        parse_instance(body, "x")
    return [(".".join(map(str, p.loc)), p.code, p.message) for p in caught.value.problems]


def test_sectioned_views_need_state_groups_and_dividing_sections() -> None:
    body = _body("context", tp=2)
    body["layer_groups"] = [{"id": 1, "tokens_per_slot": None}]
    rank = body["ranks"][0]
    conv, ssm = rank["views"][1], rank["views"][2]
    conv["section_bytes"] = [47, 25, 24]
    ssm["num_kv_heads"] = 5
    problems = _problems(body)
    assert ("ranks.0.views.1.section_bytes.0", "state_geometry_invalid") in {
        (loc, code) for loc, code, _ in problems
    }
    assert ("ranks.0.views.2.num_kv_heads", "head_count_mismatch") in {
        (loc, code) for loc, code, _ in problems
    }
    body = _body("context", tp=1)
    body["layer_groups"] = [{"id": 1, "tokens_per_slot": 2}]  # state group declared paged
    ((loc, code, message),) = _problems(body)
    assert (loc, code) == ("ranks.0.views.1.layout", "state_geometry_invalid")
    assert "tokens_per_slot null" in message


@pytest.mark.parametrize(
    ("change", "where", "code"),
    [
        (
            lambda b: b["layer_groups"].append({"id": 1, "tokens_per_slot": None}),
            "layer_groups.2.id",
            "invalid_page_table",
        ),
        (
            lambda b: b["layer_groups"].__setitem__(0, {"id": 0, "tokens_per_slot": 16}),
            "layer_groups.0.tokens_per_slot",
            "invalid_page_table",
        ),
        (
            lambda b: b["layer_groups"][1].pop("tokens_per_slot"),
            "layer_groups.1.tokens_per_slot",
            "invalid_page_table",
        ),
        (
            lambda b: b["ranks"][0]["views"][2].__setitem__("layout", "NHD"),
            "ranks.0.views.2.layout",
            "state_geometry_invalid",
        ),
        (
            lambda b: b["ranks"][0]["views"][1].pop("section_bytes"),
            "ranks.0.views.1.section_bytes",
            "invalid_page_table",
        ),
        (
            lambda b: b["ranks"][0]["views"][2].__setitem__("section_bytes", [4]),
            "ranks.0.views.2.section_bytes",
            "invalid_page_table",
        ),
        (
            lambda b: [x.__setitem__("size", 40) for x in b["ranks"][0]["views"][1]["buffers"]],
            "ranks.0.views.1.buffers.0.size",
            "state_geometry_invalid",
        ),
        (
            lambda b: b["ranks"][0]["views"][2].__setitem__("d_state", 3),
            "ranks.0.views.2.buffers.0.size",
            "head_geometry_invalid",
        ),
        (
            lambda b: [
                b["ranks"][0]["views"][2].pop(k) for k in ("num_kv_heads", "total_kv_heads")
            ],
            "ranks.0.views.2.num_kv_heads",
            "head_count_missing",
        ),
    ],
)
def test_bad_state_bodies_name_their_field(change, where, code) -> None:
    body = _body("context", tp=1)
    change(body)
    problems = _problems(body)
    assert (where, code) in {(loc, c) for loc, c, _ in problems}, problems


def test_a_layer_paged_on_one_sender_rank_and_state_on_another_is_refused() -> None:
    from geometry.builders import ViewSpec, instance_body

    views = [ViewSpec("target", 2, 8, 4)]
    ctx = instance_body(role="context", views=views, tp=2, tokens_per_block=2)
    ctx["layer_groups"] = [{"id": 1, "tokens_per_slot": None}]
    ctx["ranks"][0]["pools"][0]["layer_group"] = 1  # rank 0 keeps the K/V as per-request state
    gen = instance_body(role="generation", views=views, tp=1, tokens_per_block=2)
    context, generation = parse_instance(ctx, "c"), parse_instance(gen, "g")
    report = validate(context, generation)
    kinds = [e for e in report.errors if e.code == "state_group_mismatch"]
    assert any(e.detail.get("context_ranks") == [0] for e in kinds), report.to_dict()
    with pytest.raises(GeometryError):
        compile_plan(context, generation)


def test_the_docstring_example_of_a_sectioned_tp4_to_tp2_route() -> None:
    spec = HybridSpec(**{**SPEC.__dict__, "conv_channels": (48, 24, 24)})  # S = (96, 48, 48)
    ctx, gen = pair({"tp": 4}, {"tp": 2}, spec)
    route = next(
        r for r in compile_plan(ctx, gen).routes if (r.sender_rank, r.receiver_rank) == (1, 0)
    )
    (state,) = [s for s in route.segments if s.state]
    first_layer = [row[:3] for row in state.runs.tolist()[:3]]
    assert first_layer == [[0, 24, 24], [24, 60, 12], [36, 84, 12]]
