"""The parser that checks a registration body and returns it as :mod:`geometry.model` data.

Page-table rules enforced here (each violation names its field):

- every buffer lies inside ``[0, slot_bytes)`` of its pool, and no two buffers of one pool overlap;
- ``base_address + num_slots × slot_stride_bytes ≤ 2^63 − 1``: every byte offset is an int64
  (``invalid_geometry``);
- within a view every layer has the same number of buffers and every buffer the same ``size``;
- one rank never holds the same ``(owner, roles, layer)`` in two views;
- the view's head geometry (see :mod:`geometry.heads`) is consistent with the TP group and
  divides the registered bytes exactly;
- ``layer_groups`` (optional, instance-wide) lists ``{id, tokens_per_slot}``: a group with
  ``tokens_per_slot: null`` holds per-request recurrent state (one slot per request); its views
  follow :mod:`geometry.state`. Groups not listed are paged with ``tokens_per_block``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from geometry.errors import GeometryError, Loc, ProblemSink
from geometry.model import Buffer, Instance, Pool, RankTable, View
from geometry.state import view_geometry

OWNERS = ("target", "draft")
LAYOUTS = ("HND", "NHD", "REPLICATED", "SECTIONED")
MAX_SECTIONS = 64
ROLES = ("context", "generation")
MAX_PARALLEL = 1024
MAX_ADDRESS = (1 << 63) - 1  # last byte of a pool must be an int64 offset


def _int(
    sink: ProblemSink,
    data: Mapping[str, Any],
    key: str,
    loc: Loc,
    *,
    minimum: int = 0,
    maximum: int | None = None,
    default: int | None = None,
    required: bool = True,
) -> int | None:
    value = data.get(key)
    if value is None:
        if default is not None or not required:
            return default
        sink.add((*loc, key), "field required")
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        sink.add((*loc, key), f"must be an integer, got {type(value).__name__}")
        return None
    if value < minimum:
        sink.add((*loc, key), f"must be ≥ {minimum}, got {value}")
        return None
    if maximum is not None and value > maximum:
        sink.add((*loc, key), f"must be ≤ {maximum}, got {value}")
        return None
    return value


def _choice(
    sink: ProblemSink, data: Mapping[str, Any], key: str, loc: Loc, choices: Sequence[str]
) -> str | None:
    value = data.get(key)
    if value not in choices:
        sink.add((*loc, key), f"must be one of {', '.join(choices)}, got {value!r}")
        return None
    return str(value)


def parse_instance(body: Mapping[str, Any], name: str) -> Instance:
    """Check an instance body (``ranks`` may be partial or absent) and return it as data."""
    sink = ProblemSink()
    role = _choice(sink, body, "role", (), ROLES)
    tp = _int(sink, body, "tp", (), minimum=1, maximum=MAX_PARALLEL, default=1)
    pp = _int(sink, body, "pp", (), minimum=1, maximum=MAX_PARALLEL, default=1)
    cp = _int(sink, body, "cp", (), minimum=1, maximum=MAX_PARALLEL, default=1)
    tokens = _int(sink, body, "tokens_per_block", (), minimum=1, maximum=1 << 20)
    kv_heads = _int(sink, body, "kv_heads_per_rank", (), minimum=1, required=False)
    total_heads = _int(sink, body, "total_kv_heads", (), minimum=1, required=False)
    attention_dp = body.get("attention_dp", False)
    if not isinstance(attention_dp, bool):
        sink.add(("attention_dp",), "must be a boolean")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        sink.add(("model",), "must be a string")
    state_groups = _parse_layer_groups(sink, body.get("layer_groups"), tokens)
    sink.raise_if_any()
    assert role and tp and pp and cp and tokens  # for the type checker: checked above
    if tp * pp * cp > MAX_PARALLEL:
        sink.add(("tp",), f"world size tp×pp×cp = {tp * pp * cp} exceeds {MAX_PARALLEL}")
        sink.raise_if_any()
    instance = Instance(
        name=name,
        role=role,
        tp=tp,
        pp=pp,
        cp=cp,
        attention_dp=bool(attention_dp),
        tokens_per_block=tokens,
        model=model,
        kv_heads_per_rank=kv_heads,
        total_kv_heads=total_heads,
        ranks=(None,) * (tp * pp * cp),
        state_groups=state_groups,
    )
    raw_ranks = body.get("ranks") or []
    if not isinstance(raw_ranks, list):
        sink.add(("ranks",), "must be a list")
        sink.raise_if_any()
    seen: dict[int, int] = {}
    tables: list[RankTable] = []
    for position, raw in enumerate(raw_ranks):
        loc: Loc = ("ranks", position)
        if not isinstance(raw, Mapping):
            sink.add(loc, "must be an object")
            continue
        rank = raw.get("rank")
        if isinstance(rank, int) and not isinstance(rank, bool) and rank in seen:
            sink.add((*loc, "rank"), f"rank {rank} appears twice (also at ranks.{seen[rank]})")
            continue
        try:
            table = _parse_rank(instance, raw, loc)
        except GeometryError as error:
            sink.problems.extend(error.problems)
            continue
        seen[table.rank] = position
        tables.append(table)
    sink.raise_if_any()
    for table in tables:
        instance = instance.with_rank(table)
    return instance


def _parse_layer_groups(sink: ProblemSink, raw: Any, tokens: int | None) -> frozenset[int]:
    """``layer_groups``: ``[{id, tokens_per_slot}]``; returns the per-request state groups."""
    if raw is None:
        return frozenset()
    if not isinstance(raw, list):
        sink.add(("layer_groups",), "must be a list of {id, tokens_per_slot}")
        return frozenset()
    state: set[int] = set()
    seen: set[int] = set()
    for position, item in enumerate(raw):
        here: Loc = ("layer_groups", position)
        if not isinstance(item, Mapping):
            sink.add(here, "must be an object")
            continue
        group = _int(sink, item, "id", here, maximum=1 << 20)
        if "tokens_per_slot" not in item:
            sink.add((*here, "tokens_per_slot"), "field required (null: per-request state)")
            continue
        per_slot = item["tokens_per_slot"]
        if group is None:
            continue
        if group in seen:
            sink.add((*here, "id"), f"layer group {group} is listed twice")
            continue
        seen.add(group)
        if per_slot is None:
            state.add(group)
        elif isinstance(per_slot, bool) or not isinstance(per_slot, int):
            sink.add((*here, "tokens_per_slot"), "must be an integer or null")
        elif tokens is not None and per_slot != tokens:
            sink.add(
                (*here, "tokens_per_slot"),
                f"tokens_per_slot {per_slot} differs from the instance's tokens_per_block "
                f"{tokens}: a paged group pages by tokens_per_block; null marks per-request "
                "state",
            )
    return frozenset(state)


def parse_rank(instance: Instance, body: Mapping[str, Any]) -> RankTable:
    """Check one rank's page table against the instance it belongs to."""
    return _parse_rank(instance, body, ())


def _parse_rank(instance: Instance, body: Mapping[str, Any], loc: Loc) -> RankTable:
    sink = ProblemSink()
    rank = _int(sink, body, "rank", loc, maximum=instance.world_size - 1)
    kv_heads = _int(sink, body, "kv_heads_per_rank", loc, minimum=1, required=False)
    metadata = body.get("agent_metadata")
    if metadata is not None and not isinstance(metadata, str):
        sink.add((*loc, "agent_metadata"), "must be a string")
    pools = _parse_pools(sink, body.get("pools"), (*loc, "pools"))
    views = _parse_views(sink, body.get("views"), (*loc, "views"), pools)
    sink.raise_if_any()
    assert rank is not None
    _check_overlaps(sink, views, pools, loc)
    _check_duplicate_layers(sink, views, loc)
    table = RankTable(
        rank=rank,
        pools=pools,
        views=tuple(views),
        kv_heads_per_rank=kv_heads,
        agent_metadata=metadata,
    )
    for view in views:
        try:
            view_geometry(instance, table, view)
        except GeometryError as error:
            for problem in error.problems:
                sink.add((*loc, "views", view.index, *problem.loc), problem.message, problem.code)
    sink.raise_if_any()
    return table


def _parse_pools(sink: ProblemSink, raw: Any, loc: Loc) -> dict[int, Pool]:
    pools: dict[int, Pool] = {}
    if not isinstance(raw, list) or not raw:
        sink.add(loc, "must be a non-empty list of pools")
        return pools
    for position, item in enumerate(raw):
        here: Loc = (*loc, position)
        if not isinstance(item, Mapping):
            sink.add(here, "must be an object")
            continue
        before = len(sink.problems)
        pool_id = _int(sink, item, "id", here)
        group = _int(sink, item, "layer_group", here, default=0)
        slot_bytes = _int(sink, item, "slot_bytes", here, minimum=1, maximum=1 << 40)
        stride = _int(
            sink, item, "slot_stride_bytes", here, minimum=1, maximum=1 << 40, required=False
        )
        slots = _int(sink, item, "num_slots", here, minimum=1, maximum=1 << 32)
        base = _int(sink, item, "base_address", here, maximum=(1 << 64) - 1, default=0)
        if len(sink.problems) > before:
            continue
        assert pool_id is not None and slot_bytes and slots and group is not None
        stride = slot_bytes if stride is None else stride
        if stride < slot_bytes:
            sink.add(
                (*here, "slot_stride_bytes"),
                f"slot_stride_bytes {stride} is smaller than slot_bytes {slot_bytes}",
            )
            continue
        if pool_id in pools:
            sink.add((*here, "id"), f"pool id {pool_id} appears twice")
            continue
        end = (base or 0) + slots * stride
        if end > MAX_ADDRESS:
            # expand() computes base + block × stride in int64: refuse what could wrap.
            sink.add(
                (*here, "num_slots"),
                f"base_address + num_slots × slot_stride_bytes = {end} exceeds 2^63 - 1 "
                "(byte offsets are int64)",
                "invalid_geometry",
            )
            continue
        pools[pool_id] = Pool(pool_id, group, slot_bytes, stride, slots, base or 0)
    return pools


def _parse_views(sink: ProblemSink, raw: Any, loc: Loc, pools: Mapping[int, Pool]) -> list[View]:
    views: list[View] = []
    if not isinstance(raw, list) or not raw:
        sink.add(loc, "must be a non-empty list of views")
        return views
    for position, item in enumerate(raw):
        here: Loc = (*loc, position)
        if not isinstance(item, Mapping):
            sink.add(here, "must be an object")
            continue
        view = _parse_view(sink, item, here, position, pools)
        if view is not None:
            views.append(view)
    return views


def _parse_view(
    sink: ProblemSink, item: Mapping[str, Any], here: Loc, index: int, pools: Mapping[int, Pool]
) -> View | None:
    before = len(sink.problems)
    pool_id = _int(sink, item, "pool", here)
    owner = _choice(sink, item, "owner", here, OWNERS)
    layout = _choice(sink, item, "layout", here, LAYOUTS)
    num_heads = _int(sink, item, "num_kv_heads", here, minimum=1, required=False)
    total_heads = _int(sink, item, "total_kv_heads", here, minimum=1, required=False)
    head_dim = _int(sink, item, "head_dim", here, minimum=1, required=False)
    d_state = _int(sink, item, "d_state", here, minimum=1, required=False)
    sections = _parse_sections(sink, item.get("section_bytes"), (*here, "section_bytes"), layout)
    dtype = item.get("dtype")
    if not isinstance(dtype, str) or not dtype:
        sink.add((*here, "dtype"), "must be a non-empty string")
    roles = item.get("roles")
    if (
        not isinstance(roles, list)
        or not roles
        or not all(isinstance(role, str) and role for role in roles)
    ):
        sink.add((*here, "roles"), "must be a non-empty list of strings")
    elif len(set(roles)) != len(roles):
        sink.add((*here, "roles"), f"roles repeat: {roles}")
    if pool_id is not None and pool_id not in pools:
        sink.add((*here, "pool"), f"pool {pool_id} is not one of this rank's pools {sorted(pools)}")
    buffers = _parse_buffers(sink, item.get("buffers"), (*here, "buffers"))
    if len(sink.problems) > before:
        return None
    assert pool_id is not None and owner and layout and isinstance(dtype, str)
    pool = pools[pool_id]
    for position, buffer in enumerate(buffers):
        if buffer.offset + buffer.size > pool.slot_bytes:
            sink.add(
                (*here, "buffers", position),
                f"buffer [{buffer.offset}, {buffer.offset + buffer.size}) lies outside the "
                f"slot of pool {pool_id} (slot_bytes {pool.slot_bytes})",
            )
    by_layer: dict[int, list[Buffer]] = {}
    for buffer in buffers:
        by_layer.setdefault(buffer.layer, []).append(buffer)
    counts = {layer: len(rows) for layer, rows in by_layer.items()}
    if len(set(counts.values())) > 1:
        first_layer = next(iter(counts))
        odd = next(layer for layer, count in counts.items() if count != counts[first_layer])
        sink.add(
            (*here, "buffers"),
            f"layer {odd} has {counts[odd]} buffers but layer {first_layer} has "
            f"{counts[first_layer]}: every layer of a view needs the same number",
        )
    sizes = sorted({buffer.size for buffer in buffers})
    if len(sizes) > 1:
        odd_row = next(i for i, b in enumerate(buffers) if b.size != buffers[0].size)
        sink.add(
            (*here, "buffers", odd_row, "size"),
            f"buffer size {buffers[odd_row].size} differs from the view's {buffers[0].size}: "
            "every buffer of a view must have the same size",
        )
    if len(sink.problems) > before:
        return None
    ordered = {layer: tuple(by_layer[layer]) for layer in sorted(by_layer)}
    return View(
        index=index,
        pool=pool_id,
        owner=owner,
        roles=frozenset(roles),  # type: ignore[arg-type]
        layout=layout,
        num_kv_heads=num_heads,
        total_kv_heads=total_heads,
        head_dim=head_dim,
        dtype=dtype,
        buffers=tuple(buffers),
        buffers_by_layer=ordered,
        section_bytes=sections,
        d_state=d_state,
    )


def _parse_sections(
    sink: ProblemSink, raw: Any, loc: Loc, layout: str | None
) -> tuple[int, ...] | None:
    """``section_bytes``: required by (and only allowed with) the SECTIONED layout."""
    if layout != "SECTIONED":
        if raw is not None and layout is not None:
            sink.add(loc, f"section_bytes is only allowed with layout SECTIONED, not {layout}")
        return None
    if (
        not isinstance(raw, list)
        or not 0 < len(raw) <= MAX_SECTIONS
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in raw)
    ):
        sink.add(
            loc,
            f"layout SECTIONED needs section_bytes: 1 to {MAX_SECTIONS} positive integers "
            "(TP-aggregated bytes of each section of one buffer)",
        )
        return None
    return tuple(raw)


def _parse_buffers(sink: ProblemSink, raw: Any, loc: Loc) -> list[Buffer]:
    buffers: list[Buffer] = []
    if not isinstance(raw, list) or not raw:
        sink.add(loc, "must be a non-empty list of {layer, offset, size}")
        return buffers
    for position, item in enumerate(raw):
        here: Loc = (*loc, position)
        if not isinstance(item, Mapping):
            sink.add(here, "must be an object")
            continue
        before = len(sink.problems)
        layer = _int(sink, item, "layer", here, maximum=1 << 20)
        offset = _int(sink, item, "offset", here, maximum=1 << 40)
        size = _int(sink, item, "size", here, minimum=1, maximum=1 << 40)
        if len(sink.problems) == before:
            assert layer is not None and offset is not None and size is not None
            buffers.append(Buffer(layer, offset, size))
    return buffers


def _check_overlaps(
    sink: ProblemSink, views: Iterable[View], pools: Mapping[int, Pool], loc: Loc
) -> None:
    """No two buffers of one pool may share a byte (across all views of the pool)."""
    rows: dict[int, list[tuple[int, int, int, int]]] = {}
    for view in views:
        for position, buffer in enumerate(view.buffers):
            rows.setdefault(view.pool, []).append(
                (buffer.offset, buffer.offset + buffer.size, view.index, position)
            )
    for pool_id, intervals in rows.items():
        intervals.sort()
        for (start_a, end_a, view_a, row_a), (start_b, _end_b, view_b, row_b) in zip(
            intervals, intervals[1:], strict=False
        ):
            if start_b < end_a:
                sink.add(
                    (*loc, "views", view_b, "buffers", row_b),
                    f"buffer at offset {start_b} overlaps views.{view_a}.buffers.{row_a} "
                    f"[{start_a}, {end_a}) in pool {pool_id}",
                )


def _check_duplicate_layers(sink: ProblemSink, views: Sequence[View], loc: Loc) -> None:
    """Two views of one rank must not hold the same (owner, roles, layer)."""
    holder: dict[tuple[str, tuple[str, ...], int], int] = {}
    for view in views:
        for layer in view.layers:
            key = (view.owner, view.roles_key, layer)
            if key in holder:
                sink.add(
                    (*loc, "views", view.index),
                    f"layer {layer} ({view.owner}, roles {list(view.roles_key)}) is already held "
                    f"by views.{holder[key]} of this rank",
                    "ambiguous_peer_view",
                )
            else:
                holder[key] = view.index
