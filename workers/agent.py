"""The worker process: serves one rank, pulls transfer jobs from the control plane, moves pages.

Lifecycle of a :class:`Worker`:

1. **attach**: read the rank's registered page table, allocate its pools (``device``) or wrap the
   tensors an embedding engine hands over (:meth:`Worker.attach` with ``tensors``), open a NIXL
   agent with the pools and a staging buffer registered, and ``POST /v1/workers`` its endpoint
   (agent metadata, pool base addresses, staging buffer): the metadata travels through the
   control plane, never a side channel;
2. **heartbeat** from a background thread (extends the leases the worker holds);
3. **serve**: claim a job (long-poll), run it, report ``complete`` with bytes, duration and crc32
   checksums, or ``fail`` with the reason. A lost lease (409) drops the job silently: someone
   else owns it now. Every NIXL wait has a deadline, so a dead peer fails the job, never hangs it;
4. **stop**: deregister (``DELETE /v1/workers/{id}``), close the NIXL agent.

Jobs (see ``api/services/jobs.py``): ``send`` gathers each route into staging and NIXL-WRITEs
it chunk by chunk into the receiver's reserved staging area (or, mode ``fragments``, one
descriptor per fragment into the receiver's pools); ``receive`` scatters each chunk as its
notification lands (mode ``fragments`` with ``verify``: waits for the writes, then checksums the
landed bytes and reports ``bytes: 0``, having moved none). A receiver started with
``fill_pattern`` can verify *every* byte of its pools after a transfer (written bytes carry the
sender's pattern, all others its own).

Depends only on the wire schemas, the HTTP client and torch/NIXL: never on FastAPI or SQLAlchemy.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from api.client import ApiError, Client, ConflictError, LeaseLostError, NotFoundError
from workers.executors import (
    BlockRangeError,
    TemplateError,
    align_blocks,
    as_route,
    expand_fragments,
    fragments_crc32,
)
from workers.pools import Pool, PoolSpec, allocate_pools, attach_pools, fill_pattern
from workers.transport import TransferCancelled

if TYPE_CHECKING:
    import torch

    from workers.transport.nixl import NixlTransport

log = logging.getLogger("kvplane.worker")

DEFAULT_STAGING_BYTES = 256 << 20
CLAIM_WAIT_S = 2.0
OUTAGE_BACKOFF_S = 2.0  # between claims while the control plane is unreachable


def _retryable(error: Exception) -> bool:
    """Whether another attempt could succeed: a bad template or block list fails the same way
    every time; transport trouble (timeouts, a restarted peer) may not."""
    if isinstance(error, JobError):
        return error.retryable
    return not isinstance(error, (BlockRangeError, TemplateError, KeyError, ValueError, TypeError))


class JobError(RuntimeError):
    """A job that cannot be done; ``retryable`` says whether another attempt could succeed."""

    def __init__(self, message: str, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable


def _blocks(raw: Mapping[str, Mapping[str, list[int]]]) -> dict[int, tuple[list[int], list[int]]]:
    return {int(g): (v["context"], v["generation"]) for g, v in raw.items()}


def _crc32(tensor: torch.Tensor) -> int:
    return zlib.crc32(tensor.detach().cpu().numpy().tobytes()) & 0xFFFFFFFF


@dataclass
class WorkerStats:
    jobs_done: int = 0
    jobs_failed: int = 0
    bytes_moved: int = 0
    busy_s: float = 0.0
    verified_bytes: int = 0
    errors: list[str] = field(default_factory=list)


class Worker:
    """One rank's worker: attach, then :meth:`serve` until stopped."""

    def __init__(
        self,
        client: Client,
        instance: str,
        rank: int,
        *,
        device: str = "cpu",
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        fill: bool = False,
    ) -> None:
        self.client = client
        self.instance = instance
        self.rank = rank
        self.device = device
        self.staging_bytes = staging_bytes
        self.fill = fill
        self.pools: dict[int, Pool] = {}
        self.transport: NixlTransport | None = None
        self.worker_id: str | None = None
        self.heartbeat_interval_s = 1.0
        self.stats = WorkerStats()
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._peer_of_rank: dict[tuple[str, int], str] = {}
        self._running_job: str | None = None
        self._deadline = 0.0  # time.monotonic() by which the running job must be done
        self._tensors: Mapping[int, torch.Tensor] | None = None
        # Fault injection for tests and chaos drills: hold every claimed job this long first.
        self.pause_after_claim_s = float(os.environ.get("KVPLANE_WORKER_PAUSE_AFTER_CLAIM_S", 0))

    # --- attach --------------------------------------------------------------------------

    def attach(self, tensors: Mapping[int, torch.Tensor] | None = None) -> str:
        """Open the rank's pools and NIXL endpoint and register them; returns the worker id."""
        from workers.transport.nixl import NixlTransport

        instance = self.client.get_instance(self.instance)
        rank_body = next((r for r in instance.get("ranks", []) if r["rank"] == self.rank), None)
        if rank_body is None:
            raise JobError(f"{self.instance} rank {self.rank} has not reported its page table",
                           retryable=False)
        specs = [PoolSpec.from_dict(pool) for pool in rank_body["pools"]]
        if tensors is not None:
            self._tensors = tensors
        if self._tensors is not None:
            # An engine's memory: re-attaching (after a re-registration) wraps the same tensors.
            self.pools = attach_pools(specs, self._tensors, self.device)
        elif sorted(specs, key=lambda spec: spec.id) != [p.spec for _, p in sorted(
                self.pools.items())]:
            self.pools = allocate_pools(specs, self.device)
        if self.fill:
            for pool in self.pools.values():
                fill_pattern(self.rank, pool)
        if self.transport is not None:
            self.transport.close()
        agent = f"{self.instance}.r{self.rank}.{uuid.uuid4().hex[:8]}"
        self.transport = NixlTransport(agent, self.pools, staging_bytes=self.staging_bytes)
        attached = self.client.register_worker({
            "instance": self.instance,
            "rank": self.rank,
            "device": self.device,
            "transport": "nixl",
            "peer": self.transport.peer_info().to_json(),
            "host": socket.gethostname()[:256],
            "pid": os.getpid(),
        })
        self.worker_id = attached["id"]
        self.heartbeat_interval_s = float(attached["heartbeat_interval_s"])
        log.info("worker %s attached to %s rank %d (%s, agent %s)", self.worker_id,
                 self.instance, self.rank, self.device, agent)
        return str(self.worker_id)

    # --- serve ---------------------------------------------------------------------------

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.heartbeat_interval_s):
            try:
                if self.worker_id is not None:
                    # Only the job running now keeps its lease: a lease whose claim answer was
                    # lost (the client retried the claim) expires, and its transfer is retried.
                    running = self._running_job
                    seen = self.client.heartbeat(self.worker_id,
                                                 jobs=[] if running is None else [running])
                    # Judge the job the heartbeat was about, if it is still the one running.
                    if (running is not None and seen.get("current_job") != running
                            and self._running_job == running and self.transport is not None):
                        log.warning("job %s was withdrawn by the control plane; stopping it",
                                    running)
                        self.transport.cancel.set()
            except ConflictError:
                log.warning("heartbeat refused: worker retired or stale; re-attaching")
            except ApiError as error:
                log.warning("heartbeat failed: %s", error)

    def serve(self, *, max_jobs: int | None = None, idle_exit_s: float | None = None) -> None:
        """Claim and run jobs until :meth:`stop` (or ``max_jobs`` / ``idle_exit_s``)."""
        if self.worker_id is None:
            self.attach()
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, daemon=True,
                                           name="kvplane-heartbeat")
        self._heartbeat.start()
        done = 0
        idle_since = time.monotonic()
        while not self._stop.is_set():
            try:
                job = self.client.claim_job(str(self.worker_id), wait_s=CLAIM_WAIT_S)
            except ConflictError as error:
                if error.code in ("worker_stale", "worker_retired"):
                    log.warning("%s: attaching again", error.detail)
                    self.attach()
                    continue
                raise
            except NotFoundError:
                self.attach()
                continue
            except ApiError as error:  # the control plane is unreachable or failing: wait
                if error.status in (401, 403):
                    raise  # a missing, revoked or wrong token will not fix itself: stop
                log.warning("claim failed: %s; retrying in %.0f s", error, OUTAGE_BACKOFF_S)
                self._stop.wait(OUTAGE_BACKOFF_S)
                continue
            if job is None:
                if idle_exit_s is not None and time.monotonic() - idle_since > idle_exit_s:
                    return
                continue
            self.run_job(job)
            done += 1
            idle_since = time.monotonic()
            if max_jobs is not None and done >= max_jobs:
                return

    def run_job(self, job: Mapping[str, Any]) -> None:
        """Execute one leased job and report its outcome."""
        self._running_job = job["id"]
        if self.transport is not None:
            self.transport.cancel.clear()
        try:
            self._run(job)
        finally:
            self._running_job = None

    def _pause(self) -> None:
        deadline = time.monotonic() + self.pause_after_claim_s
        while time.monotonic() < deadline:
            if self.transport is not None and self.transport.cancel.is_set():
                raise TransferCancelled("the job was withdrawn while the worker was paused")
            time.sleep(0.05)

    def _run(self, job: Mapping[str, Any]) -> None:
        try:
            # The job's time (timeout_s) counts from now, right after the claim, pause included.
            self._deadline = time.monotonic() + float(job["payload"]["timeout_s"])
            self._pause()
            started = time.perf_counter()
            result = self._send(job) if job["kind"] == "send" else self._receive(job)
        except LeaseLostError:
            return
        except Exception as error:  # any failure is reported, never swallowed
            retryable = _retryable(error)
            reason = f"{type(error).__name__}: {error}"[:1000]
            log.warning("job %s (%s) failed: %s", job["id"], job["kind"], reason)
            self.stats.jobs_failed += 1
            self.stats.errors.append(reason)
            try:
                self.client.fail_job(
                    job["id"],
                    {"lease_token": job["lease_token"], "reason": reason, "retryable": retryable},
                )
            except LeaseLostError:
                pass  # a withdrawn job's lease is gone: the 409 is expected
            except ApiError as report_error:
                log.warning("job %s: could not report the failure (%s); its lease will expire",
                            job["id"], report_error)
            return
        elapsed = time.perf_counter() - started
        result["duration_s"] = elapsed
        result["lease_token"] = job["lease_token"]
        try:
            self.client.complete_job(job["id"], result)
        except LeaseLostError:
            log.warning("job %s: lease lost before completion; result dropped", job["id"])
            return
        except ApiError as error:
            log.warning("job %s: could not report completion (%s); its lease will expire and "
                        "the transfer will be retried", job["id"], error)
            return
        self.stats.jobs_done += 1
        self.stats.bytes_moved += int(result["bytes"])
        self.stats.busy_s += elapsed

    def _peer(self, peer: Mapping[str, Any], instance: str, rank: int) -> str:
        """Load a peer's NIXL metadata once; a restarted peer's old agent is dropped."""
        assert self.transport is not None
        agent = str(peer["agent"])
        previous = self._peer_of_rank.get((instance, rank))
        if previous == agent and agent in self.transport.peers:
            return agent
        if previous is not None and previous != agent and previous in self.transport.peers:
            self.transport.remove_peer(previous)
        self.transport.add_peer(peer)
        self._peer_of_rank[(instance, rank)] = agent
        return agent

    @staticmethod
    def _tag(payload: Mapping[str, Any], sender_rank: int) -> bytes:
        return f"{payload['transfer_id']}:{payload['attempt']}:{sender_rank}".encode()

    @staticmethod
    def _time_left(deadline: float) -> float:
        """Seconds left of the job's ``timeout_s``, which bounds the whole job, not each route:
        the control plane relies on it to know when a stale sender has stopped writing."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise JobError("the job ran out of its time (timeout_s)")
        return left

    def _send(self, job: Mapping[str, Any]) -> dict[str, Any]:
        assert self.transport is not None
        payload = job["payload"]
        deadline = self._deadline
        blocks = _blocks(payload["blocks"])
        total, routes = 0, []
        for entry in payload["routes"]:
            route = as_route(entry["route"])
            receiver = entry["receiver_rank"]
            peer = payload["peers"][str(receiver)]
            agent = self._peer(peer, "generation", receiver)
            src, dst = align_blocks(route, blocks)
            if payload["mode"] == "fragments":
                sent = self.transport.write_fragments(
                    agent, route, src, dst, tag=self._tag(payload, self.rank),
                    timeout_s=self._time_left(deadline),
                )
                checksum = None
                if payload["verify"]:
                    dst_specs = {int(p["id"]): PoolSpec.from_dict(p) for p in peer["pools"]}
                    fragments = expand_fragments(route, self.pools, dst_specs, src, dst)
                    checksum = fragments_crc32(self.pools, fragments, side="src")
            else:
                sent = self.transport.write_staged(
                    agent, route, src, dst_offset=int(entry["dst_offset"]),
                    tag=self._tag(payload, self.rank), chunk_blocks=payload["chunk_blocks"],
                    timeout_s=self._time_left(deadline),
                )
                checksum = _crc32(self.transport.staging[:sent]) if payload["verify"] else None
            if sent != entry["bytes"]:
                raise JobError(f"route {self.rank}->{receiver}: moved {sent} bytes, the plan "
                               f"says {entry['bytes']}", retryable=False)
            total += sent
            routes.append({"sender_rank": self.rank, "receiver_rank": receiver, "bytes": sent,
                           "checksum": checksum})
        return {"bytes": total, "routes": routes}

    def _receive(self, job: Mapping[str, Any]) -> dict[str, Any]:
        assert self.transport is not None
        payload = job["payload"]
        if payload.get("worker_id") not in (None, self.worker_id):
            raise JobError("this job was pinned to another worker of this "
                           "rank (restarted?)")
        deadline = self._deadline
        blocks = _blocks(payload["blocks"])
        total, routes = 0, []
        for entry in payload["routes"]:
            route = as_route(entry["route"])
            sender = entry["sender_rank"]
            peer = payload["peers"][str(sender)]
            agent = str(peer["agent"])
            src, dst = align_blocks(route, blocks)
            checksum: int | None
            if payload["mode"] == "fragments":
                # The sender wrote straight into the pools; its notification says it is done.
                # Such a receive job exists only with verify: check the bytes where they landed.
                self.transport.wait_notif(agent, [self._tag(payload, sender)],
                                          self._time_left(deadline))
                src_specs = {int(p["id"]): PoolSpec.from_dict(p) for p in peer["pools"]}
                fragments = expand_fragments(route, src_specs, self.pools, src, dst)
                got = int(entry["bytes"])
                checksum = fragments_crc32(self.pools, fragments, side="dst")
            else:
                got = self.transport.receive_staged(
                    agent, route, dst, offset=int(entry["offset"]),
                    tag=self._tag(payload, sender), chunk_blocks=payload["chunk_blocks"],
                    timeout_s=self._time_left(deadline),
                )
                offset = int(entry["offset"])
                checksum = (_crc32(self.transport.staging[offset:offset + got])
                            if payload["verify"] else None)
            if payload["mode"] != "fragments":  # there the sender moved them; this job checks
                total += got
            routes.append({"sender_rank": sender, "receiver_rank": self.rank, "bytes": got,
                           "checksum": checksum})
        result: dict[str, Any] = {"bytes": total, "routes": routes}
        log.info("job %s: received %d bytes from %d writer(s) (%s mode)", job["id"],
                 sum(route["bytes"] for route in routes), len(routes), payload["mode"])
        if payload["verify"] and self.fill:
            result["verified_bytes"] = self.verify_pools(payload["routes"], blocks,
                                                         payload["peers"])
        return result

    def verify_pools(self, entries: list[Mapping[str, Any]],
                     blocks: Mapping[int, tuple[list[int], list[int]]],
                     peers: Mapping[str, Mapping[str, Any]]) -> int:
        """Check every byte of this rank's pools: written ones hold the sender's pattern
        (rank, pool, source offset), all others still hold this rank's own pattern.

        Independent of the executors: the expected image is built from the plan's fragments
        with plain slicing (one slice per fragment; demo and test sizes).
        """
        from workers.pools import pattern_tensor

        expected = {pid: pattern_tensor(self.rank, pid, pool.tensor.numel()).numpy()
                    for pid, pool in self.pools.items()}
        sources: dict[tuple[int, int], Any] = {}
        for entry in entries:
            route = as_route(entry["route"])
            sender_rank = int(entry["sender_rank"])
            src, dst = align_blocks(route, blocks)
            src_specs = {int(p["id"]): PoolSpec.from_dict(p)
                         for p in peers[str(sender_rank)]["pools"]}
            fragments = expand_fragments(route, src_specs, self.pools, src, dst)
            for (src_pool, dst_pool), (so, do, ln) in fragments.items():
                key = (sender_rank, src_pool)
                if key not in sources:
                    sources[key] = pattern_tensor(sender_rank, src_pool,
                                                  src_specs[src_pool].nbytes).numpy()
                source, target = sources[key], expected[dst_pool]
                for s, d, n in zip(so.tolist(), do.tolist(), ln.tolist(), strict=True):
                    target[d:d + n] = source[s:s + n]
        checked = 0
        for pid, pool in self.pools.items():
            actual = pool.tensor.detach().cpu().numpy()
            wrong = (actual != expected[pid]).nonzero()[0]
            if wrong.size:
                raise JobError(f"verification failed: pool {pid} has {wrong.size} wrong bytes "
                               f"(first at offset {int(wrong[0])})", retryable=False)
            checked += actual.size
        self.stats.verified_bytes += checked
        log.info("verified %d bytes of %d pool(s)", checked, len(self.pools))
        return checked

    # --- stop ----------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop serving; deregister and release NIXL resources."""
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5)
        if self.worker_id is not None:
            try:
                self.client.stop_worker(self.worker_id)
            except ApiError as error:
                log.warning("deregistration failed: %s", error)
        if self.transport is not None:
            self.transport.close()
            self.transport = None
