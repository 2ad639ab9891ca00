"""Execute one route's transfer template over torch pools: gather, scatter, direct copy.

A route (sender rank → receiver rank) carries segments ``{src_pool, dst_pool, layer_group, runs}``;
for every aligned block pair ``(bs[j], bd[j])`` of the segment's layer group and every run,

    for c in range(count):
        d = bd·stride_d + run.dst + c·dst_step;  s = bs·stride_s + run.src + c·src_step
        dst[d : d + len] = src[s : s + len]

**Staging layout** (what :func:`gather` produces and :func:`scatter` consumes, and what travels in
one NIXL WRITE): layer groups in ascending order; inside a layer group block-major (``j`` = index
into the block lists), then the group's segments in route order, then runs in order, then ``c``,
then bytes. A layer group's area is ``n_blocks × bytes_per_block(group)`` bytes, so any block range
``[j0, j1)`` of a group is one contiguous byte range: chunks of blocks pipeline naturally.

**Block-size ratio** (``route.block_ratio = r > 1``): blocks pair by token position, so the pairs
of sub-block ``i`` and the request's partial last small block differ in number per request.
:func:`align_request` turns the plan's route into the route this request runs: one *lane* per
sub-block (a request-local layer-group key with plain ``[n]`` lists) and one for a partial last
small block, whose runs are cut to the tokens that exist. A small side given as an ``[n, r]``
array (segment ``sub_block = i`` applies to ``(large[j], small[j, i])``) still executes, for
callers that pair whole large blocks themselves. Per-request state groups (segments with
``state``) have no tokens: they pair one slot per side with or without a ratio.

**How bytes move.** Consecutive runs with the same ``len``/``count``/steps and constant offset
deltas form a *family* (an HND or NHD head slice over all layers is one family). Block pairs are cut
into maximal arithmetic progressions (a contiguous allocation is one). Each (progression × family)
is then a single ``copy_`` between two 4-D ``as_strided`` views ``[blocks, runs, count, len]`` —
no Python work per block, run, token or byte in the regular case. Measured on the 2-core dev CPU,
a strided ``copy_`` moves 0.96× (HND) and 0.77× (NHD, 512-byte runs) of a plain contiguous
``copy_``, while ``index_select`` on strided uint8 views moves 0.1–0.2×; so on CPU the
progression path is the default. On CUDA the default is the *index* path: per family one
``index_select``/``index_copy_`` over all blocks (bytes widened to 8/4/2-byte words when every
offset allows), i.e. a fixed number of kernel launches per route regardless of block count.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from geometry.align import plain_pair
from workers.crc import crc32
from workers.pools import Pool

if TYPE_CHECKING:
    import torch

Method = Literal["auto", "strided", "index"]
Blocks = Mapping[int, Sequence[int] | np.ndarray | Any] | Sequence[int] | np.ndarray


class TemplateError(ValueError):
    """The route's template does not fit the pools it is applied to."""


class BlockRangeError(ValueError):
    """A block list is unusable (id out of range, duplicate destination, length mismatch);
    ``code`` is ``invalid_blocks``, or ``ambiguous_alignment`` for lists that only
    ``num_tokens`` can place."""

    def __init__(self, message: str, code: str = "invalid_blocks") -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Run:
    src: int
    dst: int
    len: int
    count: int = 1
    src_step: int = 0
    dst_step: int = 0

    @property
    def nbytes(self) -> int:
        return self.len * self.count


@dataclass(frozen=True)
class Segment:
    src_pool: int
    dst_pool: int
    runs: tuple[Run, ...]
    layer_group: int = 0
    state: bool = False  # per-request state: applied once, to each side's state slot
    sub_block: int = 0  # with a block-size ratio: which small block of the large one

    @functools.cached_property
    def bytes_per_block(self) -> int:
        return sum(r.nbytes for r in self.runs)

    @functools.cached_property
    def fragments(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One block pair's fragments in order: ``(src offsets, dst offsets, lengths)``, the
        offsets relative to each side's slot."""
        runs = self.runs
        cnt = np.array([r.count for r in runs], dtype=np.int64)
        rep = np.repeat(np.arange(len(runs)), cnt)
        c = np.arange(cnt.sum()) - np.repeat(np.cumsum(cnt) - cnt, cnt)
        fsrc = np.array([r.src for r in runs])[rep] + c * np.array([r.src_step for r in runs])[rep]
        fdst = np.array([r.dst for r in runs])[rep] + c * np.array([r.dst_step for r in runs])[rep]
        flen = np.array([r.len for r in runs], dtype=np.int64)[rep]
        for a in (fsrc, fdst, flen):
            a.flags.writeable = False
        return fsrc, fdst, flen


@dataclass(frozen=True)
class Route:
    sender_rank: int
    receiver_rank: int
    segments: tuple[Segment, ...]
    # With CP on one side the route carries only the blocks j of that side's own list
    # (its whole sequence) with j % modulus == remainder.
    cp_modulus: int = 1
    cp_remainder: int = 0
    cp_side: str | None = None
    # Different tokens_per_block: larger / smaller, the side with the larger blocks, and the
    # smaller tokens_per_block (a partial last block is cut to whole tokens of it).
    block_ratio: int = 1
    large_side: str | None = None
    small_tokens_per_block: int | None = None

    # Cached: a route is immutable and the hot path asks these for every request.
    @functools.cached_property
    def layer_groups(self) -> tuple[int, ...]:
        return tuple(sorted({s.layer_group for s in self.segments}))

    @functools.cached_property
    def state_groups(self) -> frozenset[int]:
        """Layer groups of per-request state (one slot per side, no block alignment)."""
        return frozenset(s.layer_group for s in self.segments if s.state)

    @functools.cached_property
    def _group_bytes(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for s in self.segments:
            out[s.layer_group] = out.get(s.layer_group, 0) + s.bytes_per_block
        return out

    def bytes_per_block(self, layer_group: int) -> int:
        """Staged bytes per aligned block pair of ``layer_group``."""
        return self._group_bytes.get(layer_group, 0)

    @functools.cached_property
    def fragments_per_block(self) -> int:
        """Fragments (descriptors) per aligned block pair, over every segment."""
        return sum(run.count for seg in self.segments for run in seg.runs)

    @functools.cached_property
    def fingerprint(self) -> str:
        """A digest of the whole template: equal routes (e.g. from two fetches of one plan)
        share it, so caches keyed by it survive a directory refresh."""
        return hashlib.blake2b(repr(self).encode(), digest_size=16).hexdigest()

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Route:
        """Parse the plan's JSON route (``GET /v1/pairings/{id}/plan`` → ``routes[]``)."""
        segs = []
        for s in d["segments"]:
            runs = tuple(
                Run(
                    src=int(r["src"]),
                    dst=int(r["dst"]),
                    len=int(r["len"]),
                    count=int(r.get("count", 1)),
                    src_step=int(r.get("src_step", 0)),
                    dst_step=int(r.get("dst_step", 0)),
                )
                for r in s["runs"]
            )
            segs.append(
                Segment(
                    int(s["src_pool"]),
                    int(s["dst_pool"]),
                    runs,
                    int(s.get("layer_group", 0)),
                    state=bool(s.get("state", False)),
                    sub_block=int(s.get("sub_block", 0)),
                )
            )
        return cls(
            int(d.get("sender_rank", 0)),
            int(d.get("receiver_rank", 0)),
            tuple(segs),
            int(d.get("cp_modulus", 1)),
            int(d.get("cp_remainder", 0)),
            d.get("cp_side"),
            int(d.get("block_ratio", 1)),
            d.get("large_side"),
            None if d.get("small_tokens_per_block") is None else int(d["small_tokens_per_block"]),
        )


def as_route(route: Route | Mapping[str, Any]) -> Route:
    return route if isinstance(route, Route) else Route.from_dict(route)


# --- compiled templates ---------------------------------------------------------------------


@dataclass(frozen=True)
class _Family:
    """``n`` runs spaced ``src_delta``/``dst_delta`` apart, each ``count × len`` bytes."""

    src0: int
    dst0: int
    stage0: int  # offset of the first run inside the segment's per-block staging bytes
    len: int
    count: int
    src_step: int
    dst_step: int
    n: int
    src_delta: int
    dst_delta: int

    @property
    def src_extent(self) -> int:
        return (
            self.src0 + (self.n - 1) * self.src_delta + (self.count - 1) * self.src_step + self.len
        )

    @property
    def dst_extent(self) -> int:
        return (
            self.dst0 + (self.n - 1) * self.dst_delta + (self.count - 1) * self.dst_step + self.len
        )


@functools.lru_cache(maxsize=1024)
def _families(seg: Segment) -> tuple[_Family, ...]:
    fams: list[_Family] = []
    stage = 0
    for r in seg.runs:
        if r.len <= 0 or r.count <= 0 or r.src < 0 or r.dst < 0:
            raise TemplateError(f"run {r}: len/count must be positive and offsets non-negative")
        if r.count > 1 and (r.src_step < 0 or r.dst_step <= 0):
            raise TemplateError(f"run {r}: steps must be non-negative (dst_step positive)")
        # Steps are meaningless for count == 1; normalising them lets such runs merge.
        ss, ds = (r.src_step, r.dst_step) if r.count > 1 else (0, 0)
        f = fams[-1] if fams else None
        if (
            f is not None
            and (f.len, f.count, f.src_step, f.dst_step) == (r.len, r.count, ss, ds)
            and (
                (f.n == 1 and r.src >= f.src0 and r.dst > f.dst0)
                or (
                    f.n > 1
                    and r.src - f.src0 == f.n * f.src_delta
                    and r.dst - f.dst0 == f.n * f.dst_delta
                )
            )
        ):
            fams[-1] = _Family(
                f.src0, f.dst0, f.stage0, f.len, f.count, f.src_step, f.dst_step, f.n + 1,
                r.src - f.src0 if f.n == 1 else f.src_delta,
                r.dst - f.dst0 if f.n == 1 else f.dst_delta,
            )  # fmt: skip
        else:
            fams.append(_Family(r.src, r.dst, stage, r.len, r.count, ss, ds, 1, 0, 0))
        stage += r.nbytes
    return tuple(fams)


# --- staging layout -------------------------------------------------------------------------


@dataclass(frozen=True)
class StagingChunk:
    """Blocks ``[start, stop)`` of one layer group: staging bytes ``[offset, offset + nbytes)``."""

    layer_group: int
    start: int
    stop: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class StagingLayout:
    """Where each layer group's staged bytes live (offsets relative to the route's area)."""

    groups: tuple[tuple[int, int, int, int], ...]  # (layer_group, offset, bytes_per_block, n)
    nbytes: int

    def group(self, layer_group: int) -> tuple[int, int, int]:
        """``(offset, bytes_per_block, n_blocks)`` of ``layer_group``."""
        for g, off, bpb, n in self.groups:
            if g == layer_group:
                return off, bpb, n
        raise KeyError(layer_group)

    def chunks(self, chunk_blocks: int | None = None) -> list[StagingChunk]:
        """Split into chunks of at most ``chunk_blocks`` blocks (None: one chunk per group)."""
        out = []
        for g, off, bpb, n in self.groups:
            step = chunk_blocks if chunk_blocks else n
            for j0 in range(0, n, max(step, 1)):
                j1 = min(n, j0 + step)
                out.append(StagingChunk(g, j0, j1, off + j0 * bpb, (j1 - j0) * bpb))
        return out


def normalize_blocks(route: Route, blocks: Blocks, what: str) -> dict[int, np.ndarray]:
    """``blocks`` as one int64 array per layer group of ``route`` (``[n]``, or ``[n, r]``)."""
    if isinstance(blocks, Mapping):
        got = {int(g): v for g, v in blocks.items()}
        missing = [g for g in route.layer_groups if g not in got]
        if missing:
            raise BlockRangeError(f"{what}: no block list for layer group(s) {missing}")
    else:
        got = {g: blocks for g in route.layer_groups}
    out = {}
    for g in route.layer_groups:
        v = got[g]
        if hasattr(v, "detach"):  # a torch tensor
            v = v.detach().cpu().numpy()
        arr = np.asarray(v, dtype=np.int64)
        out[g] = arr if arr.ndim == 2 else arr.reshape(-1)  # [n, r]: a ratio's small side
    return out


def _column(ids: np.ndarray, seg: Segment) -> np.ndarray:
    """The ids a segment applies to: column ``sub_block`` of a small side's ``[n, r]`` array."""
    return np.ascontiguousarray(ids[:, seg.sub_block]) if ids.ndim == 2 else ids


def _logical_ids(side: Any, total: int, cp: int) -> tuple[np.ndarray, np.ndarray]:
    """``(slot ids, logical block indices)`` of one side (see :func:`align_blocks`)."""
    if len(side) and all(isinstance(x, (list, tuple, np.ndarray)) for x in side):
        ids, logical = [], []
        for c, rank_ids in enumerate(side):
            arr = np.asarray(rank_ids, dtype=np.int64).reshape(-1)
            on_rank = (total - c + cp - 1) // cp
            ids.append(arr)
            logical.append(c + cp * (on_rank - arr.size + np.arange(arr.size, dtype=np.int64)))
        return np.concatenate(ids), np.concatenate(logical)
    arr = np.asarray(side, dtype=np.int64).reshape(-1)
    return arr, total - arr.size + np.arange(arr.size, dtype=np.int64)


def _flat(side: Any) -> bool:
    """A flat id list (not one list per CP rank)."""
    if isinstance(side, np.ndarray):
        return side.ndim == 1
    return not (len(side) and isinstance(side[0], (list, tuple, np.ndarray)))


def _count(side: Any) -> int:
    if len(side) and all(isinstance(x, (list, tuple, np.ndarray)) for x in side):
        return sum(len(x) for x in side)
    return len(side)


def align_blocks(
    route: Route | Mapping[str, Any],
    blocks: Mapping[int, tuple[Any, Any]],
    num_tokens: int | None = None,
) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
    """Per layer group ``(context_ids, generation_ids)`` → the route's aligned block lists,
    for a route with equal block sizes (a ratio needs :func:`align_request`).

    Same rule as the planning core (:mod:`geometry.align`): blocks pair by token position.
    With ``num_tokens`` a side of ``T`` tokens per block spans ``⌈num_tokens / T⌉`` logical
    blocks and each list is a suffix of them; without it the longer list starts at block 0
    (a generation list longer than the context's is refused, as are CP groups of different
    lengths). With CP, logical block ``j`` lives on CP rank ``j % cp_modulus``; the CP side may
    give one list per CP rank (rank ``c``'s own table, a suffix of its blocks ``j ≡ c``).
    Per-request state groups (segments with ``state``) pair each side's one state slot instead.
    Raises :class:`BlockRangeError` (its ``code``: ``invalid_blocks`` or
    ``ambiguous_alignment``) for lists that cannot be placed.
    """
    route = as_route(route)
    if route.large_side is not None:
        raise BlockRangeError("a block-size ratio route: use align_request")
    return align_request(route, blocks, num_tokens)[1:]


def align_request(
    route: Route | Mapping[str, Any],
    blocks: Mapping[int, tuple[Any, Any]],
    num_tokens: int | None = None,
    memo: dict[Any, tuple[dict[int, np.ndarray], dict[int, np.ndarray]]] | None = None,
) -> tuple[Route, dict[int, np.ndarray], dict[int, np.ndarray]]:
    """The route as this request runs it, with its aligned block lists.

    Equal block sizes: the route itself and :func:`align_blocks`' lists. A block-size ratio:
    small blocks pair with sub-blocks of large ones by token position (needs ``num_tokens``),
    so the pairs of sub-block ``i`` are their own *lane* (a layer-group key of this request
    only, negative so that it never meets a real group), and a partial last small block
    another one whose segment has every run cut to the tokens that exist; every lane is a
    plain list pair, so gather, scatter, fragments and checksums run it like any group. The
    sender and the receiver derive the same lanes from the same inputs.

    ``memo`` (a dict kept for one request's routes): routes of equal block sizes that cover the
    same layer groups on the same CP ranks align alike, so the second one reuses the first's
    lists (the same arrays: read only).
    """
    from geometry.align import (
        align_equal,
        align_ratio,
        request_totals,
        trimmed_length,
    )
    from geometry.errors import GeometryError

    route = as_route(route)
    key = None
    if memo is not None and route.large_side is None:
        key = (
            route.layer_groups,
            route.state_groups,
            route.cp_modulus,
            route.cp_remainder if route.cp_modulus > 1 else 0,
            route.cp_side,
            route.small_tokens_per_block,
            route.block_ratio,
        )
        if key in memo:
            return (route, *memo[key])
    if num_tokens is None and route.large_side is None and route.cp_modulus == 1:
        flat = _align_plain(route, blocks)
        if flat is not None:
            if memo is not None:
                memo[key] = flat
            return (route, *flat)
    for g in route.layer_groups:
        if g not in blocks:
            raise BlockRangeError(f"no block lists for layer group {g}")
    paged = [g for g in route.layer_groups if g not in route.state_groups]
    cp = route.cp_modulus
    if num_tokens is not None and route.small_tokens_per_block is None:
        raise BlockRangeError(
            "this route does not say its tokens_per_block (a plan from an "
            "older control plane): refresh the directory to use num_tokens"
        )
    try:
        totals = request_totals(
            blocks, paged, num_tokens=num_tokens,
            tokens_per_block=route.small_tokens_per_block or 1, ratio=route.block_ratio, cp=cp,
        )  # fmt: skip
        src: dict[int, np.ndarray] = {}
        dst: dict[int, np.ndarray] = {}
        lanes: list[Segment] = []
        for g in route.layer_groups:
            if g in route.state_groups:
                # per-request state: one slot pair, whatever the paged groups' block sizes
                src[g], dst[g] = _state_pair(route, g, blocks[g])
                continue
            loc: tuple[str | int, ...] = ("blocks", str(g))
            if route.large_side is not None:
                if num_tokens is None:  # nothing to move (request_totals refused the rest)
                    pairs = None
                else:
                    pairs = align_ratio(
                        blocks[g][0], blocks[g][1], loc, route.block_ratio, route.large_side,
                        route.small_tokens_per_block or 1, num_tokens,
                    )  # fmt: skip
                for seg in route.segments:
                    if seg.layer_group != g:
                        continue
                    lane = _lane(g, seg.sub_block, route.block_ratio)
                    empty = np.empty(0, dtype=np.int64)
                    src[lane], dst[lane] = pairs.select(seg.sub_block) if pairs else (empty, empty)
                    lanes.append(replace(seg, layer_group=lane, sub_block=0))
                    tail = pairs.tail(seg.sub_block) if pairs else None
                    if tail is not None:
                        assert pairs is not None
                        t = route.small_tokens_per_block or 1
                        runs = tuple(
                            replace(r, len=trimmed_length(r.len, pairs.tail_tokens, t, loc))
                            for r in seg.runs
                        )
                        tail_lane = _lane(g, route.block_ratio, route.block_ratio)
                        src[tail_lane], dst[tail_lane] = tail
                        lanes.append(replace(seg, runs=runs, layer_group=tail_lane, sub_block=0))
                continue
            total = totals[g]
            on_context = cp if route.cp_side == "context" else 1
            on_generation = cp if route.cp_side == "generation" else 1
            a, b, logical = align_equal(
                blocks[g][0], blocks[g][1], loc, total, on_context, on_generation, num_tokens
            )
            if cp > 1:
                keep = logical % cp == route.cp_remainder
                a, b = a[keep], b[keep]
            src[g], dst[g] = a, b
    except GeometryError as error:
        raise BlockRangeError(str(error), code=error.code) from None
    if route.large_side is None:
        if memo is not None:
            memo[key] = (src, dst)
        return route, src, dst
    segments = tuple(seg for seg in route.segments if seg.state) + tuple(lanes)
    lanes_route = replace(route, segments=segments, block_ratio=1, large_side=None)
    return lanes_route, src, dst


def _align_plain(
    route: Route, blocks: Mapping[int, tuple[Any, Any]]
) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]] | None:
    """:func:`align_request`'s most common case in plain Python: equal block sizes, no CP, no
    per-request state, no ``num_tokens``, both sides flat lists of distinct ids ≥ 0 and the
    generation's no longer than the context's (where both list blocks). The lists then pair
    from their ends, as :func:`geometry.align.align_equal` pairs them; anything else
    (including every error) is None, for the general path. A 4-block request's lists align in
    about a tenth of the general path's time, which is numpy calls on arrays of four."""
    src: dict[int, np.ndarray] = {}
    dst: dict[int, np.ndarray] = {}
    for g in route.layer_groups:
        if g in route.state_groups:
            return None
        pair = blocks.get(g)
        if pair is None:
            return None
        context, generation = pair
        if not plain_pair(context, generation):
            return None
        n_context, n_generation = len(context), len(generation)
        n = min(n_context, n_generation)
        src[g] = np.array(context[n_context - n :], dtype=np.int64)
        dst[g] = np.array(generation[n_generation - n :], dtype=np.int64)
    return src, dst


def _lane(group: int, sub_block: int, ratio: int) -> int:
    """The request-local key of sub-block ``sub_block`` of ``group`` (``ratio``: the tail)."""
    return -1 - group * (ratio + 1) - sub_block


def _state_slot(side: Any, cp_rank: int, cp: int, what: str) -> np.ndarray:
    """One side's state slot on CP rank ``cp_rank``: ``[s]`` on every rank, or one per rank."""
    if len(side) and all(isinstance(x, (list, tuple, np.ndarray)) for x in side):
        if len(side) != cp:
            raise BlockRangeError(f"{what}: {len(side)} state slot lists for {cp} CP ranks")
        side = side[cp_rank]
    arr = np.asarray(side, dtype=np.int64).reshape(-1)
    if arr.size > 1:
        raise BlockRangeError(
            f"{what}: {arr.size} slot ids for a per-request state group; give exactly one"
        )
    return arr


def _state_pair(route: Route, g: int, pair: tuple[Any, Any]) -> tuple[np.ndarray, np.ndarray]:
    """Per-request state (same rule as :func:`geometry.expand.expand`): the request's state
    slot on each side, on the route's CP ranks; nothing when either side names none."""
    cp = route.cp_modulus
    on_context = route.cp_remainder if route.cp_side == "context" and cp > 1 else 0
    on_generation = route.cp_remainder if route.cp_side == "generation" and cp > 1 else 0
    a = _state_slot(pair[0], on_context, cp, f"layer group {g} context")
    b = _state_slot(pair[1], on_generation, cp, f"layer group {g} generation")
    if not a.size or not b.size:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    return a, b


def _align_ratio(route: Route, lists: tuple[Any, Any]) -> tuple[np.ndarray, np.ndarray]:
    """Different block sizes: both lists end at the same token; the last ``n = min(len_L,
    ⌊len_S / r⌋)`` large blocks pair with the last ``n × r`` small ones, as ``[n]`` and ``[n, r]``
    (same rule as :func:`geometry.expand.align_ratio`)."""
    r = route.block_ratio
    ids = {
        side: np.asarray(raw, dtype=np.int64).reshape(-1)
        for side, raw in zip(("context", "generation"), lists, strict=True)
    }
    small_side = "generation" if route.large_side == "context" else "context"
    large, small = ids[route.large_side or "context"], ids[small_side]
    n = min(large.size, small.size // r)
    out = {
        route.large_side: large[large.size - n :],
        small_side: small[small.size - n * r :].reshape(n, r),
    }
    return out["context"], out["generation"]


def staging_layout(route: Route | Mapping[str, Any], blocks: Blocks) -> StagingLayout:
    """Layout of the staged bytes of ``route`` for these (aligned) block lists."""
    route = as_route(route)
    ids = normalize_blocks(route, blocks, "blocks")
    groups, off = [], 0
    for g in route.layer_groups:
        bpb, n = route.bytes_per_block(g), ids[g].shape[0]
        groups.append((g, off, bpb, n))
        off += bpb * n
    return StagingLayout(tuple(groups), off)


# --- validation -----------------------------------------------------------------------------


def check_ids(ids: np.ndarray, pool: Pool, g: int, side: str, unique: bool) -> None:
    """Raise :class:`BlockRangeError` for an id outside ``pool`` (or repeated, if ``unique``)."""
    if ids.size == 0:
        return
    bad = np.flatnonzero((ids < 0) | (ids >= pool.spec.num_slots))
    if bad.size:
        j = int(bad[0])
        raise BlockRangeError(
            f"layer group {g}: {side} block id {int(ids[j])} at index {j} is out of range for "
            f"pool {pool.id} (num_slots {pool.spec.num_slots})"
        )
    if unique and np.unique(ids).size != ids.size:
        raise BlockRangeError(
            f"layer group {g}: {side} block ids repeat; every destination slot is written once"
        )


def check_template(seg: Segment, src: Pool | None, dst: Pool | None) -> tuple[_Family, ...]:
    """The segment's run families; :class:`TemplateError` if one overruns a pool's slot."""
    fams = _families(seg)
    for f in fams:
        if src is not None and f.src_extent > src.spec.slot_bytes:
            raise TemplateError(
                f"segment {seg.src_pool}->{seg.dst_pool}: run at src offset {f.src0} reaches byte "
                f"{f.src_extent} of the slot, pool {src.id} has slot_bytes {src.spec.slot_bytes}"
            )
        if dst is not None and f.dst_extent > dst.spec.slot_bytes:
            raise TemplateError(
                f"segment {seg.src_pool}->{seg.dst_pool}: run at dst offset {f.dst0} reaches byte "
                f"{f.dst_extent} of the slot, pool {dst.id} has slot_bytes {dst.spec.slot_bytes}"
            )
    return fams


def _pool(pools: Mapping[int, Pool], pid: int, side: str) -> Pool:
    try:
        return pools[pid]
    except KeyError:
        raise TemplateError(f"{side} pool {pid} is not among this rank's pools") from None


# --- block progressions ---------------------------------------------------------------------


def _progressions(a: np.ndarray, b: np.ndarray) -> list[tuple[int, int, int, int]]:
    """Cut paired id lists into ``(start, length, step_a, step_b)`` arithmetic progressions.

    Greedy over runs of equal consecutive differences (Python work per progression, not per
    block). A lone differing step between two progressions is left as a break rather than
    pairing two blocks, so ``0,1,2,10,11,12`` gives two progressions, not three. Steps are
    non-negative on both sides; a descending progression is returned reversed.
    """
    n = int(a.size)
    if n == 0:
        return []
    if n == 1:
        return [(0, 1, 0, 0)]
    da, db = np.diff(a), np.diff(b)
    cut = np.flatnonzero((da[1:] != da[:-1]) | (db[1:] != db[:-1])) + 1
    starts = np.concatenate(([0], cut)).tolist()
    ends = np.concatenate((cut, [n - 1])).tolist()
    out: list[tuple[int, int, int, int]] = []
    pos = 0
    for k, (ds, de) in enumerate(zip(starts, ends, strict=True)):
        s = max(pos, ds)
        links = de - s
        if links <= 0:
            continue
        sa, sb = int(da[ds]), int(db[ds])
        if links == 1 and k + 1 < len(starts):
            out.append((s, 1, 0, 0))
            pos = s + 1
            continue
        out.append((s, links + 1, sa, sb))
        pos = de + 1
    if pos < n:
        out.extend((p, 1, 0, 0) for p in range(pos, n))
    fixed: list[tuple[int, int, int, int]] = []
    for s, m, sa, sb in out:
        if sa >= 0 and sb >= 0:
            fixed.append((s, m, sa, sb))
        elif sa <= 0 and sb <= 0:
            fixed.append((s + m - 1, m, -sa, -sb))  # walk it backwards: same pairs
        else:
            fixed.extend((s + i, 1, 0, 0) for i in range(m))  # opposite directions: no view
    return fixed


# --- sides ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Side:
    """One end of a copy: a tensor, bytes per block id, base byte offset, and the id list."""

    tensor: torch.Tensor
    block_stride: int
    base: int
    ids: np.ndarray
    is_pool: bool
    rows: int = 0  # addressable block ids (pool sides)

    def view(self, f: _Family, src: bool, first: int, m: int, step: int) -> torch.Tensor:
        """``[m, n, count, len]`` view at progression ``first, first+step, ...`` of this side."""
        t = self.tensor
        if self.is_pool:
            off0, delta, cstep = (
                (f.src0, f.src_delta, f.src_step) if src else (f.dst0, f.dst_delta, f.dst_step)
            )
        else:
            off0, delta, cstep = f.stage0, f.count * f.len, f.len
        return t.as_strided(
            (m, f.n, f.count, f.len),
            (step * self.block_stride, delta, cstep, 1),
            t.storage_offset() + self.base + first * self.block_stride + off0,
        )


def _pool_side(pool: Pool, ids: np.ndarray) -> _Side:
    return _Side(pool.tensor, pool.spec.slot_stride_bytes, 0, ids, True, pool.spec.num_slots)


def _stage_side(staging: torch.Tensor, base: int, bpb: int, j0: int, j1: int) -> _Side:
    return _Side(staging, bpb, base, np.arange(j0, j1, dtype=np.int64), False)


def _copy_strided(src: _Side, dst: _Side, fams: Sequence[_Family]) -> None:
    for s, m, sa, sb in _progressions(src.ids, dst.ids):
        a0, b0 = int(src.ids[s]), int(dst.ids[s])
        for f in fams:
            dst.view(f, False, b0, m, sb).copy_(src.view(f, True, a0, m, sa))


def _word_bytes(src: _Side, dst: _Side, fams: Sequence[_Family]) -> int:
    vals = [src.block_stride, dst.block_stride, src.base, dst.base]
    vals += [int(src.tensor.storage_offset()), int(dst.tensor.storage_offset())]
    vals += [int(src.tensor.numel()), int(dst.tensor.numel())]
    vals += [src.tensor.data_ptr(), dst.tensor.data_ptr()]
    for f in fams:
        vals += [f.src0, f.dst0, f.stage0, f.len, f.src_step, f.dst_step, f.src_delta, f.dst_delta]
    for w in (8, 4, 2):
        if all(v % w == 0 for v in vals):
            return w
    return 1


def _copy_indexed(src: _Side, dst: _Side, fams: Sequence[_Family]) -> None:
    """Per family one gather and/or one scatter kernel over all blocks (CUDA default)."""
    import torch

    w = _word_bytes(src, dst, fams)
    dtype = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[w]
    dev = src.tensor.device

    def full(side: _Side, f: _Family, is_src: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        t = side.tensor.view(dtype) if w > 1 else side.tensor
        if side.is_pool:
            off0, delta, cstep = (
                (f.src0, f.src_delta, f.src_step) if is_src else (f.dst0, f.dst_delta, f.dst_step)
            )
            v = t.as_strided(
                (side.rows, f.n, f.count, f.len // w),
                (side.block_stride // w, delta // w, cstep // w, 1),
                t.storage_offset() + off0 // w,
            )
            return v, torch.from_numpy(side.ids).to(dev)
        first = int(side.ids[0]) if side.ids.size else 0
        v = t.as_strided(
            (side.ids.size, f.n, f.count, f.len // w),
            (side.block_stride // w, f.count * f.len // w, f.len // w, 1),
            t.storage_offset() + (side.base + first * side.block_stride + f.stage0) // w,
        )
        return v, None

    for f in fams:
        sv, si = full(src, f, True)
        dv, di = full(dst, f, False)
        data = sv.index_select(0, si) if si is not None else sv
        if di is not None:
            dv.index_copy_(0, di, data)
        else:
            dv.copy_(data)


def _run(src: _Side, dst: _Side, fams: Sequence[_Family], method: Method) -> None:
    if src.ids.size != dst.ids.size:
        raise BlockRangeError(f"{src.ids.size} source blocks vs {dst.ids.size} destination blocks")
    if src.ids.size == 0:
        return
    if method == "auto":
        method = "index" if src.tensor.device.type == "cuda" else "strided"
    if method == "index":
        _copy_indexed(src, dst, fams)
    else:
        _copy_strided(src, dst, fams)


def _chunk_filter(layout: StagingLayout, chunk: StagingChunk | None) -> list[StagingChunk]:
    return [chunk] if chunk is not None else layout.chunks(None)


def _check_staging(staging: torch.Tensor, offset: int, layout: StagingLayout) -> None:
    import torch

    if staging.dtype != torch.uint8 or staging.dim() != 1 or not staging.is_contiguous():
        raise TemplateError("staging must be a contiguous 1-D uint8 tensor")
    if offset < 0 or offset + layout.nbytes > staging.numel():
        raise TemplateError(
            f"staging area [{offset}, {offset + layout.nbytes}) exceeds the staging buffer "
            f"of {staging.numel()} bytes"
        )


# --- public API -----------------------------------------------------------------------------


def gather(
    route: Route | Mapping[str, Any],
    src_pools: Mapping[int, Pool],
    src_blocks: Blocks,
    *,
    out: torch.Tensor | None = None,
    offset: int = 0,
    chunk: StagingChunk | None = None,
    method: Method = "auto",
) -> torch.Tensor:
    """Copy the route's bytes of ``src_blocks`` into staging (see the module's layout).

    Without ``out`` a fresh tensor of exactly the staged size is returned. With ``out`` the bytes
    land at ``out[offset:]``; with ``chunk`` only that chunk's blocks are gathered.
    """
    import torch

    route = as_route(route)
    ids = normalize_blocks(route, src_blocks, "src_blocks")
    layout = staging_layout(route, ids)
    if out is None:
        dev = next(iter(src_pools.values())).device if src_pools else "cpu"
        out = torch.empty(layout.nbytes, dtype=torch.uint8, device=dev)
    _check_staging(out, offset, layout)
    for ch in _chunk_filter(layout, chunk):
        g_off, bpb, _ = layout.group(ch.layer_group)
        seg_off = 0
        for seg in route.segments:
            if seg.layer_group != ch.layer_group:
                continue
            pool = _pool(src_pools, seg.src_pool, "source")
            fams = check_template(seg, pool, None)
            sub = _column(ids[seg.layer_group][ch.start : ch.stop], seg)
            check_ids(sub, pool, seg.layer_group, "source", unique=False)
            stage = _stage_side(out, offset + g_off + seg_off, bpb, ch.start, ch.stop)
            _run(_pool_side(pool, sub), stage, fams, method)
            seg_off += seg.bytes_per_block
    return out


def scatter(
    route: Route | Mapping[str, Any],
    staging: torch.Tensor,
    dst_pools: Mapping[int, Pool],
    dst_blocks: Blocks,
    *,
    offset: int = 0,
    chunk: StagingChunk | None = None,
    method: Method = "auto",
) -> None:
    """Copy staged bytes at ``staging[offset:]`` into ``dst_blocks`` of the receiver's pools."""
    route = as_route(route)
    ids = normalize_blocks(route, dst_blocks, "dst_blocks")
    layout = staging_layout(route, ids)
    _check_staging(staging, offset, layout)
    for g in route.layer_groups:  # validate all ids before writing a byte
        for seg in route.segments:
            if seg.layer_group == g:
                check_ids(ids[g], _pool(dst_pools, seg.dst_pool, "destination"), g,
                           "destination", unique=True)  # fmt: skip
    for ch in _chunk_filter(layout, chunk):
        g_off, bpb, _ = layout.group(ch.layer_group)
        seg_off = 0
        for seg in route.segments:
            if seg.layer_group != ch.layer_group:
                continue
            pool = _pool(dst_pools, seg.dst_pool, "destination")
            fams = check_template(seg, None, pool)
            sub = _column(ids[seg.layer_group][ch.start : ch.stop], seg)
            stage = _stage_side(staging, offset + g_off + seg_off, bpb, ch.start, ch.stop)
            _run(stage, _pool_side(pool, sub), fams, method)
            seg_off += seg.bytes_per_block


def copy_local(
    route: Route | Mapping[str, Any],
    src_pools: Mapping[int, Pool],
    dst_pools: Mapping[int, Pool],
    src_blocks: Blocks,
    dst_blocks: Blocks,
    *,
    method: Method = "auto",
) -> int:
    """Copy the route's bytes straight from source to destination pools; returns bytes moved."""
    route = as_route(route)
    bs = normalize_blocks(route, src_blocks, "src_blocks")
    bd = normalize_blocks(route, dst_blocks, "dst_blocks")
    work = []
    for seg in route.segments:
        g = seg.layer_group
        if bs[g].shape[0] != bd[g].shape[0]:
            raise BlockRangeError(
                f"layer group {g}: {bs[g].shape[0]} source blocks vs {bd[g].shape[0]} "
                "destination blocks"
            )
        sp = _pool(src_pools, seg.src_pool, "source")
        dp = _pool(dst_pools, seg.dst_pool, "destination")
        fams = check_template(seg, sp, dp)
        check_ids(bs[g], sp, g, "source", unique=False)
        check_ids(bd[g], dp, g, "destination", unique=True)
        work.append((_pool_side(sp, _column(bs[g], seg)), _pool_side(dp, _column(bd[g], seg)),
                     fams))  # fmt: skip
    for src, dst, fams in work:
        _run(src, dst, fams, method)
    return sum(seg.bytes_per_block * bs[seg.layer_group].shape[0] for seg in route.segments)


def expand_fragments(
    route: Route | Mapping[str, Any],
    src_pools: Mapping[int, Any],
    dst_pools: Mapping[int, Any],
    src_blocks: Blocks,
    dst_blocks: Blocks,
) -> dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Every fragment, per (src_pool, dst_pool): ``(src_offsets, dst_offsets, lengths)``.

    Offsets are relative to each pool's base. Pools may be :class:`Pool` or bare
    :class:`~workers.pools.PoolSpec` (the peer's pools are only known by spec). Vectorized over
    blocks × fragments; the per-fragment NIXL path is the only user. Raises
    :class:`BlockRangeError` for a block id outside its pool (on either side: an address past
    the peer's pool may still be registered memory of another of its pools).
    """
    route = as_route(route)
    bs = normalize_blocks(route, src_blocks, "src_blocks")
    bd = normalize_blocks(route, dst_blocks, "dst_blocks")
    acc: dict[tuple[int, int], list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
    for seg in route.segments:
        g = seg.layer_group
        sspec = getattr(src_pools[seg.src_pool], "spec", src_pools[seg.src_pool])
        dspec = getattr(dst_pools[seg.dst_pool], "spec", dst_pools[seg.dst_pool])
        fsrc, fdst, flen = seg.fragments
        src_ids, dst_ids = _column(bs[g], seg), _column(bd[g], seg)
        for ids, spec, what in ((src_ids, sspec, "context"), (dst_ids, dspec, "generation")):
            if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= spec.num_slots):
                raise BlockRangeError(
                    f"layer group {g}: {what} block ids must be in 0..{spec.num_slots - 1}"
                )
        so = (src_ids[:, None] * sspec.slot_stride_bytes + fsrc[None, :]).reshape(-1)
        do = (dst_ids[:, None] * dspec.slot_stride_bytes + fdst[None, :]).reshape(-1)
        ln = np.broadcast_to(flen, (src_ids.size, flen.size)).reshape(-1)
        acc.setdefault((seg.src_pool, seg.dst_pool), []).append((so, do, ln))
    return {
        k: (
            np.concatenate([p[0] for p in v]),
            np.concatenate([p[1] for p in v]),
            np.concatenate([p[2] for p in v]),
        )
        for k, v in acc.items()
    }


# A prepared table holds every fragment of every slot of a route's pools: bounded per side.
FRAGMENT_TABLE_MAX = 1 << 19


@dataclass(frozen=True)
class FragmentTable:
    """Every fragment of every slot that one side of a route touches, in a fixed order: segment
    ``i``'s fragment ``k`` of slot ``s`` sits at index ``bases[i] + s·K_i + k`` (``K_i`` the
    segment's fragments per block). A NIXL prepared descriptor list over it (built once per route
    and peer) lets a request name its fragments by index: no addresses to compute or look up."""

    bases: tuple[int, ...]
    slots: tuple[int, ...]  # slots in each segment's pool on this side
    entries: tuple[tuple[int, np.ndarray, np.ndarray], ...]  # (pool, offsets from base, lengths)
    size: int


def fragment_tables(
    route: Route,
    src_specs: Mapping[int, Any],
    dst_specs: Mapping[int, Any],
    limit: int = FRAGMENT_TABLE_MAX,
) -> tuple[FragmentTable, FragmentTable] | None:
    """Both sides' :class:`FragmentTable` of ``route`` (pool specs by id); None when a side
    would exceed ``limit`` descriptors (e.g. token-major runs over a large pool)."""
    out = []
    for specs, side in ((src_specs, 0), (dst_specs, 1)):
        bases, slots, entries, size = [], [], [], 0
        for seg in route.segments:
            pool = seg.dst_pool if side else seg.src_pool
            spec = getattr(specs[pool], "spec", specs[pool])
            frag_offsets, lengths = seg.fragments[side], seg.fragments[2]
            n = int(spec.num_slots) * lengths.size
            if size + n > limit:
                return None
            offsets = (
                np.arange(spec.num_slots, dtype=np.int64)[:, None] * spec.slot_stride_bytes
                + frag_offsets[None, :]
            ).reshape(-1)
            bases.append(size)
            slots.append(int(spec.num_slots))
            entries.append((pool, offsets, np.tile(lengths, spec.num_slots)))
            size += n
        out.append(FragmentTable(tuple(bases), tuple(slots), tuple(entries), size))
    return out[0], out[1]


def fragment_indices(
    route: Route,
    tables: tuple[FragmentTable, FragmentTable],
    src_blocks: Blocks,
    dst_blocks: Blocks,
) -> tuple[np.ndarray, np.ndarray]:
    """The indices into both sides' tables of every fragment of these (aligned) block lists,
    pairwise: local ``[i]`` goes to remote ``[i]``. Raises :class:`BlockRangeError` for a block
    id outside its pool."""
    ids = (
        normalize_blocks(route, src_blocks, "src_blocks"),
        normalize_blocks(route, dst_blocks, "dst_blocks"),
    )
    out: tuple[list[np.ndarray], list[np.ndarray]] = ([], [])
    checked: set[tuple[int, int, int, int]] = set()  # segments of one group share their ids
    for i, seg in enumerate(route.segments):
        k = np.arange(seg.fragments[2].size, dtype=np.int64)
        for side, what in ((0, "context"), (1, "generation")):
            col = _column(ids[side][seg.layer_group], seg)
            slots = tables[side].slots[i]
            key = (side, seg.layer_group, seg.sub_block, slots)
            if col.size and key not in checked:
                checked.add(key)
                if int(col.min()) < 0 or int(col.max()) >= slots:
                    raise BlockRangeError(
                        f"layer group {seg.layer_group}: {what} block ids must be in 0..{slots - 1}"
                    )
            out[side].append((tables[side].bases[i] + col[:, None] * k.size + k).reshape(-1))
    return tuple(np.concatenate(x).astype(np.int32) if x else np.zeros(0, np.int32) for x in out)  # type: ignore[return-value]


def _touched_slots(pool: Pool, offsets: np.ndarray) -> tuple[memoryview, np.ndarray]:
    """The slots that ``offsets`` fall in, copied to the host, and the offsets into that copy.

    Only those slots travel: a KV pool can be far larger than one transfer. A fragment never
    crosses its slot's ``slot_bytes`` (the templates are checked against them).
    """
    import torch

    spec = pool.spec
    touched, where = np.unique(offsets // spec.slot_stride_bytes, return_inverse=True)
    slots = pool.tensor.unfold(0, spec.slot_bytes, spec.slot_stride_bytes)  # [num_slots, bytes]
    index = torch.from_numpy(touched).to(slots.device)
    host = slots.index_select(0, index).cpu().numpy().reshape(-1)
    return host.data, where.reshape(-1) * spec.slot_bytes + offsets % spec.slot_stride_bytes


def _host_image(pool: Pool, offsets: np.ndarray) -> tuple[memoryview, np.ndarray]:
    """The pool's bytes as a host buffer and ``offsets`` into it: a CPU pool is read in place
    (no copy, no torch kernel: with six workers busy on two cores, the torch gather made the
    demo's send jobs about 20× slower, 2.6 s against 0.14 s), a device pool through
    :func:`_touched_slots`."""
    if pool.tensor.device.type == "cpu":
        return pool.tensor.detach().numpy().data, offsets
    return _touched_slots(pool, offsets)


def fragments_crc32(
    pools: Mapping[int, Pool],
    fragments: Mapping[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]],
    *,
    side: Literal["src", "dst"],
) -> int:
    """crc32 of a route's bytes read fragment by fragment from this side's ``pools``.

    ``fragments`` is :func:`expand_fragments` of the route; sender (``side="src"``) and receiver
    (``"dst"``) compute it from the same route and block lists, so they read the same bytes in
    the same order when the transfer was right. A CPU pool is read in place; of a device pool
    only the touched slots are copied to the host. Small fragments of one length are gathered
    into one buffer by a row index into a sliding-window view and summed by one
    :func:`~workers.crc.crc32` (the same sum as fragment by fragment: crc32 chains); longer ones
    get one ``crc32`` per fragment over a buffer view. Measured on the 2-core dev host (loaded,
    with zlib's crc32): 34,000 fragments of 64 bytes 2.6 ms gathered against 23 ms one by one,
    4,300 of 512 bytes 1.4 against 3.6 ms; from 4 KiB on both take the same, and 140 of 16 KiB
    1.1 ms one by one against 1.3.
    """
    crc = 0
    for (src_pool, dst_pool), (so, do, ln) in fragments.items():
        pid, offsets = (src_pool, so) if side == "src" else (dst_pool, do)
        image, local = _host_image(pools[pid], offsets)
        gathered = _gather_uniform(image, local, ln)
        if gathered is not None:
            crc = crc32(gathered.data, crc)
            continue
        for offset, length in zip(local.tolist(), ln.tolist(), strict=True):
            crc = crc32(image[offset : offset + length], crc)
    return crc & 0xFFFFFFFF


GATHER_MAX = 2048  # fragments shorter than this are gathered in one go (see fragments_crc32)


def _gather_uniform(
    image: memoryview, offsets: np.ndarray, lengths: np.ndarray
) -> np.ndarray | None:
    """The fragments' bytes in order as one contiguous array, when they all have one length
    below GATHER_MAX (a row index into a sliding window over the image: one copy in C); else
    None."""
    length = uniform_length(lengths)
    if not length or length >= GATHER_MAX:
        return None
    return gather_bytes(np.frombuffer(image, dtype=np.uint8), offsets, lengths)


def uniform_length(lengths: np.ndarray) -> int:
    """The one length every fragment has (> 0), or 0 when they differ (or there are none)."""
    if not lengths.size:
        return 0
    length = int(lengths[0])
    return length if length > 0 and bool(np.all(lengths == length)) else 0


class Windows:
    """Sliding-window views (a row of ``length`` bytes at every offset) of long-lived flat byte
    images, kept per caller's key (e.g. a pool id) and length: building one costs about 70 µs of
    numpy's argument checks, more than gathering a 4-block request's fragments through it. A
    key's entry holds its image and is replaced when the key names another image (a pattern
    image that grew), so an image no longer named is not kept alive; at most ``limit``."""

    def __init__(self, limit: int = 64) -> None:
        self.limit = limit
        self._views: dict[tuple[Any, int, bool], tuple[np.ndarray, np.ndarray]] = {}

    def rows(
        self, key: Any, image: np.ndarray, length: int, *, writeable: bool = False
    ) -> np.ndarray:
        entry = (key, length, writeable)
        hit = self._views.get(entry)
        if hit is not None and hit[0] is image:
            return hit[1]
        view = sliding_window_view(image, length, writeable=writeable)
        if hit is None and len(self._views) >= self.limit:
            self._views.clear()
        self._views[entry] = (image, view)
        return view


def gather_bytes(
    image: np.ndarray,
    offsets: np.ndarray,
    lengths: np.ndarray,
    *,
    length: int | None = None,
    windows: tuple[Windows, Any] | None = None,
) -> np.ndarray:
    """The bytes of fragments ``(offsets, lengths)`` of the flat ``uint8`` ``image``, one after
    another, as a new contiguous array: of one length, a row per fragment of a sliding window
    (one copy in C); else one slice each, joined. ``length``: the caller's
    :func:`uniform_length` of ``lengths``; ``windows``: ``(Windows, key)`` where ``image``
    lives long (its sliding windows are kept there under the key)."""
    if length is None:
        length = uniform_length(lengths)
    if length:
        if windows is not None:
            rows = windows[0].rows(windows[1], image, length)
        else:
            rows = sliding_window_view(image, length)
        return rows[offsets].reshape(-1)
    if not lengths.size:
        return np.empty(0, dtype=np.uint8)
    return np.concatenate(
        [image[o : o + n] for o, n in zip(offsets.tolist(), lengths.tolist(), strict=True)]
    )
