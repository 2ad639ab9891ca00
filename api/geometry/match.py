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
- no candidate at all → ``missing_peer_view`` (error for target layers, warning for draft layers,
  which are then not transferred).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from api.geometry.model import Instance, View

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
        self.by_key: dict[Key, list[Holder]] = {}
        self.by_layer: dict[int, list[Holder]] = {}
        for rank in ranks:
            table = sender.table(rank)
            stage = sender.coords(rank)[0]
            for view in table.views:
                for layer in view.layers:
                    holder = Holder(rank, stage, view)
                    self.by_key.setdefault((view.owner, view.roles_key, layer), []).append(holder)
                    self.by_layer.setdefault(layer, []).append(holder)

    def match_view(self, receiver_rank: int, view: View) -> tuple[list[Match], list[Unmatched]]:
        """Match every layer of one receiver view; consecutive equal outcomes are grouped."""
        matches: dict[tuple[int, tuple[tuple[int, int], ...]], list[int]] = {}
        holders_of: dict[tuple[int, tuple[tuple[int, int], ...]], tuple[Holder, ...]] = {}
        unmatched: list[Unmatched] = []
        for layer in view.layers:
            found = self.by_key.get((view.owner, view.roles_key, layer))
            if not found:
                unmatched.append(self._explain_missing(receiver_rank, view, layer))
                continue
            stages = sorted({holder.stage for holder in found})
            if len(stages) > 1:
                unmatched.append(
                    Unmatched("ambiguous", receiver_rank, view, layer, stages=tuple(stages))
                )
                continue
            ordered = tuple(sorted(found, key=lambda holder: holder.rank))
            signature = (stages[0], tuple((h.rank, h.view.index) for h in ordered))
            matches.setdefault(signature, []).append(layer)
            holders_of[signature] = ordered
        result = [
            Match(receiver_rank, view, signature[0], tuple(layers), holders_of[signature])
            for signature, layers in matches.items()
        ]
        return result, unmatched

    def _explain_missing(self, receiver_rank: int, view: View, layer: int) -> Unmatched:
        others = self.by_layer.get(layer, [])
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
