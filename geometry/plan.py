"""Rank map, sender election and transfer templates.

**Active ranks.** Without attention-DP every rank of a side takes part. Under attention-DP each TP
rank is its own attention group (``dp_rank = tp_rank``): only the ranks with
``tp_rank == context_dp_rank`` send, only those with ``tp_rank == generation_dp_rank`` receive.

**Head ranges (any ratio).** A receiver view on rank ``r`` needs the global heads ``[a, b)`` (see
:mod:`geometry.heads`); a sender shard holds ``[s, t)``. Every sender shard with
``s < b`` and ``t > a`` fills ``[max(a, s), min(b, t))``: several shards when the sender is finer,
a sub-range of one when it is coarser, and both when neither shard count divides the other
(TP 3 → TP 2 with 12 heads: receiver 0 takes ``[0, 4)`` from sender 0 and ``[4, 6)`` from
sender 1). Only the bytes of one head of one token must agree (:mod:`geometry.validate`).
Validation requires, per sender stage and CP rank, a holder for every needed head
(``missing_peer_shard``), so the compile never meets a range without a holder.

**Election.** A sender shard may be held by several replicas (``G > H``). For every shard key
``(stage, cp_rank, owner, roles, shard, replicas, layer group, receiver cp_rank)`` the
``(receiver slice, layer)`` units that need it, in receiver rank order, are cut into one
contiguous chunk per replica: a unit that starts ``s`` bytes into the key's ``total`` goes to chunk
``⌊s × n / total⌋``, and chunk ``k`` is served by replica ``(k + turn) mod n`` with
``turn = generation_dp_rank + (keys of the same shard seen before)``. Hence every receiver byte is
written exactly once, by a rank that holds exactly that data; a replica's share exceeds
``⌈total / n⌉`` by less than one unit (one layer of one slice: layers are never split); DP ranks
and layer groups start at different replicas; and the result depends only on the inputs.

**Templates.** Per route (sender rank → receiver rank) and pool pair, strided runs ``{src, dst,
len, count, src_step, dst_step}`` (offsets inside one slot). HND head slices are one run per
(layer, buffer); NHD slices one run with ``count = tokens_per_block``; full-width and REPLICATED
copies whole regions; runs contiguous on both sides are merged. HND ↔ NHD conversion: one run per
(layer, buffer, head) with ``len = u`` (bytes of one head of one token), ``count =
tokens_per_block``; head ``i`` starts at ``i × T × u`` on the HND side (token step ``u``) and at
``i × u`` on the NHD side (token step ``token_bytes``). Template size depends on the layer and
head count, never on the number of blocks or tokens.

**Per-request state** (:mod:`geometry.state`): state views shard over the state axis
``tp × cp`` (1 under attention-DP), SSM heads as head ranges, SECTIONED conv state as ranges of
section-0 bytes cut into one run per (layer, buffer, section). Their segments carry
``state = true``: expansion applies them once, to the request's state slot on each side (no block
alignment, no CP block filter; under CP each CP rank's own slot).

**Block-size ratio** (HND on both sides, larger ``tokens_per_block`` ``= r ×`` the smaller ``t``;
block alignment in :mod:`geometry.expand`). With ``b = t × u`` the bytes of one head of one
small block, a small block holds head ``h`` at ``h × b`` and a large block at ``h × r·b``; small
block ``i`` of a large block is, per head, the run ``[h × r·b + i × b, + b)``. A route gets one
segment per (pool pair, ``sub_block = i``): per (layer, buffer) one run of ``len = b``, ``count =
heads``, stepping ``r·b`` on the large side and ``b`` on the small side, the large side shifted
by ``i × b``. The template grows by ``r``, never with blocks or tokens; ``bytes_per_block`` then
counts one *large* block. Per-request state groups have no token axis: a ratio never applies to
them (their segments keep ``sub_block = 0`` and move one slot pair, whatever the paged groups'
block sizes), so a hybrid instance pairs with a different ``tokens_per_block`` like a paged one.

**Staging.** A receiver with several writers gets each writer's exact staging offset (prefix sum of
the writers' bytes in sender-rank order). ``equal_split_safe`` says whether the legacy equal-split
staging would have been right: only when every overlapping sender rank writes, all write the same
bytes per block in every layer group (block counts differ per group), neither CP nor a
pipelined sender is involved, and no per-request state rides with several writers. kvplane
itself never equal-splits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import numpy as np

from geometry.errors import GeometryError, Problem
from geometry.heads import ViewGeometry
from geometry.match import Match, SenderIndex
from geometry.model import Instance, View
from geometry.state import StateGeometry, sectioned_runs, slice_bytes
from geometry.state_checks import check_state_groups, check_state_match, involves_state
from geometry.validate import (
    Findings,
    Report,
    check_coverage,
    check_draft_layers,
    check_instances,
    check_layer_counts,
    check_match,
    derive_duplication,
    draft_layers,
    geometry_of,
    needed_range,
    report_unmatched,
    sender_ranges,
)

RUN_FIELDS = ("src", "dst", "len", "count", "src_step", "dst_step")


# --------------------------------------------------------------------------------------------
# active ranks and validation


def active_ranks(instance: Instance, dp_rank: int | None, field: str) -> tuple[int, ...]:
    """The ranks of ``instance`` taking part for one request's DP rank."""
    if not instance.attention_dp:
        if dp_rank not in (None, 0):
            raise GeometryError(
                Problem(
                    (field,),
                    f"{instance.name} does not use attention-DP; {field} must be "
                    f"absent or 0, got {dp_rank}",
                    "dp_rank_out_of_range",
                )
            )
        return tuple(range(instance.world_size))
    if dp_rank is None:
        raise GeometryError(
            Problem(
                (field,),
                f"{instance.name} uses attention-DP: {field} is required",
                "dp_rank_required",
            )
        )
    if not 0 <= dp_rank < instance.tp:
        raise GeometryError(
            Problem(
                (field,),
                f"{field} must be in [0, {instance.tp}), got {dp_rank}",
                "dp_rank_out_of_range",
            )
        )
    return tuple(r for r in range(instance.world_size) if instance.coords(r)[1] == dp_rank)


def dp_choices(instance: Instance) -> list[int | None]:
    """The DP ranks a plan is made for: each one under attention DP, else ``[None]``."""
    return list(range(instance.tp)) if instance.attention_dp else [None]


def validate_pairing(context: Instance, generation: Instance) -> Report:
    """Validate a pairing for every DP combination; return all errors and warnings."""
    findings = Findings()
    if not check_instances(context, generation, findings):
        return findings.report()
    check_draft_layers(context, generation, findings)
    check_layer_counts(context, generation, findings)
    check_state_groups(context, generation, findings)
    cache: dict[Any, ViewGeometry] = {}
    derive_duplication(context, generation, cache)
    for context_dp in dp_choices(context):
        senders = active_ranks(context, context_dp, "context_dp_rank")
        index = SenderIndex(context, senders)
        for generation_dp in dp_choices(generation):
            receivers = active_ranks(generation, generation_dp, "generation_dp_rank")
            _match_all(context, generation, index, receivers, findings, cache)
    return findings.report()


def _match_all(
    context: Instance,
    generation: Instance,
    index: SenderIndex,
    receivers: Sequence[int],
    findings: Findings,
    cache: dict[Any, ViewGeometry],
) -> list[Match]:
    matches: list[Match] = []
    context_has_draft = bool(draft_layers(context))
    for rank in receivers:
        for view in generation.table(rank).views:
            found, unmatched = index.match_view(rank, view)
            report_unmatched(unmatched, findings, context_has_draft)
            for match in found:
                state = involves_state(context, generation, match)
                check = check_state_match if state else check_match
                if check(context, generation, match, findings, cache):
                    check_coverage(context, generation, match, findings, cache)
            matches.extend(found)
    return matches


# --------------------------------------------------------------------------------------------
# plan data


@dataclass(frozen=True)
class Segment:
    """The runs of one route between one sender pool and one receiver pool."""

    src_pool: int
    dst_pool: int
    layer_group: int
    runs: np.ndarray  # int64 [n, 6]: src, dst, len, count, src_step, dst_step
    state: bool = False  # per-request state: applied once, to the request's slot pair
    sub_block: int = 0  # with a block-size ratio: which small block of the large one

    @cached_property
    def bytes_per_block(self) -> int:
        return int((self.runs[:, 2] * self.runs[:, 3]).sum())

    @cached_property
    def fragments_per_block(self) -> int:
        return int(self.runs[:, 3].sum())

    def to_dict(self) -> dict[str, Any]:
        return {
            "src_pool": self.src_pool,
            "dst_pool": self.dst_pool,
            "layer_group": self.layer_group,
            "state": self.state,
            "sub_block": self.sub_block,
            "runs": [dict(zip(RUN_FIELDS, map(int, row), strict=True)) for row in self.runs],
        }


@dataclass(frozen=True)
class Route:
    """Everything sender rank ``sender_rank`` writes into receiver rank ``receiver_rank``.

    With CP on one side (``cp_side``), the route carries only the logical blocks ``j`` with
    ``j % cp_modulus == cp_remainder``: logical block ``j`` of the request (counted from the
    start of the longer list, see :mod:`geometry.expand`) lives on ``cp_rank = j % cp``.
    """

    sender_rank: int
    receiver_rank: int
    segments: tuple[Segment, ...]
    slices: tuple[dict[str, Any], ...]
    cp_modulus: int = 1
    cp_remainder: int = 0
    cp_side: str | None = None  # which side's block list is split over CP ranks
    block_ratio: int = 1  # larger tokens_per_block / smaller
    large_side: str | None = None  # the side with the larger blocks (None when equal)
    # the smaller tokens_per_block of the two sides (the common one when equal): what a
    # request's num_tokens is counted in blocks of (None only in plans stored before it)
    small_tokens_per_block: int | None = None

    @cached_property
    def bytes_per_block(self) -> int:
        return sum(segment.bytes_per_block for segment in self.segments)

    @cached_property
    def runs(self) -> int:
        return sum(len(segment.runs) for segment in self.segments)

    def to_dict(self) -> dict[str, Any]:
        return {
            "sender_rank": self.sender_rank,
            "receiver_rank": self.receiver_rank,
            "bytes_per_block": self.bytes_per_block,
            "cp_modulus": self.cp_modulus,
            "cp_remainder": self.cp_remainder,
            "cp_side": self.cp_side,
            "block_ratio": self.block_ratio,
            "large_side": self.large_side,
            "small_tokens_per_block": self.small_tokens_per_block,
            "segments": [segment.to_dict() for segment in self.segments],
            "slices": list(self.slices),
        }


@dataclass(frozen=True)
class ReceiverPlan:
    """Who writes into one receiver rank, and where each writer's bytes go in staging."""

    rank: int
    writers: tuple[int, ...]
    overlapping: tuple[int, ...]
    staging_offsets: tuple[int, ...]  # per block, aligned with ``writers``
    writer_bytes: tuple[int, ...]  # per block, aligned with ``writers``
    equal_split_safe: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "writers": len(self.writers),
            "writer_ranks": list(self.writers),
            "overlapping_ranks": list(self.overlapping),
            "equal_split_safe": self.equal_split_safe,
            "staging": [
                {"sender_rank": s, "offset_per_block": o, "bytes_per_block": b}
                for s, o, b in zip(
                    self.writers, self.staging_offsets, self.writer_bytes, strict=True
                )
            ],
        }


@dataclass(frozen=True)
class PoolRef:
    """What expansion needs of a pool: stride, slot count and layer group."""

    stride: int
    num_slots: int
    layer_group: int


@dataclass(frozen=True)
class Plan:
    """A compiled plan for one pairing and one ``(context_dp_rank, generation_dp_rank)``."""

    context: str
    generation: str
    context_dp_rank: int | None
    generation_dp_rank: int | None
    tokens_per_block: int
    routes: tuple[Route, ...]
    receivers: tuple[ReceiverPlan, ...]
    warnings: tuple[dict[str, Any], ...]
    # (side, rank, pool id) -> PoolRef, side in {"context", "generation"}
    pools: Mapping[tuple[str, int, int], PoolRef]
    generation_tokens_per_block: int | None = None  # None: equal to ``tokens_per_block``

    @property
    def block_ratio(self) -> tuple[int, str | None]:
        """``(r, side with the larger blocks)``; ``(1, None)`` for equal block sizes."""
        c = self.tokens_per_block
        g = self.generation_tokens_per_block or c
        if c == g:
            return 1, None
        return (c // g, "context") if c > g else (g // c, "generation")

    @cached_property
    def bytes_per_block(self) -> int:
        return sum(route.bytes_per_block for route in self.routes)

    @cached_property
    def runs(self) -> int:
        return sum(route.runs for route in self.routes)

    @cached_property
    def state_groups(self) -> frozenset[int]:
        """Layer groups the plan moves as per-request state (one slot per side)."""
        return frozenset(s.layer_group for r in self.routes for s in r.segments if s.state)

    def to_dict(self) -> dict[str, Any]:
        return {
            "context": self.context,
            "generation": self.generation,
            "context_dp_rank": self.context_dp_rank,
            "generation_dp_rank": self.generation_dp_rank,
            "tokens_per_block": self.tokens_per_block,
            "generation_tokens_per_block": self.generation_tokens_per_block
            or self.tokens_per_block,
            "bytes_per_block": self.bytes_per_block,
            "runs": self.runs,
            "routes": [route.to_dict() for route in self.routes],
            "receivers": [receiver.to_dict() for receiver in self.receivers],
            "warnings": list(self.warnings),
            "pools": [
                {
                    "side": side,
                    "rank": rank,
                    "pool": pool,
                    "stride": ref.stride,
                    "num_slots": ref.num_slots,
                    "layer_group": ref.layer_group,
                }
                for (side, rank, pool), ref in sorted(self.pools.items())
            ],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        """Rebuild a plan from :meth:`to_dict` output (e.g. a cached plan in the database)."""
        sizes = (data["tokens_per_block"], data.get("generation_tokens_per_block") or 1 << 62)
        small_tpb = min(sizes)
        routes = tuple(
            Route(
                sender_rank=route["sender_rank"],
                receiver_rank=route["receiver_rank"],
                segments=tuple(
                    Segment(
                        segment["src_pool"],
                        segment["dst_pool"],
                        segment["layer_group"],
                        _runs_array([[run[f] for f in RUN_FIELDS] for run in segment["runs"]]),
                        state=bool(segment.get("state", False)),
                        sub_block=segment.get("sub_block", 0),
                    )
                    for segment in route["segments"]
                ),
                slices=tuple(route.get("slices", ())),
                cp_modulus=route.get("cp_modulus", 1),
                cp_remainder=route.get("cp_remainder", 0),
                cp_side=route.get("cp_side"),
                block_ratio=route.get("block_ratio", 1),
                large_side=route.get("large_side"),
                small_tokens_per_block=route.get("small_tokens_per_block") or small_tpb,
            )
            for route in data["routes"]
        )
        receivers = tuple(
            ReceiverPlan(
                rank=receiver["rank"],
                writers=tuple(receiver["writer_ranks"]),
                overlapping=tuple(receiver["overlapping_ranks"]),
                staging_offsets=tuple(s["offset_per_block"] for s in receiver["staging"]),
                writer_bytes=tuple(s["bytes_per_block"] for s in receiver["staging"]),
                equal_split_safe=receiver["equal_split_safe"],
            )
            for receiver in data["receivers"]
        )
        pools = {
            (p["side"], p["rank"], p["pool"]): PoolRef(
                p["stride"], p["num_slots"], p["layer_group"]
            )
            for p in data["pools"]
        }
        return cls(
            data["context"],
            data["generation"],
            data["context_dp_rank"],
            data["generation_dp_rank"],
            data["tokens_per_block"],
            routes,
            receivers,
            tuple(data.get("warnings", ())),
            pools,
            data.get("generation_tokens_per_block"),
        )


def _runs_array(rows: Sequence[Sequence[int]]) -> np.ndarray:
    array = np.asarray(rows, dtype=np.int64)
    return array.reshape(-1, len(RUN_FIELDS))


# --------------------------------------------------------------------------------------------
# compilation


def compile_plan(
    context: Instance,
    generation: Instance,
    context_dp_rank: int | None = None,
    generation_dp_rank: int | None = None,
) -> Plan:
    """Compile the rank map and templates; raises :class:`GeometryError` when incompatible."""
    findings = Findings()
    if not check_instances(context, generation, findings):
        _raise_incompatible(findings.report())
    check_draft_layers(context, generation, findings)
    check_layer_counts(context, generation, findings)
    check_state_groups(context, generation, findings)
    senders = active_ranks(context, context_dp_rank, "context_dp_rank")
    receivers = active_ranks(generation, generation_dp_rank, "generation_dp_rank")
    cache: dict[Any, ViewGeometry] = {}
    derive_duplication(context, generation, cache)
    index = SenderIndex(context, senders)
    matches = _match_all(context, generation, index, receivers, findings, cache)
    report = findings.report()
    if not report.compatible:
        _raise_incompatible(report)

    builder = _RouteBuilder(context, generation, cache)
    overlapping: dict[int, set[int]] = {rank: set() for rank in receivers}
    # Phase 1: every (receiver slice, sender shard) in receiver rank order, keyed by the shard.
    work: dict[tuple[Any, ...], list[_Work]] = {}
    for match in sorted(matches, key=lambda m: (m.receiver_rank, m.receiver_view.index)):
        receiver = match.receiver_view
        local = geometry_of("generation", generation, match.receiver_rank, receiver, cache)
        start, stop = needed_range(local)
        layer_group = generation.table(match.receiver_rank).pools[receiver.pool].layer_group
        receiver_cp = generation.coords(match.receiver_rank)[2]
        for cp_rank, ranges in sender_ranges(context, match, cache).items():
            for a, b, replicas in ranges:
                lo, hi = max(start, a), min(stop, b)
                if lo >= hi:
                    continue
                overlapping[match.receiver_rank].update(rank for rank, _, _ in replicas)
                key = (
                    match.stage,
                    cp_rank,
                    receiver.owner,
                    receiver.roles_key,
                    a,
                    tuple(rank for rank, _, _ in replicas),
                    layer_group,
                    receiver_cp,
                )
                if isinstance(local, StateGeometry):
                    buffers = receiver.buffers_per_layer
                    per_layer = slice_bytes(local, lo, hi, buffers)
                else:
                    per_layer = _slice_bytes(match, local, lo, hi, context.tokens_per_block)
                work.setdefault(key, []).append(_Work(match, local, lo, hi, replicas, per_layer))
    # Phase 2: each shard's layers, in order, cut into one contiguous chunk per replica.
    rotation: dict[tuple[Any, ...], int] = {}
    first_turn = generation_dp_rank or 0
    for key, items in work.items():
        base = key[:6]  # the same shard in another layer group starts at the next replica
        turn = first_turn + rotation.get(base, 0)
        rotation[base] = rotation.get(base, 0) + 1
        for item, layers, choice in _elect(items, turn):
            rank, view, peer = item.replicas[choice]
            match = item.match
            if layers != match.layers:
                match = replace(match, layers=layers)
            builder.add(match, rank, view, peer, item.local, item.lo, item.hi)

    routes = builder.routes()
    receiver_plans = _receiver_plans(context, generation, routes, receivers, overlapping)
    warnings = tuple(issue.to_dict() for issue in report.warnings)
    return Plan(
        context.name,
        generation.name,
        context_dp_rank,
        generation_dp_rank,
        context.tokens_per_block,
        routes,
        receiver_plans,
        warnings,
        _pool_refs(context, generation, senders, receivers),
        generation.tokens_per_block,
    )


@dataclass(frozen=True)
class _Work:
    """One receiver slice ``[lo, hi)`` of one sender shard, and the shard's replicas."""

    match: Match
    local: ViewGeometry
    lo: int
    hi: int
    replicas: list[tuple[int, View, ViewGeometry]]
    per_layer: int  # bytes per block of one layer of this slice


def _elect(items: Sequence[_Work], turn: int) -> list[tuple[_Work, tuple[int, ...], int]]:
    """Cut a shard's ``(slice, layer)`` units, in order, into one contiguous chunk per replica.

    Unit ``u`` starting ``s_u`` bytes into the shard's ``total`` goes to chunk
    ``⌊s_u × n / total⌋``; chunk ``k`` is served by replica ``(k + turn) mod n``.
    With equal units every replica gets ``⌊m / n⌋`` or ``⌈m / n⌉`` of the ``m`` units, so no
    replica exceeds ``⌈total / n⌉`` by a unit or more; contiguous chunks keep runs mergeable.
    """
    n = len(items[0].replicas)
    if n == 1:  # no replicas: nothing to balance
        return [(item, item.match.layers, 0) for item in items]
    total = sum(item.per_layer * len(item.match.layers) for item in items)
    out: list[tuple[_Work, tuple[int, ...], int]] = []
    before = 0
    for item in items:
        current: list[int] = []
        current_choice = -1
        for layer in item.match.layers:
            chunk = before * n // total if total else 0
            choice = (chunk + turn) % n
            if choice != current_choice and current:
                out.append((item, tuple(current), current_choice))
                current = []
            current.append(layer)
            current_choice = choice
            before += item.per_layer
        if current:
            out.append((item, tuple(current), current_choice))
    return out


def _slice_bytes(match: Match, local: ViewGeometry, lo: int, hi: int, tokens: int) -> int:
    """Bytes per block of one layer of a slice (the election's unit)."""
    per_buffer = local.unit_bytes
    if local.layout != "REPLICATED":
        per_buffer *= (hi - lo) * (tokens if local.layout == "NHD" else 1)
    return match.receiver_view.buffers_per_layer * per_buffer


def _raise_incompatible(report: Report) -> None:
    raise GeometryError(
        [
            Problem(("pairing",), f"{issue.code}: {issue.message}", "incompatible")
            for issue in report.errors
        ]
    )


class _RouteBuilder:
    """Accumulates runs per (sender, receiver, src pool, dst pool) and merges them."""

    def __init__(
        self, context: Instance, generation: Instance, cache: dict[Any, ViewGeometry]
    ) -> None:
        self.context = context
        self.generation = generation
        self.cache = cache
        self.parts: dict[tuple[int, int], dict[tuple[int, int, int, int], list[np.ndarray]]] = {}
        self.slices: dict[tuple[int, int], list[dict[str, Any]]] = {}
        c, g = context.tokens_per_block, generation.tokens_per_block
        self.ratio = max(c, g) // min(c, g)
        self.large_side = None if c == g else ("context" if c > g else "generation")
        self.small_tokens_per_block = min(c, g)

    @staticmethod
    def _offsets(view: View, layers: tuple[int, ...]) -> np.ndarray:
        """Buffer offsets ``[len(layers), buffers_per_layer]`` of a view."""
        table = view.offset_table
        if len(layers) == len(view.layers):
            return table
        positions = np.searchsorted(np.asarray(view.layers), np.asarray(layers))
        return table[positions]

    def add(
        self,
        match: Match,
        sender_rank: int,
        sender: View,
        peer: ViewGeometry,
        local: ViewGeometry,
        lo: int,
        hi: int,
    ) -> None:
        receiver = match.receiver_view
        src = self._offsets(sender, match.layers).ravel()
        dst = self._offsets(receiver, match.layers).ravel()
        size = receiver.buffer_bytes
        n_runs = src.size
        per_sub: list[np.ndarray] = []
        if receiver.layout == "REPLICATED":
            runs = _stack(src, dst, size, 1, 0, 0)
            sender_heads = receiver_heads = None
        elif receiver.layout == "SECTIONED":
            assert isinstance(peer, StateGeometry) and isinstance(local, StateGeometry)
            runs = sectioned_runs(src, dst, lo, hi, peer, local)
            sender_heads = [lo - peer.shard * peer.heads, hi - peer.shard * peer.heads]
            receiver_heads = [lo - local.shard * local.heads, hi - local.shard * local.heads]
        else:
            heads = hi - lo
            src_head = lo - peer.shard * peer.heads
            dst_head = lo - local.shard * local.heads
            unit = local.unit_bytes
            full = heads == peer.heads == local.heads
            tokens = self.context.tokens_per_block
            state = self.generation.is_state_group(
                self.generation.table(match.receiver_rank).pools[receiver.pool].layer_group
            )
            if self.large_side is not None and not state:
                # HND paged views on both sides: validation refuses the rest; state views
                # (one slot per request, no tokens) move as with equal block sizes
                per_sub = _ratio_runs(src, dst, src_head, dst_head, heads, peer, local,
                                      self.ratio, self.large_side)  # fmt: skip
                runs = np.concatenate(per_sub)
            elif sender.layout != receiver.layout:
                runs = _conversion_runs(src, dst, src_head, dst_head, heads, peer, local, tokens)
            elif receiver.layout == "HND" or full:
                length = size if full else heads * unit
                runs = _stack(src + src_head * unit, dst + dst_head * unit, length, 1, 0, 0)
            else:
                runs = _stack(
                    src + src_head * unit,
                    dst + dst_head * unit,
                    heads * unit,
                    tokens,
                    peer.token_bytes,
                    local.token_bytes,
                )
            sender_heads = [src_head, src_head + heads]
            receiver_heads = [dst_head, dst_head + heads]
        assert runs.shape[0] % n_runs == 0
        sender_pool = self.context.table(sender_rank).pools[sender.pool]
        route_key = (sender_rank, match.receiver_rank)
        pools = self.parts.setdefault(route_key, {})
        for sub, sub_runs in enumerate(per_sub or [runs]):
            pool_key = (sender.pool, receiver.pool, sender_pool.layer_group, sub)
            pools.setdefault(pool_key, []).append(sub_runs)
        self.slices.setdefault(route_key, []).append(
            {
                "receiver_view": receiver.index,
                "sender_view": sender.index,
                "owner": receiver.owner,
                "roles": list(receiver.roles_key),
                "layout": receiver.layout,
                "sender_layout": sender.layout,
                "layers": list(match.layers),
                "global_heads": None if sender_heads is None else [lo, hi],
                "sender_local_heads": sender_heads,
                "receiver_local_heads": receiver_heads,
                "bytes_per_block": int((runs[:, 2] * runs[:, 3]).sum()),
            }
        )

    def routes(self) -> tuple[Route, ...]:
        routes = []
        for (sender_rank, receiver_rank), pools in sorted(self.parts.items()):
            segments = tuple(
                Segment(
                    src_pool,
                    dst_pool,
                    group,
                    merge_runs(np.concatenate(parts)),
                    state=self.generation.is_state_group(group),
                    sub_block=sub,
                )
                for (src_pool, dst_pool, group, sub), parts in sorted(pools.items())
            )
            modulus, remainder, side = self._cp_filter(sender_rank, receiver_rank)
            routes.append(
                Route(
                    sender_rank,
                    receiver_rank,
                    segments,
                    tuple(self.slices[(sender_rank, receiver_rank)]),
                    modulus,
                    remainder,
                    side,
                    self.ratio,
                    self.large_side,
                    self.small_tokens_per_block,
                )
            )
        return tuple(routes)

    def _cp_filter(self, sender_rank: int, receiver_rank: int) -> tuple[int, int, str | None]:
        if self.context.cp > 1:
            return self.context.cp, self.context.coords(sender_rank)[2], "context"
        if self.generation.cp > 1:
            return self.generation.cp, self.generation.coords(receiver_rank)[2], "generation"
        return 1, 0, None


def _ratio_runs(
    src: np.ndarray,
    dst: np.ndarray,
    src_head: int,
    dst_head: int,
    heads: int,
    peer: ViewGeometry,
    local: ViewGeometry,
    ratio: int,
    large_side: str,
) -> list[np.ndarray]:
    """HND with a block-size ratio ``r``: the runs of each sub-block ``i in [0, r)``.

    With ``b`` the bytes of one head of one *small* block, a small block holds head ``h`` at
    ``h × b``, a large block at ``h × r·b``, and small block ``i`` of a large one is, per head,
    the run ``[h × r·b + i × b, + b)``. Per sub-block: one run per (layer, buffer) of ``len = b``
    and ``count = heads``, stepping by each side's bytes per head (``r·b`` and ``b``).
    """
    small = min(peer.unit_bytes, local.unit_bytes)  # b (equal head-token bytes: validated)
    count, steps = (heads, (peer.unit_bytes, local.unit_bytes)) if heads > 1 else (1, (0, 0))
    src0 = src + src_head * peer.unit_bytes
    dst0 = dst + dst_head * local.unit_bytes
    out = []
    for sub in range(ratio):
        shift = sub * small
        src_sub, dst_sub = (src0 + shift, dst0) if large_side == "context" else (src0, dst0 + shift)
        out.append(_stack(src_sub, dst_sub, small, count, *steps))
    return out


def _conversion_runs(
    src: np.ndarray,
    dst: np.ndarray,
    src_head: int,
    dst_head: int,
    heads: int,
    peer: ViewGeometry,
    local: ViewGeometry,
    tokens: int,
) -> np.ndarray:
    """HND ↔ NHD: one run per (layer, buffer, head) with ``count = tokens_per_block``.

    With ``u`` the bytes of one head of one token, head ``i`` of a buffer starts at ``i × T × u``
    (HND, ``T`` tokens) or ``i × u`` (NHD); token ``t`` adds ``t × u`` (HND) or ``t × token_bytes``
    (NHD). Rows are (layer, buffer)-major, then head.
    """
    head_token = (peer if peer.layout == "NHD" else local).unit_bytes  # equal on both sides
    offsets = np.arange(heads, dtype=np.int64)

    def side(base: np.ndarray, first: int, geometry: ViewGeometry) -> tuple[np.ndarray, int]:
        if geometry.layout == "HND":
            per_head, step = geometry.unit_bytes, head_token
        else:
            per_head, step = head_token, geometry.token_bytes
        starts = base[:, None] + (first + offsets)[None, :] * per_head
        return starts.ravel(), step

    src_starts, src_step = side(src, src_head, peer)
    dst_starts, dst_step = side(dst, dst_head, local)
    return _stack(src_starts, dst_starts, head_token, tokens, src_step, dst_step)


def _stack(
    src: np.ndarray, dst: np.ndarray, length: int, count: int, src_step: int, dst_step: int
) -> np.ndarray:
    runs = np.empty((src.size, 6), dtype=np.int64)
    runs[:, 0] = src
    runs[:, 1] = dst
    runs[:, 2] = length
    runs[:, 3] = count
    runs[:, 4] = src_step
    runs[:, 5] = dst_step
    return runs


def merge_runs(runs: np.ndarray) -> np.ndarray:
    """Sort runs by source offset and merge neighbours contiguous on both sides.

    Only single runs (``count == 1``) merge: a run starting where the previous one ends on the
    source *and* the destination side extends it. Strided NHD runs of one route belong to
    different (layer, buffer) rows and are never contiguous.
    """
    if len(runs) < 2:
        return runs
    runs = runs[np.lexsort((runs[:, 1], runs[:, 0]))]
    prev, cur = runs[:-1], runs[1:]
    joins = (
        (prev[:, 3] == 1)
        & (cur[:, 3] == 1)
        & (cur[:, 0] == prev[:, 0] + prev[:, 2])
        & (cur[:, 1] == prev[:, 1] + prev[:, 2])
    )
    if not joins.any():
        return runs
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    merged = runs[starts].copy()
    merged[:, 2] = np.add.reduceat(runs[:, 2], starts)
    return merged


def _receiver_plans(
    context: Instance,
    generation: Instance,
    routes: Sequence[Route],
    receivers: Sequence[int],
    overlapping: Mapping[int, set[int]],
) -> tuple[ReceiverPlan, ...]:
    plans = []
    for rank in receivers:
        mine = [route for route in routes if route.receiver_rank == rank]
        writers = tuple(route.sender_rank for route in mine)
        sizes = tuple(route.bytes_per_block for route in mine)
        offsets = (
            tuple(int(x) for x in np.concatenate(([0], np.cumsum(sizes)[:-1])).tolist())
            if sizes
            else ()
        )
        # Block counts differ per layer group (full attention vs sliding window), so writers
        # carry equal bytes per request only if they carry equal bytes per block in every group.
        per_group = [_bytes_per_group(route) for route in mine]
        state = any(segment.state for route in mine for segment in route.segments)
        safe = (
            bool(writers)
            and not (state and len(writers) > 1)
            and set(writers) == overlapping[rank]
            and all(groups == per_group[0] for groups in per_group)
            and context.cp == 1
            and generation.cp == 1
            and (context.pp == 1 or len(writers) == 1)
        )
        plans.append(
            ReceiverPlan(rank, writers, tuple(sorted(overlapping[rank])), offsets, sizes, safe)
        )
    return tuple(plans)


def _bytes_per_group(route: Route) -> dict[int, int]:
    groups: dict[int, int] = {}
    for segment in route.segments:
        groups[segment.layer_group] = groups.get(segment.layer_group, 0) + segment.bytes_per_block
    return groups


def _pool_refs(
    context: Instance, generation: Instance, senders: Sequence[int], receivers: Sequence[int]
) -> dict[tuple[str, int, int], PoolRef]:
    refs: dict[tuple[str, int, int], PoolRef] = {}
    for side, instance, ranks in (
        ("context", context, senders),
        ("generation", generation, receivers),
    ):
        for rank in ranks:
            for pool in instance.table(rank).pools.values():
                refs[(side, rank, pool.id)] = PoolRef(
                    pool.slot_stride_bytes, pool.num_slots, pool.layer_group
                )
    return refs
