"""Grants: how a route's bytes move once both sides have called, receiver first.

The receiver knows from the plan who writes how many bytes, so it allocates a staging area per
writer from its own buffer (:mod:`workers.handover.staging`, no reservation round trip) and
*grants* it to that writer in a ``G`` notification. The writer gathers its route chunk by chunk
into its own staging and WRITEs each chunk into the granted area with a ``C`` notification; the
receiver scatters each chunk into its blocks as it lands. In ``fragments`` mode the grant only
says "ready" (offset -1), and the writer posts one descriptor per fragment straight into the
receiver's pools (``F``). ``mode="auto"`` picks per route (:func:`route_mode_of`), alike on both
sides. A granted route that hears nothing for ``GRANT_RESEND_S`` grants again; a writer that
gets a grant again for a route it already wrote probes the connection (``P``).

A receiver whose context side has not called ``send`` asks first (``expect(..., ask=True)``): an
``A`` notification before each grant, answered by the context rank's ``on_ask`` hook.

:class:`GrantExchange` is this part of :class:`~workers.handover.Handover`: it owns the routes
that wait (for their peer's endpoint, for staging space, for a hold), the asks served here and
the routes this rank wrote (to probe when their grant comes again); it ends handles through
:class:`~workers.handover.handles.Handles` and finds peers through
:class:`~workers.handover.peers.Peers`. It runs on the progress thread (and on the caller's
thread while ``send``/``expect`` begin a handle).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from workers.crc import crc32
from workers.executors import Route, expand_fragments, fragments_crc32, gather, scatter
from workers.handover.notices import Ask, RouteKey, ask_payload, notice, parse_ask, reason_field
from workers.handover.staging import CHUNK_BLOCKS
from workers.transport import PeerUnreachable, TransportError

if TYPE_CHECKING:
    from workers.handover.handles import Handles, Op, RouteState
    from workers.handover.peers import Peers
    from workers.handover.reloads import PeerReloads
    from workers.handover.staging import StagingAreas
    from workers.transport.nixl import NixlTransport

log = logging.getLogger("kvplane.handover")

GRANT_RESEND_S = 1.0  # a granted route that heard nothing this long sends its grant again
ASKED_TTL_S = 600.0  # an ask already served (or refused) is ignored when it comes again
# mode="auto": fragments (pool to pool, no copies) when a route's fragments average at least
# this many bytes; otherwise staged (gather, one WRITE per chunk, scatter).
AUTO_FRAGMENT_BYTES = 8192
MODES = ("auto", "staged", "fragments")
# The last field of a verified route's grant: "I compare your crc32 with mine before I say
# arrived" (the writer's sum rides its last chunk's or its fragments' notification), so the
# writer's released handle decides nothing on the control plane.
COMPARES = ("1",)


def route_mode_of(route: Route) -> str:
    """``mode="auto"`` for one route: ``fragments`` (pool to pool, no copies) when its fragments
    average at least ``AUTO_FRAGMENT_BYTES``, else ``staged``. A function of the plan alone, so
    the route's sender and receiver resolve it alike."""
    nbytes = sum(route.bytes_per_block(g) for g in route.layer_groups)
    fragments = route.fragments_per_block
    return "fragments" if fragments and nbytes >= AUTO_FRAGMENT_BYTES * fragments else "staged"


class GrantExchange:
    """The receiver's grants and the writer's WRITEs of each route (see the module docstring)."""

    def __init__(
        self,
        transport: NixlTransport,
        areas: StagingAreas,
        handles: Handles,
        peers: Peers,
        reloads: PeerReloads,
        *,
        chunk_blocks: int = CHUNK_BLOCKS,
        sum_fragments: bool = True,
        on_ask: Callable[[Ask], None] | None = None,
        on_unknown_agent: Callable[[str], None] | None = None,
    ) -> None:
        self.transport = transport
        self.areas = areas
        self.handles = handles
        self.peers = peers
        self.reloads = reloads
        self.chunk_blocks = chunk_blocks
        # A verified receive sums its fragments-mode routes here; False: the handles' check
        # gathers those bytes anyway and sums them (see Handles.check).
        self.sum_fragments = sum_fragments
        # Context side: called on the progress thread with each new Ask (keep it short).
        self.on_ask = on_ask
        # An ask from an agent the directory does not name yet (a peer paired a moment ago):
        # the owner refreshes the directory off this thread; the ask comes again.
        self.on_unknown_agent = on_unknown_agent
        self.waiting: list[RouteState] = []  # routes waiting for a peer, staging space or hold
        self._asked: dict[str, float] = {}  # request ids asked for here (served or refused): when
        # Routes this rank wrote: to which agent, and when (a reload since lost their bytes)
        self._written: dict[RouteKey, tuple[str, float]] = {}

    # --- both sides --------------------------------------------------------------------------

    def begin(self, op: Op) -> None:
        """Take the first step of ``op``'s routes that move bytes (indexed by the handles):
        a receiver grants, a sender writes for a grant that came early."""
        for state in op.routes:
            if not state.done:
                self.waiting.append(state)
        self.retry_waiting()

    def retry_waiting(self) -> None:
        """Routes waiting for their peer's endpoint or for staging space."""
        still = []
        for state in self.waiting:
            op = state.op
            if op.handle.done:
                continue
            try:
                if self._advance(state):
                    still.append(state)
            except PeerUnreachable as error:
                self.handles.unreachable(str(state.agent), error)
            except Exception as error:  # e.g. the peer vanished between two chunks
                self.handles.fail(op, f"{type(error).__name__}: {error}")
        self.waiting = [s for s in still if not s.op.handle.done]

    def _advance(self, state: RouteState) -> bool:
        """One waiting route's next step; True while it still waits."""
        op = state.op
        if state.agent is None:
            peer = self.peers.get(op.peer, state.peer_rank)
            if peer is None or not self.peers.load(peer):
                return True
            if peer.epoch != op.peer_epoch:
                self.handles.fail(
                    op, f"peer_restarted: {op.peer} re-registered since the plan this request uses"
                )
                return False
            state.agent = peer.agent
        elif self.reloads.stale(state.agent) is not None:
            return True  # its connection failed: loaded again once a probe reaches it
        if time.monotonic() < op.hold_until:
            return True
        if op.side == "receive" and not state.granted:
            if op.ask:
                self._send_ask(state)
            return not self._grant(state)
        if op.side == "send" and state.grant is not None and not state.written:
            if state.grant[0] != state.agent:
                self.handles.fail(
                    op,
                    f"peer_restarted: the grant came from a worker of {op.peer} "
                    f"rank {state.peer_rank} that is not the current one",
                )
                return False
            return not self._write(state)
        return False

    # --- receiver ----------------------------------------------------------------------------

    def _grant(self, state: RouteState) -> bool:
        op = state.op
        ttl_ms = max(1, int((op.deadline - time.monotonic()) * 1000))
        if op.mode == "auto" and state.mode == "staged" and not self._fits_writer(state):
            state.mode = "fragments"  # the writer could not stage it: pool to pool
        if state.mode == "fragments":
            offset = -1
        else:
            area = self.areas.alloc(state.layout.nbytes)
            if area is None:
                return False
            state.area = area
            offset = area
            state.chunk_blocks = self.chunk_blocks
            state.chunks = dict(
                enumerate(c for c in state.layout.chunks(self.chunk_blocks) if c.nbytes)
            )
        state.granted = True
        if not self._send_grant(state, offset, ttl_ms) and not op.handle.done:
            # Its connection had failed: nothing left, the route waits for the peer's reload.
            state.granted = False
            if state.area is not None:
                self.areas.free(state.area, state.layout.nbytes)
                state.area = None
            return False
        return True

    def _fits_writer(self, state: RouteState) -> bool:
        """Whether the writer's staging buffer holds this route in one piece."""
        try:
            return (
                state.layout.nbytes <= self.transport.peer_info_of(str(state.agent)).staging_bytes
            )
        except TransportError:  # not loaded yet: the grant waits for it anyway
            return True

    def _send_grant(self, state: RouteState, offset: int, ttl_ms: int, again: bool = False) -> bool:
        """Send (or, ``again``, re-send) the route's grant; whether it left."""
        op = state.op
        ce, ge = op.handle.entry.epochs()
        state.heard_at = time.monotonic()
        assert state.agent is not None
        try:
            reconnected = self.transport.send_notif(
                state.agent,
                notice(
                    "G",
                    op.xid,
                    ce,
                    ge,
                    state.sender_rank,
                    state.receiver_rank,
                    offset,
                    state.layout.nbytes,
                    state.chunk_blocks,
                    ttl_ms,
                    *(COMPARES if op.verify else ()),
                ),
            )
        except PeerUnreachable as error:
            # Its connection failed: every handle on it fails, but a first grant never left,
            # so its route waits for the reload instead (within its deadline).
            self.handles.unreachable(state.agent, error, spare=None if again else op)
            return False
        except TransportError as error:
            self.handles.fail(
                op,
                f"peer_unreachable: cannot reach {op.peer} rank {state.peer_rank}: {error}",
                notify=False,
            )
            return False
        if again and reconnected:  # the connection this route waited on had failed
            self.handles.unreachable(
                state.agent,
                PeerUnreachable("the connection failed while this rank waited for its bytes"),
                reload=False,
            )
        return True

    def _send_ask(self, state: RouteState) -> None:
        """Ask the writer of ``state`` to send (before the grant, so both land together)."""
        op = state.op
        ce, ge = op.handle.entry.epochs()
        payload = ask_payload(
            request_id=op.handle.request_id,
            blocks=op.handle.blocks,
            dp=op.dp,
            mode=op.mode,
            verify=op.verify,
            num_tokens=op.handle.num_tokens,
            timeout_s=op.deadline - time.monotonic(),
            source=op.source,
        )
        assert state.agent is not None
        try:
            self.transport.send_notif(
                state.agent,
                notice("A", op.xid, ce, ge, state.sender_rank, state.receiver_rank, payload),
            )
        except TransportError as error:  # the grant right after it fails the route
            log.debug("ask to %s failed: %s", state.agent, error)

    def serve_ask(self, agent: str, fields: list[str]) -> None:
        """A generation rank asks this (context) rank to send (see :class:`Ask`)."""
        xid = fields[1]
        if self.on_ask is None or xid in self._asked:
            return
        if any(key[0] == xid for key in self.handles.sending):
            return  # already sending: the ask of another receiving rank of the same request
        peer = self.peers.by_agent(agent)
        if peer is None:  # not a worker of a paired instance (yet): the ask comes again
            log.debug("ask for %s from unknown agent %s", xid, agent)
            if self.on_unknown_agent is not None:
                self.on_unknown_agent(agent)
            return
        try:
            ask = parse_ask(agent, peer.instance, peer.rank, fields)
        except (ValueError, KeyError, TypeError) as error:
            log.warning("malformed ask from %s: %s", agent, error)
            return
        now = time.monotonic()
        self._asked[xid] = now
        if len(self._asked) > 4096:
            self._asked = {k: t for k, t in self._asked.items() if now - t < ASKED_TTL_S}
        try:
            self.on_ask(ask)
        except Exception:
            log.exception("on_ask hook failed for %s", xid)

    def refuse(self, ask: Ask, reason: str) -> None:
        """Answer ``ask`` with an abort: the receiver's handle fails at once with ``reason``."""
        ce, ge = ask.epochs
        self._asked[ask.request_id] = time.monotonic()
        try:
            self.transport.send_notif(
                ask.agent,
                notice(
                    "X", ask.request_id, ce, ge, ask.route[0], ask.route[1], reason_field(reason)
                ),
            )
        except Exception as error:  # the asking rank is gone: its deadline covers it
            log.debug("refusal to %s failed: %s", ask.agent, error)

    def resend_grants(self, now: float) -> None:
        """Granted routes that heard nothing for a while send their grant again: a grant lost on
        a connection that failed while idle gets through, and a failed one shows."""
        for state in list(self.handles.receiving.values()):
            if (
                state.granted
                and not state.done
                and not state.op.handle.done
                and now - state.heard_at > GRANT_RESEND_S
                and (state.agent is None or self.reloads.stale(state.agent) is None)
            ):
                offset = -1 if state.mode == "fragments" else int(state.area or 0)
                if state.op.ask:
                    self._send_ask(state)
                self._send_grant(
                    state, offset, max(1, int((state.op.deadline - now) * 1000)), again=True
                )

    def on_chunk(self, state: RouteState, fields: list[str]) -> None:
        i = int(fields[6])
        chunk = state.chunks.pop(i, None)
        if chunk is None:  # a duplicate or a chunk of another chunking: not ours
            return
        state.heard_at = time.monotonic()
        if len(fields) > 8:  # the last chunk of a verified route: the sender's sum
            state.sender_checksum = int(fields[8])
        assert state.area is not None
        scatter(
            state.route,
            self.transport.staging,
            self.transport.pools,
            state.dst,
            offset=state.area,
            chunk=chunk,
        )
        if not state.chunks:
            self._route_received(state)

    def _route_received(self, state: RouteState) -> None:
        op = state.op
        staging = self.transport.staging
        if state.area is not None:
            if staging.device.type == "cuda":
                import torch

                torch.cuda.current_stream(staging.device).synchronize()
            if op.verify:
                area = staging[state.area : state.area + state.layout.nbytes]
                state.checksum = crc32(area.detach().cpu().numpy().data) & 0xFFFFFFFF
            self.areas.free(state.area, state.layout.nbytes)
            state.area = None
        self.handles.route_done(state)

    def on_fragments_done(self, state: RouteState, fields: list[str]) -> None:
        op = state.op
        if len(fields) > 7:  # a verified route: the sender's sum
            state.sender_checksum = int(fields[7])
        if op.verify and self.sum_fragments:  # else a fill check gathers these bytes: it sums them
            info = self.transport.peer_info_of(str(state.agent))
            src_specs = {pid: p.spec for pid, p in info.pools.items()}
            fragments = expand_fragments(
                state.route, src_specs, self.transport.pools, state.src, state.dst
            )
            state.checksum = fragments_crc32(self.transport.pools, fragments, side="dst")
        self.handles.route_done(state)

    # --- sender ------------------------------------------------------------------------------

    def on_grant(
        self, state: RouteState, agent: str, fields: list[str], received_at: float | None = None
    ) -> None:
        op = state.op
        offset, nbytes, chunk_blocks, ttl_ms = (int(x) for x in fields[6:10])
        received = time.monotonic() if received_at is None else received_at
        if nbytes != state.layout.nbytes:
            self.handles.fail(
                op,
                f"plan mismatch: receiver rank {state.receiver_rank} expects "
                f"{nbytes} bytes of this route, this rank would send "
                f"{state.layout.nbytes} (different block lists?)",
            )
            return
        state.grant = (agent, offset, nbytes, chunk_blocks, received + ttl_ms / 1000)
        state.compared = tuple(fields[10:11]) == COMPARES
        # Before the directory names the receiver's worker, the route waits in ``waiting``.
        if state.agent == agent and (
            time.monotonic() < op.hold_until
            or self.reloads.stale(agent) is not None  # written once the peer is loaded again
            or not self._write(state)
        ):
            self.waiting.append(state)

    def _write(self, state: RouteState) -> bool:
        """Gather and post this route's WRITEs; False while local staging has no room."""
        op = state.op
        assert state.grant is not None
        agent, offset, nbytes, chunk_blocks, write_by = state.grant
        if state.written:
            return True
        if time.monotonic() > write_by:
            self.handles.fail(
                op,
                f"the grant of receiver rank {state.receiver_rank} expired before "
                "this rank could write",
            )
            return True
        ce, ge = op.handle.entry.epochs()
        tp = self.transport
        if offset < 0:  # fragments: one descriptor per fragment, straight into the pools
            summed: tuple[int, ...] = ()
            if op.verify:  # summed before the WRITE: the sum rides its notification
                frags = expand_fragments(
                    state.route, tp.pools, tp.peer_info_of(agent).pools, state.src, state.dst
                )
                state.checksum = fragments_crc32(tp.pools, frags, side="src")
                summed = (state.checksum,)
            notif = notice(
                "F", op.xid, ce, ge, state.sender_rank, state.receiver_rank, nbytes, *summed
            )
            try:
                pending = tp.post_fragments(
                    agent,
                    state.route,
                    state.src,
                    state.dst,
                    notif,
                    f"fragments to rank {state.receiver_rank}",
                    nbytes,
                )
            except PeerUnreachable as error:  # nothing left: wait for the peer's reload
                self.handles.unreachable(agent, error, spare=op)
                return False
            state.written = True
            if pending is None:  # no block to move: the notification alone
                tp.send_notif(agent, notif)
                self._route_sent(state)
            else:
                state.pending.append(pending)
            return True
        area = self.areas.alloc(nbytes)
        if area is None:
            return False
        state.area = area
        state.written = True
        info = tp.peer_info_of(agent)
        chunks = [c for c in state.layout.chunks(chunk_blocks) if c.nbytes]
        crc = 0
        for i, chunk in enumerate(chunks):
            gather(state.route, tp.pools, state.src, out=tp.staging, offset=area, chunk=chunk)
            if tp.staging.device.type == "cuda":
                import torch

                torch.cuda.current_stream(tp.staging.device).synchronize()
            last: tuple[int, ...] = ()
            if op.verify:
                piece = tp.staging[area + chunk.offset : area + chunk.offset + chunk.nbytes]
                crc = crc32(piece.detach().cpu().numpy().data, crc)
                if i == len(chunks) - 1:  # the route's sum rides its last chunk
                    last = (crc & 0xFFFFFFFF,)
            remote = tp.desc(
                np.array([info.staging_address + offset + chunk.offset]),
                np.array([chunk.nbytes]),
                info.device_id,
            )
            try:
                pending = tp.post_write(
                    agent,
                    tp.local_staging_desc(area + chunk.offset, chunk.nbytes),
                    remote,
                    notice(
                        "C",
                        op.xid,
                        ce,
                        ge,
                        state.sender_rank,
                        state.receiver_rank,
                        i,
                        len(chunks),
                        *last,
                    ),
                    f"chunk {i}/{len(chunks)} to rank {state.receiver_rank}",
                )
            except PeerUnreachable as error:
                if i:  # chunks already left over the failed connection: the handle fails
                    raise
                self.areas.free(area, nbytes)  # nothing left: wait for the peer's reload
                state.area = None
                state.written = False
                self.handles.unreachable(agent, error, spare=op)
                return False
            state.pending.append(pending)
        if op.verify:
            state.checksum = crc & 0xFFFFFFFF
        return True

    def poll_writes(self, state: RouteState) -> None:
        try:
            if all([self.transport.poll(p) for p in state.pending]):
                state.pending.clear()
                self._route_sent(state)
        except PeerUnreachable as error:
            self.handles.unreachable(str(state.agent), error)
        except TransportError as error:
            self.handles.fail(state.op, f"transport: {error}")

    def probe_written(self, agent: str, key: RouteKey, fields: list[str]) -> bool:
        """A grant from ``agent`` again for a route this rank wrote to it: probe the connection
        (were its bytes lost with it?). Whether it was such a grant."""
        written = self._written.get(key)
        if written is None or written[0] != agent:
            return False
        if self.peers.usable(agent):
            self._probe(agent, fields, written[1])
        return True

    def _probe(self, agent: str, fields: list[str], written_at: float) -> None:
        """Send ``agent`` a ``P``; abort the route over a new connection when the old one had
        failed, or was loaded again since ``written_at``."""
        head = fields[1:6]
        # The connection was loaded again since the WRITE: its bytes may have been lost with it.
        lost = self.reloads.reloaded.get(agent, 0.0) > written_at
        try:
            if self.transport.send_notif(agent, notice("P", *head)) or lost:
                self.transport.send_notif(
                    agent,
                    notice(
                        "X",
                        *head,
                        "peer_unreachable: the connection failed after this rank's "
                        "WRITE completed; its bytes were lost with it",
                    ),
                )
        except PeerUnreachable as error:
            log.debug("probe of %s failed: %s", agent, error)
            self.reloads.mark(agent, error)
        except TransportError as error:
            log.debug("probe of %s failed: %s", agent, error)

    def _route_sent(self, state: RouteState) -> None:
        if state.area is not None:
            self.areas.free(state.area, state.layout.nbytes)
            state.area = None
        if state.agent is not None:
            self._written[state.key] = (state.agent, time.monotonic())
            if len(self._written) > 4096:
                del self._written[next(iter(self._written))]
        self.handles.route_done(state)
