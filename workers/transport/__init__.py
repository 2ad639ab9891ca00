"""Transports: how a route's bytes get from the sender's pools to the receiver's pools.

``local``: both ranks' pools live in this process (torch copies). ``nixl``: one NIXL agent per
worker (UCX backend), cross-process and cross-node, DRAM or VRAM.
"""

from __future__ import annotations


class TransportError(RuntimeError):
    """A transfer failed (NIXL error state, unknown peer, bad descriptor)."""


class TransferTimeout(TransportError):
    """A transfer or an awaited notification did not complete in time."""


class PeerUnreachable(TransportError):
    """The connection to the peer failed (its host died, the network broke): NIXL's error state
    or ``nixlRemoteDisconnectError``. Reload the peer (``NixlTransport.reset_peer``) before
    talking to it again."""


class TransferCancelled(TransportError):
    """The control plane withdrew the job (lease lost, transfer failed or retried): stop."""
