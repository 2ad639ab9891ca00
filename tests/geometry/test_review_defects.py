"""Defects found in a review of the planning core, one test each.

Each test here failed on the code before the fix: most of them by moving wrong bytes (the oracle
says which), the others by crashing, by one error hiding another, or by accepting what the
registration and pairing rules refuse (docs/integrators.md, docs/planning.md).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest

from geometry import (
    GeometryError,
    compile_plan,
    expand,
    parse_instance,
    validate_pairing,
)
from geometry.builders import ViewSpec, instance_body

TPB = 2


def body(role: str, views: list[ViewSpec], **kw: Any) -> dict[str, Any]:
    kw.setdefault("tokens_per_block", TPB)
    kw.setdefault("num_slots", 8)
    return instance_body(role=role, views=views, **kw)


def kv(heads: int = 8, layers: int = 2, **kw: Any) -> ViewSpec:
    return ViewSpec("target", layers, heads, 4, **kw)


def codes(report) -> set[str]:
    return {issue.code for issue in report.errors}


# --- A1: the geometry cache was keyed by instance name -----------------------------------------


def test_same_instance_name_on_both_sides_plans_each_side_with_its_own_geometry(oracle) -> None:
    ctx = parse_instance(body("context", [kv()], tp=4), "llama")
    gen = parse_instance(body("generation", [kv()], tp=2), "llama")
    assert validate_pairing(ctx, gen).compatible
    oracle.check_transfer(ctx, gen, ([0, 1, 2], [3, 4, 5]))


def test_same_name_with_different_geometry_is_still_refused() -> None:
    ctx = parse_instance(body("context", [kv()], tp=4), "llama")
    gen = parse_instance(body("generation", [kv(heads=4)], tp=2), "llama")
    assert "head_count_mismatch" in codes(validate_pairing(ctx, gen))


# --- A2 / A3: a sender shard (or CP rank) without a holder ------------------------------------


def _drop_layer(instance_body_: dict[str, Any], rank: int, layer: int) -> dict[str, Any]:
    changed = copy.deepcopy(instance_body_)
    view = changed["ranks"][rank]["views"][0]
    view["buffers"] = [b for b in view["buffers"] if b["layer"] != layer]
    return changed


def test_tp_rank_missing_a_layer_its_peers_hold_is_reported_not_crashed() -> None:
    ctx = parse_instance(_drop_layer(body("context", [kv()], tp=2), 1, 1), "ctx")
    gen = parse_instance(body("generation", [kv()], tp=1), "gen")
    report = validate_pairing(ctx, gen)
    assert "missing_peer_shard" in codes(report), report.to_dict()
    (issue,) = [i for i in report.errors if i.code == "missing_peer_shard"]
    assert issue.detail["layers"] == [1]
    assert issue.detail["global_heads"] == [4, 8]
    with pytest.raises(GeometryError) as error:
        compile_plan(ctx, gen)
    assert error.value.code == "incompatible"


def test_cp_rank_missing_a_layer_is_reported_instead_of_losing_its_blocks() -> None:
    ctx = parse_instance(_drop_layer(body("context", [kv()], cp=2), 1, 1), "ctx")
    gen = parse_instance(body("generation", [kv()]), "gen")
    report = validate_pairing(ctx, gen)
    assert "missing_peer_shard" in codes(report), report.to_dict()
    (issue,) = [i for i in report.errors if i.code == "missing_peer_shard"]
    assert issue.detail["cp_rank"] == 1


# --- A4: helix ownership follows the logical block index ---------------------------------------


@pytest.mark.parametrize(
    ("blocks", "num_tokens"),
    [
        (([0, 1, 2, 3], [5, 6, 7]), None),  # generation (the CP side) reused block 0
        (([0, 1, 2, 3, 4], [5, 6]), None),
        (([1, 2, 3], [4, 5, 6, 7]), 4 * TPB),  # context reused a prefix: still the logical index
    ],
)
def test_generation_cp_ownership_follows_the_logical_block_under_prefix_reuse(
    oracle, blocks, num_tokens
) -> None:
    ctx = parse_instance(body("context", [kv()], tp=2), "ctx")
    gen = parse_instance(body("generation", [kv()], tp=2, cp=2), "gen")
    oracle.check_transfer(ctx, gen, blocks, num_tokens=num_tokens)


@pytest.mark.parametrize(
    ("blocks", "num_tokens"), [(([0, 1, 2, 3], [5, 6, 7]), None), (([1, 2, 3], [4, 5, 6, 7]), 7)]
)
def test_context_cp_ownership_follows_the_logical_block_under_prefix_reuse(
    oracle, blocks, num_tokens
) -> None:
    ctx = parse_instance(body("context", [kv()], cp=2), "ctx")
    gen = parse_instance(body("generation", [kv()]), "gen")
    oracle.check_transfer(ctx, gen, blocks, num_tokens=num_tokens)


# --- A5: equal_split_safe across layer groups ---------------------------------------------------


def _two_group_replicated(role: str, tp: int) -> dict[str, Any]:
    ranks = []
    for rank in range(tp):
        ranks.append(
            {
                "rank": rank,
                "pools": [
                    {"id": 0, "layer_group": 0, "slot_bytes": 128, "num_slots": 8},
                    {"id": 1, "layer_group": 1, "slot_bytes": 128, "num_slots": 8},
                ],
                "views": [
                    {
                        "pool": pool,
                        "owner": "target",
                        "roles": ["key"],
                        "layout": "REPLICATED",
                        "dtype": "bfloat16",
                        "buffers": [{"layer": pool, "offset": 0, "size": 128}],
                    }
                    for pool in (0, 1)
                ],
            }
        )
    return {"role": role, "tp": tp, "tokens_per_block": TPB, "ranks": ranks}


def test_equal_split_safe_compares_bytes_per_layer_group(oracle) -> None:
    ctx = parse_instance(_two_group_replicated("context", 2), "ctx")
    gen = parse_instance(_two_group_replicated("generation", 1), "gen")
    plan = compile_plan(ctx, gen)
    (receiver,) = plan.receivers
    blocks = {0: ([0, 1], [2, 3]), 1: ([4], [5])}  # full attention 2 blocks, sliding window 1
    result = oracle.check_transfer(ctx, gen, blocks, plan=plan)
    per_writer = {r.route.sender_rank: r.bytes for r in result.expansion.routes}
    if len(receiver.writers) > 1 and len(set(per_writer.values())) > 1:
        assert receiver.equal_split_safe is False, per_writer


# --- A6: int64 overflow of block × stride -------------------------------------------------------


def test_pool_whose_last_byte_is_beyond_int64_is_refused_at_registration() -> None:
    raw = body("context", [kv()])
    pool = raw["ranks"][0]["pools"][0]
    pool["num_slots"] = 1 << 32
    pool["slot_stride_bytes"] = 1 << 40
    with pytest.raises(GeometryError) as error:
        parse_instance(raw, "ctx")
    assert error.value.code == "invalid_geometry"
    assert error.value.problems[0].loc[-1] == "num_slots"


def test_base_address_near_the_top_is_refused() -> None:
    raw = body("context", [kv()])
    raw["ranks"][0]["pools"][0]["base_address"] = (1 << 63) - 16
    with pytest.raises(GeometryError) as error:
        parse_instance(raw, "ctx")
    assert error.value.code == "invalid_geometry"


# --- balance: a shard's bytes spread over its replicas ------------------------------------------


def test_replicas_split_a_shard_over_receiver_pipeline_stages_30_10(oracle) -> None:
    ctx = parse_instance(body("context", [kv(heads=1, layers=40)], tp=2), "ctx")
    gen = parse_instance(body("generation", [kv(heads=1, layers=40)], pp=2, pp_split=[30, 10]), "g")
    plan = compile_plan(ctx, gen)
    sent: dict[int, int] = {}
    for route in plan.routes:
        sent[route.sender_rank] = sent.get(route.sender_rank, 0) + route.bytes_per_block
    total = sum(sent.values())
    assert max(sent.values()) <= math.ceil(total / 2), sent
    assert oracle.load_balance_violations(plan, ctx) == []
    oracle.check_transfer(ctx, gen, ([0, 1], [2, 3]))


@pytest.mark.parametrize("layers", [1, 2, 3])
def test_mla_replicas_rotate_with_the_generation_dp_rank(oracle, layers: int) -> None:
    mla = [ViewSpec("target", layers, 1, 8, "REPLICATED", "bfloat16", True, True)]
    ctx = parse_instance(body("context", mla, tp=4), "ctx")
    gen = parse_instance(body("generation", mla, tp=4, attention_dp=True), "gen")
    sent = dict.fromkeys(range(4), 0)
    first = {}
    for dp in range(4):
        plan = compile_plan(ctx, gen, None, dp)
        for route in plan.routes:
            sent[route.sender_rank] += route.bytes_per_block
        first[dp] = min(r.sender_rank for r in plan.routes)
        oracle.check_transfer(ctx, gen, ([0], [1]), None, dp, plan=plan)
    assert len(set(sent.values())) == 1, sent  # every replica serves the same share
    if layers == 1:
        assert first == {0: 0, 1: 1, 2: 2, 3: 3}


# --- collect all errors -------------------------------------------------------------------------


def test_tokens_per_block_error_does_not_hide_view_errors() -> None:
    ctx = parse_instance(body("context", [kv()], tokens_per_block=2), "ctx")
    gen = parse_instance(body("generation", [kv(dtype="float16")], tokens_per_block=3), "gen")
    assert {"tokens_per_block_mismatch", "dtype_mismatch"} <= codes(validate_pairing(ctx, gen))


def test_cp_both_sides_does_not_hide_view_errors() -> None:
    ctx = parse_instance(body("context", [kv()], cp=2), "ctx")
    gen = parse_instance(body("generation", [kv(dtype="float16")], cp=2), "gen")
    assert {"context_parallel_both_sides", "dtype_mismatch"} <= codes(validate_pairing(ctx, gen))


def test_layout_mismatch_does_not_hide_dtype_and_head_dim() -> None:
    ctx = parse_instance(body("context", [kv()]), "ctx")
    gen = parse_instance(
        body("generation", [ViewSpec("target", 2, 8, 8, "REPLICATED", "float16")]), "gen"
    )
    found = codes(validate_pairing(ctx, gen))
    assert {"layout_mismatch", "dtype_mismatch", "head_dim_mismatch"} <= found, found


# --- draft views do not inherit the target's total ----------------------------------------------


def test_draft_view_with_only_num_kv_heads_does_not_take_the_instance_total(oracle) -> None:
    views = [kv(heads=8), ViewSpec("draft", 1, 2, 4)]
    raws = [body("context", views, tp=2), body("generation", views, tp=2)]
    for raw in raws:
        for rank in raw["ranks"]:
            del rank["views"][1]["total_kv_heads"]  # the draft gives num_kv_heads = 1 only
    ctx, gen = parse_instance(raws[0], "ctx"), parse_instance(raws[1], "gen")
    assert validate_pairing(ctx, gen).compatible
    oracle.check_transfer(ctx, gen, ([0, 1], [2, 3]))


# --- block lists of a request -------------------------------------------------------------------


def test_a_request_omitting_a_layer_group_is_refused_unless_explicitly_empty() -> None:
    ctx = parse_instance(_two_group_replicated("context", 1), "ctx")
    gen = parse_instance(_two_group_replicated("generation", 1), "gen")
    plan = compile_plan(ctx, gen)
    with pytest.raises(GeometryError) as error:
        expand(plan, {0: ([0], [1])})
    problem = error.value.problems[0]
    assert (problem.code, problem.loc) == ("invalid_blocks", ("blocks", "1"))
    assert expand(plan, {0: ([0], [1]), 1: ([], [])}).bytes == 128


@pytest.mark.parametrize("side", ["context", "generation"])
def test_duplicate_block_ids_in_one_list_are_refused(side: str) -> None:
    ctx = parse_instance(body("context", [kv()]), "ctx")
    gen = parse_instance(body("generation", [kv()]), "gen")
    lists = {"context": [0, 1, 2, 3], "generation": [4, 5, 6, 7]}
    lists[side] = [5, 5, 5, 5]
    with pytest.raises(GeometryError) as error:
        expand(compile_plan(ctx, gen), {0: (lists["context"], lists["generation"])})
    problem = error.value.problems[0]
    assert (problem.code, problem.loc) == ("invalid_blocks", ("blocks", "0", side))
    assert "5" in problem.message


# --- helix: one block table per generation CP rank ----------------------------------------------


@pytest.mark.parametrize(
    "generation",
    [
        [[10, 11, 12], [20, 21]],  # 5 logical blocks, full tables
        [[11, 12], [21]],  # generation reused logical blocks 0..1 (rank 0: 0, rank 1: 1)
        [[12], [20, 21]],  # unequal reuse per CP rank
        [[], [21]],
    ],
)
def test_helix_per_cp_rank_block_tables_move_each_logical_block_once(oracle, generation) -> None:
    ctx = parse_instance(body("context", [kv()], tp=2, num_slots=32), "ctx")
    gen = parse_instance(body("generation", [kv()], tp=4, cp=2, num_slots=32), "gen")
    result = oracle.check_transfer(ctx, gen, ([0, 1, 2, 3, 4], generation))
    per_block = sum(r.bytes_per_block for r in result.plan.routes) // 2  # each CP rank's routes
    assert result.expansion.bytes == sum(len(ids) for ids in generation) * per_block


def test_helix_block_tables_must_fit_the_request() -> None:
    ctx = parse_instance(body("context", [kv()]), "ctx")
    gen = parse_instance(body("generation", [kv()], cp=2), "gen")
    plan = compile_plan(ctx, gen)
    for generation, where in (([[1, 2, 3], [4]], 0), ([[1], [2], [3]], None), ([[1, 1], [2]], 0)):
        with pytest.raises(GeometryError) as error:
            expand(plan, {0: ([0, 1, 2], generation)}, num_tokens=3 * TPB)
        problem = error.value.problems[0]
        assert problem.code == "invalid_blocks"
        assert problem.loc == ("blocks", "0", "generation", *([] if where is None else [where]))
    flat = compile_plan(ctx, parse_instance(body("generation", [kv()]), "gen"))
    with pytest.raises(GeometryError) as error:
        expand(flat, {0: ([0, 1], [[1], [2]])})
    assert "CP > 1" in error.value.problems[0].message
