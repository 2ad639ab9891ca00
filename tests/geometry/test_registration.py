"""Registration rules: ``parse_instance`` / ``parse_rank`` refuse bad page tables by field."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from geometry import GeometryError, parse_instance, parse_rank
from geometry.builders import ViewSpec, instance_body


def body(tp: int = 2, views=None, **kw: Any) -> dict[str, Any]:
    kw.setdefault("tokens_per_block", 2)
    kw.setdefault("num_slots", 4)
    return instance_body(role="context", views=views or [ViewSpec("target", 2, 8, 4)], tp=tp, **kw)


def refused(raw: dict[str, Any]) -> list[tuple[tuple[Any, ...], str, str]]:
    with pytest.raises(GeometryError) as error:
        parse_instance(raw, "ctx")
    return [(p.loc, p.code, p.message) for p in error.value.problems]


def test_builder_body_is_accepted() -> None:
    instance = parse_instance(body(tp=4, pp=2), "ctx")
    assert instance.is_complete and instance.world_size == 8
    assert instance.coords(5) == (1, 1, 0)


def test_buffer_outside_the_slot() -> None:
    raw = body()
    raw["ranks"][1]["views"][0]["buffers"][3]["offset"] = 200  # size 64, slot_bytes 256
    ((loc, code, message),) = refused(raw)
    assert loc == ("ranks", 1, "views", 0, "buffers", 3)
    assert code == "invalid_page_table"
    assert "[200, 264)" in message and "256" in message


def test_overlapping_buffers_in_one_view() -> None:
    raw = body()
    raw["ranks"][0]["views"][0]["buffers"][2]["offset"] = 100  # overlaps [64, 128)
    ((loc, _code, message),) = refused(raw)
    assert loc == ("ranks", 0, "views", 0, "buffers", 2)
    assert "overlaps views.0.buffers.1" in message


def test_overlapping_buffers_across_two_views_of_one_pool() -> None:
    raw = body(views=[ViewSpec("target", 1, 8, 4), ViewSpec("draft", 1, 2, 4)])
    draft = raw["ranks"][0]["views"][1]
    draft["buffers"][0]["offset"] = 100  # inside the target's V buffer [64, 128)
    draft["buffers"][1]["offset"] = 116
    ((loc, _code, message),) = refused(raw)
    assert loc == ("ranks", 0, "views", 1, "buffers", 0)
    assert "overlaps views.0.buffers.1 [64, 128)" in message


def test_views_in_different_pools_may_use_the_same_offsets() -> None:
    raw = body(tp=1, views=[ViewSpec("target", 1, 8, 4), ViewSpec("draft", 1, 2, 4)])
    rank = raw["ranks"][0]
    rank["pools"].append(dict(rank["pools"][0], id=1))
    draft = rank["views"][1]
    draft["pool"] = 1
    draft["buffers"][0]["offset"], draft["buffers"][1]["offset"] = 0, 32
    assert parse_instance(raw, "ctx").table(0).views[1].pool == 1


def test_layers_with_different_buffer_counts() -> None:
    raw = body()
    raw["ranks"][0]["views"][0]["buffers"].pop()  # layer 1 keeps only K
    ((loc, _code, message),) = refused(raw)
    assert loc == ("ranks", 0, "views", 0, "buffers")
    assert "layer 1 has 1 buffers but layer 0 has 2" in message


def test_unequal_buffer_sizes() -> None:
    raw = body()
    raw["ranks"][0]["views"][0]["buffers"][2]["size"] = 32
    ((loc, _code, message),) = refused(raw)
    assert loc == ("ranks", 0, "views", 0, "buffers", 2, "size")
    assert "32" in message and "64" in message


def test_head_count_not_dividing_hnd_bytes() -> None:
    raw = body()
    for row in raw["ranks"][0]["views"][0]["buffers"]:
        row["size"] = 30  # 4 heads per rank
    ((loc, code, message),) = refused(raw)
    assert loc == ("ranks", 0, "views", 0, "buffers", 0, "size")
    assert code == "head_geometry_invalid" and "30" in message and "4 heads" in message


def test_head_count_not_dividing_nhd_token_rows() -> None:
    raw = body(views=[ViewSpec("target", 1, 8, 4, "NHD")], tokens_per_block=4)
    for row in raw["ranks"][1]["views"][0]["buffers"]:
        row["size"] = 4 * 6  # 6-byte token rows do not split over 4 heads
    ((loc, code, _message),) = refused(raw)
    assert (loc, code) == (("ranks", 1, "views", 0, "buffers", 0, "size"), "head_geometry_invalid")


def test_declared_num_kv_heads_contradicting_total_over_tp() -> None:
    raw = body(tp=4)
    raw["ranks"][2]["views"][0]["num_kv_heads"] = 4  # 8 heads over TP4 → 2 per rank
    ((loc, code, message),) = refused(raw)
    assert loc == ("ranks", 2, "views", 0, "num_kv_heads")
    assert code == "head_count_mismatch"
    assert "declares 4" in message and "give 2" in message


def test_total_heads_not_splittable_over_tp() -> None:
    raw = body(tp=4)
    for rank in raw["ranks"]:
        rank["views"][0]["total_kv_heads"] = 6
        rank["views"][0]["num_kv_heads"] = None
    problems = refused(raw)
    assert {code for _, code, _ in problems} == {"head_geometry_invalid"}
    assert problems[0][0] == ("ranks", 0, "views", 0, "total_kv_heads")


def test_same_owner_roles_and_layer_in_two_views_of_one_rank() -> None:
    raw = body(tp=1, views=[ViewSpec("target", 1, 8, 4), ViewSpec("draft", 1, 8, 4)])
    raw["ranks"][0]["views"][1]["owner"] = "target"
    for row in raw["ranks"][0]["views"][1]["buffers"]:
        row["layer"] = 0
    ((loc, code, message),) = refused(raw)
    assert loc == ("ranks", 0, "views", 1)
    assert code == "ambiguous_peer_view" and "already held by views.0" in message


def test_same_layer_with_other_roles_in_two_views_is_allowed() -> None:
    raw = body(tp=1, views=[ViewSpec("target", 1, 8, 4, k_only=True), ViewSpec("draft", 1, 8, 4)])
    view = raw["ranks"][0]["views"][1]
    view.update(owner="target", roles=["value"])
    del view["buffers"][1]
    view["buffers"][0]["layer"] = 0
    assert len(parse_instance(raw, "ctx").table(0).views) == 2


def test_slot_stride_smaller_than_slot_bytes() -> None:
    raw = body()
    raw["ranks"][1]["pools"][0]["slot_stride_bytes"] = 255
    problems = refused(raw)
    assert problems[0][0] == ("ranks", 1, "pools", 0, "slot_stride_bytes")
    assert "255" in problems[0][2] and "256" in problems[0][2]


def test_duplicate_pool_ids() -> None:
    raw = body()
    rank = raw["ranks"][0]
    rank["pools"].append(dict(rank["pools"][0]))
    problems = refused(raw)
    assert problems[0][0] == ("ranks", 0, "pools", 1, "id")
    assert "appears twice" in problems[0][2]


def test_rank_out_of_range() -> None:
    raw = body()
    raw["ranks"][1]["rank"] = 2  # world size 2
    problems = refused(raw)
    assert problems[0][0] == ("ranks", 1, "rank") and "≤ 1" in problems[0][2]


def test_duplicate_ranks() -> None:
    raw = body()
    raw["ranks"][1]["rank"] = 0
    problems = refused(raw)
    assert problems[0][0] == ("ranks", 1, "rank") and "appears twice" in problems[0][2]


def test_all_problems_of_a_body_are_reported() -> None:
    raw = body()
    raw["ranks"][0]["views"][0]["buffers"][2]["size"] = 32  # unequal sizes on rank 0
    raw["ranks"][1]["pools"][0]["slot_stride_bytes"] = 1  # and a bad stride on rank 1
    locs = [loc for loc, _, _ in refused(raw)]
    assert locs[:2] == [
        ("ranks", 0, "views", 0, "buffers", 2, "size"),
        ("ranks", 1, "pools", 0, "slot_stride_bytes"),
    ]


def test_all_top_level_problems_are_reported() -> None:
    raw = body()
    raw.update(role="prefill", tp=0, tokens_per_block=None)
    problems = refused(raw)
    assert [loc for loc, _, _ in problems] == [("role",), ("tp",), ("tokens_per_block",)]


def test_parse_rank_checks_one_rank_against_its_instance() -> None:
    raw = body(tp=4)
    ranks = raw.pop("ranks")
    instance = parse_instance(raw, "ctx")
    assert not instance.is_complete and instance.missing_ranks == (0, 1, 2, 3)
    table = parse_rank(instance, ranks[3])
    assert instance.with_rank(table).missing_ranks == (0, 1, 2)
    ranks[1]["views"][0]["num_kv_heads"] = 8
    with pytest.raises(GeometryError) as error:
        parse_rank(instance, ranks[1])
    assert error.value.problems[0].loc == ("views", 0, "num_kv_heads")
    assert error.value.code == "head_count_mismatch"


def test_planning_core_imports_neither_fastapi_sqlalchemy_nor_torch() -> None:
    script = (
        "import sys, geometry, geometry.builders; "
        "print(sorted(m for m in ('fastapi', 'sqlalchemy', 'torch', 'starlette', 'pydantic') "
        "if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "[]", result.stdout
