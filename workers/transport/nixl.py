"""NIXL transport: one agent per worker (UCX), pools and a staging buffer registered with it.

Lifecycle of a worker's :class:`NixlTransport`:

1. construct with the rank's pools: the agent registers every pool tensor and a staging buffer
   (same device as the pools, so VRAM pools stay VRAM end to end);
2. publish :meth:`NixlTransport.peer_info` (agent metadata, base64 in JSON, plus pool and staging
   addresses) through the control plane; peers :meth:`add_peer` it. Re-registering memory
   changes the metadata, so publish after construction and never before;
3. staged path: the sender :meth:`write_staged` — gather a chunk of blocks into its own staging
   buffer, one NIXL WRITE of that chunk into the receiver's staging area at the writer's exact
   offset with a notification ``<tag>|<chunk>|<chunks>``, gather the next chunk while it flies; the
   receiver :meth:`receive_staged` scatters each chunk as its notification arrives;
4. per-fragment path: :meth:`post_fragments` (the handover's) and :meth:`write_fragments` post
   one descriptor per fragment straight into the receiver's pools (no staging, no receiver
   copy), from descriptor lists prepared once per route and peer;
5. a restarted peer comes back with a new agent: :meth:`remove_peer` the old one, add the new;
6. :meth:`close` releases handles, drops peers and deregisters memory.

UCX settings are explicit options, never a hidden environment: ``ucx_tls`` (UCX's transport list,
e.g. ``"tcp"`` so that bytes between two processes of one machine cross its network instead of
shared memory / CMA) and ``ucx_net_devices`` (the network devices every UCX transport may use,
e.g. ``"data0"`` or ``"mlx5_0:1"``). UCX reads both from the process's environment when NIXL
creates the backend's UCX context, so they are set as ``UCX_TLS`` / ``UCX_NET_DEVICES`` for the
duration of that call and restored afterwards. NIXL's own device parameter is not used: NIXL 1.5
reads ``device_list`` (later versions also ``ucx_devices``) and passes every name on as
``<name>:1``, an RDMA port, which no TCP device (``data0``) matches. Unset, the process's
``UCX_TLS`` / ``UCX_NET_DEVICES`` apply, and without those UCX's defaults (every transport, every
device). :attr:`ucx` says what this endpoint runs with; a worker reports it to the control plane.

A peer that disappears (its host died, the network broke) shows in two ways: a WRITE to it ends
in NIXL's error state or ``check_xfer_state`` raises (``nixlRemoteDisconnectError``), both a
:class:`PeerUnreachable`; or, while the link is merely down, the WRITE stays in progress until
TCP gives up (``net.ipv4.tcp_retries2``), so every wait has a deadline. Once UCX failed a
connection, every later WRITE and notification over it fails or is lost silently: :meth:`reset_peer`
drops and reloads the peer so the next transfer opens a new connection.

Every wait has a deadline and raises :class:`~workers.transport.TransferTimeout`; a transfer in
NIXL's error state raises :class:`~workers.transport.TransportError`.
"""

from __future__ import annotations

import base64
import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from workers.executors import (
    FRAGMENT_TABLE_MAX,
    BlockRangeError,
    Blocks,
    FragmentTable,
    Route,
    StagingChunk,
    as_route,
    check_ids,
    check_template,
    expand_fragments,
    fragment_indices,
    fragment_tables,
    gather,
    normalize_blocks,
    scatter,
    staging_layout,
)
from workers.pools import Pool, PoolSpec
from workers.transport import (
    PeerUnreachable,
    TransferCancelled,
    TransferTimeout,
    TransportError,
    ucx_log,
)

if TYPE_CHECKING:
    import torch

DEFAULT_TIMEOUT_S = 30.0
_SPIN_S = 0.002  # busy-poll this long before sleeping between polls: small transfers finish fast
_POLL_SLEEP_S = 0.0002
PREPARED_LISTS_MAX = 512  # prepared descriptor lists kept (per route and peer)
INBOX_LIMIT = 1 << 16  # notifications kept per peer (a staged route sends one per chunk)
UCX_DEFAULT = "default"  # what :attr:`NixlTransport.ucx` says for a setting UCX chooses itself
# UCX reads UCX_TLS and UCX_NET_DEVICES when a backend is created: one creation at a time may
# change them.
_UCX_ENV_LOCK = threading.Lock()


@dataclass(frozen=True)
class UcxSettings:
    """The UCX settings an endpoint was created with (``default``: UCX chooses)."""

    tls: str = UCX_DEFAULT
    net_devices: str = UCX_DEFAULT

    def to_json(self) -> dict[str, str]:
        return {"backend": "UCX", "tls": self.tls, "net_devices": self.net_devices}


def _disconnected(error: BaseException) -> bool:
    """Whether a NIXL exception says the peer is gone (``nixlRemoteDisconnectError`` & co.)."""
    text = f"{type(error).__name__} {error}".lower()
    return "disconnect" in text or "unreach" in text or "connection reset" in text


@dataclass(frozen=True)
class PeerPool:
    """A remote pool as the peer published it: its spec and base address."""

    spec: PoolSpec
    base_address: int

    @property
    def id(self) -> int:
        return self.spec.id


@dataclass(frozen=True)
class PeerInfo:
    """What a worker publishes about its NIXL endpoint (travels through the control plane)."""

    agent: str
    metadata: bytes
    mem_type: str  # "DRAM" | "VRAM"
    device_id: int
    pools: Mapping[int, PeerPool]
    staging_address: int
    staging_bytes: int
    ucx: UcxSettings | None = None

    def to_json(self) -> dict[str, Any]:
        """JSON-able form; the agent metadata is base64."""
        return {
            "agent": self.agent,
            "metadata_b64": base64.b64encode(self.metadata).decode("ascii"),
            "mem_type": self.mem_type,
            "device_id": self.device_id,
            "pools": [
                {
                    "id": p.spec.id,
                    "layer_group": p.spec.layer_group,
                    "slot_bytes": p.spec.slot_bytes,
                    "slot_stride_bytes": p.spec.slot_stride_bytes,
                    "num_slots": p.spec.num_slots,
                    "base_address": p.base_address,
                }
                for p in self.pools.values()
            ],
            "staging": {"address": self.staging_address, "bytes": self.staging_bytes},
            **({"ucx": self.ucx.to_json()} if self.ucx is not None else {}),
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> PeerInfo:
        pools = {
            int(p["id"]): PeerPool(PoolSpec.from_dict(p), int(p["base_address"]))
            for p in d["pools"]
        }
        return cls(
            agent=str(d["agent"]),
            metadata=base64.b64decode(d["metadata_b64"]),
            mem_type=str(d["mem_type"]),
            device_id=int(d["device_id"]),
            pools=pools,
            staging_address=int(d["staging"]["address"]),
            staging_bytes=int(d["staging"]["bytes"]),
            ucx=UcxSettings(str(d["ucx"]["tls"]), str(d["ucx"]["net_devices"]))
            if d.get("ucx")
            else None,
        )


@dataclass
class PendingWrite:
    handle: Any
    what: str
    nbytes: int = 0
    done: bool = field(default=False)
    agent: str = ""


def _device_of(t: torch.Tensor) -> tuple[str, int]:
    if t.device.type == "cuda":
        return "VRAM", int(t.device.index or 0)
    return "DRAM", 0


def _sync(t: torch.Tensor) -> None:
    if t.device.type == "cuda":
        import torch

        torch.cuda.current_stream(t.device).synchronize()


class NixlTransport:
    """A worker's NIXL endpoint: registered pools + staging, peers, staged and fragment writes."""

    def __init__(
        self,
        name: str,
        pools: Mapping[int, Pool],
        *,
        staging_bytes: int,
        backends: Iterable[str] = ("UCX",),
        num_threads: int = 0,
        progress_thread: bool = True,
        ucx_tls: str | None = None,
        ucx_net_devices: str | None = None,
    ) -> None:
        import torch
        from nixl._api import nixl_agent, nixl_agent_config

        if not pools:
            raise ValueError("a NIXL transport needs at least one pool")
        self.name = name
        self.pools = dict(pools)
        devices = {p.device for p in self.pools.values()}
        if len(devices) != 1:
            raise ValueError(f"pools span several devices: {sorted(map(str, devices))}")
        device = devices.pop()
        self.staging = torch.zeros(max(int(staging_bytes), 1), dtype=torch.uint8, device=device)
        self.mem_type, self.device_id = _device_of(self.staging)
        # NIXL's progress thread is required for correctness here: a WRITE into this agent must
        # complete while this agent's owner is not polling it (a receiver whose handover loop
        # sleeps between polls or is busy with another handle, or a caller that calls
        # receive_staged only after the writer's write_staged returned; without the thread such
        # a WRITE times out, see test_nixl.py). It polls
        # without sleeping, which costs a core: on the 2-core dev host a raw WRITE ran at 2.0
        # GB/s without it, 0.8 with it (bench/transfer.py --no-progress-thread).
        backends = list(backends)
        cfg = nixl_agent_config(
            enable_prog_thread=progress_thread,
            backends=[b for b in backends if b != "UCX"],
            num_threads=num_threads,
        )
        # UCX's log says which transports it picks per peer (ucx_log.py); it must be set up
        # before the process's first agent loads UCX.
        self._ucx_log = ucx_log.setup() if "UCX" in backends else None
        self._ucx_log_mark = self._ucx_log.mark() if self._ucx_log is not None else 0
        self._agent = nixl_agent(name, cfg)
        self.ucx = UcxSettings()
        self._ucx_args = (ucx_tls, ucx_net_devices)
        if "UCX" in backends:
            self.ucx = self._create_ucx(ucx_tls, ucx_net_devices, num_threads)
        self._regs = [self._agent.register_memory(p.tensor) for p in self.pools.values()]
        self._regs.append(self._agent.register_memory(self.staging))
        self._peers: dict[str, PeerInfo] = {}
        self._inbox: dict[str, list[bytes]] = {}
        self._outstanding: dict[str, int] = {}  # posted WRITEs not yet released, per peer
        # Per-fragment path, by (peer agent, route fingerprint): both sides' fragment tables
        # (None: too large to prepare), and NIXL prepared descriptor lists ("": this worker's)
        self._tables: dict[tuple[str, str], tuple[FragmentTable, FragmentTable] | None] = {}
        self._prepped: dict[tuple[str, str], Any] = {}
        # A route whose tables would hold more descriptors than this posts each request's own
        self.fragment_table_max = FRAGMENT_TABLE_MAX
        self._closed = False
        # After UCX failed a connection, post and send_notif load the peer again on the spot
        # (blocking while the peer is unreachable). A Handover turns that off and reloads
        # peers itself once a probe reaches them (workers/handover/reloads.py).
        self.reconnect_inline = True
        self._probe_agent: Any = None  # probe_peer's own agent, created on first use
        self._probes = 0  # probe agents created
        self._probe_lock = threading.Lock()
        # Set by the owner (the worker) when the control plane withdrew the current job: every
        # wait then stops at its next poll instead of running into its deadline.
        self.cancel = threading.Event()

    def _create_ucx(
        self, tls: str | None, net_devices: str | None, num_threads: int, agent: Any = None
    ) -> UcxSettings:
        import os

        init: dict[str, str] = {}
        if num_threads > 0:
            init["num_threads"] = str(num_threads)
        chosen = {"UCX_TLS": tls, "UCX_NET_DEVICES": net_devices}
        with _UCX_ENV_LOCK:
            before = {key: os.environ.get(key) for key in chosen}
            try:
                for key, value in chosen.items():
                    if value:
                        os.environ[key] = value
                (agent or self._agent).create_backend("UCX", init)
            finally:
                for key, value in before.items():
                    if value is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = value
        return UcxSettings(
            tls=tls or before["UCX_TLS"] or UCX_DEFAULT,
            net_devices=net_devices or before["UCX_NET_DEVICES"] or UCX_DEFAULT,
        )

    def ucx_in_use(self) -> dict[str, Any] | None:
        """What UCX actually uses for this endpoint's peer connections so far, from UCX's log
        (:func:`workers.transport.ucx_log.summarize`; None: no connection yet, or unknown).
        Reads a file: call it off the hot path."""
        if self._ucx_log is None:
            return None
        return self._ucx_log.report(self.name, since=self._ucx_log_mark)

    # --- peers ---------------------------------------------------------------------------

    def peer_info(self) -> PeerInfo:
        """This endpoint as peers need it (call after construction; metadata covers all regs)."""
        return PeerInfo(
            agent=self.name,
            metadata=bytes(self._agent.get_agent_metadata()),
            mem_type=self.mem_type,
            device_id=self.device_id,
            pools={pid: PeerPool(p.spec, p.base_address) for pid, p in self.pools.items()},
            staging_address=int(self.staging.data_ptr()),
            staging_bytes=int(self.staging.numel()),
            ucx=self.ucx,
        )

    def add_peer(self, info: PeerInfo | Mapping[str, Any]) -> str:
        """Load a peer's metadata (a ``PeerInfo`` or its JSON); replaces a same-named peer."""
        if not isinstance(info, PeerInfo):
            info = PeerInfo.from_json(info)
        if info.agent in self._peers:
            self.remove_peer(info.agent)
        try:
            loaded = self._agent.add_remote_agent(info.metadata)
        except Exception as e:  # nixl raises its own binding errors
            raise TransportError(f"cannot load metadata of peer {info.agent!r}: {e}") from e
        name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if name != info.agent:
            self._agent.remove_remote_agent(name)
            raise TransportError(f"peer metadata names agent {name!r}, expected {info.agent!r}")
        self._peers[name] = info
        return name

    def remove_peer(self, agent: str) -> None:
        """Forget a peer (e.g. it restarted with a new agent); unknown names are ignored."""
        self._release_prepared([k for k in self._prepped if k[0] == agent])
        for key in [k for k in self._tables if k[0] == agent]:  # its pools may differ next time
            del self._tables[key]
        if self._peers.pop(agent, None) is not None:
            try:
                self._agent.remove_remote_agent(agent)
            except Exception as e:
                raise TransportError(f"cannot drop peer {agent!r}: {e}") from e
        self._inbox.pop(agent, None)

    def reset_peer(self, agent: str) -> bool:
        """Drop and reload a known peer: the next WRITE or notification to it opens a new
        connection (after UCX failed the old one, everything sent over it is lost). False when
        the peer is unknown or its metadata cannot be loaded again."""
        info = self._peers.get(agent)
        if info is None:
            return False
        inbox = self._inbox.get(agent)
        with contextlib.suppress(TransportError):
            self.remove_peer(agent)
        try:
            self.add_peer(info)
        except TransportError:
            return False
        if inbox:
            self._inbox[agent] = inbox
        return True

    def outstanding(self, agent: str) -> int:
        """WRITEs to ``agent`` posted and not yet released."""
        return self._outstanding.get(agent, 0)

    def probe_peer(
        self, info: PeerInfo | Mapping[str, Any], note: bytes | None = None
    ) -> str | None:
        """Whether a peer (its ``PeerInfo`` or JSON) answers now: None when it does, else the
        error.

        The probe loads the peer's metadata into an agent of its own (same UCX settings, no
        memory), which connects to the peer, and drops it again: nothing of this endpoint waits
        on it, and no request of this endpoint rides on the probe's connection. It blocks for as
        long as the network takes to answer (seconds for an unreachable host): call it off the
        progress thread. One probe at a time per endpoint. ``note``: a notification the probe
        sends the peer once connected (it is given up to 50 ms to leave)."""
        if not isinstance(info, PeerInfo):
            info = PeerInfo.from_json(info)
        with self._probe_lock:
            if self._closed:
                return "the endpoint is closed"
            try:
                if self._probe_agent is None:
                    from nixl._api import nixl_agent, nixl_agent_config

                    self._probes += 1
                    self._probe_agent = nixl_agent(
                        f"{self.name}.probe{self._probes}",
                        nixl_agent_config(enable_prog_thread=False, backends=[]),
                    )
                    self._create_ucx(*self._ucx_args, 0, agent=self._probe_agent)
                name = self._probe_agent.add_remote_agent(info.metadata)
            except Exception as e:  # nixl raises its own binding errors
                # A load that failed half way leaves the agent unable to load that peer again
                # (NIXL_ERR_BACKEND on every later try, also once the peer answers): the next
                # probe starts from a new agent.
                if self._probe_agent is not None:
                    with contextlib.suppress(Exception):
                        self._probe_agent.remove_remote_agent(info.agent)
                self._probe_agent = None
                return f"{type(e).__name__}: {e}"
            name = name.decode() if isinstance(name, bytes) else str(name)
            if note is not None:
                with contextlib.suppress(Exception):
                    self._probe_agent.send_notif(name, note)
                    for _ in range(25):  # no progress thread: progress it until the note left
                        self._probe_agent.get_new_notifs()
                        time.sleep(0.002)
            with contextlib.suppress(Exception):
                self._probe_agent.remove_remote_agent(name)
            return None

    def has_peer(self, agent: str) -> bool:
        """Whether ``agent``'s metadata is loaded (a failed :meth:`reset_peer` drops it)."""
        return agent in self._peers

    @property
    def peers(self) -> tuple[str, ...]:
        return tuple(self._peers)

    def _peer(self, agent: str) -> PeerInfo:
        try:
            return self._peers[agent]
        except KeyError:
            raise TransportError(f"unknown peer {agent!r}; add_peer() its metadata first") from None

    # --- low level -----------------------------------------------------------------------

    def _post(
        self, peer: PeerInfo, local: np.ndarray, remote: np.ndarray, notif: bytes, what: str
    ) -> PendingWrite:
        def make(info: PeerInfo) -> Any:
            ld = self._agent.get_xfer_descs(local, self.mem_type)
            rd = self._agent.get_xfer_descs(remote, info.mem_type)
            return self._agent.initialize_xfer("WRITE", ld, rd, info.agent, notif)

        return self._post_with(peer, make, int(local[:, 1].sum()), what)

    def _post_with(
        self, peer: PeerInfo, make: Callable[[PeerInfo], Any], nbytes: int, what: str
    ) -> PendingWrite:
        try:
            return self._post_once(peer, make, nbytes, what)
        except PeerUnreachable:
            # A connection UCX already failed refuses every post. Nothing of this WRITE left,
            # and with nothing else in flight to the peer a new connection costs nothing lost.
            if (
                not self.reconnect_inline
                or self._outstanding.get(peer.agent)
                or not self.reset_peer(peer.agent)
            ):
                raise
            return self._post_once(peer, make, nbytes, what)

    def _post_once(
        self, peer: PeerInfo, make: Callable[[PeerInfo], Any], nbytes: int, what: str
    ) -> PendingWrite:
        h = None
        try:
            h = make(peer)
            state = self._agent.transfer(h)
        except Exception as e:
            if h is not None:
                with contextlib.suppress(Exception):
                    h.release()
            kind = PeerUnreachable if _disconnected(e) else TransportError
            raise kind(f"{what}: NIXL refused the WRITE to {peer.agent!r}: {e}") from e
        if state == "ERR":
            with contextlib.suppress(Exception):
                h.release()
            raise TransportError(f"{what}: NIXL WRITE to {peer.agent!r} failed on post")
        self._outstanding[peer.agent] = self._outstanding.get(peer.agent, 0) + 1
        return PendingWrite(h, what, nbytes, agent=peer.agent)

    def _prepared(self, peer: PeerInfo | None, key: str, table: FragmentTable) -> Any:
        """The NIXL prepared descriptor list of ``table`` on this worker (``peer`` None) or on
        ``peer``, built on first use and kept until the peer is dropped."""
        agent = "" if peer is None else peer.agent
        handle = self._prepped.get((agent, key))
        if handle is not None:
            return handle
        rows = []
        for pool, offsets, lengths in table.entries:
            if peer is None:
                rows.append(
                    self._desc(self.pools[pool].base_address + offsets, lengths, self.device_id)
                )
            else:
                rows.append(
                    self._desc(peer.pools[pool].base_address + offsets, lengths, peer.device_id)
                )
        descs = np.concatenate(rows) if rows else np.zeros((0, 3), dtype=np.uint64)
        handle = self._agent.prep_xfer_dlist(
            agent, descs, self.mem_type if peer is None else peer.mem_type
        )
        self._prepped[(agent, key)] = handle
        if len(self._prepped) > PREPARED_LISTS_MAX:  # plans that changed long ago
            self._release_prepared([next(iter(self._prepped))])
        return handle

    def _release_prepared(self, keys: Iterable[tuple[str, str]]) -> None:
        for k in list(keys):
            handle = self._prepped.pop(k, None)
            if handle is not None:
                with contextlib.suppress(Exception):
                    handle.release()

    def _poll(self, p: PendingWrite) -> bool:
        if p.done:
            return True
        try:
            state = self._agent.check_xfer_state(p.handle)
        except Exception as e:  # e.g. nixlRemoteDisconnectError: NIXL raises instead of "ERR"
            self._release(p)
            raise PeerUnreachable(f"{p.what}: {type(e).__name__}: {e}") from e
        if state == "ERR":
            self._release(p)
            raise PeerUnreachable(f"{p.what}: transfer entered NIXL's error state")
        if state == "DONE":
            self._release(p)
            return True
        return False

    def _release(self, p: PendingWrite) -> None:
        if not p.done:
            p.done = True
            if self._outstanding.get(p.agent, 0) > 1:
                self._outstanding[p.agent] -= 1
            else:
                self._outstanding.pop(p.agent, None)
            # An in-flight handle NIXL cannot cancel is leaked rather than masking the real error.
            with contextlib.suppress(Exception):
                p.handle.release()

    def _wait(self, pending: list[PendingWrite], deadline: float) -> None:
        t_spin = time.monotonic() + _SPIN_S
        try:
            while True:
                if all([self._poll(p) for p in pending]):
                    return
                if self.cancel.is_set():
                    raise TransferCancelled("the job was withdrawn while writes were in flight")
                now = time.monotonic()
                if now > deadline:
                    left = [p.what for p in pending if not p.done]
                    raise TransferTimeout(f"timed out waiting for {len(left)} write(s): {left[:3]}")
                if now > t_spin:
                    time.sleep(_POLL_SLEEP_S)
        finally:
            for p in pending:
                self._release(p)

    def _desc(self, addr: np.ndarray, length: np.ndarray, device_id: int) -> np.ndarray:
        out = np.empty((addr.size, 3), dtype=np.uint64)
        out[:, 0], out[:, 1], out[:, 2] = addr, length, device_id
        return out

    def _staging_desc(self, offset: int, nbytes: int) -> np.ndarray:
        return self._desc(
            np.array([self.staging.data_ptr() + offset]), np.array([nbytes]), self.device_id
        )

    # --- non-blocking API (the hot path's progress loop) ----------------------------------

    def post_write(
        self, peer: str, local: np.ndarray, remote: np.ndarray, notif: bytes, what: str
    ) -> PendingWrite:
        """Post one WRITE (descriptor arrays ``[addr, len, dev]``) with a notification."""
        return self._post(self._peer(peer), local, remote, notif, what)

    def post_fragments(
        self,
        peer: str,
        route: Route | Mapping[str, Any],
        src_blocks: Blocks,
        dst_blocks: Blocks,
        notif: bytes,
        what: str,
        nbytes: int | None = None,
    ) -> PendingWrite | None:
        """Post one WRITE of every fragment of these (aligned) block lists, pool to pool, with
        ``notif``; None when there is no fragment (nothing posted). ``nbytes``: the bytes they
        hold, when the caller knows them already (else computed).

        The descriptors come from NIXL lists prepared once per route and peer over every slot's
        fragments (:func:`~workers.executors.fragment_tables`): a request names its fragments
        by index, with no addresses to compute or look up. A route whose tables would be larger
        than ``fragment_table_max`` (``FRAGMENT_TABLE_MAX``) posts this request's descriptors
        instead. Raises :class:`BlockRangeError` for a block id outside its pool.
        """
        info = self._peer(peer)
        route = as_route(route)
        key = (info.agent, route.fingerprint)
        if key not in self._tables:
            self._tables[key] = fragment_tables(
                route,
                {pid: p.spec for pid, p in self.pools.items()},
                {pid: p.spec for pid, p in info.pools.items()},
                limit=self.fragment_table_max,
            )
        tables = self._tables[key]
        if tables is None:
            frags = expand_fragments(route, self.pools, info.pools, src_blocks, dst_blocks)
            locs, rems = [], []
            for (sp_id, dp_id), (so, do, ln) in frags.items():
                locs.append(self._desc(self.pools[sp_id].base_address + so, ln, self.device_id))
                rems.append(self._desc(info.pools[dp_id].base_address + do, ln, info.device_id))
            if not locs or not sum(len(x) for x in locs):
                return None
            return self._post(info, np.concatenate(locs), np.concatenate(rems), notif, what)
        local_idx, remote_idx = fragment_indices(route, tables, src_blocks, dst_blocks)
        if not local_idx.size:
            return None

        def make(peer_info: PeerInfo) -> Any:
            local = self._prepared(None, route.fingerprint, tables[0])
            remote = self._prepared(peer_info, route.fingerprint, tables[1])
            return self._agent.make_prepped_xfer(
                "WRITE", local, local_idx, remote, remote_idx, notif
            )

        if nbytes is None:
            nbytes = staging_layout(route, src_blocks).nbytes
        return self._post_with(info, make, nbytes, what)

    def poll(self, pending: PendingWrite) -> bool:
        """Whether ``pending`` completed; raises :class:`TransportError` on NIXL's error."""
        return self._poll(pending)

    def release(self, pending: PendingWrite) -> None:
        """Release a posted WRITE's handle (idempotent)."""
        self._release(pending)

    def drain_notifications(self) -> dict[str, list[bytes]]:
        """Every notification that arrived since the last call, by sending agent."""
        out: dict[str, list[bytes]] = {}
        for agent, msgs in self._agent.get_new_notifs().items():
            key = agent.decode() if isinstance(agent, bytes) else str(agent)
            out.setdefault(key, []).extend(bytes(m) for m in msgs)
        return out

    def peer_info_of(self, agent: str) -> PeerInfo:
        """A loaded peer's published info (pools, staging)."""
        return self._peer(agent)

    def desc(self, addr: np.ndarray, length: np.ndarray, device_id: int) -> np.ndarray:
        """A descriptor array ``[addr, len, device]`` (uint64)."""
        return self._desc(addr, length, device_id)

    def local_staging_desc(self, offset: int, nbytes: int) -> np.ndarray:
        """The descriptor of ``nbytes`` of this worker's staging buffer at ``offset``."""
        return self._staging_desc(offset, nbytes)

    # --- notifications -------------------------------------------------------------------

    def _collect(self) -> None:
        for agent, msgs in self._agent.get_new_notifs().items():
            key = agent.decode() if isinstance(agent, bytes) else str(agent)
            box = self._inbox.setdefault(key, [])
            box.extend(bytes(m) for m in msgs)
            # Nobody waits for some notifications (a fragments write without verify, chunks of a
            # superseded attempt): keep the newest, so a long-lived worker's inbox stays bounded.
            if len(box) > INBOX_LIMIT:
                del box[: len(box) - INBOX_LIMIT]

    def wait_notif(
        self, peer: str, wanted: Iterable[bytes], timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> bytes:
        """Wait for (and consume) the first of ``wanted`` notifications from ``peer``."""
        want = set(wanted)
        deadline = time.monotonic() + timeout_s
        t_spin = time.monotonic() + _SPIN_S
        while True:
            box = self._inbox.get(peer, [])
            for i, m in enumerate(box):
                if m in want:
                    return box.pop(i)
            self._collect()
            if any(m in want for m in self._inbox.get(peer, [])):
                continue
            if self.cancel.is_set():
                raise TransferCancelled("the job was withdrawn while waiting for notifications")
            now = time.monotonic()
            if now > deadline:
                raise TransferTimeout(
                    f"no notification {sorted(want)[:3]} from {peer!r} within {timeout_s:g}s"
                )
            if now > t_spin:
                time.sleep(_POLL_SLEEP_S)

    def send_notif(self, peer: str, msg: bytes) -> bool:
        """A standalone notification (e.g. 'scatter done') to a known peer.

        When UCX already failed the connection to ``peer`` (and no WRITE to it is in flight),
        the peer is reloaded and the message goes over a new connection: returns True then.
        """
        self._peer(peer)
        try:
            self._agent.send_notif(peer, msg)
            return False
        except Exception as e:  # e.g. nixlRemoteDisconnectError: the connection failed
            if not _disconnected(e):
                raise TransportError(f"notification to {peer!r}: {type(e).__name__}: {e}") from e
            error: Exception = e
        # Over a new connection when nothing else is in flight to the peer (see _post).
        if self.reconnect_inline and not self._outstanding.get(peer) and self.reset_peer(peer):
            try:
                self._agent.send_notif(peer, msg)
                return True
            except Exception as e:
                error = e
        raise PeerUnreachable(
            f"notification to {peer!r}: {type(error).__name__}: {error}"
        ) from error

    # --- staged path ---------------------------------------------------------------------

    @staticmethod
    def _chunk_tag(tag: bytes, i: int, n: int) -> bytes:
        return b"%s|%d|%d" % (tag, i, n)

    def write_staged(
        self,
        peer: str,
        route: Route | Mapping[str, Any],
        src_blocks: Blocks,
        *,
        dst_offset: int,
        tag: bytes,
        chunk_blocks: int | None = None,
        local_offset: int = 0,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> int:
        """Gather ``route`` and WRITE it into ``peer``'s staging at ``dst_offset``; returns bytes.

        With ``chunk_blocks`` the blocks go in chunks (one WRITE + notification each) so the
        gather of chunk ``i+1`` and the receiver's scatter of chunk ``i-1`` overlap the WRITE of
        chunk ``i``; without it, one gather and exactly one WRITE.
        """
        info = self._peer(peer)
        route = as_route(route)
        layout = staging_layout(route, src_blocks)
        if local_offset + layout.nbytes > self.staging.numel():
            raise TransportError(
                f"route needs {layout.nbytes} staging bytes at {local_offset}, local staging "
                f"holds {self.staging.numel()}"
            )
        if dst_offset < 0 or dst_offset + layout.nbytes > info.staging_bytes:
            raise TransportError(
                f"staging area [{dst_offset}, {dst_offset + layout.nbytes}) exceeds {peer!r}'s "
                f"staging buffer of {info.staging_bytes} bytes"
            )
        chunks = [c for c in layout.chunks(chunk_blocks) if c.nbytes]
        deadline = time.monotonic() + timeout_s
        pending: list[PendingWrite] = []
        try:
            for i, ch in enumerate(chunks):
                if self.cancel.is_set():  # a withdrawn job must not write another byte
                    raise TransferCancelled(f"the job was withdrawn before chunk {i}")
                gather(
                    route, self.pools, src_blocks, out=self.staging, offset=local_offset, chunk=ch
                )
                _sync(self.staging)
                remote = self._desc(
                    np.array([info.staging_address + dst_offset + ch.offset]),
                    np.array([ch.nbytes]),
                    info.device_id,
                )
                pending.append(
                    self._post(
                        info,
                        self._staging_desc(local_offset + ch.offset, ch.nbytes),
                        remote,
                        self._chunk_tag(tag, i, len(chunks)),
                        f"staged chunk {i}/{len(chunks)}",
                    )
                )
                for p in pending:  # reap finished writes early; keeps handles few
                    self._poll(p)
            self._wait(pending, deadline)
        finally:
            for p in pending:
                self._release(p)
        return layout.nbytes

    def receive_staged(
        self,
        peer: str,
        route: Route | Mapping[str, Any],
        dst_blocks: Blocks,
        *,
        offset: int,
        tag: bytes,
        chunk_blocks: int | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> int:
        """Scatter ``peer``'s staged write (area at ``offset``) chunk by chunk as it lands.

        ``chunk_blocks`` must match the sender's. Returns bytes scattered.
        """
        route = as_route(route)
        ids = normalize_blocks(route, dst_blocks, "dst_blocks")
        layout = staging_layout(route, ids)
        chunks: list[StagingChunk] = [c for c in layout.chunks(chunk_blocks) if c.nbytes]
        # Validate everything before the first byte lands (a bad plan fails fast, not mid-way).
        for seg in route.segments:
            pool = self.pools.get(seg.dst_pool)
            if pool is None:
                raise BlockRangeError(f"destination pool {seg.dst_pool} is not on this rank")
            check_template(seg, None, pool)
            check_ids(ids[seg.layer_group], pool, seg.layer_group, "destination", unique=True)
        deadline = time.monotonic() + timeout_s
        tags = {self._chunk_tag(tag, i, len(chunks)): ch for i, ch in enumerate(chunks)}
        while tags:
            got = self.wait_notif(peer, tags, max(0.0, deadline - time.monotonic()))
            scatter(route, self.staging, self.pools, ids, offset=offset, chunk=tags.pop(got))
        _sync(self.staging)
        return layout.nbytes

    # --- per-fragment path ---------------------------------------------------------------

    def write_fragments(
        self,
        peer: str,
        route: Route | Mapping[str, Any],
        src_blocks: Blocks,
        dst_blocks: Blocks,
        *,
        tag: bytes,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> int:
        """One WRITE whose descriptors are the route's fragments, pool to pool; returns bytes."""
        info = self._peer(peer)
        route = as_route(route)
        bs = normalize_blocks(route, src_blocks, "src_blocks")
        bd = normalize_blocks(route, dst_blocks, "dst_blocks")
        for seg in route.segments:
            sp = self.pools.get(seg.src_pool)
            dp = info.pools.get(seg.dst_pool)
            if sp is None or dp is None:
                raise BlockRangeError(f"segment {seg.src_pool}->{seg.dst_pool}: unknown pool")
            check_template(seg, sp, dp)  # type: ignore[arg-type]
            g = seg.layer_group
            if bs[g].shape[0] != bd[g].shape[0]:  # pairs (a ratio's small side is [n, r])
                raise BlockRangeError(f"layer group {g}: block lists differ in length")
            check_ids(bs[g], sp, g, "source", unique=False)
            check_ids(bd[g], dp, g, "destination", unique=True)  # type: ignore[arg-type]
        p = self.post_fragments(peer, route, bs, bd, tag, "fragments")
        if p is None:
            return 0
        self._wait([p], time.monotonic() + timeout_s)
        return p.nbytes

    def write_raw(
        self,
        peer: str,
        nbytes: int,
        *,
        dst_offset: int = 0,
        tag: bytes = b"raw",
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> int:
        """One WRITE of ``nbytes`` staging → peer staging (the transport's ceiling; benchmarks)."""
        info = self._peer(peer)
        if nbytes > self.staging.numel() or dst_offset + nbytes > info.staging_bytes:
            raise TransportError(f"raw write of {nbytes} bytes exceeds a staging buffer")
        remote = self._desc(
            np.array([info.staging_address + dst_offset]), np.array([nbytes]), info.device_id
        )
        p = self._post(info, self._staging_desc(0, nbytes), remote, tag, "raw write")
        self._wait([p], time.monotonic() + timeout_s)
        return nbytes

    # --- teardown ------------------------------------------------------------------------

    def close(self) -> None:
        """Drop peers and deregister memory; the transport is unusable afterwards."""
        if self._closed:
            return
        self._closed = True
        self._release_prepared(list(self._prepped))
        for agent in list(self._peers):
            with contextlib.suppress(TransportError):
                self.remove_peer(agent)
        for reg in self._regs:
            with contextlib.suppress(Exception):
                self._agent.deregister_memory(reg)
        self._regs.clear()

    def __enter__(self) -> NixlTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
