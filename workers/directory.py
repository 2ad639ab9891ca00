"""A worker's cached view of the control plane: its pairings' templates and its peers' endpoints.

The control plane compiles, for every compatible pairing that involves the worker's instance, the
plan of every DP-rank combination, and lists the live workers of the peer instance with their
NIXL endpoints (``GET /v1/workers/{id}/directory``). A worker fetches it on attach and again
whenever the revision in its heartbeat answer differs from the one it holds, so a
re-registration or a restarted peer reaches it within one heartbeat interval. Every entry carries
the epochs it was compiled for; the hot path never mixes entries of two epochs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from workers.executors import Route


class HandoverError(ValueError):
    """A send or expect that cannot start; ``code`` is stable (``unknown_pairing``, ...)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class PlanEntry:
    """The routes of one pairing and DP-rank combination that involve this worker's rank."""

    pairing_id: str
    context: str
    generation: str
    context_epoch: str
    generation_epoch: str
    context_dp_rank: int | None
    generation_dp_rank: int | None
    senders: tuple[int, ...]
    receivers: tuple[int, ...]
    routes: tuple[Route, ...]
    route_dicts: tuple[Mapping[str, Any], ...]

    def epochs(self) -> tuple[str, str]:
        return self.context_epoch, self.generation_epoch


@dataclass(frozen=True)
class PeerWorker:
    """One live worker of a peer instance: its id and the NIXL endpoint it published."""

    instance: str
    rank: int
    epoch: str
    worker_id: str
    agent: str
    info: Mapping[str, Any]


@dataclass(frozen=True)
class Directory:
    """An immutable snapshot; a refresh replaces the whole object."""

    revision: str
    instance: str
    role: str
    rank: int
    epoch: str
    plans: Mapping[tuple[str, int | None, int | None], PlanEntry] = field(default_factory=dict)
    peers: Mapping[tuple[str, int], PeerWorker] = field(default_factory=dict)
    peer_epochs: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def empty(cls, instance: str, rank: int) -> Directory:
        return cls("", instance, "", rank, "")

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Directory:
        """Parse the wire form (``GET /v1/workers/{id}/directory``)."""
        role = str(data["role"])
        plans: dict[tuple[str, int | None, int | None], PlanEntry] = {}
        for pairing in data["pairings"]:
            peer = pairing["generation"] if role == "context" else pairing["context"]
            for plan in pairing["plans"]:
                key = (str(peer), plan["context_dp_rank"], plan["generation_dp_rank"])
                plans[key] = PlanEntry(
                    pairing_id=str(pairing["id"]),
                    context=str(pairing["context"]),
                    generation=str(pairing["generation"]),
                    context_epoch=str(pairing["context_epoch"]),
                    generation_epoch=str(pairing["generation_epoch"]),
                    context_dp_rank=plan["context_dp_rank"],
                    generation_dp_rank=plan["generation_dp_rank"],
                    senders=tuple(plan["senders"]),
                    receivers=tuple(plan["receivers"]),
                    routes=tuple(Route.from_dict(route) for route in plan["routes"]),
                    route_dicts=tuple(plan["routes"]),
                )
        peers: dict[tuple[str, int], PeerWorker] = {}
        peer_epochs: dict[str, str] = {}
        for name, peer in data["peers"].items():
            peer_epochs[str(name)] = str(peer["epoch"])
            for rank, worker in peer["ranks"].items():
                peers[(str(name), int(rank))] = PeerWorker(
                    instance=str(name),
                    rank=int(rank),
                    epoch=str(peer["epoch"]),
                    worker_id=str(worker["worker_id"]),
                    agent=str(worker["peer"]["agent"]),
                    info=worker["peer"],
                )
        return cls(
            revision=str(data["revision"]),
            instance=str(data["instance"]),
            role=role,
            rank=int(data["rank"]),
            epoch=str(data["epoch"]),
            plans=plans,
            peers=peers,
            peer_epochs=peer_epochs,
        )

    def plan(
        self, peer: str, context_dp_rank: int | None, generation_dp_rank: int | None
    ) -> PlanEntry:
        """The cached plan toward ``peer``; :class:`HandoverError` when there is none."""
        entry = self.plans.get((peer, context_dp_rank, generation_dp_rank))
        if entry is not None:
            return entry
        known = sorted({key[0] for key in self.plans})
        if peer not in known:
            raise HandoverError(
                f"{self.instance} has no compatible, current pairing with {peer!r} "
                f"(paired: {known or 'none'}); register both, POST /v1/pairings, and wait for "
                f"the worker's directory to refresh",
                code="unknown_pairing",
            )
        choices = sorted((k[1], k[2]) for k in self.plans if k[0] == peer)
        raise HandoverError(
            f"no plan toward {peer!r} for context_dp_rank={context_dp_rank}, "
            f"generation_dp_rank={generation_dp_rank}; valid (context, generation) dp ranks: "
            f"{choices}",
            code="dp_rank_out_of_range",
        )

    def peer(self, instance: str, rank: int) -> PeerWorker | None:
        """The live worker of ``instance`` rank ``rank``, if the control plane knows one."""
        return self.peers.get((instance, rank))

    def owner_of(self, agent: str) -> PeerWorker | None:
        """The peer worker whose NIXL agent is ``agent``."""
        for peer in self.peers.values():
            if peer.agent == agent:
                return peer
        return None
