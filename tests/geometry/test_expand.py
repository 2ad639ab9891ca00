"""Expansion of a plan over one request's block lists: errors, and context parallelism."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from geometry import GeometryError, compile_plan, expand, parse_instance, summarize
from geometry.builders import ViewSpec, instance_body

ONE_HEAD = [ViewSpec("target", 1, 2, 4)]  # TP1: K and V of 32 bytes, slot 64 bytes


def instance(role: str, **kw: Any):
    kw.setdefault("tokens_per_block", 2)
    kw.setdefault("num_slots", 4)
    return parse_instance(instance_body(role=role, views=ONE_HEAD, **kw), role[:3])


def plan_for(ctx_kw: dict[str, Any] | None = None, gen_kw: dict[str, Any] | None = None):
    return compile_plan(
        instance("context", **(ctx_kw or {})), instance("generation", **(gen_kw or {}))
    )


def by_route(expansion) -> dict[tuple[int, int], list[list[int]]]:
    return {
        (r.route.sender_rank, r.route.receiver_rank): r.fragment_rows().tolist()
        for r in expansion.routes
    }


@pytest.mark.parametrize(
    ("blocks", "side"), [(([0, 4], [0, 1]), "context"), (([0, 1], [3, 4]), "generation")]
)
def test_block_id_beyond_the_pool_is_refused(blocks, side: str) -> None:
    plan = plan_for({"tp": 2}, {"tp": 2})
    with pytest.raises(GeometryError) as error:
        expand(plan, {0: blocks})
    problem = error.value.problems[0]
    assert (problem.code, problem.loc) == ("block_out_of_range", ("blocks", "0", side))
    assert "block id 4" in problem.message and "4 slots" in problem.message


def test_block_ids_before_the_aligned_suffix_are_not_checked_or_moved() -> None:
    # id 99 is cached on the generation side: it is dropped by suffix alignment (2 tokens per
    # block, 4 tokens: the context reused block 0 and lists block 1 only)
    expansion = expand(plan_for(), {0: ([1], [99, 2])}, num_tokens=4)
    assert by_route(expansion) == {(0, 0): [[0, 64, 0, 128, 64]]}


def test_unknown_layer_group_is_refused() -> None:
    with pytest.raises(GeometryError) as error:
        expand(plan_for(), {0: ([0], [0]), 1: ([0], [0])})
    problem = error.value.problems[0]
    assert (problem.code, problem.loc) == ("invalid_blocks", ("blocks", "1"))


@pytest.mark.parametrize("ids", [[-1], [[0, 1]]])
def test_malformed_block_lists_are_refused(ids) -> None:
    with pytest.raises(GeometryError) as error:
        expand(plan_for(), {0: (ids, [0])})
    assert error.value.code == "invalid_blocks"
    assert error.value.problems[0].loc == ("blocks", "0", "context")


def test_context_parallel_sender_routes_alternate_blocks() -> None:
    plan = plan_for({"cp": 2})
    assert [(r.sender_rank, r.cp_modulus, r.cp_remainder) for r in plan.routes] == [
        (0, 2, 0),
        (1, 2, 1),
    ]
    assert all(not p.equal_split_safe for p in plan.receivers)
    rows = by_route(expand(plan, {0: ([0, 1, 2], [3, 2, 1])}))
    # block j of the context lives on cp_rank j % 2
    assert rows == {
        (0, 0): [[0, 0, 0, 192, 64], [0, 128, 0, 64, 64]],
        (1, 0): [[0, 64, 0, 128, 64]],
    }


@pytest.mark.parametrize(
    ("ctx_kw", "gen_kw", "blocks"),
    [({}, {"cp": 2}, ([0, 100], [1, 2])), ({"cp": 2}, {}, ([0, 1], [1, 100]))],
    ids=["generation-cp-context-id", "context-cp-generation-id"],
)
def test_block_out_of_range_is_detected_under_context_parallelism(ctx_kw, gen_kw, blocks) -> None:
    plan = plan_for(ctx_kw, gen_kw)
    with pytest.raises(GeometryError) as error:
        expand(plan, {0: blocks})  # today: a fragment at offset 6400 of a 256-byte pool
    assert error.value.code == "block_out_of_range"


def test_context_parallel_filter_uses_logical_block_index_under_prefix_caching() -> None:
    plan = plan_for({"cp": 2})
    # context: logical blocks 0..3 in slots 0..3; generation cached block 0, gets 1..3
    rows = by_route(expand(plan, {0: ([0, 1, 2, 3], [1, 2, 3])}))
    sent = {rank: sorted(row[1] // 64 for row in got) for (rank, _), got in rows.items()}
    assert sent == {0: [2], 1: [1, 3]}  # logical block j on cp_rank j % 2


@pytest.mark.parametrize(("ctx_layout", "gen_layout"), [("HND", "HND"), ("NHD", "NHD")])
@pytest.mark.parametrize("limit", [1, 5, 64, 10_000])
def test_fragment_pages_concatenate_to_the_full_list(
    ctx_layout: str, gen_layout: str, limit: int
) -> None:
    """Windows of the fragment list (``GET .../fragments?offset=&limit=``) are computed from
    the indices alone; one after the other they are exactly the full expansion."""

    def side(role: str, layout: str, tp: int):
        views = [ViewSpec("target", 2, 4, 4, layout=layout)]
        body = instance_body(role=role, views=views, tp=tp, tokens_per_block=4, num_slots=16)
        return parse_instance(body, role[:3])

    plan = compile_plan(side("context", ctx_layout, 4), side("generation", gen_layout, 2))
    expansion = expand(plan, {0: ([3, 9, 1, 7, 2], [4, 0, 11, 5])})
    full = [
        (route["sender_rank"], route["receiver_rank"], row)
        for route in expansion.to_fragments()["routes"]
        for row in route["fragments"]
    ]
    assert len(full) == expansion.fragments > 0
    paged: list[tuple[int, int, list[int]]] = []
    offset: int | None = 0
    while offset is not None:
        page = expansion.fragment_page(offset, limit)
        assert page["total"] == expansion.fragments
        paged += [
            (route["sender_rank"], route["receiver_rank"], row)
            for route in page["routes"]
            for row in route["fragments"]
        ]
        offset = page["next_offset"]
    assert paged == full


def _summary_or_error(call) -> Any:
    try:
        return call()
    except GeometryError as error:
        return ("refused", [(p.code, p.loc, p.message) for p in error.problems])


@settings(max_examples=200, deadline=None)
@given(
    lists=st.lists(
        st.tuples(
            st.lists(st.integers(-1, 9), max_size=6), st.lists(st.integers(-1, 9), max_size=6)
        ),
        min_size=1,
        max_size=3,
    )
)
def test_summarize_keeps_a_summary_per_block_count_and_equals_the_expansion(lists) -> None:
    """Requests of one plan (TP4 target + draft into TP2, 8 slots) one after another through
    one memo: every summary (or refusal) is the expansion's own."""
    views = [ViewSpec("target", 2, 8, 4), ViewSpec("draft", 1, 2, 4)]
    plan = compile_plan(
        parse_instance(instance_body(role="context", views=views, tp=4, num_slots=8), "ctx"),
        parse_instance(instance_body(role="generation", views=views, tp=2, num_slots=8), "gen"),
    )
    memo: dict = {}
    for context_ids, generation_ids in lists:
        blocks = {0: (list(context_ids), list(generation_ids))}
        want = _summary_or_error(lambda b=blocks: expand(plan, b).to_summary())
        assert _summary_or_error(lambda b=blocks: summarize(plan, b, None, memo)) == want
    shapes = {(len(c), len(g)) for c, g in lists}
    assert len(memo) <= len(shapes)  # one kept summary per block count at most


def test_summarize_returns_a_copy_of_the_kept_summary() -> None:
    plan = plan_for({"tp": 2}, {"tp": 2})
    memo: dict = {}
    first = summarize(plan, {0: ([0, 1], [2, 3])}, None, memo)
    first["routes"][0]["bytes"] = -1
    first["num_tokens"] = 7
    again = summarize(plan, {0: ([1, 3], [0, 2])}, None, memo)
    assert again == expand(plan, {0: ([1, 3], [0, 2])}).to_summary() and len(memo) == 1
