"""Per-request state together with a block-size ratio (``tokens_per_block`` differs by ``r``).

State groups have no token axis, so a ratio never applies to them: a hybrid pair whose paged
(attention) groups page ``r×`` more tokens on one side plans the paged group with per-sub-block
templates and ``[n, r]`` alignment, and the state group exactly as with equal block sizes (one
slot pair per request, ``sub_block = 0``). State views (SECTIONED conv state, HND SSM heads) never
count as the non-HND views that refuse a ratio; NHD attention views, CP, or sizes that are not
multiples still refuse it with ``tokens_per_block_mismatch`` and its reasons.
"""

from __future__ import annotations

from typing import Any

import pytest

from geometry import Plan, compile_plan, expand, parse_instance
from geometry import validate_pairing as validate
from geometry.state_builders import hybrid_body

from .conftest import HYBRID_SPEC

SPEC = HYBRID_SPEC
STATE_BYTES = 3 * (sum(SPEC.section_bytes) + 12 * 16)  # 3 recurrent layers, TP-aggregated


def body(role: str, tpb: int, **kw: Any) -> dict[str, Any]:
    kw.setdefault("num_slots", 16)
    kw.setdefault("state_slots", 4)
    return hybrid_body(role=role, spec=SPEC, tokens_per_block=tpb, **kw)


def pair(ctx_tpb: int, gen_tpb: int, ctx: dict[str, Any], gen: dict[str, Any]):
    return (
        parse_instance(body("context", ctx_tpb, **ctx), "ctx"),
        parse_instance(body("generation", gen_tpb, **gen), "gen"),
    )


# (context tpb, generation tpb, context kw, generation kw, paged block lists)
CASES = [
    (8, 2, {"tp": 2}, {"tp": 1}, ([3, 0, 5], [1, 6, 2, 7, 9, 10, 11, 12, 13])),
    (2, 8, {"tp": 1}, {"tp": 2}, ([1, 6, 2, 7, 9, 10, 11, 12, 13], [3, 0, 5])),
    (4, 2, {"tp": 4}, {"tp": 2}, ([3, 0, 5, 4], [1, 6, 2, 7, 9, 10, 11])),
    (2, 6, {"tp": 2}, {"tp": 4}, ([1, 6, 2, 7, 9, 10, 11, 12], [3, 0, 5])),
    (8, 2, {"tp": 2, "attention_dp": True}, {"tp": 1}, ([3, 0], [1, 6, 2, 7, 9, 10, 11, 12])),
    (2, 4, {"tp": 1, "pp": 2}, {"tp": 2}, ([1, 6, 2, 7, 9], [3, 0, 5])),
]


@pytest.mark.parametrize(("ctx_tpb", "gen_tpb", "ctx_kw", "gen_kw", "paged"), CASES)
def test_hybrid_with_a_block_size_ratio_moves_every_state_and_kv_byte_once(
    oracle, ctx_tpb, gen_tpb, ctx_kw, gen_kw, paged
):
    ctx, gen = pair(ctx_tpb, gen_tpb, ctx_kw, gen_kw)
    report = validate(ctx, gen)
    assert report.compatible, report.to_dict()
    codes = {w["code"]: w for w in report.to_dict()["warnings"]}
    ratio = max(ctx_tpb, gen_tpb) // min(ctx_tpb, gen_tpb)
    assert codes["tokens_per_block_ratio"]["detail"]["ratio"] == ratio
    dp = 0 if ctx_kw.get("attention_dp") else None
    # the prompt ends one token into the last block of the side whose lists reach furthest
    num_tokens = max((len(paged[0]) - 1) * ctx_tpb, (len(paged[1]) - 1) * gen_tpb) + 1
    result = oracle.check_transfer(
        ctx, gen, {0: paged, 1: ([2], [3])}, context_dp_rank=dp, num_tokens=num_tokens
    )
    plan = result.plan
    assert plan.state_groups == {1}
    assert plan.block_ratio == (ratio, "context" if ctx_tpb > gen_tpb else "generation")
    for route in plan.routes:
        subs = {(s.layer_group, s.state): set() for s in route.segments}
        for s in route.segments:
            subs[(s.layer_group, s.state)].add(s.sub_block)
        assert subs.get((1, True), {0}) == {0}  # state: one segment set, never a sub-block
        assert subs.get((0, False), set(range(ratio))) == set(range(ratio))
    # tokens moved: from the later of the two lists' first tokens to the prompt's end
    starts = [
        (-(-num_tokens // tpb) - len(ids)) * tpb
        for ids, tpb in ((paged[0], ctx_tpb), (paged[1], gen_tpb))
    ]
    tokens = num_tokens - max(starts)
    kv_bytes = 2 * SPEC.kv_heads * tokens * SPEC.head_dim * 2  # K/V × heads × tokens × dim × 2 B
    assert result.bytes == STATE_BYTES + kv_bytes


def test_an_empty_state_list_with_a_ratio_moves_only_kv(oracle) -> None:
    ctx, gen = pair(8, 2, {"tp": 2}, {"tp": 1})
    paged = ([3, 0, 5], [1, 6, 2, 7, 9, 10, 11, 12, 13])
    full = oracle.check_transfer(ctx, gen, {0: paged, 1: ([2], [3])}, num_tokens=17)
    kv_only = oracle.check_transfer(ctx, gen, {0: paged, 1: ([2], [])}, num_tokens=17)
    assert full.bytes - kv_only.bytes == STATE_BYTES


def test_state_views_never_refuse_a_ratio_but_nhd_attention_views_do() -> None:
    bodies = [body("context", 8, tp=2), body("generation", 2, tp=1)]
    for rank in bodies[1]["ranks"]:
        for view in rank["views"]:
            if view["roles"] == ["key", "value"]:
                view["layout"] = "NHD"
    ctx, gen = (parse_instance(b, b["role"][:3]) for b in bodies)
    errors = {e["code"]: e for e in validate(ctx, gen).to_dict()["errors"]}
    detail = errors["tokens_per_block_mismatch"]["detail"]
    assert detail["reasons"] == ["layout"]
    assert detail["non_hnd_views"] and all("NHD" in v for v in detail["non_hnd_views"])
    assert not any("SECTIONED" in v or "state" in v for v in detail["non_hnd_views"])


@pytest.mark.parametrize(
    ("ctx_tpb", "gen_tpb", "ctx_kw", "gen_kw", "reasons"),
    [
        (4, 6, {"tp": 1}, {"tp": 1}, ["not_a_multiple"]),
        (8, 2, {"tp": 2}, {"tp": 1, "cp": 2}, ["context_parallel"]),
    ],
)
def test_hybrid_ratios_that_cannot_be_served_name_only_the_real_reasons(
    ctx_tpb, gen_tpb, ctx_kw, gen_kw, reasons
) -> None:
    ctx, gen = pair(ctx_tpb, gen_tpb, ctx_kw, gen_kw)
    report = validate(ctx, gen).to_dict()
    errors = {e["code"]: e for e in report["errors"]}
    assert errors["tokens_per_block_mismatch"]["detail"]["reasons"] == reasons
    with pytest.raises(Exception, match="tokens_per_block_mismatch"):
        compile_plan(ctx, gen)


def test_hybrid_ratio_plans_round_trip_with_state_and_sub_blocks() -> None:
    ctx, gen = pair(2, 8, {"tp": 1}, {"tp": 2})
    plan = compile_plan(ctx, gen)
    data = plan.to_dict()
    again = Plan.from_dict(data)
    assert again.to_dict() == data
    assert again.block_ratio == (4, "generation")
    segments = [s for r in data["routes"] for s in r["segments"]]
    assert {(s["state"], s["sub_block"]) for s in segments} == {
        (True, 0),
        *((False, i) for i in range(4)),
    }
    blocks = {0: ([1, 6, 2, 7, 9, 10, 11, 12], [3, 0]), 1: ([2], [3])}
    assert expand(again, blocks, 15).bytes == expand(plan, blocks, 15).bytes > 0
