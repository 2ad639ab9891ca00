"""Expansion of a plan's templates for one request's block lists.

Block alignment: the two lists of a layer group are suffixes of the request's logical blocks
``0 … N−1`` (prefix caching may drop a prefix on either side; ``N`` is the longer list), so the
last ``n = min(len_C, len_R)`` blocks of each are paired. Element ``k`` of a list of length ``L``
is logical block ``j = N − L + k``.

Different block sizes (``tokens_per_block`` ``tpb_C ≠ tpb_R``, the larger ``L`` a multiple
``r`` of the smaller ``S``; HND only, no CP): blocks align by **tokens from the end**. The
transfer covers the last ::

    T = ⌊min(len_C × tpb_C, len_R × tpb_R) / L⌋ × L      tokens,

i.e. the last ``n = T / L`` blocks of the large side and the last ``n × r`` of the small side
(equal sizes: ``T / tpb = min(len_C, len_R)``, the rule above). Large block ``k`` of the aligned
suffix pairs with small blocks ``r·k … r·k + r − 1``; the small side's blocks come as ``[n, r]``
and a segment with ``sub_block = i`` applies to the pairs ``(large[k], small[k, i])``. Assumed:
both lists are whole blocks of suffixes of the *same* token range and end at the same token — a
partial last block is only right when the request's token count is a multiple of ``L`` (with
``70`` tokens, ``tpb`` 16 vs 64, the large side's last block starts at token 64 but the small
side's last four start at 16; aligning by the first token, as TensorRT-LLM's ``dst_start_token``
does, would need each list's first token, which the block lists do not carry).

Context parallelism (one side only): logical block ``j`` lives on CP rank ``j mod cp``, always by
the logical index, also when either side reused a prefix. The CP side's blocks come either as one
flat list (element ``k`` names a slot of CP rank ``j mod cp``) or, for helix generation, as one
list per CP rank in ``cp_rank`` order: rank ``c``'s own block table, where logical block ``j``
sits at position ``j // cp``; each such list is a suffix of the ``⌈(N − c) / cp⌉`` blocks of that
rank. The blocks moved are those present on both sides. Within one rank's blocks a slot id may
appear once (``invalid_blocks`` otherwise); every layer group the plan moves must be named.

For a run ``{src, dst, len, count, src_step, dst_step}`` and block pair ``(bs, bd)`` (with a
ratio: the large block and small block ``sub_block`` of it) the fragments are, for
``c in [0, count)``::

    src = bs × stride_s + run.src + c × run.src_step      (offsets relative to the pool base)
    dst = bd × stride_d + run.dst + c × run.dst_step

Counting bytes and fragments needs no expansion (``n × Σ len·count`` and ``n × Σ count``); the
fragment arrays are built only on request, with numpy broadcasting (no Python loop per block or
token). A request may ask for a window ``[start, stop)`` of the transfer's fragment list (routes
in plan order, then segments, then block-major, then run order): fragment ``i`` of a segment is
block ``i // F`` and fragment ``i mod F`` of the block's template (``F`` fragments per block),
so a window costs memory by its own length, never by the transfer's.

Per-request state groups (segments with ``state``, :mod:`api.geometry.state`) are not aligned:
each side names its state slot, ``[slot]`` (the same slot on every CP rank of that side) or one
``[slot]`` per CP rank; the segment applies once, to the pair of slots of the route's CP ranks.
``[]`` on either side moves nothing; more than one slot is ``invalid_blocks``. A block-size ratio
never applies to state groups (no tokens): with a ratio the paged groups align by tokens and the
state groups still pair one slot per side.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from api.geometry.errors import GeometryError, Problem
from api.geometry.plan import Plan, Route, Segment
from api.geometry.state import pair_slots, route_cp_ranks, state_slots

BlockLists = Mapping[int, tuple[Sequence[int], Sequence[int]]]


@dataclass(frozen=True)
class RouteBlocks:
    """One segment of a route with the aligned block ids it applies to."""

    segment: Segment
    src_stride: int
    dst_stride: int
    src_blocks: np.ndarray
    dst_blocks: np.ndarray

    @property
    def bytes(self) -> int:
        return int(self.src_blocks.size) * self.segment.bytes_per_block

    @property
    def fragments(self) -> int:
        return int(self.src_blocks.size) * self.segment.fragments_per_block

    def fragment_window(self, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` of this part's fragment table (``fragment_rows`` order), as
        ``int64 [n, 5]``, computed from the indices alone (nothing outside the window)."""
        runs = self.segment.runs
        per_block = self.segment.fragments_per_block
        stop = min(stop, self.fragments)
        if per_block == 0 or start >= stop:
            return np.empty((0, 5), dtype=np.int64)
        index = np.arange(start, stop, dtype=np.int64)
        block, within = np.divmod(index, per_block)
        counts = runs[:, 3]
        ends = np.cumsum(counts)
        run_of = np.searchsorted(ends, within, side="right")
        rep = within - (ends - counts)[run_of]
        table = np.empty((index.size, 5), dtype=np.int64)
        table[:, 0] = self.segment.src_pool
        table[:, 1] = self.src_blocks[block] * self.src_stride + runs[run_of, 0]
        table[:, 1] += rep * runs[run_of, 4]
        table[:, 2] = self.segment.dst_pool
        table[:, 3] = self.dst_blocks[block] * self.dst_stride + runs[run_of, 1]
        table[:, 3] += rep * runs[run_of, 5]
        table[:, 4] = runs[run_of, 2]
        return table

    def fragment_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(src_offsets, dst_offsets, lengths)``, block-major, then run order."""
        runs = self.segment.runs
        counts = runs[:, 3]
        run_of = np.repeat(np.arange(len(runs)), counts)
        rep = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        src_in_slot = runs[run_of, 0] + rep * runs[run_of, 4]
        dst_in_slot = runs[run_of, 1] + rep * runs[run_of, 5]
        lengths = runs[run_of, 2]
        src = (self.src_blocks[:, None] * self.src_stride + src_in_slot[None, :]).ravel()
        dst = (self.dst_blocks[:, None] * self.dst_stride + dst_in_slot[None, :]).ravel()
        return src, dst, np.tile(lengths, self.src_blocks.size)


@dataclass(frozen=True)
class ExpandedRoute:
    route: Route
    parts: tuple[RouteBlocks, ...]

    @property
    def bytes(self) -> int:
        return sum(part.bytes for part in self.parts)

    @property
    def fragments(self) -> int:
        return sum(part.fragments for part in self.parts)

    def summary(self) -> dict[str, Any]:
        return {
            "sender_rank": self.route.sender_rank,
            "receiver_rank": self.route.receiver_rank,
            "bytes": self.bytes,
            "fragments": self.fragments,
            "runs": self.route.runs,
            "blocks": max((int(p.src_blocks.size) for p in self.parts), default=0),
        }

    def fragment_rows(self) -> np.ndarray:
        """``[[src_pool, src_offset, dst_pool, dst_offset, length], ...]`` as an int64 array."""
        tables = []
        for part in self.parts:
            src, dst, lengths = part.fragment_arrays()
            table = np.empty((src.size, 5), dtype=np.int64)
            table[:, 0] = part.segment.src_pool
            table[:, 1] = src
            table[:, 2] = part.segment.dst_pool
            table[:, 3] = dst
            table[:, 4] = lengths
            tables.append(table)
        return np.concatenate(tables) if tables else np.empty((0, 5), dtype=np.int64)


@dataclass(frozen=True)
class Expansion:
    """A plan applied to one request's blocks."""

    plan: Plan
    routes: tuple[ExpandedRoute, ...]

    @property
    def bytes(self) -> int:
        return sum(route.bytes for route in self.routes)

    @property
    def fragments(self) -> int:
        return sum(route.fragments for route in self.routes)

    def to_summary(self) -> dict[str, Any]:
        return {
            "routes": [route.summary() for route in self.routes],
            "bytes": self.bytes,
            "fragments": self.fragments,
        }

    def fragment_page(self, offset: int, limit: int) -> dict[str, Any]:
        """Fragments ``[offset, offset + limit)`` of the whole list, per route (every route is
        listed, possibly with none), and where the next page starts (None at the end)."""
        stop = offset + limit
        routes = []
        start = 0  # global index of the current part's first fragment
        for route in self.routes:
            tables = []
            for part in route.parts:
                end = start + part.fragments
                if start < stop and offset < end:
                    tables.append(part.fragment_window(max(offset, start) - start, stop - start))
                start = end
            rows = np.concatenate(tables) if tables else np.empty((0, 5), dtype=np.int64)
            routes.append(
                {
                    "sender_rank": route.route.sender_rank,
                    "receiver_rank": route.route.receiver_rank,
                    "fragments": rows.tolist(),
                }
            )
        return {
            "routes": routes,
            "total": start,
            "offset": offset,
            "limit": limit,
            "next_offset": stop if stop < start else None,
        }

    def to_fragments(self) -> dict[str, Any]:
        return {
            "routes": [
                {
                    "sender_rank": route.route.sender_rank,
                    "receiver_rank": route.route.receiver_rank,
                    "fragments": route.fragment_rows().tolist(),
                }
                for route in self.routes
            ]
        }


def _block_array(ids: Sequence[int], loc: tuple[str | int, ...]) -> np.ndarray:
    array = np.asarray(ids, dtype=np.int64) if len(ids) else np.empty(0, dtype=np.int64)
    if array.ndim != 1:
        raise GeometryError(Problem(loc, "must be a flat list of block ids", "invalid_blocks"))
    if array.size and array.min() < 0:
        raise GeometryError(Problem(loc, "block ids must be ≥ 0", "invalid_blocks"))
    return array


def _no_duplicates(ids: np.ndarray, loc: tuple[str | int, ...]) -> None:
    if ids.size < 2:
        return
    ordered = np.sort(ids)
    repeated = ordered[1:][ordered[1:] == ordered[:-1]]
    if repeated.size:
        raise GeometryError(
            Problem(
                loc,
                f"block id {int(repeated[0])} appears more than once: one slot cannot hold two "
                "blocks of a request",
                "invalid_blocks",
            )
        )


def _is_nested(ids: Sequence[Any]) -> bool:
    return bool(len(ids)) and all(isinstance(item, (list, tuple)) for item in ids)


def _parse_side(
    raw: Sequence[Any], loc: tuple[str | int, ...], cp: int
) -> tuple[list[np.ndarray], bool]:
    """``([ids])`` for a flat list, ``([ids of cp rank 0], …)`` for per-CP-rank lists."""
    if not _is_nested(raw):
        return [_block_array(raw, loc)], False
    if cp < 2:
        raise GeometryError(
            Problem(
                loc,
                "a list of lists (one block table per CP rank) needs CP > 1 on this side",
                "invalid_blocks",
            )
        )
    if len(raw) != cp:
        raise GeometryError(
            Problem(
                loc,
                f"{len(raw)} block lists for {cp} CP ranks: give one list per CP rank, in "
                "cp_rank order",
                "invalid_blocks",
            )
        )
    return [_block_array(ids, (*loc, c)) for c, ids in enumerate(raw)], True


def _logical(
    lists: list[np.ndarray], nested: bool, total: int, cp: int, loc: tuple[str | int, ...]
) -> tuple[np.ndarray, np.ndarray]:
    """``(slots, logical indices)``; duplicates are refused within each rank's blocks."""
    if not nested:
        (ids,) = lists
        logical = total - ids.size + np.arange(ids.size, dtype=np.int64)
        for c in range(cp):  # under CP, a flat list names slots of different ranks
            _no_duplicates(ids[logical % cp == c] if cp > 1 else ids, loc)
        return ids, logical
    slots, logical_parts = [], []
    for c, ids in enumerate(lists):
        _no_duplicates(ids, (*loc, c))
        on_rank = (total - c + cp - 1) // cp  # logical blocks j < total with j % cp == c
        if ids.size > on_rank:
            raise GeometryError(
                Problem(
                    (*loc, c),
                    f"CP rank {c} lists {ids.size} blocks, but a request of {total} blocks has "
                    f"only {on_rank} on that rank",
                    "invalid_blocks",
                )
            )
        slots.append(ids)
        logical_parts.append(c + cp * (on_rank - ids.size + np.arange(ids.size, dtype=np.int64)))
    return np.concatenate(slots), np.concatenate(logical_parts)


def align(
    context_ids: Sequence[Any],
    generation_ids: Sequence[Any],
    group: int,
    context_cp: int = 1,
    generation_cp: int = 1,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(context slots, generation slots, logical block)`` of the blocks present on both sides.

    Each side's list is a suffix of the request's logical blocks ``0 … N−1``, ``N`` the longer
    side's count; a per-CP-rank list is a suffix of that rank's blocks ``j ≡ c (mod cp)``.
    """
    loc: tuple[str | int, ...] = ("blocks", str(group))
    ctx_lists, ctx_nested = _parse_side(context_ids, (*loc, "context"), context_cp)
    gen_lists, gen_nested = _parse_side(generation_ids, (*loc, "generation"), generation_cp)
    total = max(sum(ids.size for ids in ctx_lists), sum(ids.size for ids in gen_lists))
    if not ctx_nested and not gen_nested:  # both flat: the common suffix, no set algebra
        (src,), (dst,) = ctx_lists, gen_lists
        _logical(ctx_lists, False, total, context_cp, (*loc, "context"))
        _logical(gen_lists, False, total, generation_cp, (*loc, "generation"))
        n = min(src.size, dst.size)
        return src[src.size - n :], dst[dst.size - n :], np.arange(total - n, total)
    src, src_logical = _logical(ctx_lists, ctx_nested, total, context_cp, (*loc, "context"))
    dst, dst_logical = _logical(gen_lists, gen_nested, total, generation_cp, (*loc, "generation"))
    logical, src_at, dst_at = np.intersect1d(
        src_logical, dst_logical, assume_unique=True, return_indices=True
    )
    return src[src_at], dst[dst_at], logical


def align_ratio(
    context_ids: Sequence[Any],
    generation_ids: Sequence[Any],
    group: int,
    ratio: int,
    large_side: str,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Different block sizes: ``(context slots, generation slots, large block index)``.

    The small side comes as ``[n, r]``: row ``k`` holds the ``r`` small blocks that large block
    ``k`` pairs with. Both lists end at the request's last token; the last ``n = min(len_L,
    ⌊len_S / r⌋)`` large blocks and the last ``n × r`` small blocks move (``T = n × L`` tokens).
    """
    loc: tuple[str | int, ...] = ("blocks", str(group))
    sides = {}
    for side, raw in (("context", context_ids), ("generation", generation_ids)):
        (ids,), _nested = _parse_side(raw, (*loc, side), 1)
        _no_duplicates(ids, (*loc, side))
        sides[side] = ids
    small_side = "generation" if large_side == "context" else "context"
    large, small = sides[large_side], sides[small_side]
    n = min(large.size, small.size // ratio)
    aligned = {
        large_side: large[large.size - n :],
        small_side: small[small.size - n * ratio :].reshape(n, ratio),
    }
    return aligned["context"], aligned["generation"], np.arange(n, dtype=np.int64)


def _cp_sizes(plan: Plan) -> tuple[int, int]:
    for route in plan.routes:
        if route.cp_modulus > 1:
            if route.cp_side == "context":
                return route.cp_modulus, 1
            return 1, route.cp_modulus
    return 1, 1


def expand(plan: Plan, blocks: BlockLists) -> Expansion:
    """Apply ``plan`` to per-layer-group ``(context_ids, generation_ids)`` block lists.

    Every layer group the plan moves must be named (``[]`` on either side: nothing to move).
    """
    known = {ref.layer_group for ref in plan.pools.values()}
    unknown = sorted(set(blocks) - known)
    if unknown:
        raise GeometryError(
            Problem(
                ("blocks", str(unknown[0])),
                f"layer group {unknown[0]} has no pool on either side (groups: {sorted(known)})",
                "invalid_blocks",
            )
        )
    moved = sorted({s.layer_group for r in plan.routes for s in r.segments} - set(blocks))
    if moved:
        raise GeometryError(
            [
                Problem(
                    ("blocks", str(group)),
                    f"the plan moves layer group {group} but the request has no block lists "
                    "for it: name it (empty lists if it has nothing to move)",
                    "invalid_blocks",
                )
                for group in moved
            ]
        )
    context_cp, generation_cp = _cp_sizes(plan)
    state_groups = plan.state_groups
    ratio, large_side = plan.block_ratio
    aligned = {
        group: (
            align_ratio(context_ids, generation_ids, group, ratio, large_side)
            if large_side is not None
            else align(context_ids, generation_ids, group, context_cp, generation_cp)
        )
        for group, (context_ids, generation_ids) in blocks.items()
        if group not in state_groups
    }
    slots = {
        group: (
            state_slots(context_ids, ("blocks", str(group), "context"), context_cp),
            state_slots(generation_ids, ("blocks", str(group), "generation"), generation_cp),
        )
        for group, (context_ids, generation_ids) in blocks.items()
        if group in state_groups
    }

    expanded = []
    for route in plan.routes:
        parts = []
        for segment in route.segments:
            if segment.state:
                sender_cp, receiver_cp = route_cp_ranks(
                    route.cp_modulus, route.cp_remainder, route.cp_side
                )
                context_slots, generation_slots = slots[segment.layer_group]
                src_blocks, dst_blocks = pair_slots(
                    context_slots, generation_slots, sender_cp, receiver_cp
                )
            else:
                src_blocks, dst_blocks, logical = aligned[segment.layer_group]
                # the small side's [n, r] blocks: this segment fills small block ``sub_block``
                src_blocks, dst_blocks = (
                    ids[:, segment.sub_block] if ids.ndim == 2 else ids
                    for ids in (src_blocks, dst_blocks)
                )
            if route.cp_modulus > 1 and not segment.state:
                # Logical block j lives on cp_rank j % cp of the CP side.
                keep = logical % route.cp_modulus == route.cp_remainder
                src_blocks, dst_blocks = src_blocks[keep], dst_blocks[keep]
            src_ref = plan.pools[("context", route.sender_rank, segment.src_pool)]
            dst_ref = plan.pools[("generation", route.receiver_rank, segment.dst_pool)]
            for side, rank, pool, ref, ids in (
                ("context", route.sender_rank, segment.src_pool, src_ref, src_blocks),
                ("generation", route.receiver_rank, segment.dst_pool, dst_ref, dst_blocks),
            ):
                if ids.size and int(ids.max()) >= ref.num_slots:
                    raise GeometryError(
                        Problem(
                            ("blocks", str(segment.layer_group), side),
                            f"block id {int(ids.max())} is out of range: {side} rank {rank} "
                            f"pool {pool} has {ref.num_slots} slots",
                            "block_out_of_range",
                        )
                    )
            parts.append(
                RouteBlocks(segment, src_ref.stride, dst_ref.stride, src_blocks, dst_blocks)
            )
        expanded.append(ExpandedRoute(route, tuple(parts)))
    return Expansion(plan, tuple(expanded))
