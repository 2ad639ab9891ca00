"""Handles and their lifecycle: what an engine holds per request, and how it ends.

A :class:`Handle` is one rank's side of one request. It is ``pending`` until it resolves, exactly
once: a receiver's becomes ``arrived`` when every writer's bytes are in its blocks; a sender's
becomes ``released`` when its WRITEs completed (its context blocks may be freed); either becomes
``failed`` with a reason: its deadline passed, a peer restarted (a notification from an old agent
or epoch), the peer aborted, the connection failed, or the blocks were bad. Failures are told to
the other side at once (an ``X`` notification), so neither waits for its deadline when the other
already knows. Wait on a handle (``wait``), poll it (``done``, ``state``), give it a callback, or
poll :meth:`~workers.handover.Handover.get_finished` (a :class:`Finished`).

Inside the handover a request is an :class:`Op` with one :class:`RouteState` per route this rank
takes part in. :class:`Handles` holds them (the pending ops, their routes by key for the
notifications to find, the resolved handles not yet polled, the counters) and ends them:
complete, fail (releasing or quarantining their staging, telling the peer), a lost connection,
a refreshed directory, the deadline's reason, and the ``on_finished`` hook. After a failed
fragments-mode receive whose writer had its grant, the handle's blocks become reusable only
after the grant's time to live plus ``QUARANTINE_MARGIN_S`` (``reusable_at``): a WRITE already
on the wire may still land in them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from workers.directory import PlanEntry
from workers.executors import Route, StagingChunk, StagingLayout
from workers.handover.notices import RouteKey, notice, reason_field
from workers.handover.staging import CHUNK_BLOCKS, StagingAreas
from workers.transport import PeerUnreachable, TransportError

if TYPE_CHECKING:
    from workers.handover.peers import Peers
    from workers.handover.reloads import PeerReloads
    from workers.transport.nixl import NixlTransport, PendingWrite

log = logging.getLogger("kvplane.handover")

PENDING, ARRIVED, RELEASED, FAILED = "pending", "arrived", "released", "failed"
QUARANTINE_MARGIN_S = 5.0


class Handle:
    """One rank's side of one request's handover; resolves exactly once."""

    def __init__(
        self, request_id: str, side: str, peer: str, entry: PlanEntry, timeout_s: float
    ) -> None:
        self.request_id = request_id
        self.side = side  # "send" | "receive"
        self.peer = peer
        self.entry = entry
        self.timeout_s = timeout_s
        self.state = PENDING
        self.reason: str | None = None
        self.bytes = 0
        self.routes: list[dict[str, Any]] = []
        self.started_at = time.time()
        self.finished_at: float | None = None
        # When this rank's blocks of the request may be reused (time.time()), set on resolve: at
        # once, except after a failed fragments-mode receive whose writer had its grant (a WRITE
        # already on the wire may still land in the blocks until the grant's time to live
        # is over, plus a margin).
        self.reusable_at: float | None = None
        self._quiet_s = 0.0
        # What send/expect was asked: the request's block lists (REST form, see blocks_of),
        # its prompt tokens, whether it is verified; then how its routes move (``mode``, one
        # for all, else as asked), whether its receivers compared every route's checksum
        # (``compared``, a verified send) and the bytes a fill check verified.
        self.blocks: dict[str, Any] = {}
        self.num_tokens: int | None = None
        self.verify = False
        self.mode = "staged"
        self.compared = False
        self.verified_bytes: int | None = None
        self.context: dict[str, Any] = {}  # the caller's extras (e.g. a REST transfer's id)
        self._event: threading.Event | None = None  # made by the first wait(): most never wait
        self._callbacks: list[Callable[[Handle], None]] = []
        self._lock = threading.Lock()

    @property
    def done(self) -> bool:
        return self.state != PENDING

    @property
    def ok(self) -> bool:
        return self.state in (ARRIVED, RELEASED)

    @property
    def duration_s(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.started_at

    def wait(self, timeout: float | None = None) -> str:
        """Block until resolved (or ``timeout``); returns the state."""
        with self._lock:
            if self.done:
                return self.state
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        event.wait(timeout)
        return self.state

    def add_done_callback(self, callback: Callable[[Handle], None]) -> None:
        """Call ``callback(handle)`` once resolved (at once if it already is). Callbacks run on
        the worker's progress thread, or on the thread that called ``send``/``expect`` when the
        handle resolves at once: keep them short."""
        with self._lock:
            if not self.done:
                self._callbacks.append(callback)
                return
        callback(self)

    def _resolve(self, state: str, reason: str | None = None) -> bool:
        with self._lock:
            if self.done:
                return False
            self.state, self.reason = state, reason
            self.finished_at = time.time()
            self.reusable_at = self.finished_at + self._quiet_s
            callbacks, self._callbacks = self._callbacks, []
            event = self._event
        if event is not None:
            event.set()
        for callback in callbacks:
            try:
                callback(self)
            except Exception:  # a caller's callback must not kill the progress loop
                log.exception("handle callback of %s failed", self.request_id)
        return True

    def __repr__(self) -> str:
        return f"Handle({self.request_id!r}, {self.side}, {self.state}, reason={self.reason!r})"


@dataclass(frozen=True)
class Finished:
    """What :meth:`Handover.get_finished` returns: request ids resolved since the last call."""

    sent: frozenset[str]
    received: frozenset[str]
    failed: Mapping[str, str]


@dataclass
class RouteState:
    """One route of a handle: (sender rank → receiver rank) with its aligned blocks."""

    op: Op
    route: Route
    route_dict: Mapping[str, Any]
    sender_rank: int
    receiver_rank: int
    src: dict[int, np.ndarray]
    dst: dict[int, np.ndarray]
    layout: StagingLayout
    peer_rank: int  # the other side's rank
    mode: str = "staged"  # staged | fragments (auto resolved per route, alike on both sides)
    agent: str | None = None  # the other side's NIXL agent (None until the directory has it)
    area: int | None = None  # staging offset (receiver: granted area; sender: local area)
    chunks: dict[int, StagingChunk] = field(default_factory=dict)  # receiver: outstanding
    chunk_blocks: int = CHUNK_BLOCKS
    # sender: posted WRITEs, as NixlTransport.post_write/post_fragments return them
    pending: list[PendingWrite] = field(default_factory=list)
    grant: tuple[str, int, int, int, float] | None = None  # agent, offset, nbytes, cb, write_by
    granted: bool = False
    heard_at: float = 0.0  # receiver: when it granted or the last chunk arrived
    written: bool = False
    done: bool = False
    checksum: int | None = None
    # verify: the sender's crc32 of the route, from its last chunk's or its fragments'
    # notification (receiver); None from a writer that does not send it
    sender_checksum: int | None = None
    # verify: the receiver said in its grant that it compares the sums itself (sender)
    compared: bool = False

    @property
    def key(self) -> RouteKey:
        return (self.op.xid, self.sender_rank, self.receiver_rank)


@dataclass
class Op:
    """One request on this rank: its handle, its routes and its deadline."""

    handle: Handle
    xid: str
    side: str
    peer: str
    mode: str
    verify: bool
    deadline: float
    routes: list[RouteState] = field(default_factory=list)
    hold_until: float = 0.0
    ask: bool = False  # receiver: ask each writer to send (see Ask)
    source: str | None = None  # receiver: the context engine's id of the request (Ask.source)
    dp: tuple[int | None, int | None] = (None, None)  # context and generation DP ranks

    @property
    def peer_epoch(self) -> str:
        """The epoch of the peer instance that this request's plan was made with."""
        entry = self.handle.entry
        return entry.generation_epoch if self.side == "send" else entry.context_epoch


class Handles:
    """This rank's pending handles, their routes by key, and how they end; the part of
    :class:`~workers.handover.Handover` that every other part calls."""

    def __init__(
        self,
        transport: NixlTransport,
        areas: StagingAreas,
        peers: Peers,
        reloads: PeerReloads,
        *,
        check: Callable[[Handle, Sequence[RouteState]], str | None] | None = None,
        on_finished: Callable[[Handle], None] | None = None,
    ) -> None:
        self.transport = transport
        self.areas = areas
        self.peers = peers
        self.reloads = reloads
        # Progress thread, before a receive resolves: a reason fails it (fill-pattern checks).
        # It gets the receive's route states, and may set the checksum of a fragments-mode
        # route of a verified receive (the receiver then does not sum those bytes itself).
        self.check = check
        self.on_finished = on_finished
        self.ops: dict[int, Op] = {}  # pending, by id(op)
        # The routes of pending handles that still move bytes, by key (a notification finds
        # its route here): this rank's sends and its receives
        self.sending: dict[RouteKey, RouteState] = {}
        self.receiving: dict[RouteKey, RouteState] = {}
        self.finished: deque[Handle] = deque()  # resolved since the last take_finished()
        self.stats = {"sent": 0, "received": 0, "failed": 0, "bytes": 0}
        self._aborted: dict[RouteKey, tuple[str, str]] = {}  # sends failed here: to whom, why

    # --- beginning ---------------------------------------------------------------------------

    def open(self, op: Op) -> None:
        """Count ``op`` as pending: from now on it ends here."""
        self.ops[id(op)] = op

    def index(self, op: Op) -> bool:
        """Enter ``op``'s routes in its side's index, so their notifications find them (a
        staged route of no bytes is done at once); False, entering nothing, when the request is
        already in flight here."""
        index = self.sending if op.side == "send" else self.receiving
        if any(state.key in index for state in op.routes):
            return False
        for state in op.routes:
            if not state.layout.nbytes and state.mode == "staged":
                state.done = True
                continue
            index[state.key] = state
        return True

    # --- ending ------------------------------------------------------------------------------

    def route_done(self, state: RouteState) -> None:
        """``state`` moved its bytes: out of the index; its handle resolves if it was the last."""
        state.done = True
        index = self.sending if state.op.side == "send" else self.receiving
        if index.get(state.key) is state:
            del index[state.key]
        self.maybe_complete(state.op)

    def maybe_complete(self, op: Op) -> None:
        """Resolve ``op`` once every route of it is done."""
        if not op.handle.done and all(state.done for state in op.routes):
            self.complete(op)

    def complete(self, op: Op) -> None:
        """Resolve ``op``: released or arrived, or failed when the check or the sums say so."""
        handle = op.handle
        reason = None
        if self.check is not None and op.side == "receive" and op.routes:
            reason = self.check(handle, op.routes)  # may fill in the routes' checksums
        if reason is None and op.verify and op.side == "receive":
            reason = checksum_mismatch(op.routes)
        if op.verify and op.side == "send":  # every receiver compares: this send decides nothing
            handle.compared = bool(op.routes) and all(s.compared for s in op.routes)
        handle.bytes = sum(state.layout.nbytes for state in op.routes)
        handle.routes = self._route_results(op)
        if reason is not None:
            self.ops.pop(id(op), None)
            self.stats["failed"] += 1
            self._resolve(handle, FAILED, reason)
            return
        self.ops.pop(id(op), None)
        self.stats["sent" if op.side == "send" else "received"] += 1
        self.stats["bytes"] += handle.bytes
        self._resolve(handle, RELEASED if op.side == "send" else ARRIVED, None)

    def _route_results(self, op: Op) -> list[dict[str, Any]]:
        return [
            {
                "sender_rank": s.sender_rank,
                "receiver_rank": s.receiver_rank,
                "bytes": s.layout.nbytes if s.done else 0,
                "checksum": s.checksum,
                **({"sender_checksum": s.sender_checksum} if s.sender_checksum is not None else {}),
            }
            for s in op.routes
        ]

    def fail(self, op: Op, reason: str, notify: bool = True) -> None:
        """Fail ``op`` with ``reason``: its staging freed or quarantined, its posted WRITEs
        released and, ``notify``, each other side told (an ``X`` notification)."""
        if op.handle.done:
            return
        now = time.monotonic()
        if op.side == "receive" and any(
            state.mode == "fragments" and state.granted and not state.done for state in op.routes
        ):
            # A writer with our grant writes straight into the blocks: they stay out of use for
            # as long as its grant lives (it never starts a WRITE later), plus the margin.
            op.handle._quiet_s = max(0.0, op.deadline - now) + QUARANTINE_MARGIN_S
        for state in op.routes:
            if state.done:
                continue
            index = self.sending if op.side == "send" else self.receiving
            if index.get(state.key) is state:
                del index[state.key]
            if state.area is not None:
                # A late WRITE may still land (receiver) or still read (sender): keep it out
                # of use until the grant's time to live is over.
                ttl = max(0.0, op.deadline - now) + QUARANTINE_MARGIN_S
                if state.pending or op.side == "receive":
                    self.areas.quarantine(state.area, state.layout.nbytes, now + ttl)
                else:
                    self.areas.free(state.area, state.layout.nbytes)
                state.area = None
            for pending in state.pending:
                self.transport.release(pending)
            state.pending.clear()
            if notify:
                self._abort_notice(op, state, reason)
        if op.side == "send":  # a grant that comes again for it gets this reason back
            for state in op.routes:
                if state.agent is not None:
                    self._aborted[state.key] = (state.agent, reason)
            while len(self._aborted) > 4096:
                del self._aborted[next(iter(self._aborted))]
        op.handle.routes = self._route_results(op)
        self.ops.pop(id(op), None)
        self.stats["failed"] += 1
        log.warning("%s %s failed: %s", op.side, op.xid, reason)
        self._resolve(op.handle, FAILED, reason)

    def fail_overdue(self, now: float) -> None:
        """Fail the handles whose deadline passed, saying what each still waited for."""
        for op in list(self.ops.values()):
            if now > op.deadline:
                self.fail(op, self._deadline_reason(op))

    def peers_changed(self, peer_epochs: Mapping[str, str], retired: set[str]) -> None:
        """A refreshed directory: fail the handles whose peer instance has another epoch now
        (``peer_epochs``) or whose peer worker was replaced (its agent in ``retired``)."""
        for op in list(self.ops.values()):
            current = peer_epochs.get(op.peer)
            if current is not None and current != op.peer_epoch:
                self.fail(op, f"peer_restarted: {op.peer} re-registered (new epoch)")
                continue
            for state in op.routes:
                if state.agent is not None and state.agent in retired and not state.done:
                    self.fail(
                        op,
                        f"peer_restarted: the worker of {op.peer} rank "
                        f"{state.peer_rank} was replaced",
                    )
                    break

    def drop(self, handle: Handle, reason: str) -> None:
        """Fail a handle that no progress thread will run (``send``/``expect`` raced
        ``close``); nothing else is told."""
        handle._resolve(FAILED, reason)

    def take_finished(self) -> Finished:
        """Request ids whose handles resolved since the last call."""
        sent, received, failed = set(), set(), {}
        while self.finished:
            handle = self.finished.popleft()
            if handle.state == FAILED:
                failed[handle.request_id] = str(handle.reason)
            elif handle.side == "send":
                sent.add(handle.request_id)
            else:
                received.add(handle.request_id)
        return Finished(frozenset(sent), frozenset(received), failed)

    def _abort_notice(self, op: Op, state: RouteState, reason: str) -> None:
        """Tell the other side of ``state`` that ``op`` failed here (best effort; never over a
        connection that failed: the other side's own deadline covers it)."""
        if state.agent is None or not self.peers.usable(state.agent):
            return
        ce, ge = op.handle.entry.epochs()
        try:
            self.transport.send_notif(
                state.agent,
                notice(
                    "X",
                    op.xid,
                    ce,
                    ge,
                    state.sender_rank,
                    state.receiver_rank,
                    reason_field(reason),
                ),
            )
        except PeerUnreachable as error:  # that connection failed too: reload it later
            log.debug("abort notification to %s failed: %s", state.agent, error)
            self.reloads.mark(state.agent, error)
        except Exception as error:  # the peer may be gone: its deadline covers it
            log.debug("abort notification to %s failed: %s", state.agent, error)

    def abort_again(self, agent: str, key: RouteKey, fields: list[str]) -> bool:
        """A grant from ``agent`` for a route this rank's send failed (its abort may have been
        lost with a failed connection): tell the receiver again. Whether it was such a grant."""
        aborted = self._aborted.get(key)
        if aborted is None or aborted[0] != agent:
            return False
        if not self.peers.usable(agent):
            return True
        try:
            self.transport.send_notif(agent, notice("X", *fields[1:6], reason_field(aborted[1])))
        except PeerUnreachable as error:
            self.reloads.mark(agent, error)
        except TransportError as error:
            log.debug("abort to %s failed: %s", agent, error)
        return True

    def _resolve(self, handle: Handle, state: str, reason: str | None) -> None:
        if handle._resolve(state, reason):
            self.finished.append(handle)
            if len(self.finished) > 100_000:  # nobody polls get_finished: stay bounded
                self.finished.popleft()
            if self.on_finished is not None:
                try:
                    self.on_finished(handle)
                except Exception:
                    log.exception("on_finished hook failed for %s", handle.request_id)

    def _deadline_reason(self, op: Op) -> str:
        waiting = [s for s in op.routes if not s.done]
        parts = []
        for s in waiting[:3]:
            peer = self.peers.get(op.peer, s.peer_rank)
            agent = s.agent or (peer.agent if peer is not None else None)
            unreachable = self.reloads.why(agent) if agent is not None else None
            if unreachable is not None:
                parts.append(f"peer_unreachable: {op.peer} rank {s.peer_rank} {unreachable}")
            elif s.agent is None and peer is None:
                parts.append(f"no worker of {op.peer} rank {s.peer_rank} in the directory")
            elif s.agent is None:
                parts.append(f"the endpoint of {op.peer} rank {s.peer_rank} could not be loaded")
            elif op.side == "send" and s.grant is None:
                parts.append(f"no grant from {op.peer} rank {s.peer_rank} (did it expect()?)")
            elif op.side == "send":
                parts.append(f"WRITEs to {op.peer} rank {s.peer_rank} still in flight")
            elif not s.granted:
                parts.append("no staging space")
            else:
                parts.append(
                    f"{op.peer} rank {s.peer_rank} did not write ({len(s.chunks)} chunk(s) missing)"
                )
        return f"deadline: {op.handle.timeout_s:g} s passed; " + "; ".join(parts)

    def unreachable(
        self, agent: str, error: Exception, reload: bool = True, spare: Op | None = None
    ) -> None:
        """The connection to ``agent`` failed: every handle using it fails (``peer_unreachable``)
        and tells its other peers; ``agent`` is loaded again once a probe reaches it
        (:mod:`workers.handover.reloads`), never here: while the network is cut that load
        blocks for seconds, and a WRITE still posted to it must be released first."""
        victims: list[tuple[Op, str]] = []
        for op in list(self.ops.values()):
            if op is spare:  # nothing of it left over that connection: it waits for the reload
                continue
            # Lost with the connection: a sender's posted or completed WRITEs. What else goes
            # over this rank's side of it (grants, asks, aborts) is sent again once the peer
            # is loaded again: a receiver keeps waiting for its bytes, a sender that has not
            # written yet for its grant.
            lost = next(
                (s for s in op.routes if s.agent == agent and not s.done and s.written),
                None,
            )
            if lost is not None and not op.handle.done:
                reason = (
                    f"peer_unreachable: the connection to {op.peer} rank {lost.peer_rank} "
                    f"failed: {error}"
                )
                self.fail(op, reason, notify=False)
                victims.append((op, reason))
        if reload:
            self.reloads.mark(agent, error)
        for op, reason in victims:
            for state in op.routes:
                if not state.done:
                    self._abort_notice(op, state, reason)


def checksum_mismatch(routes: list[RouteState]) -> str | None:
    """A verified receive's failure reason when a route's bytes do not sum to what its sender
    summed (both sides' crc32, compared here before the handle says ``arrived``)."""
    for state in routes:
        if (
            state.sender_checksum is not None
            and state.checksum is not None
            and state.sender_checksum != state.checksum
        ):
            return (
                f"checksum_mismatch: route {state.sender_rank}->{state.receiver_rank}: sender "
                f"crc32 {state.sender_checksum}, receiver crc32 {state.checksum}"
            )
    return None
