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
``tokens_per_block_mismatch``  the two sides page tokens differently
``model_mismatch``             both sides name a model and the names differ
``context_parallel_both_sides``CP > 1 on both sides
``missing_peer_view``          no sender view holds the layer with this owner and roles
                               (a warning for draft layers: they are then not transferred)
``misplaced_peer_view``        only a view of the *other* owner (target vs draft) holds the layer
``ambiguous_peer_view``        two sender pipeline stages hold the layer
``layout_mismatch``            HND vs NHD vs REPLICATED
``dtype_mismatch``             element types differ
``head_dim_mismatch``          ``head_dim`` differs (when both give it)
``buffers_per_layer_mismatch`` K/V vs K-only buffer rows
``head_count_mismatch``        the matched views have different total KV heads ``H``
``head_geometry_mismatch``     shard counts not divisible, or bytes per head / per token-head /
                               replicated region differ
``layer_group_mismatch``       matched views live in pools of different layer groups
``draft_layer_count_mismatch`` both sides have draft layers, but not the same number
=============================  =====================================================================

Warnings: ``missing_peer_view`` (draft), ``layer_count_mismatch``, ``nhd_head_slicing``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from api.geometry.heads import ViewGeometry, view_geometry
from api.geometry.match import Match, Unmatched
from api.geometry.model import Instance, View


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
    if context.tokens_per_block != generation.tokens_per_block:
        findings.add(
            "tokens_per_block_mismatch",
            f"context pages {context.tokens_per_block} tokens per block, generation "
            f"{generation.tokens_per_block}",
            field="tokens_per_block",
            local=generation.tokens_per_block,
            peer=context.tokens_per_block,
        )
        runnable = False
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
        runnable = False
    return runnable


def check_draft_layers(context: Instance, generation: Instance, findings: Findings) -> None:
    """Both sides with draft layers must have the same number of them."""
    counts = [_draft_layer_count(instance) for instance in (context, generation)]
    if counts[0] and counts[1] and counts[0] != counts[1]:
        findings.add(
            "draft_layer_count_mismatch",
            f"context has {counts[0]} draft layers, generation {counts[1]}",
            field="draft_layers",
            local=counts[1],
            peer=counts[0],
        )


def _draft_layer_count(instance: Instance) -> int:
    layers = {
        layer
        for table in instance.ranks
        if table is not None
        for view in table.views
        if view.owner == "draft"
        for layer in view.layers
    }
    return len(layers)


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


def report_unmatched(unmatched: Sequence[Unmatched], findings: Findings) -> None:
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
            draft = view.owner == "draft"
            hint = (
                f" (the context has them with roles {[list(r) for r in item.other_roles]})"
                if item.other_roles
                else ""
            )
            findings.add(
                "missing_peer_view",
                f"{view.label()}: no context view holds these layers with the same owner and "
                f"roles{hint}" + ("; these draft layers are not transferred" if draft else ""),
                warning=draft,
                receiver_ranks=[item.receiver_rank],
                layers=[item.layer],
                **common,
            )


def geometry_of(
    instance: Instance, rank: int, view: View, cache: dict[Any, ViewGeometry]
) -> ViewGeometry:
    key = (instance.name, rank, view.index)
    geometry = cache.get(key)
    if geometry is None:
        geometry = cache[key] = view_geometry(instance, instance.table(rank), view)
    return geometry


def _mismatch(
    findings: Findings,
    match: Match,
    sender_rank: int,
    sender: View,
    code: str,
    what: str,
    field_name: str,
    local_value: Any,
    peer_value: Any,
) -> None:
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
    )


def check_match(
    context: Instance,
    generation: Instance,
    match: Match,
    findings: Findings,
    cache: dict[Any, ViewGeometry],
) -> None:
    """Check every sender view of one match against the receiver view."""
    receiver = match.receiver_view
    local = geometry_of(generation, match.receiver_rank, receiver, cache)
    receiver_pool = generation.table(match.receiver_rank).pools[receiver.pool]
    for holder in match.holders:
        sender = holder.view
        peer = geometry_of(context, holder.rank, sender, cache)
        sender_pool = context.table(holder.rank).pools[sender.pool]

        def mismatch(
            code: str,
            what: str,
            field_name: str,
            local_value: Any,
            peer_value: Any,
            sender: View = sender,
            rank: int = holder.rank,
        ) -> None:
            _mismatch(
                findings, match, rank, sender, code, what, field_name, local_value, peer_value
            )

        if sender.layout != receiver.layout:
            mismatch("layout_mismatch", "layout", "layout", receiver.layout, sender.layout)
            continue
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
            continue
        if sender_pool.layer_group != receiver_pool.layer_group:
            mismatch(
                "layer_group_mismatch",
                "layer group",
                "layer_group",
                receiver_pool.layer_group,
                sender_pool.layer_group,
            )
        if receiver.layout == "REPLICATED":
            if peer.unit_bytes != local.unit_bytes:
                mismatch(
                    "head_geometry_mismatch",
                    "replicated region size",
                    "size",
                    local.unit_bytes,
                    peer.unit_bytes,
                )
            continue
        if peer.total_heads != local.total_heads:
            mismatch(
                "head_count_mismatch",
                "total KV heads",
                "total_kv_heads",
                local.total_heads,
                peer.total_heads,
            )
            continue
        if max(peer.shards, local.shards) % min(peer.shards, local.shards):
            mismatch(
                "head_geometry_mismatch",
                "shard count (not divisible)",
                "shards",
                local.shards,
                peer.shards,
            )
            continue
        unit = "bytes_per_head" if receiver.layout == "HND" else "head_token_bytes"
        if peer.unit_bytes != local.unit_bytes:
            mismatch(
                "head_geometry_mismatch",
                unit.replace("_", " "),
                unit,
                local.unit_bytes,
                peer.unit_bytes,
            )
            continue
        if receiver.layout == "NHD" and local.heads != peer.heads:
            per_token = max(local.heads // peer.heads, 1)
            findings.add(
                "nhd_head_slicing",
                f"{receiver.label()}: NHD head slicing ({peer.heads} heads per context rank, "
                f"{local.heads} per generation rank) cuts every token row into {per_token} "
                f"fragment(s): {context.tokens_per_block * per_token} per block, layer and buffer",
                warning=True,
                receiver_ranks=[match.receiver_rank],
                sender_ranks=[holder.rank],
                view=receiver.label(),
                fragments_per_token=per_token,
                fragments_per_block_layer_buffer=context.tokens_per_block * per_token,
            )
