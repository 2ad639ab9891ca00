"""Property tests for per-request state: random hybrid geometry and parallelism on both sides.

Every compatible scenario must move every needed state and KV byte exactly once (the oracle); the
plan must survive a JSON round trip; an incompatible one must say why with a state code.
"""

from __future__ import annotations

import json
import os
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from geometry import Plan, compile_plan, expand, parse_instance, validate_pairing
from geometry.state_builders import HybridSpec, hybrid_body

PROPERTY = settings(
    max_examples=int(os.environ.get("KVPLANE_GEOMETRY_EXAMPLES", "60")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@st.composite
def specs(draw: st.DrawFn) -> HybridSpec:
    layers = draw(st.integers(2, 5))
    attention = draw(
        st.lists(st.integers(0, layers - 1), min_size=1, max_size=layers - 1, unique=True)
    )
    return HybridSpec(
        num_layers=layers,
        attention_layers=tuple(sorted(attention)),
        kv_heads=draw(st.sampled_from([1, 2, 4, 8])),
        head_dim=4,
        ssm_heads=draw(st.sampled_from([1, 2, 4, 8, 12])),
        ssm_head_dim=draw(st.sampled_from([1, 2])),
        d_state=draw(st.sampled_from([1, 2, 4])),
        # channel counts multiples of 24: every section splits over axes 1, 2, 3, 4, 6, 8, 12, 24
        conv_channels=tuple(
            24 * c for c in draw(st.lists(st.integers(1, 3), min_size=1, max_size=4))
        ),
        d_conv=draw(st.sampled_from([2, 4])),
        dtype="bfloat16",
        ssm_dtype=draw(st.sampled_from(["float32", "bfloat16"])),
    )


@st.composite
def sides(draw: st.DrawFn, spec: HybridSpec) -> dict[str, Any]:
    pp = draw(st.integers(1, min(2, spec.num_layers)))
    return {
        "tp": draw(st.sampled_from([1, 2, 3, 4])),
        "pp": pp,
        "attention_dp": draw(st.sampled_from([False, False, True])),
        "state_slots": 3,
    }


def _fits(spec: HybridSpec, side: dict[str, Any], cp: int = 1) -> bool:
    group = 1 if side["attention_dp"] else side["tp"]
    axis = 1 if side["attention_dp"] else side["tp"] * cp
    ok = all(
        g % min(g, h) == 0 and h % min(g, h) == 0
        for g, h in ((group, spec.kv_heads), (axis, spec.ssm_heads))
    )
    return ok and all(size % axis == 0 for size in spec.section_bytes)


@st.composite
def scenarios(draw: st.DrawFn) -> dict[str, Any]:
    spec = draw(specs())
    ctx, gen = draw(sides(spec)), draw(sides(spec))
    gen_cp = draw(st.sampled_from([1, 1, 2])) if not gen["attention_dp"] else 1
    hypothesis_assume(_fits(spec, ctx) and _fits(spec, gen, gen_cp))
    n_kv = draw(st.integers(0, 3))
    ctx_kv = draw(st.permutations(range(8)))[: draw(st.integers(n_kv, min(n_kv + 2, 8)))]
    gen_kv = draw(st.permutations(range(8)))[:n_kv]
    if gen_cp > 1:
        gen_kv = gen_kv[: len(ctx_kv)]
    state_c = draw(st.sampled_from([[0], [1], [2], []]))
    state_g: Any = draw(st.sampled_from([[0], [1], [2]]))
    if gen_cp > 1 and draw(st.booleans()):
        state_g = [[draw(st.integers(0, 2))] for _ in range(gen_cp)]
    # paged groups may page differently (a block-size ratio, no CP); state groups never do
    tpb = (2, 2) if gen_cp > 1 else draw(st.sampled_from([(2, 2), (2, 2), (8, 2), (2, 4), (4, 2)]))
    # the prompt's tokens: enough for both lists (each ends with the block of the last token);
    # equal block sizes may omit it (the context's list then starts at block 0)
    fit = max(1, (len(ctx_kv) - 1) * tpb[0] + 1, (len(gen_kv) - 1) * tpb[1] + 1)
    num_tokens = fit + draw(st.integers(0, max(tpb) - 1))
    if tpb[0] == tpb[1] and len(ctx_kv) >= -(-num_tokens // tpb[0]) and draw(st.booleans()):
        num_tokens = None  # the context list is the whole request: exact without it
    return {
        "spec": spec,
        "ctx": {**ctx, "tokens_per_block": tpb[0]},
        "gen": {**gen, "cp": gen_cp, "tokens_per_block": tpb[1]},
        "context_dp_rank": draw(st.integers(0, ctx["tp"] - 1)) if ctx["attention_dp"] else None,
        "generation_dp_rank": draw(st.integers(0, gen["tp"] - 1)) if gen["attention_dp"] else None,
        "blocks": {0: (list(ctx_kv), list(gen_kv)), 1: (state_c, state_g)},
        "num_tokens": num_tokens,
    }


def hypothesis_assume(condition: bool) -> None:
    from hypothesis import assume

    assume(condition)


@PROPERTY
@given(scenarios())
def test_random_hybrid_pairs_move_every_state_byte_exactly_once(oracle, case) -> None:
    spec = case["spec"]
    ctx = parse_instance(
        hybrid_body(role="context", spec=spec, num_slots=8, **case["ctx"]),
        "ctx",
    )
    gen = parse_instance(
        hybrid_body(role="generation", spec=spec, num_slots=8, **case["gen"]),
        "gen",
    )
    report = validate_pairing(ctx, gen)
    assert report.compatible, report.to_dict()
    plan = compile_plan(ctx, gen, case["context_dp_rank"], case["generation_dp_rank"])
    result = oracle.check_transfer(
        ctx,
        gen,
        case["blocks"],
        case["context_dp_rank"],
        case["generation_dp_rank"],
        plan=plan,
        num_tokens=case["num_tokens"],
    )
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert expand(again, case["blocks"], case["num_tokens"]).bytes == result.bytes
    assert not oracle.load_balance_violations(plan, ctx, gen)


@PROPERTY
@given(specs(), specs(), st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4]))
def test_different_state_shapes_are_refused_with_a_state_code(a, b, ctx_tp, gen_tp) -> None:
    b = HybridSpec(
        **{
            **b.__dict__,
            "num_layers": a.num_layers,
            "attention_layers": a.attention_layers,
            "kv_heads": a.kv_heads,
        }
    )
    hypothesis_assume(_fits(a, {"tp": ctx_tp, "attention_dp": False}))
    hypothesis_assume(_fits(b, {"tp": gen_tp, "attention_dp": False}))
    ctx = parse_instance(hybrid_body(role="context", spec=a, tp=ctx_tp, tokens_per_block=2), "c")
    gen = parse_instance(hybrid_body(role="generation", spec=b, tp=gen_tp, tokens_per_block=2), "g")
    report = validate_pairing(ctx, gen)
    same_state = (
        a.section_bytes == b.section_bytes
        and a.ssm_heads == b.ssm_heads
        and (a.ssm_head_dim, a.d_state, a.ssm_dtype) == (b.ssm_head_dim, b.d_state, b.ssm_dtype)
    )
    assert report.compatible == same_state, report.to_dict()
    state_codes = {
        "state_bytes_mismatch",
        "section_count_mismatch",
        "section_bytes_mismatch",
        "head_count_mismatch",
        "head_geometry_mismatch",
        "d_state_mismatch",
        "dtype_mismatch",
        "head_dim_mismatch",
    }
    assert set(report.codes()) <= state_codes
    aggregated_differ = sum(a.section_bytes) != sum(b.section_bytes) or (
        a.ssm_heads * a.ssm_head_dim * a.d_state * (4 if a.ssm_dtype == "float32" else 2)
        != b.ssm_heads * b.ssm_head_dim * b.d_state * (4 if b.ssm_dtype == "float32" else 2)
    )
    assert ("state_bytes_mismatch" in report.codes()) == aggregated_differ
