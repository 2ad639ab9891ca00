"""``KvplaneConnector``: vLLM's KV connector (``KVConnectorBase_V1``) on kvplane's engine path.

A prefill (``kv_producer``) and a decode (``kv_consumer``) vLLM engine each load this module by
path; every engine rank registers its own KV tensors with the control plane, which validates the
pairing head by head, and each request's KV then moves rank to rank over NIXL with no control-plane
round trip::

    --kv-transfer-config '{"kv_connector": "KvplaneConnector",
      "kv_connector_module_path": "workers.connectors.vllm", "kv_role": "kv_producer",
      "kv_connector_extra_config": {"control_plane": "http://127.0.0.1:8000",
                                    "instance": "vllm-prefill"}}'

Lifecycle of one request (as with vLLM's NixlConnector, the proxy sends the prompt to the prefill
engine with ``max_tokens=1`` and ``kv_transfer_params: {"do_remote_decode": true}``, then to the
decode engine with the ``kv_transfer_params`` that came back):

1. **prefill, scheduler** — ``request_finished``: the request's blocks are kept (vLLM's delayed
   free) and the answer's ``kv_transfer_params`` name this instance, the request id and its block
   ids. ``build_connector_meta`` tells the ranks which requests they hold, until when
   (``hold_s``); ``has_pending_push_work`` keeps the engine stepping meanwhile.
2. **decode, scheduler** — ``get_num_new_matched_tokens``: the prompt's tokens load
   asynchronously; ``update_state_after_alloc`` pairs the blocks vLLM allocated with the remote
   ones (aligned from the end; a local prefix-cache hit shortens both);
   ``build_connector_meta`` hands them to the ranks.
3. **decode, every rank** — ``start_load_kv``: ``Worker.expect(..., ask=True)``: the rank asks
   each context rank that the plan says writes to it to send (a NIXL notification carrying both
   block lists), then grants it staging or its pools.
4. **prefill, every rank** — the ask reaches the worker's progress thread; a request this rank
   holds is sent (``Worker.send``), any other is refused at once (the decode side fails fast
   rather than load blocks that were freed and reused).
5. ``get_finished``: the decode ranks report the request loaded (``arrived``), or loaded with
   errors: a failed receive's blocks go to ``get_block_ids_with_load_errors`` and vLLM
   recomputes or fails the request by its ``kv_load_failure_policy``, never decodes garbage.
   The prefill ranks report it sent (``released``, failed, or not asked for within ``hold_s``),
   and vLLM frees its blocks.

Registration: vLLM's CPU attention backend keeps one tensor per layer, ``[blocks, kv_heads,
block_size, 2 * head_dim]``: each head's keys then values, per block. The connector registers one
pool per layer (a slot is a block) and one ``HND`` view with a single buffer per layer: a head's
region, keys and values together, is what moves, so TP 2 → TP 1 is a plain head slice. The
``[2, blocks, ...]`` layouts of the GPU backends register a key pool and a value pool per layer
(``NHD`` or ``HND`` by their strides). ``model`` (the model directory's name unless
``kv_connector_extra_config`` names one) makes the control plane refuse a pairing of two models.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from workers.agent import Worker
    from workers.handover import Ask

log = logging.getLogger("kvplane.vllm")

DEFAULT_HOLD_S = 60.0  # a prefill keeps a finished request's blocks this long for the decode
DEFAULT_TIMEOUT_S = 30.0  # a decode rank's receive fails after this
PARK_S = 10.0  # an ask that came before its request's metadata waits this long
DEFAULT_STAGING_MIB = 32
IDLE_STEP_S = 0.01  # the longest a step that runs no model waits for a handover to resolve
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _extra(config: VllmConfig) -> dict[str, Any]:
    kv = config.kv_transfer_config
    return dict(kv.kv_connector_extra_config or {}) if kv is not None else {}


def instance_name(config: VllmConfig) -> str:
    """The kvplane instance this engine registers as (``instance``, else role and engine id)."""
    extra = _extra(config)
    if extra.get("instance"):
        return str(extra["instance"])
    kv = config.kv_transfer_config
    assert kv is not None
    side = "prefill" if kv.is_kv_producer else "decode"
    return f"vllm-{side}-{str(kv.engine_id)[:8]}"


def _log_to_stderr(level: str) -> None:
    """``log_level`` (or ``KVPLANE_LOG_LEVEL``): kvplane's loggers at that level on stderr, in
    every engine process (the scheduler's and each rank's); unset, only warnings reach stderr."""
    if not level:
        return
    logger = logging.getLogger("kvplane")
    logger.setLevel(level.upper())
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(
            logging.Formatter(
                f"%(asctime)s kvplane[{os.getpid()}] %(levelname)s %(name)s: %(message)s"
            )
        )
        logger.addHandler(handler)


def _role(config: VllmConfig) -> str:
    kv = config.kv_transfer_config
    assert kv is not None
    if kv.kv_role == "kv_producer":
        return "context"
    if kv.kv_role == "kv_consumer":
        return "generation"
    raise ValueError(
        f"KvplaneConnector: kv_role {kv.kv_role!r}: a kvplane instance is either a "
        "context (kv_producer) or a generation (kv_consumer) instance"
    )


@dataclass
class Receive:
    """One decode request's load, from the scheduler to every rank."""

    request_id: str  # the decode engine's
    remote_request_id: str  # the prefill engine's: the transfer's request id on both sides
    context: str  # the prefill's kvplane instance
    remote_block_ids: list[int]
    local_block_ids: list[int]
    num_tokens: int | None = None  # the prompt's tokens: blocks pair by token position
    skip_blocks: int = 0  # fault injection: leave the first N blocks unloaded


@dataclass
class KvplaneConnectorMetadata(KVConnectorMetadata):
    """What the scheduler tells the ranks each step."""

    receive: list[Receive] = field(default_factory=list)
    hold: dict[str, tuple[list[int], float]] = field(default_factory=dict)  # id: blocks, until
    idle: bool = False  # the step runs no model: only handovers keep the engine stepping


class KvplaneConnector(KVConnectorBase_V1):
    """vLLM's KV connector over kvplane (see the module docstring)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        self.kind = _role(vllm_config)
        self.instance = instance_name(vllm_config)
        extra = _extra(vllm_config)
        _log_to_stderr(str(extra.get("log_level") or os.environ.get("KVPLANE_LOG_LEVEL") or ""))
        self.hold_s = float(extra.get("hold_s", DEFAULT_HOLD_S))
        self.timeout_s = float(extra.get("timeout_s", DEFAULT_TIMEOUT_S))
        self.verify = bool(extra.get("verify", False))
        # Fault injection for tests: the decode leaves its first N blocks unloaded (per request:
        # kv_transfer_params' "kvplane_fault_skip_blocks").
        self.fault_skip_blocks = int(extra.get("fault_skip_blocks", 0))
        # scheduler side
        self._holding: dict[str, float] = {}  # prefill: request id -> until (wall clock)
        self._new_holds: dict[str, tuple[list[int], float]] = {}
        self._new_receives: list[Receive] = []
        self._loading: set[str] = set()  # decode: requests whose KV is on its way
        # worker side
        self.worker: Worker | None = None
        self._lock = threading.Lock()
        self._held: dict[str, tuple[list[int], float]] = {}  # prefill rank: what it holds
        self._parked: dict[str, tuple[Ask, float]] = {}  # asks that came before the metadata
        self._sending: set[str] = set()  # prefill rank: sends started
        self._done_sending: set[str] = set()
        self._receiving: dict[str, Receive] = {}  # decode rank: by remote request id
        self._done_receiving: set[str] = set()
        self._load_errors: set[int] = set()
        self._paired: set[str] = set()
        self._resolved = threading.Event()  # a handle of this rank resolved (progress thread)

    # ---------------------------------------------------------------------------------------
    # scheduler side
    # ---------------------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill") and params.get("remote_block_ids"):
            count = len(request.prompt_token_ids or ()) - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # load once
        if num_external_tokens <= 0:
            return  # a full local prefix hit: the prefill's hold simply runs out
        block_size = self._vllm_config.cache_config.block_size
        local = list(blocks.get_unhashed_block_ids())
        remote = [int(b) for b in params["remote_block_ids"]]
        # The blocks that hold the tokens to load, aligned from the end of the prompt.
        needed = -(-len(request.prompt_token_ids or ()) // block_size) - (
            request.num_computed_tokens // block_size
        )
        count = min(len(local), len(remote), max(needed, 0))
        local, remote = local[:count], remote[len(remote) - count :]
        self._loading.add(request.request_id)
        self._new_receives.append(
            Receive(
                request_id=request.request_id,
                remote_request_id=str(params["remote_request_id"]),
                context=str(params["kvplane_context"]),
                remote_block_ids=remote,
                local_block_ids=local,
                num_tokens=len(request.prompt_token_ids or ()) or None,
                skip_blocks=int(params.get("kvplane_fault_skip_blocks", self.fault_skip_blocks)),
            )
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KvplaneConnectorMetadata(
            receive=self._new_receives,
            hold=self._new_holds,
            idle=scheduler_output.total_num_scheduled_tokens == 0
            and bool(self._holding or self._loading),
        )
        self._new_receives, self._new_holds = [], {}
        return meta

    def request_finished(
        self, request: Request, block_ids: Any
    ) -> tuple[bool, dict[str, Any] | None]:
        self._loading.discard(request.request_id)
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_decode") or self.kind != "context":
            return False, None
        from vllm.v1.request import RequestStatus

        if request.status not in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        ):
            return False, None  # aborted: nothing to hand over
        nested = bool(block_ids) and isinstance(block_ids[0], (list, tuple))
        ids = [int(b) for b in (block_ids[0] if nested else block_ids)]
        if not ids:
            return False, None
        until = time.time() + self.hold_s
        self._holding[request.request_id] = until
        self._new_holds[request.request_id] = (ids, until)
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": ids,
            "remote_request_id": request.request_id,
            "remote_engine_id": self.instance,
            "kvplane_context": self.instance,
            "remote_num_tokens": len(request.prompt_token_ids or ()),
        }

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        for request_id in connector_output.finished_sending or ():
            self._holding.pop(request_id, None)
        self._loading.difference_update(connector_output.finished_recving or ())

    def has_pending_push_work(self) -> bool:
        # Keep stepping while blocks are held: the ranks learn what they hold from the next
        # step's metadata, and report sends done from get_finished.
        now = time.time()
        self._holding = {k: t for k, t in self._holding.items() if t + 5.0 > now}
        return bool(self._holding)

    # ---------------------------------------------------------------------------------------
    # worker side
    # ---------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Register this rank's KV tensors with the control plane and attach a worker to them."""
        from api.client import Client
        from workers.agent import Worker

        extra = _extra(self._vllm_config)
        url = str(
            extra.get("control_plane") or os.environ.get("KVPLANE_URL") or "http://127.0.0.1:8000"
        )
        token = extra.get("token") or os.environ.get("KVPLANE_TOKEN")
        client = Client(url, token=token, retries=5)
        rank, header, rank_body, tensors = registration(
            self._vllm_config, kv_caches, model=extra.get("model")
        )
        client.register_instance(self.instance, {**header, "ranks": [rank_body]})
        device = str(next(iter(tensors.values())).device)
        worker = Worker(
            client,
            self.instance,
            rank,
            device=device,
            staging_bytes=int(extra.get("staging_mib", DEFAULT_STAGING_MIB)) << 20,
            on_ask=self._on_ask if self.kind == "context" else None,
        )
        worker.add_listener(lambda handle: self._resolved.set())
        worker.attach(tensors=tensors)
        worker.start()
        self.worker = worker
        log.info(
            "kvplane: %s rank %d registered at %s (%d pools)",
            self.instance,
            rank,
            url,
            len(tensors),
        )
        if self.kind == "context":
            self._revalidate_pairings(client)
        elif extra.get("peer"):
            self._pair(str(extra["peer"]), quiet=True)

    def _revalidate_pairings(self, client: Any) -> None:
        """A restarted prefill (new epoch) puts its pairings back in service once every rank
        has reported, so running decode engines pick it up without a restart."""
        try:
            if client.get_instance(self.instance).get("status") != "ready":
                return
            for pairing in client.list_pairings(instance=self.instance)["items"]:
                if pairing["context"] == self.instance:
                    client.validate_pairing(pairing["id"])
        except Exception as error:  # the decode side pairs again on its first request
            log.warning("kvplane: re-validating %s's pairings failed: %s", self.instance, error)

    def _pair(self, context: str, quiet: bool = False) -> None:
        assert self.worker is not None
        try:
            report = self.worker.client.create_pairing(context, self.instance)
        except Exception as error:
            if quiet:
                log.info(
                    "kvplane: pairing %s -> %s not possible yet: %s", context, self.instance, error
                )
                return
            raise
        if not report.get("compatible"):
            errors = "; ".join(f"{e['code']}: {e['message']}" for e in report.get("errors", []))
            raise RuntimeError(f"kvplane: {context} -> {self.instance} is incompatible: {errors}")
        self._paired.add(context)
        self.worker.refresh_directory()

    # decode ranks --------------------------------------------------------------------------

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvplaneConnectorMetadata)
        if meta.hold:
            self._hold(meta.hold)
        for receive in meta.receive:
            self._expect(receive)
        if meta.idle and not meta.hold and not meta.receive:
            # vLLM steps without pause while a finished request's blocks are held or a
            # request's KV is on its way, and with TP > 1 each rank busy-waits for the next
            # step: the worker's own threads (asks, WRITEs, notifications, heartbeats) would
            # starve. Wait for a handle of this rank to resolve instead, or IDLE_STEP_S.
            self._resolved.wait(IDLE_STEP_S)
            self._resolved.clear()

    def _expect(self, receive: Receive) -> None:
        from workers.directory import HandoverError

        assert self.worker is not None
        skip = min(receive.skip_blocks, len(receive.local_block_ids))
        blocks = {0: (receive.remote_block_ids[skip:], receive.local_block_ids[skip:])}
        options: dict[str, Any] = {
            "timeout_s": self.timeout_s,
            "verify": self.verify,
            "ask": True,
            "num_tokens": receive.num_tokens,
        }
        with self._lock:
            self._receiving[receive.remote_request_id] = receive
        try:
            try:
                self.worker.expect(receive.remote_request_id, receive.context, blocks, **options)
            except HandoverError as error:
                if error.code != "unknown_pairing":
                    raise
                self._pair(receive.context)  # a prefill engine this decode has not met yet
                self.worker.expect(receive.remote_request_id, receive.context, blocks, **options)
        except Exception as error:
            log.warning(
                "kvplane: cannot load %s from %s: %s", receive.request_id, receive.context, error
            )
            with self._lock:
                self._receiving.pop(receive.remote_request_id, None)
                self._done_receiving.add(receive.request_id)
                self._load_errors.update(receive.local_block_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    # prefill ranks -------------------------------------------------------------------------

    def _hold(self, holds: dict[str, tuple[list[int], float]]) -> None:
        ready = []
        log.debug("kvplane: %s holds %s", self.instance, sorted(holds))
        with self._lock:
            self._held.update(holds)
            for request_id in holds:
                parked = self._parked.pop(request_id, None)
                if parked is not None:
                    ready.append(parked[0])
        for ask in ready:
            self._serve(ask)

    def _on_ask(self, ask: Ask) -> None:
        """Progress thread: a decode rank asks for a request (serve it, park it or refuse)."""
        with self._lock:
            held = ask.request_id in self._held
            if not held:
                self._parked[ask.request_id] = (ask, time.monotonic())
        log.debug(
            "kvplane: %s asked for %s by %s (%s)",
            self.instance,
            ask.request_id,
            ask.peer,
            "held" if held else "parked",
        )
        if held:
            self._serve(ask)

    def _serve(self, ask: Ask) -> None:
        assert self.worker is not None and self.worker.handover is not None
        handover = self.worker.handover
        with self._lock:
            held = self._held.get(ask.request_id)
            if held is None or ask.request_id in self._sending:
                return
            self._sending.add(ask.request_id)
        wanted = _context_ids(ask.blocks)
        if held[1] < time.time() or not set(wanted) <= set(held[0]):
            reason = (
                f"{self.instance} no longer holds request {ask.request_id}"
                if held[1] < time.time()
                else f"{self.instance} holds other blocks for request {ask.request_id}"
            )
            handover.refuse(ask, reason)
            self._sent(ask.request_id)
            return
        try:
            handle = handover.send(ask.request_id, ask.peer, ask.blocks, **ask.send_options())
        except Exception as error:
            handover.refuse(ask, f"{self.instance} cannot send: {error}")
            self._sent(ask.request_id)
            return
        handle.add_done_callback(lambda h: self._sent(h.request_id))

    def _sent(self, request_id: str) -> None:
        with self._lock:
            self._done_sending.add(request_id)

    # both ----------------------------------------------------------------------------------

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.worker is None:
            return None, None
        finished = self.worker.get_finished()
        now_wall, now = time.time(), time.monotonic()
        refuse: list[Ask] = []
        with self._lock:
            for request_id in finished.received | set(finished.failed):
                receive = self._receiving.pop(request_id, None)
                if receive is None:
                    continue
                self._done_receiving.add(receive.request_id)
                if request_id in finished.failed:
                    log.warning(
                        "kvplane: loading %s failed: %s",
                        receive.request_id,
                        finished.failed[request_id],
                    )
                    self._load_errors.update(receive.local_block_ids)
            for request_id, (_, until) in list(self._held.items()):
                if until < now_wall and request_id not in self._sending:
                    self._done_sending.add(request_id)  # nobody asked in time: free them
            for request_id, (ask, since) in list(self._parked.items()):
                if now - since > PARK_S:
                    del self._parked[request_id]
                    refuse.append(ask)
            sending, self._done_sending = self._done_sending, set()
            receiving, self._done_receiving = self._done_receiving, set()
            for request_id in sending:
                self._held.pop(request_id, None)
                self._sending.discard(request_id)
        for ask in refuse:
            assert self.worker.handover is not None
            self.worker.handover.refuse(
                ask, f"{self.instance} does not hold request {ask.request_id}"
            )
        return sending or None, receiving or None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads finish before the scheduler runs the request

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # the decode side pulls by asking; nothing to save per layer

    def wait_for_save(self) -> None:
        return

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.stop()
            self.worker = None


def _context_ids(blocks: Any) -> list[int]:
    lists = next(iter(blocks.values()))
    ids = lists["context"] if isinstance(lists, dict) else lists[0]
    return [int(b) for b in ids]


def registration(
    config: VllmConfig, kv_caches: dict[str, torch.Tensor], *, model: str | None = None
) -> tuple[int, dict[str, Any], dict[str, Any], dict[int, torch.Tensor]]:
    """``(rank, instance header, rank body, {pool id: tensor})`` for this rank's KV tensors."""
    from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

    parallel = config.parallel_config
    model_config = config.model_config
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    rank = get_pp_group().rank_in_group * tp + get_tensor_model_parallel_rank()
    block_size = config.cache_config.block_size
    heads = model_config.get_num_kv_heads(parallel)
    total = model_config.get_total_num_kv_heads()
    head_dim = model_config.get_head_size()
    header = {
        "role": _role(config),
        "model": model or os.path.basename(str(model_config.model).rstrip("/")),
        "tp": tp,
        "pp": pp,
        "cp": 1,
        "attention_dp": False,
        "tokens_per_block": block_size,
        "kv_heads_per_rank": heads,
        "total_kv_heads": total,
    }
    pools: list[dict[str, Any]] = []
    views: list[dict[str, Any]] = []
    tensors: dict[int, torch.Tensor] = {}
    for index, (name, tensor) in enumerate(sorted(kv_caches.items(), key=_layer_order)):
        match = _LAYER.search(name)
        layer = int(match.group(1)) if match else index
        for roles, part, layout in _parts(tensor, heads, block_size, head_dim):
            pool_id = len(pools)
            slot = part[0].numel() * part.element_size()
            pools.append(
                {
                    "id": pool_id,
                    "layer_group": 0,
                    "slot_bytes": slot,
                    "slot_stride_bytes": part.stride(0) * part.element_size(),
                    "num_slots": part.shape[0],
                    "base_address": part.data_ptr(),
                }
            )
            views.append(
                {
                    "pool": pool_id,
                    "owner": "target",
                    "roles": roles,
                    "layout": layout,
                    "num_kv_heads": heads,
                    "total_kv_heads": total,
                    "head_dim": head_dim,
                    "dtype": str(tensor.dtype).removeprefix("torch."),
                    "buffers": [{"layer": layer, "offset": 0, "size": slot}],
                }
            )
            tensors[pool_id] = part
    return rank, header, {"rank": rank, "pools": pools, "views": views}, tensors


def _layer_order(item: tuple[str, Any]) -> tuple[int, str]:
    match = _LAYER.search(item[0])
    return (int(match.group(1)) if match else 1 << 30, item[0])


def _parts(
    tensor: torch.Tensor, heads: int, block_size: int, head_dim: int
) -> list[tuple[list[str], torch.Tensor, str]]:
    """One layer's tensor as ``(roles, [blocks, ...] tensor, layout)`` pools."""
    shape = tuple(tensor.shape)
    if len(shape) == 4 and shape[1:] == (heads, block_size, 2 * head_dim):
        # CPU attention: per block and head, the keys of every token, then their values.
        return [(["key", "value"], tensor, "HND")]
    if len(shape) == 5 and shape[0] == 2:
        inner = shape[2:4]
        layout = (
            "NHD"
            if inner == (block_size, heads)
            else "HND"
            if inner == (heads, block_size)
            else None
        )
        if layout is not None and tensor[0].is_contiguous() and tensor[1].is_contiguous():
            return [(["key"], tensor[0], layout), (["value"], tensor[1], layout)]
    raise ValueError(
        f"KvplaneConnector: a KV cache tensor of shape {shape} (block size "
        f"{block_size}, {heads} KV heads, head_dim {head_dim}) is not a layout it "
        "knows: [blocks, heads, block_size, 2*head_dim] (CPU) or [2, blocks, "
        "block_size, heads, head_dim] / [2, blocks, heads, block_size, head_dim]"
    )
