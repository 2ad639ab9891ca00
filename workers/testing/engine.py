"""A reference engine loop: one fake engine per rank, each embedding a kvplane ``Worker``.

What an engine does around the handover, minus the model:

- it **owns its KV memory**: one torch tensor per registered pool, handed to
  ``Worker.attach(tensors=...)`` (the worker wraps them, it never copies);
- it keeps a **paged-cache account** per layer group (:class:`BlockCache`): a free list of block
  ids, refusing to hand out an id twice or to free one that is not in use, and a leak count;
- per request, a context rank takes the request's block ids from its cache, calls
  ``worker.send(...)`` and gives the ids back when the handle is ``released`` or ``failed``; a
  generation rank takes its ids, calls ``worker.expect(...)`` and gives them back after
  ``arrived`` (in a real engine, after decoding) or ``failed``.

Block tables. The ranks of one instance share one block table (the instance's scheduler
allocates; every TP rank indexes its own pools with the same ids), and both instances must agree
on the request's ``{group: (context_ids, generation_ids)}`` map, which a router hands to both. Here
that router is a pure function: :func:`request_blocks` derives request ``i``'s two lists from a
shared seed, so every rank computes the same map with no message between them. Each side's pool is
cut into ``lanes`` of ``blocks`` ids (a seeded permutation, so ids are scattered like a used
cache); request ``i`` uses lane ``i % lanes``. A rank only issues a request once its own cache has
every id of it free (otherwise it waits, as a scheduler waits for free blocks), reserves them
(``BlockCache.reserve`` raises on a double allocation) and frees them on the handle's outcome.
At the end every cache must be whole again: :attr:`BlockCache.leaked` is 0.

Driving. Each rank runs its own loop with no coordinator (requests in index order): ``closed``
keeps ``in_flight`` of its own handles pending; ``poisson`` issues request ``i`` at a shared,
seeded arrival time (exponential gaps, ``rate`` per second), still bounded by ``in_flight`` and
free blocks. With ``prefill_ms`` a context rank calls ``send`` that long after it admitted a
request (its prefill), while the generation ranks ``expect`` at once. Every rank records per
request its issue time (just before ``send``/``expect``), its outcome time
(``handle.finished_at``), the state and the reason; all ranks share one machine clock
(``time.time()``), so the driver computes a request's handover latency as *last generation
handle arrived − last rank's issue*.

Processes. :class:`Fleet` starts the control plane (``kvplane serve`` on SQLite, see
:class:`ControlPlane`), registers the demo fleet (TP4 context with an 8-head target and a 2-head
draft view → TP2 generation), pairs it and starts one process per rank (``multiprocessing``
spawn). The driver talks to the ranks over pipes, outside the measured path: one command per run,
one result list back. The rank processes also serve REST ``execute=true`` commands (the worker's
command stream), and :meth:`EngineRank.raw` measures plain NIXL WRITEs between the same processes
(see ``bench/latency.py``).

Several hosts. With ``hosts`` (role → network namespace, see :mod:`workers.testing.netbed`) the
control plane and each role's rank processes start inside their namespaces with ``ip netns exec``
(a fresh interpreter, ``python -m workers.testing.engine``, talking to the driver over an
inherited socket), the control plane listens on its host's address and every worker reaches it and
its peers over the bed's network; ``ucx_tls`` (e.g. ``"tcp"``) is every worker's UCX transport
list and ``ucx_net_devices`` (e.g. ``"data0"``, the bed's data NIC) the devices it may use.
:meth:`Fleet.kill_role` and :meth:`Fleet.restart_role` play a host dying and coming back.

Test and bench equipment, not the data path: ``tests/workers/test_reference_engine.py``,
``tests/multihost``, ``bench/latency.py`` and ``kvplane demo`` import it (no pytest in here).
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import itertools
import logging
import multiprocessing as mp
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from api.client import Client
from api.logs import QUIET_LOGGERS
from geometry.builders import ViewSpec, instance_body

CONTEXT = "demo-ctx-tp4"
GENERATION = "demo-gen-tp2"
WORLD = {CONTEXT: 4, GENERATION: 2}
START_TIMEOUT_S = 180.0
# Between empty polls the raw loops sleep as long as the handover's busy progress loop does
# (BUSY_SLEEP_S of workers/handover/engine_api.py): six processes spinning on two cores measure
# the scheduler.
RAW_POLL_SLEEP_S = 0.00005
REPO = Path(__file__).resolve().parents[2]

log = logging.getLogger("kvplane.engine_loop")
REST_RETRIES = 20


def demo_bodies(num_slots: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The demo fleet: Llama-like 8-head target (4 layers) + 2-head one-layer draft, bf16, HND,
    TP4 context → TP2 generation."""
    views = [ViewSpec("target", 4, 8, 128), ViewSpec("draft", 1, 2, 128)]
    context = instance_body(
        role="context", views=views, tp=4, num_slots=num_slots, model="demo-llama"
    )
    generation = instance_body(
        role="generation", views=views, tp=2, num_slots=num_slots, model="demo-llama"
    )
    return context, generation


# --- the paged cache -------------------------------------------------------------------------


class CacheError(RuntimeError):
    """A paged-cache accounting error: a double allocation or a free of an id not in use."""


class BlockCache:
    """One layer group's block ids: a free list and the set in use (real accounting).

    The free list is an insertion-ordered dict (an ordered set): ``alloc`` takes from its head,
    ``free`` appends, ``reserve`` removes given ids; each costs O(ids), not O(slots), as in a
    real engine's allocator (rebuilding a 1,024-slot list per request was most of a rank's
    engine-thread CPU in the latency bench).
    """

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free: dict[int, None] = dict.fromkeys(range(num_slots))
        self._in_use: set[int] = set()
        self.high_water = 0

    def available(self, ids: Iterable[int]) -> bool:
        return not self._in_use.intersection(ids)

    def reserve(self, ids: Sequence[int]) -> None:
        """Take exactly these ids off the free list; :class:`CacheError` if any is in use."""
        taken = set(ids)
        if len(taken) != len(ids):
            raise CacheError(f"duplicate ids in one allocation: {sorted(ids)}")
        clash = self._in_use & taken
        if clash:
            raise CacheError(f"double allocation of block(s) {sorted(clash)[:8]}")
        bad = [i for i in taken if not 0 <= i < self.num_slots]
        if bad:
            raise CacheError(f"block id(s) {bad[:8]} outside [0, {self.num_slots})")
        self._in_use |= taken
        for i in taken:
            del self._free[i]
        self.high_water = max(self.high_water, len(self._in_use))

    def alloc(self, n: int) -> list[int]:
        """Take ``n`` ids from the head of the free list (what a scheduler does)."""
        if n > len(self._free):
            raise CacheError(f"{n} blocks wanted, {len(self._free)} free")
        ids = list(itertools.islice(self._free, n))
        for i in ids:
            del self._free[i]
        self._in_use.update(ids)
        self.high_water = max(self.high_water, len(self._in_use))
        return ids

    def free(self, ids: Sequence[int]) -> None:
        """Give ids back; :class:`CacheError` for an id that is not in use."""
        missing = set(ids) - self._in_use
        if missing:
            raise CacheError(f"free of block(s) not in use: {sorted(missing)[:8]}")
        self._in_use.difference_update(ids)
        self._free.update(dict.fromkeys(ids))

    @property
    def leaked(self) -> int:
        """Ids still in use (0 once every request gave its blocks back)."""
        return len(self._in_use)

    @property
    def free_count(self) -> int:
        return len(self._free)


def request_blocks(
    seed: int, index: int, blocks: int, num_slots: int, *, contiguous: bool = False
) -> dict[int, tuple[list[int], list[int]]]:
    """Request ``index``'s ``{group: (context_ids, generation_ids)}``: the same on every rank
    (``contiguous``: each lane's ids in order, as in a fresh cache)."""
    lanes = num_slots // blocks
    if lanes < 1:
        raise ValueError(f"{blocks} blocks per request do not fit {num_slots} slots")
    lane = index % lanes
    sides = []
    for side in (0, 1):  # the two instances' caches are scattered differently
        perm = list(range(num_slots)) if contiguous else _permutation(seed, side, num_slots)
        sides.append(perm[lane * blocks : (lane + 1) * blocks])
    return {0: (sides[0], sides[1])}


@functools.lru_cache(maxsize=64)
def _permutation(seed: int, side: int, num_slots: int) -> list[int]:
    return [int(x) for x in np.random.default_rng([seed, side]).permutation(num_slots)]


def lanes_of(blocks: int, num_slots: int) -> int:
    return num_slots // blocks


def arrivals(seed: int, requests: int, rate: float) -> np.ndarray:
    """Poisson arrivals: offsets in seconds from the start, the same on every rank."""
    gaps = np.random.default_rng([seed, 7]).exponential(1.0 / rate, size=requests)
    return np.cumsum(gaps) - gaps[0]


# --- one rank's fake engine (runs in its own process) ---------------------------------------


@dataclass(frozen=True)
class RankSpec:
    url: str
    instance: str
    rank: int
    role: str  # context | generation
    peer: str
    device: str = "cpu"
    fill: bool = False
    staging_bytes: int = 64 << 20
    chunk_blocks: int | None = None
    log_path: str | None = None
    ucx_tls: str | None = None
    ucx_net_devices: str | None = None
    netns: str | None = None  # the host (network namespace) this rank runs on


@dataclass
class RunResult:
    """One rank's account of one run."""

    rank: int
    role: str
    records: list[tuple[int, float, float, str, str | None]] = field(default_factory=list)
    leaked: int = 0
    # Blocks of failed fragments-mode receives still held back at the end (``reusable_at``):
    # a WRITE already granted may land there; accounted, given back when due, not leaked.
    quarantined: int = 0
    failed: int = 0
    double_allocations: int = 0
    verified_bytes: int = 0
    verify_errors: list[str] = field(default_factory=list)
    stalled: list[int] = field(default_factory=list)  # requests still pending at the time limit
    cache_high_water: int = 0


class EngineRank:
    """A fake engine rank: owns its pools, a block cache per layer group, and a Worker."""

    def __init__(self, spec: RankSpec) -> None:
        import torch

        from workers.agent import Worker

        self.spec = spec
        self.client = Client(spec.url, retries=3, backoff_s=0.2)
        body = self.client.get_instance(spec.instance)
        rank_body = next(r for r in body["ranks"] if r["rank"] == spec.rank)
        self.pool_specs = rank_body["pools"]
        # The engine's KV memory: one bf16 tensor per pool, [slots, stride / 2].
        self.tensors = {
            int(p["id"]): torch.zeros(
                (int(p["num_slots"]), int(p.get("slot_stride_bytes") or p["slot_bytes"]) // 2),
                dtype=torch.bfloat16,
                device=spec.device,
            )
            for p in self.pool_specs
        }
        groups = {int(p.get("layer_group", 0)): int(p["num_slots"]) for p in self.pool_specs}
        self.caches = {g: BlockCache(n) for g, n in groups.items()}
        self.num_slots = min(groups.values())
        self.worker = Worker(
            self.client,
            spec.instance,
            spec.rank,
            device=spec.device,
            staging_bytes=spec.staging_bytes,
            fill=spec.fill,
            chunk_blocks=spec.chunk_blocks,
            ucx_tls=spec.ucx_tls,
            ucx_net_devices=spec.ucx_net_devices,
        )
        self.worker.attach(tensors=self.tensors)
        self.worker.start()
        self._done: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._held: list[tuple[float, dict[int, list[int]]]] = []  # (reusable_at, blocks)
        self.worker.add_listener(self._on_handle)

    def _on_handle(self, handle: Any) -> None:
        if "engine_index" in handle.context:  # REST-dispatched handles are not the engine's
            self._done.put(handle)

    def _give_back(self, blocks: dict[int, list[int]], reusable_at: float | None) -> None:
        """A request's blocks back to the cache, or held until ``reusable_at``."""
        if reusable_at is not None and reusable_at > time.time():
            self._held.append((reusable_at, blocks))
            return
        for g, ids in blocks.items():
            self.caches[g].free(ids)

    def _release_held(self) -> float | None:
        """Free the held blocks that are due; when the next ones are."""
        now = time.time()
        due = [b for t, b in self._held if t <= now]
        self._held = [(t, b) for t, b in self._held if t > now]
        for blocks in due:
            self._give_back(blocks, None)
        return min((t for t, _ in self._held), default=None)

    # --- set-up ------------------------------------------------------------------------------

    def sync(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """Refresh the directory until every peer rank has a worker in it."""
        deadline = time.monotonic() + timeout_s
        world = WORLD[self.spec.peer]
        while True:
            directory = self.worker.refresh_directory()
            have = [r for r in range(world) if directory.peer(self.spec.peer, r) is not None]
            if len(have) == world and directory.plans:
                return {"rank": self.spec.rank, "peers": len(have)}
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.spec.instance} rank {self.spec.rank}: peers {have} "
                    f"of {world} after {timeout_s:.0f} s"
                )
            time.sleep(0.2)

    # --- the engine loop ---------------------------------------------------------------------

    def run(
        self,
        *,
        requests: int,
        blocks: int,
        in_flight: int,
        seed: int,
        start_at: float,
        tag: str,
        arrival: str = "closed",
        rate: float = 100.0,
        at: Sequence[float] | None = None,
        verify: bool = False,
        mode: str = "auto",
        timeout_s: float = 30.0,
        run_timeout_s: float = 300.0,
        contiguous: bool = False,
        num_slots: int | None = None,
        prefill_ms: float = 0.0,
    ) -> dict[str, Any]:
        """Issue ``requests`` requests in index order; returns a :class:`RunResult` as a dict
        (``num_slots``: use only block ids below it, leaving the rest to REST transfers).

        Arrivals: ``closed`` (the next as soon as fewer than ``in_flight`` are out), ``poisson``
        (at ``rate`` a second), or ``at``: request i arrives ``at[i]`` seconds after the start
        (a drill that starts requests before, during and after a fault).

        ``prefill_ms``: a context rank computes each request's KV for this long after it
        admitted it (its blocks reserved) and only then calls ``send``, while a generation rank
        calls ``expect`` as soon as it admitted it: the usual order in disaggregated serving,
        where the decode side allocates and expects during the prefill."""
        spec = self.spec
        slots = min(num_slots or self.num_slots, self.num_slots)
        result = RunResult(rank=spec.rank, role=spec.role)
        side = 0 if spec.role == "context" else 1
        call = self.worker.send if spec.role == "context" else self.worker.expect
        schedule: Sequence[float] | np.ndarray | None
        if at is not None:
            if len(at) != requests:
                raise ValueError(f"at names {len(at)} arrival times for {requests} requests")
            schedule = [float(t) for t in at]
        else:
            schedule = arrivals(seed, requests, rate) if arrival == "poisson" else None
        verified_before = self.worker.stats.verified_bytes
        outstanding: dict[int, tuple[Any, dict[int, list[int]], float]] = {}
        prefill_s = prefill_ms / 1e3 if spec.role == "context" else 0.0
        # Admitted (blocks reserved), computing their KV until due: (index, due, pairs, mine).
        admitted: deque[tuple[int, float, dict[int, Any], dict[int, list[int]]]] = deque()
        nxt = 0
        while time.time() < start_at:
            time.sleep(min(0.01, max(0.0, start_at - time.time())))
        t0 = time.time()
        give_up = time.monotonic() + run_timeout_s
        while len(result.records) < requests:
            wait_s = 0.5
            if self._held:
                next_due = self._release_held()
                if next_due is not None:
                    wait_s = min(wait_s, max(0.0005, next_due - time.time()))
            while nxt < requests and len(outstanding) + len(admitted) < in_flight:
                if schedule is not None:
                    due = t0 + float(schedule[nxt])
                    if time.time() < due:
                        wait_s = min(wait_s, due - time.time())
                        break
                pairs = request_blocks(seed, nxt, blocks, slots, contiguous=contiguous)
                mine = {g: ids[side] for g, ids in pairs.items()}
                if not all(self.caches[g].available(ids) for g, ids in mine.items()):
                    break  # our cache has no room for it yet: wait for an outcome
                try:
                    for g, ids in mine.items():
                        self.caches[g].reserve(ids)
                except CacheError as error:
                    result.double_allocations += 1
                    result.records.append((nxt, time.time(), time.time(), "failed", str(error)))
                    nxt += 1
                    continue
                admitted.append((nxt, time.time() + prefill_s, pairs, mine))
                nxt += 1
            while admitted and admitted[0][1] <= time.time():  # its KV is computed: send it
                index, _, pairs, mine = admitted.popleft()
                issued = time.time()
                try:
                    handle = call(
                        f"{tag}-{index}",
                        spec.peer,
                        pairs,
                        timeout_s=timeout_s,
                        verify=verify,
                        mode=mode,
                        context={"engine_index": index},
                    )
                except Exception as error:  # the request could not start: blocks back
                    for g, ids in mine.items():
                        self.caches[g].free(ids)
                    result.records.append(
                        (index, issued, time.time(), "failed", f"{type(error).__name__}: {error}")
                    )
                    continue
                outstanding[index] = (handle, mine, issued)
            if admitted:
                wait_s = min(wait_s, max(0.0, admitted[0][1] - time.time()))
            if time.monotonic() > give_up:
                result.stalled = sorted([*outstanding, *(a[0] for a in admitted)])
                break
            try:
                handle = self._done.get(timeout=max(0.0005, wait_s))
            except queue.Empty:
                continue
            while True:
                index = handle.context["engine_index"]
                entry = outstanding.pop(index, None)
                if entry is not None and entry[0] is handle:
                    # released / arrived / failed: blocks back (after a failed fragments
                    # receive, once no granted WRITE can land any more)
                    self._give_back(entry[1], handle.reusable_at)
                    result.records.append(
                        (index, entry[2], float(handle.finished_at), handle.state, handle.reason)
                    )
                try:
                    handle = self._done.get_nowait()
                except queue.Empty:
                    break
        for _, _, _, mine in admitted:  # admitted, never sent (a stall): blocks back
            for g, ids in mine.items():
                self.caches[g].free(ids)
        result.records.sort()
        result.failed = sum(1 for r in result.records if r[3] == "failed")
        result.verify_errors = [
            r[4] for r in result.records if r[4] and "verification failed" in r[4]
        ]
        self._release_held()
        result.quarantined = sum(len(ids) for _, b in self._held for ids in b.values())
        result.leaked = sum(c.leaked for c in self.caches.values()) - result.quarantined
        result.cache_high_water = max(c.high_water for c in self.caches.values())
        result.verified_bytes = self.worker.stats.verified_bytes - verified_before
        # shallow: asdict's deep copy of every record tuple cost ~0.07 ms per request here
        return {f.name: getattr(result, f.name) for f in fields(result)}

    def try_start(
        self,
        *,
        request_id: str,
        blocks: Mapping[int, Any],
        mode: str = "auto",
        peer: str | None = None,
    ) -> dict[str, Any]:
        """Call ``send``/``expect`` with these blocks as an engine would (for tests of what the
        engine API refuses): ``{"code", "message"}`` when it refuses, else the handle's state
        once it resolved (at most 5 s; a start that nobody answers fails at 1 s)."""
        from workers.directory import HandoverError

        call = self.worker.send if self.spec.role == "context" else self.worker.expect
        try:
            handle = call(request_id, peer or self.spec.peer, blocks, mode=mode, timeout_s=1.0)
        except HandoverError as error:
            return {"code": error.code, "message": str(error)}
        handle.wait(5.0)
        return {"state": handle.state, "reason": handle.reason}

    # --- raw NIXL, the same processes --------------------------------------------------------

    def raw(
        self,
        *,
        requests: int,
        blocks: int,
        in_flight: int,
        seed: int,
        start_at: float,
        run_timeout_s: float = 120.0,
        layout: str = "staging",
    ) -> dict[str, Any]:
        """Plain NIXL WRITEs of this rank's routes (one WRITE and one notification per route),
        closed loop over ``in_flight`` requests, with the handover paused meanwhile.

        ``layout``: ``staging`` writes each route's byte count from this rank's staging into the
        peer's, contiguous, at the same offsets every time (the lower bound of moving those
        bytes); ``fragments`` writes each request's own fragments (its block ids, as the
        engine path gets them) pool to pool, from the NIXL descriptor lists prepared per route:
        the same memory traffic as a handover, without its protocol; ``granted`` is
        ``fragments`` in the handover's order, with the least of its protocol: each receiver
        keeps ``in_flight`` requests granted (one notification to each of its senders per
        request) and a sender WRITEs a request's fragments when its grant comes.

        Sender: posts its routes of request ``i`` (one WRITE each), records the post time, keeps
        ``in_flight`` requests' WRITEs pending (granted: answers grants). Receiver: records the
        time the last of request ``i``'s route notifications arrived (granted: and the time it
        granted it, the request's issue). Returns ``{"issued": {i: t}, "arrived": {i: t}}``.
        """
        from workers.executors import align_request, staging_layout

        if layout not in ("staging", "fragments", "granted"):
            raise ValueError(f"layout {layout!r}: staging, fragments or granted")
        worker = self.worker
        handover = worker.handover
        assert handover is not None and worker.transport is not None
        tp = worker.transport
        entry = worker.directory.plan(self.spec.peer, None, None)
        pairs = request_blocks(seed, 0, blocks, self.num_slots)
        routes = []
        for route in entry.routes:
            lanes, src, _ = align_request(route, pairs)
            nbytes = staging_layout(lanes, src).nbytes
            if nbytes:
                routes.append((route.sender_rank, route.receiver_rank, nbytes))
        # fragments: every request's aligned block lists of this rank's routes, made before
        # the clock starts (the engine path's requests name the same ones)
        aligned: list[dict[int, tuple[Any, Any, Any]]] = []
        if layout in ("fragments", "granted") and self.spec.role == "context":
            mine_routes = [r for r in entry.routes if r.sender_rank == self.spec.rank]
            for i in range(requests):
                request = request_blocks(seed, i, blocks, self.num_slots)
                aligned.append({r.receiver_rank: align_request(r, request) for r in mine_routes})
        # Pause the handover's progress thread (it would eat our notifications): it runs the
        # blocking function below from its inbox until the raw run is over.
        paused, resume = threading.Event(), threading.Event()

        def hold() -> None:
            paused.set()
            resume.wait(run_timeout_s + 30)

        handover.call_soon(hold)
        if not paused.wait(10):
            raise RuntimeError("the handover's progress thread did not pause")
        out: dict[str, Any] = {"issued": {}, "arrived": {}, "error": None}
        try:
            if self.spec.role == "context":
                mine = [(r, n) for s, r, n in routes if s == self.spec.rank]
                agents = {}
                for receiver, _ in mine:
                    agent = self._loaded_peer(receiver)
                    agents[receiver] = (agent, tp.peer_info_of(agent))
                if layout == "granted":
                    self._raw_granted_send(out, mine, agents, requests, run_timeout_s, aligned)
                else:
                    self._raw_send(
                        out, mine, agents, requests, in_flight, start_at, run_timeout_s, aligned
                    )
            else:
                senders = [s for s, r, _ in routes if r == self.spec.rank]
                if layout == "granted":
                    granters = [self._loaded_peer(sender) for sender in senders]
                    self._raw_granted_receive(
                        out, granters, requests, in_flight, start_at, run_timeout_s
                    )
                else:
                    self._raw_receive(out, len(senders), requests, run_timeout_s)
        except Exception as error:
            out["error"] = f"{type(error).__name__}: {error}"
        finally:
            resume.set()
        return out

    def _raw_send(
        self,
        out: dict[str, Any],
        mine: list[tuple[int, int]],
        agents: Mapping[int, tuple[str, Any]],
        requests: int,
        in_flight: int,
        start_at: float,
        run_timeout_s: float,
        aligned: Sequence[Mapping[int, tuple[Any, Any, Any]]] = (),
    ) -> None:
        tp = self.worker.transport
        assert tp is not None
        local_bytes = max((n for _, n in mine), default=0)
        if local_bytes > tp.staging.numel():
            raise RuntimeError("a route does not fit this rank's staging buffer")
        pending: deque[tuple[int, list[Any]]] = deque()
        while time.time() < start_at:
            time.sleep(0.001)
        give_up = time.monotonic() + run_timeout_s
        for i in range(requests):
            while len(pending) >= in_flight:
                if not self._raw_reap(pending):
                    time.sleep(RAW_POLL_SLEEP_S)
                if time.monotonic() > give_up:
                    raise TimeoutError("raw WRITEs did not complete")
            out["issued"][i] = time.time()
            posted = []
            for receiver, nbytes in mine:
                agent, info = agents[receiver]
                notif = f"R|{i}|{self.spec.rank}".encode()
                if aligned:  # this request's fragments, pool to pool
                    route, src, dst = aligned[i][receiver]
                    pending_write = tp.post_fragments(agent, route, src, dst, notif, "raw", nbytes)
                    if pending_write is None:
                        tp.send_notif(agent, notif)
                    else:
                        posted.append(pending_write)
                    continue
                # Writers land in distinct parts of the receiver's staging where they fit.
                offset = self.spec.rank * nbytes
                if offset + nbytes > info.staging_bytes:
                    offset = 0
                remote = tp.desc(
                    np.array([info.staging_address + offset]), np.array([nbytes]), info.device_id
                )
                posted.append(
                    tp.post_write(agent, tp.local_staging_desc(0, nbytes), remote, notif, "raw")
                )
            pending.append((i, posted))
        while pending:
            if not self._raw_reap(pending):
                time.sleep(RAW_POLL_SLEEP_S)
            if time.monotonic() > give_up:
                raise TimeoutError("raw WRITEs did not complete")

    def _raw_reap(self, pending: deque[tuple[int, list[Any]]]) -> bool:
        """Drop completed requests from ``pending``; True when one completed."""
        tp = self.worker.transport
        assert tp is not None
        before = len(pending)
        for _ in range(before):
            i, posted = pending.popleft()
            if not all([tp.poll(p) for p in posted]):
                pending.append((i, posted))
        return len(pending) < before

    def _raw_receive(
        self, out: dict[str, Any], expected: int, requests: int, run_timeout_s: float
    ) -> None:
        counts: dict[int, int] = {}
        give_up = time.monotonic() + run_timeout_s
        while len(out["arrived"]) < requests:
            if not self._raw_arrivals(out, counts, expected):
                time.sleep(RAW_POLL_SLEEP_S)
            if time.monotonic() > give_up:
                raise TimeoutError(f"raw: {len(out['arrived'])} of {requests} requests arrived")

    def _loaded_peer(self, rank: int) -> str:
        """The NIXL agent of the peer instance's ``rank``, loaded into this rank's endpoint."""
        peer = self.worker.directory.peer(self.spec.peer, rank)
        assert peer is not None and self.worker.handover is not None
        self.worker.handover.peers.load(peer)
        return peer.agent

    def _raw_arrivals(self, out: dict[str, Any], counts: dict[int, int], expected: int) -> bool:
        """Raw receiver: count the ``R|i|s`` notifications that came; request ``i`` arrived
        with its ``expected``-th. Whether any notification came."""
        tp = self.worker.transport
        assert tp is not None
        notifications = tp.drain_notifications()
        for msgs in notifications.values():
            now = time.time()
            for msg in msgs:
                parts = msg.split(b"|")
                if parts[0] != b"R":
                    continue
                i = int(parts[1])
                counts[i] = counts.get(i, 0) + 1
                if counts[i] == expected:
                    out["arrived"][i] = now
        return bool(notifications)

    def _raw_granted_send(
        self,
        out: dict[str, Any],
        mine: list[tuple[int, int]],
        agents: Mapping[int, tuple[str, Any]],
        requests: int,
        run_timeout_s: float,
        aligned: Sequence[Mapping[int, tuple[Any, Any, Any]]],
    ) -> None:
        """Granted raw, sender: each grant ``G|i|r`` from receiver ``r`` is answered with one
        WRITE of request ``i``'s fragments to it (notification ``R|i|rank``)."""
        tp = self.worker.transport
        assert tp is not None
        receiver_of = {agents[r][0]: (r, n) for r, n in mine}
        left = requests * len(mine)
        pending: list[Any] = []
        give_up = time.monotonic() + run_timeout_s
        while left or pending:
            moved = False
            for agent, msgs in tp.drain_notifications().items():
                for msg in msgs:
                    parts = msg.split(b"|")
                    if parts[0] != b"G" or agent not in receiver_of:
                        continue
                    receiver, nbytes = receiver_of[agent]
                    i = int(parts[1])
                    route, src, dst = aligned[i][receiver]
                    notif = f"R|{i}|{self.spec.rank}".encode()
                    write = tp.post_fragments(agent, route, src, dst, notif, "raw", nbytes)
                    if write is None:
                        tp.send_notif(agent, notif)
                    else:
                        pending.append(write)
                    left -= 1
                    moved = True
            if pending:
                still = [p for p in pending if not tp.poll(p)]
                moved = moved or len(still) < len(pending)
                pending = still
            if not moved:
                time.sleep(RAW_POLL_SLEEP_S)
            if time.monotonic() > give_up:
                raise TimeoutError(f"raw, granted: {left} grant(s) never came")

    def _raw_granted_receive(
        self,
        out: dict[str, Any],
        senders: Sequence[str],
        requests: int,
        in_flight: int,
        start_at: float,
        run_timeout_s: float,
    ) -> None:
        """Granted raw, receiver: keeps ``in_flight`` requests granted (``G|i|rank`` to each of
        its senders, the time recorded as the request's issue) and records when the last
        sender's ``R|i|s`` arrived."""
        tp = self.worker.transport
        assert tp is not None
        counts: dict[int, int] = {}
        nxt = 0
        while time.time() < start_at:
            time.sleep(0.001)
        give_up = time.monotonic() + run_timeout_s
        while len(out["arrived"]) < requests:
            moved = False
            while nxt < requests and nxt - len(out["arrived"]) < in_flight:
                out["issued"][nxt] = time.time()
                for agent in senders:
                    tp.send_notif(agent, f"G|{nxt}|{self.spec.rank}".encode())
                nxt += 1
                moved = True
            if self._raw_arrivals(out, counts, len(senders)):
                moved = True
            if not moved:
                time.sleep(RAW_POLL_SLEEP_S)
            if time.monotonic() > give_up:
                raise TimeoutError(f"raw, granted: {len(out['arrived'])} of {requests} arrived")

    def handover_state(self) -> dict[str, Any]:
        """The handover's books, read on its progress thread: handles pending, staging bytes
        free (quarantined areas of failed transfers reclaimed when due) of the total."""
        handover = self.worker.handover
        assert handover is not None
        out: dict[str, Any] = {}
        done = threading.Event()

        def read() -> None:
            handover.areas.reclaim(time.monotonic())
            out.update(
                pending=handover.pending,
                staging_free=handover.areas.free_bytes,
                staging_total=handover.areas.nbytes,
                peers=list(handover.transport.peers),
            )
            done.set()

        handover.call_soon(read)
        if not done.wait(10):
            raise RuntimeError("the handover's progress thread did not answer")
        return out

    def hold_writes(self, seconds: float) -> None:
        """Fault injection: this rank's handover holds its grants or WRITEs ``seconds`` after
        each handle starts (a frozen peer); 0 undoes it."""
        assert self.worker.handover is not None
        self.worker.handover.hold(seconds)

    def stats(self, sweep: bool = False) -> dict[str, Any]:
        """Counters; with ``sweep`` (fill mode) first check every untouched pool byte."""
        w = self.worker
        swept = w.verify_untouched() if sweep and w.fill else 0
        self._release_held()
        held = sum(len(ids) for _, b in self._held for ids in b.values())
        return {
            "swept_bytes": swept,
            "rank": self.spec.rank,
            "sent": w.stats.sent,
            "received": w.stats.received,
            "failed": w.stats.failed,
            "verified_bytes": w.stats.verified_bytes,
            "errors": list(w.stats.errors[-5:]),
            "leaked": sum(c.leaked for c in self.caches.values()) - held,
            "quarantined": held,
            "records_pending": w.recorder.pending if w.recorder else None,
            "records_posted": w.recorder.posted if w.recorder else None,
            "duplicate_commands": w.duplicate_commands,
            "control_plane": w.client.url,
        }

    def flush_records(self, timeout_s: float = 10.0) -> bool:
        """Post every queued transfer record now; True when none is left (CPU accounting: a
        run's records belong to it, without waiting out the recorder's interval)."""
        recorder = self.worker.recorder
        return recorder.flush(timeout_s) if recorder is not None else True

    def profile(self, directory: str | None = None) -> str | None:
        """Profile this rank (yappi, CPU clock, every thread; yappi is not a dependency:
        ``pip install yappi``): with no ``directory`` start, else stop and write the pstats
        to ``<directory>/<role>-<rank>.pstat``."""
        import yappi

        if directory is None:
            yappi.clear_stats()
            yappi.set_clock_type("cpu")
            yappi.start(builtins=True)
            return None
        yappi.stop()
        path = str(Path(directory) / f"{self.spec.role}-{self.spec.rank}.pstat")
        yappi.get_func_stats().save(path, type="pstat")
        yappi.clear_stats()
        return path

    def threads(self) -> dict[int, str]:
        """This process's Python threads: native thread id → name (CPU accounting)."""
        return {int(t.native_id): t.name for t in threading.enumerate() if t.native_id}

    def stop(self) -> None:
        self.worker.stop()


def _rank_main(spec: RankSpec, conn: Connection) -> None:
    """A rank process: build the engine, then serve the driver's commands until ``stop``."""
    if spec.log_path:
        logging.basicConfig(
            filename=spec.log_path,
            level=logging.INFO,
            format="%(asctime)s %(name)s %(levelname)s %(message)s",
        )
        for name in QUIET_LOGGERS:  # a line per record batch and heartbeat otherwise
            logging.getLogger(name).setLevel(logging.WARNING)
        # A crash inside NIXL or UCX (SIGSEGV) leaves every thread's Python stack in the log.
        crash_log = open(spec.log_path, "a")  # noqa: SIM115 (open for the process's life)
        faulthandler.enable(crash_log, all_threads=True)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver stops us
    engine = None
    try:
        engine = EngineRank(spec)
        conn.send(("ok", {"rank": spec.rank, "pid": os.getpid()}))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    try:
        while True:
            try:
                command, args = conn.recv()
            except EOFError:
                return
            if command == "stop":
                return
            try:
                conn.send(("ok", getattr(engine, command)(**args)))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    finally:
        with contextlib.suppress(Exception):
            engine.stop()
        with contextlib.suppress(Exception):
            conn.send(("ok", "stopped"))


class _HostProcess:
    """A rank process started with ``ip netns exec`` (the ``multiprocessing.Process`` calls the
    driver uses)."""

    def __init__(self, spec: RankSpec, conn_fd: int) -> None:
        import json

        argv = [
            sys.executable,
            "-m",
            "workers.testing.engine",
            "--rank-fd",
            str(conn_fd),
            "--spec",
            json.dumps(asdict(spec)),
        ]
        if spec.netns:
            argv = ["ip", "netns", "exec", spec.netns, *argv]
        log_file = open(spec.log_path or os.devnull, "ab")  # noqa: SIM115 - closed on exit
        self.process = subprocess.Popen(
            argv,
            pass_fds=[conn_fd],
            cwd=REPO,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log_file.close()
        self.pid = self.process.pid

    def is_alive(self) -> bool:
        return self.process.poll() is None

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)


def _host_main(argv: Sequence[str]) -> None:
    """``python -m workers.testing.engine --rank-fd N --spec JSON``: a rank process on a host."""
    import argparse
    import json

    parser = argparse.ArgumentParser()
    parser.add_argument("--rank-fd", type=int, required=True)
    parser.add_argument("--spec", required=True)
    args = parser.parse_args(argv)
    _rank_main(RankSpec(**json.loads(args.spec)), Connection(args.rank_fd))


# --- the driver side: control plane, rank processes ------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ControlPlane:
    """``kvplane serve`` on a SQLite file, as its own process; can be stopped and restarted."""

    def __init__(
        self,
        workdir: Path,
        port: int | None = None,
        env: Mapping[str, str] | None = None,
        *,
        database: Path | None = None,
        host: str = "127.0.0.1",
        netns: str | None = None,
    ) -> None:
        self.workdir = workdir
        self.port = port or free_port()
        self.host = host
        self.netns = netns  # run inside this network namespace (``host``: its address)
        self.url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{self.port}"
        self.database = database or workdir / "kvplane.db"
        self.env = {
            **os.environ,
            "KVPLANE_DATABASE_URL": f"sqlite:///{self.database.resolve()}",
            "KVPLANE_AUTH": "false",
            **(env or {}),
        }
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self, timeout_s: float = 60.0) -> None:
        self.starts += 1
        with (self.workdir / f"server-{self.starts}.log").open("wb") as log_file:
            argv = [
                sys.executable,
                "-m",
                "cli",
                "serve",
                "--host",
                self.host,
                "--port",
                str(self.port),
            ]
            if self.netns and self.env.get("KVPLANE_AUTH") == "false":
                argv.append("--insecure")  # the bed's private bridge, no tokens (tests, benches)
            if self.netns:
                argv = ["ip", "netns", "exec", self.netns, *argv]
            self.process = subprocess.Popen(
                argv,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=REPO,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the control plane exited: {self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return
            time.sleep(0.1)
        raise TimeoutError(f"the control plane did not become ready: {self.log_tail()}")

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=5)

    def kill(self) -> None:
        """SIGKILL (a crash: no shutdown hooks, open streams and requests cut)."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)

    def log_tail(self, chars: int = 2000) -> str:
        path = self.workdir / f"server-{self.starts}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""


class Fleet:
    """A control plane, the demo fleet registered and paired, and one process per rank.

    ``servers``: several control-plane processes on one PostgreSQL database instead of the one
    SQLite server; every client (ranks included) gets all their URLs and fails over between
    them.
    """

    def __init__(
        self,
        workdir: Path,
        *,
        num_slots: int = 64,
        device: str = "cpu",
        fill: bool = False,
        staging_bytes: int = 64 << 20,
        chunk_blocks: int | None = None,
        server_env: Mapping[str, str] | None = None,
        database: Path | None = None,
        port: int | None = None,
        host: str = "127.0.0.1",
        hosts: Mapping[str, str] | None = None,
        ucx_tls: str | None = None,
        ucx_net_devices: str | None = None,
        servers: Sequence[ControlPlane] = (),
    ) -> None:
        """``hosts``: network namespace per role (``"control"``, ``"context"``,
        ``"generation"``); the control plane then listens on ``host`` inside its namespace.
        ``servers``: several control planes (API processes on one PostgreSQL) instead of one of
        its own."""
        self.workdir = workdir
        self.hosts = dict(hosts or {})
        self.ucx_tls = ucx_tls
        self.ucx_net_devices = ucx_net_devices
        self.num_slots = num_slots
        self.device = device
        self.fill = fill
        self.staging_bytes = staging_bytes
        self.chunk_blocks = chunk_blocks
        self.servers = list(servers) or [
            ControlPlane(
                workdir,
                port,
                env=server_env,
                database=database,
                host=host,
                netns=self.hosts.get("control"),
            )
        ]
        self.server = self.servers[0]
        self.url = ",".join(server.url for server in self.servers)
        self.client: Client | None = None
        self.pairing: dict[str, Any] = {}
        self.ranks: list[tuple[RankSpec, Any, Connection]] = []
        self.registrations = 0

    def start(self) -> None:
        for server in self.servers:
            server.start()
        self.client = Client(self.url, retries=3, backoff_s=0.2)
        self.register()
        started = self._spawn("context") + self._spawn("generation")
        for spec, _, conn in started:
            self._answer(spec, conn, START_TIMEOUT_S)
        self.call_all("sync")

    def register(self, role: str | None = None) -> None:
        """Register the demo instances (or one role's) and pair them. Each registration
        reports other pool base addresses, so a repeated one is a new epoch (as a restarted
        engine's would be)."""
        assert self.client is not None
        self.registrations += 1
        bodies = dict(
            zip(("context", "generation"), demo_bodies(num_slots=self.num_slots), strict=True)
        )
        for name, body in ((CONTEXT, bodies["context"]), (GENERATION, bodies["generation"])):
            if role is not None and name != (CONTEXT if role == "context" else GENERATION):
                continue
            for rank_body in body["ranks"]:
                for pool in rank_body["pools"]:
                    if self.registrations > 1:
                        pool["base_address"] = self.registrations << 40
            self.client.register_instance(name, body)
        self.pairing = self.client.create_pairing(CONTEXT, GENERATION)
        if not self.pairing["compatible"]:
            raise RuntimeError(f"pairing refused: {self.pairing['errors']}")

    def _spawn(self, role: str) -> list[tuple[RankSpec, Any, Connection]]:
        """Start one process per rank of ``role`` (on its host when the fleet has hosts)."""
        instance, peer = (CONTEXT, GENERATION) if role == "context" else (GENERATION, CONTEXT)
        ctx = mp.get_context("spawn")
        started = []
        for rank in range(WORLD[instance]):
            spec = RankSpec(
                url=self.url,
                instance=instance,
                rank=rank,
                role=role,
                peer=peer,
                device=self.device,
                fill=self.fill,
                staging_bytes=self.staging_bytes,
                chunk_blocks=self.chunk_blocks,
                log_path=str(self.workdir / f"{instance}-{rank}.log"),
                ucx_tls=self.ucx_tls,
                ucx_net_devices=self.ucx_net_devices,
                netns=self.hosts.get(role),
            )
            mine, theirs = ctx.Pipe()
            process: Any
            if spec.netns:
                process = _HostProcess(spec, theirs.fileno())
            else:
                process = ctx.Process(
                    target=_rank_main,
                    args=(spec, theirs),
                    daemon=True,
                    name=f"engine-{instance}-{rank}",
                )
                process.start()
            theirs.close()
            started.append((spec, process, mine))
        self.ranks.extend(started)
        return started

    def kill_role(self, role: str) -> list[int]:
        """SIGKILL every rank process of ``role`` (a host dies); their pids."""
        killed = [(spec, process, conn) for spec, process, conn in self.ranks if spec.role == role]
        for _, process, conn in killed:
            process.kill()
            process.join(timeout=10)
            conn.close()
        self.ranks = [r for r in self.ranks if r[0].role != role]
        return [process.pid for _, process, _ in killed]

    def restart_role(self, role: str) -> None:
        """A host comes back: its engine registers again (a new epoch), pairs, and every rank
        process starts; returns once every rank has its peers."""
        self.register(role)
        for spec, _, conn in self._spawn(role):
            self._answer(spec, conn, START_TIMEOUT_S)
        self.call_all("sync")

    def _answer(self, spec: RankSpec, conn: Connection, timeout_s: float) -> Any:
        if not conn.poll(timeout_s):
            raise TimeoutError(
                f"{spec.instance} rank {spec.rank} did not answer in "
                f"{timeout_s:.0f} s; log: {self.rank_log(spec)}"
            )
        status, value = conn.recv()
        if status != "ok":
            raise RuntimeError(f"{spec.instance} rank {spec.rank}: {value}")
        return value

    def rank_log(self, spec: RankSpec, chars: int = 2000) -> str:
        path = Path(spec.log_path or "")
        return path.read_text(errors="replace")[-chars:] if path.is_file() else ""

    def call_all(self, command: str, wait_s: float = 300.0, **args: Any) -> list[Any]:
        """Send one command to every rank, then collect the answers (rank order); ``args``
        are the command's (``timeout_s`` included)."""
        for _, _, conn in self.ranks:
            conn.send((command, args))
        return [self._answer(spec, conn, wait_s) for spec, _, conn in self.ranks]

    def call_role(self, role: str, command: str, wait_s: float = 300.0, **args: Any) -> list[Any]:
        """:meth:`call_all`, for the ranks of one role only."""
        mine = [(spec, conn) for spec, _, conn in self.ranks if spec.role == role]
        for _, conn in mine:
            conn.send((command, args))
        return [self._answer(spec, conn, wait_s) for spec, conn in mine]

    def pids(self) -> dict[str, list[int]]:
        """Process ids: ``{"ranks": [...], "server": [...]}`` (for CPU accounting)."""
        return {
            "ranks": [process.pid for _, process, _ in self.ranks],
            "server": [s.process.pid for s in self.servers if s.process is not None],
        }

    def run_engine(
        self,
        *,
        requests: int,
        blocks: int,
        in_flight: int,
        seed: int = 1,
        tag: str | None = None,
        start_delay_s: float = 0.3,
        start_at: float | None = None,
        **options: Any,
    ) -> EngineRun:
        """Every rank runs the engine loop over the same requests; the combined account.
        The ranks start together at ``start_at`` (``time.time()``; default ``start_delay_s``
        from now)."""
        tag = tag or f"e{seed}-{blocks}x{in_flight}-{time.time_ns() % 10**9}"
        results = self.call_all(
            "run",
            requests=requests,
            blocks=blocks,
            in_flight=in_flight,
            seed=seed,
            tag=tag,
            start_at=time.time() + start_delay_s if start_at is None else start_at,
            **options,
        )
        return EngineRun(tag, requests, [RunResult(**r) for r in results])

    def run_raw(
        self,
        *,
        requests: int,
        blocks: int,
        in_flight: int,
        seed: int = 1,
        start_delay_s: float = 0.3,
        start_at: float | None = None,
        layout: str = "staging",
    ) -> RawRun:
        results = self.call_all(
            "raw",
            requests=requests,
            blocks=blocks,
            in_flight=in_flight,
            seed=seed,
            start_at=time.time() + start_delay_s if start_at is None else start_at,
            layout=layout,
        )
        return RawRun(
            requests, [(spec.role, r) for (spec, _, _), r in zip(self.ranks, results, strict=True)]
        )

    def stop(self) -> None:
        for _, _, conn in self.ranks:
            with contextlib.suppress(Exception):
                conn.send(("stop", {}))
        for _, process, conn in self.ranks:
            with contextlib.suppress(Exception):
                if conn.poll(20):
                    conn.recv()
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
        self.ranks = []
        if self.client is not None:
            self.client.close()
        for server in self.servers:
            server.stop()


# --- what a run tells -----------------------------------------------------------------------


def cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU seconds of these processes so far (all their threads; Linux)."""
    total = 0.0
    ticks = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / ticks
    return total


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if len(values) else float("nan")


def run_rest(
    url: str,
    *,
    requests: int,
    blocks: int,
    in_flight: int,
    num_slots: int,
    seed: int,
    tag: str,
    verify: bool = False,
) -> dict[str, Any]:
    """The REST path as a router drives it: ``in_flight`` client threads, each ``POST
    /v1/transfers?wait=30`` (``execute``: answered once the transfer settled, in one round
    trip) in turn, over its own block lane; ``GET ?wait=`` only if it had not settled."""
    latencies: list[float] = []
    errors: list[str] = []
    retries: list[str] = []
    starts: list[float] = []
    ends: list[float] = []
    lock = threading.Lock()
    counter = iter(range(requests))

    def client(lane: int) -> None:
        pairs = request_blocks(seed, lane, blocks, num_slots)
        body_blocks = {str(g): {"context": c, "generation": r} for g, (c, r) in pairs.items()}
        with httpx.Client(base_url=url, timeout=60) as http:
            while True:
                with lock:
                    k = next(counter, None)
                if k is None:
                    return
                t0 = time.time()
                try:
                    for attempt in range(REST_RETRIES + 1):
                        created = http.post(
                            "/v1/transfers",
                            params={"wait": 30},
                            json={
                                "context": CONTEXT,
                                "generation": GENERATION,
                                "request_id": f"{tag}-{k}",
                                "blocks": body_blocks,
                                "execute": True,
                                "verify": verify,
                            },
                        )
                        if created.status_code != 503 or attempt == REST_RETRIES:
                            break
                        # As a client should: 503 (SQLite busy) says when to come back.
                        with lock:
                            retries.append(created.json().get("code", "503"))
                        time.sleep(float(created.headers.get("Retry-After", "0.1") or 0.1))
                    created.raise_for_status()
                    done = created
                    while done.json()["status"] in ("queued", "running"):
                        done = http.get(f"/v1/transfers/{done.json()['id']}", params={"wait": 30})
                        done.raise_for_status()
                    status = done.json()["status"]
                    if status != "done":
                        status = f"{status}: {done.json().get('error')}"
                except httpx.HTTPError as error:
                    status = f"{type(error).__name__}: {error}"
                t1 = time.time()
                with lock:
                    starts.append(t0)
                    ends.append(t1)
                    if status == "done":
                        latencies.append(t1 - t0)
                    else:
                        errors.append(str(status)[:200])

    threads = [threading.Thread(target=client, args=(c,)) for c in range(in_flight)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {
        "latencies": latencies,
        "errors": errors,
        "retries": retries,
        "throughput": requests / max(max(ends) - min(starts), 1e-9),
    }


@dataclass
class EngineRun:
    """The combined account of one engine-loop run over every rank."""

    tag: str
    requests: int
    ranks: list[RunResult]

    @property
    def leaked(self) -> int:
        return sum(r.leaked for r in self.ranks)

    @property
    def quarantined(self) -> int:
        return sum(r.quarantined for r in self.ranks)

    @property
    def failures(self) -> dict[str, str]:
        """``{f"{role} rank {r} request {i}": reason}`` of every failed handle."""
        return {
            f"{r.role} rank {r.rank} request {rec[0]}": str(rec[4])
            for r in self.ranks
            for rec in r.records
            if rec[3] == "failed"
        }

    @property
    def stalled(self) -> dict[str, list[int]]:
        return {f"{r.role} rank {r.rank}": r.stalled for r in self.ranks if r.stalled}

    @property
    def complete(self) -> bool:
        return all(len(r.records) == self.requests for r in self.ranks)

    def latencies_s(self) -> list[float]:
        """Per request: last generation handle arrived − last rank's issue (successes only)."""
        issued: dict[int, float] = {}
        arrived: dict[int, float] = {}
        failed: set[int] = set()
        for r in self.ranks:
            for index, t_issue, t_done, state, _ in r.records:
                issued[index] = max(issued.get(index, 0.0), t_issue)
                if state == "failed":
                    failed.add(index)
                if r.role == "generation":
                    arrived[index] = max(arrived.get(index, 0.0), t_done)
        return [arrived[i] - issued[i] for i in sorted(arrived) if i not in failed]

    def throughput(self) -> float:
        """Requests per second: all requests over first issue → last outcome of any rank."""
        first = min(rec[1] for r in self.ranks for rec in r.records)
        last = max(rec[2] for r in self.ranks for rec in r.records)
        return self.requests / max(last - first, 1e-9)


@dataclass
class RawRun:
    requests: int
    ranks: list[tuple[str, dict[str, Any]]]

    @property
    def errors(self) -> list[str]:
        return [r["error"] for _, r in self.ranks if r.get("error")]

    def latencies_s(self) -> list[float]:
        """Per request: the last receiver's last notification − the last issue (a sender's post,
        or in the granted layout a receiver's grant)."""
        issued: dict[int, float] = {}
        arrived: dict[int, float] = {}
        for role, r in self.ranks:
            for i, t in r["issued"].items():
                issued[int(i)] = max(issued.get(int(i), 0.0), t)
            if role != "context":
                for i, t in r["arrived"].items():
                    arrived[int(i)] = max(arrived.get(int(i), 0.0), t)
        return [arrived[i] - issued[i] for i in sorted(arrived) if i in issued]

    def throughput(self) -> float:
        starts = [t for _, r in self.ranks for t in r["issued"].values()]
        ends = [t for role, r in self.ranks if role != "context" for t in r["arrived"].values()]
        return self.requests / max(max(ends) - min(starts), 1e-9)


if __name__ == "__main__":
    _host_main(sys.argv[1:])


__all__ = [
    "CONTEXT",
    "GENERATION",
    "BlockCache",
    "CacheError",
    "ControlPlane",
    "EngineRank",
    "EngineRun",
    "Fleet",
    "RankSpec",
    "RawRun",
    "RunResult",
    "arrivals",
    "cpu_seconds",
    "demo_bodies",
    "free_port",
    "percentile",
    "request_blocks",
    "run_rest",
]
