"""A test-side byte-provenance oracle for the planning core.

Independent of ``geometry``'s math: the head geometry, the byte layout of every buffer and
the block alignment are recomputed here from the formulas docs/planning.md states (and the
planning core's module docstrings spell out), and the plan is judged only by what its expanded
fragments do to memory.

Every byte of every view buffer of every rank gets an int64 *label* saying what it holds::

    (tag, owner, roles, layer, buffer index, global head, token, byte-within-head-token)

(REPLICATED: ``(tag, owner, roles, layer, buffer, byte)`` — whole buffer, identical on all ranks).
Per-request state views (layer groups with ``tokens_per_slot: null``) label by their own axis
``G_s = tp × cp`` (1 under attention-DP), ``g_s = tp_rank × cp + cp_rank``: HND ``(…, global SSM
head, 0, byte within head)``; SECTIONED ``(…, section, global byte of the section)`` with the
section split contiguously over ``G_s`` and a rank's shares concatenated in section order. The
request's state slot holds ``tag = STATE_TAG`` on both sides (``[slot]``, or one per CP rank),
whatever the paged groups' block sizes (state has no tokens).
Paged tokens are counted in *small blocks* (``s = min(tokens_per_block)`` of the two sides): token
``τ`` of the request is ``(tag, token) = (τ // s + 1, τ % s)``, the same label on both sides
whatever their block sizes (equal sizes: ``tag`` = logical block + 1). Slots outside the aligned
suffix, and ranks of other attention-DP groups, hold ``tag = 0`` ("other data"), so a fragment that
reads them lands a wrong label. Bytes no view covers are ``-1``.

:func:`check_transfer` fills the active sender pools, applies the fragments and requires that every
byte the receiver needs is written exactly once with exactly its label, and nothing else.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from geometry import Instance, RankTable, View, compile_plan, expand, parse_instance
from geometry.builders import ViewSpec, instance_body
from geometry.state_builders import HybridSpec

# label bit fields (low → high)
_BYTE_BITS, _TOKEN_BITS, _HEAD_BITS, _BUF_BITS, _LAYER_BITS, _ROLES_BITS, _OWNER_BITS = (
    16,
    8,
    8,
    2,
    12,
    3,
    2,
)
_REPL_BITS = 1
_ROLE_CODES: dict[tuple[str, ...], int] = {
    ("key", "value"): 1,
    ("key",): 2,
    ("value",): 3,
    ("conv_state",): 4,
    ("ssm_state",): 5,
}
STATE_TAG = 1
_OWNER_CODES = {"target": 1, "draft": 2}

# The hybrid model of the recurrent-state tests (test_state*.py): a paged attention layer and
# three Mamba layers with SECTIONED conv state and HND SSM state.
HYBRID_SPEC = HybridSpec(
    num_layers=4,
    attention_layers=(1,),
    kv_heads=4,
    head_dim=4,
    ssm_heads=12,
    ssm_head_dim=2,
    d_state=2,
    conv_channels=(24, 12, 12),
    d_conv=2,
    dtype="bfloat16",
    ssm_dtype="float32",
)


def _encode(
    tag: np.ndarray | int,
    owner: str,
    roles: tuple[str, ...],
    layer: int,
    buf: int,
    head: np.ndarray | int,
    token: np.ndarray | int,
    byte: np.ndarray | int,
    replicated: bool,
) -> np.ndarray:
    value: Any = np.asarray(tag, dtype=np.int64)
    for part, bits in (
        (int(replicated), _REPL_BITS),
        (_OWNER_CODES[owner], _OWNER_BITS),
        (_ROLE_CODES.get(roles, 7), _ROLES_BITS),
        (layer, _LAYER_BITS),
        (buf, _BUF_BITS),
    ):
        assert 0 <= part < (1 << bits)
        value = (value << bits) | part
    head_a, token_a, byte_a = (np.asarray(x, dtype=np.int64) for x in (head, token, byte))
    assert (byte_a < (1 << _BYTE_BITS)).all() and (token_a < (1 << _TOKEN_BITS)).all()
    assert (head_a < (1 << _HEAD_BITS)).all()
    value = (value << _HEAD_BITS) | head_a
    value = (value << _TOKEN_BITS) | token_a
    return (value << _BYTE_BITS) | byte_a


def decode(label: int) -> dict[str, int]:
    """The fields of one label (for readable failure messages)."""
    out = {}
    for name, bits in (
        ("byte", _BYTE_BITS),
        ("token", _TOKEN_BITS),
        ("head", _HEAD_BITS),
        ("buf", _BUF_BITS),
        ("layer", _LAYER_BITS),
        ("roles", _ROLES_BITS),
        ("owner", _OWNER_BITS),
        ("replicated", _REPL_BITS),
    ):
        out[name] = int(label) & ((1 << bits) - 1)
        label = int(label) >> bits
    out["tag"] = int(label)
    return out


# ---------------------------------------------------------------------------------------------
# head geometry: shards = min(G, H), replicas = G / shards, shard = g // replicas, h = H / shards,
# heads [shard·h, (shard+1)·h)


@dataclass(frozen=True)
class Geo:
    heads: int  # h (REPLICATED: 0, no head math)
    first_head: int  # global index of the rank's first head
    replicated: bool


def coords(instance: Instance, rank: int) -> tuple[int, int, int]:
    """(pp_rank, tp_rank, cp_rank) from ``rank = pp×(tp×cp) + tp×cp + cp``."""
    pp_rank = rank // (instance.tp * instance.cp)
    tp_rank = (rank % (instance.tp * instance.cp)) // instance.cp
    return pp_rank, tp_rank, rank % instance.cp


def geo(instance: Instance, table: RankTable, view: View) -> Geo:
    if view.layout == "REPLICATED":
        return Geo(0, 0, True)
    if table.pools[view.pool].layer_group in instance.state_groups:
        axis, index = state_axis(instance, table.rank)
        if view.layout == "SECTIONED":  # positions: bytes of section 0, no replicas
            assert view.section_bytes is not None
            share = view.section_bytes[0] // axis
            return Geo(share, index * share, False)
        total = view.total_kv_heads or (view.num_kv_heads or 0) * axis
        shards = min(axis, total)
        h = total // shards
        return Geo(h, (index // (axis // shards)) * h, False)
    group = 1 if instance.attention_dp else instance.tp
    g = 0 if instance.attention_dp else coords(instance, table.rank)[1]
    declared = view.num_kv_heads
    if declared is None:
        declared = table.kv_heads_per_rank or instance.kv_heads_per_rank
    total = view.total_kv_heads
    if total is None and view.owner == "target":  # a draft never takes the target's total
        total = instance.total_kv_heads
    if total is None:
        assert declared is not None, "oracle: no head count at all"
        total = declared * group
    shards = min(group, total)
    assert group % shards == 0 and total % shards == 0
    replicas = group // shards
    h = total // shards
    return Geo(h, (g // replicas) * h, False)


def active(instance: Instance, dp_rank: int | None) -> list[int]:
    ranks = range(instance.tp * instance.pp * instance.cp)
    if not instance.attention_dp:
        return list(ranks)
    return [r for r in ranks if coords(instance, r)[1] == dp_rank]


def is_state(instance: Instance, table: RankTable, view: View) -> bool:
    return table.pools[view.pool].layer_group in instance.state_groups


def state_axis(instance: Instance, rank: int) -> tuple[int, int]:
    """``(G_s, g_s)``, the state axis: ``(1, 0)`` under attention-DP, else
    ``(tp × cp, tp_rank × cp + cp_rank)``."""
    if instance.attention_dp:
        return 1, 0
    _, tp_rank, cp_rank = coords(instance, rank)
    return instance.tp * instance.cp, tp_rank * instance.cp + cp_rank


def state_labels(
    instance: Instance, table: RankTable, view: View, layer: int, buf: int, tag: int
) -> np.ndarray:
    """Label one state buffer: SSM heads (HND), sections (SECTIONED) or a whole region."""
    size = view.buffers_by_layer[layer][buf].size
    b = np.arange(size, dtype=np.int64)
    roles = tuple(sorted(view.roles))
    axis, index = state_axis(instance, table.rank)
    if view.layout == "REPLICATED":
        return _encode(tag, view.owner, roles, layer, buf, 0, 0, b, True)
    if view.layout == "SECTIONED":
        assert view.section_bytes is not None
        section = np.empty(size, dtype=np.int64)
        position = np.empty(size, dtype=np.int64)
        start = 0
        for i, total in enumerate(view.section_bytes):
            share = total // axis
            section[start : start + share] = i
            position[start : start + share] = index * share + np.arange(share)
            start += share
        assert start == size, "oracle: sections do not fill the buffer"
        token, byte = np.divmod(position, 1 << _BYTE_BITS)
        return _encode(tag, view.owner, roles, layer, buf, section, token, byte, False)
    total = view.total_kv_heads
    if total is None:
        assert view.num_kv_heads is not None
        total = view.num_kv_heads * axis
    shards = min(axis, total)
    replicas = axis // shards
    h = total // shards
    head, byte = np.divmod(b, size // h)
    first = (index // replicas) * h
    return _encode(tag, view.owner, roles, layer, buf, first + head, 0, byte, False)


def buffer_labels(
    instance: Instance,
    table: RankTable,
    view: View,
    layer: int,
    buf: int,
    tag: int,
    small: int | None = None,
    window: tuple[int, int] | None = None,
) -> np.ndarray:
    """Label every byte of one buffer: HND ``[heads][tokens][…]``, NHD ``[tokens][heads][…]``.

    ``tag - 1`` is the slot's first token in small blocks of ``small`` tokens (0: other data);
    state buffers ignore ``small`` (no tokens). ``window = (lo, hi)``: bytes of tokens of the
    request outside ``[lo, hi)`` are ``-1`` (not to be written).
    """
    if is_state(instance, table, view):
        return state_labels(instance, table, view, layer, buf, tag)
    size = view.buffers_by_layer[layer][buf].size
    b = np.arange(size, dtype=np.int64)
    g = geo(instance, table, view)
    roles = tuple(sorted(view.roles))
    if g.replicated:
        return _encode(tag, view.owner, roles, layer, buf, 0, 0, b, True)
    tokens = instance.tokens_per_block
    assert size % (g.heads * tokens) == 0, "oracle: registered bytes do not split"
    cell = size // (g.heads * tokens)  # bytes of one (head, token)
    if view.layout == "HND":
        head, rest = np.divmod(b, tokens * cell)
        token, byte = np.divmod(rest, cell)
    else:
        token, rest = np.divmod(b, g.heads * cell)
        head, byte = np.divmod(rest, cell)
    small = small or tokens
    tags = tag + token // small if tag else 0
    labels = _encode(
        tags, view.owner, roles, layer, buf, g.first_head + head, token % small, byte, False
    )
    if window is not None and tag:
        position = (tags - 1) * small + token % small  # the token of the request
        labels[(position < window[0]) | (position >= window[1])] = -1
    return labels


def pool_memory(
    instance: Instance,
    rank: int,
    pool_id: int,
    tags: Mapping[int, int],
    keep: Any = None,
    default_tag: int | None = 0,
    small: int | None = None,
    window: tuple[int, int] | None = None,
) -> np.ndarray:
    """Labels of a whole pool (``num_slots × stride`` bytes); slot ``s`` holds ``tags[s]``.

    ``keep(view, layer)`` restricts which buffers are labelled (others stay ``-1``); ``window``:
    see :func:`buffer_labels`.
    """
    table = instance.ranks[rank]
    assert table is not None
    pool = table.pools[pool_id]
    memory = np.full(pool.num_slots * pool.slot_stride_bytes, -1, dtype=np.int64)
    for slot in range(pool.num_slots):
        tag = tags.get(slot, default_tag)
        if tag is None:
            continue
        base = slot * pool.slot_stride_bytes
        for view in table.views:
            if view.pool != pool_id:
                continue
            for layer, rows in view.buffers_by_layer.items():
                if keep is not None and not keep(view, layer):
                    continue
                for buf, row in enumerate(rows):
                    start = base + row.offset
                    memory[start : start + row.size] = buffer_labels(
                        instance, table, view, layer, buf, tag, small, window
                    )
    return memory


def _expand_indices(offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    within = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(
        np.cumsum(lengths) - lengths, lengths
    )
    return np.repeat(offsets, lengths) + within


def _logical_pairs(ids: Sequence[Any], total: int, cp: int) -> list[tuple[int, int]]:
    """``(slot, logical block)`` of one side, logical blocks counted from the request's start.

    A flat list is a suffix of the request's blocks ``0 … total−1``; a list of lists holds one
    block table per CP rank ``c``: a suffix of that rank's blocks ``j ≡ c (mod cp)``, logical
    block ``j`` at position ``j // cp``.
    """
    if ids and all(isinstance(item, (list, tuple)) for item in ids):
        pairs = []
        for c, rank_ids in enumerate(ids):
            own = [j for j in range(total) if j % cp == c]
            pairs += list(zip(rank_ids, own[len(own) - len(rank_ids) :], strict=True))
        return pairs
    return list(zip(ids, range(total - len(ids), total), strict=True))


def _count(ids: Sequence[Any]) -> int:
    if ids and all(isinstance(item, (list, tuple)) for item in ids):
        return sum(len(item) for item in ids)
    return len(ids)


def aligned_tags(
    ids_c: Sequence[Any],
    ids_g: Sequence[Any],
    cp_g: int = 1,
    tpb_c: int = 1,
    tpb_g: int = 1,
    num_tokens: int | None = None,
    cp_c: int = 1,
) -> tuple[list[tuple[int, int]], list[tuple[int, int]], tuple[int, int] | None]:
    """``(slot, tag)`` per side for the blocks present on both sides, ``tag = logical + 1``, and
    the token window the receiver must get (None: whole blocks).

    A request of ``P = num_tokens`` tokens spans ``⌈P / tpb⌉`` blocks per side and every list
    ends with the block of token ``P − 1`` (without ``num_tokens``: the longer list starts at
    block 0). Different block sizes: a slot's tag is its first token in small blocks, plus 1;
    the tokens ``[max(first token of each list), P)`` move, exactly (no byte past ``P``).
    """
    if tpb_c != tpb_g:
        assert num_tokens is not None, "oracle: a ratio needs num_tokens"
        small = min(tpb_c, tpb_g)
        firsts = []
        for ids, tpb in ((ids_c, tpb_c), (ids_g, tpb_g)):
            total = -(-num_tokens // tpb)
            firsts.append([(total - len(ids) + k) * tpb for k in range(len(ids))])
        lo = max((f[0] for f in firsts if f), default=num_tokens)
        if not all(firsts):
            lo = num_tokens  # a side lists nothing: nothing moves
        out = []
        for ids, tpb, first in ((ids_c, tpb_c, firsts[0]), (ids_g, tpb_g, firsts[1])):
            out.append(
                [(slot, f // small + 1) for slot, f in zip(ids, first, strict=True)
                 if f + tpb > lo and f < num_tokens]
            )  # fmt: skip
        return out[0], out[1], (lo, num_tokens)
    total = max(_count(ids_c), _count(ids_g))
    if num_tokens is not None:
        total = -(-num_tokens // tpb_c)
    ctx = _logical_pairs(list(ids_c), total, cp_c)
    gen = _logical_pairs(list(ids_g), total, cp_g)
    common = {j for _, j in ctx} & {j for _, j in gen}
    return (
        [(slot, j + 1) for slot, j in ctx if j in common],
        [(slot, j + 1) for slot, j in gen if j in common],
        None,
    )


def state_slot(ids: Sequence[Any], instance: Instance, rank: int) -> int | None:
    """The request's state slot on ``rank``: ``[s]`` on every CP rank, or ``[[s0], [s1], …]``."""
    if not ids:
        return None
    cp_rank = coords(instance, rank)[2]
    first = ids[cp_rank] if isinstance(ids[0], (list, tuple)) else ids
    assert len(first) <= 1
    return int(first[0]) if first else None


def _cp_share(instance: Instance, rank: int, tags: Sequence[tuple[int, int]]) -> dict[int, int]:
    """Under CP, logical block ``j`` (tag ``j + 1``) lives on ``cp_rank = j % cp`` only."""
    cp_rank = coords(instance, rank)[2]
    return {slot: tag for slot, tag in tags if (tag - 1) % instance.cp == cp_rank}


def check_transfer(
    ctx: Instance,
    gen: Instance,
    blocks: tuple[Sequence[int], Sequence[int]] | Mapping[int, tuple[Sequence[int], Sequence[int]]],
    context_dp_rank: int | None = None,
    generation_dp_rank: int | None = None,
    plan: Any = None,
    num_tokens: int | None = None,
) -> SimpleNamespace:
    """Compile (unless given), expand one request and check every receiver byte.

    ``blocks``: ``(context_ids, generation_ids)`` of layer group 0, or a dict per layer group;
    ``num_tokens``: the request's prompt tokens (see :func:`aligned_tags`).
    """
    if plan is None:
        plan = compile_plan(ctx, gen, context_dp_rank, generation_dp_rank)
    if not isinstance(blocks, Mapping):
        blocks = {0: blocks}
    expansion = expand(
        plan, {g: (list(c), list(r)) for g, (c, r) in blocks.items()}, num_tokens=num_tokens
    )
    state_groups = ctx.state_groups | gen.state_groups
    tpbs = (ctx.tokens_per_block, gen.tokens_per_block)
    small = min(tpbs)
    tags_by_group = {
        g: aligned_tags(c, r, gen.cp, *tpbs, num_tokens=num_tokens, cp_c=ctx.cp)
        for g, (c, r) in blocks.items()
        if g not in state_groups
    }
    state_ids = {g: (c, r) for g, (c, r) in blocks.items() if g in state_groups}

    def state_tags(instance: Instance, rank: int, group: int, side: int) -> dict[int, int]:
        ids = state_ids.get(group, ([], []))
        if any(not part for part in ids):  # either side names no slot: nothing moves
            return {}
        slot = state_slot(ids[side], instance, rank)
        return {} if slot is None else {slot: STATE_TAG}

    senders = active(ctx, context_dp_rank)
    receivers = active(gen, generation_dp_rank)

    held = set()
    for rank in senders:
        table = ctx.ranks[rank]
        assert table is not None
        for view in table.views:
            for layer in view.layers:
                held.add((view.owner, tuple(sorted(view.roles)), layer))

    def needed(view: View, layer: int) -> bool:
        return (view.owner, tuple(sorted(view.roles)), layer) in held

    sender_memory: dict[tuple[int, int], np.ndarray] = {}
    for rank, table in enumerate(ctx.ranks):
        assert table is not None
        for pool_id, pool in table.pools.items():
            group_tags = tags_by_group.get(pool.layer_group, ([], [], None))[0]
            tags = _cp_share(ctx, rank, group_tags) if rank in senders else {}
            if pool.layer_group in state_groups:
                tags = state_tags(ctx, rank, pool.layer_group, 0) if rank in senders else {}
            sender_memory[(rank, pool_id)] = pool_memory(ctx, rank, pool_id, tags, small=small)

    expected: dict[tuple[int, int], np.ndarray] = {}
    written: dict[tuple[int, int], np.ndarray] = {}
    count: dict[tuple[int, int], np.ndarray] = {}
    for rank, table in enumerate(gen.ranks):
        assert table is not None
        for pool_id, pool in table.pools.items():
            aligned = tags_by_group.get(pool.layer_group, ([], [], None))
            group_tags = _cp_share(gen, rank, aligned[1])
            if pool.layer_group in state_groups:
                group_tags = state_tags(gen, rank, pool.layer_group, 1)
            if rank in receivers:
                want = pool_memory(
                    gen,
                    rank,
                    pool_id,
                    group_tags,
                    keep=needed,
                    default_tag=None,
                    small=small,
                    window=aligned[2],
                )
            else:
                want = np.full(pool.num_slots * pool.slot_stride_bytes, -1, dtype=np.int64)
            expected[(rank, pool_id)] = want
            written[(rank, pool_id)] = np.full_like(want, -1)
            count[(rank, pool_id)] = np.zeros(want.size, dtype=np.int64)

    total_bytes = total_rows = 0
    for route in expansion.routes:
        s, r = route.route.sender_rank, route.route.receiver_rank
        assert s in senders, f"route from inactive sender rank {s}"
        assert r in receivers, f"route into inactive receiver rank {r}"
        rows = route.fragment_rows()
        total_rows += len(rows)
        total_bytes += int(rows[:, 4].sum()) if len(rows) else 0
        for src_pool, dst_pool in {(int(a), int(b)) for a, b in rows[:, [0, 2]]}:
            sel = rows[(rows[:, 0] == src_pool) & (rows[:, 2] == dst_pool)]
            assert (sel[:, 4] > 0).all()
            src_idx = _expand_indices(sel[:, 1], sel[:, 4])
            dst_idx = _expand_indices(sel[:, 3], sel[:, 4])
            src_mem = sender_memory[(s, src_pool)]
            assert src_idx.min() >= 0 and src_idx.max() < src_mem.size, "read outside the pool"
            assert dst_idx.min() >= 0 and dst_idx.max() < written[(r, dst_pool)].size
            written[(r, dst_pool)][dst_idx] = src_mem[src_idx]
            np.add.at(count[(r, dst_pool)], dst_idx, 1)

    needed_bytes = 0
    for key, want in expected.items():
        need = want >= 0
        needed_bytes += int(need.sum())
        got_count = count[key]
        bad_extra = np.flatnonzero(~need & (got_count > 0))
        assert bad_extra.size == 0, (
            f"receiver rank {key[0]} pool {key[1]}: {bad_extra.size} bytes written that no "
            f"needed view covers, first at {bad_extra[0]}"
        )
        twice = np.flatnonzero(need & (got_count != 1))
        assert twice.size == 0, (
            f"receiver rank {key[0]} pool {key[1]}: byte {twice[0]} written "
            f"{got_count[twice[0]]} times (wants {decode(want[twice[0]])})"
        )
        wrong = np.flatnonzero(need & (written[key] != want))
        assert wrong.size == 0, (
            f"receiver rank {key[0]} pool {key[1]}: {wrong.size} wrong bytes; byte {wrong[0]} "
            f"holds {decode(written[key][wrong[0]])}, wants {decode(want[wrong[0]])}"
        )
    assert total_bytes == needed_bytes == expansion.bytes
    assert total_rows == expansion.fragments
    return SimpleNamespace(plan=plan, expansion=expansion, bytes=needed_bytes)


# ---------------------------------------------------------------------------------------------
# building pairs


def build(role: str, views: Sequence[ViewSpec], name: str | None = None, **kwargs: Any) -> Instance:
    kwargs.setdefault("num_slots", 8)
    body = instance_body(role=role, views=views, **kwargs)
    return parse_instance(body, name or role[:3])


def load_balance_violations(plan: Any, ctx: Instance, gen: Instance | None = None) -> list[str]:
    """Per sender shard: no holder sends more than ``ceil(total / holders)`` of its bytes.

    The unit of election is one layer of one receiver slice, so a holder may exceed the even
    share by less than one such unit. The shard key includes the layer group (block counts differ
    per group) and, under helix CP, the receiver's CP rank (its blocks differ from its peers').
    """
    active_senders = sorted({r for (side, r, _), _ in plan.pools.items() if side == "context"})
    served: dict[tuple[Any, ...], dict[int, int]] = {}
    unit: dict[tuple[Any, ...], int] = {}
    for route in plan.routes:
        for piece in route.slices:
            stage, _tp, cp_rank = coords(ctx, route.sender_rank)
            table = ctx.ranks[route.sender_rank]
            assert table is not None
            view = table.views[piece["sender_view"]]
            g = geo(ctx, table, view)
            group = table.pools[view.pool].layer_group
            receiver_cp = coords(gen, route.receiver_rank)[2] if gen is not None else 0
            shards = [0] if g.replicated else _shards_of(piece["global_heads"], g.heads)
            for shard in shards:
                key = (
                    stage,
                    cp_rank,
                    piece["owner"],
                    tuple(piece["roles"]),
                    group,
                    shard,
                    receiver_cp,
                )
                per_layer = piece["bytes_per_block"] // len(piece["layers"]) // len(shards)
                served.setdefault(key, {}).setdefault(route.sender_rank, 0)
                served[key][route.sender_rank] += per_layer * len(piece["layers"])
                unit[key] = max(unit.get(key, 0), per_layer)
    problems = []
    for key, per_holder in served.items():
        stage, cp_rank, owner, roles, _group, shard, _receiver_cp = key
        holders = []
        for rank in active_senders:
            if coords(ctx, rank)[0] != stage or coords(ctx, rank)[2] != cp_rank:
                continue
            table = ctx.ranks[rank]
            assert table is not None
            for view in table.views:
                if view.owner == owner and tuple(sorted(view.roles)) == roles:
                    g = geo(ctx, table, view)
                    if g.replicated or g.first_head // g.heads == shard:
                        holders.append(rank)
        assert set(per_holder) <= set(holders), (key, per_holder, holders)
        limit = math.ceil(sum(per_holder.values()) / len(set(holders))) + unit[key] - 1
        if max(per_holder.values()) > limit:
            problems.append(f"{key}: {per_holder} over {len(holders)} holders (limit {limit})")
    return problems


def _shards_of(global_heads: Sequence[int], heads: int) -> list[int]:
    lo, hi = global_heads
    return list(range(lo // heads, (hi - 1) // heads + 1))


@pytest.fixture(scope="session")
def oracle() -> SimpleNamespace:
    """The oracle's helpers (tests/geometry has no package, so they travel as a fixture)."""
    return SimpleNamespace(
        build=build,
        check_transfer=check_transfer,
        load_balance_violations=load_balance_violations,
        decode=decode,
        geo=geo,
        coords=coords,
        active=active,
        pool_memory=pool_memory,
        aligned_tags=aligned_tags,
        ViewSpec=ViewSpec,
        state_axis=state_axis,
        STATE_TAG=STATE_TAG,
    )
