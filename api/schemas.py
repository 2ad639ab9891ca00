"""Wire schemas: what clients send (``*Create``: strict, ``extra="forbid"``) and get (``*Read``).

Request models are *strict*: JSON ``false`` is not ``0`` and ``"1"`` is not ``1``. Sizes are
bounded (the planning core re-checks the same bounds and every page-table rule, with field paths).
Workers may import this module; it depends on pydantic only.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

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
MAX_BLOCKS_PER_GROUP = 1 << 20

Name = Annotated[str, StringConstraints(pattern=NAME_PATTERN)]
Label = Annotated[str, StringConstraints(min_length=1, max_length=64)]
Role = Literal["context", "generation"]
InstanceStatus = Literal["incomplete", "ready"]
PairingStatus = Literal["compatible", "incompatible", "stale"]
TransferStatus = Literal["planned", "queued", "running", "done", "failed"]
TransferMode = Literal["staged", "fragments"]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Response(BaseModel):
    model_config = ConfigDict(from_attributes=True)


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
    """One class of buffers inside one pool, with its own head geometry."""

    pool: int = Field(ge=0, le=MAX_LAYER)
    owner: Literal["target", "draft"]
    roles: list[Label] = Field(min_length=1, max_length=8)
    layout: Literal["HND", "NHD", "REPLICATED"]
    num_kv_heads: int | None = Field(default=None, ge=1, le=MAX_HEADS)
    total_kv_heads: int | None = Field(default=None, ge=1, le=MAX_HEADS)
    head_dim: int | None = Field(default=None, ge=1, le=MAX_HEAD_DIM)
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
    ranks: list[RankCreate] = Field(default_factory=list, max_length=MAX_RANKS)


class RankRead(_Response):
    """A rank's page table as registered."""

    model_config = ConfigDict(extra="allow")

    rank: int
    kv_heads_per_rank: int | None = None
    agent_metadata: str | None = None
    pools: list[dict[str, Any]]
    views: list[dict[str, Any]]


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
    world_size: int
    missing_ranks: list[int]
    created_at: datetime
    updated_at: datetime


class InstanceRead(InstanceSummary):
    """An instance with every reported rank's page table."""

    ranks: list[RankRead]


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

    model_config = ConfigDict(extra="allow")

    src: int
    dst: int
    len: int
    count: int
    src_step: int
    dst_step: int


class Segment(_Response):
    """The runs from one sender pool to one receiver pool, applied to every block pair."""

    model_config = ConfigDict(extra="allow")

    src_pool: int
    dst_pool: int
    runs: list[Run]


class Route(_Response):
    """Everything one sender rank sends to one receiver rank, per block."""

    model_config = ConfigDict(extra="allow")

    sender_rank: int
    receiver_rank: int
    bytes_per_block: int
    segments: list[Segment]


class Receiver(_Response):
    """Per receiver rank: number of writers and whether legacy equal-split would be safe."""

    model_config = ConfigDict(extra="allow")

    rank: int
    writers: int
    equal_split_safe: bool


class PlanRead(_Response):
    """A compiled plan: per-route templates of strided runs (independent of block counts)."""

    model_config = ConfigDict(extra="allow")

    routes: list[Route]
    receivers: list[Receiver]


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


class BlockLists(_Request):
    """One layer group's block ids on both sides (suffixes of the same logical range)."""

    context: BlockIds
    generation: BlockIds


LayerGroupKey = Annotated[str, StringConstraints(pattern=r"^(0|[1-9][0-9]{0,6})$")]


class TransferCreate(_Request):
    """Plan (and with ``execute``, run) one request's KV transfer."""

    context: Name
    generation: Name
    request_id: str = Field(min_length=1, max_length=256)
    context_dp_rank: int | None = Field(default=None, ge=0, lt=MAX_PARALLEL)
    generation_dp_rank: int | None = Field(default=None, ge=0, lt=MAX_PARALLEL)
    blocks: dict[LayerGroupKey, BlockLists] = Field(min_length=1, max_length=1024)
    execute: bool = False
    mode: TransferMode = Field(
        default="staged",
        description="staged: gather, one NIXL WRITE per chunk into the receiver's staging "
        "area, scatter there; fragments: one NIXL descriptor per fragment, pool to pool",
    )
    verify: bool = Field(
        default=False, description="Compare sender and receiver crc32 of every route's bytes"
    )
    timeout_s: float = Field(
        default=30.0, gt=0, le=600,
        description="execute: every rank fails its side after this many seconds, and the "
        "control plane fails the transfer if a rank has not reported by then",
    )


class RouteSummary(_Response):
    """What one route moves for this transfer."""

    model_config = ConfigDict(extra="allow")

    sender_rank: int
    receiver_rank: int
    bytes: int
    fragments: int


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
        default=None, description="Dispatch (engine path: the first rank's start) to done/failed")


class TransferList(_Response):
    """One page of transfers."""

    items: list[TransferRead]
    total: int
    limit: int
    offset: int


class RouteFragments(_Response):
    """Expanded fragments of one route: ``[src_pool, src_offset, dst_pool, dst_offset, length]``."""

    sender_rank: int
    receiver_rank: int
    fragments: list[Annotated[list[int], Field(min_length=5, max_length=5)]]


class TransferFragments(_Response):
    """Every fragment of a transfer, offsets relative to each pool's base."""

    routes: list[RouteFragments]


# ---------------------------------------------------------------------------------------------
# health


class Health(_Response):
    """Liveness/readiness answer."""

    status: Literal["ok", "unavailable"]
    detail: str | None = None
