"""The :class:`Handover` of one rank: the engine-facing calls and the progress thread.

``send``/``expect`` validate on the caller's thread (request id, mode, role, timeout, block ids
against this rank's pools) and begin the handle there, so its grant (or, after an early grant,
its WRITEs) leaves at once. One progress thread per worker then drives NIXL: it runs what the
caller's thread hands it, dispatches the notifications that arrived (grants and aborts that come
before their ``send``/``expect`` wait ``EARLY_TTL_S``), polls posted WRITEs, retries routes that
wait for a peer's endpoint or for staging space, re-sends grants and fails handles whose
deadline passed. While a handle is pending it polls every ``BUSY_SLEEP_S``, then, after
``BUSY_POLLS`` polls without progress, every ``PATIENT_SLEEP_S``; idle, it waits up to
``IDLE_WAIT_S``, and up to ``IDLE_SLOW_WAIT_S`` once idle for ``IDLE_SLOW_AFTER_S`` unless it
serves asks (``on_ask``). A call of ``send``/``expect`` wakes it at once either way; a peer's
first contact with an idle rank, e.g. the connection set-up a fresh endpoint needs, may wait
that long. A refreshed directory swaps in on the progress thread: a peer worker is retired only
when its rank has another worker or its instance another epoch.

:class:`Handover` holds its parts and wires them together; each owns its own state:

- ``handles`` (:class:`~workers.handover.handles.Handles`): the pending requests, their routes
  by key, the resolved handles not yet polled, and how a handle ends;
- ``grants`` (:class:`~workers.handover.grants.GrantExchange`): the grants and WRITEs of each
  route, the routes that wait, asks;
- ``peers`` (:class:`~workers.handover.peers.Peers`): the peer workers, their NIXL endpoints and,
  in ``peers.reloads``, the ones whose connection failed;
- ``areas`` (:class:`~workers.handover.staging.StagingAreas`): this rank's staging buffer.

:class:`Handover` itself keeps what the engine and the progress thread need: the directory, the
inbox of calls for the progress thread, and the notifications that came before their
``send``/``expect``; it dispatches each notification to the part it is for.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from workers.directory import Directory, HandoverError, PeerWorker
from workers.executors import BlockRangeError, align_request, staging_layout
from workers.handover.blocks import BlockMap, blocks_of, normalize_blocks
from workers.handover.grants import GRANT_RESEND_S, MODES, GrantExchange, route_mode_of
from workers.handover.handles import Finished, Handle, Handles, Op, RouteState
from workers.handover.notices import Ask, RouteKey, decode, notice
from workers.handover.peers import Peers
from workers.handover.reloads import RELOAD_ME
from workers.handover.staging import CHUNK_BLOCKS, StagingAreas
from workers.transport import PeerUnreachable

if TYPE_CHECKING:
    from workers.transport.nixl import NixlTransport

log = logging.getLogger("kvplane.handover")

DEFAULT_TIMEOUT_S = 30.0
EARLY_TTL_S = 120.0  # grants and aborts that arrive before their send() are kept this long
STRANGER_RELEASE_S = 5.0  # a release notice from an agent not in the directory waits this long
STRANGER_RELEASES = 1024  # ... and at most this many wait
IDLE_WAIT_S = 0.005  # an idle progress loop still drains stray notifications this often ...
IDLE_SLOW_AFTER_S = 1.0  # ... and, idle this long (its idle hook done), only every
IDLE_SLOW_WAIT_S = 0.025  # IDLE_SLOW_WAIT_S: each wake costs ~80 us of CPU, 16 ms a second
IDLE_HOOK_S = 0.02  # nothing pending this long: the owner's idle hook runs (see on_idle)
# While a handle is pending, the loop polls NIXL every BUSY_SLEEP_S: a notification (a grant,
# a chunk) waits at most that long to be seen, and every hop of a handover pays it (0.5 ms here
# cost ~1 ms per request at 4 blocks: two hops). The raw bench loop polls as often. After
# BUSY_POLLS polls without progress (a peer that has not called yet), it polls every
# PATIENT_SLEEP_S instead: each poll costs ~15 us of CPU, and six spinning ranks on two cores
# slowed the ranks that had work to do.
BUSY_SLEEP_S = 0.00005
BUSY_POLLS = 40
PATIENT_SLEEP_S = 0.00025
REQUEST_ID = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,200}$")


class Handover:
    """The hot path of one rank: ``send`` / ``expect`` per request, one progress thread."""

    def __init__(
        self,
        transport: NixlTransport,
        *,
        instance: str,
        rank: int,
        directory: Directory | None = None,
        on_finished: Callable[[Handle], None] | None = None,
        on_start: Callable[[Handle], None] | None = None,
        check: Callable[[Handle, Sequence[RouteState]], str | None] | None = None,
        chunk_blocks: int = CHUNK_BLOCKS,
        default_timeout_s: float = DEFAULT_TIMEOUT_S,
        hold_s: float = 0.0,
        on_ask: Callable[[Ask], None] | None = None,
        on_release: Callable[[str, str], None] | None = None,
        on_unknown_agent: Callable[[str], None] | None = None,
        on_idle: Callable[[], bool | None] | None = None,
    ) -> None:
        self.transport = transport
        self.instance = instance
        self.rank = rank
        self.directory = directory or Directory.empty(instance, rank)
        self.on_start = on_start  # caller's thread, before the first byte can move
        self.default_timeout_s = default_timeout_s
        # Fault injection for tests and chaos drills: a receiver holds its grants, a sender
        # its writes, this long after the handle started (a frozen or dying peer).
        self.hold_s = hold_s
        # Context side: called on the progress thread with (request id, generation instance)
        # when a paired generation rank will not ask for that request (see release()).
        self.on_release = on_release
        # Progress thread, after IDLE_HOOK_S with no handle pending (and every IDLE_WAIT_S
        # while that lasts): the owner's background work (fill mode marks noted receives).
        # It returns True while it has more to do (the loop then does not slow down).
        self.on_idle = on_idle
        self.areas = StagingAreas(int(transport.staging.numel()))
        self._inbox: deque[Callable[[], None]] = deque()
        self._wake = threading.Event()
        # Held by the progress thread while it steps and by send()/expect() while they begin a
        # handle; re-entrant, so a callback that starts another handle does not deadlock.
        self._mutex = threading.RLock()
        self._closed = False
        # Grants and aborts that came before their send()/expect(): (agent, fields, when)
        self._early: dict[RouteKey, tuple[str, list[str], float]] = {}
        # Release notices from agents not in the directory yet: (agent, request id, when)
        self._strangers: list[tuple[str, str, float]] = []
        self._next_resend = 0.0  # when the progress loop next re-sends quiet grants
        self.ticked_at = time.monotonic()  # the progress loop's last turn (a stall watch reads it)
        self.peers = Peers(transport, wake=self._wake.set, name=f"{instance}-{rank}")
        self.handles = Handles(
            transport,
            self.areas,
            self.peers,
            self.peers.reloads,
            check=check,
            on_finished=on_finished,
        )
        self.grants = GrantExchange(
            transport,
            self.areas,
            self.handles,
            self.peers,
            self.peers.reloads,
            chunk_blocks=chunk_blocks,
            sum_fragments=check is None,  # a check gathers those bytes: it sums them
            on_ask=on_ask,
            on_unknown_agent=on_unknown_agent,
        )
        transport.reconnect_inline = False  # failed peers are reloaded by peers.reloads
        self._apply_directory(self.directory)
        self._thread = threading.Thread(
            target=self._loop, daemon=True, name=f"kvplane-handover-{instance}-{rank}"
        )
        self._thread.start()

    # --- engine API --------------------------------------------------------------------------

    def send(
        self,
        request_id: str,
        peer: str,
        blocks: BlockMap,
        *,
        context_dp_rank: int | None = None,
        generation_dp_rank: int | None = None,
        timeout_s: float | None = None,
        mode: str = "auto",
        verify: bool = False,
        context: Mapping[str, Any] | None = None,
        num_tokens: int | None = None,
    ) -> Handle:
        """Start sending this rank's share of ``request_id`` to generation instance ``peer``.

        ``num_tokens``: the request's prompt tokens whose KV the context holds (vLLM's
        ``num_computed_tokens``); blocks pair by token position from the start of the request
        (:mod:`geometry.align`), and both sides must give the same value. Required with a
        block-size ratio (a partial last block then moves only its tokens) and with CP over
        layer groups of different lengths; ``ambiguous_alignment`` otherwise.
        ``timeout_s``: the handle fails when not released by then; ``mode``: ``staged``,
        ``fragments`` or ``auto`` (per route: fragments when the route's fragments average at
        least ``AUTO_FRAGMENT_BYTES``, else staged; both sides resolve it alike from the same
        plan); ``verify``: crc32 of every route's bytes on both sides
        (recorded); ``context``: the caller's extras, kept on ``handle.context``. Raises
        :class:`HandoverError` (a ``code`` says why) when it cannot start.
        """
        return self._start(
            "send",
            request_id,
            peer,
            blocks,
            context_dp_rank,
            generation_dp_rank,
            timeout_s,
            mode,
            verify,
            context,
            num_tokens,
        )

    def expect(
        self,
        request_id: str,
        peer: str,
        blocks: BlockMap,
        *,
        context_dp_rank: int | None = None,
        generation_dp_rank: int | None = None,
        timeout_s: float | None = None,
        mode: str = "auto",
        verify: bool = False,
        context: Mapping[str, Any] | None = None,
        num_tokens: int | None = None,
        ask: bool = False,
        source: str | None = None,
    ) -> Handle:
        """Start receiving this rank's share of ``request_id`` from context instance ``peer``
        (same options as :meth:`send`; the handle becomes ``arrived``). ``ask``: the context
        side has not called ``send``; ask each writer to (see :class:`Ask`). ``source``: the
        context engine's own id of the request, when it differs from ``request_id`` (it rides
        the ask as :attr:`Ask.source`)."""
        return self._start(
            "receive",
            request_id,
            peer,
            blocks,
            context_dp_rank,
            generation_dp_rank,
            timeout_s,
            mode,
            verify,
            context,
            num_tokens,
            ask,
            source,
        )

    def release(
        self,
        request_id: str,
        peer: str,
        *,
        context_dp_rank: int | None = None,
        generation_dp_rank: int | None = None,
    ) -> int | None:
        """Generation side: tell each context rank of ``peer`` that writes to this rank that
        its request ``request_id`` (the context engine's id) will not be asked for, so it frees
        the blocks now rather than when its hold runs out. The notices go from the progress
        thread, which loads a writer's endpoint first where this rank has not met it yet.
        Returns the notices queued (0 for an invalid id, or where no writer of ``peer`` writes
        to this rank), or None where this rank's directory does not know the pairing (yet):
        refresh it and release again, or let the hold run out."""
        if not isinstance(request_id, str) or not REQUEST_ID.match(request_id):
            return 0
        entry = self.directory.plans.get((peer, context_dp_rank, generation_dp_rank))
        if entry is None:
            return None
        ce, ge = entry.epochs()
        senders = sorted({r.sender_rank for r in entry.routes if r.receiver_rank == self.rank})
        if senders:
            self.call_soon(lambda: self._send_releases(request_id, peer, senders, ce, ge))
        return len(senders)

    def _send_releases(
        self, request_id: str, peer: str, senders: list[int], ce: str, ge: str
    ) -> None:
        """Progress thread: :meth:`release`'s notices (the hold covers one that cannot go)."""
        for sender in senders:
            worker = self.peers.get(peer, sender)
            if worker is None or not self.peers.load(worker):
                log.debug("release of %s: %s rank %d is not reachable", request_id, peer, sender)
                continue
            try:
                self.transport.send_notif(
                    worker.agent, notice("R", request_id, ce, ge, sender, self.rank)
                )
            except Exception as error:
                log.debug("release of %s to %s failed: %s", request_id, worker.agent, error)

    def refuse(self, ask: Ask, reason: str) -> None:
        """Answer ``ask`` with an abort: the receiver's handle fails at once with ``reason``."""
        self.grants.refuse(ask, reason)

    def get_finished(self) -> Finished:
        """Request ids whose handles resolved since the last call (connector-style poll)."""
        return self.handles.take_finished()

    def set_directory(self, directory: Directory) -> None:
        """Swap in a refreshed directory: the next send/expect plans with it at once, and the
        progress thread applies it to its peers (connections, retired workers)."""
        self.directory = directory
        self.call_soon(lambda: self._apply_directory(directory))

    def hold(self, seconds: float) -> None:
        """Fault injection for tests and chaos drills: receivers hold their grants, senders
        their writes, this long after each handle started (a frozen or dying peer)."""
        self.hold_s = float(seconds)

    def close(self, reason: str = "the worker stopped") -> None:
        """Fail every pending handle with ``reason`` and stop the progress thread."""
        if self._closed:
            return
        done = threading.Event()

        def shutdown() -> None:
            for op in list(self.handles.ops.values()):
                self.handles.fail(op, reason)
            self._closed = True
            done.set()

        self.peers.close()
        self.call_soon(shutdown)
        if not done.wait(5.0):
            self._closed = True
        self._thread.join(timeout=5.0)

    @property
    def pending(self) -> int:
        """Handles not resolved yet."""
        return len(self.handles.ops)

    @property
    def stats(self) -> dict[str, int]:
        """Handles sent, received and failed, and bytes moved, since the start."""
        return self.handles.stats

    def peer(self, instance: str, rank: int) -> PeerWorker | None:
        """The worker of ``instance`` rank ``rank`` this rank would talk to now."""
        return self.peers.get(instance, rank)

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the progress thread at its next step, which it wakes: there it may
        read or change the handover's books (its parts) without racing the hot path."""
        self._inbox.append(fn)
        self._wake.set()

    # --- starting a handle (caller's thread: validation only) --------------------------------

    def _start(
        self,
        side: str,
        request_id: str,
        peer: str,
        blocks: BlockMap,
        context_dp_rank: int | None,
        generation_dp_rank: int | None,
        timeout_s: float | None,
        mode: str,
        verify: bool,
        context: Mapping[str, Any] | None,
        num_tokens: int | None = None,
        ask: bool = False,
        source: str | None = None,
    ) -> Handle:
        if self._closed:
            raise HandoverError("this worker's handover is closed", code="closed")
        if not isinstance(request_id, str) or not REQUEST_ID.match(request_id):
            raise HandoverError(
                f"request id {request_id!r}: 1-200 characters of letters, digits and ._:@/+=-",
                code="invalid_request_id",
            )
        if mode not in MODES:
            raise HandoverError(f"mode {mode!r}: auto, staged or fragments", code="invalid_mode")
        directory = self.directory
        role = "context" if side == "send" else "generation"
        if directory.role and directory.role != role:
            raise HandoverError(
                f"{self.instance} is a {directory.role} instance: it can only "
                f"{'send' if directory.role == 'context' else 'expect'}",
                code="wrong_role",
            )
        entry = directory.plan(peer, context_dp_rank, generation_dp_rank)
        timeout = self.default_timeout_s if timeout_s is None else float(timeout_s)
        if not 0 < timeout <= 3600:
            raise HandoverError(f"timeout_s {timeout}: between 0 and 3600", code="invalid_timeout")
        if num_tokens is not None and (type(num_tokens) is not int or num_tokens < 1):
            raise HandoverError(f"num_tokens {num_tokens!r}: an integer ≥ 1", code="invalid_blocks")
        pairs = normalize_blocks(blocks)
        handle = Handle(request_id, side, peer, entry, timeout)
        handle.context.update(context or {})
        handle.blocks, handle.verify, handle.num_tokens = blocks_of(pairs), verify, num_tokens
        now = time.monotonic()
        op = Op(
            handle,
            request_id,
            side,
            peer,
            mode,
            verify,
            now + timeout,
            hold_until=now + self.hold_s,
            ask=ask and side == "receive",
            dp=(context_dp_rank, generation_dp_rank),
            source=source if ask and side == "receive" else None,
        )
        aligned: dict[Any, Any] = {}  # routes over the same groups align alike
        for route, route_dict in zip(entry.routes, entry.route_dicts, strict=True):
            mine = route.sender_rank if side == "send" else route.receiver_rank
            if mine != self.rank:
                continue
            missing = [g for g in route.layer_groups if g not in pairs]
            if missing:
                raise HandoverError(
                    f"no block lists for layer group(s) {missing}", code="invalid_blocks"
                )
            route_mode = route_mode_of(route) if mode == "auto" else mode  # the plan's route
            try:  # a ratio: the route as this request runs it (see align_request)
                route, src, dst = align_request(route, pairs, num_tokens, aligned)
            except BlockRangeError as error:  # e.g. two slot ids for a per-request state group
                raise HandoverError(str(error), code=error.code) from None
            layout = staging_layout(route, src)
            if route_mode == "staged" and layout.nbytes > self.areas.nbytes and mode == "auto":
                # Too large to stage here (a long prompt): pool to pool instead. A receiver
                # grants it so; a sender follows whatever the receiver grants.
                route_mode = "fragments"
            if route_mode == "staged" and layout.nbytes > self.areas.nbytes:
                raise HandoverError(
                    f"route {route.sender_rank}->{route.receiver_rank} needs {layout.nbytes} "
                    f"staging bytes; this worker's buffer holds {self.areas.nbytes} (use a "
                    "larger --staging-mib or mode=fragments)",
                    code="staging_too_small",
                )
            op.routes.append(
                RouteState(
                    op,
                    route,
                    route_dict,
                    route.sender_rank,
                    route.receiver_rank,
                    src,
                    dst,
                    layout,
                    peer_rank=route.receiver_rank if side == "send" else route.sender_rank,
                    mode=route_mode,
                )
            )
        modes = {state.mode for state in op.routes}
        handle.mode = modes.pop() if len(modes) == 1 else mode
        self._validate_ids(op)
        if self.on_start is not None:
            self.on_start(handle)
        # Begin on the caller's thread: its grant (or, after an early grant, its WRITEs) leaves
        # now rather than when the progress thread next wakes.
        with self._mutex:
            self._begin(op)
        self._wake.set()
        if self._closed and not self._thread.is_alive():  # raced close(): nobody will run it
            self.handles.drop(handle, "the worker stopped")
        return handle

    def _validate_ids(self, op: Op) -> None:
        """Block ids against this rank's pools, before anything is granted or written."""
        pools = self.transport.pools
        checked: set[tuple[int, int]] = set()  # (id of an id array, pool size): checked once
        for state in op.routes:
            ids = state.src if op.side == "send" else state.dst
            for seg in state.route.segments:
                pool_id = seg.src_pool if op.side == "send" else seg.dst_pool
                pool = pools.get(pool_id)
                if pool is None:
                    raise HandoverError(
                        f"pool {pool_id} is not on rank {self.rank}", code="invalid_blocks"
                    )
                arr = ids[seg.layer_group]
                num_slots = pool.spec.num_slots
                if (id(arr), num_slots) in checked:  # views of one layer group share their ids
                    continue
                checked.add((id(arr), num_slots))
                values = arr.ravel().tolist()  # a request's few ids: faster as Python ints
                if values and (min(values) < 0 or max(values) >= num_slots):
                    raise HandoverError(
                        f"layer group {seg.layer_group}: block ids must be in [0, "
                        f"{num_slots}) on rank {self.rank}",
                        code="invalid_blocks",
                    )
                if op.side == "receive" and len(set(values)) != len(values):
                    raise HandoverError(
                        f"layer group {seg.layer_group}: duplicate destination block ids",
                        code="invalid_blocks",
                    )

    # --- progress thread ---------------------------------------------------------------------

    def _loop(self) -> None:
        quiet = 0  # polls in a row that moved nothing
        idle_since: float | None = None  # when the last pending handle resolved
        try:
            while not self._closed:
                self.ticked_at = time.monotonic()
                woken = self._wake.is_set()
                self._wake.clear()
                try:
                    with self._mutex:
                        busy, progressed = self._step()
                except Exception:  # never let one bad step kill the hot path
                    log.exception("handover progress step failed")
                    busy = progressed = False
                quiet = 0 if progressed or woken else quiet + 1
                if busy:
                    idle_since = None
                    time.sleep(BUSY_SLEEP_S if quiet < BUSY_POLLS else PATIENT_SLEEP_S)
                    continue
                now = time.monotonic()
                idle_since = now if idle_since is None else idle_since
                more = False  # the idle hook has more to do
                if self.on_idle is not None and now - idle_since >= IDLE_HOOK_S:
                    try:
                        more = bool(self.on_idle())
                    except Exception:
                        log.exception("handover idle hook failed")
                # A rank that serves asks keeps the short wait: an ask comes while it is idle
                # (its KV ready, waiting to be asked) and is on the request's path.
                slow = (
                    not more
                    and self.grants.on_ask is None
                    and now - idle_since >= IDLE_SLOW_AFTER_S
                )
                # cleared (and counted) at the loop's top
                self._wake.wait(IDLE_SLOW_WAIT_S if slow else IDLE_WAIT_S)
        finally:
            # Whatever was started but not finished when the loop ends fails, never hangs.
            self._closed = True
            while self._inbox:
                with contextlib.suppress(Exception):
                    self._inbox.popleft()()
            for op in list(self.handles.ops.values()):
                with contextlib.suppress(Exception):
                    self.handles.fail(op, "the worker stopped", notify=False)

    def _step(self) -> tuple[bool, bool]:
        """One poll: ``(handles pending, something moved)``."""
        progressed = bool(self._inbox)
        while self._inbox:
            self._inbox.popleft()()
        if self._closed:
            return False, progressed
        handles, grants, peers = self.handles, self.grants, self.peers
        finished = len(handles.finished)
        progressed = self._drain() or progressed
        if peers.reloads.any_ready:
            progressed = peers.reload_ready() or progressed
        now = time.monotonic()
        for state in list(handles.sending.values()):
            if state.pending and not state.done:
                grants.poll_writes(state)
        if grants.waiting:
            grants.retry_waiting()
        if handles.receiving and now > self._next_resend:
            self._next_resend = now + GRANT_RESEND_S / 4
            grants.resend_grants(now)
        handles.fail_overdue(now)
        self.areas.reclaim(now)
        if self._early:
            self._expire_early(now)
        return bool(handles.ops), progressed or len(handles.finished) != finished

    def _drain(self) -> bool:
        """Handle every notification that arrived; whether there were any."""
        notifications = self.transport.drain_notifications()
        for agent, msgs in notifications.items():
            for msg in msgs:
                if msg.startswith(RELOAD_ME):  # a peer's probe: its connection to us failed
                    self.peers.reloads.requested(msg[len(RELOAD_ME) :].decode(errors="replace"))
                    continue
                try:
                    self._on_notification(agent, msg)
                except Exception:  # one bad message must not drop the rest of the batch
                    log.exception("notification %r from %s failed", msg[:80], agent)
        return bool(notifications)

    def _begin(self, op: Op) -> None:
        handles = self.handles
        handles.open(op)
        if self._closed:
            handles.fail(op, "the worker stopped", notify=False)
            return
        if not op.routes:  # this rank takes no part (e.g. another DP rank's request)
            handles.complete(op)
            return
        if not handles.index(op):
            handles.fail(
                op, f"request {op.xid!r} is already in flight on rank {self.rank}", notify=False
            )
            return
        self.grants.begin(op)
        if op.side == "send":
            # A grant that already came in but waits in NIXL: take it now, and write on the
            # caller's thread instead of when the progress thread next polls.
            self._drain()
        for state in op.routes:
            early = self._early.pop(state.key, None)
            if early is not None and not op.handle.done:
                self._on_message(early[0], early[1], state, received_at=early[2])
        handles.maybe_complete(op)

    # --- notifications -----------------------------------------------------------------------

    def _on_notification(self, agent: str, msg: bytes) -> None:
        decoded = decode(msg)
        if decoded is None:
            return  # not ours (or mangled): nothing waits for it
        kind, key, fields = decoded
        if kind == "A":
            if self.directory.role != "generation":
                self.grants.serve_ask(agent, fields)
            return
        if kind == "R":
            self._on_release(agent, key[0])
            return
        index = (
            self.handles.sending
            if kind == "G" or (kind == "X" and self.directory.role == "context")
            else self.handles.receiving
        )
        state = index.get(key)
        if state is None:
            if kind == "G" and (
                self.grants.probe_written(agent, key, fields)
                or self.handles.abort_again(agent, key, fields)
            ):
                return  # a grant again for a route this rank wrote, or whose send failed
            if kind == "X" or (kind == "G" and self.directory.role == "context"):
                # send()/expect() not called yet: a grant, or an abort, waits for it
                self._early[key] = (agent, fields, time.monotonic())
            return
        self._on_message(agent, fields, state)

    def _on_release(self, agent: str, request_id: str) -> None:
        """A paired generation rank will not ask for ``request_id`` (see :meth:`release`).

        A notice from an agent this rank does not know yet (a generation engine's first
        contact: its pairing is newer than this rank's directory) waits up to
        ``STRANGER_RELEASE_S`` for the directory refresh it asks for; a notice whose agent the
        refreshed directory does not name either is dropped: only a paired instance's worker
        may release."""
        if self.on_release is None or self.directory.role != "context":
            return
        peer = self.peers.by_agent(agent)
        if peer is None:
            if len(self._strangers) < STRANGER_RELEASES:
                self._strangers.append((agent, request_id, time.monotonic()))
            if self.grants.on_unknown_agent is not None:
                self.grants.on_unknown_agent(agent)
            return
        try:
            self.on_release(request_id, peer.instance)
        except Exception:
            log.exception("on_release hook failed for %s", request_id)

    def _strangers_again(self) -> None:
        """After a directory refresh: the parked notices of agents it names go through."""
        now = time.monotonic()
        parked, self._strangers = self._strangers, []
        for agent, request_id, since in parked:
            if self.peers.by_agent(agent) is not None:
                self._on_release(agent, request_id)
            elif now - since < STRANGER_RELEASE_S:
                self._strangers.append((agent, request_id, since))
        if self._strangers and self.grants.on_unknown_agent is not None:
            self.grants.on_unknown_agent(self._strangers[0][0])  # a refresh may have raced it

    def _on_message(
        self, agent: str, fields: list[str], state: RouteState, received_at: float | None = None
    ) -> None:
        op = state.op
        if op.handle.done:
            return
        kind = fields[0]
        if state.agent is not None and agent != state.agent:
            owner = self.peers.known(agent)
            who = f"{op.peer} rank {state.peer_rank}"
            if owner is not None:
                self.handles.fail(op, f"peer_restarted: a message from {who}'s previous worker")
            return  # a stranger's message: drop it
        if (fields[2], fields[3]) != op.handle.entry.epochs():
            self.handles.fail(
                op,
                f"peer_restarted: {op.peer} planned with other epochs "
                f"({fields[2][:8]}/{fields[3][:8]})",
                notify=True,
            )
            return
        try:
            if kind == "X":
                told = "|".join(fields[6:])
                cause = "peer_unreachable: " if told.startswith("peer_unreachable") else ""
                self.handles.fail(
                    op,
                    f"{cause}peer {op.peer} rank {state.peer_rank} aborted: {told}",
                    notify=False,
                )
            elif kind == "G" and op.side == "send" and state.grant is None:
                self.grants.on_grant(state, agent, fields, received_at)
            elif kind == "C" and op.side == "receive":
                self.grants.on_chunk(state, fields)
            elif kind == "F" and op.side == "receive":
                self.grants.on_fragments_done(state, fields)
        except PeerUnreachable as error:  # a WRITE after the grant met a failed connection
            self.handles.unreachable(agent, error)
        except Exception as error:  # bad blocks, NIXL errors, a malformed message: fail it
            self.handles.fail(op, f"{type(error).__name__}: {error}")

    def _expire_early(self, now: float) -> None:
        self._early = {k: v for k, v in self._early.items() if now - v[2] < EARLY_TTL_S}

    # --- directory ---------------------------------------------------------------------------

    def _apply_directory(self, directory: Directory) -> None:
        """Swap in a refreshed directory: its peer workers (see :class:`Peers` for which are
        retired), and the handles whose peer restarted fail."""
        self.directory = directory
        retired = self.peers.apply(directory)
        self.handles.peers_changed(directory.peer_epochs, retired)
        if self._strangers:
            self._strangers_again()
