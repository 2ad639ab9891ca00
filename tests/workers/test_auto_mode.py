"""``mode="auto"``: resolved per route from the plan alone, so a route's two ends agree."""

from __future__ import annotations

from geometry import compile_plan, parse_instance
from geometry.builders import ViewSpec, instance_body
from workers.executors import Route
from workers.handover import AUTO_FRAGMENT_BYTES, normalize_blocks, route_mode_of


def _routes(layout: str, head_dim: int, tokens_per_block: int) -> list[Route]:
    views = [ViewSpec("target", 2, 4, head_dim, layout)]
    ctx = instance_body(role="context", views=views, tp=2, tokens_per_block=tokens_per_block)
    gen = instance_body(role="generation", views=views, tp=1, tokens_per_block=tokens_per_block)
    plan = compile_plan(parse_instance(ctx, "ctx"), parse_instance(gen, "gen"))
    return [Route.from_dict(route.to_dict()) for route in plan.routes]


def test_large_hnd_head_slices_go_pool_to_pool() -> None:
    # one HND head of one block: 64 tokens x 128 dims x 2 bytes = 16 KiB per fragment
    routes = _routes("HND", 128, 64)
    assert routes and {route_mode_of(r) for r in routes} == {"fragments"}


def test_small_nhd_fragments_are_staged() -> None:
    # NHD head slices: one fragment per token, 2 heads x 16 dims x 2 bytes = 64 bytes each
    routes = _routes("NHD", 16, 16)
    assert routes and {route_mode_of(r) for r in routes} == {"staged"}


def test_the_threshold_is_the_mean_fragment_size() -> None:
    # HND, 8 tokens x 128 dims x 2 bytes = 2 KiB per head-block fragment: below 8 KiB
    (route,) = _routes("HND", 128, 8)[:1]
    nbytes = sum(seg.bytes_per_block for seg in route.segments)
    fragments = sum(run.count for seg in route.segments for run in seg.runs)
    assert nbytes / fragments < AUTO_FRAGMENT_BYTES
    assert route_mode_of(route) == "staged"


def test_per_cp_rank_block_tables_pass_normalization() -> None:
    pairs = normalize_blocks({"0": {"context": [1, 2, 3], "generation": [[7, 8], [9]]}})
    assert pairs == {0: ([1, 2, 3], [[7, 8], [9]])}
