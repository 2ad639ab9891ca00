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
   free) and the answer's ``kv_transfer_params`` name this instance, the request id, its block
   ids, its token count and a chained digest of its prompt per block (:func:`block_digests`).
   ``build_connector_meta`` tells the ranks which requests they hold, until when (``hold_s``);
   ``has_pending_push_work`` keeps the engine stepping meanwhile.
2. **decode, scheduler** — ``get_num_new_matched_tokens`` checks the params
   (:func:`parse_params`): missing, foreign or malformed params, a prompt whose first block
   differs from the prefilled one, params that another request of this engine already loaded
   (a retry), or a prefill this engine cannot pair with within ``timeout_s`` load nothing: vLLM
   computes the prompt, and one warning says why. Otherwise only the leading blocks whose tokens
   equal the prefilled ones load (a longer prompt loads the prefilled prefix and computes the
   rest). A prefill met for the first time is paired on a thread of its own (:class:`Pairings`);
   meanwhile the request waits and the step does not. ``update_state_after_alloc`` pairs the
   blocks vLLM allocated with the remote ones, position by position; ``build_connector_meta``
   hands them to the ranks, with the release notices below.
3. **decode, every rank** — ``start_load_kv``: ``Handover.expect(..., ask=True)`` under the
   decode's own request id (:func:`transfer_id`), naming the prefill's as the ask's ``source``:
   the rank asks each context rank that the plan says writes to it to send, then grants it
   staging or its pools. A rank whose directory does not know the pairing yet refreshes it on
   a thread of its own and tries again each step, until ``timeout_s``.
4. **prefill, every rank** — the ask reaches the worker's progress thread; a request this rank
   holds is sent when the blocks asked for are a run of the ones it holds, in order (forged ids
   are refused); an ask for anything else is refused at once, and the decode side fails fast
   rather than load blocks that were freed and reused.
5. ``get_finished``: the decode ranks report the request loaded (``arrived``), or loaded with
   errors: a failed receive's blocks go to ``get_block_ids_with_load_errors`` and vLLM
   recomputes or fails the request by its ``kv_load_failure_policy``, never decodes garbage. A
   failed receive is reported only once no WRITE granted before the failure can land any more
   (the handle's ``reusable_at``). The prefill ranks report it sent (``released``, failed,
   refused, released by the decode, or not asked for within ``hold_s``), and vLLM frees its
   blocks.

Release notices: a decode request that loads nothing after all (its own prefix cache holds the
prompt, its prompt differs, it is aborted before its blocks are allocated) makes the decode's
ranks tell the prefill's (``Handover.release``), which free the blocks at once; ``hold_s`` only
covers a decode that never comes. At first contact the notice waits (``_release_later``) for the
pairing the scheduler asks for, up to ``timeout_s``. A prefill rank that sends in none of its
pairings' routes (prefill TP above the model's KV heads) reports each request sent at once.

Live KV is the engine's alone: the connector's workers refuse REST-pushed transfer commands
(recorded as failed transfers on the control plane), fault injection acts only with
``KVPLANE_TEST_FAULTS=1`` in the engine's environment, and the control plane's token comes from
``KVPLANE_TOKEN`` or ``token_file``, never from the logged config.

Hybrid models: with ``SupportsHMA`` vLLM keeps its hybrid KV cache manager on, one KV cache
group per attention kind (full attention, sliding window). Each group is a kvplane layer group;
``remote_block_ids`` then lists each group's blocks (null where a sliding window dropped one),
and the decode loads, group by group, the blocks its own allocation holds. Other group kinds
(Mamba state, chunked local attention) are refused at start-up.

Registration: vLLM hands every attention backend one ``[blocks, kv_heads, block_size,
content]`` view per layer, with strides from one of its six KV cache layouts; the connector
asks for ``LBHNC`` (one ``HND`` pool per layer, a slot is a block: a head's keys and values for
the block's tokens are one run, so TP 2 → TP 1 is a plain head slice) and registers whatever
layout the strides say (:mod:`workers.connectors.layouts`). ``model`` (the model directory's
name unless ``kv_connector_extra_config`` names one) makes the control plane refuse a pairing
of two models.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from workers.connectors.boundary import (
    FAULTS_ENV,
    Pairings,
    ParamsError,
    Quarantine,
    RemotePrefill,
    block_digests,
    control_plane_token,
    faults_enabled,
    parse_params,
    refusal,
    transfer_id,
    window_gap,
)
from workers.connectors.layouts import describe
from workers.connectors.vllm_stats import HandoverNotes, KvplaneConnectorStats, KvplanePromMetrics
from workers.watchdog import StallWatch, stall_dump_s

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
    from workers.handover import Ask, Handle

log = logging.getLogger("kvplane.vllm")

DEFAULT_HOLD_S = 60.0  # a prefill keeps a finished request's blocks this long for the decode
DEFAULT_TIMEOUT_S = 30.0  # a decode rank's receive fails after this
PARK_S = 5.0  # an ask that came before its request's hold reached this rank waits this long
DEFAULT_STAGING_MIB = 32
IDLE_STEP_S = 0.01  # the longest a step that runs no model waits for a handover to resolve
RELEASE_RETRY_S = 0.25  # a release to a prefill this rank has not met yet is tried this often
_DP_SUFFIX = re.compile(r"^(.*?)(?:_dp(\d+))?$")
CLAIMS_KEPT = 65_536  # prefill requests whose KV a decode engine loaded, remembered


def _extra(config: VllmConfig) -> dict[str, Any]:
    kv = config.kv_transfer_config
    return dict(kv.kv_connector_extra_config or {}) if kv is not None else {}


def instance_name(config: VllmConfig) -> str:
    """The kvplane instance this engine registers as (``instance``, else role and engine id).

    Under data parallelism each DP rank is an engine of its own (its own scheduler, KV cache and
    block ids), so each registers its own instance: the name ends with ``-dp<rank>``."""
    extra = _extra(config)
    kv = config.kv_transfer_config
    assert kv is not None
    # vLLM gives each DP rank's engine core the engine id "<id>_dp<rank>" (and, for ranks
    # without MoE, a parallel config of DP size 1): the suffix is what tells the ranks apart.
    match = _DP_SUFFIX.match(str(kv.engine_id))
    assert match is not None  # every string matches
    engine, dp = match.groups()
    if extra.get("instance"):
        name = str(extra["instance"])
    else:
        side = "prefill" if kv.is_kv_producer else "decode"
        name = f"vllm-{side}-{engine[:8]}"
    return name if dp is None else f"{name}-dp{dp}"


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


def kv_cache_windows(config: KVCacheConfig | None) -> list[int | None]:
    """Each KV cache group's sliding window in tokens (None: full attention). vLLM's hybrid KV
    cache manager gives sliding-window and full-attention layers groups of their own; the
    connector moves every group's blocks, each group a kvplane layer group. Groups of other
    kinds (Mamba or linear-attention state, chunked local attention) are refused here."""
    if config is None or not config.kv_cache_groups:
        return [None]
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    def window(spec: Any) -> tuple[bool, int | None]:
        if isinstance(spec, UniformTypeKVCacheSpecs):  # one type, layers of several shapes
            kinds = {window(each) for each in spec.kv_cache_specs.values()}
            return kinds.pop() if len(kinds) == 1 else (False, None)
        if isinstance(spec, SlidingWindowSpec):
            return True, int(spec.sliding_window)
        full = isinstance(spec, FullAttentionSpec)
        return full and not isinstance(spec, ChunkedLocalAttentionSpec), None

    windows: list[int | None] = []
    for group in config.kv_cache_groups:
        known, tokens = window(group.kv_cache_spec)
        if not known:
            raise ValueError(
                f"KvplaneConnector: the KV cache group of {', '.join(group.layer_names[:3])} "
                f"is {type(group.kv_cache_spec).__name__}; the connector moves full-attention "
                "and sliding-window KV (Mamba/SSM or linear-attention state and chunked local "
                "attention are not supported)"
            )
        windows.append(tokens)
    return windows


def layer_groups(config: KVCacheConfig | None) -> dict[str, int]:
    """Each layer's KV cache group (its kvplane layer group), by vLLM layer name."""
    if config is None:
        return {}
    return {
        name: index
        for index, group in enumerate(config.kv_cache_groups)
        for name in group.layer_names
    }


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


# -------------------------------------------------------------------------------------------
# scheduler ↔ ranks
# -------------------------------------------------------------------------------------------


# A prefill's finished request: its blocks per KV cache group (None where a sliding window
# dropped one), held until a wall-clock time
Held = tuple[list[list[int | None]], float]


@dataclass
class Receive:
    """One decode request's load, from the scheduler to every rank."""

    request_id: str  # the decode engine's
    source: str  # the prefill engine's id of the request
    context: str  # the prefill's kvplane instance
    blocks: dict[int, tuple[list[int], list[int]]]  # KV cache group: (remote ids, local ids)
    skip_blocks: int = 0  # test-only fault injection: leave the first N blocks unloaded
    broken: str | None = None  # why it cannot load (a block the prefill no longer holds)

    @property
    def transfer_id(self) -> str:
        return transfer_id(self.request_id)

    @property
    def local_block_ids(self) -> list[int]:
        return [b for _, local in self.blocks.values() for b in local]


@dataclass
class KvplaneConnectorMetadata(KVConnectorMetadata):
    """What the scheduler tells the ranks each step."""

    receive: list[Receive] = field(default_factory=list)
    hold: dict[str, Held] = field(default_factory=dict)  # by request id
    release: list[tuple[str, str]] = field(default_factory=list)  # (context, its request id)
    idle: bool = False  # the step runs no model: only handovers keep the engine stepping


@dataclass
class _Decision:
    """A decode request whose KV will load: what from, and how many tokens."""

    remote: RemotePrefill
    matched: int  # leading prompt tokens the prefill holds
    skip_blocks: int = 0
    seen_at: float = field(default_factory=time.monotonic)


class KvplaneConnector(KVConnectorBase_V1, SupportsHMA):
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
        self.url = str(
            extra.get("control_plane") or os.environ.get("KVPLANE_URL") or "http://127.0.0.1:8000"
        )
        self.token = control_plane_token(extra)
        self.hold_s = float(extra.get("hold_s", DEFAULT_HOLD_S))
        self.timeout_s = float(extra.get("timeout_s", DEFAULT_TIMEOUT_S))
        self.verify = bool(extra.get("verify", False))
        self.block_size = int(vllm_config.cache_config.block_size)
        self.windows = kv_cache_windows(kv_cache_config)
        if self.kind == "generation":
            _check_decode_can_continue(vllm_config)
        self.faults = faults_enabled()
        if extra.get("fault_skip_blocks") and not self.faults:
            raise ValueError(
                f"KvplaneConnector: fault_skip_blocks is test-only fault injection; it needs "
                f"{FAULTS_ENV}=1 in the engine's environment"
            )
        # Test-only: the decode leaves its first N blocks unloaded (per request:
        # kv_transfer_params' "kvplane_fault_skip_blocks").
        self.fault_skip_blocks = int(extra.get("fault_skip_blocks", 0)) if self.faults else 0
        # scheduler side
        self._holding: dict[str, float] = {}  # prefill: request id -> until (wall clock)
        self._new_holds: dict[str, Held] = {}
        self._new_receives: list[Receive] = []
        self._releases: list[tuple[str, str]] = []  # decode: (context, its request id)
        self._loading: set[str] = set()  # decode: requests whose KV is on its way
        self._decisions: dict[str, _Decision] = {}  # decode: request id -> what it loads
        self._claims: OrderedDict[tuple[str, str], str] = OrderedDict()  # prefill's -> decode's
        self.pairings = Pairings(self._client, self.instance)
        # worker side
        self.worker: Worker | None = None
        self._lock = threading.Lock()
        self._held: dict[str, Held] = {}  # prefill rank: what it holds
        self._parked: dict[str, tuple[Ask, float]] = {}  # asks that came before the metadata
        self._released: dict[str, float] = {}  # releases that came before the metadata
        self._sending: dict[str, set[str]] = {}  # prefill rank: held id -> transfers under way
        # prefill rank: held ids to free, with what freed them (vllm:kvplane_holds_total)
        self._done_sending: dict[str, str] = {}
        self._receiving: dict[str, tuple[Receive, Handle]] = {}  # decode rank: by transfer id
        self._deferred: dict[str, tuple[Receive, float]] = {}  # waiting for the pairing: until
        self._unsent: dict[tuple[str, str], float] = {}  # releases waiting for it: until
        self._releasing = False  # a thread sends them (_release_later)
        self._quarantined: Quarantine[Receive] = Quarantine()  # failed loads, until reusable
        self._done_receiving: set[str] = set()
        self._load_errors: set[int] = set()  # one KV cache group: vLLM recomputes from there
        self._failed_loads: set[str] = set()  # several: vLLM takes failures per request
        self._resolved = threading.Event()  # a handle of this rank resolved (progress thread)
        self._notes = HandoverNotes()  # for vLLM's KVConnectorStats
        self._stepped_at = time.monotonic()  # the model runner's last get_finished
        self._watch: StallWatch | None = None  # KVPLANE_STALL_DUMP_S

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """``LBHNC``: a block of one layer holds each head's tokens together, so a head slice
        (TP 2 → TP 1) is one run per head and block. kvplane also describes ``LBNHC``,
        ``BLHNC`` and ``BLNHC`` (``VLLM_KV_CACHE_LAYOUT`` may name one); see
        :mod:`workers.connectors.layouts`. None with MLA: one latent "head" per token, every
        layout moves it alike."""
        model = vllm_config.model_config
        return None if model is not None and model.use_mla else "LBHNC"

    def _client(self, retries: int = 0) -> Any:
        from api.client import Client

        return Client(self.url, token=self.token, retries=retries, timeout_s=10.0)

    # ---------------------------------------------------------------------------------------
    # scheduler side
    # ---------------------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            return 0, False
        if self.kind != "generation":
            return self._compute_locally(request, "a prefill engine loads no remote KV")
        decision = self._decisions.get(request.request_id)
        if decision is None:
            try:
                remote = parse_params(params)
            except ParamsError as error:
                return self._compute_locally(request, f"kv_transfer_params refused: {error}")
            decision = self._decide(request, remote)
            if decision is None:
                return 0, False
        remote = decision.remote
        state, reason = self.pairings.state(remote.context)
        if state != "ready":
            if state == "pending" and time.monotonic() - decision.seen_at < self.timeout_s:
                return None, False  # asked again next step; the step does not wait
            why = reason or f"no pairing with {remote.context} within {self.timeout_s:g} s"
            return self._compute_locally(request, f"{remote.context}: {why}")
        count = decision.matched - num_computed_tokens
        if count <= 0:  # the decode's own prefix cache holds it all
            log.debug("kvplane: %s hits its own prefix cache", request.request_id)
            return self._compute_locally(request, None, release=remote)
        return count, True

    def _decide(self, request: Request, remote: RemotePrefill) -> _Decision | None:
        """What ``request`` may load from ``remote`` (None: it computes locally)."""
        params = request.kv_transfer_params or {}
        key = (remote.context, remote.request_id)
        claimed = self._claims.get(key)
        if claimed is not None and claimed != request.request_id:
            self._compute_locally(
                request,
                f"{remote.context}'s request {remote.request_id} was already loaded by "
                f"{claimed} (a retry with the same params)",
            )
            return None
        if remote.block_size != self.block_size:
            self._compute_locally(
                request,
                f"block sizes differ ({remote.context}: {remote.block_size}, this engine: "
                f"{self.block_size}); the connector loads between equal block sizes",
                release=remote,
            )
            return None
        if len(remote.groups) != len(self.windows):
            self._compute_locally(
                request,
                f"{remote.context} sent blocks of {len(remote.groups)} KV cache groups, this "
                f"engine has {len(self.windows)} (another model?)",
                release=remote,
            )
            return None
        prompt = list(request.prompt_token_ids or ())
        if self.faults and params.get("kvplane_fault_trust_tokens"):
            matched = min(remote.num_tokens, len(prompt))  # test-only: load another prompt's KV
        else:
            matched = remote.matched_tokens(prompt)
        if matched < self.block_size and matched < len(prompt):
            self._compute_locally(
                request,
                f"its prompt is not the one {remote.context} prefilled (request "
                f"{remote.request_id}): it differs within the first block",
                release=remote,
            )
            return None
        if matched < min(len(prompt), remote.num_tokens):
            log.info(
                "kvplane: %s loads %d of its %d prompt tokens from %s (the prompts differ "
                "after that)",
                request.request_id,
                matched,
                len(prompt),
                remote.context,
            )
        gap = window_gap(remote, matched, self.windows)
        if gap is not None:
            self._compute_locally(request, gap, release=remote)
            return None
        skip = params.get("kvplane_fault_skip_blocks", self.fault_skip_blocks) if self.faults else 0
        decision = _Decision(remote, matched, skip_blocks=int(skip or 0))
        self._decisions[request.request_id] = decision
        self._claims[key] = request.request_id
        while len(self._claims) > CLAIMS_KEPT:
            self._claims.popitem(last=False)
        return decision

    def _compute_locally(
        self, request: Request, why: str | None, release: RemotePrefill | None = None
    ) -> tuple[int, bool]:
        """``request`` loads nothing: vLLM computes its prompt. ``why`` is warned once;
        ``release`` tells that prefill to free the blocks it holds for it."""
        params = request.kv_transfer_params
        if isinstance(params, dict):
            params["do_remote_prefill"] = False  # asked once
        self._decisions.pop(request.request_id, None)
        if why:
            log.warning("kvplane: %s computes its prompt locally: %s", request.request_id, why)
        if release is not None:
            self._releases.append((release.context, release.request_id))
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        decision = self._decisions.pop(request.request_id, None)
        if decision is None:
            return
        params = request.kv_transfer_params
        if isinstance(params, dict):
            params["do_remote_prefill"] = False  # load once
        remote = decision.remote
        if num_external_tokens <= 0:
            self._releases.append((remote.context, remote.request_id))
            return
        size = self.block_size
        local_tokens = decision.matched - num_external_tokens
        first, last = local_tokens // size, -(-decision.matched // size)
        pairs: dict[int, tuple[list[int], list[int]]] = {}
        broken = None
        for group, (mine, theirs) in enumerate(zip(blocks.blocks, remote.groups, strict=True)):
            remote_ids, local_ids = [], []
            for block, remote_id in zip(mine[first:last], theirs[first:last], strict=False):
                if block.is_null:  # out of this group's sliding window here: nothing to load
                    continue
                if remote_id is None:
                    broken = f"{remote.context} no longer holds a block of KV cache group {group}"
                    continue
                remote_ids.append(remote_id)
                local_ids.append(block.block_id)
            pairs[group] = (remote_ids, local_ids)
        self._loading.add(request.request_id)
        self._new_receives.append(
            Receive(
                request_id=request.request_id,
                source=remote.request_id,
                context=remote.context,
                blocks=pairs,
                skip_blocks=decision.skip_blocks,
                broken=broken,
            )
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KvplaneConnectorMetadata(
            receive=self._new_receives,
            hold=self._new_holds,
            release=self._releases,
            idle=scheduler_output.total_num_scheduled_tokens == 0
            and bool(self._holding or self._loading or self._decisions),
        )
        self._new_receives, self._new_holds, self._releases = [], {}, []
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._loading.discard(request.request_id)
        decision = self._decisions.pop(request.request_id, None)
        params = request.kv_transfer_params
        if self.kind == "generation":
            if decision is not None:  # finished (aborted) before its blocks were allocated
                self._releases.append((decision.remote.context, decision.remote.request_id))
            elif isinstance(params, dict) and params.get("do_remote_prefill"):
                try:  # aborted before the scheduler looked at it
                    remote = parse_params(params)
                except ParamsError:
                    return False, None
                self._releases.append((remote.context, remote.request_id))
                self.pairings.state(remote.context)  # a first contact: its ranks need it
            return False, None
        if not isinstance(params, dict) or not params.get("do_remote_decode"):
            return False, None
        from vllm.v1.request import RequestStatus

        if request.status not in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        ):
            return False, None  # aborted: nothing to hand over
        # vLLM's null block (id 0) stands for a block a sliding window dropped
        groups = [[int(b) or None for b in group] for group in block_ids]
        prompt = list(request.prompt_token_ids or ())
        if not groups or not all(any(group) for group in groups) or not prompt:
            return False, None
        until = time.time() + self.hold_s
        self._holding[request.request_id] = until
        self._new_holds[request.request_id] = (groups, until)
        flat = len(groups) == 1 and None not in groups[0]
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": groups[0] if flat else groups,
            "remote_request_id": request.request_id,
            "remote_engine_id": self.instance,
            "remote_num_tokens": len(prompt),
            "kvplane_context": self.instance,
            "kvplane_block_size": self.block_size,
            "kvplane_digests": block_digests(prompt, self.block_size),
        }

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        for request_id in connector_output.finished_sending or ():
            self._holding.pop(request_id, None)
        self._loading.difference_update(connector_output.finished_recving or ())

    def has_pending_push_work(self) -> bool:
        # Keep stepping while blocks are held (the ranks learn what they hold from the next
        # step's metadata, and report sends done from get_finished) and while a release
        # notice has not reached the ranks.
        now = time.time()
        self._holding = {k: t for k, t in self._holding.items() if t + 5.0 > now}
        return bool(self._holding or self._releases)

    # ---------------------------------------------------------------------------------------
    # worker side
    # ---------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Register this rank's KV tensors with the control plane and attach a worker to them."""
        from workers.agent import Worker

        extra = _extra(self._vllm_config)
        client = self._client(retries=5)
        rank, header, rank_body, tensors = registration(
            self._vllm_config,
            kv_caches,
            model=extra.get("model"),
            groups=layer_groups(self._kv_cache_config),
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
            on_release=self._on_release if self.kind == "context" else None,
            accept_commands=False,  # only the engine hands out its blocks
        )
        worker.add_listener(lambda handle: self._resolved.set())
        worker.add_listener(self._notes.note)
        worker.attach(tensors=tensors)
        worker.start()
        self.worker = worker
        self._start_watch(rank)
        log.info(
            "kvplane: %s rank %d registered at %s (%d pools)",
            self.instance,
            rank,
            self.url,
            len(tensors),
        )
        if self.kind == "context":
            self._revalidate_pairings(client)
        elif extra.get("peer"):
            self._pair_at_start(str(extra["peer"]))

    def _start_watch(self, rank: int) -> None:
        """``KVPLANE_STALL_DUMP_S``: every thread's stack to stderr when the handover's progress
        loop, or the engine's steps while this rank has KV held or on its way, stop moving."""
        after = stall_dump_s()
        handover = self.worker.handover if self.worker is not None else None
        if after is None or handover is None:
            return
        watch = StallWatch(f"{self.instance}-{rank}", after)
        watch.watch("the handover's progress loop", lambda: handover.ticked_at, lambda: True)
        watch.watch("the engine's steps", lambda: self._stepped_at, self._outstanding)
        self._watch = watch.start()
        log.info("kvplane: %s rank %d: stall watch on (%g s)", self.instance, rank, after)

    def _outstanding(self) -> bool:
        """Whether this rank has KV held, on its way or waiting: vLLM then keeps stepping."""
        return bool(self._held or self._receiving or self._deferred or self._parked or self._unsent)

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

    def _pair_at_start(self, context: str) -> None:
        """``peer``: pair with that prefill at start-up (the first request then finds it)."""
        assert self.worker is not None
        try:
            report = self.worker.client.create_pairing(context, self.instance)
            if report.get("compatible"):
                self.worker.refresh_directory()
        except Exception as error:
            log.info(
                "kvplane: pairing %s -> %s not possible yet: %s", context, self.instance, error
            )

    # decode ranks --------------------------------------------------------------------------

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvplaneConnectorMetadata)
        if meta.hold:
            self._hold(meta.hold)
        for receive in meta.receive:
            self._expect(receive)
        for context, source in meta.release:
            self._release(context, source)
        if meta.idle and not meta.hold and not meta.receive:
            # vLLM steps without pause while a finished request's blocks are held or a
            # request's KV is on its way, and with TP > 1 each rank busy-waits for the next
            # step: the worker's own threads (asks, WRITEs, notifications, heartbeats) would
            # starve. Wait for a handle of this rank to resolve instead, or IDLE_STEP_S.
            self._resolved.wait(IDLE_STEP_S)
            self._resolved.clear()

    def _expect(self, receive: Receive, deadline: float | None = None) -> None:
        """Start this rank's receive, or defer it while the rank's directory does not know the
        pairing yet (refreshed off this thread); fail it once ``timeout_s`` has passed."""
        from workers.directory import HandoverError

        worker = self.worker
        assert worker is not None
        deadline = time.monotonic() + self.timeout_s if deadline is None else deadline
        skip = receive.skip_blocks
        blocks = {g: (remote[skip:], local[skip:]) for g, (remote, local) in receive.blocks.items()}
        try:
            if receive.broken:
                raise HandoverError(receive.broken, code="not_held")
            if worker.handover is None:
                raise HandoverError("the worker is not attached", code="not_attached")
            left = deadline - time.monotonic()
            if left <= 0:
                raise HandoverError(
                    f"no pairing with {receive.context} in this rank's directory within "
                    f"{self.timeout_s:g} s",
                    code="unknown_pairing",
                )
            handle = worker.handover.expect(
                receive.transfer_id,
                receive.context,
                blocks,
                timeout_s=left,
                verify=self.verify,
                ask=True,
                source=receive.source,
            )
        except HandoverError as error:
            if error.code == "unknown_pairing" and deadline > time.monotonic():
                with self._lock:
                    self._deferred[receive.transfer_id] = (receive, deadline)
                worker.refresh_directory_soon()
                return
            self._load_failed(receive, str(error))
            return
        except Exception as error:
            self._load_failed(receive, f"{type(error).__name__}: {error}")
            return
        with self._lock:
            self._receiving[receive.transfer_id] = (receive, handle)

    def _load_failed(self, receive: Receive, reason: str, reusable_at: float | None = None) -> None:
        log.warning(
            "kvplane: loading %s from %s failed: %s", receive.request_id, receive.context, reason
        )
        with self._lock:
            if reusable_at is not None and reusable_at > time.time():
                # A WRITE granted before the failure may still land: vLLM gets the blocks back
                # (and recomputes into them) only after that.
                self._quarantined.add(receive, reusable_at)
                return
            self._failed(receive)

    def _failed(self, receive: Receive) -> None:
        """Report ``receive`` loaded with errors (the caller holds the lock)."""
        self._done_receiving.add(receive.request_id)
        if len(self.windows) > 1:  # block ids name a block of one group only
            self._failed_loads.add(receive.request_id)
        else:
            self._load_errors.update(receive.local_block_ids)

    def _release(self, context: str, source: str) -> None:
        worker = self.worker
        if worker is None or worker.handover is None:
            return
        sent = worker.handover.release(source, context)
        if sent is not None:
            log.debug("kvplane: released %s at %s (%d notices)", source, context, sent)
            return
        # First contact (a request aborted before its first load): the pairing is being made
        # (the scheduler asked for it); send the notice once this rank's directory has it.
        with self._lock:
            self._unsent[(context, source)] = time.monotonic() + self.timeout_s
            if self._releasing:
                return
            self._releasing = True
        threading.Thread(target=self._release_later, daemon=True, name="kvplane-release").start()

    def _release_later(self) -> None:
        """Releases whose pairing this rank's directory did not know: sent after a directory
        refresh brings it, or given up after ``timeout_s`` (the prefill's hold frees them)."""
        worker = self.worker
        assert worker is not None and worker.handover is not None
        while True:
            time.sleep(RELEASE_RETRY_S)
            try:
                worker.refresh_directory()
            except Exception as error:  # the control plane is down: the holds run out
                log.debug("kvplane: directory refresh for a release failed: %s", error)
            now = time.monotonic()
            with self._lock:
                unsent = list(self._unsent.items())
            for (context, source), until in unsent:
                sent = worker.handover.release(source, context)
                if sent is None and until > now:
                    continue
                if sent is None:
                    log.info(
                        "kvplane: %s does not know %s within %g s: its hold frees request %s",
                        self.instance,
                        context,
                        self.timeout_s,
                        source,
                    )
                with self._lock:
                    self._unsent.pop((context, source), None)
            with self._lock:
                if not self._unsent:
                    self._releasing = False
                    return

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    # prefill ranks -------------------------------------------------------------------------

    def _hold(self, holds: dict[str, Held]) -> None:
        ready = []
        log.debug("kvplane: %s holds %s", self.instance, sorted(holds))
        unused = self._routeless()
        with self._lock:
            if unused:  # no pairing has a route from this rank: nobody will ask it
                self._done_sending.update(dict.fromkeys(holds, "routeless"))
                return
            self._held.update(holds)
            # released before the hold reached this rank (the decode was quick to decide)
            for request_id in holds:
                if self._released.pop(request_id, None) is not None:
                    self._done_sending[request_id] = "released"
            for transfer, (ask, _) in list(self._parked.items()):
                if (ask.source or ask.request_id) in holds:
                    del self._parked[transfer]
                    ready.append(ask)
        for ask in ready:
            self._serve(ask)

    def _routeless(self) -> bool:
        """Whether this rank sends in none of its pairings (prefill TP above the KV heads: a
        replica no route elects). False before the first pairing: it may yet send."""
        worker = self.worker
        if worker is None:
            return False
        plans = worker.directory.plans
        rank = worker.rank
        return bool(plans) and not any(
            route.sender_rank == rank for entry in plans.values() for route in entry.routes
        )

    def _on_ask(self, ask: Ask) -> None:
        """Progress thread: a decode rank asks for a request (serve it, park it or refuse)."""
        source = ask.source or ask.request_id
        with self._lock:
            held = source in self._held
            if not held:
                self._parked[ask.request_id] = (ask, time.monotonic())
        log.debug(
            "kvplane: %s asked for %s (as %s) by %s (%s)",
            self.instance,
            source,
            ask.request_id,
            ask.peer,
            "held" if held else "parked",
        )
        if held:
            self._serve(ask)

    def _serve(self, ask: Ask) -> None:
        assert self.worker is not None and self.worker.handover is not None
        handover = self.worker.handover
        source = ask.source or ask.request_id
        with self._lock:
            held = self._held.get(source)
            if held is None or source in self._done_sending:
                reason: str | None = f"{self.instance} no longer holds request {source}"
            else:
                reason = refusal(self.instance, source, held, ask.blocks)
            if reason is None:
                self._sending.setdefault(source, set()).add(ask.request_id)
        if reason is not None:
            handover.refuse(ask, reason)
            if held is not None:  # the decode that came loads nothing: free the blocks
                self._sent(source, None, "refused")
            return
        try:
            handle = handover.send(ask.request_id, ask.peer, ask.blocks, **ask.send_options())
        except Exception as error:
            handover.refuse(ask, f"{self.instance} cannot send: {error}")
            self._sent(source, ask.request_id, "refused")
            return
        handle.add_done_callback(lambda h: self._sent(source, h.request_id))

    def _sent(self, source: str, transfer: str | None, outcome: str = "sent") -> None:
        """A send of held request ``source`` ended: its blocks are free once none is under way
        (``outcome``: what freed them, unless something did first)."""
        with self._lock:
            sending = self._sending.get(source, set())
            sending.discard(transfer or "")
            if not sending:
                self._sending.pop(source, None)
                self._done_sending.setdefault(source, outcome)

    def _on_release(self, request_id: str, peer: str) -> None:
        """Progress thread: a decode engine will not ask for ``request_id``: free it now (or,
        when its hold has not reached this rank yet, as soon as it does)."""
        now = time.monotonic()
        with self._lock:
            if request_id not in self._held:
                self._released[request_id] = now
                if len(self._released) > CLAIMS_KEPT:
                    self._released = {k: t for k, t in self._released.items() if now - t < PARK_S}
            elif not self._sending.get(request_id):
                self._done_sending.setdefault(request_id, "released")
        log.debug("kvplane: %s released %s", peer, request_id)

    # both ----------------------------------------------------------------------------------

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._stepped_at = time.monotonic()
        if self.worker is None:
            return None, None
        with self._lock:
            deferred, self._deferred = self._deferred, {}
        for receive, deadline in deferred.values():
            self._expect(receive, deadline)
        finished = self.worker.get_finished()
        now_wall, now = time.time(), time.monotonic()
        # Held before the first pairing reached this rank, which none of them elects: free.
        routeless = bool(self._held) and self._routeless()
        refuse: list[Ask] = []
        failed: list[tuple[Receive, str, float | None]] = []
        with self._lock:
            for transfer in finished.received | set(finished.failed):
                entry = self._receiving.pop(transfer, None)
                if entry is None:
                    continue
                receive, handle = entry
                if transfer in finished.failed:
                    failed.append((receive, finished.failed[transfer], handle.reusable_at))
                else:
                    self._done_receiving.add(receive.request_id)
            for receive in self._quarantined.due(now_wall):
                self._failed(receive)
            for request_id, (_, until) in list(self._held.items()):
                if (routeless or until < now_wall) and request_id not in self._sending:
                    # nobody asked in time, or will: free
                    self._done_sending.setdefault(
                        request_id, "routeless" if routeless else "expired"
                    )
            for transfer, (ask, since) in list(self._parked.items()):
                if now - since > PARK_S:
                    del self._parked[transfer]
                    refuse.append(ask)
            sending, self._done_sending = self._done_sending, {}
            for request_id in sending:
                self._held.pop(request_id, None)
        if sending:
            self._notes.held(list(sending.values()))
        for receive, reason, quiet_until in failed:
            self._load_failed(receive, reason, quiet_until)
        with self._lock:
            receiving, self._done_receiving = self._done_receiving, set()
        for ask in refuse:
            assert self.worker.handover is not None
            self.worker.handover.refuse(
                ask, f"{self.instance} does not hold request {ask.source or ask.request_id}"
            )
        return set(sending) or None, receiving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, receiving = self.get_finished(finished_req_ids)
        with self._lock:
            failed, self._failed_loads = self._failed_loads, set()
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()),
            finished_recving=set(receiving or ()),
            failed_recving=failed,
        )

    def get_kv_connector_stats(self) -> KvplaneConnectorStats | None:
        """This rank's handovers since the last step (:mod:`workers.connectors.vllm_stats`)."""
        return self._notes.take()

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KvplaneConnectorStats | None:
        return KvplaneConnectorStats(data=dict(data)) if data is not None else None

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KvplanePromMetrics:
        return KvplanePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads finish before the scheduler runs the request

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # the decode side pulls by asking; nothing to save per layer

    def wait_for_save(self) -> None:
        return

    def shutdown(self) -> None:
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
        if self.worker is not None:
            self.worker.stop()
            self.worker = None


def _check_decode_can_continue(config: VllmConfig) -> None:
    """A decode engine computes the last prompt token (at least) over the KV it loaded, so its
    attention backend must run a prompt's rest over cached KV. vLLM's CPU backend for multi-head
    latent attention cannot: vLLM turns chunked prefill and prefix caching off for MLA models on
    CPU, and such a decode would sample from a prompt it never attended to."""
    from vllm.platforms import current_platform

    model = config.model_config
    if (
        model is not None
        and model.use_mla
        and current_platform.is_cpu()
        and not config.scheduler_config.enable_chunked_prefill
    ):
        raise ValueError(
            "KvplaneConnector: a decode (kv_consumer) engine for an MLA model cannot run on "
            "vLLM's CPU backend: its MLA attention cannot continue a prompt over loaded KV "
            "(vLLM disables chunked prefill and prefix caching for MLA on CPU for the same "
            "reason). Run the decode engine on a GPU; the prefill side registers MLA latents "
            "as REPLICATED views"
        )


def registration(
    config: VllmConfig,
    kv_caches: dict[str, torch.Tensor],
    *,
    model: str | None = None,
    groups: Mapping[str, int] | None = None,
) -> tuple[int, dict[str, Any], dict[str, Any], dict[int, torch.Tensor]]:
    """``(rank, instance header, rank body, {pool id: tensor})`` for this rank's KV tensors
    (pools and views follow their strides: :mod:`workers.connectors.layouts`); ``groups``: each
    layer's KV cache group by name, its pools' layer group (default 0)."""
    from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

    parallel = config.parallel_config
    model_config = config.model_config
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    rank = get_pp_group().rank_in_group * tp + get_tensor_model_parallel_rank()
    block_size = config.cache_config.block_size
    heads = model_config.get_num_kv_heads(parallel)
    total = model_config.get_total_num_kv_heads()
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
    pools, views, tensors = describe(
        kv_caches,
        heads=heads,
        total_heads=total,
        block_size=block_size,
        head_dim=model_config.get_head_size(),
        latent=bool(model_config.use_mla),
        groups=groups,
    )
    return rank, header, {"rank": rank, "pools": pools, "views": views}, tensors
