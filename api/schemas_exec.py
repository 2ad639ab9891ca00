"""Wire schemas of execution: workers, their directory, transfer records (pydantic only; workers
import it)."""

from __future__ import annotations

import base64
import binascii
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

from api.schemas import MAX_ADDRESS, MAX_BYTES, MAX_PARALLEL, MAX_SLOTS, Name

PartKind = Literal["send", "receive"]
PartState = Literal["done", "failed"]
Transport = Literal["nixl"]
Device = Annotated[str, StringConstraints(pattern=r"^(cpu|cuda(:[0-9]{1,3})?)$")]
# NIXL agent metadata (UCX backend, loopback): 0.8 KiB of base64 with 4 pools, 1.5 KiB with 16;
# about 35 bytes more per registered region and per UCX device address. 64 KiB leaves room for
# a thousand pools and many NICs, and bounds what a listing or a directory can be made to carry.
MAX_METADATA_B64 = 64 << 10
# Unix seconds a record's timestamps may take at all (2100-01-01): beyond it a datetime of the
# database overflows. The control plane also holds them to a window around its own clock.
MAX_UNIX_S = 4_102_444_800.0


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


class UcxSettings(_Request):
    """The UCX settings a worker's NIXL endpoint was created with (``default``: UCX chooses,
    i.e. every transport or device it finds; on one machine that means shared memory / CMA)."""

    backend: Literal["UCX"] = "UCX"
    tls: str = Field(
        default="default",
        min_length=1,
        max_length=256,
        description="UCX transports (UCX_TLS), e.g. tcp; `kvplane worker --ucx-tls`",
    )
    net_devices: str = Field(
        default="default",
        min_length=1,
        max_length=256,
        description="Network devices UCX may use (UCX_NET_DEVICES), e.g. "
        "eth0; `kvplane worker --ucx-net-devices`",
    )


# A UCX transport on a device as UCX's log writes it: tcp/eth0, cma/memory, rc_mlx5/mlx5_0:1.
_UCX_NAME = r"[A-Za-z0-9_.:@+-]{1,64}"
UcxTl = Annotated[str, StringConstraints(pattern=rf"^{_UCX_NAME}/{_UCX_NAME}$")]
UcxLaneKind = Annotated[str, StringConstraints(pattern=r"^[a-z_]{1,32}$")]
UcxTls = Annotated[list[UcxTl], Field(max_length=64)]


class UcxInUse(_Request):
    """What UCX actually uses for a worker's peer connections, from UCX's own log of the
    endpoint configurations it built (``transport/device``: ``tcp/eth0`` is the network,
    ``cma/memory`` and every other ``…/memory`` shared memory between processes of one kernel)."""

    transports: list[UcxTl] = Field(
        min_length=1,
        max_length=64,
        description="Every "
        "transport/device on a lane to a peer, e.g. tcp/eth0, "
        "cma/memory, rc_mlx5/mlx5_0:1",
    )
    lanes: dict[UcxLaneKind, UcxTls] = Field(
        max_length=16,
        description="The same by lane kind as UCX names them: am (active "
        "messages, with the bandwidth lanes that carry a large WRITE's bytes), rma, amo (_am: "
        "emulated over active messages), tag, stream, ka (keep-alive)",
    )
    peers: list[Literal["intra-node", "inter-node"]] = Field(
        min_length=1,
        max_length=2,
        description="Where the peers were: this machine (intra-node) or another one (inter-node)",
    )
    shared_memory: bool = Field(
        description="A lane on shared memory: bytes between workers "
        "of one machine skip the network (UCX_TLS=tcp rules it out)"
    )


class WorkerHeartbeat(_Request):
    """A worker's heartbeat; the body is optional (older workers send none)."""

    ucx_in_use: UcxInUse | None = Field(
        default=None,
        description="What UCX uses for this worker's peer connections, once it made one",
    )


class PeerInfo(_Request):
    """What other workers need to reach this one over NIXL (opaque metadata is base64)."""

    agent: str = Field(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9._:-]+$")
    metadata_b64: str = Field(
        min_length=4,
        max_length=MAX_METADATA_B64,
        pattern=r"^[A-Za-z0-9+/]+={0,2}$",
        description="The NIXL agent metadata, base64 (at most 64 KiB)",
    )
    mem_type: Literal["DRAM", "VRAM"]
    device_id: int = Field(ge=0, le=1024)
    pools: list[PeerPool] = Field(min_length=1, max_length=1024)
    staging: Staging
    ucx: UcxSettings | None = Field(default=None, description="Absent from older workers")

    @field_validator("metadata_b64")
    @classmethod
    def _decodable(cls, value: str) -> str:
        try:
            base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("not decodable base64 (length a multiple of 4)") from None
        return value


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
    """A worker as the control plane sees it (``directory_revision``: see the directory)."""

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
    connected: bool = Field(
        default=False,
        description="Holds the command stream open to "
        "this API process (REST execute=true reaches it)",
    )
    directory_revision: str | None = None
    ucx: UcxSettings | None = Field(
        default=None,
        description="The UCX transports and devices "
        "the worker's NIXL endpoint runs with (null: an older "
        "worker that did not say)",
    )
    ucx_in_use: UcxInUse | None = Field(
        default=None,
        description="What UCX actually uses for the worker's peer connections "
        "(its heartbeat reports UCX's own log): shared memory (cma/memory …) or the network "
        "(tcp/eth0 …). Null until the worker connected to a peer, for an older worker, or "
        "where the worker's UCX_LOG_LEVEL / UCX_LOG_FILE are the user's own",
    )


class WorkerList(BaseModel):
    items: list[WorkerRead]


class WorkerAttached(WorkerRead):
    """Registration answer: how often to heartbeat."""

    heartbeat_interval_s: float


class RouteResult(_Request):
    sender_rank: int = Field(ge=0, lt=MAX_PARALLEL)
    receiver_rank: int = Field(ge=0, lt=MAX_PARALLEL)
    bytes: int = Field(ge=0, le=1 << 50)
    checksum: int | None = Field(default=None, ge=0, le=(1 << 32) - 1)
    sender_checksum: int | None = Field(
        default=None,
        ge=0,
        le=(1 << 32) - 1,
        description="A receive with verify: the sender's crc32 of the route, as its last "
        "notification carried it; the receiving rank compared it with its own (`checksum`) "
        "before the bytes counted as arrived, so this route needs no send record",
    )


class PartRead(BaseModel):
    """One rank's part of an executed transfer, as its worker recorded it."""

    id: str
    transfer_id: str
    kind: PartKind = Field(description="send (a context rank) or receive (a generation rank)")
    instance: str
    rank: int
    state: PartState
    attempt: int
    worker_id: str | None
    result: dict[str, Any] | None = Field(
        description="bytes, duration_s and per-route results (checksums with verify)"
    )
    error: str | None
    created_at: datetime
    finished_at: datetime | None


class PartList(BaseModel):
    items: list[PartRead]


class TransferCommand(BaseModel):
    """One rank's part of a REST ``execute=true`` transfer: a ``transfer`` line of its worker's
    stream (``GET /v1/workers/{id}/commands``, ``/v1/workers/{id}/stream``). The control plane
    builds it; the worker parses it (fields a newer control plane adds are ignored)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["transfer"] = "transfer"
    transfer_id: str = Field(min_length=1, max_length=64)
    attempt: int = Field(ge=1)
    xid: str = Field(
        min_length=1, description="The attempt's id on the wire: the handover's request id"
    )
    request_id: str = Field(min_length=1)
    context: str
    generation: str
    context_epoch: str
    generation_epoch: str
    context_dp_rank: int | None = None
    generation_dp_rank: int | None = None
    side: PartKind = Field(description="send (a context rank) or receive (a generation rank)")
    rank: int = Field(ge=0, lt=MAX_PARALLEL, description="The rank this command is for")
    blocks: dict[str, dict[str, list[int] | list[list[int]]]] = Field(
        description="The transfer's block lists by layer group, as POST /v1/transfers took them"
    )
    num_tokens: int | None = Field(
        default=None, ge=1, description="The request's prompt tokens, when the transfer named them"
    )
    mode: Literal["auto", "staged", "fragments"] = "staged"
    verify: bool = False
    deadline_at: float = Field(description="The attempt's deadline (Unix seconds)")
    timeout_s: float = Field(
        description="What was left of the deadline when the line left the control plane"
    )


class TransferRecord(_Request):
    """One rank's finished part of one transfer (engine path or REST-dispatched)."""

    transfer_id: str | None = Field(
        default=None,
        min_length=1,
        max_length=64,
        description="The transfer's id when it was dispatched through POST /v1/transfers; "
        "absent for the engine path (the control plane derives it from pairing, epochs and "
        "request id)",
    )
    attempt: int = Field(default=1, ge=1, le=1000)
    request_id: str = Field(min_length=1, max_length=256)
    pairing_id: str = Field(min_length=1, max_length=64)
    context: Name
    generation: Name
    context_epoch: str = Field(min_length=1, max_length=64)
    generation_epoch: str = Field(min_length=1, max_length=64)
    context_dp_rank: int | None = Field(default=None, ge=0, lt=MAX_PARALLEL)
    generation_dp_rank: int | None = Field(default=None, ge=0, lt=MAX_PARALLEL)
    side: PartKind
    rank: int = Field(ge=0, lt=MAX_PARALLEL)
    status: Literal["done", "failed"]
    error: str | None = Field(default=None, max_length=2000)
    bytes: int = Field(ge=0, le=1 << 50)
    mode: Literal["auto", "staged", "fragments"] = "staged"
    verify: bool = False
    started_at: float = Field(
        ge=0,
        le=MAX_UNIX_S,
        allow_inf_nan=False,
        description="Unix time the rank started its part (within a day "
        "before and a few minutes after the control plane's clock)",
    )
    finished_at: float = Field(
        ge=0,
        le=MAX_UNIX_S,
        allow_inf_nan=False,
        description="Unix time the rank finished its part (not before started_at)",
    )
    routes: list[RouteResult] = Field(default_factory=list, max_length=4096)
    verified_bytes: int | None = Field(default=None, ge=0, le=1 << 50)
    timeout_s: float | None = Field(
        default=None,
        gt=0,
        le=3600,
        description="The handle's deadline (engine path: the control plane fails the transfer "
        "when a rank has not recorded its part by then, plus a grace)",
    )
    blocks: dict[str, dict[str, list[int]]] | None = Field(
        default=None,
        description="The request's block lists (engine path; kept for "
        "GET /v1/transfers/{id}/fragments)",
    )
    num_tokens: int | None = Field(
        default=None,
        ge=1,
        le=1 << 40,
        description="The request's prompt tokens, when the engine gave them (engine path; "
        "the blocks are expanded with them)",
    )


class TransferRecords(_Request):
    """A batch of finished parts from one worker (one request per N transfers or second)."""

    worker_id: str = Field(min_length=1, max_length=64)
    records: list[TransferRecord] = Field(min_length=1, max_length=1000)


class RecordsAccepted(BaseModel):
    accepted: int = Field(description="Records stored (a repeated record counts once)")
    settled: list[str] = Field(description="Transfers that these records finished")


class DirectoryPlan(BaseModel):
    """One DP-rank combination of a pairing: the routes that involve the worker's rank."""

    context_dp_rank: int | None
    generation_dp_rank: int | None
    senders: list[int]
    receivers: list[int]
    routes: list[dict[str, Any]] = Field(description="Plan routes (as in GET .../plan)")


class DirectoryPairing(BaseModel):
    id: str
    context: str
    generation: str
    context_epoch: str
    generation_epoch: str
    plans: list[DirectoryPlan]


class DirectoryWorker(BaseModel):
    worker_id: str
    peer: dict[str, Any] = Field(description="The peer's NIXL endpoint as it attached")


class DirectoryPeer(BaseModel):
    epoch: str
    ranks: dict[str, DirectoryWorker]


class WorkerDirectory(BaseModel):
    """Everything a worker needs for the hot path: templates of its pairings and peers."""

    revision: str = Field(description="Changes whenever anything below changes")
    instance: str
    role: str
    rank: int
    epoch: str
    pairings: list[DirectoryPairing]
    peers: dict[str, DirectoryPeer]
