"""Wire schemas: what clients send (``*Create``: strict, ``extra="forbid"``) and get (``*Read``).

Request models are *strict*: JSON ``false`` is not ``0`` and ``"1"`` is not ``1``. Sizes are
bounded (the planning core re-checks the same bounds and every page-table rule, with field paths).
Workers may import this module; it depends on pydantic only.

Responses declare every key they carry (``tests/contract/test_walk.py`` fails on an undeclared
one) and mark every always-present field ``required`` in the spec (serialization-mode schemas), so
generated clients type them as present. Instance reads reuse the write models of the page table,
so what a client reads can be sent back as is.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator
from typing_extensions import TypeAliasType

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
MAX_PARALLEL = 1024
MAX_BYTES = 1 << 40
MAX_SLOTS = 1 << 32
MAX_ADDRESS = (1 << 64) - 1
MAX_LAYER = 1 << 20
MAX_HEADS = 1 << 20
MAX_HEAD_DIM = 1 << 16
MAX_TOKENS_PER_BLOCK = 1 << 20
MAX_RANKS = MAX_PARALLEL
MAX_BLOCK_ID = (1 << 32) - 1
MAX_NUM_TOKENS = 1 << 40
MAX_BLOCKS_PER_GROUP = 1 << 20
MAX_SECTIONS = 64

Name = Annotated[str, StringConstraints(pattern=NAME_PATTERN)]
Label = Annotated[str, StringConstraints(min_length=1, max_length=64)]
# Named (a component schema of their own) where requests and responses share them, so that a
# generated client has one enum type for both and a read value can be sent back unchanged.
Role = TypeAliasType("Role", Literal["context", "generation"])
TransferMode = TypeAliasType("TransferMode", Literal["auto", "staged", "fragments"])
Owner = TypeAliasType("Owner", Literal["target", "draft"])
Layout = TypeAliasType("Layout", Literal["HND", "NHD", "REPLICATED", "SECTIONED"])
InstanceStatus = Literal["incomplete", "ready"]
PairingStatus = Literal["compatible", "incompatible", "stale"]
TransferStatus = Literal["planned", "queued", "running", "done", "failed"]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def _declared_only(schema: dict[str, Any]) -> None:
    """Response schemas list their keys and say nothing about others (no TS index signature)."""
    schema.pop("additionalProperties", None)


class _Response(BaseModel):
    """A response: every field is always sent, so the spec lists every field as required.

    ``extra="allow"`` lets a key that a service adds but the model does not declare reach the
    client instead of vanishing, where the contract walker (``tests/contract``) catches it.
    """

    model_config = ConfigDict(
        from_attributes=True,
        extra="allow",
        json_schema_serialization_defaults_required=True,
        json_schema_extra=_declared_only,
    )


# ---------------------------------------------------------------------------------------------
# instances


class BufferCreate(_Request):
    """One byte range inside a slot holding (part of) one layer: K then V for a K/V view."""

    layer: int = Field(ge=0, le=MAX_LAYER)
    offset: int = Field(ge=0, le=MAX_BYTES)
    size: int = Field(ge=1, le=MAX_BYTES)


class PoolCreate(_Request):
    """One registered memory region of a rank."""

    id: int = Field(ge=0, le=MAX_LAYER)
    layer_group: int = Field(default=0, ge=0, le=MAX_LAYER)
    slot_bytes: int = Field(ge=1, le=MAX_BYTES)
    slot_stride_bytes: int | None = Field(
        default=None, ge=1, le=MAX_BYTES, description="Defaults to slot_bytes"
    )
    num_slots: int = Field(ge=1, le=MAX_SLOTS)
    base_address: int | None = Field(default=None, ge=0, le=MAX_ADDRESS)


class ViewCreate(_Request):
    """One class of buffers inside one pool, with its own head geometry.

    In a per-request state group (``tokens_per_slot: null``): ``HND`` over SSM heads (the head
    counts are SSM heads, one head = ``head_dim × d_state × itemsize`` bytes) or ``SECTIONED``
    conv state (``section_bytes``), both sharded over ``tp × cp`` (1 under attention-DP).
    """

    pool: int = Field(ge=0, le=MAX_LAYER)
    owner: Owner
    roles: list[Label] = Field(min_length=1, max_length=8)
    layout: Layout = Field(
        description="HND/NHD: sharded heads; REPLICATED: identical on every rank; SECTIONED "
        "(per-request state only): concatenated sections, each split over the state axis"
    )
    num_kv_heads: int | None = Field(
        default=None,
        ge=1,
        le=MAX_HEADS,
        description="Heads this rank holds (KV heads; SSM heads in a state group)",
    )
    total_kv_heads: int | None = Field(
        default=None,
        ge=1,
        le=MAX_HEADS,
        description="Model-wide heads of these layers (KV heads; SSM heads in a state group)",
    )
    head_dim: int | None = Field(default=None, ge=1, le=MAX_HEAD_DIM)
    d_state: int | None = Field(
        default=None,
        ge=1,
        le=MAX_HEAD_DIM,
        description="SSM state size of an HND state view (compared across sides when both "
        "give it; with head_dim and dtype it must match the bytes per head)",
    )
    section_bytes: list[Annotated[int, Field(ge=1, le=MAX_BYTES)]] | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_SECTIONS,
        description="SECTIONED only: TP-aggregated bytes of each section of one buffer (e.g. "
        "the x, B, C channels of a Mamba2 conv state × (d_conv - 1) × itemsize); each section "
        "is split contiguously over the state axis, a rank's buffer is its shares in order",
    )
    dtype: Label
    buffers: list[BufferCreate] = Field(min_length=1, max_length=1 << 16)


class RankCreate(_Request):
    """One rank's page table: its pools and the views inside them."""

    rank: int = Field(ge=0, lt=MAX_RANKS)
    kv_heads_per_rank: int | None = Field(default=None, ge=1, le=MAX_HEADS)
    agent_metadata: str | None = Field(
        default=None, max_length=1 << 19, description="Transport (NIXL) agent metadata, opaque"
    )
    pools: list[PoolCreate] = Field(min_length=1, max_length=1024)
    views: list[ViewCreate] = Field(min_length=1, max_length=1024)


class LayerGroupCreate(_Request):
    """How a layer group pages its slots: by tokens, or one slot per request (recurrent state)."""

    id: int = Field(ge=0, le=MAX_LAYER, description="The pools' `layer_group`")
    tokens_per_slot: int | None = Field(
        ge=1,
        le=MAX_TOKENS_PER_BLOCK,
        description="Tokens per slot (must equal tokens_per_block), or null: per-request "
        "state (Mamba/SSM conv and SSM state, linear attention), one slot per request; a "
        "transfer names that slot, `[slot]`, on each side",
    )


class InstanceCreate(_Request):
    """An instance registration; ``ranks`` may be partial or omitted (sent one by one later)."""

    role: Role
    model: str | None = Field(default=None, max_length=256)
    tp: int = Field(default=1, ge=1, le=MAX_PARALLEL)
    pp: int = Field(default=1, ge=1, le=MAX_PARALLEL)
    cp: int = Field(default=1, ge=1, le=MAX_PARALLEL)
    attention_dp: bool = False
    tokens_per_block: int = Field(ge=1, le=MAX_TOKENS_PER_BLOCK)
    kv_heads_per_rank: int | None = Field(default=None, ge=1, le=MAX_HEADS)
    total_kv_heads: int | None = Field(default=None, ge=1, le=MAX_HEADS)
    layer_groups: list[LayerGroupCreate] = Field(
        default_factory=list,
        max_length=1024,
        description="Layer groups that are not paged by tokens_per_block (a group not listed "
        "is paged): `{id, tokens_per_slot: null}` marks per-request recurrent state",
    )
    ranks: list[RankCreate] = Field(default_factory=list, max_length=MAX_RANKS)


class InstanceSummary(_Response):
    """An instance without its page tables (list views)."""

    name: str
    role: Role
    status: InstanceStatus
    generation: int = Field(description="Bumped on every change of the registration")
    epoch: str = Field(description="New (uuid4 hex) on every change; invalidates plans")
    model: str | None = None
    tp: int
    pp: int
    cp: int
    attention_dp: bool
    tokens_per_block: int
    kv_heads_per_rank: int | None = None
    total_kv_heads: int | None = None
    layer_groups: list[LayerGroupCreate] = Field(
        default_factory=list, description="As registered (empty: every group is paged)"
    )
    world_size: int
    missing_ranks: list[int]
    created_at: datetime
    updated_at: datetime


class InstanceRead(InstanceSummary):
    """An instance with every reported rank's page table, as registered.

    The instance fields and ``ranks`` have the types of :class:`InstanceCreate` (``ranks`` *is*
    a list of :class:`RankCreate`), so a read instance, changed, is a valid registration body;
    ``name``, ``status``, ``generation``, ``epoch``, ``world_size``, ``missing_ranks`` and the
    timestamps are read-only.
    """

    ranks: list[RankCreate]


class InstanceList(_Response):
    """One page of instances."""

    items: list[InstanceSummary]
    total: int
    limit: int
    offset: int


# ---------------------------------------------------------------------------------------------
# pairings and plans


class Issue(_Response):
    """One validation finding; ``code`` is stable API."""

    code: str
    message: str
    detail: dict[str, Any] = Field(default_factory=dict)


class Report(_Response):
    """A validation report: every error and warning found (not only the first)."""

    compatible: bool
    errors: list[Issue]
    warnings: list[Issue]


class PairingCreate(_Request):
    """Names of the two instances to pair."""

    context: Name
    generation: Name


class PairingRead(Report):
    """A stored pairing with the report of its last validation."""

    id: str
    context: str
    generation: str
    status: PairingStatus = Field(description="stale once either instance re-registered")
    context_epoch: str
    generation_epoch: str
    created_at: datetime
    validated_at: datetime


class PairingList(_Response):
    """One page of pairings."""

    items: list[PairingRead]
    total: int
    limit: int
    offset: int


class Run(_Response):
    """A strided copy: ``count`` runs of ``len`` bytes, ``src_step``/``dst_step`` apart."""

    src: int = Field(description="Byte offset inside the sender's slot")
    dst: int = Field(description="Byte offset inside the receiver's slot")
    len: int
    count: int
    src_step: int
    dst_step: int


class Segment(_Response):
    """The runs from one sender pool to one receiver pool, applied to every block pair."""

    src_pool: int
    dst_pool: int
    layer_group: int = Field(description="Layer group of both pools (whose block ids apply)")
    state: bool = Field(
        default=False,
        description="Per-request state (tokens_per_slot null): the runs apply once, to the "
        "request's state slot on each side, not to aligned blocks",
    )
    sub_block: int = Field(
        default=0,
        description="With different tokens_per_block (the route's `block_ratio` r > 1): the "
        "runs apply to each large block and small block `sub_block` (0 … r−1) of the r small "
        "blocks it pairs with; 0 otherwise (always 0 for `state` segments)",
    )
    runs: list[Run]


class RouteSlice(_Response):
    """Which heads of which layers of one receiver view a route fills, from which sender view."""

    receiver_view: int = Field(description="Index of the view in the receiver rank's `views`")
    sender_view: int = Field(description="Index of the view in the sender rank's `views`")
    owner: Owner
    roles: list[str]
    layout: Layout = Field(description="The receiver view's layout")
    sender_layout: Layout | None = Field(
        default=None,
        description="The sender view's layout: differs from `layout` for an HND <-> NHD "
        "conversion (null in plans cached before it was recorded)",
    )
    layers: list[int]
    global_heads: list[int] | None = Field(
        description="`[start, stop)` of the model-wide heads (SECTIONED: of the bytes of "
        "section 0, each section cut in proportion); null for REPLICATED views"
    )
    sender_local_heads: list[int] | None = Field(
        description="`[start, stop)` of those heads on the sender rank; null for REPLICATED"
    )
    receiver_local_heads: list[int] | None = Field(
        description="`[start, stop)` of those heads on the receiver rank; null for REPLICATED"
    )
    bytes_per_block: int


class Route(_Response):
    """Everything one sender rank sends to one receiver rank, per block."""

    sender_rank: int
    receiver_rank: int
    bytes_per_block: int
    cp_modulus: int = Field(
        description="With CP on one side, the route carries the logical blocks `j` (the "
        "block's index in the request: from `num_tokens`, else counted from the start of the "
        "longer block list) with `j % cp_modulus == cp_remainder` (1 without CP)"
    )
    cp_remainder: int
    cp_side: Role | None = Field(
        description="Which side's block list is split over CP ranks; null without CP"
    )
    block_ratio: int = Field(
        default=1,
        description="Larger tokens_per_block / smaller (1 when equal): one block of "
        "`large_side` pairs with `block_ratio` consecutive blocks of the other side, aligned by "
        "token position from the start of the request (a transfer gives `num_tokens`); "
        "`bytes_per_block` counts one large block",
    )
    large_side: Role | None = Field(
        default=None, description="The side with the larger blocks; null when they are equal"
    )
    small_tokens_per_block: int | None = Field(
        default=None,
        description="The smaller of the two sides' tokens_per_block (the common one when they "
        "are equal): what a request's `num_tokens` is counted in, and with a ratio what a "
        "partial last block is cut to, token by token",
    )
    segments: list[Segment]
    slices: list[RouteSlice]


class StagingShare(_Response):
    """Where one writer's bytes go in a receiver's staging area, per block."""

    sender_rank: int
    offset_per_block: int
    bytes_per_block: int


class Receiver(_Response):
    """Per receiver rank: its writers, their staging offsets, and whether legacy equal-split
    staging would be safe."""

    rank: int
    writers: int = Field(description="Number of sender ranks writing into this rank")
    writer_ranks: list[int]
    overlapping_ranks: list[int] = Field(
        description="Sender ranks whose heads overlap this rank's (writers or not)"
    )
    equal_split_safe: bool
    staging: list[StagingShare]


class PlanPool(_Response):
    """A pool of either side that the plan touches: what expanding blocks into bytes needs."""

    side: Role
    rank: int
    pool: int
    stride: int = Field(description="Slot stride in bytes")
    num_slots: int
    layer_group: int


class PlanRead(_Response):
    """A compiled plan: per-route templates of strided runs (independent of block counts)."""

    context: str
    generation: str
    context_dp_rank: int | None
    generation_dp_rank: int | None
    tokens_per_block: int = Field(description="The context side's tokens per block")
    generation_tokens_per_block: int = Field(
        description="The generation side's tokens per block (differs for a block-size ratio)"
    )
    bytes_per_block: int = Field(
        description="Bytes moved per aligned block (the larger block for a ratio), all routes"
    )
    runs: int = Field(description="Runs in all templates")
    routes: list[Route]
    receivers: list[Receiver]
    warnings: list[Issue]
    pools: list[PlanPool]


class InstanceInline(InstanceCreate):
    """An instance body with its name, for compile-only checks."""

    name: Name


class CompatibilityCheck(_Request):
    """Two inline instance bodies to check against each other (nothing is stored)."""

    context: InstanceInline
    generation: InstanceInline
    context_dp_rank: int | None = Field(default=None, ge=0, lt=MAX_PARALLEL)
    generation_dp_rank: int | None = Field(default=None, ge=0, lt=MAX_PARALLEL)


class PlanSummary(_Response):
    """Size of a compiled plan."""

    routes: int
    segments: int
    runs: int
    bytes_per_block: int


class CompatibilityRead(Report):
    """The report, plus a plan summary when compatible and a plan could be compiled."""

    plan: PlanSummary | None = None


# ---------------------------------------------------------------------------------------------
# transfers


BlockIds = Annotated[
    list[Annotated[int, Field(ge=0, le=MAX_BLOCK_ID)]], Field(max_length=MAX_BLOCKS_PER_GROUP)
]


PerCpRankBlockIds = Annotated[list[BlockIds], Field(min_length=2, max_length=MAX_PARALLEL)]


class BlockLists(_Request):
    """One layer group's block ids on both sides (suffixes of the same logical range).

    Helix (context cp = 1, generation cp = N): ``generation`` may instead be one list per
    generation CP rank, in ``cp_rank`` order; logical block ``j`` is at position ``j // N`` of
    CP rank ``j % N``'s list.

    Per-request state group (``tokens_per_slot: null``): each side names the request's state
    slot, ``[slot]`` (exactly one id; ``[]`` moves nothing), or under helix one ``[slot]`` per
    generation CP rank; more ids are refused (``invalid_blocks``).
    """

    context: BlockIds = Field(
        description="Block ids of the context side (a per-request state group: `[slot]`)"
    )
    generation: BlockIds | PerCpRankBlockIds = Field(
        description="Block ids of the generation side: one list, or (helix CP) one list per "
        "generation CP rank in cp_rank order (a per-request state group: `[slot]`, or one "
        "`[slot]` per CP rank)"
    )

    @model_validator(mode="after")
    def _bounded(self) -> BlockLists:
        if self.generation and isinstance(self.generation[0], list):
            total = sum(len(ids) for ids in self.generation)  # type: ignore[arg-type]
            if total > MAX_BLOCKS_PER_GROUP:
                raise ValueError(
                    f"{total} generation block ids in all; at most {MAX_BLOCKS_PER_GROUP}"
                )
        return self


LAYER_GROUP_KEY_PATTERN = r"^(0|[1-9][0-9]{0,6})$"
LayerGroupKey = Annotated[str, StringConstraints(pattern=LAYER_GROUP_KEY_PATTERN)]


def _blocks_map_schema(schema: dict[str, Any]) -> None:
    """Declare the blocks map as ``additionalProperties: BlockLists`` (which code generators
    type as a map of ``BlockLists``; they drop ``patternProperties``), with the key pattern
    kept as ``propertyNames``. The server validates the keys either way."""
    patterns = schema.pop("patternProperties", None)
    if patterns:
        ((pattern, value),) = patterns.items()
        schema["additionalProperties"] = value
        schema["propertyNames"] = {"pattern": pattern}


class TransferCreate(_Request):
    """Plan (and with ``execute``, run) one request's KV transfer."""

    context: Name
    generation: Name
    request_id: str = Field(min_length=1, max_length=256)
    context_dp_rank: int | None = Field(default=None, ge=0, lt=MAX_PARALLEL)
    generation_dp_rank: int | None = Field(default=None, ge=0, lt=MAX_PARALLEL)
    blocks: dict[LayerGroupKey, BlockLists] = Field(
        min_length=1,
        max_length=1024,
        description="Layer group (a decimal number without leading zeros: "
        f"`{LAYER_GROUP_KEY_PATTERN}`) → both sides' block ids in that group",
        json_schema_extra=_blocks_map_schema,
    )
    num_tokens: int | None = Field(
        default=None,
        ge=1,
        le=MAX_NUM_TOKENS,
        description="The request's prompt tokens whose KV the context holds and that move. "
        "Blocks pair by token position: a side with T tokens per block spans ceil(num_tokens / "
        "T) blocks and each list is a suffix of them, ending with the block of the last prompt "
        "token. Required for a block-size ratio (a partial last block then moves only the "
        "tokens that exist) and for context parallelism with layer groups of different "
        "lengths (`ambiguous_alignment` otherwise); without it, the longer list is taken to "
        "start at the request's first block and a generation list longer than the context's "
        "is refused (`invalid_blocks`)",
    )
    execute: bool = False
    mode: TransferMode = Field(
        default="auto",
        description="staged: gather, one NIXL WRITE per chunk into the receiver's staging "
        "area, scatter there; fragments: one NIXL descriptor per fragment, pool to pool (no "
        "copies); auto: per route, fragments when the route's fragments average at least 8 KiB, "
        "staged otherwise",
    )
    verify: bool = Field(
        default=False, description="Compare sender and receiver crc32 of every route's bytes"
    )
    timeout_s: float = Field(
        default=30.0,
        gt=0,
        le=600,
        description="execute: every rank fails its side after this many seconds, and the "
        "control plane fails the transfer if a rank has not reported by then",
    )


class RouteSummary(_Response):
    """What one route moves for this transfer."""

    sender_rank: int
    receiver_rank: int
    bytes: int
    fragments: int
    runs: int = Field(description="Runs in the route's template")
    blocks: int = Field(description="Aligned blocks moved (the most of any pool pair)")


class TransferRead(_Response):
    """A planned transfer."""

    id: str
    status: TransferStatus
    context: str
    generation: str
    request_id: str
    pairing_id: str | None
    context_dp_rank: int | None
    generation_dp_rank: int | None
    num_tokens: int | None = Field(
        default=None, description="The request's prompt tokens, when the transfer gave them"
    )
    execute: bool
    routes: list[RouteSummary]
    bytes: int
    fragments: int
    created_at: datetime
    updated_at: datetime
    mode: TransferMode = "staged"
    verify: bool = False
    attempt: int = Field(default=0, description="Execution attempt (0 until dispatched)")
    error: str | None = Field(default=None, description="Why the transfer (or an attempt) failed")
    started_at: datetime | None = None
    finished_at: datetime | None = None
    duration_s: float | None = Field(
        default=None, description="Dispatch (engine path: the first rank's start) to done/failed"
    )


class TransferList(_Response):
    """One page of transfers."""

    items: list[TransferRead]
    total: int
    limit: int
    offset: int


class HandoverCounts(_Response):
    """Handovers of a window by outcome, with the bytes and latency of the done ones."""

    total: int
    planned: int = Field(description="Planned, never executed by kvplane's workers")
    queued: int
    running: int
    done: int
    failed: int
    bytes_moved: int = Field(description="Bytes of the done handovers")
    p50_s: float | None = Field(
        description="Median creation-to-done latency of the done handovers (nearest rank); "
        "null without one"
    )
    p99_s: float | None = Field(description="99th percentile of the same (nearest rank)")


class HandoverPeer(HandoverCounts):
    """An instance's handovers with one peer: the instance on the other side."""

    peer: str = Field(description="A generation instance for a context instance, and reverse")
    pairing_id: str | None = Field(description="The two instances' pairing; null when unpaired")
    last_at: datetime = Field(description="Creation time of the newest handover")


class HandoverFailure(_Response):
    """One failed handover and why."""

    transfer_id: str
    request_id: str
    peer: str
    error: str | None
    created_at: datetime
    finished_at: datetime | None


class InstanceHandovers(_Response):
    """An instance's transfers of a recent window (the handovers it sent as a context instance,
    or received as a generation instance): per peer, in all, and the latest failures."""

    instance: str
    role: Role
    since: datetime = Field(description="Start of the window: handovers created since then")
    window_s: int
    peers: list[HandoverPeer] = Field(description="One entry per peer, by name")
    total: HandoverCounts = Field(description="Every peer together")
    failures: list[HandoverFailure] = Field(description="The newest failed handovers first")


class RouteFragments(_Response):
    """Expanded fragments of one route: ``[src_pool, src_offset, dst_pool, dst_offset, length]``."""

    sender_rank: int
    receiver_rank: int
    fragments: list[Annotated[list[int], Field(min_length=5, max_length=5)]]


class TransferFragments(_Response):
    """One page of a transfer's fragments (all of them when they fit in one), offsets relative
    to each pool's base. Fragments are numbered across routes in plan order."""

    routes: list[RouteFragments]
    total: int = Field(description="Fragments of the whole transfer")
    offset: int = Field(description="Number of this page's first fragment")
    limit: int = Field(description="Most fragments this page could hold")
    next_offset: int | None = Field(
        description="`offset` of the next page, or null when this page ends the list"
    )


# ---------------------------------------------------------------------------------------------
# health


class Health(_Response):
    """Liveness/readiness answer."""

    # `detail` is left out when empty (response_model_exclude_none), so it is not required.
    model_config = ConfigDict(json_schema_serialization_defaults_required=False)

    status: Literal["ok", "unavailable"]
    detail: str | None = None
