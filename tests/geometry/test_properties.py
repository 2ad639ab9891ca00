"""Property tests: random parallelism and head geometry on both sides, judged by the oracle."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import hypothesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from geometry import Plan, compile_plan, expand, parse_instance, validate_pairing
from geometry.builders import ViewSpec, instance_body

# KVPLANE_GEOMETRY_EXAMPLES raises the example count for a soak run (1200 took ~3.5 min).
PROPERTY = settings(
    max_examples=int(os.environ.get("KVPLANE_GEOMETRY_EXAMPLES", "80")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

KINDS = ("HND", "NHD", "MLA")  # MLA: K-only REPLICATED view
DTYPES = ("bfloat16", "float8_e4m3fn", "nvfp4", "float32")


def _spec(owner: str, layers: int, heads: int, head_dim: int, kind: str, dtype: str) -> ViewSpec:
    if kind == "MLA":
        return ViewSpec(owner, layers, heads, head_dim, "REPLICATED", dtype, True, True)
    return ViewSpec(owner, layers, heads, head_dim, kind, dtype)


@st.composite
def splits(draw: st.DrawFn, layers: int, pp: int) -> list[int]:
    cuts = (
        sorted(
            draw(
                st.lists(st.integers(1, layers - 1), min_size=pp - 1, max_size=pp - 1, unique=True)
            )
        )
        if pp > 1
        else []
    )
    edges = [0, *cuts, layers]
    return [b - a for a, b in zip(edges, edges[1:], strict=False)]


@st.composite
def side(draw: st.DrawFn, layers: int) -> dict[str, Any]:
    pp = draw(st.integers(1, min(3, layers)))
    return {
        "tp": draw(st.sampled_from([1, 2, 4, 8])),
        "pp": pp,
        "pp_split": draw(splits(layers, pp)),
        "attention_dp": draw(st.booleans()),
        "stride_pad": draw(st.sampled_from([0, 0, 8])),
        "slot_pad": draw(st.sampled_from([0, 4])),
    }


@st.composite
def prompt(draw: st.DrawFn, tokens_per_block: int, n_context: int, n_generation: int) -> Any:
    """``num_tokens`` for lists of these lengths: each ends with the block of the last token, so
    the request spans at least the longer list (one more block: both reused a prefix); the
    last block is partial or whole. None (omitted) where that is exact: the context's list is
    the whole request and the generation's no longer."""
    blocks = max(n_context, n_generation, 1) + draw(st.integers(0, 1))
    tokens = (blocks - 1) * tokens_per_block + draw(st.integers(1, tokens_per_block))
    if n_context == blocks and n_generation <= n_context and draw(st.booleans()):
        return None
    return tokens


@st.composite
def scenarios(draw: st.DrawFn) -> dict[str, Any]:
    layers = draw(st.integers(1, 4))
    head_dim = draw(st.sampled_from([4, 8]))
    target = _spec(
        "target",
        layers,
        draw(st.sampled_from([1, 2, 4, 8])),
        head_dim,
        draw(st.sampled_from(KINDS)),
        draw(st.sampled_from(DTYPES)),
    )
    draft_where = draw(st.sampled_from(["none", "both", "both", "generation", "context"]))
    draft = _spec(
        "draft",
        draw(st.integers(1, 2)),
        draw(st.sampled_from([1, 2, 4, 8])),
        draw(st.sampled_from([4, 8])),
        draw(st.sampled_from(KINDS)),
        draw(st.sampled_from(DTYPES)),
    )
    ctx, gen = draw(side(layers)), draw(side(layers))
    n_slots = 6
    ids_c = draw(st.permutations(range(n_slots)).map(lambda p: p[: draw(st.integers(1, 4))]))
    ids_g = draw(st.permutations(range(n_slots)).map(lambda p: p[: draw(st.integers(1, 4))]))
    tokens_per_block = draw(st.integers(2, 4))
    return {
        "tokens_per_block": tokens_per_block,
        "num_tokens": draw(prompt(tokens_per_block, len(ids_c), len(ids_g))),
        "ctx": ctx,
        "gen": gen,
        "ctx_views": [target, draft] if draft_where in ("both", "context") else [target],
        "gen_views": [target, draft] if draft_where in ("both", "generation") else [target],
        "blocks": (list(ids_c), list(ids_g)),
        "ctx_dp": draw(st.integers(0, ctx["tp"] - 1)) if ctx["attention_dp"] else None,
        "gen_dp": draw(st.integers(0, gen["tp"] - 1)) if gen["attention_dp"] else None,
        "n_slots": n_slots,
    }


def _instance(role: str, views: list[ViewSpec], opts: dict[str, Any], sc: dict[str, Any]):
    return parse_instance(_raw(role, views, opts, sc), role[:3])


def _raw(role: str, views: list[ViewSpec], opts: dict[str, Any], sc: dict[str, Any]):
    body = instance_body(
        role=role,
        views=views,
        cp=opts.get("cp", 1),
        tp=opts["tp"],
        pp=opts["pp"],
        pp_split=opts["pp_split"],
        attention_dp=opts["attention_dp"],
        tokens_per_block=sc["tokens_per_block"],
        num_slots=sc["n_slots"],
        slot_padding_bytes=opts["slot_pad"],
    )
    for rank in body["ranks"]:
        for pool in rank["pools"]:
            pool["slot_stride_bytes"] = pool["slot_bytes"] + opts["stride_pad"]
    return body


def _pair(sc: dict[str, Any]):
    return (
        _instance("context", sc["ctx_views"], sc["ctx"], sc),
        _instance("generation", sc["gen_views"], sc["gen"], sc),
    )


@PROPERTY
@given(sc=scenarios())
def test_every_receiver_byte_written_once_with_its_label(sc: dict[str, Any], oracle) -> None:
    ctx, gen = _pair(sc)
    report = validate_pairing(ctx, gen)
    assert report.compatible, report.to_dict()
    warned = {w.code for w in report.warnings}
    assert ("missing_peer_view" in warned) == (
        sc["gen_views"] != sc["ctx_views"] and len(sc["gen_views"]) == 2
    )
    oracle.check_transfer(
        ctx, gen, sc["blocks"], sc["ctx_dp"], sc["gen_dp"], num_tokens=sc["num_tokens"]
    )


@PROPERTY
@given(sc=scenarios())
def test_plan_is_deterministic_balanced_and_round_trips(sc: dict[str, Any], oracle) -> None:
    ctx, gen = _pair(sc)
    plan = compile_plan(ctx, gen, sc["ctx_dp"], sc["gen_dp"])
    ctx2, gen2 = _pair(sc)
    again = compile_plan(ctx2, gen2, sc["ctx_dp"], sc["gen_dp"])
    data = plan.to_dict()
    assert json.dumps(data, sort_keys=True) == json.dumps(again.to_dict(), sort_keys=True)
    assert oracle.load_balance_violations(plan, ctx, gen) == []
    rebuilt = Plan.from_dict(json.loads(json.dumps(data)))
    assert rebuilt.to_dict() == data
    # the rebuilt plan moves exactly the same bytes
    oracle.check_transfer(
        ctx, gen, sc["blocks"], sc["ctx_dp"], sc["gen_dp"], plan=rebuilt,
        num_tokens=sc["num_tokens"],
    )  # fmt: skip


@PROPERTY
@given(sc=scenarios(), n=st.integers(1, 6))
def test_template_size_is_independent_of_blocks(sc: dict[str, Any], n: int, oracle) -> None:
    ctx, gen = _pair(sc)
    plan = compile_plan(ctx, gen, sc["ctx_dp"], sc["gen_dp"])
    runs_before = plan.runs
    per_block_bytes = sum(r.bytes_per_block for r in plan.routes)
    per_block_frags = sum(s.fragments_per_block for r in plan.routes for s in r.segments)
    ids = list(range(n))
    expansion = expand(plan, {0: (ids, ids[::-1])})
    assert plan.runs == runs_before
    assert expansion.bytes == n * per_block_bytes
    assert expansion.fragments == n * per_block_frags
    rows = [row for route in expansion.routes for row in route.fragment_rows().tolist()]
    assert len(rows) == expansion.fragments
    assert sum(row[4] for row in rows) == expansion.bytes
    listed = expansion.to_fragments()["routes"]
    assert sum(len(r["fragments"]) for r in listed) == expansion.fragments
    # every run of the template is used once per block
    for route in plan.routes:
        for segment in route.segments:
            assert (segment.runs[:, 2] > 0).all() and (segment.runs[:, 3] >= 1).all()


@st.composite
def cp_scenarios(draw: st.DrawFn) -> dict[str, Any]:
    """Context parallelism on one side (never both); equal-length block lists."""
    sc = draw(scenarios())
    where = draw(st.sampled_from(["ctx", "gen"]))
    sc[where] = dict(sc[where], cp=draw(st.integers(2, 3)))
    n = draw(st.integers(1, 5))
    sc["blocks"] = (list(range(n)), list(range(n))[::-1])
    sc["num_tokens"] = draw(prompt(sc["tokens_per_block"], n, n))
    return sc


@PROPERTY
@given(sc=cp_scenarios())
def test_context_parallel_side_moves_each_block_from_its_cp_rank(
    sc: dict[str, Any], oracle
) -> None:
    ctx, gen = _pair(sc)
    assert validate_pairing(ctx, gen).compatible
    result = oracle.check_transfer(
        ctx, gen, sc["blocks"], sc["ctx_dp"], sc["gen_dp"], num_tokens=sc["num_tokens"]
    )
    assert oracle.load_balance_violations(result.plan, ctx, gen) == []


def _valid_sharding(tp: int, attention_dp: bool, heads: int) -> bool:
    group = 1 if attention_dp else tp
    shards = min(group, heads)
    return group % shards == 0 and heads % shards == 0


@st.composite
def conversion_scenarios(draw: st.DrawFn) -> dict[str, Any]:
    """Random layouts per side (HND/NHD, converted when they differ) and any TP ratio."""
    sc = draw(scenarios())
    heads = draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12]))
    layouts = [draw(st.sampled_from(["HND", "NHD"])) for _ in range(2)]
    for where in ("ctx", "gen"):
        tp = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
        hypothesis.assume(_valid_sharding(tp, sc[where]["attention_dp"], heads))
        sc[where] = dict(sc[where], tp=tp)
    target = sc["ctx_views"][0]
    sc["ctx_views"] = [
        dataclasses.replace(
            target, kv_heads=heads, layout=layouts[0], replicated=False, k_only=False
        )
    ]
    sc["gen_views"] = [dataclasses.replace(sc["ctx_views"][0], layout=layouts[1])]
    sc["ctx_dp"] = draw(st.integers(0, sc["ctx"]["tp"] - 1)) if sc["ctx"]["attention_dp"] else None
    sc["gen_dp"] = draw(st.integers(0, sc["gen"]["tp"] - 1)) if sc["gen"]["attention_dp"] else None
    return sc


@PROPERTY
@given(sc=conversion_scenarios())
def test_conversion_and_any_tp_ratio_write_every_byte_once(sc: dict[str, Any], oracle) -> None:
    ctx, gen = _pair(sc)
    report = validate_pairing(ctx, gen)
    assert report.compatible, report.to_dict()
    converted = sc["ctx_views"][0].layout != sc["gen_views"][0].layout
    assert converted == ("layout_conversion" in {w.code for w in report.warnings})
    result = oracle.check_transfer(
        ctx, gen, sc["blocks"], sc["ctx_dp"], sc["gen_dp"], num_tokens=sc["num_tokens"]
    )
    assert oracle.load_balance_violations(result.plan, ctx, gen) == []


@st.composite
def prefix_cp_scenarios(draw: st.DrawFn) -> dict[str, Any]:
    """CP on one side with block lists of unequal length (prefix reuse on either side)."""
    sc = draw(cp_scenarios())
    n_c, n_g = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    sc["blocks"] = (list(range(n_c)), list(range(n_g))[::-1])
    sc["num_tokens"] = draw(prompt(sc["tokens_per_block"], n_c, n_g))
    return sc


@PROPERTY
@given(sc=prefix_cp_scenarios())
def test_context_parallel_ownership_follows_the_logical_block(sc: dict[str, Any], oracle) -> None:
    ctx, gen = _pair(sc)
    oracle.check_transfer(
        ctx, gen, sc["blocks"], sc["ctx_dp"], sc["gen_dp"], num_tokens=sc["num_tokens"]
    )


@st.composite
def helix_scenarios(draw: st.DrawFn) -> dict[str, Any]:
    """Generation CP with one block table per CP rank, each a random suffix (prefix reuse)."""
    sc = draw(scenarios())
    cp = draw(st.integers(2, 3))
    sc["gen"] = dict(sc["gen"], cp=cp)
    total = draw(st.integers(1, 6))
    # one side holds the whole request (it defines N); the other may have reused a prefix
    context_full = draw(st.booleans())
    context = list(range(total - (total if context_full else draw(st.integers(0, total))), total))
    tables = []
    for c in range(cp):
        own = (total - c + cp - 1) // cp
        keep = draw(st.integers(0, own)) if context_full else own
        tables.append(list(range(10 + 10 * c, 10 + 10 * c + own))[own - keep :])
    sc["blocks"] = (context, tables)
    sc["n_slots"] = 40
    if draw(st.booleans()):  # the request's tokens: the last block partial or whole
        sc["num_tokens"] = (total - 1) * sc["tokens_per_block"] + draw(
            st.integers(1, sc["tokens_per_block"])
        )
    else:
        sc["num_tokens"] = None if context_full else total * sc["tokens_per_block"]
    return sc


@PROPERTY
@given(sc=helix_scenarios())
def test_helix_block_tables_move_each_logical_block_from_its_cp_rank(
    sc: dict[str, Any], oracle
) -> None:
    ctx, gen = _pair(sc)
    result = oracle.check_transfer(
        ctx, gen, sc["blocks"], sc["ctx_dp"], sc["gen_dp"], num_tokens=sc["num_tokens"]
    )
    assert oracle.load_balance_violations(result.plan, ctx, gen) == []


@st.composite
def ratio_scenarios(draw: st.DrawFn) -> dict[str, Any]:
    """Different tokens_per_block (HND, ratio 2..8 either way), any TP / head split on both
    sides, drafts, PP, attention-DP, and block lists of unrelated lengths."""
    sc = draw(scenarios())
    heads = draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12]))
    for where in ("ctx", "gen"):
        tp = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
        sc[where] = dict(sc[where], tp=tp)
    plain = {"layout": "HND", "replicated": False, "k_only": False}
    target = dataclasses.replace(sc["ctx_views"][0], kv_heads=heads, **plain)
    draft = dataclasses.replace(
        sc["gen_views"][-1] if len(sc["gen_views"]) == 2 else sc["ctx_views"][-1], **plain
    )
    for where, key in (("ctx", "ctx_views"), ("gen", "gen_views")):
        views = [target] + ([draft] if len(sc[key]) == 2 else [])
        for view in views:
            hypothesis.assume(_valid_sharding(sc[where]["tp"], sc[where]["attention_dp"],
                                              view.kv_heads))  # fmt: skip
        sc[key] = views
    small, ratio = draw(st.integers(1, 4)), draw(st.integers(2, 8))
    context_large = draw(st.booleans())
    sc["tpb"] = (small * ratio, small) if context_large else (small, small * ratio)
    sc["ratio"], sc["larger_side"] = ratio, "context" if context_large else "generation"
    sc["n_slots"] = 5 * ratio
    n_large, n_small = draw(st.integers(0, 4)), draw(st.integers(0, 5 * ratio))
    n_c, n_g = (n_large, n_small) if context_large else (n_small, n_large)
    ids_c = draw(st.permutations(range(sc["n_slots"])))[:n_c]
    ids_g = draw(st.permutations(range(sc["n_slots"])))[:n_g]
    sc["blocks"] = (list(ids_c), list(ids_g))
    # any prompt both lists fit in (each ends with the block of its last token): mostly not a
    # multiple of either block size, the lists' first tokens wherever the lengths put them
    fit = max(1, (n_c - 1) * sc["tpb"][0] + 1, (n_g - 1) * sc["tpb"][1] + 1)
    sc["num_tokens"] = fit + draw(st.integers(0, small * ratio))
    sc["ctx_dp"] = draw(st.integers(0, sc["ctx"]["tp"] - 1)) if sc["ctx"]["attention_dp"] else None
    sc["gen_dp"] = draw(st.integers(0, sc["gen"]["tp"] - 1)) if sc["gen"]["attention_dp"] else None
    return sc


def _ratio_pair(sc: dict[str, Any]):
    ctx = _instance("context", sc["ctx_views"], sc["ctx"], dict(sc, tokens_per_block=sc["tpb"][0]))
    gen = _instance("generation", sc["gen_views"], sc["gen"],
                    dict(sc, tokens_per_block=sc["tpb"][1]))  # fmt: skip
    return ctx, gen


@PROPERTY
@given(sc=ratio_scenarios())
def test_block_size_ratio_writes_every_byte_once(sc: dict[str, Any], oracle) -> None:
    ctx, gen = _ratio_pair(sc)
    report = validate_pairing(ctx, gen)
    assert report.compatible, report.to_dict()
    (warning,) = [w for w in report.warnings if w.code == "tokens_per_block_ratio"]
    assert (warning.detail["ratio"], warning.detail["larger_side"]) == (
        sc["ratio"],
        sc["larger_side"],
    )
    result = oracle.check_transfer(
        ctx, gen, sc["blocks"], sc["ctx_dp"], sc["gen_dp"], num_tokens=sc["num_tokens"]
    )
    assert oracle.load_balance_violations(result.plan, ctx, gen) == []
    # the template depends on the ratio, never on the block counts; it round-trips
    data = result.plan.to_dict()
    assert Plan.from_dict(json.loads(json.dumps(data))).to_dict() == data
    for route in result.plan.routes:
        assert {s.sub_block for s in route.segments} == set(range(sc["ratio"]))


def _split_groups(body: dict[str, Any]) -> dict[str, Any]:
    """Odd global layers into a second layer group (pool 1, same slot shape): e.g. sliding
    window layers beside full attention ones."""
    for rank in body["ranks"]:
        (pool,) = rank["pools"]
        rank["pools"] = [pool, dict(pool, id=1, layer_group=1)]
        views = []
        for view in rank["views"]:
            for group in (0, 1):
                rows = [b for b in view["buffers"] if b["layer"] % 2 == group]
                if rows:
                    views.append(dict(view, pool=group, buffers=rows))
        rank["views"] = views
    return body


@st.composite
def window_scenarios(draw: st.DrawFn) -> dict[str, Any]:
    """Two layer groups, the second a sliding window (its lists keep the request's last few
    blocks), with CP on either side (helix tables or a flat list) and prefix reuse."""
    sc = draw(scenarios())
    hypothesis.assume(sc["ctx_views"][0].layers >= 2)
    where = draw(st.sampled_from(["ctx", "gen"]))
    cp = draw(st.integers(2, 3))
    sc[where] = dict(sc[where], cp=cp)
    tpb = sc["tokens_per_block"]
    total = draw(st.integers(1, 5))
    sc["num_tokens"] = (total - 1) * tpb + draw(st.integers(1, tpb))
    sc["n_slots"] = 40

    def suffix(first: int, base: int, helix: bool) -> Any:
        if not helix:
            return [base + j for j in range(first, total)]
        return [[base + 10 * c + j for j in range(first, total) if j % cp == c] for c in range(cp)]

    blocks = {}
    for group in (0, 1):
        window = draw(st.integers(1, total)) if group else total
        first_c = total - window + (draw(st.integers(0, window - 1)) if group == 0 else 0)
        first_g = total - window + draw(st.integers(0, window - 1))
        helix = where == "gen" and draw(st.booleans())
        blocks[group] = (suffix(first_c, 0, False), suffix(first_g, 0, helix))
    sc["blocks"] = blocks
    return sc


@PROPERTY
@given(sc=window_scenarios())
def test_window_groups_with_cp_move_each_block_from_the_rank_of_its_request_index(
    sc: dict[str, Any], oracle
) -> None:
    ctx = parse_instance(_split_groups(_raw("context", sc["ctx_views"], sc["ctx"], sc)), "ctx")
    gen = parse_instance(_split_groups(_raw("generation", sc["gen_views"], sc["gen"], sc)), "gen")
    report = validate_pairing(ctx, gen)
    assert report.compatible, report.to_dict()
    result = oracle.check_transfer(
        ctx, gen, sc["blocks"], sc["ctx_dp"], sc["gen_dp"], num_tokens=sc["num_tokens"]
    )
    assert oracle.load_balance_violations(result.plan, ctx, gen) == []
