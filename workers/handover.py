"""The engine-facing API: one rank's side of each request's KV handover, in process.

An engine embeds one :class:`~workers.agent.Worker` per rank. The lifecycle is close to vLLM's KV
connector (the scheduler decides, the worker side starts sends and loads, a poll reports what
finished), so a thin adapter plugs it into such an engine:

1. **attach and start** (slow path, once): ``worker.attach(tensors={pool_id: tensor})`` registers
   the rank's KV memory with NIXL and the control plane; ``worker.start()`` pulls the worker's
   *directory* (the compiled templates of every pairing that involves its instance, for every DP
   combination, and its peers' NIXL endpoints) and keeps it current through the heartbeat.
2. **per request** (hot path, no database, no control-plane round trip): every context rank calls
   ``worker.send(request_id, peer, blocks)`` and every generation rank
   ``worker.expect(request_id, peer, blocks)``; both get a :class:`Handle` at once. ``blocks`` is
   the same map on both sides, ``{layer_group: (context_ids, generation_ids)}`` (or the REST form
   ``{"0": {"context": [...], "generation": [...]}}``): a router hands the request's two block
   tables to both engines, with ``num_tokens`` (the prompt tokens that move): blocks pair by
   token position from the start of the request (:mod:`api.geometry.align`; a block-size ratio
   runs as the lanes of :func:`~workers.executors.align_request`). Each rank computes its own
   routes from the cached templates; nothing coordinates them. A per-request state group
   (Mamba/SSM conv and SSM state,
   ``tokens_per_slot: null``) takes the request's state slot on each side, ``([slot], [slot])``
   (``[]`` on a side: move no state); it rides the same routes and staging.
3. **progress**: one thread per worker drives NIXL. The receiver knows from the plan who writes
   how many bytes, so it allocates a staging area per writer from its own buffer (no reservation
   round trip) and *grants* it to that writer in a NIXL notification. The writer gathers its
   route chunk by chunk into its own staging and WRITEs each chunk into the granted area with a
   notification; the receiver scatters each chunk into its blocks as it lands. In ``fragments``
   mode the grant only says "ready", and the writer posts one descriptor per fragment straight
   into the receiver's pools.
4. **outcome**: the receiver's handle becomes ``arrived`` when every writer's bytes are in its
   blocks; the sender's becomes ``released`` when its WRITEs completed (its context blocks may be
   freed); either becomes ``failed`` with a reason: its deadline passed, a peer restarted (a
   notification from an old agent or epoch), the peer aborted, or the blocks were bad. Failures
   are told to the other side at once (an abort notification), so neither waits for its
   deadline when the other already knows. Wait on a handle (``wait``), poll it (``done``,
   ``state``), give it a callback, or poll :meth:`Handover.get_finished`.
5. **record**: finished handles go to the control plane in batches (``workers/records.py``); the
   record never blocks a transfer and catches up after a control-plane outage.

Notifications (``|``-separated ASCII; ``x`` is the transfer id, ``ce``/``ge`` the context and
generation epochs the sender and receiver planned with, ``s``/``r`` the route's ranks):

- ``G|x|ce|ge|s|r|offset|nbytes|chunk_blocks|ttl_ms``: receiver → writer, "write this route into
  my staging at ``offset``" (``offset`` -1: fragments mode, straight into the pools);
- ``C|x|ce|ge|s|r|i|n``: writer → receiver with the WRITE of chunk ``i`` of ``n``;
- ``F|x|ce|ge|s|r|nbytes``: writer → receiver with the fragments WRITE;
- ``X|x|ce|ge|s|r|reason``: either way, "this transfer failed here".

A receiver whose granted route hears nothing for ``GRANT_RESEND_S`` sends its grant again (a
writer ignores a grant it already has). Lost connections: when NIXL says the connection to a peer
failed (a WRITE in its error state, ``nixlRemoteDisconnectError``), every handle using it fails as
``peer_unreachable``, the peer is loaded again (a new connection: UCX loses whatever is sent over
a failed one, silently) and the abort goes over the new one. The re-sent grant is what finds a
connection that failed while it was idle, so the next transfer after a network outage works
instead of waiting for its deadline. A writer that gets a grant again for a route it already
wrote (UCX completes a TCP WRITE once the bytes are in the socket) probes the connection with a
``P`` notification; when that finds the connection failed, the bytes were lost with it and the
receiver gets a ``peer_unreachable`` abort over a new one. On a merely slow link the probe is
harmless and the bytes arrive.

Staging areas of a failed receive stay quarantined for the grant's time to live plus a margin
(a writer never starts a WRITE after its grant expired), so a late WRITE never lands in an area
that another transfer owns.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from workers.directory import Directory, HandoverError, PeerWorker, PlanEntry
from workers.executors import (
    BlockRangeError,
    Route,
    StagingChunk,
    StagingLayout,
    align_request,
    expand_fragments,
    fragments_crc32,
    gather,
    scatter,
    staging_layout,
)
from workers.transport import PeerUnreachable, TransportError

if TYPE_CHECKING:
    from workers.transport.nixl import NixlTransport, _Pending

log = logging.getLogger("kvplane.handover")

PENDING, ARRIVED, RELEASED, FAILED = "pending", "arrived", "released", "failed"
DEFAULT_TIMEOUT_S = 30.0
CHUNK_BLOCKS = 16
QUARANTINE_MARGIN_S = 5.0
GRANT_RESEND_S = 1.0  # a granted route that heard nothing this long sends its grant again
EARLY_TTL_S = 120.0  # grants and aborts that arrive before their send() are kept this long
ASKED_TTL_S = 600.0  # an ask already served (or refused) is ignored when it comes again
IDLE_WAIT_S = 0.005  # an idle progress loop still drains stray notifications this often
# While a handle is pending, the loop polls NIXL every BUSY_SLEEP_S: a notification (a grant,
# a chunk) waits at most that long to be seen, and every hop of a handover pays it (0.5 ms here
# cost ~1 ms per request at 4 blocks: two hops). The raw bench loop polls as often. After
# BUSY_POLLS polls without progress (a peer that has not called yet), it polls every
# PATIENT_SLEEP_S instead: each poll costs ~15 us of CPU, and six spinning ranks on two cores
# slowed the ranks that had work to do.
BUSY_SLEEP_S = 0.00005
BUSY_POLLS = 40
PATIENT_SLEEP_S = 0.00025
# mode="auto": fragments (pool to pool, no copies) when a route's fragments average at least
# this many bytes; otherwise staged (gather, one WRITE per chunk, scatter).
AUTO_FRAGMENT_BYTES = 8192
MODES = ("auto", "staged", "fragments")
_ALIGN = 256
_ID = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,200}$")

BlockMap = Mapping[Any, Any]


def _flat_ids(raw: Any, g: int, side: str) -> list[int]:
    arr = np.asarray(raw.detach().cpu().numpy() if hasattr(raw, "detach") else raw)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise HandoverError(f"layer group {g}: {side} block ids must be a flat list of integers "
                            "(or, on a CP side, one such list per CP rank)",
                            code="invalid_blocks")
    return [int(x) for x in arr.tolist()]


def _side_ids(raw: Any, g: int, side: str) -> list[int] | list[list[int]]:
    """A flat id list, or one list per CP rank (helix: each CP rank's own block table)."""
    if type(raw) is list and all(type(x) is int for x in raw):
        return raw  # the usual form, already what the rest expects
    if (isinstance(raw, Sequence) and not isinstance(raw, (str, bytes)) and len(raw)
            and all(isinstance(x, (Sequence, np.ndarray)) and not isinstance(x, (str, bytes))
                    for x in raw)):
        return [_flat_ids(x, g, side) for x in raw]
    return _flat_ids(raw, g, side)


def normalize_blocks(blocks: BlockMap) -> dict[int, tuple[Any, Any]]:
    """``{group: (context_ids, generation_ids)}`` from either accepted form; each side a flat
    list of ints or one list per CP rank. Raises :class:`HandoverError` if bad."""
    out: dict[int, tuple[Any, Any]] = {}
    for group, lists in blocks.items():
        try:
            g = int(group)
        except (TypeError, ValueError):
            raise HandoverError(f"layer group {group!r} is not an integer",
                                code="invalid_blocks") from None
        if isinstance(lists, Mapping):
            pair = (lists.get("context"), lists.get("generation"))
        elif isinstance(lists, Sequence) and len(lists) == 2:
            pair = (lists[0], lists[1])
        else:
            raise HandoverError(f"layer group {g}: expected (context_ids, generation_ids)",
                                code="invalid_blocks")
        ids = []
        for side, raw in zip(("context", "generation"), pair, strict=True):
            if raw is None:
                raise HandoverError(f"layer group {g}: no {side} block list",
                                    code="invalid_blocks")
            ids.append(_side_ids(raw, g, side))
        out[g] = (ids[0], ids[1])
    return out


def route_mode_of(route: Route) -> str:
    """``mode="auto"`` for one route: ``fragments`` (pool to pool, no copies) when its fragments
    average at least ``AUTO_FRAGMENT_BYTES``, else ``staged``. A function of the plan alone, so
    the route's sender and receiver resolve it alike."""
    nbytes = sum(route.bytes_per_block(g) for g in route.layer_groups)
    fragments = route.fragments_per_block
    return "fragments" if fragments and nbytes >= AUTO_FRAGMENT_BYTES * fragments else "staged"


class Handle:
    """One rank's side of one request's handover; resolves exactly once."""

    def __init__(self, request_id: str, side: str, peer: str, entry: PlanEntry,
                 timeout_s: float) -> None:
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
        self.context: dict[str, Any] = {}  # caller's extras (e.g. REST transfer id, verify)
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


class StagingAreas:
    """First-fit allocator over one staging buffer, with quarantine for areas a late WRITE may
    still hit."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # sorted (start, end)
        self._quarantined: list[tuple[float, int, int]] = []

    def alloc(self, nbytes: int) -> int | None:
        need = max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
        for i, (start, end) in enumerate(self._free):
            if end - start >= need:
                if end - start == need:
                    del self._free[i]
                else:
                    self._free[i] = (start + need, end)
                return start
        return None

    def free(self, start: int, nbytes: int) -> None:
        end = start + max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
        self._free.append((start, end))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for s, e in self._free:
            if merged and merged[-1][1] == s:
                merged[-1] = (merged[-1][0], e)
            else:
                merged.append((s, e))
        self._free = merged

    def quarantine(self, start: int, nbytes: int, until: float) -> None:
        self._quarantined.append((until, start, nbytes))

    def reclaim(self, now: float) -> None:
        if not self._quarantined:
            return
        keep = []
        for until, start, nbytes in self._quarantined:
            if until <= now:
                self.free(start, nbytes)
            else:
                keep.append((until, start, nbytes))
        self._quarantined = keep

    @property
    def free_bytes(self) -> int:
        return sum(e - s for s, e in self._free)


@dataclass
class _RouteState:
    """One route of a handle: (sender rank → receiver rank) with its aligned blocks."""

    op: _Op
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
    pending: list[_Pending] = field(default_factory=list)  # sender: posted WRITEs
    grant: tuple[str, int, int, int, float] | None = None  # agent, offset, nbytes, cb, write_by
    granted: bool = False
    heard_at: float = 0.0  # receiver: when it granted or the last chunk arrived
    written: bool = False
    done: bool = False
    checksum: int | None = None

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.op.xid, self.sender_rank, self.receiver_rank)


@dataclass
class _Op:
    handle: Handle
    xid: str
    side: str
    peer: str
    mode: str
    verify: bool
    deadline: float
    routes: list[_RouteState] = field(default_factory=list)
    hold_until: float = 0.0
    ask: bool = False  # receiver: ask each writer to send (see Ask)
    dp: tuple[int | None, int | None] = (None, None)  # context and generation DP ranks


def _msg(*parts: object) -> bytes:
    return "|".join(str(p) for p in parts).encode()


@dataclass(frozen=True)
class Ask:
    """A generation rank's request that this context rank send ``request_id``.

    Engines whose context side finishes a request before the generation side has allocated its
    blocks (vLLM, SGLang: the prefill engine answers, then a router sends the request to the
    decode engine) cannot call ``send`` with both block lists. The generation rank then calls
    ``expect(..., ask=True)``: before its grant it sends each writer an ``A`` notification with
    the request's block map and options, and the context rank's ``on_ask`` hook answers with
    :meth:`Handover.send` (the engine checks that it still holds the blocks) or
    :meth:`Handover.refuse`. An ask comes again with each re-sent grant until a send starts; a
    request id that was already sent or refused here is ignored.
    """

    agent: str
    peer: str  # the generation instance
    peer_rank: int
    request_id: str
    blocks: Mapping[str, Any]  # the REST form, both sides' lists
    context_dp_rank: int | None
    generation_dp_rank: int | None
    timeout_s: float  # what is left of the receiver's deadline
    mode: str
    verify: bool
    epochs: tuple[str, str]
    route: tuple[int, int]  # (sender rank, receiver rank)
    num_tokens: int | None = None

    def send_options(self) -> dict[str, Any]:
        """Keyword arguments of :meth:`Handover.send` that match the receiver's."""
        return {"context_dp_rank": self.context_dp_rank,
                "generation_dp_rank": self.generation_dp_rank,
                "timeout_s": self.timeout_s, "mode": self.mode, "verify": self.verify,
                "num_tokens": self.num_tokens}


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
        check: Callable[[Handle], str | None] | None = None,
        chunk_blocks: int = CHUNK_BLOCKS,
        default_timeout_s: float = DEFAULT_TIMEOUT_S,
        hold_s: float = 0.0,
        on_ask: Callable[[Ask], None] | None = None,
        on_unknown_agent: Callable[[str], None] | None = None,
    ) -> None:
        self.transport = transport
        self.instance = instance
        self.rank = rank
        self.directory = directory or Directory.empty(instance, rank)
        self.on_finished = on_finished
        self.on_start = on_start  # caller's thread, before the first byte can move
        # Progress thread, before a receive resolves: a reason fails it (fill-pattern checks).
        self.check = check
        self.chunk_blocks = chunk_blocks
        self.default_timeout_s = default_timeout_s
        # Fault injection for tests and chaos drills: a receiver holds its grants, a sender
        # its writes, this long after the handle started (a frozen or dying peer).
        self.hold_s = hold_s
        # Context side: called on the progress thread with each new Ask (keep it short).
        self.on_ask = on_ask
        # An ask from an agent the directory does not name yet (a peer paired a moment ago):
        # the owner refreshes the directory off this thread; the ask comes again.
        self.on_unknown_agent = on_unknown_agent
        self._asked: dict[str, float] = {}  # request ids asked for here: when
        self.areas = StagingAreas(int(transport.staging.numel()))
        self._inbox: deque[Callable[[], None]] = deque()
        self._wake = threading.Event()
        # Held by the progress thread while it steps and by send()/expect() while they begin a
        # handle; re-entrant, so a callback that starts another handle does not deadlock.
        self._mutex = threading.RLock()
        self._closed = False
        self._ops: dict[int, _Op] = {}
        self._recv: dict[tuple[str, int, int], _RouteState] = {}
        self._send: dict[tuple[str, int, int], _RouteState] = {}
        self._waiting: list[_RouteState] = []  # routes waiting for staging space or a peer
        self._early: dict[tuple[str, int, int], tuple[str, list[str], float]] = {}
        self._peers: dict[tuple[str, int], PeerWorker] = {}  # the directory's, plus kept ones
        self._agents: dict[str, PeerWorker] = {}
        self._retired: dict[str, PeerWorker] = {}
        self._finished: deque[Handle] = deque()
        self._loaded: set[str] = set()
        self._next_resend = 0.0
        self._written: dict[tuple[str, int, int], str] = {}  # routes this rank wrote: agent
        self.stats = {"sent": 0, "received": 0, "failed": 0, "bytes": 0}
        self._apply_directory(self.directory)
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"kvplane-handover-{instance}-{rank}")
        self._thread.start()

    # --- engine API --------------------------------------------------------------------------

    def send(self, request_id: str, peer: str, blocks: BlockMap, *,
             context_dp_rank: int | None = None, generation_dp_rank: int | None = None,
             timeout_s: float | None = None, mode: str = "auto", verify: bool = False,
             context: Mapping[str, Any] | None = None, num_tokens: int | None = None) -> Handle:
        """Start sending this rank's share of ``request_id`` to generation instance ``peer``.

        ``num_tokens``: the request's prompt tokens whose KV the context holds (vLLM's
        ``num_computed_tokens``); blocks pair by token position from the start of the request
        (:mod:`api.geometry.align`), and both sides must give the same value. Required with a
        block-size ratio (a partial last block then moves only its tokens) and with CP over
        layer groups of different lengths; ``ambiguous_alignment`` otherwise.
        ``timeout_s``: the handle fails when not released by then; ``mode``: ``staged``,
        ``fragments`` or ``auto`` (per route: fragments when the route's fragments average at
        least ``AUTO_FRAGMENT_BYTES``, else staged; both sides resolve it alike from the same
        plan); ``verify``: crc32 of every route's bytes on both sides
        (recorded); ``context``: the caller's extras, kept on ``handle.context``. Raises
        :class:`HandoverError` (a ``code`` says why) when it cannot start.
        """
        return self._start("send", request_id, peer, blocks, context_dp_rank,
                           generation_dp_rank, timeout_s, mode, verify, context, num_tokens)

    def expect(self, request_id: str, peer: str, blocks: BlockMap, *,
               context_dp_rank: int | None = None, generation_dp_rank: int | None = None,
               timeout_s: float | None = None, mode: str = "auto", verify: bool = False,
               context: Mapping[str, Any] | None = None,
               num_tokens: int | None = None, ask: bool = False) -> Handle:
        """Start receiving this rank's share of ``request_id`` from context instance ``peer``
        (same options as :meth:`send`; the handle becomes ``arrived``). ``ask``: the context
        side has not called ``send``; ask each writer to (see :class:`Ask`)."""
        return self._start("receive", request_id, peer, blocks, context_dp_rank,
                           generation_dp_rank, timeout_s, mode, verify, context, num_tokens,
                           ask)

    def refuse(self, ask: Ask, reason: str) -> None:
        """Answer ``ask`` with an abort: the receiver's handle fails at once with ``reason``."""
        ce, ge = ask.epochs
        self._asked[ask.request_id] = time.monotonic()
        try:
            self.transport.send_notif(ask.agent, _msg(
                "X", ask.request_id, ce, ge, ask.route[0], ask.route[1],
                reason[:200].replace("|", "/")))
        except Exception as error:  # the asking rank is gone: its deadline covers it
            log.debug("refusal to %s failed: %s", ask.agent, error)

    def get_finished(self) -> Finished:
        """Request ids whose handles resolved since the last call (connector-style poll)."""
        sent, received, failed = set(), set(), {}
        while self._finished:
            handle = self._finished.popleft()
            if handle.state == FAILED:
                failed[handle.request_id] = str(handle.reason)
            elif handle.side == "send":
                sent.add(handle.request_id)
            else:
                received.add(handle.request_id)
        return Finished(frozenset(sent), frozenset(received), failed)

    def set_directory(self, directory: Directory) -> None:
        """Swap in a refreshed directory (applied on the progress thread)."""
        self._call(lambda: self._apply_directory(directory))

    def close(self, reason: str = "the worker stopped") -> None:
        """Fail every pending handle with ``reason`` and stop the progress thread."""
        if self._closed:
            return
        done = threading.Event()

        def shutdown() -> None:
            for op in list(self._ops.values()):
                self._fail(op, reason)
            self._closed = True
            done.set()

        self._call(shutdown)
        if not done.wait(5.0):
            self._closed = True
        self._thread.join(timeout=5.0)

    @property
    def pending(self) -> int:
        return len(self._ops)

    def peer(self, instance: str, rank: int) -> PeerWorker | None:
        """The worker of ``instance`` rank ``rank`` this rank would talk to now."""
        return self._peers.get((instance, rank))

    # --- starting a handle (caller's thread: validation only) --------------------------------

    def _start(self, side: str, request_id: str, peer: str, blocks: BlockMap,
               context_dp_rank: int | None, generation_dp_rank: int | None,
               timeout_s: float | None, mode: str, verify: bool,
               context: Mapping[str, Any] | None, num_tokens: int | None = None,
               ask: bool = False) -> Handle:
        if self._closed:
            raise HandoverError("this worker's handover is closed", code="closed")
        if not isinstance(request_id, str) or not _ID.match(request_id):
            raise HandoverError(
                f"request id {request_id!r}: 1-200 characters of letters, digits and ._:@/+=-",
                code="invalid_request_id")
        if mode not in MODES:
            raise HandoverError(f"mode {mode!r}: auto, staged or fragments",
                                code="invalid_mode")
        directory = self.directory
        role = "context" if side == "send" else "generation"
        if directory.role and directory.role != role:
            raise HandoverError(f"{self.instance} is a {directory.role} instance: it can only "
                                f"{'send' if directory.role == 'context' else 'expect'}",
                                code="wrong_role")
        entry = directory.plan(peer, context_dp_rank, generation_dp_rank)
        timeout = self.default_timeout_s if timeout_s is None else float(timeout_s)
        if not 0 < timeout <= 3600:
            raise HandoverError(f"timeout_s {timeout}: between 0 and 3600", code="invalid_timeout")
        if num_tokens is not None and (type(num_tokens) is not int or num_tokens < 1):
            raise HandoverError(f"num_tokens {num_tokens!r}: an integer ≥ 1",
                                code="invalid_blocks")
        pairs = normalize_blocks(blocks)
        handle = Handle(request_id, side, peer, entry, timeout)
        handle.context.update(context or {})
        handle.context.update(blocks=blocks_of(pairs), verify=verify, num_tokens=num_tokens)
        now = time.monotonic()
        op = _Op(handle, request_id, side, peer, mode, verify, now + timeout,
                 hold_until=now + self.hold_s, ask=ask and side == "receive",
                 dp=(context_dp_rank, generation_dp_rank))
        for route, route_dict in zip(entry.routes, entry.route_dicts, strict=True):
            mine = route.sender_rank if side == "send" else route.receiver_rank
            if mine != self.rank:
                continue
            missing = [g for g in route.layer_groups if g not in pairs]
            if missing:
                raise HandoverError(f"no block lists for layer group(s) {missing}",
                                    code="invalid_blocks")
            route_mode = route_mode_of(route) if mode == "auto" else mode  # the plan's route
            try:  # a ratio: the route as this request runs it (see align_request)
                route, src, dst = align_request(route, pairs, num_tokens)
            except BlockRangeError as error:  # e.g. two slot ids for a per-request state group
                raise HandoverError(str(error), code=error.code) from None
            layout = staging_layout(route, src)
            if route_mode == "staged" and layout.nbytes > self.areas.nbytes:
                raise HandoverError(
                    f"route {route.sender_rank}->{route.receiver_rank} needs {layout.nbytes} "
                    f"staging bytes; this worker's buffer holds {self.areas.nbytes} (use a "
                    "larger --staging-mib or mode=fragments)", code="staging_too_small")
            op.routes.append(_RouteState(
                op, route, route_dict, route.sender_rank, route.receiver_rank, src, dst, layout,
                peer_rank=route.receiver_rank if side == "send" else route.sender_rank,
                mode=route_mode))
        modes = {state.mode for state in op.routes}
        handle.context["mode"] = modes.pop() if len(modes) == 1 else mode
        self._validate_ids(op)
        if self.on_start is not None:
            self.on_start(handle)
        # Begin on the caller's thread: its grant (or, after an early grant, its WRITEs) leaves
        # now rather than when the progress thread next wakes.
        with self._mutex:
            self._begin(op)
        self._wake.set()
        if self._closed and not self._thread.is_alive():  # raced close(): nobody will run it
            handle._resolve(FAILED, "the worker stopped")
        return handle

    def _validate_ids(self, op: _Op) -> None:
        """Block ids against this rank's pools, before anything is granted or written."""
        pools = self.transport.pools
        checked: set[tuple[int, int]] = set()  # (id of an id array, pool size): checked once
        for state in op.routes:
            ids = state.src if op.side == "send" else state.dst
            for seg in state.route.segments:
                pool_id = seg.src_pool if op.side == "send" else seg.dst_pool
                pool = pools.get(pool_id)
                if pool is None:
                    raise HandoverError(f"pool {pool_id} is not on rank {self.rank}",
                                        code="invalid_blocks")
                arr = ids[seg.layer_group]
                num_slots = pool.spec.num_slots
                if (id(arr), num_slots) in checked:  # views of one layer group share their ids
                    continue
                checked.add((id(arr), num_slots))
                values = arr.ravel().tolist()  # a request's few ids: faster as Python ints
                if values and (min(values) < 0 or max(values) >= num_slots):
                    raise HandoverError(
                        f"layer group {seg.layer_group}: block ids must be in [0, "
                        f"{num_slots}) on rank {self.rank}", code="invalid_blocks")
                if op.side == "receive" and len(set(values)) != len(values):
                    raise HandoverError(f"layer group {seg.layer_group}: duplicate destination "
                                        "block ids", code="invalid_blocks")

    # --- progress thread ---------------------------------------------------------------------

    def _call(self, fn: Callable[[], None]) -> None:
        self._inbox.append(fn)
        self._wake.set()

    def _loop(self) -> None:
        quiet = 0  # polls in a row that moved nothing
        try:
            while not self._closed:
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
                    time.sleep(BUSY_SLEEP_S if quiet < BUSY_POLLS else PATIENT_SLEEP_S)
                else:
                    self._wake.wait(IDLE_WAIT_S)  # cleared (and counted) at the loop's top
        finally:
            # Whatever was started but not finished when the loop ends fails, never hangs.
            self._closed = True
            while self._inbox:
                with contextlib.suppress(Exception):
                    self._inbox.popleft()()
            for op in list(self._ops.values()):
                with contextlib.suppress(Exception):
                    self._fail(op, "the worker stopped", notify=False)

    def _step(self) -> tuple[bool, bool]:
        """One poll: ``(handles pending, something moved)``."""
        progressed = bool(self._inbox)
        while self._inbox:
            self._inbox.popleft()()
        if self._closed:
            return False, progressed
        finished = len(self._finished)
        progressed = self._drain() or progressed
        now = time.monotonic()
        for state in list(self._send.values()):
            if state.pending and not state.done:
                self._poll_writes(state)
        if self._waiting:
            self._retry_waiting()
        if self._recv and now > self._next_resend:
            self._next_resend = now + GRANT_RESEND_S / 4
            self._resend_grants(now)
        for op in list(self._ops.values()):
            if now > op.deadline:
                self._fail(op, self._deadline_reason(op))
        self.areas.reclaim(now)
        if self._early:
            self._expire_early(now)
        return bool(self._ops), progressed or len(self._finished) != finished

    def _drain(self) -> bool:
        """Handle every notification that arrived; whether there were any."""
        notifications = self.transport.drain_notifications()
        for agent, msgs in notifications.items():
            for msg in msgs:
                try:
                    self._on_notification(agent, msg)
                except Exception:  # one bad message must not drop the rest of the batch
                    log.exception("notification %r from %s failed", msg[:80], agent)
        return bool(notifications)

    def _begin(self, op: _Op) -> None:
        self._ops[id(op)] = op
        if self._closed:
            self._fail(op, "the worker stopped", notify=False)
            return
        if not op.routes:  # this rank takes no part (e.g. another DP rank's request)
            self._complete(op)
            return
        index = self._send if op.side == "send" else self._recv
        if any(state.key in index for state in op.routes):
            self._fail(op, f"request {op.xid!r} is already in flight on rank {self.rank}",
                       notify=False)
            return
        for state in op.routes:
            if not state.layout.nbytes and state.mode == "staged":
                state.done = True
                continue
            index[state.key] = state
            self._waiting.append(state)
        self._retry_waiting()
        if op.side == "send":
            # A grant that already came in but waits in NIXL: take it now, and write on the
            # caller's thread instead of when the progress thread next polls.
            self._drain()
        for state in op.routes:
            early = self._early.pop(state.key, None)
            if early is not None and not op.handle.done:
                self._on_message(early[0], early[1], state, received_at=early[2])
        self._maybe_complete(op)

    def _retry_waiting(self) -> None:
        """Routes waiting for their peer's endpoint or for staging space."""
        still = []
        for state in self._waiting:
            op = state.op
            if op.handle.done:
                continue
            try:
                if self._advance(state):
                    still.append(state)
            except PeerUnreachable as error:
                self._on_unreachable(str(state.agent), error)
            except Exception as error:  # e.g. the peer vanished between two chunks
                self._fail(op, f"{type(error).__name__}: {error}")
        self._waiting = [s for s in still if not s.op.handle.done]

    def _advance(self, state: _RouteState) -> bool:
        """One waiting route's next step; True while it still waits."""
        op = state.op
        if state.agent is None:
            peer = self._peers.get((op.peer, state.peer_rank))
            if peer is None or not self._load_peer(peer):
                return True
            if peer.epoch != self._peer_epoch(op):
                self._fail(op, f"peer_restarted: {op.peer} re-registered since the plan this "
                               "request uses")
                return False
            state.agent = peer.agent
        if time.monotonic() < op.hold_until:
            return True
        if op.side == "receive" and not state.granted:
            if op.ask:
                self._send_ask(state)
            return not self._grant(state)
        if op.side == "send" and state.grant is not None and not state.written:
            if state.grant[0] != state.agent:
                self._fail(op, f"peer_restarted: the grant came from a worker of {op.peer} "
                               f"rank {state.peer_rank} that is not the current one")
                return False
            return not self._write(state)
        return False

    def _peer_epoch(self, op: _Op) -> str:
        entry = op.handle.entry
        return entry.generation_epoch if op.side == "send" else entry.context_epoch

    def _load_peer(self, peer: PeerWorker) -> bool:
        if peer.agent in self._loaded and self.transport.has_peer(peer.agent):
            return True
        try:
            self.transport.add_peer(peer.info)
        except TransportError as error:
            log.warning("cannot load peer %s rank %d: %s", peer.instance, peer.rank, error)
            return False
        self._loaded.add(peer.agent)
        return True

    # --- receiver ----------------------------------------------------------------------------

    def _grant(self, state: _RouteState) -> bool:
        op = state.op
        ttl_ms = max(1, int((op.deadline - time.monotonic()) * 1000))
        if state.mode == "fragments":
            offset = -1
        else:
            area = self.areas.alloc(state.layout.nbytes)
            if area is None:
                return False
            state.area = area
            offset = area
            state.chunk_blocks = self.chunk_blocks
            state.chunks = dict(enumerate(c for c in state.layout.chunks(self.chunk_blocks)
                                          if c.nbytes))
        state.granted = True
        self._send_grant(state, offset, ttl_ms)
        return True

    def _send_grant(self, state: _RouteState, offset: int, ttl_ms: int,
                    again: bool = False) -> None:
        op = state.op
        ce, ge = op.handle.entry.epochs()
        state.heard_at = time.monotonic()
        assert state.agent is not None
        try:
            reconnected = self.transport.send_notif(state.agent, _msg(
                "G", op.xid, ce, ge, state.sender_rank, state.receiver_rank, offset,
                state.layout.nbytes, state.chunk_blocks, ttl_ms))
        except TransportError as error:
            self._fail(op, f"peer_unreachable: cannot reach {op.peer} rank {state.peer_rank}: "
                           f"{error}", notify=False)
            return
        if again and reconnected:  # the connection this route waited on had failed
            self._on_unreachable(state.agent, PeerUnreachable(
                "the connection failed while this rank waited for its bytes"), reload=False)

    def _send_ask(self, state: _RouteState) -> None:
        """Ask the writer of ``state`` to send (before the grant, so both land together)."""
        op = state.op
        ce, ge = op.handle.entry.epochs()
        payload = json.dumps({
            "q": op.handle.request_id, "b": op.handle.context["blocks"],
            "cdp": op.dp[0], "gdp": op.dp[1], "m": op.mode, "v": op.verify,
            "n": op.handle.context.get("num_tokens"),
            "t": round(max(0.001, op.deadline - time.monotonic()), 3)},
            separators=(",", ":"))
        assert state.agent is not None
        try:
            self.transport.send_notif(state.agent, _msg(
                "A", op.xid, ce, ge, state.sender_rank, state.receiver_rank, payload))
        except TransportError as error:  # the grant right after it fails the route
            log.debug("ask to %s failed: %s", state.agent, error)

    def _on_ask(self, agent: str, fields: list[str]) -> None:
        """A generation rank asks this rank to send (see :class:`Ask`)."""
        xid = fields[1]
        if self.on_ask is None or self.directory.role == "generation" or xid in self._asked:
            return
        if any(key[0] == xid for key in self._send):
            return  # already sending: the ask of another receiving rank of the same request
        peer = self._agents.get(agent)
        if peer is None:  # not a worker of a paired instance (yet): the ask comes again
            log.debug("ask for %s from unknown agent %s", xid, agent)
            if self.on_unknown_agent is not None:
                self.on_unknown_agent(agent)
            return
        try:
            body = json.loads("|".join(fields[6:]))
            ask = Ask(agent=agent, peer=peer.instance, peer_rank=peer.rank,
                      request_id=str(body["q"]), blocks=dict(body["b"]),
                      context_dp_rank=body.get("cdp"), generation_dp_rank=body.get("gdp"),
                      timeout_s=float(body["t"]), mode=str(body.get("m", "auto")),
                      verify=bool(body.get("v", False)), epochs=(fields[2], fields[3]),
                      route=(int(fields[4]), int(fields[5])),
                      num_tokens=None if body.get("n") is None else int(body["n"]))
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

    def _resend_grants(self, now: float) -> None:
        """Granted routes that heard nothing for a while send their grant again: a grant lost on
        a connection that failed while idle gets through, and a failed one shows."""
        for state in list(self._recv.values()):
            if (state.granted and not state.done and not state.op.handle.done
                    and now - state.heard_at > GRANT_RESEND_S):
                offset = -1 if state.mode == "fragments" else int(state.area or 0)
                if state.op.ask:
                    self._send_ask(state)
                self._send_grant(state, offset, max(1, int((state.op.deadline - now) * 1000)),
                                 again=True)

    def _on_chunk(self, state: _RouteState, i: int, n: int) -> None:
        chunk = state.chunks.pop(i, None)
        if chunk is None:  # a duplicate or a chunk of another chunking: not ours
            return
        state.heard_at = time.monotonic()
        assert state.area is not None
        scatter(state.route, self.transport.staging, self.transport.pools, state.dst,
                offset=state.area, chunk=chunk)
        if not state.chunks:
            self._route_received(state)

    def _route_received(self, state: _RouteState) -> None:
        op = state.op
        staging = self.transport.staging
        if state.area is not None:
            if staging.device.type == "cuda":
                import torch

                torch.cuda.current_stream(staging.device).synchronize()
            if op.verify:
                area = staging[state.area:state.area + state.layout.nbytes]
                state.checksum = zlib.crc32(area.detach().cpu().numpy().tobytes()) & 0xFFFFFFFF
            self.areas.free(state.area, state.layout.nbytes)
            state.area = None
        state.done = True
        if self._recv.get(state.key) is state:
            del self._recv[state.key]
        self._maybe_complete(op)

    def _on_fragments_done(self, state: _RouteState) -> None:
        op = state.op
        if op.verify:
            info = self.transport.peer_info_of(str(state.agent))
            src_specs = {pid: p.spec for pid, p in info.pools.items()}
            fragments = expand_fragments(state.route, src_specs, self.transport.pools,
                                         state.src, state.dst)
            state.checksum = fragments_crc32(self.transport.pools, fragments, side="dst")
        state.done = True
        if self._recv.get(state.key) is state:
            del self._recv[state.key]
        self._maybe_complete(op)

    # --- sender ------------------------------------------------------------------------------

    def _on_grant(self, state: _RouteState, agent: str, fields: list[str],
                  received_at: float | None = None) -> None:
        op = state.op
        offset, nbytes, chunk_blocks, ttl_ms = (int(x) for x in fields[6:10])
        received = time.monotonic() if received_at is None else received_at
        if nbytes != state.layout.nbytes:
            self._fail(op, f"plan mismatch: receiver rank {state.receiver_rank} expects "
                           f"{nbytes} bytes of this route, this rank would send "
                           f"{state.layout.nbytes} (different block lists?)")
            return
        state.grant = (agent, offset, nbytes, chunk_blocks, received + ttl_ms / 1000)
        # Before the directory names the receiver's worker, the route waits in _waiting.
        if state.agent == agent and (time.monotonic() < op.hold_until or
                                     not self._write(state)):
            self._waiting.append(state)

    def _write(self, state: _RouteState) -> bool:
        """Gather and post this route's WRITEs; False while local staging has no room."""
        op = state.op
        assert state.grant is not None
        agent, offset, nbytes, chunk_blocks, write_by = state.grant
        if state.written:
            return True
        if time.monotonic() > write_by:
            self._fail(op, f"the grant of receiver rank {state.receiver_rank} expired before "
                           "this rank could write")
            return True
        ce, ge = op.handle.entry.epochs()
        tp = self.transport
        if offset < 0:  # fragments: one descriptor per fragment, straight into the pools
            notif = _msg("F", op.xid, ce, ge, state.sender_rank, state.receiver_rank, nbytes)
            if op.verify:
                frags = expand_fragments(state.route, tp.pools, tp.peer_info_of(agent).pools,
                                         state.src, state.dst)
                state.checksum = fragments_crc32(tp.pools, frags, side="src")
            state.written = True
            pending = tp.post_fragments(agent, state.route, state.src, state.dst, notif,
                                        f"fragments to rank {state.receiver_rank}", nbytes)
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
            if op.verify:
                piece = tp.staging[area + chunk.offset:area + chunk.offset + chunk.nbytes]
                crc = zlib.crc32(piece.detach().cpu().numpy().tobytes(), crc)
            remote = tp.desc(np.array([info.staging_address + offset + chunk.offset]),
                             np.array([chunk.nbytes]), info.device_id)
            state.pending.append(tp.post_write(
                agent, tp.local_staging_desc(area + chunk.offset, chunk.nbytes), remote,
                _msg("C", op.xid, ce, ge, state.sender_rank, state.receiver_rank, i, len(chunks)),
                f"chunk {i}/{len(chunks)} to rank {state.receiver_rank}"))
        if op.verify:
            state.checksum = crc & 0xFFFFFFFF
        return True

    def _poll_writes(self, state: _RouteState) -> None:
        try:
            if all([self.transport.poll(p) for p in state.pending]):
                state.pending.clear()
                self._route_sent(state)
        except PeerUnreachable as error:
            self._on_unreachable(str(state.agent), error)
        except TransportError as error:
            self._fail(state.op, f"transport: {error}")

    def _on_unreachable(self, agent: str, error: Exception, reload: bool = True) -> None:
        """The connection to ``agent`` failed: every handle using it fails (``peer_unreachable``),
        the peer is loaded again, and the aborts go over the new connection."""
        victims: list[tuple[_Op, str]] = []
        for op in list(self._ops.values()):
            lost = next((s for s in op.routes if s.agent == agent and not s.done), None)
            if lost is not None and not op.handle.done:
                reason = (f"peer_unreachable: the connection to {op.peer} rank {lost.peer_rank} "
                          f"failed: {error}")
                self._fail(op, reason, notify=False)
                victims.append((op, reason))
        if reload and agent in self._loaded and not self.transport.reset_peer(agent):
            self._loaded.discard(agent)  # loaded again when a route needs it
        for op, reason in victims:
            for state in op.routes:
                if not state.done:
                    self._abort_notice(op, state, reason)

    def _probe(self, agent: str, fields: list[str]) -> None:
        """A grant again for a route this rank wrote: were its bytes lost with a connection?"""
        if agent not in self._loaded:
            return
        head = fields[1:6]
        try:
            if self.transport.send_notif(agent, _msg("P", *head)):  # had to reconnect
                self.transport.send_notif(agent, _msg(
                    "X", *head, "peer_unreachable: the connection failed after this rank's "
                    "WRITE completed; its bytes were lost with it"))
        except TransportError as error:
            log.debug("probe of %s failed: %s", agent, error)

    def _route_sent(self, state: _RouteState) -> None:
        if state.area is not None:
            self.areas.free(state.area, state.layout.nbytes)
            state.area = None
        state.done = True
        if self._send.get(state.key) is state:
            del self._send[state.key]
        if state.agent is not None:
            self._written[state.key] = state.agent
            if len(self._written) > 4096:
                del self._written[next(iter(self._written))]
        self._maybe_complete(state.op)

    # --- notifications -----------------------------------------------------------------------

    def _on_notification(self, agent: str, msg: bytes) -> None:
        try:
            fields = msg.decode("ascii").split("|")
            kind = fields[0]
            key = (fields[1], int(fields[4]), int(fields[5]))
        except (UnicodeDecodeError, IndexError, ValueError):
            return  # not ours (or mangled): nothing waits for it
        if kind == "A":
            self._on_ask(agent, fields)
            return
        index = self._send if kind == "G" or (kind == "X" and
                                              self.directory.role == "context") else self._recv
        state = index.get(key)
        if state is None:
            if kind == "G" and self._written.get(key) == agent:
                self._probe(agent, fields)
                return
            if kind == "X" or (kind == "G" and self.directory.role == "context"):
                # send()/expect() not called yet: a grant, or an abort, waits for it
                self._early[key] = (agent, fields, time.monotonic())
            return
        self._on_message(agent, fields, state)

    def _on_message(self, agent: str, fields: list[str], state: _RouteState,
                    received_at: float | None = None) -> None:
        op = state.op
        if op.handle.done:
            return
        kind = fields[0]
        if state.agent is not None and agent != state.agent:
            owner = self._retired.get(agent) or self._agents.get(agent)
            who = f"{op.peer} rank {state.peer_rank}"
            if owner is not None:
                self._fail(op, f"peer_restarted: a message from {who}'s previous worker")
            return  # a stranger's message: drop it
        if (fields[2], fields[3]) != op.handle.entry.epochs():
            self._fail(op, f"peer_restarted: {op.peer} planned with other epochs "
                           f"({fields[2][:8]}/{fields[3][:8]})", notify=True)
            return
        try:
            if kind == "X":
                told = "|".join(fields[6:])
                cause = "peer_unreachable: " if told.startswith("peer_unreachable") else ""
                self._fail(op, f"{cause}peer {op.peer} rank {state.peer_rank} aborted: {told}",
                           notify=False)
            elif kind == "G" and op.side == "send" and state.grant is None:
                self._on_grant(state, agent, fields, received_at)
            elif kind == "C" and op.side == "receive":
                self._on_chunk(state, int(fields[6]), int(fields[7]))
            elif kind == "F" and op.side == "receive":
                self._on_fragments_done(state)
        except Exception as error:  # bad blocks, NIXL errors, a malformed message: fail it
            self._fail(op, f"{type(error).__name__}: {error}")

    # --- outcomes ----------------------------------------------------------------------------

    def _maybe_complete(self, op: _Op) -> None:
        if not op.handle.done and all(state.done for state in op.routes):
            self._complete(op)

    def _complete(self, op: _Op) -> None:
        handle = op.handle
        handle.bytes = sum(state.layout.nbytes for state in op.routes)
        handle.routes = self._route_results(op)
        if self.check is not None and op.side == "receive" and op.routes:
            reason = self.check(handle)
            if reason is not None:
                self._ops.pop(id(op), None)
                self.stats["failed"] += 1
                self._resolve(handle, FAILED, reason)
                return
        self._ops.pop(id(op), None)
        self.stats["sent" if op.side == "send" else "received"] += 1
        self.stats["bytes"] += handle.bytes
        self._resolve(handle, RELEASED if op.side == "send" else ARRIVED, None)

    def _route_results(self, op: _Op) -> list[dict[str, Any]]:
        return [{"sender_rank": s.sender_rank, "receiver_rank": s.receiver_rank,
                 "bytes": s.layout.nbytes if s.done else 0, "checksum": s.checksum}
                for s in op.routes]

    def _fail(self, op: _Op, reason: str, notify: bool = True) -> None:
        if op.handle.done:
            return
        now = time.monotonic()
        ce, ge = op.handle.entry.epochs()
        if op.side == "receive" and any(state.mode == "fragments" and state.granted
                                        and not state.done for state in op.routes):
            # A writer with our grant writes straight into the blocks: they stay out of use for
            # as long as its grant lives (it never starts a WRITE later), plus the margin.
            op.handle._quiet_s = max(0.0, op.deadline - now) + QUARANTINE_MARGIN_S
        for state in op.routes:
            if state.done:
                continue
            index = self._send if op.side == "send" else self._recv
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
        op.handle.routes = self._route_results(op)
        self._ops.pop(id(op), None)
        self.stats["failed"] += 1
        log.warning("%s %s failed: %s", op.side, op.xid, reason)
        self._resolve(op.handle, FAILED, reason)

    def _abort_notice(self, op: _Op, state: _RouteState, reason: str) -> None:
        """Tell the other side of ``state`` that ``op`` failed here (best effort)."""
        if state.agent is None or state.agent not in self._loaded:
            return
        ce, ge = op.handle.entry.epochs()
        try:
            self.transport.send_notif(state.agent, _msg(
                "X", op.xid, ce, ge, state.sender_rank, state.receiver_rank,
                reason[:200].replace("|", "/")))
        except Exception as error:  # the peer may be gone: its deadline covers it
            log.debug("abort notification to %s failed: %s", state.agent, error)

    def _resolve(self, handle: Handle, state: str, reason: str | None) -> None:
        if handle._resolve(state, reason):
            self._finished.append(handle)
            if len(self._finished) > 100_000:  # nobody polls get_finished: stay bounded
                self._finished.popleft()
            if self.on_finished is not None:
                try:
                    self.on_finished(handle)
                except Exception:
                    log.exception("on_finished hook failed for %s", handle.request_id)

    def _deadline_reason(self, op: _Op) -> str:
        waiting = [s for s in op.routes if not s.done]
        parts = []
        for s in waiting[:3]:
            if s.agent is None:
                parts.append(f"no worker of {op.peer} rank {s.peer_rank} in the directory")
            elif op.side == "send" and s.grant is None:
                parts.append(f"no grant from {op.peer} rank {s.peer_rank} (did it expect()?)")
            elif op.side == "send":
                parts.append(f"WRITEs to {op.peer} rank {s.peer_rank} still in flight")
            elif not s.granted:
                parts.append("no staging space")
            else:
                parts.append(f"{op.peer} rank {s.peer_rank} did not write "
                             f"({len(s.chunks)} chunk(s) missing)")
        return f"deadline: {op.handle.timeout_s:g} s passed; " + "; ".join(parts)

    def _expire_early(self, now: float) -> None:
        self._early = {k: v for k, v in self._early.items() if now - v[2] < EARLY_TTL_S}

    # --- directory ---------------------------------------------------------------------------

    def _apply_directory(self, directory: Directory) -> None:
        """Swap in a refreshed directory.

        A peer worker is retired only when its rank has another worker now or its instance
        has another epoch. A rank that is merely missing (the control plane is slow, its
        heartbeats lag) keeps its last known worker: the hot path does not depend on the control
        plane's view of liveness, only on NIXL and on deadlines.
        """
        self.directory = directory
        peers = dict(directory.peers)
        for key, peer in self._peers.items():
            if key in peers:
                continue
            epoch = directory.peer_epochs.get(peer.instance)
            if epoch is None or epoch == peer.epoch:  # still that epoch, or not paired now
                peers[key] = peer
        retired = {p.agent for p in self._peers.values()} - {p.agent for p in peers.values()}
        for agent in retired:
            self._retired[agent] = self._agents[agent]
            if agent in self._loaded:
                self._loaded.discard(agent)
                try:
                    self.transport.remove_peer(agent)
                except TransportError as error:
                    log.debug("dropping peer %s: %s", agent, error)
        self._peers = peers
        self._agents = {peer.agent: peer for peer in peers.values()}
        if len(self._retired) > 4096:
            self._retired = dict(list(self._retired.items())[-1024:])
        for op in list(self._ops.values()):
            current = directory.peer_epochs.get(op.peer)
            if current is not None and current != self._peer_epoch(op):
                self._fail(op, f"peer_restarted: {op.peer} re-registered (new epoch)")
                continue
            for state in op.routes:
                if state.agent is not None and state.agent in retired and not state.done:
                    self._fail(op, f"peer_restarted: the worker of {op.peer} rank "
                                   f"{state.peer_rank} was replaced")
                    break


def blocks_of(pairs: Mapping[int, tuple[Any, Any]]) -> dict[str, Any]:
    """The REST form of a block map (``{"0": {"context": [...], "generation": [...]}}``);
    per-CP-rank lists stay lists of lists."""
    def side(ids: Iterable[Any]) -> list[Any]:
        return [side(x) if isinstance(x, (list, tuple)) else int(x) for x in ids]

    return {str(g): {"context": side(c), "generation": side(r)} for g, (c, r) in pairs.items()}


__all__ = ["ARRIVED", "FAILED", "PENDING", "RELEASED", "Finished", "Handle", "Handover",
           "HandoverError", "StagingAreas", "blocks_of", "normalize_blocks"]
