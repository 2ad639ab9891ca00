"""Expansion of a plan's templates for one request's block lists.

Block alignment (:mod:`geometry.align`): blocks pair by their token position from the start
of the request. With ``num_tokens`` (``P``) a side of ``T`` tokens per block spans ``N = ⌈P / T⌉``
logical blocks and each list is a suffix of them (element ``k`` of a list of length ``L`` is
logical block ``N − L + k``); without it, the longer list is taken to start at block 0 where that
is exact, and the rest is refused (a generation list longer than the context's:
``invalid_blocks``; a ratio, or CP with layer groups of different lengths:
``ambiguous_alignment``).

Different block sizes (``tokens_per_block`` ``t`` and ``r·t``; HND only, no CP): small block ``s``
pairs with sub-block ``s mod r`` of large block ``⌊s / r⌋``. A segment with ``sub_block = i``
applies to the pairs of sub-block ``i``; the request's partial last small block (``P`` not a
multiple of ``t``) gets its own part, the segment with every run cut to the tokens that exist
(an HND run of one head of one small block holds its tokens contiguously, so the first ``p``
tokens are its first ``p × u`` bytes). No byte past the prompt is written, and every receiver
block the prompt covers is written wherever the context lists it.

Context parallelism (one side only): logical block ``j`` lives on CP rank ``j mod cp``, always by
the logical index in the request, also when either side reused a prefix or lists only a
sliding window's blocks. The CP side's blocks come either as one flat list (element ``k`` names a
slot of CP rank ``j mod cp``) or, for helix generation, as one list per CP rank in ``cp_rank``
order: rank ``c``'s own block table, where logical block ``j`` sits at position ``j // cp``; each
such list is a suffix of the ``⌈(N − c) / cp⌉`` blocks of that rank. The blocks moved are those
present on both sides. Within one rank's blocks a slot id may appear once (``invalid_blocks``
otherwise); every layer group the plan moves must be named.

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

Per-request state groups (segments with ``state``, :mod:`geometry.state`) are not aligned:
each side names its state slot, ``[slot]`` (the same slot on every CP rank of that side) or one
``[slot]`` per CP rank; the segment applies once, to the pair of slots of the route's CP ranks.
``[]`` on either side moves nothing; more than one slot is ``invalid_blocks``. A block-size ratio
never applies to state groups (no tokens): with a ratio the paged groups align by tokens and the
state groups still pair one slot per side.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from geometry.align import (
    RatioPairs,
    align_equal,
    align_ratio,
    parse_side,
    plain_pair,
    request_totals,
    trimmed_length,
)
from geometry.errors import GeometryError, Problem
from geometry.plan import Plan, Route, Segment
from geometry.state import pair_slots, route_cp_ranks, state_slots

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


def _cp_sizes(plan: Plan) -> tuple[int, int]:
    for route in plan.routes:
        if route.cp_modulus > 1:
            if route.cp_side == "context":
                return route.cp_modulus, 1
            return 1, route.cp_modulus
    return 1, 1


def expand(plan: Plan, blocks: BlockLists, num_tokens: int | None = None) -> Expansion:
    """Apply ``plan`` to per-layer-group ``(context_ids, generation_ids)`` block lists.

    Every layer group the plan moves must be named (``[]`` on either side: nothing to move).
    ``num_tokens``: the request's prompt tokens (see :mod:`geometry.align`: blocks align by
    token position; without it, only placements that are exact are accepted).
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
    paged = sorted(group for group in blocks if group not in state_groups)
    totals = request_totals(
        blocks,
        paged,
        num_tokens=num_tokens,
        tokens_per_block=plan.tokens_per_block,
        ratio=ratio,
        cp=max(context_cp, generation_cp),
    )
    small_tpb = min(plan.tokens_per_block, plan.generation_tokens_per_block or 1 << 62)
    aligned: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    pairs: dict[int, RatioPairs] = {}
    for group in paged:
        context_ids, generation_ids = blocks[group]
        loc: tuple[str | int, ...] = ("blocks", str(group))
        if large_side is not None and num_tokens is not None:
            pairs[group] = align_ratio(
                context_ids, generation_ids, loc, ratio, large_side, small_tpb, num_tokens
            )
        elif large_side is not None:  # nothing to move (request_totals refused the rest)
            for side, raw in (("context", context_ids), ("generation", generation_ids)):
                parse_side(raw, (*loc, side), 1)
            empty = np.empty(0, dtype=np.int64)
            pairs[group] = RatioPairs(empty, empty, empty, 0)
        else:
            aligned[group] = align_equal(
                context_ids,
                generation_ids,
                loc,
                totals[group],
                context_cp,
                generation_cp,
                num_tokens,
            )
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
            pieces: list[tuple[Segment, np.ndarray, np.ndarray]] = []
            if segment.state:
                sender_cp, receiver_cp = route_cp_ranks(
                    route.cp_modulus, route.cp_remainder, route.cp_side
                )
                context_slots, generation_slots = slots[segment.layer_group]
                pieces.append(
                    (segment, *pair_slots(context_slots, generation_slots, sender_cp, receiver_cp))
                )
            elif segment.layer_group in pairs:
                ratio_pairs = pairs[segment.layer_group]
                pieces.append((segment, *ratio_pairs.select(segment.sub_block)))
                tail = ratio_pairs.tail(segment.sub_block)
                if tail is not None:
                    pieces.append((_trimmed(segment, ratio_pairs.tail_tokens, small_tpb), *tail))
            else:
                src_blocks, dst_blocks, logical = aligned[segment.layer_group]
                if route.cp_modulus > 1:
                    # Logical block j lives on cp_rank j % cp of the CP side.
                    keep = logical % route.cp_modulus == route.cp_remainder
                    src_blocks, dst_blocks = src_blocks[keep], dst_blocks[keep]
                pieces.append((segment, src_blocks, dst_blocks))
            src_ref = plan.pools[("context", route.sender_rank, segment.src_pool)]
            dst_ref = plan.pools[("generation", route.receiver_rank, segment.dst_pool)]
            for piece, src_blocks, dst_blocks in pieces:
                for side, rank, pool, ref, ids in (
                    ("context", route.sender_rank, segment.src_pool, src_ref, src_blocks),
                    ("generation", route.receiver_rank, segment.dst_pool, dst_ref, dst_blocks),
                ):
                    if ids.size and int(ids.max()) >= ref.num_slots:
                        raise GeometryError(
                            Problem(
                                ("blocks", str(segment.layer_group), side),
                                f"block id {int(ids.max())} is out of range: {side} rank "
                                f"{rank} pool {pool} has {ref.num_slots} slots",
                                "block_out_of_range",
                            )
                        )
                parts.append(
                    RouteBlocks(piece, src_ref.stride, dst_ref.stride, src_blocks, dst_blocks)
                )
        expanded.append(ExpandedRoute(route, tuple(parts)))
    return Expansion(plan, tuple(expanded))


def summarize(
    plan: Plan,
    blocks: BlockLists,
    num_tokens: int | None = None,
    memo: dict[Any, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """``expand(plan, blocks, num_tokens).to_summary()`` (raises alike).

    A summary depends on the block lists only through how many blocks pair, and ``memo`` (a
    dict the caller keeps for this one plan) keeps it per count: lists in the plain case (equal
    block sizes, no CP, no per-request state, no ``num_tokens``; flat lists of distinct ids
    within every pool of their side, the generation's no longer than the context's where both
    list blocks) are checked here in plain Python and take a kept summary; anything else
    expands. The control plane summarizes every engine-path transfer from its first record:
    a batch of them over one plan expands once.
    """
    shape = _plain_shape(plan, blocks) if memo is not None and num_tokens is None else None
    if shape is None or memo is None or shape not in memo:
        summary = expand(plan, blocks, num_tokens).to_summary()
        if shape is not None and memo is not None:
            memo[shape] = summary
    else:
        summary = memo[shape]
    return {**summary, "routes": [dict(route) for route in summary["routes"]]}


def _plain_shape(plan: Plan, blocks: BlockLists) -> tuple[tuple[int, int, int], ...] | None:
    """Per layer group ``(group, context blocks, generation blocks)`` when :func:`expand` would
    take ``blocks`` as they are and pair them from their ends (see :func:`summarize`), else
    None."""
    if plan.block_ratio[1] is not None or plan.state_groups or _cp_sizes(plan) != (1, 1):
        return None
    limits: dict[tuple[str, int], int] = {}
    for (side, _, _), ref in plan.pools.items():
        key = (side, ref.layer_group)
        limits[key] = min(limits.get(key, ref.num_slots), ref.num_slots)
    if set(blocks) != {group for _, group in limits}:
        return None
    shape = []
    for group, (context, generation) in sorted(blocks.items()):
        if not plain_pair(context, generation):
            return None
        for side, ids in (("context", context), ("generation", generation)):
            if ids and max(ids) >= limits.get((side, group), 0):
                return None
        shape.append((group, len(context), len(generation)))
    return tuple(shape)


def _trimmed(segment: Segment, tokens: int, small_tokens_per_block: int) -> Segment:
    """A ratio segment cut to the first ``tokens`` tokens of its small block: every run is one
    head of one small block (``len = t × u``, see :func:`geometry.plan._ratio_runs`)."""
    runs = segment.runs.copy()
    loc = ("blocks", str(segment.layer_group))
    runs[:, 2] = [trimmed_length(int(n), tokens, small_tokens_per_block, loc) for n in runs[:, 2]]
    return replace(segment, runs=runs)
