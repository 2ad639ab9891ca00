"""Expansion of a plan's templates for one request's block lists.

Block alignment: the two lists of a layer group are suffixes of the same logical range (prefix
caching may drop a prefix on either side), so the last ``n = min(len_C, len_R)`` blocks of each are
paired. For a run ``{src, dst, len, count, src_step, dst_step}`` and block pair ``(bs, bd)`` the
fragments are, for ``c in [0, count)``::

    src = bs × stride_s + run.src + c × run.src_step      (offsets relative to the pool base)
    dst = bd × stride_d + run.dst + c × run.dst_step

Counting bytes and fragments needs no expansion (``n × Σ len·count`` and ``n × Σ count``); the
fragment arrays are built only on request, with numpy broadcasting (no Python loop per block or
token). A request may ask for a window ``[start, stop)`` of the transfer's fragment list (routes
in plan order, then segments, then block-major, then run order): fragment ``i`` of a segment is
block ``i // F`` and fragment ``i mod F`` of the block's template (``F`` fragments per block),
so a window costs memory by its own length, never by the transfer's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from api.geometry.errors import GeometryError, Problem
from api.geometry.plan import Plan, Route, Segment

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


def expand(plan: Plan, blocks: BlockLists) -> Expansion:
    """Apply ``plan`` to per-layer-group ``(context_ids, generation_ids)`` block lists."""
    known = {ref.layer_group for ref in plan.pools.values()}
    unknown = sorted(set(blocks) - known)
    if unknown:
        raise GeometryError(
            Problem(
                ("blocks", str(unknown[0])),
                f"layer group {unknown[0]} has no pool on either side (groups: "
                f"{sorted(known)})",
                "invalid_blocks",
            )
        )
    aligned: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    skipped: dict[int, tuple[int, int]] = {}  # blocks cut from the front of each list
    for group, (context_ids, generation_ids) in blocks.items():
        src = _block_array(context_ids, ("blocks", str(group), "context"))
        dst = _block_array(generation_ids, ("blocks", str(group), "generation"))
        n = min(src.size, dst.size)
        aligned[group] = (src[src.size - n :], dst[dst.size - n :])
        skipped[group] = (src.size - n, dst.size - n)

    expanded = []
    for route in plan.routes:
        parts = []
        for segment in route.segments:
            if segment.layer_group not in aligned:
                continue
            src_blocks, dst_blocks = aligned[segment.layer_group]
            if route.cp_modulus > 1:
                # Block j of the CP side's own list lives on cp_rank j % cp.
                first = skipped[segment.layer_group][0 if route.cp_side == "context" else 1]
                positions = first + np.arange(src_blocks.size)
                keep = positions % route.cp_modulus == route.cp_remainder
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
