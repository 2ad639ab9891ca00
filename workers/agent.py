"""The worker: serves one rank, keeps its directory current, runs the hot path, records results.

Lifecycle of a :class:`Worker` (embedded in an engine, or as ``kvplane worker``):

1. **attach** (slow path): read the rank's registered page table, allocate its pools
   (``device``) or wrap the tensors an embedding engine hands over (``tensors``), open a NIXL
   agent with the pools and a staging buffer registered, and ``POST /v1/workers`` its endpoint
   (agent metadata, pool base addresses, staging buffer). The metadata travels through the
   control plane, never a side channel.
2. **start**: fetch the worker's *directory* (``workers/directory.py``) and start four threads:
   the handover's progress loop (``workers/handover/``, the hot path), the heartbeat (its
   answer's ``directory_revision`` triggers a refetch, so a re-registration or a restarted peer
   reaches the worker within one heartbeat interval; ``409 worker_stale`` re-attaches; it also
   carries what UCX uses for the endpoint's peer connections, ``ucx_in_use``), the
   command stream (REST ``execute=true`` pushes commands here, which run through the same
   handover as the engine's own calls) and the recorder (``workers/records.py``, batched).
   Commands arrive *at least once* (an API process that dies, or a stream that moves to another
   process, makes the control plane send again what this rank has not recorded): a command
   whose ``xid`` and side this worker has already seen is dropped.
3. **per request**: :meth:`Worker.send` / :meth:`Worker.expect` (engine path) or a pushed command
   (REST path) → a :class:`~workers.handover.Handle`. No database, no control-plane round trip.
4. **stop**: fail what is still pending, flush the record (bounded), deregister, close NIXL.

The hot path keeps working while the control plane is down: the directory is cached, NIXL
connects the workers directly, and records wait in the recorder until it returns. Given several
control-plane URLs (``KVPLANE_URL=http://cp-a:8000,http://cp-b:8000``), the client moves the
heartbeat, directory, records and command stream to the next API process when one dies.

A worker started with ``fill`` fills its pools with the (rank, pool, byte) pattern and checks
every transfer it receives with ``verify`` against it (``workers/fillcheck.py``).

Depends only on the wire schemas, the HTTP client and torch/NIXL: never on FastAPI or SQLAlchemy.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from api.client import (
    ApiError,
    BadRequestError,
    Client,
    ConflictError,
    NotFoundError,
    StreamUnsupported,
    TransferCommand,
    WorkerStream,
)
from workers.directory import Directory, HandoverError
from workers.fillcheck import FillCheck
from workers.fillcheck import VerificationError as VerificationError  # its old home
from workers.handover import CHUNK_BLOCKS, FAILED, Ask, BlockMap, Finished, Handle, Handover
from workers.pools import Pool, PoolSpec, allocate_pools, attach_pools
from workers.records import Recorder

if TYPE_CHECKING:
    import torch

    from workers.directory import PeerWorker
    from workers.handover.handles import RouteState
    from workers.transport.nixl import NixlTransport

log = logging.getLogger("kvplane.worker")

DEFAULT_STAGING_BYTES = 256 << 20
OUTAGE_BACKOFF_S = 2.0
FAILOVER_DELAY_S = 0.05  # a stream that failed on one API process reconnects to the next at once
STREAM_READ_TIMEOUT_S = 30.0  # the control plane sends a keep-alive every 10 s
SEEN_COMMANDS = 65_536  # command ids remembered to drop a re-sent command


class WorkerError(RuntimeError):
    """The worker cannot serve its rank (e.g. the rank has not reported its page table)."""


class CommandRefused(WorkerError):
    """A REST-pushed transfer reached a worker that takes none (``accept_commands=False``)."""

    def __init__(self, instance: str) -> None:
        super().__init__(
            f"{instance}'s workers are embedded in a serving engine and take no REST-pushed "
            "transfers: only the engine hands out its KV blocks"
        )


@dataclass
class WorkerStats:
    sent: int = 0
    received: int = 0
    failed: int = 0
    bytes_moved: int = 0
    verified_bytes: int = 0
    errors: list[str] = field(default_factory=list)


class Worker:
    """One rank's worker: :meth:`attach`, :meth:`start`, then ``send``/``expect`` (an engine)
    or :meth:`serve` (``kvplane worker``)."""

    def __init__(
        self,
        client: Client,
        instance: str,
        rank: int,
        *,
        device: str = "cpu",
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        fill: bool = False,
        chunk_blocks: int | None = None,
        ucx_tls: str | None = None,
        ucx_net_devices: str | None = None,
        record_releases: bool = False,
        on_ask: Callable[[Ask], None] | None = None,
        on_release: Callable[[str, str], None] | None = None,
        accept_commands: bool = True,
    ) -> None:
        self.client = client
        self.instance = instance
        self.rank = rank
        self.device = device
        self.staging_bytes = staging_bytes
        self.fill = fill
        self.chunk_blocks = chunk_blocks
        # UCX transports / devices of the NIXL endpoint (None: the process's UCX_TLS and
        # UCX_NET_DEVICES, else UCX's defaults); see workers/transport/nixl.py.
        self.ucx_tls = ucx_tls
        self.ucx_net_devices = ucx_net_devices
        # Engine path: also record the sends that succeeded without verify (see _recorded).
        self.record_releases = record_releases
        # Context side: answers generation ranks' asks (expect(..., ask=True)); see Ask.
        self.on_ask = on_ask
        # Context side: a generation rank will not ask for a request (Handover.release).
        self.on_release = on_release
        # False: REST-pushed transfer commands are refused and recorded as failed (a worker
        # embedded in a serving engine, whose blocks only the engine may hand out).
        self.accept_commands = accept_commands
        self.pools: dict[int, Pool] = {}
        self.transport: NixlTransport | None = None
        self.handover: Handover | None = None
        self.directory: Directory = Directory.empty(instance, rank)
        self.worker_id: str | None = None
        self.heartbeat_interval_s = 1.0
        # The two-way stream carries pushed commands and their urgent records: a worker that
        # takes no pushed transfers (embedded in a serving engine) keeps the plain command
        # stream and posts its batched records, as it always has.
        self._two_way = accept_commands  # then: until the control plane turns out to have none
        self._stream: WorkerStream | None = None  # open while the command loop reads it
        self.stats = WorkerStats()
        self.recorder: Recorder | None = None
        self._listeners: list[Callable[[Handle], None]] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._attach_lock = threading.RLock()
        self._tensors: Mapping[int, torch.Tensor] | None = None
        # Fill mode: the pattern's checks (its pools handed over at each attach).
        self.fillcheck = FillCheck(rank, self.stats, self._peer)
        self._seen: OrderedDict[tuple[str, str], None] = OrderedDict()  # (xid, side) run here
        self._seen_lock = threading.Lock()
        self.duplicate_commands = 0
        self._refreshing = threading.Event()
        self._refreshed_at = 0.0
        self.superseded = False  # another worker attached to this rank; this one stopped
        # Fault injection for tests and chaos drills (see Handover.hold_s).
        self.hold_s = float(os.environ.get("KVPLANE_WORKER_HOLD_S", 0))

    # --- attach --------------------------------------------------------------------------

    def attach(
        self,
        tensors: Mapping[int, torch.Tensor] | None = None,
        *,
        ucx_tls: str | None = None,
        ucx_net_devices: str | None = None,
    ) -> str:
        """Open the rank's pools and NIXL endpoint and register them; returns the worker id.

        ``ucx_tls`` / ``ucx_net_devices`` override the worker's UCX settings (e.g. ``"tcp"`` so
        that two workers of one machine talk over its network rather than shared memory); the
        registration reports what the endpoint runs with (``GET /v1/workers``: ``ucx``).
        Attaching again (after a re-registration) fails every handle still pending on the old
        endpoint and starts a new one over the same engine tensors.
        """
        from workers.transport.nixl import NixlTransport

        with self._attach_lock:
            if ucx_tls is not None:
                self.ucx_tls = ucx_tls
            if ucx_net_devices is not None:
                self.ucx_net_devices = ucx_net_devices
            instance = self.client.get_instance(self.instance)
            rank_body = next((r for r in instance.get("ranks", []) if r["rank"] == self.rank), None)
            if rank_body is None:
                raise WorkerError(
                    f"{self.instance} rank {self.rank} has not reported its page table"
                )
            specs = [PoolSpec.from_dict(pool) for pool in rank_body["pools"]]
            if tensors is not None:
                self._tensors = tensors
            if self._tensors is not None:
                self.pools = attach_pools(specs, self._tensors, self.device)
            elif sorted(specs, key=lambda spec: spec.id) != [
                p.spec for _, p in sorted(self.pools.items())
            ]:
                self.pools = allocate_pools(specs, self.device)
            if self.fill:
                self.fillcheck.fill(self.pools)
            if self.handover is not None:
                self.handover.close(
                    f"peer_restarted: {self.instance} re-registered; this worker attached again"
                )
            if self.transport is not None:
                self.transport.close()
            agent = f"{self.instance}.r{self.rank}.{uuid.uuid4().hex[:8]}"
            self.transport = NixlTransport(
                agent,
                self.pools,
                staging_bytes=self.staging_bytes,
                progress_thread=False,
                ucx_tls=self.ucx_tls,
                ucx_net_devices=self.ucx_net_devices,
            )
            peer = self.transport.peer_info().to_json()
            body: dict[str, Any] = {
                "instance": self.instance,
                "rank": self.rank,
                "device": self.device,
                "transport": "nixl",
                "peer": peer,
                "host": socket.gethostname()[:256],
                "pid": os.getpid(),
            }
            try:
                attached = self.client.register_worker(body)
            except BadRequestError as error:
                if "peer.ucx" not in str(error):
                    raise
                # A control plane older than this worker: attach without the UCX report.
                peer.pop("ucx", None)
                attached = self.client.register_worker(body)
            self.worker_id = str(attached["id"])
            self.heartbeat_interval_s = float(attached["heartbeat_interval_s"])
            self.handover = Handover(
                self.transport,
                instance=self.instance,
                rank=self.rank,
                on_finished=self._on_finished,
                on_start=self.fillcheck.note_receive if self.fill else None,
                check=self.fillcheck.check_filled if self.fill else None,
                on_idle=self.fillcheck.mark_some if self.fill else None,
                chunk_blocks=self.chunk_blocks or CHUNK_BLOCKS,
                hold_s=self.hold_s,
                on_ask=self.on_ask,
                on_release=self.on_release,
                on_unknown_agent=self._refresh_soon,
            )
            log.info(
                "worker %s attached to %s rank %d (%s, agent %s, UCX tls=%s devices=%s)",
                self.worker_id,
                self.instance,
                self.rank,
                self.device,
                agent,
                self.transport.ucx.tls,
                self.transport.ucx.net_devices,
            )
            if self._threads:  # already started: the new endpoint needs a fresh directory
                self._refresh_quietly()
            return self.worker_id

    # --- start / serve / stop ------------------------------------------------------------

    def start(self) -> None:
        """Fetch the directory and start the heartbeat, command-stream and record threads."""
        if self.worker_id is None:
            self.attach()
        if self._threads:
            return
        self.refresh_directory()
        self.recorder = Recorder(self.client, lambda: self.worker_id, stream=lambda: self._stream)
        for target, name in ((self._heartbeat_loop, "heartbeat"), (self._command_loop, "commands")):
            thread = threading.Thread(target=target, daemon=True, name=f"kvplane-{name}")
            thread.start()
            self._threads.append(thread)

    def serve(self, *, idle_exit_s: float | None = None) -> None:
        """:meth:`start`, then block until :meth:`stop` (or ``idle_exit_s`` without a transfer)."""
        self.start()
        last = (self.stats.sent, self.stats.received, self.stats.failed)
        idle_since = time.monotonic()
        while not self._stop.wait(0.5):
            now = (self.stats.sent, self.stats.received, self.stats.failed)
            if now != last:
                last, idle_since = now, time.monotonic()
            elif idle_exit_s is not None and time.monotonic() - idle_since > idle_exit_s:
                return

    def stop(self) -> None:
        """Stop serving: fail pending handles, flush the record, deregister, release NIXL."""
        self._stop.set()
        if self.handover is not None:
            self.handover.close("the worker stopped")
        if self.recorder is not None:
            self.recorder.close(timeout_s=3.0)
        # Deregister before joining the threads: the command stream's read ends with it, and an
        # engine that gives its ranks a few seconds to stop (vLLM's --shutdown-timeout) sees
        # this worker stopped within them.
        if self.worker_id is not None:
            try:
                self.client.stop_worker(self.worker_id)
            except ApiError as error:
                log.warning("deregistration failed: %s", error)
        for thread in self._threads:
            thread.join(timeout=2.0)
        if self.transport is not None:
            self.transport.close()
            self.transport = None

    # --- engine API ----------------------------------------------------------------------

    def send(
        self,
        request_id: str,
        peer: str,
        blocks: BlockMap,
        *,
        num_tokens: int | None = None,
        **options: Any,
    ) -> Handle:
        """Send this rank's share of ``request_id`` to generation instance ``peer``;
        ``num_tokens``: the request's prompt tokens (blocks pair by token position; see
        :meth:`workers.handover.Handover.send` for it and the other options)."""
        return self._handover_call(
            "send", request_id, peer, blocks, dict(options, num_tokens=num_tokens)
        )

    def expect(
        self,
        request_id: str,
        peer: str,
        blocks: BlockMap,
        *,
        num_tokens: int | None = None,
        **options: Any,
    ) -> Handle:
        """Receive this rank's share of ``request_id`` from context instance ``peer``
        (the same ``num_tokens`` as the sender's; see :meth:`workers.handover.Handover.expect`)."""
        return self._handover_call(
            "expect", request_id, peer, blocks, dict(options, num_tokens=num_tokens)
        )

    def get_finished(self) -> Finished:
        """Request ids resolved since the last call (sent, received, failed with reasons)."""
        if self.handover is None:
            return Finished(frozenset(), frozenset(), {})
        return self.handover.get_finished()

    def add_listener(self, listener: Callable[[Handle], None]) -> None:
        """Call ``listener(handle)`` for every handle that resolves (progress thread)."""
        self._listeners.append(listener)

    def _handover_call(
        self, kind: str, request_id: str, peer: str, blocks: BlockMap, options: Mapping[str, Any]
    ) -> Handle:
        handover = self.handover
        if handover is None:
            raise HandoverError("the worker is not attached", code="not_attached")
        method = handover.send if kind == "send" else handover.expect
        try:
            handle = method(request_id, peer, blocks, **options)
        except HandoverError as error:
            if error.code != "unknown_pairing":
                raise
            # A pairing newer than the cached directory: one refetch, then the hot path again.
            self.refresh_directory()
            handle = method(request_id, peer, blocks, **options)
        return handle

    # --- directory -----------------------------------------------------------------------

    def refresh_directory(self) -> Directory:
        """Fetch the directory now and hand it to the hot path."""
        assert self.worker_id is not None
        directory = Directory.from_json(self.client.get_directory(self.worker_id))
        self.directory = directory
        if self.handover is not None:
            self.handover.set_directory(directory)
        if self.fill:
            self.fillcheck.prepare_patterns(directory)
        return directory

    def refresh_directory_soon(self) -> None:
        """Refresh the directory on a thread of its own (never on the caller's)."""
        self._refresh_soon("")

    def _refresh_soon(self, agent: str) -> None:
        """Refresh the directory on a thread of its own (at most one at a time, 4 a second)."""
        now = time.monotonic()
        if self._refreshing.is_set() or now - self._refreshed_at < 0.25:
            return
        self._refreshing.set()
        self._refreshed_at = now

        def refresh() -> None:
            try:
                self._refresh_quietly()
            finally:
                self._refreshing.clear()

        threading.Thread(target=refresh, daemon=True, name="kvplane-refresh").start()

    def _refresh_quietly(self) -> None:
        try:
            self.refresh_directory()
        except ApiError as error:
            log.warning("directory refresh failed: %s", error)

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.heartbeat_interval_s):
            worker_id = self.worker_id
            try:
                if worker_id is None:
                    continue
                # What UCX uses for this endpoint's peers (read from UCX's log, here, off the
                # hot path); None until known, and then the heartbeat has no body.
                transport = self.transport
                report = transport.ucx_in_use() if transport is not None else None
                seen = (
                    self.client.heartbeat(worker_id)
                    if report is None
                    else self.client.heartbeat(worker_id, ucx_in_use=report)
                )
                if seen.get("directory_revision") != self.directory.revision:
                    self.refresh_directory()
            except ConflictError as error:
                if self._stop.is_set():
                    return  # stopping: its own deregistration refused this heartbeat
                if error.code == "worker_superseded":
                    if self._superseded_unless_reattached(worker_id, error.detail):
                        return
                    continue
                log.warning("heartbeat refused (%s); attaching again", error.detail)
                try:
                    self.attach()
                except ApiError as attach_error:
                    log.warning("attaching again failed: %s", attach_error)
            except NotFoundError as error:
                if self._stop.is_set():
                    return
                log.warning("heartbeat refused (%s); attaching again", error.detail)
                try:
                    self.attach()
                except ApiError as attach_error:
                    log.warning("attaching again failed: %s", attach_error)
            except ApiError as error:
                if error.status in (401, 403):
                    log.error("heartbeat refused: %s; the worker keeps its cached directory", error)
                else:
                    log.warning(
                        "heartbeat failed (%s); the hot path runs on the cached directory", error
                    )

    # --- REST commands -------------------------------------------------------------------

    def _command_loop(self) -> None:
        failures = 0  # streams in a row that failed before a line arrived
        while not self._stop.is_set():
            worker_id = self.worker_id
            if worker_id is None:
                self._stop.wait(OUTAGE_BACKOFF_S)
                continue
            # (getattr: an engine that embeds the worker may hand it a client of its own)
            url = getattr(self.client, "url", None)
            reattached = False  # this worker attached again: its new id's stream, at once
            try:
                for command in self._commands(worker_id):
                    failures = 0
                    if self._stop.is_set():
                        break
                    if worker_id != self.worker_id:
                        reattached = True
                        break
                    if command.get("type") == "transfer":
                        self.run_command(command)
                    elif command.get("type") == "superseded":
                        if self._superseded_unless_reattached(
                            worker_id, f"worker {command.get('by')} attached to this rank"
                        ):
                            return
                        reattached = True
                        break
            except ApiError as error:
                if self._stop.is_set():
                    return
                if error.status in (401, 403):
                    log.error("command stream refused: %s", error)
                elif error.status not in (404, 409):  # 404/409: the heartbeat re-attaches
                    log.warning("command stream on %s closed (%s); reconnecting", url, error)
            except Exception:  # never lose the stream thread to one bad line
                log.exception("command stream failed; reconnecting")
            finally:
                self._close_stream()
            if reattached:
                continue
            failures += 1
            # Another API process to try (the client failed over): at once, once per URL;
            # then back off, the control plane is down.
            moved = getattr(self.client, "url", None) != url and failures < len(
                getattr(self.client, "urls", ())
            )
            delay = FAILOVER_DELAY_S if moved else OUTAGE_BACKOFF_S
            self._stop.wait(delay if not self._stop.is_set() else 0)

    def _commands(self, worker_id: str) -> Iterator[dict[str, Any]]:
        """The command lines of the worker's two-way stream (its records go up the same
        connection, see workers/records.py), or of ``GET .../commands`` where the control plane
        or the client has no such stream."""
        open_stream = getattr(self.client, "open_stream", None) if self._two_way else None
        if open_stream is not None:
            try:
                stream = open_stream(worker_id, read_timeout_s=STREAM_READ_TIMEOUT_S)
            except StreamUnsupported as why:
                log.info("no two-way stream (%s); records go by POST", why)
                self._two_way = False
            else:
                self._stream = stream
                return iter(stream)
        return iter(self.client.stream_commands(worker_id, read_timeout_s=STREAM_READ_TIMEOUT_S))

    def _close_stream(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()

    def _superseded_unless_reattached(self, stale_id: str | None, why: str) -> bool:
        """``stale_id`` was superseded: stop (True), unless this worker attached again since
        then, on another thread (a heartbeat refused after a re-registration re-attaches): the
        worker that superseded it is this one, under its new id."""
        with self._attach_lock:  # an attach in progress on another thread finishes first
            if self.worker_id != stale_id:
                log.info("worker %s superseded by this one's new id %s", stale_id, self.worker_id)
                return False
        self._superseded(why)
        return True

    def _superseded(self, why: str) -> None:
        """Another worker took this rank over: stop serving (attaching again would take it
        back, and two workers would fight over the rank)."""
        log.error(
            "this worker was superseded on %s rank %d (%s); it stops", self.instance, self.rank, why
        )
        self.superseded = True
        self._stop.set()
        if self.handover is not None:
            self.handover.close("superseded: another worker attached to this rank")

    def _first_time(self, command: TransferCommand) -> bool:
        """Whether this command (its ``xid`` and side) is new here; remembers it."""
        key = (command.xid, command.side)
        with self._seen_lock:
            if key in self._seen:
                self.duplicate_commands += 1
                return False
            self._seen[key] = None
            while len(self._seen) > SEEN_COMMANDS:
                self._seen.popitem(last=False)
        return True

    def run_command(self, line: Mapping[str, Any] | TransferCommand) -> Handle | None:
        """Start this rank's side of a REST-dispatched transfer (None: refused, or a command
        this worker already had). ``line``: the stream's ``transfer`` line, or its model."""
        try:
            command = (
                line if isinstance(line, TransferCommand) else TransferCommand.model_validate(line)
            )
        except ValidationError as error:  # nothing to record it under: it fails at its deadline
            log.error("dropped a transfer command this worker cannot read: %s", error)
            return None
        if not self._first_time(command):
            log.debug("command %s (%s) arrived again; dropped", command.xid, command.side)
            return None
        if not self.accept_commands:
            log.warning(
                "refused REST transfer %s: %s rank %d takes no pushed transfers",
                command.transfer_id,
                self.instance,
                self.rank,
            )
            self._record_refusal(command, CommandRefused(self.instance))
            return None
        epochs = (command.context_epoch, command.generation_epoch)
        peer = command.generation if command.side == "send" else command.context
        entry = self.directory.plans.get(
            (peer, command.context_dp_rank, command.generation_dp_rank)
        )
        if entry is None or entry.epochs() != epochs:
            self._refresh_quietly()  # a pairing or epoch newer than the cached directory
        call = self.send if command.side == "send" else self.expect
        try:
            handle = call(
                command.xid,
                peer,
                command.blocks,
                context_dp_rank=command.context_dp_rank,
                generation_dp_rank=command.generation_dp_rank,
                timeout_s=command.timeout_s,
                mode=command.mode,
                verify=command.verify,
                num_tokens=command.num_tokens,
                context={"transfer_id": command.transfer_id, "attempt": command.attempt},
            )
        except Exception as error:  # bad blocks, unknown pairing, ...: the transfer fails now
            self._record_refusal(command, error)
            return None
        if handle.entry.epochs() != epochs:
            log.warning(
                "transfer %s was planned with other epochs than this worker's "
                "directory; it will fail as peer_restarted",
                command.transfer_id,
            )
        return handle

    def _record_refusal(self, command: TransferCommand, error: Exception) -> None:
        now = time.time()
        if self.recorder is None:
            return
        self.recorder.add(
            {
                "transfer_id": command.transfer_id,
                "attempt": command.attempt,
                "request_id": command.request_id,
                "pairing_id": "unknown",
                "context": command.context,
                "generation": command.generation,
                "context_epoch": command.context_epoch,
                "generation_epoch": command.generation_epoch,
                "context_dp_rank": command.context_dp_rank,
                "generation_dp_rank": command.generation_dp_rank,
                "side": command.side,
                "rank": self.rank,
                "status": "failed",
                "error": f"{type(error).__name__}: {error}"[:2000],
                "bytes": 0,
                "mode": command.mode,
                "verify": command.verify,
                "started_at": now,
                "finished_at": now,
            },
            urgent=True,
        )

    # --- outcomes ------------------------------------------------------------------------

    def _on_finished(self, handle: Handle) -> None:
        """Progress thread: stats, fill-mode verification, the record, listeners."""
        verified = handle.verified_bytes
        if handle.state != FAILED:
            if handle.side == "send":
                self.stats.sent += 1
            else:
                self.stats.received += 1
            self.stats.bytes_moved += handle.bytes
        if handle.state == FAILED:
            self.stats.failed += 1
            self.stats.errors.append(str(handle.reason))
            del self.stats.errors[:-100]
        if self.recorder is not None and self._recorded(handle):
            # A REST transfer's waiter needs the receivers' parts now (and, with verify, the
            # senders' checksums too, unless the receivers compared them); everything else
            # rides the next batch.
            urgent = "transfer_id" in handle.context and (
                handle.side == "receive"
                or handle.state == FAILED
                or (handle.verify and not handle.compared)
            )
            self.recorder.add(self._record(handle, verified), urgent=urgent)
        for listener in self._listeners:
            try:
                listener(handle)
            except Exception:
                log.exception("worker listener failed")

    def _recorded(self, handle: Handle) -> bool:
        """Whether the control plane gets this handle's part.

        On the engine path a send that was released without ``verify`` decides nothing: the
        receivers' parts settle the transfer and list every route's bytes, sender by sender.
        Leaving it out makes the record one row per receiving rank instead of one per rank
        (2 instead of 6 for TP4 -> TP2), which halved the control plane's CPU per engine
        transfer. With ``verify`` the same holds when every receiver compared the sums itself
        (its grant said so; the receivers' parts carry both sums): only a send to a receiver
        that does not compare carries a checksum the control plane needs. Failures,
        REST-dispatched transfers (their parts are each rank's answer to a command) and every
        send of a worker made with ``record_releases=True`` are recorded.
        """
        return (
            handle.side == "receive"
            or handle.state == FAILED
            or self.record_releases
            or "transfer_id" in handle.context
            or (handle.verify and not handle.compared)
        )

    def _record(self, handle: Handle, verified: int | None) -> dict[str, Any]:
        entry = handle.entry
        context = handle.context
        record: dict[str, Any] = {
            "attempt": int(context.get("attempt", 1)),
            "request_id": str(context.get("request_id", handle.request_id)),
            "pairing_id": entry.pairing_id,
            "context": entry.context,
            "generation": entry.generation,
            "context_epoch": entry.context_epoch,
            "generation_epoch": entry.generation_epoch,
            "context_dp_rank": entry.context_dp_rank,
            "generation_dp_rank": entry.generation_dp_rank,
            "side": handle.side,
            "rank": self.rank,
            "status": "failed" if handle.state == FAILED else "done",
            "error": None if handle.reason is None else str(handle.reason)[:2000],
            "bytes": handle.bytes,
            "mode": handle.mode,
            "verify": handle.verify,
            "started_at": handle.started_at,
            "finished_at": handle.finished_at or time.time(),
            "routes": handle.routes,
            "verified_bytes": verified,
            "timeout_s": handle.timeout_s,
        }
        if "transfer_id" in context:
            record["transfer_id"] = context["transfer_id"]
        else:  # engine path: whichever rank's record comes first creates the transfer's row
            record["blocks"] = handle.blocks
            if handle.num_tokens is not None:
                record["num_tokens"] = handle.num_tokens
        return record

    # --- fill-pattern verification (workers/fillcheck.py) ---------------------------------

    def verify_transfer(self, handle: Handle, routes: Sequence[RouteState] | None = None) -> int:
        """Fill mode: check the bytes ``handle`` was meant to write, and the rest of the slots
        it wrote (see :meth:`workers.fillcheck.FillCheck.verify_transfer`); bytes checked."""
        return self.fillcheck.verify_transfer(handle, routes)

    def verify_untouched(self) -> int:
        """Fill mode: every byte of every pool that no transfer targeted still holds this
        rank's pattern (a stray write anywhere shows up). Returns the bytes checked."""
        return self.fillcheck.verify_untouched()

    def _peer(self, instance: str, rank: int) -> PeerWorker | None:
        """The worker of ``instance`` rank ``rank`` the handover talks to now (fill checks)."""
        assert self.handover is not None
        return self.handover.peer(instance, rank)
