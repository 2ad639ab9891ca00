"""The peer workers one rank talks to: who they are, which are loaded, which failed.

The directory names one worker (one NIXL agent) per rank of each paired instance. :class:`Peers`
keeps that map across directory refreshes: a peer worker is *retired* only when its rank has
another worker now or its instance another epoch; a rank that is merely missing (the control
plane is slow, its heartbeats lag) keeps its last known worker, so the hot path depends on NIXL
and on deadlines, not on the control plane's view of liveness. A peer's endpoint is loaded into
this rank's NIXL agent when a route first needs it (:meth:`Peers.load`); a peer whose connection
failed waits in :class:`~workers.handover.reloads.PeerReloads` (``reloads``) until a probe
reaches it, and is loaded again by :meth:`Peers.reload_ready` on the progress thread.

Everything here runs on the progress thread, or on the caller's thread while ``send``/``expect``
begin a handle (under the handover's mutex); only :meth:`Peers.info_of` is read by the reloads'
watch thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from workers.directory import Directory, PeerWorker
from workers.handover.reloads import PeerReloads
from workers.transport import TransportError

if TYPE_CHECKING:
    from workers.transport.nixl import NixlTransport

log = logging.getLogger("kvplane.handover")


class Peers:
    """The peer workers of one rank, their NIXL endpoints and their failed connections."""

    def __init__(self, transport: NixlTransport, *, wake: Callable[[], None], name: str) -> None:
        self.transport = transport
        self._by_rank: dict[tuple[str, int], PeerWorker] = {}  # the directory's, plus kept ones
        self._by_agent: dict[str, PeerWorker] = {}
        self._retired: dict[str, PeerWorker] = {}  # replaced workers: their messages are stale
        self._loaded: set[str] = set()  # agents loaded into this rank's NIXL agent
        # Peers whose connection failed are probed and reloaded off the progress thread's
        # critical path; ``wake`` wakes that thread when one becomes ready.
        self.reloads = PeerReloads(transport, wake, name, self.info_of)

    def get(self, instance: str, rank: int) -> PeerWorker | None:
        """The worker of ``instance`` rank ``rank`` this rank would talk to now."""
        return self._by_rank.get((instance, rank))

    def by_agent(self, agent: str) -> PeerWorker | None:
        """The current peer worker whose NIXL agent is ``agent``."""
        return self._by_agent.get(agent)

    def known(self, agent: str) -> PeerWorker | None:
        """The peer worker, current or retired, whose NIXL agent is ``agent``."""
        return self._retired.get(agent) or self._by_agent.get(agent)

    def usable(self, agent: str) -> bool:
        """Whether ``agent`` is loaded and its connection has not failed since."""
        return agent in self._loaded and self.reloads.stale(agent) is None

    def info_of(self, agent: str) -> Mapping[str, Any] | None:
        """A peer worker's published endpoint (read by the reloads' watch thread)."""
        peer = self._by_agent.get(agent)
        return None if peer is None else peer.info

    def load(self, peer: PeerWorker) -> bool:
        """Load ``peer``'s endpoint into this rank's NIXL agent unless it is; whether it is."""
        if self.reloads.stale(peer.agent) is not None:
            return False  # its connection failed: the watch thread reloads it once it answers
        if peer.agent in self._loaded and self.transport.has_peer(peer.agent):
            return True
        try:
            self.transport.add_peer(peer.info)
        except TransportError as error:
            log.warning("cannot load peer %s rank %d: %s", peer.instance, peer.rank, error)
            if peer.agent in self._by_agent:
                self.reloads.mark(peer.agent, error)  # probed off this thread from now on
            return False
        self._loaded.add(peer.agent)
        return True

    def reload_ready(self) -> bool:
        """Load again the failed peers a probe reached, where nothing is in flight to them:
        every notification was read this step, and no WRITE to them is posted. Whether any
        was loaded again."""
        moved = False
        for agent in self.reloads.ready():
            peer = self._by_agent.get(agent)
            if peer is None:
                self.reloads.forget(agent)
                continue
            if self.transport.outstanding(agent):
                continue  # released by their own polls or deadlines first
            try:
                self.transport.remove_peer(agent)
                self.transport.add_peer(peer.info)
            except TransportError as error:
                self.reloads.mark(agent, error, reload_failed=True)
                continue
            self._loaded.add(agent)
            self.reloads.done(agent)
            moved = True
        return moved

    def apply(self, directory: Directory) -> set[str]:
        """Take the peer workers of a refreshed directory; returns the agents it retired (their
        endpoints dropped from this rank's NIXL agent)."""
        peers = dict(directory.peers)
        for key, peer in self._by_rank.items():
            if key in peers:
                continue
            epoch = directory.peer_epochs.get(peer.instance)
            if epoch is None or epoch == peer.epoch:  # still that epoch, or not paired now
                peers[key] = peer
        retired = {p.agent for p in self._by_rank.values()} - {p.agent for p in peers.values()}
        for agent in retired:
            self._retired[agent] = self._by_agent[agent]
            self.reloads.forget(agent)
            if agent in self._loaded:
                self._loaded.discard(agent)
                try:
                    self.transport.remove_peer(agent)
                except TransportError as error:
                    log.debug("dropping peer %s: %s", agent, error)
        self._by_rank = peers
        self._by_agent = {peer.agent: peer for peer in peers.values()}
        if len(self._retired) > 4096:
            self._retired = dict(list(self._retired.items())[-1024:])
        return retired

    def close(self) -> None:
        """Stop probing failed peers."""
        self.reloads.close()
