"""Pairing checks of per-request state groups (see :mod:`geometry.state` for the formulas).

Codes (stable API, added to those of :mod:`geometry.validate`):

=============================  =====================================================================
code                           meaning
=============================  =====================================================================
``state_group_mismatch``       one side holds per-request state (``tokens_per_slot: null``) and
                               the other none, or a matched view's layer group is a state group on
                               one side and paged on the other
``state_bytes_mismatch``       the TP-aggregated bytes of one state buffer differ
                               (``H × unit``, ``Σ S_i`` or the replicated region)
``section_count_mismatch``     SECTIONED views with a different number of sections
``section_bytes_mismatch``     a section's TP-aggregated bytes differ
``d_state_mismatch``           ``d_state`` differs (when both give it)
=============================  =====================================================================

A state match also reports the generic codes where they apply: ``layout_mismatch`` (state
layouts never convert), ``dtype_mismatch``, ``head_dim_mismatch``, ``buffers_per_layer_mismatch``,
``layer_group_mismatch``, ``head_count_mismatch`` (SSM heads ``H``) and
``head_geometry_mismatch`` (bytes per SSM head). Every check runs; none hides another.
"""

from __future__ import annotations

from typing import Any

from geometry.heads import ViewGeometry
from geometry.match import Match
from geometry.model import Instance, View
from geometry.state import StateGeometry
from geometry.validate import Findings, geometry_of, mismatch_finding


def _state_layers(instance: Instance) -> dict[int, set[int]]:
    layers: dict[int, set[int]] = {}
    for table in instance.ranks:
        if table is None:
            continue
        for view in table.views:
            group = table.pools[view.pool].layer_group
            if instance.is_state_group(group):
                layers.setdefault(group, set()).update(view.layers)
    return layers


def check_state_groups(context: Instance, generation: Instance, findings: Findings) -> None:
    """Per-request state on one side only is an error: the other side could not resume."""
    sides = {"context": _state_layers(context), "generation": _state_layers(generation)}
    for side, other in (("context", "generation"), ("generation", "context")):
        if sides[side] and not sides[other]:
            layers = sorted(set().union(*sides[side].values()))
            findings.add(
                "state_group_mismatch",
                f"only the {side} side holds per-request state (layer groups "
                f"{sorted(sides[side])} with tokens_per_slot null, {len(layers)} layers); the "
                f"{other} side has no state group to resume from",
                field="layer_groups",
                side=side,
                state_layer_groups=sorted(sides[side]),
                state_layers=layers[:64],
            )


def involves_state(context: Instance, generation: Instance, match: Match) -> bool:
    """Whether the receiver view or any matched sender view lives in a state group."""
    table = generation.table(match.receiver_rank)
    if generation.is_state_group(table.pools[match.receiver_view.pool].layer_group):
        return True
    return any(
        context.is_state_group(context.table(h.rank).pools[h.view.pool].layer_group)
        for h in match.holders
    )


def check_state_match(
    context: Instance,
    generation: Instance,
    match: Match,
    findings: Findings,
    cache: dict[Any, ViewGeometry],
) -> bool:
    """Check every sender view of a state match against the receiver view; True when all pass."""
    receiver = match.receiver_view
    local = geometry_of("generation", generation, match.receiver_rank, receiver, cache)
    receiver_group = generation.table(match.receiver_rank).pools[receiver.pool].layer_group
    ok = True
    for holder in match.holders:
        sender = holder.view
        peer = geometry_of("context", context, holder.rank, sender, cache)
        sender_group = context.table(holder.rank).pools[sender.pool].layer_group
        before = findings.error_count

        def mismatch(
            code: str,
            what: str,
            field_name: str,
            local_value: Any,
            peer_value: Any,
            sender: View = sender,
            rank: int = holder.rank,
            **extra: Any,
        ) -> None:
            mismatch_finding(
                findings,
                match,
                rank,
                sender,
                code,
                what,
                field_name,
                local_value,
                peer_value,
                **extra,
            )

        state_sides = (
            generation.is_state_group(receiver_group),
            context.is_state_group(sender_group),
        )
        if state_sides[0] != state_sides[1]:
            kinds = ["per-request state" if s else "paged" for s in state_sides]
            mismatch(
                "state_group_mismatch",
                "layer group kind",
                "tokens_per_slot",
                kinds[0],
                kinds[1],
            )
            ok = False
            continue
        if not state_sides[0]:
            # A paged receiver reaches here only because another holder is a state view: that
            # holder's state_group_mismatch already fails the match.
            ok = False
            continue
        assert isinstance(local, StateGeometry) and isinstance(peer, StateGeometry)
        if sender_group != receiver_group:
            mismatch(
                "layer_group_mismatch", "layer group", "layer_group", receiver_group, sender_group
            )
        comparable = True
        if sender.layout != receiver.layout:
            mismatch("layout_mismatch", "layout", "layout", receiver.layout, sender.layout)
            comparable = False
        if sender.dtype != receiver.dtype:
            mismatch("dtype_mismatch", "dtype", "dtype", receiver.dtype, sender.dtype)
        if sender.head_dim and receiver.head_dim and sender.head_dim != receiver.head_dim:
            mismatch(
                "head_dim_mismatch", "head_dim", "head_dim", receiver.head_dim, sender.head_dim
            )
        if sender.d_state and receiver.d_state and sender.d_state != receiver.d_state:
            mismatch("d_state_mismatch", "d_state", "d_state", receiver.d_state, sender.d_state)
        if sender.buffers_per_layer != receiver.buffers_per_layer:
            mismatch(
                "buffers_per_layer_mismatch",
                "buffers per layer",
                "buffers",
                receiver.buffers_per_layer,
                sender.buffers_per_layer,
            )
            comparable = False
        if local.aggregated_bytes != peer.aggregated_bytes:
            mismatch(
                "state_bytes_mismatch",
                "TP-aggregated bytes of one state buffer",
                "aggregated_bytes",
                local.aggregated_bytes,
                peer.aggregated_bytes,
                local_bytes_per_rank=local.unit_bytes
                if local.layout != "HND"
                else local.heads * local.unit_bytes,
                peer_bytes_per_rank=peer.unit_bytes
                if peer.layout != "HND"
                else peer.heads * peer.unit_bytes,
                local_shards=local.shards,
                peer_shards=peer.shards,
            )
        if not comparable:
            ok = False
            continue
        if receiver.layout == "SECTIONED":
            if len(local.sections) != len(peer.sections):
                mismatch(
                    "section_count_mismatch",
                    "number of sections",
                    "section_bytes",
                    len(local.sections),
                    len(peer.sections),
                )
            else:
                odd = [
                    i
                    for i, (a, b) in enumerate(zip(local.sections, peer.sections, strict=True))
                    if a != b
                ]
                if odd:
                    mismatch(
                        "section_bytes_mismatch",
                        f"TP-aggregated bytes of section(s) {odd}",
                        "section_bytes",
                        list(local.sections),
                        list(peer.sections),
                        sections=odd,
                    )
        elif receiver.layout == "HND":
            if local.total_heads != peer.total_heads:
                mismatch(
                    "head_count_mismatch",
                    "total SSM heads",
                    "total_kv_heads",
                    local.total_heads,
                    peer.total_heads,
                )
            if local.unit_bytes != peer.unit_bytes:
                mismatch(
                    "head_geometry_mismatch",
                    "bytes per SSM head (head_dim × d_state × itemsize)",
                    "bytes_per_head",
                    local.unit_bytes,
                    peer.unit_bytes,
                )
        ok = ok and findings.error_count == before
    return ok
