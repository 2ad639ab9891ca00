"""Execution: workers, the job queue and transfer outcomes.

A transfer with ``execute=true`` becomes jobs for the ranks involved:

- mode ``staged`` (default): one ``send`` job per active sender rank (its routes) and one
  ``receive`` job per receiver rank. The control plane reserves each receiver's staging area for
  the transfer (first fit in the receiver worker's registered staging buffer) and gives every
  writer its exact offset in it; senders gather, NIXL-WRITE chunk by chunk with notifications;
  receivers scatter each chunk as it lands.
- mode ``fragments``: one NIXL descriptor per fragment straight into the receiver's pools (the
  comparison path; nothing to reserve). Without ``verify`` only ``send`` jobs; with it, also one
  ``receive`` job per receiver rank, which waits for its senders' notifications and checksums
  the bytes where they landed, in the same fragment order as the sender.

Job states ``queued → leased → done | failed``. Claiming is one guarded statement:
``UPDATE jobs … WHERE id = (SELECT id … FOR UPDATE SKIP LOCKED LIMIT 1) AND state = 'queued'
RETURNING id`` (PostgreSQL skips locked rows; SQLite serializes writers, ``BEGIN IMMEDIATE``).
The lease token is a fencing token: every later change is ``… WHERE lease_token = :token AND
state = 'leased'``, so a worker whose lease expired gets 409, never a silent overwrite.

Jobs of one transfer are coupled (a receiver waits for its writers' notifications), so a failure
retries the *transfer*: every job of the attempt is superseded and a new attempt is enqueued after
a backoff, up to ``max_attempts``; then the transfer fails with the reason. A job whose instance
or peer re-registered (new epoch) fails the transfer with ``peer_restarted``: bytes from an old
memory layout are never used. A transfer is ``done`` only when every job of its attempt is, and,
with ``verify``, when every route's sender and receiver crc32 agree.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, and_, func, or_, select, text, update
from sqlalchemy.orm import Session

from api import schemas_exec as wire
from api.errors import BadRequest, Conflict, LeaseLost, NotFound, Unavailable
from api.geometry import Plan, expand
from api.models import InstanceRow, JobRow, PlanRow, TransferRow, WorkerRow

log = logging.getLogger(__name__)

LEASE_TTL_S = 30.0
HEARTBEAT_INTERVAL_S = 1.0
WORKER_GONE_S = 10.0
RETRY_BACKOFF_S = (0.5, 2.0, 5.0)
CHUNK_BLOCKS = 16
JOB_TIMEOUT_S = 60.0
QUARANTINE_MARGIN_S = 10.0
ACTIVE = ("queued", "leased")

Clock = Callable[[], datetime]


def _id() -> str:
    return uuid.uuid4().hex


# --------------------------------------------------------------------------------------------
# workers


def _instance(session: Session, name: str) -> InstanceRow:
    row = session.scalars(select(InstanceRow).where(InstanceRow.name == name)).one_or_none()
    if row is None:
        raise NotFound(f"instance {name!r} is not registered", code="instance_not_found")
    return row


def register_worker(*, session: Session, body: wire.WorkerCreate, now: datetime) -> WorkerRow:
    """Attach a worker to a rank; its pools must be exactly the rank's registered pools."""
    instance = _instance(session, body.instance)
    if body.rank >= instance.world_size:
        raise BadRequest(
            f"rank {body.rank} is outside {instance.name}'s world size {instance.world_size}",
            code="rank_out_of_range",
            errors=[{"loc": ["body", "rank"], "msg": "rank out of range"}],
        )
    rank_row = next((r for r in instance.ranks if r.rank == body.rank), None)
    if rank_row is None:
        raise Conflict(
            f"{instance.name} rank {body.rank} has not reported its page table yet",
            code="rank_not_reported",
        )
    _check_pools(rank_row.body.get("pools", []), body.peer.pools)
    row = WorkerRow(
        id=_id(),
        instance_id=instance.id,
        rank=body.rank,
        epoch=instance.epoch,
        device=body.device,
        transport=body.transport,
        agent=body.peer.agent,
        peer=body.peer.model_dump(mode="json"),
        host=body.host,
        pid=body.pid,
        stopped=False,
        registered_at=now,
        heartbeat_at=now,
    )
    session.add(row)
    session.flush()
    return row


def _check_pools(registered: Sequence[dict[str, Any]], attached: Sequence[wire.PeerPool]) -> None:
    """The worker's pools must be the registered ones: same ids and byte geometry."""
    want = {
        int(p["id"]): (
            int(p.get("layer_group", 0)),
            int(p["slot_bytes"]),
            int(p.get("slot_stride_bytes") or p["slot_bytes"]),
            int(p["num_slots"]),
        )
        for p in registered
    }
    have = {p.id: (p.layer_group, p.slot_bytes, p.slot_stride_bytes, p.num_slots) for p in attached}
    if want != have:
        raise Conflict(
            "the worker's pools differ from the rank's registered pools "
            f"(registered {want}, attached {have})",
            code="pool_mismatch",
        )


def get_worker(*, session: Session, worker_id: str) -> WorkerRow:
    row = session.get(WorkerRow, worker_id)
    if row is None:
        raise NotFound(f"worker {worker_id!r} is not registered", code="worker_not_found")
    return row


def heartbeat(
    *,
    session: Session,
    worker_id: str,
    now: datetime,
    lease_ttl_s: float = LEASE_TTL_S,
    jobs: Sequence[str] | None = None,
) -> WorkerRow:
    """Record a heartbeat and extend the leases of ``jobs`` (``None``: every lease it holds).

    A worker names the jobs it runs, so that a lease it does not know about (its claim was
    committed but the answer lost, and the retried claim leased another job) expires.
    """
    row = get_worker(session=session, worker_id=worker_id)
    if row.stopped:
        raise Conflict(
            "this worker was retired (another worker attached to its rank)", code="worker_retired"
        )
    row.heartbeat_at = now
    held = and_(JobRow.worker_id == worker_id, JobRow.state == "leased")
    if jobs is not None:
        held = and_(held, JobRow.id.in_(list(jobs)))
    session.execute(
        update(JobRow)
        .where(held)
        .values(lease_expires_at=now + timedelta(seconds=lease_ttl_s), updated_at=now)
        .execution_options(synchronize_session=False)
    )
    return row


def stop_worker(*, session: Session, worker_id: str) -> None:
    """A worker shutting down cleanly; its leases expire and its jobs are retried."""
    row = get_worker(session=session, worker_id=worker_id)
    row.stopped = True


def worker_status(row: WorkerRow, instance_epoch: str, now: datetime) -> str:
    if row.stopped:
        return "stopped"
    if row.epoch != instance_epoch:
        return "stale"
    if (now - row.heartbeat_at).total_seconds() > WORKER_GONE_S:
        return "gone"
    return "alive"


def list_workers(
    *, session: Session, instance: str | None = None, limit: int = 500, offset: int = 0
) -> list[WorkerRow]:
    query = (
        select(WorkerRow)
        .join(InstanceRow)
        .order_by(InstanceRow.name, WorkerRow.rank, WorkerRow.registered_at.desc())
    )
    if instance is not None:
        query = query.where(InstanceRow.name == instance)
    return list(session.scalars(query.limit(limit).offset(offset)))


def worker_read(
    session: Session, row: WorkerRow, now: datetime, jobs: Sequence[str] | None = None
) -> wire.WorkerRead:
    """The wire view; ``current_job`` is a job it holds, among ``jobs`` when given."""
    held = select(JobRow.id).where(JobRow.worker_id == row.id, JobRow.state == "leased")
    if jobs is not None:
        held = held.where(JobRow.id.in_(list(jobs)))
    current = session.scalars(
        held.order_by(JobRow.lease_expires_at.desc(), JobRow.id).limit(1)
    ).first()
    return wire.WorkerRead(
        id=row.id,
        instance=row.instance.name,
        rank=row.rank,
        epoch=row.epoch,
        device=row.device,
        transport=row.transport,
        agent=row.agent,
        host=row.host,
        pid=row.pid,
        status=worker_status(row, row.instance.epoch, now),  # type: ignore[arg-type]
        registered_at=row.registered_at,
        heartbeat_at=row.heartbeat_at,
        heartbeat_age_s=max(0.0, (now - row.heartbeat_at).total_seconds()),
        current_job=current,
    )


def _live_worker(
    session: Session, instance: InstanceRow, rank: int, now: datetime
) -> WorkerRow | None:
    cutoff = now - timedelta(seconds=WORKER_GONE_S)
    return session.scalars(
        select(WorkerRow)
        .where(
            WorkerRow.instance_id == instance.id,
            WorkerRow.rank == rank,
            WorkerRow.epoch == instance.epoch,
            WorkerRow.stopped.is_(False),
            WorkerRow.heartbeat_at >= cutoff,
        )
        .order_by(WorkerRow.registered_at.desc())
        .limit(1)
    ).first()


# --------------------------------------------------------------------------------------------
# enqueue


def _route_wire(route_dict: dict[str, Any]) -> dict[str, Any]:
    """A plan route as a worker needs it (the explanatory slices stay in the control plane)."""
    return {key: value for key, value in route_dict.items() if key != "slices"}


def enqueue_transfer(
    *, session: Session, transfer: TransferRow, plan: Plan, now: datetime, delay_s: float = 0.0
) -> list[JobRow]:
    """Create the jobs of the transfer's next attempt (raises Unavailable when it cannot run)."""
    context = _instance(session, transfer.context_name)
    generation = _instance(session, transfer.generation_name)
    blocks = {int(g): (v["context"], v["generation"]) for g, v in transfer.blocks.items()}
    expansion = expand(plan, blocks)
    attempt = transfer.attempt + 1
    not_before = now + timedelta(seconds=delay_s)
    routes = [(er.route, er.bytes) for er in expansion.routes if er.bytes > 0]
    common = {
        "transfer_id": transfer.id,
        "mode": transfer.mode,
        "blocks": transfer.blocks,
        "chunk_blocks": CHUNK_BLOCKS,
        "timeout_s": JOB_TIMEOUT_S,
        "verify": transfer.verify,
        "tokens_per_block": plan.tokens_per_block,
    }
    epochs = {"context": context.epoch, "generation": generation.epoch}
    jobs: list[JobRow] = []

    def job(
        kind: str,
        instance: InstanceRow,
        rank: int,
        payload: dict[str, Any],
        staging_offset: int = 0,
        staging_bytes: int = 0,
    ) -> JobRow:
        row = JobRow(
            id=_id(),
            transfer_id=transfer.id,
            kind=kind,
            instance_id=instance.id,
            rank=rank,
            epoch=instance.epoch,
            state="queued",
            attempt=attempt,
            claims=0,
            not_before=not_before,
            staging_offset=staging_offset,
            staging_bytes=staging_bytes,
            payload={**common, **payload, "epochs": epochs},
            worker_id=payload.get("worker_id"),
            created_at=now,
            updated_at=now,
        )
        jobs.append(row)
        return row

    # One lookup per receiver rank, used for the check and for every job that pins the worker
    # (two lookups could disagree when a worker attaches or stops in between).
    found = {
        rank: _live_worker(session, generation, rank, now)
        for rank in sorted({r.receiver_rank for r, _ in routes})
    }
    receivers = {rank: worker for rank, worker in found.items() if worker is not None}
    missing = sorted(
        {
            ("context", r.sender_rank)
            for r, _ in routes
            if _live_worker(session, context, r.sender_rank, now) is None
        }
        | {("generation", rank) for rank in found if rank not in receivers}
    )
    if missing:
        names = ", ".join(f"{side} rank {rank}" for side, rank in missing)
        raise Unavailable(
            f"no live worker for {names}; start `kvplane worker` for every rank",
            code="workers_unavailable",
            headers={"Retry-After": "2"},
        )

    send_routes: dict[int, list[dict[str, Any]]] = {}
    if transfer.mode == "staged":
        by_receiver: dict[int, list[tuple[Any, int]]] = {}
        for route, nbytes in routes:
            by_receiver.setdefault(route.receiver_rank, []).append((route, nbytes))
        for receiver_rank, incoming in sorted(by_receiver.items()):
            need = sum(nbytes for _, nbytes in incoming)
            worker = receivers[receiver_rank]
            offset = _reserve_staging(
                session, generation, receiver_rank, worker, need, now, transfer.id
            )
            cursor = offset
            receive_routes = []
            for route, nbytes in incoming:
                receive_routes.append(
                    {
                        "route": _route_wire(route.to_dict()),
                        "sender_rank": route.sender_rank,
                        "offset": cursor,
                        "bytes": nbytes,
                    }
                )
                send_routes.setdefault(route.sender_rank, []).append(
                    {
                        "route": _route_wire(route.to_dict()),
                        "receiver_rank": receiver_rank,
                        "dst_offset": cursor,
                        "bytes": nbytes,
                        "receiver_worker": worker.id,
                    }
                )
                cursor += nbytes
            job(
                "receive",
                generation,
                receiver_rank,
                {"routes": receive_routes, "worker_id": worker.id},
                staging_offset=offset,
                staging_bytes=need,
            )
    else:
        # Fragments land in the receiver's pools with no receive step. With verify, a receive
        # job per receiver waits for its senders and checksums the bytes where they landed.
        checks: dict[int, list[dict[str, Any]]] = {}
        for route, nbytes in routes:
            wire_route = _route_wire(route.to_dict())
            send: dict[str, Any] = {
                "route": wire_route,
                "receiver_rank": route.receiver_rank,
                "bytes": nbytes,
            }
            if transfer.verify:
                send["receiver_worker"] = receivers[route.receiver_rank].id
                checks.setdefault(route.receiver_rank, []).append(
                    {"route": wire_route, "sender_rank": route.sender_rank, "bytes": nbytes}
                )
            send_routes.setdefault(route.sender_rank, []).append(send)
        for receiver_rank, checked in sorted(checks.items()):
            worker_id = receivers[receiver_rank].id
            job("receive", generation, receiver_rank, {"routes": checked, "worker_id": worker_id})
    for sender_rank, outgoing in sorted(send_routes.items()):
        job("send", context, sender_rank, {"routes": outgoing})
    session.add_all(jobs)
    transfer.attempt = attempt
    transfer.status = "queued" if jobs else "done"
    transfer.updated_at = now
    if not jobs:
        transfer.finished_at = now
    session.flush()
    return jobs


def _reserve_staging(
    session: Session, instance: InstanceRow, rank: int, worker: WorkerRow, need: int,
    now: datetime, transfer_id: str,
) -> int:
    """First fit of ``need`` bytes in the receiver's staging buffer, beside active transfers.

    Areas quarantined for this same transfer's earlier attempts are free to it: a stale sender
    of the transfer writes the very bytes that its next attempt moves.
    """
    capacity = int(worker.peer["staging"]["bytes"])
    if need > capacity:
        raise BadRequest(
            f"this transfer needs {need:,} staging bytes on {instance.name} rank {rank}, whose "
            f"worker registered {capacity:,}; start the worker with a larger --staging-mib or "
            "use mode=fragments",
            code="staging_too_small",
        )
    if session.get_bind().dialect.name == "postgresql":
        # Two transfers reserving on one rank at once must not both see the same gap free
        # (SQLite's writers are serialized already). Held until the transaction ends.
        session.execute(
            text("SELECT pg_advisory_xact_lock(:instance, :rank)"),
            {"instance": instance.id, "rank": rank},
        )
    taken = sorted(
        (int(offset), int(size))
        for offset, size in session.execute(
            select(JobRow.staging_offset, JobRow.staging_bytes).where(
                JobRow.instance_id == instance.id,
                JobRow.rank == rank,
                JobRow.kind == "receive",
                JobRow.staging_bytes > 0,
                or_(
                    JobRow.state.in_(ACTIVE),
                    # quarantined: a superseded sender might still write into it
                    and_(
                        JobRow.state == "failed",
                        JobRow.lease_expires_at > now,
                        JobRow.transfer_id != transfer_id,
                    ),
                ),
            )
        )
    )
    cursor = 0
    for offset, size in taken:
        if offset - cursor >= need:
            break
        cursor = max(cursor, offset + size)
    if cursor + need > capacity:
        raise Unavailable(
            f"the staging buffer of {instance.name} rank {rank} is busy with other transfers",
            code="staging_busy",
            headers={"Retry-After": "1"},
        )
    return cursor


# --------------------------------------------------------------------------------------------
# claim / complete / fail


def _check_worker(worker: WorkerRow) -> None:
    if worker.stopped:
        raise Conflict(
            "this worker was retired (another worker attached to its rank)", code="worker_retired"
        )
    if worker.epoch != worker.instance.epoch:
        raise Conflict(
            f"{worker.instance.name} re-registered (epoch {worker.instance.epoch}); attach the "
            "worker again",
            code="worker_stale",
        )


def has_work(*, session: Session, worker_id: str, now: datetime) -> bool:
    """Read-only pre-check of a claim: anything runnable for this worker, or a lease to reap?

    Lets idle workers poll without taking the (SQLite: database-wide) write lock.
    """
    worker = get_worker(session=session, worker_id=worker_id)
    _check_worker(worker)
    runnable = (
        select(JobRow.id)
        .where(
            JobRow.instance_id == worker.instance_id,
            JobRow.rank == worker.rank,
            JobRow.state == "queued",
            JobRow.not_before <= now,
            or_(JobRow.worker_id.is_(None), JobRow.worker_id == worker_id),
        )
        .limit(1)
    )
    expired = select(JobRow.id).where(JobRow.state == "leased", JobRow.lease_expires_at < now)
    stranded = select(JobRow.id).join(WorkerRow, JobRow.worker_id == WorkerRow.id)
    return (
        session.scalars(runnable).first() is not None
        or session.scalars(expired.limit(1)).first() is not None
        or session.scalars(stranded.where(stranded_condition(now)).limit(1)).first() is not None
    )


def claim_job(
    *, session: Session, worker_id: str, now: datetime, lease_ttl_s: float = LEASE_TTL_S
) -> JobRow | None:
    """Lease the oldest runnable job of the worker's rank, or None."""
    worker = get_worker(session=session, worker_id=worker_id)
    _check_worker(worker)
    worker.heartbeat_at = now
    reap_expired(session=session, now=now)
    candidate = (
        select(JobRow.id)
        .where(
            JobRow.instance_id == worker.instance_id,
            JobRow.rank == worker.rank,
            JobRow.state == "queued",
            JobRow.not_before <= now,
            # A receive job belongs to the worker it was pinned to (its staging area, or the
            # pools that the fragments land in).
            or_(JobRow.worker_id.is_(None), JobRow.worker_id == worker_id),
        )
        .join(TransferRow, TransferRow.id == JobRow.transfer_id)
        .order_by(JobRow.created_at, JobRow.id)
        .limit(1)
        # The job and its transfer in one lock (the order every path keeps: a transfer being
        # completed or failed right now is skipped, not waited for).
        .with_for_update(skip_locked=True, of=[JobRow, TransferRow])
        .scalar_subquery()
    )
    token = _id()
    claimed = session.execute(
        update(JobRow)
        .where(JobRow.id == candidate, JobRow.state == "queued")
        .values(
            state="leased",
            lease_token=token,
            lease_expires_at=now + timedelta(seconds=lease_ttl_s),
            worker_id=worker_id,
            claims=JobRow.claims + 1,
            updated_at=now,
        )
        .returning(JobRow.id)
        .execution_options(synchronize_session=False)
    ).scalar_one_or_none()
    if claimed is None:
        return None
    job = session.get(JobRow, claimed, populate_existing=True)
    assert job is not None
    transfer = session.get(TransferRow, job.transfer_id)
    assert transfer is not None
    if transfer.status == "queued":
        session.execute(
            update(TransferRow)
            .where(TransferRow.id == transfer.id, TransferRow.status == "queued")
            .values(status="running", started_at=now, updated_at=now)
        )
    problem = _stale_epochs(session, job)
    if problem is None:
        problem = _attach_peers(session, job, now)
    if problem is not None:
        code, reason, retryable = problem
        _fail(session, job, token, f"{code}: {reason}", retryable, now)
        return claim_job(session=session, worker_id=worker_id, now=now, lease_ttl_s=lease_ttl_s)
    return job


def _stale_epochs(session: Session, job: JobRow) -> tuple[str, str, bool] | None:
    transfer = session.get(TransferRow, job.transfer_id)
    assert transfer is not None
    for side, name in (
        ("context", transfer.context_name),
        ("generation", transfer.generation_name),
    ):
        row = session.scalars(select(InstanceRow).where(InstanceRow.name == name)).one_or_none()
        planned = job.payload["epochs"][side]
        if row is None or row.epoch != planned:
            return (
                "peer_restarted",
                f"{side} instance {name} re-registered or left since the transfer was "
                "planned; its memory layout may have changed",
                False,
            )
    return None


def _attach_peers(session: Session, job: JobRow, now: datetime) -> tuple[str, str, bool] | None:
    """Put the current NIXL endpoints of the job's peers into its payload."""
    transfer = session.get(TransferRow, job.transfer_id)
    assert transfer is not None
    if job.kind == "send":
        peer_instance = _instance(session, transfer.generation_name)
        ranks = [route["receiver_rank"] for route in job.payload["routes"]]
    else:
        peer_instance = _instance(session, transfer.context_name)
        ranks = [route["sender_rank"] for route in job.payload["routes"]]
    peers: dict[str, Any] = {}
    for rank in ranks:
        worker = _live_worker(session, peer_instance, rank, now)
        if worker is None:
            return (
                "peer_unavailable",
                f"{peer_instance.name} rank {rank} has no live worker",
                True,
            )
        if job.kind == "send":
            # Staged, and fragments with verify: a receive job is pinned to this worker.
            planned = next(
                r.get("receiver_worker")
                for r in job.payload["routes"]
                if r["receiver_rank"] == rank
            )
            if planned is not None and worker.id != planned:
                return (
                    "peer_unavailable",
                    f"the worker of {peer_instance.name} rank {rank} changed since its "
                    "receive job was planned",
                    True,
                )
        peers[str(rank)] = worker.peer
    job.payload = {**job.payload, "peers": peers, "attempt": job.attempt}
    return None


def _leased(session: Session, job_id: str, token: str) -> JobRow:
    job = session.get(JobRow, job_id)
    if job is None:
        raise NotFound(f"job {job_id!r} does not exist", code="job_not_found")
    if job.lease_token != token or job.state != "leased":
        raise LeaseLost(
            f"job {job_id} is no longer leased with this token (state {job.state}); "
            "its lease expired or the transfer was retried",
        )
    return job


def _lock_transfer(session: Session, transfer_id: str, *, skip_locked: bool = False) -> bool:
    """Serialize the changes to one transfer and its jobs (``FOR UPDATE``; SQLite's writers are
    serialized already). Without it, on PostgreSQL the last two jobs completing at once each
    see the other still leased, and neither settles the transfer. Lock order everywhere: the
    transfer, then its jobs. With ``skip_locked``, False when another transaction holds it."""
    locked = session.scalar(
        select(TransferRow.id)
        .where(TransferRow.id == transfer_id)
        .with_for_update(skip_locked=skip_locked)
    )
    return locked is not None


def _current_plan(session: Session, transfer: TransferRow) -> Plan | None:
    """The transfer's plan if it still describes both instances' memory (else None).

    A retry after a re-registration must not move bytes with the old layout's offsets.
    """
    from api.services.pairings import load_plan

    if transfer.plan_id is None:
        return None
    row = session.get(PlanRow, transfer.plan_id)
    if row is None or row.stale:
        return None
    epochs = {
        name: session.scalar(select(InstanceRow.epoch).where(InstanceRow.name == name))
        for name in (transfer.context_name, transfer.generation_name)
    }
    if (epochs[transfer.context_name], epochs[transfer.generation_name]) != (
        row.context_epoch,
        row.generation_epoch,
    ):
        return None
    return load_plan(session=session, plan_id=row.id)


def complete_job(*, session: Session, job_id: str, body: wire.JobComplete, now: datetime) -> JobRow:
    """Record a job's result (fenced by its lease token) and settle the transfer."""
    job = _leased(session, job_id, body.lease_token)
    _lock_transfer(session, job.transfer_id)
    result = body.model_dump(mode="json", exclude={"lease_token"})
    changed = session.execute(
        update(JobRow)
        .where(
            JobRow.id == job_id, JobRow.lease_token == body.lease_token, JobRow.state == "leased"
        )
        .values(state="done", result=result, finished_at=now, updated_at=now, lease_expires_at=None)
        .returning(JobRow.id)
        .execution_options(synchronize_session=False)
    ).scalar_one_or_none()
    if changed is None:
        raise LeaseLost(f"job {job_id} changed concurrently")
    session.refresh(job)
    _settle(session, job.transfer_id, job.attempt, now)
    return job


def fail_job(*, session: Session, job_id: str, body: wire.JobFail, now: datetime) -> JobRow:
    """A worker gives up on a job: retry the transfer (bounded) or fail it with the reason."""
    job = _leased(session, job_id, body.lease_token)
    _fail(session, job, body.lease_token, body.reason, body.retryable, now)
    session.refresh(job)
    return job


def _fail(
    session: Session, job: JobRow, token: str, reason: str, retryable: bool, now: datetime
) -> None:
    _lock_transfer(session, job.transfer_id)
    changed = session.execute(
        update(JobRow)
        .where(JobRow.id == job.id, JobRow.lease_token == token, JobRow.state == "leased")
        .values(
            state="failed",
            error=reason[:2000],
            finished_at=now,
            updated_at=now,
            lease_expires_at=None,
        )
        .returning(JobRow.id)
        .execution_options(synchronize_session=False)
    ).scalar_one_or_none()
    if changed is None:
        raise LeaseLost(f"job {job.id} changed concurrently")
    _retry_or_fail(
        session,
        job.transfer_id,
        job.attempt,
        f"{job.kind} job of rank {job.rank}: {reason}",
        retryable,
        now,
    )


def _retry_or_fail(
    session: Session, transfer_id: str, attempt: int, reason: str, retryable: bool, now: datetime
) -> None:
    transfer = session.get(TransferRow, transfer_id, populate_existing=True)
    if (
        transfer is None
        or transfer.attempt != attempt
        or transfer.status not in ("queued", "running")
    ):
        return  # an older attempt's news: the transfer has moved on
    _supersede(session, transfer_id, attempt, f"cancelled: {reason}", now)
    if retryable and transfer.attempt < transfer.max_attempts:
        plan = _current_plan(session, transfer)
        if plan is None:
            reason = f"{reason}; retry impossible: the plan no longer matches the instances"
        delay = RETRY_BACKOFF_S[min(transfer.attempt - 1, len(RETRY_BACKOFF_S) - 1)]
        if plan is not None:
            try:
                with session.begin_nested():
                    enqueue_transfer(
                        session=session, transfer=transfer, plan=plan, now=now, delay_s=delay
                    )
                log.warning(
                    "transfer %s: attempt %d failed (%s); retrying in %.1fs",
                    transfer_id,
                    attempt,
                    reason,
                    delay,
                )
                transfer.error = reason[:2000]
                return
            except (Unavailable, BadRequest, Conflict, NotFound) as error:
                reason = f"{reason}; retry impossible: {error.detail}"
    _finish(session, transfer, "failed", now, reason)


def _supersede(
    session: Session, transfer_id: str, attempt: int, reason: str, now: datetime
) -> None:
    """Fail every active job of one attempt.

    A sender that was claimed and did not finish may be writing right now (or wake up later),
    even when its own lease is already gone (it expired, or the sender failed with a WRITE still
    in flight, just before this call). So the attempt's receive staging areas stay reserved
    (quarantined) until such a sender's job has run out of time (``timeout_s``, counted by the
    worker from a claim that happened before now) and until every lease still held has run out;
    only then may another transfer's bytes land there.
    """
    sends = and_(
        JobRow.transfer_id == transfer_id,
        JobRow.attempt == attempt,
        JobRow.kind == "send",
    )
    writing = session.scalar(
        select(func.max(JobRow.lease_expires_at)).where(sends, JobRow.state == "leased")
    )
    started = session.scalar(
        select(func.count()).where(sends, JobRow.claims > 0, JobRow.state != "done")
    )
    if started:
        # The worker counts timeout_s from when the claim's answer reached it, a moment after
        # the claim; the margin covers that moment.
        until = now + timedelta(seconds=JOB_TIMEOUT_S + QUARANTINE_MARGIN_S)
        writing = until if writing is None else max(writing, until)
    session.execute(
        update(JobRow)
        .where(
            JobRow.transfer_id == transfer_id, JobRow.attempt == attempt, JobRow.state.in_(ACTIVE)
        )
        .values(
            state="failed",
            error=reason[:2000],
            finished_at=now,
            updated_at=now,
            lease_expires_at=None,
        )
        .execution_options(synchronize_session=False)
    )
    if writing is not None:
        session.execute(
            update(JobRow)
            .where(
                JobRow.transfer_id == transfer_id,
                JobRow.attempt == attempt,
                JobRow.kind == "receive",
            )
            .values(lease_expires_at=max(writing, now + timedelta(seconds=LEASE_TTL_S)))
            .execution_options(synchronize_session=False)
        )


def _finish(
    session: Session, transfer: TransferRow, status: str, now: datetime, error: str | None = None
) -> None:
    session.execute(
        update(TransferRow)
        .where(TransferRow.id == transfer.id, TransferRow.status.in_(("queued", "running")))
        .values(
            status=status,
            error=None if error is None else error[:2000],
            finished_at=now,
            updated_at=now,
        )
        .execution_options(synchronize_session=False)
    )
    session.refresh(transfer)
    if status == "failed":
        log.warning("transfer %s failed: %s", transfer.id, error)


def _settle(session: Session, transfer_id: str, attempt: int, now: datetime) -> None:
    """Mark the transfer done once every job of its attempt is done (checksums agreeing)."""
    jobs = list(
        session.scalars(
            select(JobRow).where(JobRow.transfer_id == transfer_id, JobRow.attempt == attempt)
        )
    )
    if any(job.state != "done" for job in jobs):
        return
    transfer = session.get(TransferRow, transfer_id, populate_existing=True)
    if transfer is None or transfer.attempt != attempt:
        return
    mismatch = _checksum_mismatch(jobs) if transfer.verify else None
    if mismatch is not None:
        _finish(session, transfer, "failed", now, f"checksum_mismatch: {mismatch}")
    else:
        _finish(session, transfer, "done", now)


def _checksum_mismatch(jobs: Iterable[JobRow]) -> str | None:
    sent: dict[tuple[int, int], int | None] = {}
    received: dict[tuple[int, int], int | None] = {}
    for job in jobs:
        target = sent if job.kind == "send" else received
        for route in (job.result or {}).get("routes", []):
            target[(route["sender_rank"], route["receiver_rank"])] = route.get("checksum")
    for key, checksum in sent.items():
        if key in received and received[key] != checksum:
            return (
                f"route {key[0]}->{key[1]}: sender crc32 {checksum}, receiver crc32 {received[key]}"
            )
    return None


def stranded_condition(now: datetime) -> ColumnElement[bool]:
    """A queued job pinned to a worker that is gone (stopped, or no heartbeat for
    ``WORKER_GONE_S``): nobody else may claim it, so it must be failed. Select ``JobRow``
    joined to its ``WorkerRow``."""
    cutoff = now - timedelta(seconds=WORKER_GONE_S)
    return and_(
        JobRow.state == "queued",
        or_(WorkerRow.stopped.is_(True), WorkerRow.heartbeat_at < cutoff),
    )


def reap_expired(*, session: Session, now: datetime) -> int:
    """Jobs whose lease expired, and queued jobs pinned to a worker that is gone: their
    transfer is retried (or failed after max attempts). Returns the number of expired leases
    this call failed (a transfer another transaction is changing is left to it)."""
    # No row locks here: each job is failed by a guarded UPDATE after its transfer is locked
    # (one lock order everywhere: the transfer, then its jobs).
    expired = list(
        session.scalars(
            select(JobRow).where(JobRow.state == "leased", JobRow.lease_expires_at < now)
        )
    )
    reaped = 0
    for job in expired:
        if not _lock_transfer(session, job.transfer_id, skip_locked=True):
            continue  # another transaction is changing this transfer (another reaper, maybe)
        token = job.lease_token or ""
        try:
            _fail(
                session,
                job,
                token,
                f"lease expired (worker {job.worker_id} stopped heartbeating)",
                True,
                now,
            )
        except LeaseLost:
            continue
        reaped += 1
    stranded = session.scalars(
        select(JobRow)
        .join(WorkerRow, JobRow.worker_id == WorkerRow.id)
        .where(stranded_condition(now))
    )
    for job in list(stranded):
        if not _lock_transfer(session, job.transfer_id, skip_locked=True):
            continue
        changed = session.execute(
            update(JobRow)
            .where(JobRow.id == job.id, JobRow.state == "queued")
            .values(state="failed", error="its worker is gone", finished_at=now, updated_at=now)
            .returning(JobRow.id)
            .execution_options(synchronize_session=False)
        ).scalar_one_or_none()
        if changed is not None:
            reason = f"worker {job.worker_id}, which this job was pinned to, is gone"
            _retry_or_fail(
                session, job.transfer_id, job.attempt, f"{job.kind} job of rank {job.rank}: "
                f"{reason}", True, now,
            )
    return reaped


def fail_transfers_of_instance(*, session: Session, instance_id: int, now: datetime,
                               reason: str) -> int:
    """An instance re-registered or left: fail every active transfer that involves it.

    Its queued and leased jobs are superseded, so a worker still holding one gets 409 on
    ``complete``; the transfer reports ``reason`` (``peer_restarted`` / ``peer_left``).
    """
    instance = session.get(InstanceRow, instance_id)
    if instance is None:
        return 0
    # Locked (in id order), and read afresh: a retry committed meanwhile moved the attempt.
    transfers = list(session.scalars(
        select(TransferRow).where(
            TransferRow.status.in_(("queued", "running")),
            or_(TransferRow.context_name == instance.name,
                TransferRow.generation_name == instance.name),
        )
        .order_by(TransferRow.id)
        .with_for_update()
        .execution_options(populate_existing=True)
    ))
    for transfer in transfers:
        _supersede(session, transfer.id, transfer.attempt, f"cancelled: {reason}", now)
        _finish(session, transfer, "failed", now, reason)
    return len(transfers)


def retry_transfer(*, session: Session, transfer_id: str, now: datetime) -> TransferRow:
    """Operator action: run a failed transfer again (new attempts, same plan and blocks)."""
    # Locked: two concurrent retries must not both enqueue the next attempt.
    transfer = session.get(
        TransferRow, transfer_id, with_for_update=True, populate_existing=True
    )
    if transfer is None:
        raise NotFound(f"transfer {transfer_id!r} does not exist", code="transfer_not_found")
    if transfer.status != "failed" or not transfer.execute:
        raise Conflict(
            f"only a failed executed transfer can be retried (status {transfer.status})",
            code="transfer_not_retryable",
        )
    plan = _current_plan(session, transfer)
    if plan is None:
        raise Conflict(
            "the transfer's plan was deleted with its pairing, or an instance re-registered "
            "since it was planned: POST /v1/transfers again",
            code="plan_gone",
        )
    transfer.max_attempts = transfer.attempt + 3
    transfer.error = None
    transfer.finished_at = None
    enqueue_transfer(session=session, transfer=transfer, plan=plan, now=now)
    return transfer


# --------------------------------------------------------------------------------------------
# reads


def list_jobs(
    *,
    session: Session,
    transfer_id: str | None = None,
    state: str | None = None,
    limit: int = 200,
    offset: int = 0,
) -> list[JobRow]:
    query = select(JobRow).order_by(JobRow.created_at.desc(), JobRow.kind, JobRow.rank)
    if transfer_id is not None:
        query = query.where(JobRow.transfer_id == transfer_id)
    if state is not None:
        query = query.where(JobRow.state == state)
    return list(session.scalars(query.limit(limit).offset(offset)))


def count_jobs_by_state(*, session: Session) -> dict[str, int]:
    rows = session.execute(select(JobRow.state, func.count()).group_by(JobRow.state))
    return {state: int(count) for state, count in rows}


def job_read(session: Session, row: JobRow) -> wire.JobRead:
    instance = session.get(InstanceRow, row.instance_id)
    return wire.JobRead(
        id=row.id,
        transfer_id=row.transfer_id,
        kind=row.kind,  # type: ignore[arg-type]
        instance=instance.name if instance else "?",
        rank=row.rank,
        state=row.state,  # type: ignore[arg-type]
        attempt=row.attempt,
        claims=row.claims,
        worker_id=row.worker_id,
        lease_expires_at=row.lease_expires_at,
        staging_offset=row.staging_offset,
        staging_bytes=row.staging_bytes,
        result=row.result,
        error=row.error,
        created_at=row.created_at,
        updated_at=row.updated_at,
        finished_at=row.finished_at,
    )


def job_lease(session: Session, row: JobRow) -> wire.JobLease:
    instance = session.get(InstanceRow, row.instance_id)
    assert row.lease_token is not None and row.lease_expires_at is not None
    return wire.JobLease(
        id=row.id,
        transfer_id=row.transfer_id,
        kind=row.kind,  # type: ignore[arg-type]
        instance=instance.name if instance else "?",
        rank=row.rank,
        attempt=row.attempt,
        lease_token=row.lease_token,
        lease_expires_at=row.lease_expires_at,
        payload=row.payload,
    )


def active_transfer_ids(*, session: Session) -> list[str]:
    return list(
        session.scalars(
            select(TransferRow.id).where(and_(TransferRow.status.in_(("queued", "running"))))
        )
    )
