"""Pairing validation: every reason a context instance cannot feed a generation instance.

All failures are collected (never only the first) as ``{code, message, detail}``; ``detail``
names the ranks, views, layers, the field and both values (``local`` = generation side, the
receiver; ``peer`` = context side, the sender). Identical findings on many ranks are reported
once with the rank lists merged. Codes are stable API:

=============================  =====================================================================
code                           meaning
=============================  =====================================================================
``instance_not_ready``         an instance has ranks that never reported their page table
``role_mismatch``              the "context" side is not a context instance (or vice versa)
``tokens_per_block_mismatch``  the two sides page tokens differently and no ratio serves them:
                               not a multiple, CP on a side, or a non-HND view
                               (``detail.reasons``)
``model_mismatch``             both sides name a model and the names differ
``context_parallel_both_sides``CP > 1 on both sides
``missing_peer_view``          no sender view holds the layer with this owner and roles
                               (a warning for draft layers when the context has no draft layers
                               at all: they are then not transferred; an error otherwise)
``misplaced_peer_view``        only a view of the *other* owner (target vs draft) holds the layer
``ambiguous_peer_view``        two sender pipeline stages hold the layer
``layout_mismatch``            REPLICATED against HND or NHD (HND ↔ NHD converts)
``dtype_mismatch``             element types differ
``head_dim_mismatch``          ``head_dim`` differs (when both give it)
``buffers_per_layer_mismatch`` K/V vs K-only buffer rows
``head_count_mismatch``        the matched views have different total KV heads ``H``
``head_geometry_mismatch``     bytes of one head of one token (or the replicated region) differ;
                               shard counts need not divide each other (ranges are intersected)
``missing_peer_shard``         the layer is held by some ranks of a sender stage, but no rank of
                               one CP rank (or none at all) holds the heads a receiver needs
``layer_group_mismatch``       matched views live in pools of different layer groups
``draft_layer_count_mismatch`` both sides have draft layers, but not the same number
``draft_layer_mismatch``       both sides have as many draft layers, numbered differently
=============================  =====================================================================

Per-request state groups (``tokens_per_slot: null``) add ``state_group_mismatch``,
``state_bytes_mismatch``, ``section_count_mismatch``, ``section_bytes_mismatch`` and
``d_state_mismatch``: see :mod:`geometry.state_checks`.

Warnings: ``missing_peer_view`` (draft), ``layer_count_mismatch``, ``nhd_head_slicing``,
``layout_conversion`` (HND ↔ NHD, converted head by head), ``tokens_per_block_ratio`` (HND on
both sides, no CP, the larger ``tokens_per_block`` a multiple ``r`` of the smaller: one large
block pairs with ``r`` small ones by token position, so transfers must give ``num_tokens``, see
:mod:`geometry.align`; ``detail.ratio`` and ``detail.larger_side``; per-request state
groups are unaffected and still pair one slot per side).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Any

from geometry.errors import GeometryError
from geometry.heads import ViewGeometry, assumed_total, declared_heads, derived_total
from geometry.match import Match, Unmatched
from geometry.model import Instance, View
from geometry.state import is_state_view, view_geometry


@dataclass(frozen=True)
class Issue:
    """One finding of a validation: an error or a warning."""

    code: str
    message: str
    detail: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "detail": self.detail}


@dataclass(frozen=True)
class Report:
    """The outcome of validating a pairing."""

    errors: tuple[Issue, ...]
    warnings: tuple[Issue, ...]

    @property
    def compatible(self) -> bool:
        return not self.errors

    def codes(self) -> list[str]:
        return [issue.code for issue in self.errors]

    def to_dict(self) -> dict[str, Any]:
        return {
            "compatible": self.compatible,
            "errors": [issue.to_dict() for issue in self.errors],
            "warnings": [issue.to_dict() for issue in self.warnings],
        }


@dataclass
class _Finding:
    code: str
    message: str
    detail: dict[str, Any]
    receiver_ranks: set[int] = field(default_factory=set)
    sender_ranks: set[int] = field(default_factory=set)
    layers: set[int] = field(default_factory=set)


class Findings:
    """Collects findings, merging the same finding seen on many ranks and layers."""

    def __init__(self) -> None:
        self._errors: dict[tuple[Any, ...], _Finding] = {}
        self._warnings: dict[tuple[Any, ...], _Finding] = {}
        self._error_adds = 0

    def add(
        self,
        code: str,
        message: str,
        *,
        warning: bool = False,
        receiver_ranks: Iterable[int] = (),
        sender_ranks: Iterable[int] = (),
        layers: Iterable[int] = (),
        **detail: Any,
    ) -> None:
        bucket = self._warnings if warning else self._errors
        self._error_adds += not warning
        key = (code, message, tuple(sorted(detail.items(), key=lambda item: item[0])).__repr__())
        finding = bucket.get(key)
        if finding is None:
            finding = bucket[key] = _Finding(code, message, detail)
        finding.receiver_ranks.update(receiver_ranks)
        finding.sender_ranks.update(sender_ranks)
        finding.layers.update(layers)

    @property
    def has_errors(self) -> bool:
        return bool(self._errors)

    @property
    def error_count(self) -> int:
        """Errors added so far (merged or not): a check compares it before and after."""
        return self._error_adds

    def report(self) -> Report:
        return Report(_issues(self._errors.values()), _issues(self._warnings.values()))


def _issues(findings: Iterable[_Finding]) -> tuple[Issue, ...]:
    issues = []
    for finding in findings:
        detail = dict(finding.detail)
        if finding.receiver_ranks:
            detail["generation_ranks"] = sorted(finding.receiver_ranks)
        if finding.sender_ranks:
            detail["context_ranks"] = sorted(finding.sender_ranks)
        if finding.layers:
            detail["layers"] = sorted(finding.layers)
        issues.append(Issue(finding.code, finding.message, detail))
    return tuple(issues)


# --------------------------------------------------------------------------------------------


def check_instances(context: Instance, generation: Instance, findings: Findings) -> bool:
    """Instance-level checks; returns False when view-level checks cannot run."""
    runnable = True
    for side, instance, role in (
        ("context", context, "context"),
        ("generation", generation, "generation"),
    ):
        if instance.role != role:
            findings.add(
                "role_mismatch",
                f"{instance.name} is a {instance.role} instance but is used as the {side} side",
                instance=instance.name,
                field="role",
                expected=role,
                actual=instance.role,
            )
            runnable = False
        if not instance.is_complete:
            missing = list(instance.missing_ranks)
            findings.add(
                "instance_not_ready",
                f"{instance.name} has {len(missing)} of {instance.world_size} ranks that have not "
                "reported their page table",
                instance=instance.name,
                missing_ranks=missing[:64],
                missing_count=len(missing),
            )
            runnable = False
    check_block_sizes(context, generation, findings)
    if context.model and generation.model and context.model != generation.model:
        findings.add(
            "model_mismatch",
            f"context serves model {context.model!r}, generation {generation.model!r}",
            field="model",
            local=generation.model,
            peer=context.model,
        )
    if context.cp > 1 and generation.cp > 1:
        findings.add(
            "context_parallel_both_sides",
            f"CP > 1 on both sides (context cp={context.cp}, generation cp={generation.cp}); "
            "at most one side may shard the sequence",
            field="cp",
            local=generation.cp,
            peer=context.cp,
        )
    return runnable


def check_block_sizes(context: Instance, generation: Instance, findings: Findings) -> None:
    """Equal ``tokens_per_block``, or (HND only, no CP) one a multiple of the other: a warning.

    Every reason a ratio cannot be served is named (``detail.reasons``): ``not_a_multiple``,
    ``context_parallel`` (helix ownership ``[cp_rank::cp]`` needs coinciding block boundaries)
    and ``layout`` (an NHD or REPLICATED view on either side: kvplane splits a large block into
    small ones only for HND, where a small block is, per head, one contiguous run).
    """
    c, g = context.tokens_per_block, generation.tokens_per_block
    if c == g:
        return
    large, small = max(c, g), min(c, g)
    larger_side = "context" if c > g else "generation"
    common: dict[str, Any] = {"field": "tokens_per_block", "local": g, "peer": c}
    reasons: dict[str, str] = {}
    if large % small:
        reasons["not_a_multiple"] = f"{large} is not a multiple of {small}"
    sides = (("context", context), ("generation", generation))
    cp_sides = [f"{side} cp={instance.cp}" for side, instance in sides if instance.cp > 1]
    if cp_sides:
        reasons["context_parallel"] = (
            f"CP > 1 ({', '.join(cp_sides)}) needs equal tokens_per_block: CP ranks own "
            "logical blocks round-robin, so block boundaries must coincide"
        )
    other = _non_hnd_views(context, "context") + _non_hnd_views(generation, "generation")
    if other:
        shown = ", ".join(other[:4]) + (f" (+{len(other) - 4} more)" if len(other) > 4 else "")
        reasons["layout"] = f"block-size ratios are supported for HND views only, not {shown}"
    if reasons:
        findings.add(
            "tokens_per_block_mismatch",
            f"context pages {c} tokens per block, generation {g}: " + "; ".join(reasons.values()),
            reasons=list(reasons),
            non_hnd_views=other[:64],
            **common,
        )
        return
    ratio = large // small
    smaller_side = "generation" if larger_side == "context" else "context"
    findings.add(
        "tokens_per_block_ratio",
        f"context pages {c} tokens per block, generation {g}: each {larger_side} block pairs "
        f"with {ratio} consecutive {smaller_side} blocks by token position from the start of "
        "the request: every transfer must give num_tokens (the prompt tokens), each block "
        "list ends with the block of the last prompt token, and a partial last block moves "
        "only the tokens that exist",
        warning=True,
        ratio=ratio,
        larger_side=larger_side,
        **common,
    )


def _non_hnd_views(instance: Instance, side: str) -> list[str]:
    """``"context target[key]@pool1 (REPLICATED)"`` per distinct non-HND paged view of an instance.

    Per-request state views (SECTIONED conv state, HND SSM heads) have no token axis: a ratio
    does not apply to them (one slot pair per request, whatever the block sizes), so they never
    stand in its way.
    """
    seen: dict[str, None] = {}
    for table in instance.ranks:
        if table is None:
            continue
        for view in table.views:
            if view.layout != "HND" and not is_state_view(instance, table, view):
                seen[f"{side} {view.label()} ({view.layout})"] = None
    return list(seen)


def check_draft_layers(context: Instance, generation: Instance, findings: Findings) -> None:
    """Both sides with draft layers must hold the same draft layers: the same number
    (``draft_layer_count_mismatch``) with the same global ids (``draft_layer_mismatch``).

    As TensorRT-LLM compares a standalone drafter's first layer, layer count, head_dim and
    dtype: draft layers numbered differently would match nothing and move nothing. Their head
    geometry is then compared per matched view pair like a target's (``head_count_mismatch``,
    ``head_dim_mismatch``, ``dtype_mismatch``, …). Only "the generation has a drafter, the
    context none" is a warning (``missing_peer_view``: those layers are not transferred).
    """
    ids = [draft_layers(instance) for instance in (context, generation)]
    counts = [len(layers) for layers in ids]
    if not (counts[0] and counts[1]):
        return
    if counts[0] != counts[1]:
        findings.add(
            "draft_layer_count_mismatch",
            f"context has {counts[0]} draft layers, generation {counts[1]}",
            field="draft_layers",
            local=counts[1],
            peer=counts[0],
        )
        return
    if ids[0] != ids[1]:
        shapes = [_draft_shapes(instance) for instance in (context, generation)]
        findings.add(
            "draft_layer_mismatch",
            f"the context numbers its draft layers {_layer_span(ids[0])} "
            f"({', '.join(shapes[0])}), the generation {_layer_span(ids[1])} "
            f"({', '.join(shapes[1])}): draft layers pair by global layer id, so both sides "
            "must number them alike",
            field="draft_layers",
            local=sorted(ids[1])[:64],
            peer=sorted(ids[0])[:64],
            local_views=shapes[1],
            peer_views=shapes[0],
        )


def draft_layers(instance: Instance) -> frozenset[int]:
    """Global ids of the draft-owned layers of an instance (every rank)."""
    return frozenset(
        layer
        for table in instance.ranks
        if table is not None
        for view in table.views
        if view.owner == "draft"
        for layer in view.layers
    )


def _layer_span(layers: frozenset[int]) -> str:
    ordered = sorted(layers)
    if ordered == list(range(ordered[0], ordered[-1] + 1)) and len(ordered) > 1:
        return f"{ordered[0]}–{ordered[-1]}"
    return ", ".join(map(str, ordered[:8])) + (" …" if len(ordered) > 8 else "")


def _draft_shapes(instance: Instance) -> list[str]:
    """``"key,value HND head_dim 4 bfloat16 heads 2"`` per distinct draft view shape."""
    seen: dict[str, None] = {}
    for table in instance.ranks:
        if table is None:
            continue
        for view in table.views:
            if view.owner == "draft":
                heads = view.total_kv_heads or view.num_kv_heads
                seen[
                    f"{','.join(view.roles_key)} {view.layout} head_dim {view.head_dim} "
                    f"{view.dtype} heads {heads}"
                ] = None
    return list(seen)[:8]


def check_layer_counts(context: Instance, generation: Instance, findings: Findings) -> None:
    """Warn when the two sides hold different target layer sets."""
    sets = []
    for instance in (context, generation):
        sets.append(
            {
                layer
                for table in instance.ranks
                if table is not None
                for view in table.views
                if view.owner == "target"
                for layer in view.layers
            }
        )
    if sets[0] != sets[1]:
        only_context = sorted(sets[0] - sets[1])
        only_generation = sorted(sets[1] - sets[0])
        findings.add(
            "layer_count_mismatch",
            f"context holds {len(sets[0])} target layers, generation {len(sets[1])}",
            warning=True,
            field="layers",
            local=len(sets[1]),
            peer=len(sets[0]),
            only_context=only_context[:64],
            only_generation=only_generation[:64],
        )


def report_unmatched(
    unmatched: Sequence[Unmatched], findings: Findings, context_has_draft: bool = False
) -> None:
    """Receiver views without a sender view. A draft layer without one is only a warning when
    the context has no draft layers at all (a drafter on the generation side alone)."""
    for item in unmatched:
        view = item.receiver_view
        common: dict[str, Any] = {
            "receiver_view": view.index,
            "view": view.label(),
            "owner": view.owner,
            "roles": list(view.roles_key),
        }
        if item.kind == "ambiguous":
            findings.add(
                "ambiguous_peer_view",
                f"{view.label()}: layers are held by several context pipeline stages",
                receiver_ranks=[item.receiver_rank],
                layers=[item.layer],
                stages=list(item.stages),
                **common,
            )
        elif item.kind == "misplaced":
            findings.add(
                "misplaced_peer_view",
                f"{view.label()}: the context holds these layers only in a view owned by the "
                f"other model ({', '.join(item.other_owner_views)}); {view.owner} layers are "
                "never filled from another owner's view",
                receiver_ranks=[item.receiver_rank],
                layers=[item.layer],
                peer_views=list(item.other_owner_views),
                **common,
            )
        else:
            draft = view.owner == "draft" and not context_has_draft
            hint = (
                f" (the context has them with roles {[list(r) for r in item.other_roles]})"
                if item.other_roles
                else ""
            )
            findings.add(
                "missing_peer_view",
                f"{view.label()}: no context view holds these layers with the same owner and "
                f"roles{hint}"
                + (
                    "; the context has no draft layers, so these are not transferred"
                    if draft
                    else "; the context has draft layers too: both sides' draft layers must "
                    "match like target layers"
                    if view.owner == "draft"
                    else ""
                ),
                warning=draft,
                receiver_ranks=[item.receiver_rank],
                layers=[item.layer],
                **common,
            )


def derive_duplication(
    context: Instance, generation: Instance, cache: dict[Any, ViewGeometry]
) -> None:
    """Per-view totals that only the "no duplication" assumption gave, re-derived from both
    sides' counts (as TensorRT-LLM's duplicate-head factor): per class of views (owner, roles),
    when the two sides' head counts differ and one side's count is only assumed (``h × G``),
    the smaller count ``H`` is adopted for that side if it explains its declared ``h``
    (``H / min(G, H) == h``, so ``h × G / H`` ranks hold each head). The re-derived geometry
    goes into ``cache`` (``geometry_of`` reads it); anything else is left to ``check_match``,
    whose ``head_count_mismatch`` then names ``total_kv_heads``.
    """
    sides = (("context", context), ("generation", generation))
    totals: dict[tuple[str, tuple[str, ...]], dict[str, set[tuple[int | None, int]]]] = {}
    for side, instance in sides:
        for table in instance.ranks:
            if table is None:
                continue
            for view in table.views:
                if is_state_view(instance, table, view) or view.layout == "REPLICATED":
                    continue
                assumed = assumed_total(instance, table, view)
                declared, _ = declared_heads(instance, table, view)
                if assumed is not None:
                    entry = (declared, assumed)
                else:
                    try:
                        entry = (None, view_geometry(instance, table, view).total_heads)
                    except GeometryError:
                        continue
                key = (view.owner, view.roles_key)
                totals.setdefault(key, {}).setdefault(side, set()).add(entry)
    for (owner, roles), per_side in totals.items():
        if len(per_side) != 2 or any(len(entries) != 1 for entries in per_side.values()):
            continue
        (ctx_entry,), (gen_entry,) = per_side["context"], per_side["generation"]
        heads = min(ctx_entry[1], gen_entry[1])
        if ctx_entry[1] == gen_entry[1]:
            continue
        for (side, instance), (declared, total) in zip(sides, (ctx_entry, gen_entry), strict=True):
            if declared is None or total == heads or not derived_total(instance, declared, heads):
                continue
            for table in instance.ranks:
                if table is None:
                    continue
                for view in table.views:
                    if (
                        view.owner == owner
                        and view.roles_key == roles
                        and (assumed_total(instance, table, view) is not None)
                    ):
                        explicit = replace(view, total_kv_heads=heads)
                        cache[(side, table.rank, view.index)] = view_geometry(
                            instance, table, explicit
                        )


def geometry_of(
    side: str, instance: Instance, rank: int, view: View, cache: dict[Any, ViewGeometry]
) -> ViewGeometry:
    """A view's geometry, memoized per ``(side, rank, view)``: never by instance name, which
    both sides may share (two bodies of one model checked against each other)."""
    key = (side, rank, view.index)
    geometry = cache.get(key)
    if geometry is None:
        geometry = cache[key] = view_geometry(instance, instance.table(rank), view)
    return geometry


def mismatch_finding(
    findings: Findings,
    match: Match,
    sender_rank: int,
    sender: View,
    code: str,
    what: str,
    field_name: str,
    local_value: Any,
    peer_value: Any,
    **extra: Any,
) -> None:
    """One field of a matched view pair differs: a finding naming both views and ranks."""
    receiver = match.receiver_view
    findings.add(
        code,
        f"{receiver.label()}: {what} differs (generation {local_value}, context {peer_value})",
        receiver_ranks=[match.receiver_rank],
        sender_ranks=[sender_rank],
        layers=match.layers,
        field=field_name,
        local=local_value,
        peer=peer_value,
        receiver_view=receiver.index,
        sender_view=sender.index,
        view=receiver.label(),
        peer_view=sender.label(),
        **extra,
    )


def head_token_bytes(geometry: ViewGeometry, tokens_per_block: int) -> Fraction:
    """Bytes of one head of one token: ``bytes_per_head / tokens_per_block`` (HND) or the NHD
    unit; a fraction for sub-byte types (FP4 with a tiny head_dim)."""
    if geometry.layout == "HND":
        return Fraction(geometry.unit_bytes, tokens_per_block)
    return Fraction(geometry.unit_bytes)


def check_match(
    context: Instance,
    generation: Instance,
    match: Match,
    findings: Findings,
    cache: dict[Any, ViewGeometry],
) -> bool:
    """Check every sender view of one match against the receiver view; True when all pass.

    Every check runs (a layout mismatch does not hide a dtype or head_dim mismatch); only the
    checks that need comparable geometry are skipped after a structural mismatch.
    """
    receiver = match.receiver_view
    local = geometry_of("generation", generation, match.receiver_rank, receiver, cache)
    receiver_pool = generation.table(match.receiver_rank).pools[receiver.pool]
    ok = True
    for holder in match.holders:
        sender = holder.view
        peer = geometry_of("context", context, holder.rank, sender, cache)
        sender_pool = context.table(holder.rank).pools[sender.pool]
        before = findings.error_count

        def mismatch(
            code: str,
            what: str,
            field_name: str,
            local_value: Any,
            peer_value: Any,
            sender: View = sender,
            rank: int = holder.rank,
        ) -> None:
            mismatch_finding(
                findings, match, rank, sender, code, what, field_name, local_value, peer_value
            )

        replicated = {sender.layout, receiver.layout} & {"REPLICATED"}
        comparable = True
        if sender.layout != receiver.layout and replicated:
            mismatch("layout_mismatch", "layout", "layout", receiver.layout, sender.layout)
            comparable = False
        if sender.dtype != receiver.dtype:
            mismatch("dtype_mismatch", "dtype", "dtype", receiver.dtype, sender.dtype)
        if sender.head_dim and receiver.head_dim and sender.head_dim != receiver.head_dim:
            mismatch(
                "head_dim_mismatch", "head_dim", "head_dim", receiver.head_dim, sender.head_dim
            )
        if sender.buffers_per_layer != receiver.buffers_per_layer:
            mismatch(
                "buffers_per_layer_mismatch",
                "buffers per layer",
                "buffers",
                receiver.buffers_per_layer,
                sender.buffers_per_layer,
            )
            comparable = False
        if sender_pool.layer_group != receiver_pool.layer_group:
            mismatch(
                "layer_group_mismatch",
                "layer group",
                "layer_group",
                receiver_pool.layer_group,
                sender_pool.layer_group,
            )
        if not comparable:
            ok = False
            continue
        if receiver.layout == "REPLICATED":
            if peer.unit_bytes != local.unit_bytes:
                mismatch(
                    "head_geometry_mismatch",
                    "replicated region size",
                    "size",
                    local.unit_bytes,
                    peer.unit_bytes,
                )
            ok = ok and findings.error_count == before
            continue
        if peer.total_heads != local.total_heads:
            mismatch(
                "head_count_mismatch",
                "total KV heads (a side that gives only num_kv_heads is taken as h × tp, no "
                "duplication, unless the other side's count explains it: give total_kv_heads "
                "on the views)",
                "total_kv_heads",
                local.total_heads,
                peer.total_heads,
            )
            ok = False
            continue
        # Any two shardings pair (head ranges are intersected); only the bytes of one head of
        # one token must agree, whatever the layouts and block sizes.
        local_unit = head_token_bytes(local, generation.tokens_per_block)
        peer_unit = head_token_bytes(peer, context.tokens_per_block)
        if receiver.layout == sender.layout and context.tokens_per_block == (
            generation.tokens_per_block
        ):
            unit = "bytes_per_head" if receiver.layout == "HND" else "head_token_bytes"
            local_value: int | float = local.unit_bytes
            peer_value: int | float = peer.unit_bytes
        else:
            unit = "head_token_bytes"
            local_value, peer_value = _number(local_unit), _number(peer_unit)
        if local_unit != peer_unit:
            mismatch(
                "head_geometry_mismatch", unit.replace("_", " "), unit, local_value, peer_value
            )
            ok = False
            continue
        if sender.layout != receiver.layout and local_unit.denominator != 1:
            mismatch(
                "head_geometry_mismatch",
                "head-token bytes (not a whole byte: no layout conversion)",
                "head_token_bytes",
                local_value,
                peer_value,
            )
            ok = False
            continue
        if sender.layout != receiver.layout:
            _warn_conversion(context, match, holder.rank, sender, local, peer, findings)
        elif receiver.layout == "NHD" and local.heads != peer.heads:
            _warn_nhd_slicing(context, match, holder.rank, local, peer, findings)
        ok = ok and findings.error_count == before
    return ok


def _number(value: Fraction) -> int | float:
    return int(value) if value.denominator == 1 else float(value)


def _warn_nhd_slicing(
    context: Instance,
    match: Match,
    sender_rank: int,
    local: ViewGeometry,
    peer: ViewGeometry,
    findings: Findings,
) -> None:
    receiver = match.receiver_view
    per_token = _pieces(local, peer)
    findings.add(
        "nhd_head_slicing",
        f"{receiver.label()}: NHD head slicing ({peer.heads} heads per context rank, "
        f"{local.heads} per generation rank) cuts every token row into {per_token} "
        f"fragment(s): {context.tokens_per_block * per_token} per block, layer and buffer",
        warning=True,
        receiver_ranks=[match.receiver_rank],
        sender_ranks=[sender_rank],
        view=receiver.label(),
        fragments_per_token=per_token,
        fragments_per_block_layer_buffer=context.tokens_per_block * per_token,
    )


def _pieces(local: ViewGeometry, peer: ViewGeometry) -> int:
    """Sender shards a receiver's head range is cut into (range intersection, any ratio)."""
    start, stop = local.head_range
    return (stop - 1) // peer.heads - start // peer.heads + 1


def _warn_conversion(
    context: Instance,
    match: Match,
    sender_rank: int,
    sender: View,
    local: ViewGeometry,
    peer: ViewGeometry,
    findings: Findings,
) -> None:
    receiver = match.receiver_view
    tokens = context.tokens_per_block
    # one strided run per (layer, buffer, head), count = tokens_per_block: a fragment per
    # head and token
    per_block = tokens * local.heads
    findings.add(
        "layout_conversion",
        f"{receiver.label()}: context {sender.layout} → generation {receiver.layout}: converted "
        f"head by head, {per_block} fragments per block, layer and buffer "
        f"({local.heads} heads × {tokens} tokens); a staged transfer gathers them in one pass",
        warning=True,
        receiver_ranks=[match.receiver_rank],
        sender_ranks=[sender_rank],
        view=receiver.label(),
        local=receiver.layout,
        peer=sender.layout,
        fragments_per_block_layer_buffer=per_block,
    )


def sender_ranges(
    context: Instance, match: Match, cache: dict[Any, ViewGeometry]
) -> dict[int, list[tuple[int, int, list[tuple[int, View, ViewGeometry]]]]]:
    """Per sender CP rank: the distinct head ranges ``[a, b)`` of the match's holders (in head
    order) with the holders of each (its replicas, in rank order). REPLICATED: one range."""
    by_cp: dict[int, dict[tuple[int, int], list[tuple[int, View, ViewGeometry]]]] = {
        cp_rank: {} for cp_rank in range(context.cp)
    }
    for holder in match.holders:
        peer = geometry_of("context", context, holder.rank, holder.view, cache)
        head_range = (0, 1) if peer.layout == "REPLICATED" else peer.head_range
        cp_rank = context.coords(holder.rank)[2]
        by_cp[cp_rank].setdefault(head_range, []).append((holder.rank, holder.view, peer))
    return {
        cp_rank: [(a, b, holders) for (a, b), holders in sorted(ranges.items())]
        for cp_rank, ranges in by_cp.items()
    }


def needed_range(local: ViewGeometry) -> tuple[int, int]:
    return (0, 1) if local.layout == "REPLICATED" else local.head_range


def check_coverage(
    context: Instance,
    generation: Instance,
    match: Match,
    findings: Findings,
    cache: dict[Any, ViewGeometry],
) -> None:
    """Every head the receiver needs is held by some sender rank of every CP rank of the stage.

    A TP rank (or CP rank) that lacks a layer its peers hold would otherwise leave a hole: the
    compile had no holder to elect (TP) or silently skipped that CP rank's blocks.
    """
    receiver = match.receiver_view
    local = geometry_of("generation", generation, match.receiver_rank, receiver, cache)
    start, stop = needed_range(local)
    for cp_rank, ranges in sender_ranges(context, match, cache).items():
        cursor = start
        gaps = []
        for a, b, _holders in ranges:
            if b <= cursor or a >= stop:
                continue
            if a > cursor:
                gaps.append((cursor, a))
            cursor = max(cursor, b)
        if cursor < stop:
            gaps.append((cursor, stop))
        for lo, hi in gaps:
            replicated = local.layout == "REPLICATED"
            what = "the replicated region" if replicated else f"heads [{lo}, {hi})"
            findings.add(
                "missing_peer_shard",
                f"{receiver.label()}: no context rank of pipeline stage {match.stage}"
                + (f", CP rank {cp_rank}" if context.cp > 1 else "")
                + f" holds {what} of these layers, though its other ranks do",
                receiver_ranks=[match.receiver_rank],
                layers=match.layers,
                stage=match.stage,
                cp_rank=cp_rank,
                global_heads=None if local.layout == "REPLICATED" else [lo, hi],
                receiver_view=receiver.index,
                view=receiver.label(),
            )
