"""Wire schemas of execution: workers, job leases and results (pydantic only; workers import it)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from api.schemas import MAX_ADDRESS, MAX_BYTES, MAX_PARALLEL, MAX_SLOTS, Name

JobKind = Literal["send", "receive"]
JobState = Literal["queued", "leased", "done", "failed"]
Transport = Literal["nixl"]
Device = Annotated[str, StringConstraints(pattern=r"^(cpu|cuda(:[0-9]{1,3})?)$")]
MAX_METADATA_B64 = 1 << 20  # NIXL agent metadata is a few KiB; refuse anything absurd
MAX_WAIT_S = 30.0


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class PeerPool(_Request):
    """A pool as the worker registered it with NIXL: its spec and live base address."""

    id: int = Field(ge=0, le=MAX_SLOTS)
    layer_group: int = Field(default=0, ge=0, le=MAX_SLOTS)
    slot_bytes: int = Field(ge=1, le=MAX_BYTES)
    slot_stride_bytes: int = Field(ge=1, le=MAX_BYTES)
    num_slots: int = Field(ge=1, le=MAX_SLOTS)
    base_address: int = Field(ge=0, le=MAX_ADDRESS)


class Staging(_Request):
    """The worker's registered staging buffer (receivers' staged writes land here)."""

    address: int = Field(ge=0, le=MAX_ADDRESS)
    bytes: int = Field(ge=0, le=MAX_BYTES)


class PeerInfo(_Request):
    """What other workers need to reach this one over NIXL (opaque metadata is base64)."""

    agent: str = Field(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9._:-]+$")
    metadata_b64: str = Field(min_length=1, max_length=MAX_METADATA_B64,
                              pattern=r"^[A-Za-z0-9+/]+={0,2}$")
    mem_type: Literal["DRAM", "VRAM"]
    device_id: int = Field(ge=0, le=1024)
    pools: list[PeerPool] = Field(min_length=1, max_length=1024)
    staging: Staging


class WorkerCreate(_Request):
    """A worker attaching to one rank of a registered instance."""

    instance: Name
    rank: int = Field(ge=0, lt=MAX_PARALLEL)
    device: Device = "cpu"
    transport: Transport = "nixl"
    peer: PeerInfo
    host: str = Field(default="", max_length=256)
    pid: int = Field(default=0, ge=0, le=1 << 31)


class WorkerRead(BaseModel):
    """A worker as the control plane sees it."""

    model_config = ConfigDict(json_schema_serialization_defaults_required=True)

    id: str
    instance: str
    rank: int
    epoch: str
    device: str
    transport: str
    agent: str
    host: str
    pid: int
    status: Literal["alive", "gone", "stopped", "stale"]
    registered_at: datetime
    heartbeat_at: datetime
    heartbeat_age_s: float
    current_job: str | None = None


class WorkerList(BaseModel):
    items: list[WorkerRead]


class WorkerAttached(WorkerRead):
    """Registration answer: how often to heartbeat and how long a lease lasts."""

    heartbeat_interval_s: float
    lease_ttl_s: float


class JobClaim(_Request):
    """A worker asking for work; waits up to ``wait_s`` for a job to appear."""

    worker_id: str = Field(min_length=1, max_length=64)
    wait_s: float = Field(default=0.0, ge=0.0, le=MAX_WAIT_S)


class JobLease(BaseModel):
    """A claimed job: run it, then complete or fail it with ``lease_token``."""

    id: str
    transfer_id: str
    kind: JobKind
    instance: str
    rank: int
    attempt: int
    lease_token: str
    lease_expires_at: datetime
    payload: dict[str, Any]


class RouteResult(_Request):
    sender_rank: int = Field(ge=0, lt=MAX_PARALLEL)
    receiver_rank: int = Field(ge=0, lt=MAX_PARALLEL)
    bytes: int = Field(ge=0, le=1 << 50)
    checksum: int | None = Field(default=None, ge=0, le=(1 << 32) - 1)


class Heartbeat(_Request):
    """What the worker is running: only these jobs' leases are extended."""

    jobs: list[Annotated[str, StringConstraints(min_length=1, max_length=64)]] = Field(
        default_factory=list,
        max_length=16,
        description="Ids of the jobs the worker is running now. Leases it holds on other jobs "
        "(a claim whose answer was lost) are not extended, so they expire and are retried.",
    )


class JobComplete(_Request):
    """A job's result: bytes moved, wall time, per-route checksums (crc32) when verifying."""

    lease_token: str = Field(min_length=1, max_length=64)
    bytes: int = Field(ge=0, le=1 << 50)
    duration_s: float = Field(ge=0.0, le=86400.0)
    routes: list[RouteResult] = Field(default_factory=list, max_length=4096)
    verified_bytes: int | None = Field(default=None, ge=0, le=1 << 50)


class JobFail(_Request):
    """A job that could not run: why, and whether another attempt could succeed."""

    lease_token: str = Field(min_length=1, max_length=64)
    reason: str = Field(min_length=1, max_length=1000)
    retryable: bool = True


class JobRead(BaseModel):
    id: str
    transfer_id: str
    kind: JobKind
    instance: str
    rank: int
    state: JobState
    attempt: int
    claims: int
    worker_id: str | None
    lease_expires_at: datetime | None
    staging_offset: int
    staging_bytes: int
    result: dict[str, Any] | None
    error: str | None
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None
