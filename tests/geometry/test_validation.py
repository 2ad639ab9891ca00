"""Pairing validation: every error and warning code, with its detail fields."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from geometry import GeometryError, compile_plan, parse_instance, validate_pairing
from geometry.builders import ViewSpec, instance_body


def spec(owner: str = "target", layers: int = 2, heads: int = 8, **kw: Any) -> ViewSpec:
    return ViewSpec(owner, layers, heads, kw.pop("head_dim", 4), **kw)


def body(role: str, views=None, **kw: Any) -> dict[str, Any]:
    kw.setdefault("tokens_per_block", 2)
    kw.setdefault("num_slots", 4)
    return instance_body(role=role, views=views or [spec()], **kw)


def validate(ctx_body: dict[str, Any], gen_body: dict[str, Any]):
    return validate_pairing(parse_instance(ctx_body, "ctx"), parse_instance(gen_body, "gen"))


def only(issues, code: str) -> dict[str, Any]:
    found = [issue for issue in issues if issue.code == code]
    assert len(found) == 1, [issue.to_dict() for issue in issues]
    return found[0].detail


def edit_views(raw: dict[str, Any], **fields: Any) -> dict[str, Any]:
    for rank in raw["ranks"]:
        for view in rank["views"]:
            view.update(fields)
    return raw


def test_compatible_pairing_has_no_findings() -> None:
    report = validate(body("context", tp=4), body("generation", tp=2))
    assert report.compatible and report.errors == () and report.warnings == ()
    assert report.to_dict() == {"compatible": True, "errors": [], "warnings": []}


def test_missing_peer_view_for_target_layers_is_an_error() -> None:
    report = validate(body("context", [spec(layers=2)]), body("generation", [spec(layers=4)], pp=2))
    assert not report.compatible
    detail = only(report.errors, "missing_peer_view")
    assert detail["layers"] == [2, 3]
    assert detail["generation_ranks"] == [1]
    assert (detail["owner"], detail["roles"], detail["view"]) == (
        "target",
        ["key", "value"],
        "target[key,value]@pool0",
    )
    assert only(report.warnings, "layer_count_mismatch")["only_generation"] == [2, 3]
    with pytest.raises(GeometryError) as refused:
        compile_plan(
            parse_instance(body("context", [spec(layers=2)]), "ctx"),
            parse_instance(body("generation", [spec(layers=4)], pp=2), "gen"),
        )
    assert refused.value.code == "incompatible"
    assert refused.value.problems[0].message.startswith("missing_peer_view")


def test_missing_peer_view_for_draft_layers_is_a_warning_and_not_transferred(oracle) -> None:
    views = [spec(), spec("draft", layers=1, heads=2)]
    ctx = parse_instance(body("context", [spec()], tp=2), "ctx")
    gen = parse_instance(body("generation", views, tp=2), "gen")
    report = validate_pairing(ctx, gen)
    assert report.compatible
    detail = only(report.warnings, "missing_peer_view")
    assert (detail["owner"], detail["layers"], detail["generation_ranks"]) == ("draft", [2], [0, 1])
    plan = compile_plan(ctx, gen)
    assert [w["code"] for w in plan.warnings] == ["missing_peer_view"]
    assert "not transferred" in plan.warnings[0]["message"]
    assert all(s["owner"] == "target" for r in plan.routes for s in r.slices)
    oracle.check_transfer(ctx, gen, ([0, 1], [2, 3]))  # draft bytes must stay unwritten


def test_missing_peer_view_names_the_roles_the_context_has() -> None:
    k_only = ViewSpec("target", 2, 8, 4, k_only=True)
    report = validate(body("context", [k_only]), body("generation"))
    detail = only(report.errors, "missing_peer_view")
    assert detail["roles"] == ["key", "value"]
    assert "[['key']]" in [i for i in report.errors if i.code == "missing_peer_view"][0].message


def test_misplaced_peer_view_when_only_the_other_owner_holds_the_layer() -> None:
    # context: 3 target layers; generation: 2 target layers + layer 2 as a draft layer
    ctx = body("context", [spec(layers=3)])
    gen = body("generation", [spec(layers=2), spec("draft", layers=1)])
    report = validate(ctx, gen)
    detail = only(report.errors, "misplaced_peer_view")
    assert detail["layers"] == [2]
    assert detail["owner"] == "draft"
    assert detail["peer_views"] == ["target[key,value]@pool0"]
    assert detail["generation_ranks"] == [0]


def test_ambiguous_peer_view_when_two_context_stages_hold_a_layer() -> None:
    ctx = body("context", [spec(layers=2)], pp=2)
    stage1 = ctx["ranks"][1]
    size = stage1["views"][0]["buffers"][0]["size"]
    stage1["views"][0]["buffers"] += [
        {"layer": 0, "offset": size * 2, "size": size},
        {"layer": 0, "offset": size * 3, "size": size},
    ]
    stage1["pools"][0]["slot_bytes"] = stage1["pools"][0]["slot_stride_bytes"] = size * 4
    report = validate(ctx, body("generation", [spec(layers=2)]))
    detail = only(report.errors, "ambiguous_peer_view")
    assert (detail["layers"], detail["stages"], detail["generation_ranks"]) == ([0], [0, 1], [0])


def test_layout_mismatch() -> None:
    replicated = [spec(layout="REPLICATED", replicated=True)]
    report = validate(body("context", tp=2), body("generation", replicated, tp=2))
    detail = only(report.errors, "layout_mismatch")
    assert (detail["field"], detail["local"], detail["peer"]) == ("layout", "REPLICATED", "HND")
    assert (detail["generation_ranks"], detail["context_ranks"]) == ([0, 1], [0, 1])
    assert (detail["receiver_view"], detail["sender_view"]) == (0, 0)
    assert detail["layers"] == [0, 1]


def test_dtype_mismatch() -> None:
    report = validate(body("context", [spec(dtype="float16")]), body("generation"))
    detail = only(report.errors, "dtype_mismatch")
    assert (detail["field"], detail["local"], detail["peer"]) == ("dtype", "bfloat16", "float16")
    assert [i.code for i in report.errors] == ["dtype_mismatch"]  # same bytes: nothing else


def test_head_dim_mismatch_with_equal_bytes() -> None:
    ctx = edit_views(body("context"), head_dim=8)  # bytes still say head_dim 4
    report = validate(ctx, body("generation"))
    detail = only(report.errors, "head_dim_mismatch")
    assert (detail["field"], detail["local"], detail["peer"]) == ("head_dim", 4, 8)
    assert report.codes() == ["head_dim_mismatch"]


def test_buffers_per_layer_mismatch() -> None:
    ctx = body("context", [ViewSpec("target", 2, 8, 4, k_only=True)])
    edit_views(ctx, roles=["key", "value"])  # K/V roles but one buffer per layer
    report = validate(ctx, body("generation"))
    detail = only(report.errors, "buffers_per_layer_mismatch")
    assert (detail["field"], detail["local"], detail["peer"]) == ("buffers", 2, 1)


def test_head_count_mismatch() -> None:
    # 8 heads over TP2 and 4 heads over TP1 hold 4 heads of 16 bytes per rank: only H differs
    report = validate(body("context", [spec(heads=8)], tp=2), body("generation", [spec(heads=4)]))
    detail = only(report.errors, "head_count_mismatch")
    assert (detail["field"], detail["local"], detail["peer"]) == ("total_kv_heads", 4, 8)
    assert detail["context_ranks"] == [0, 1]


def test_head_geometry_mismatch_bytes_per_head() -> None:
    ctx = edit_views(body("context", [spec(head_dim=4)]), head_dim=None)
    gen = edit_views(body("generation", [spec(head_dim=8)]), head_dim=None)
    report = validate(ctx, gen)
    detail = only(report.errors, "head_geometry_mismatch")
    assert (detail["field"], detail["local"], detail["peer"]) == ("bytes_per_head", 32, 16)


def test_shard_counts_that_do_not_divide_each_other_pair_by_range_intersection() -> None:
    report = validate(
        body("context", [spec(heads=6)], tp=3), body("generation", [spec(heads=6)], tp=2)
    )
    assert report.compatible, report.to_dict()


def test_head_geometry_mismatch_nhd_head_token_bytes() -> None:
    ctx = edit_views(body("context", [spec(layout="NHD", dtype="float16")]), dtype="x")
    gen = edit_views(body("generation", [spec(layout="NHD", dtype="float32")]), dtype="x")
    detail = only(validate(ctx, gen).errors, "head_geometry_mismatch")
    assert (detail["field"], detail["local"], detail["peer"]) == ("head_token_bytes", 16, 8)


def test_head_geometry_mismatch_replicated_region() -> None:
    mla = ViewSpec("target", 1, 1, 8, "REPLICATED", "bfloat16", True, True)
    mla_wide = ViewSpec("target", 1, 1, 16, "REPLICATED", "bfloat16", True, True)
    ctx = edit_views(body("context", [mla]), head_dim=None)
    gen = edit_views(body("generation", [mla_wide]), head_dim=None)
    detail = only(validate(ctx, gen).errors, "head_geometry_mismatch")
    assert (detail["field"], detail["local"], detail["peer"]) == ("size", 64, 32)


def test_layer_group_mismatch() -> None:
    gen = body("generation")
    gen["ranks"][0]["pools"][0]["layer_group"] = 1
    detail = only(validate(body("context"), gen).errors, "layer_group_mismatch")
    assert (detail["field"], detail["local"], detail["peer"]) == ("layer_group", 1, 0)


@pytest.mark.parametrize(
    ("ctx_tpb", "gen_tpb", "larger"), [(2, 8, "generation"), (6, 2, "context")]
)
def test_tokens_per_block_ratio_is_a_warning_for_hnd(ctx_tpb, gen_tpb, larger) -> None:
    report = validate(
        body("context", tokens_per_block=ctx_tpb), body("generation", tokens_per_block=gen_tpb)
    )
    assert report.compatible, report.to_dict()
    detail = only(report.warnings, "tokens_per_block_ratio")
    assert (detail["field"], detail["local"], detail["peer"]) == ("tokens_per_block", gen_tpb,
                                                                   ctx_tpb)  # fmt: skip
    assert (detail["ratio"], detail["larger_side"]) == (max(ctx_tpb, gen_tpb) // 2, larger)


def test_tokens_per_block_not_a_multiple() -> None:
    report = validate(body("context", tokens_per_block=4), body("generation", tokens_per_block=6))
    detail = only(report.errors, "tokens_per_block_mismatch")
    assert (detail["field"], detail["local"], detail["peer"]) == ("tokens_per_block", 6, 4)
    assert detail["reasons"] == ["not_a_multiple"]
    assert "6 is not a multiple of 4" in report.errors[0].message
    assert not report.warnings


@pytest.mark.parametrize(
    ("layout", "shown"),
    [("NHD", "NHD"), ("MLA", "REPLICATED")],
)
def test_tokens_per_block_ratio_refused_for_non_hnd_views(layout, shown) -> None:
    view = (
        spec(heads=1, layout="REPLICATED", k_only=True, replicated=True)
        if layout == "MLA"
        else spec(layout=layout)
    )
    report = validate(
        body("context", [view], tokens_per_block=2),
        body("generation", [view], tokens_per_block=4),
    )
    detail = only(report.errors, "tokens_per_block_mismatch")
    assert detail["reasons"] == ["layout"]
    assert detail["non_hnd_views"] == [
        f"context target[key]@pool0 ({shown})" if layout == "MLA" else
        f"context target[key,value]@pool0 ({shown})",
        f"generation target[key]@pool0 ({shown})" if layout == "MLA" else
        f"generation target[key,value]@pool0 ({shown})",
    ]  # fmt: skip
    assert "HND views only" in next(e.message for e in report.errors)


@pytest.mark.parametrize("side", ["context", "generation"])
def test_tokens_per_block_must_be_equal_with_context_parallelism(side) -> None:
    ctx = body("context", tokens_per_block=2, cp=2 if side == "context" else 1)
    gen = body("generation", tokens_per_block=4, cp=2 if side == "generation" else 1)
    report = validate(ctx, gen)
    detail = only(report.errors, "tokens_per_block_mismatch")
    assert detail["reasons"] == ["context_parallel"]
    assert f"{side} cp=2" in next(e.message for e in report.errors)


def test_tokens_per_block_mismatch_names_every_reason_and_other_errors() -> None:
    ctx = body("context", [spec(layout="NHD")], tokens_per_block=4, cp=2)
    gen = body("generation", [spec(layout="NHD", dtype="float16")], tokens_per_block=6)
    report = validate(ctx, gen)
    detail = only(report.errors, "tokens_per_block_mismatch")
    assert detail["reasons"] == ["not_a_multiple", "context_parallel", "layout"]
    assert "dtype_mismatch" in report.codes()


def test_instance_not_ready() -> None:
    ctx = body("context", tp=4)
    del ctx["ranks"][1]
    del ctx["ranks"][2]  # ranks 0 and 2 reported, 1 and 3 did not
    report = validate(ctx, body("generation"))
    detail = only(report.errors, "instance_not_ready")
    assert (detail["instance"], detail["missing_ranks"], detail["missing_count"]) == (
        "ctx",
        [1, 3],
        2,
    )


def test_role_mismatch() -> None:
    report = validate(body("generation"), body("generation"))
    detail = only(report.errors, "role_mismatch")
    assert (detail["field"], detail["expected"], detail["actual"]) == (
        "role",
        "context",
        "generation",
    )


def test_model_mismatch_only_when_both_sides_name_one() -> None:
    report = validate(body("context", model="llama-a"), body("generation", model="llama-b"))
    detail = only(report.errors, "model_mismatch")
    assert (detail["field"], detail["local"], detail["peer"]) == ("model", "llama-b", "llama-a")
    assert validate(body("context", model="llama-a"), body("generation")).compatible


def test_context_parallel_both_sides() -> None:
    report = validate(body("context", cp=2), body("generation", cp=4))
    detail = only(report.errors, "context_parallel_both_sides")
    assert (detail["field"], detail["local"], detail["peer"]) == ("cp", 4, 2)
    assert validate(body("context", cp=2), body("generation")).compatible


def test_draft_layer_count_mismatch() -> None:
    ctx = body("context", [spec(), spec("draft", layers=1, heads=2)])
    gen = body("generation", [spec(), spec("draft", layers=2, heads=2)])
    report = validate(ctx, gen)
    detail = only(report.errors, "draft_layer_count_mismatch")
    assert (detail["field"], detail["local"], detail["peer"]) == ("draft_layers", 2, 1)
    # the generation's second draft layer has no context view; the context has draft layers,
    # so that is an error too (only a drafter on the generation side alone is a warning)
    assert only(report.errors, "missing_peer_view")["layers"] == [3]
    assert not [w for w in report.warnings if w.code == "missing_peer_view"]


def test_layer_count_mismatch_is_a_warning() -> None:
    report = validate(body("context", [spec(layers=3)]), body("generation", [spec(layers=2)]))
    assert report.compatible
    detail = only(report.warnings, "layer_count_mismatch")
    assert (detail["local"], detail["peer"], detail["only_context"]) == (2, 3, [2])


def test_nhd_head_slicing_is_a_warning() -> None:
    nhd = [spec(layout="NHD")]
    report = validate(body("context", nhd, tp=4), body("generation", nhd, tp=2))
    assert report.compatible
    detail = only(report.warnings, "nhd_head_slicing")
    assert (detail["fragments_per_token"], detail["fragments_per_block_layer_buffer"]) == (2, 4)
    assert detail["generation_ranks"] == [0, 1] and detail["context_ranks"] == [0, 1, 2, 3]


def test_all_errors_are_collected() -> None:
    ctx = edit_views(body("context", [spec(dtype="float16")], model="m1"), head_dim=8)
    report = validate(ctx, body("generation", model="m2"))
    assert sorted(report.codes()) == ["dtype_mismatch", "head_dim_mismatch", "model_mismatch"]
    with pytest.raises(GeometryError) as refused:
        compile_plan(
            parse_instance(ctx, "ctx"), parse_instance(body("generation", model="m2"), "gen")
        )
    assert len(refused.value.problems) == 3


def test_findings_on_many_ranks_are_merged_into_one() -> None:
    report = validate(body("context", tp=8), body("generation", [spec(dtype="float16")], tp=4))
    (issue,) = report.errors
    assert issue.detail["generation_ranks"] == [0, 1, 2, 3]
    assert issue.detail["context_ranks"] == list(range(8))


def test_every_dp_combination_is_validated() -> None:
    # generation dp rank 1 is fine, but every dp rank is checked: both are reported together
    ctx = body("context", tp=2, attention_dp=True)
    gen = body("generation", tp=2, attention_dp=True)
    assert validate(copy.deepcopy(ctx), copy.deepcopy(gen)).compatible
    gen["ranks"][1]["views"][0]["dtype"] = "float16"
    detail = only(validate(ctx, gen).errors, "dtype_mismatch")
    assert detail["generation_ranks"] == [1] and detail["context_ranks"] == [0, 1]
