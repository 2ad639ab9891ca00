"""View matching between a sender (context) and a receiver (generation) rank set.

Receiver-centric: for every receiver rank ``r``, view ``v`` and layer ``L`` the sender views that
can fill it are the views on the active sender ranks that hold ``L`` with the **same owner and the
same roles**. Target-owned and draft-owned layers are never matched across owners, even when they
live in one physical pool (that is the bug class of the seed change: a draft layer silently filled
from a target view with another head count).

Outcomes per ``(r, v, L)``:

- candidates on exactly one sender pipeline stage → a match: one sender view per rank of that stage
  (the TP shards and replicas of the stage; CP ranks hold different blocks of the same heads);
- candidates on two or more stages → ``ambiguous_peer_view``;
- no candidate, but the layer exists with the other owner → ``misplaced_peer_view``;
- no candidate at all → ``missing_peer_view`` (error for target layers, and for draft layers when
  the context has draft layers too; a warning for draft layers when it has none, which are then
  not transferred).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from geometry.model import Instance, View

Key = tuple[str, tuple[str, ...], int]  # (owner, roles, layer)


@dataclass(frozen=True, slots=True)
class Holder:
    """One sender view on one sender rank that holds a layer."""

    rank: int
    stage: int
    view: View


@dataclass(frozen=True, slots=True)
class Match:
    """Receiver view ``receiver_view`` on ``receiver_rank``: the layers filled from one stage."""

    receiver_rank: int
    receiver_view: View
    stage: int
    layers: tuple[int, ...]
    holders: tuple[Holder, ...]  # one per active sender rank of the stage (sorted by rank)


@dataclass(frozen=True, slots=True)
class Unmatched:
    """A receiver layer without a unique sender: ``missing``, ``misplaced`` or ``ambiguous``."""

    kind: str
    receiver_rank: int
    receiver_view: View
    layer: int
    stages: tuple[int, ...] = ()
    other_owner_views: tuple[str, ...] = ()
    other_roles: tuple[tuple[str, ...], ...] = ()


class SenderIndex:
    """Which active sender ranks hold which ``(owner, roles, layer)``."""

    def __init__(self, sender: Instance, ranks: Sequence[int]) -> None:
        self.instance = sender
        # Ranks of one stage usually hold identical view classes: group them first so the
        # per-layer index is built once per class, not once per rank.
        classes: dict[tuple[str, tuple[str, ...], tuple[int, ...]], list[Holder]] = {}
        for rank in sorted(ranks):
            stage = sender.coords(rank)[0]
            for view in sender.table(rank).views:
                key = (view.owner, view.roles_key, view.layers)
                classes.setdefault(key, []).append(Holder(rank, stage, view))
        by_key: dict[Key, list[int]] = {}
        holders_of_class = list(classes.values())
        for number, ((owner, roles, layers), _holders) in enumerate(classes.items()):
            for layer in layers:
                by_key.setdefault((owner, roles, layer), []).append(number)
        # Per key: the holders (rank order), their stages, and a signature that groups the
        # layers held by the very same sender views (so matching is one lookup per layer).
        self.by_key: dict[Key, tuple[tuple[Holder, ...], tuple[int, ...], tuple[int, ...]]] = {}
        memo: dict[tuple[int, ...], tuple[tuple[Holder, ...], tuple[int, ...]]] = {}
        for layer_key, numbers in by_key.items():
            signature = tuple(numbers)
            if signature not in memo:
                holders = [h for number in numbers for h in holders_of_class[number]]
                holders.sort(key=lambda holder: holder.rank)
                stages = tuple(sorted({holder.stage for holder in holders}))
                memo[signature] = (tuple(holders), stages)
            holders_tuple, stages = memo[signature]
            self.by_key[layer_key] = (holders_tuple, stages, signature)

    def match_view(self, receiver_rank: int, view: View) -> tuple[list[Match], list[Unmatched]]:
        """Match every layer of one receiver view; layers with the same sender views group."""
        layers_of: dict[tuple[int, ...], list[int]] = {}
        holders_of: dict[tuple[int, ...], tuple[tuple[Holder, ...], int]] = {}
        unmatched: list[Unmatched] = []
        roles = view.roles_key
        for layer in view.layers:
            entry = self.by_key.get((view.owner, roles, layer))
            if entry is None:
                unmatched.append(self._explain_missing(receiver_rank, view, layer))
                continue
            holders, stages, signature = entry
            if len(stages) > 1:
                unmatched.append(Unmatched("ambiguous", receiver_rank, view, layer, stages=stages))
                continue
            group = layers_of.get(signature)
            if group is None:
                layers_of[signature] = [layer]
                holders_of[signature] = (holders, stages[0])
            else:
                group.append(layer)
        result = [
            Match(receiver_rank, view, holders_of[sig][1], tuple(layers), holders_of[sig][0])
            for sig, layers in layers_of.items()
        ]
        return result, unmatched

    def _holders_of_layer(self, layer: int) -> list[Holder]:
        return [
            holder
            for holders, _stages, _signature in self.by_key.values()
            for holder in holders
            if layer in holder.view.buffers_by_layer
        ]

    def _explain_missing(self, receiver_rank: int, view: View, layer: int) -> Unmatched:
        others = self._holders_of_layer(layer)
        other_owner = sorted(
            {
                h.view.label()
                for h in others
                if h.view.owner != view.owner and h.view.roles_key == view.roles_key
            }
        )
        if other_owner:
            return Unmatched(
                "misplaced", receiver_rank, view, layer, other_owner_views=tuple(other_owner)
            )
        other_roles = sorted({h.view.roles_key for h in others if h.view.owner == view.owner})
        return Unmatched("missing", receiver_rank, view, layer, other_roles=tuple(other_roles))
