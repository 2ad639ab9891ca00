"""SQLAlchemy models. The schema only ever changes through Alembic migrations (``migrations/``).

Registrations are stored as the raw JSON the instance sent (header + one row per rank) and
re-parsed by ``geometry`` when needed, so the planning core stays the single source of truth.
Compiled plans are cached per (pairing, context epoch, generation epoch, dp ranks): a new epoch
can never hit an old plan. A later migration adds the ``jobs`` table, referencing ``transfers.id``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    ForeignKey,
    Index,
    Integer,
    String,
    UniqueConstraint,
)
from sqlalchemy.orm import Mapped, mapped_column, relationship

from api.db import Base, UTCDateTime, utcnow

NAME_LENGTH = 128
EPOCH_LENGTH = 32
ID_LENGTH = 32
# A dp rank of None is stored as -1 so the plan-cache key can be a plain unique constraint.
NO_DP_RANK = -1


class InstanceRow(Base):
    """One registered instance: its header JSON, counters and readiness."""

    __tablename__ = "instances"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(NAME_LENGTH), unique=True)
    role: Mapped[str] = mapped_column(String(16), index=True)
    status: Mapped[str] = mapped_column(String(16), index=True)
    generation: Mapped[int] = mapped_column(Integer, default=1)
    epoch: Mapped[str] = mapped_column(String(EPOCH_LENGTH))
    world_size: Mapped[int] = mapped_column(Integer)
    header: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    # Migration 0007: bumped by every change its workers' directories depend on (its epoch, its
    # pairings, its peers' epochs and workers): the heartbeat reads it, nothing recomputes it.
    directory_revision: Mapped[int] = mapped_column(Integer, default=0, server_default="0")

    ranks: Mapped[list[RankRow]] = relationship(
        back_populates="instance",
        cascade="all, delete-orphan",
        passive_deletes=True,
        order_by="RankRow.rank",
    )


class RankRow(Base):
    """One rank's reported page table (raw JSON, as sent)."""

    __tablename__ = "instance_ranks"

    instance_id: Mapped[int] = mapped_column(
        ForeignKey("instances.id", ondelete="CASCADE"), primary_key=True
    )
    rank: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    body: Mapped[dict[str, Any]] = mapped_column(JSON)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)

    instance: Mapped[InstanceRow] = relationship(back_populates="ranks")


class PairingRow(Base):
    """A validated (context, generation) pair and the report of its last validation."""

    __tablename__ = "pairings"
    __table_args__ = (UniqueConstraint("context_id", "generation_id"),)

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    context_id: Mapped[int] = mapped_column(
        ForeignKey("instances.id", ondelete="CASCADE"), index=True
    )
    generation_id: Mapped[int] = mapped_column(
        ForeignKey("instances.id", ondelete="CASCADE"), index=True
    )
    context_epoch: Mapped[str] = mapped_column(String(EPOCH_LENGTH))
    generation_epoch: Mapped[str] = mapped_column(String(EPOCH_LENGTH))
    status: Mapped[str] = mapped_column(String(16), index=True)
    compatible: Mapped[bool] = mapped_column(Boolean)
    report: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    validated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)

    context: Mapped[InstanceRow] = relationship(foreign_keys=[context_id])
    generation: Mapped[InstanceRow] = relationship(foreign_keys=[generation_id])


class PlanRow(Base):
    """A compiled plan, cached under both instance epochs and both dp ranks (immutable)."""

    __tablename__ = "plans"
    __table_args__ = (
        UniqueConstraint(
            "pairing_id",
            "context_epoch",
            "generation_epoch",
            "context_dp_rank",
            "generation_dp_rank",
        ),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    pairing_id: Mapped[str] = mapped_column(
        ForeignKey("pairings.id", ondelete="CASCADE"), index=True
    )
    context_epoch: Mapped[str] = mapped_column(String(EPOCH_LENGTH))
    generation_epoch: Mapped[str] = mapped_column(String(EPOCH_LENGTH))
    context_dp_rank: Mapped[int] = mapped_column(Integer)
    generation_dp_rank: Mapped[int] = mapped_column(Integer)
    stale: Mapped[bool] = mapped_column(Boolean, default=False)
    body: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class TransferRow(Base):
    """One request's planned transfer: block lists, plan reference and the expansion summary."""

    __tablename__ = "transfers"

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    pairing_id: Mapped[str | None] = mapped_column(
        ForeignKey("pairings.id", ondelete="SET NULL"), index=True, nullable=True
    )
    plan_id: Mapped[int | None] = mapped_column(
        ForeignKey("plans.id", ondelete="SET NULL"), nullable=True
    )
    context_name: Mapped[str] = mapped_column(String(NAME_LENGTH))
    generation_name: Mapped[str] = mapped_column(String(NAME_LENGTH))
    request_id: Mapped[str] = mapped_column(String(256), index=True)
    context_dp_rank: Mapped[int | None] = mapped_column(Integer, nullable=True)
    generation_dp_rank: Mapped[int | None] = mapped_column(Integer, nullable=True)
    status: Mapped[str] = mapped_column(String(16), index=True)
    execute: Mapped[bool] = mapped_column(Boolean, default=False)
    blocks: Mapped[dict[str, Any]] = mapped_column(JSON)
    summary: Mapped[dict[str, Any]] = mapped_column(JSON)
    bytes: Mapped[int] = mapped_column(BigInteger)
    fragments: Mapped[int] = mapped_column(BigInteger)
    idempotency_key: Mapped[str | None] = mapped_column(String(256), unique=True, nullable=True)
    request_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow, index=True)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    # Execution (migration 0002): transport mode, checksum verification, attempts and outcome.
    mode: Mapped[str] = mapped_column(String(16), default="staged")
    verify: Mapped[bool] = mapped_column(Boolean, default=False)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    max_attempts: Mapped[int] = mapped_column(Integer, default=3)
    error: Mapped[str | None] = mapped_column(String(2000), nullable=True)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    # Migration 0004: a dispatched transfer not settled by then is failed by the control plane.
    deadline_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)


class WorkerRow(Base):
    """A worker process serving one rank: its device, transport and NIXL endpoint.

    ``peer`` is what other workers need to reach it (agent name, base64 agent metadata, pool base
    addresses, staging buffer); it travels through the control plane, never a side channel.
    ``epoch`` is the instance epoch the worker attached to: after a re-registration the worker
    must attach again before it may claim.
    """

    __tablename__ = "workers"
    __table_args__ = (Index("ix_workers_instance_rank", "instance_id", "rank"),)

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    instance_id: Mapped[int] = mapped_column(
        ForeignKey("instances.id", ondelete="CASCADE"), index=True
    )
    rank: Mapped[int] = mapped_column(Integer)
    epoch: Mapped[str] = mapped_column(String(EPOCH_LENGTH))
    device: Mapped[str] = mapped_column(String(32))
    transport: Mapped[str] = mapped_column(String(16))
    agent: Mapped[str] = mapped_column(String(256))
    peer: Mapped[dict[str, Any]] = mapped_column(JSON)
    host: Mapped[str] = mapped_column(String(256), default="")
    pid: Mapped[int] = mapped_column(Integer, default=0)
    stopped: Mapped[bool] = mapped_column(Boolean, default=False)
    registered_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow, index=True)
    # What UCX uses for the worker's peer connections, as its latest heartbeat said (null: not
    # known yet): wire.UcxInUse.
    ucx_in_use: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    # Migration 0007: the worker that attached to this one's rank after it (it is stopped).
    superseded_by: Mapped[str | None] = mapped_column(String(ID_LENGTH), nullable=True)

    instance: Mapped[InstanceRow] = relationship()


class JobRow(Base):
    """One rank's part of an executed transfer, as its worker recorded it (``done``/``failed``).

    Workers run transfers from cached plans and report finished parts in batches
    (``POST /v1/transfers/records``); a row per (transfer, attempt, kind, rank). The table kept its
    name from the job queue it replaced (migration 0004); the lease and staging columns are unused.
    """

    __tablename__ = "jobs"
    __table_args__ = (
        Index("ix_jobs_claim", "instance_id", "rank", "state", "not_before"),
        Index("ix_jobs_transfer_attempt", "transfer_id", "attempt"),
    )

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    transfer_id: Mapped[str] = mapped_column(
        ForeignKey("transfers.id", ondelete="CASCADE"), index=True
    )
    kind: Mapped[str] = mapped_column(String(16))
    instance_id: Mapped[int] = mapped_column(ForeignKey("instances.id", ondelete="CASCADE"))
    rank: Mapped[int] = mapped_column(Integer)
    epoch: Mapped[str] = mapped_column(String(EPOCH_LENGTH))
    state: Mapped[str] = mapped_column(String(16), index=True)
    attempt: Mapped[int] = mapped_column(Integer, default=1)
    claims: Mapped[int] = mapped_column(Integer, default=0)
    lease_token: Mapped[str | None] = mapped_column(String(ID_LENGTH), nullable=True)
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    worker_id: Mapped[str | None] = mapped_column(String(ID_LENGTH), nullable=True)
    not_before: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    staging_offset: Mapped[int] = mapped_column(BigInteger, default=0)
    staging_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    payload: Mapped[dict[str, Any]] = mapped_column(JSON)
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    error: Mapped[str | None] = mapped_column(String(2000), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)


class TokenRow(Base):
    """An API bearer token: only the sha256 of its secret is stored (the secret is shown once).

    ``scope`` is ``instance``, ``worker``, ``operator`` or ``admin``; ``instance`` binds an
    instance or worker token to one instance name, and ``rank`` (migration 0004, optional) a
    worker token to one rank of it. A revoked token keeps its row (audit).
    """

    __tablename__ = "tokens"

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    name: Mapped[str] = mapped_column(String(NAME_LENGTH), default="")
    scope: Mapped[str] = mapped_column(String(16))
    instance: Mapped[str | None] = mapped_column(String(NAME_LENGTH), nullable=True)
    secret_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    rank: Mapped[int | None] = mapped_column(Integer, nullable=True)


class DashboardSessionRow(Base):
    """A dashboard sign-in (migration 0004): the cookie names this row, signed.

    The session ends at ``expires_at``, at logout (``revoked_at``) or when its token is revoked,
    whichever comes first; a copied cookie is worth nothing after any of them.
    """

    __tablename__ = "dashboard_sessions"

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    token_id: Mapped[str] = mapped_column(ForeignKey("tokens.id", ondelete="CASCADE"), index=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime())
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
