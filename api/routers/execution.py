"""``/v1/workers`` and ``/v1/jobs``: worker registration, heartbeats, claims and job results."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Path, Query, Request, Response, status
from fastapi.concurrency import run_in_threadpool
from sqlalchemy.orm import Session

from api import schemas_exec as wire
from api.db import Database
from api.errors import problem_responses
from api.metrics import Metrics
from api.models import JobRow
from api.routers.deps import DbDep, MetricsDep
from api.services import jobs as service
from api.services import stats

workers_router = APIRouter(prefix="/v1/workers", tags=["workers"])
jobs_router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

WorkerId = Annotated[str, Path(min_length=1, max_length=64, description="Worker id")]
JobId = Annotated[str, Path(min_length=1, max_length=64, description="Job id")]
CLAIM_POLL_S = 0.05


def now_of(request: Request) -> datetime:
    """The app's clock (injectable in tests)."""
    clock: service.Clock = request.app.state.clock
    return clock()


def lease_ttl_of(request: Request) -> float:
    return float(request.app.state.settings.lease_ttl_s)


@workers_router.post(
    "",
    operation_id="register_worker",
    response_model=wire.WorkerAttached,
    status_code=status.HTTP_201_CREATED,
    responses=problem_responses(404, 409, 413, 422, 503),
)
def register_worker(
    body: wire.WorkerCreate, request: Request, db: DbDep, metrics: MetricsDep
) -> wire.WorkerAttached:
    """Attach a worker process to one rank: its pools' addresses and its NIXL endpoint."""
    now = now_of(request)
    with db.write() as session:
        row = service.register_worker(session=session, body=body, now=now)
        read = service.worker_read(session, row, now)
    metrics.worker_heartbeats.inc()
    return wire.WorkerAttached(
        **read.model_dump(),
        heartbeat_interval_s=service.HEARTBEAT_INTERVAL_S,
        lease_ttl_s=lease_ttl_of(request),
    )


@workers_router.get(
    "",
    operation_id="list_workers",
    response_model=wire.WorkerList,
    responses=problem_responses(422, 503),
)
def list_workers(
    request: Request,
    db: DbDep,
    instance: Annotated[str | None, Query(max_length=128)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 500,
    offset: Annotated[int, Query(ge=0, le=1 << 31)] = 0,
) -> wire.WorkerList:
    """Workers with their status (alive, gone, stopped, stale) and current lease."""
    now = now_of(request)
    with db.read() as session:
        rows = service.list_workers(session=session, instance=instance, limit=limit, offset=offset)
        return wire.WorkerList(items=[service.worker_read(session, row, now) for row in rows])


@workers_router.post(
    "/{worker_id}/heartbeat",
    operation_id="worker_heartbeat",
    response_model=wire.WorkerRead,
    responses=problem_responses(404, 409, 422, 503),
)
def worker_heartbeat(
    worker_id: WorkerId,
    request: Request,
    db: DbDep,
    metrics: MetricsDep,
    body: wire.Heartbeat | None = None,
) -> wire.WorkerRead:
    """A worker is alive: record it and extend the leases of the jobs it says it runs (without
    a body: every lease it holds). `current_job` is the one of those it still holds."""
    now = now_of(request)
    jobs = None if body is None else body.jobs
    with db.write() as session:
        row = service.heartbeat(
            session=session,
            worker_id=worker_id,
            now=now,
            lease_ttl_s=lease_ttl_of(request),
            jobs=jobs,
        )
        read = service.worker_read(session, row, now, jobs=jobs)
    metrics.worker_heartbeats.inc()
    return read


@workers_router.delete(
    "/{worker_id}",
    operation_id="stop_worker",
    status_code=status.HTTP_204_NO_CONTENT,
    responses=problem_responses(404, 422, 503),
)
def stop_worker(worker_id: WorkerId, db: DbDep) -> Response:
    """A worker shutting down cleanly (its leased jobs are retried when their leases expire)."""
    with db.write() as session:
        service.stop_worker(session=session, worker_id=worker_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@jobs_router.post(
    "/claim",
    operation_id="claim_job",
    response_model=wire.JobLease,
    responses={
        204: {"description": "No job within wait_s"},
        **problem_responses(404, 409, 422, 503),
    },
)
async def claim_job(
    body: wire.JobClaim, request: Request, db: DbDep, metrics: MetricsDep
) -> wire.JobLease | Response:
    """Lease the next runnable job of the worker's rank, waiting up to ``wait_s`` for one."""
    # The wait is asyncio.sleep and only the database steps run in the thread pool: waiting
    # workers must not use up the threads that every other request needs.
    deadline = time.monotonic() + body.wait_s
    lease_ttl_s = lease_ttl_of(request)

    def ready(now: datetime) -> bool:
        with db.read() as session:
            return service.has_work(session=session, worker_id=body.worker_id, now=now)

    def claim(now: datetime) -> wire.JobLease | None:
        with db.write() as session:
            # Reaped here (claim_job would do it too) so that expiries reach the metrics.
            before = stats.transfer_statuses(
                session=session,
                transfer_ids=stats.expired_lease_transfer_ids(session=session, now=now),
            )
            expired = service.reap_expired(session=session, now=now)
            finished = stats.newly_finished(session=session, before=before)
            job = service.claim_job(
                session=session, worker_id=body.worker_id, now=now, lease_ttl_s=lease_ttl_s
            )
            lease = None if job is None else service.job_lease(session, job)
        metrics.lease_expiries.inc(expired)
        metrics.transfers_settled(finished)
        return lease

    while True:
        now = now_of(request)
        if await run_in_threadpool(ready, now):
            lease = await run_in_threadpool(claim, now)
            if lease is not None:
                metrics.jobs_claimed.inc()
                return lease
        if time.monotonic() >= deadline:
            return Response(status_code=status.HTTP_204_NO_CONTENT)
        await asyncio.sleep(min(CLAIM_POLL_S, max(0.0, deadline - time.monotonic())))


def _report(
    db: Database, metrics: Metrics, job_id: str, act: Callable[[Session], JobRow]
) -> wire.JobRead:
    """Run a worker's report in one transaction and count the transfers it finished."""
    with db.write() as session:
        before = stats.transfer_statuses(
            session=session, transfer_ids=stats.job_transfer_ids(session=session, job_id=job_id)
        )
        read = service.job_read(session, act(session))
        finished = stats.newly_finished(session=session, before=before)
    metrics.transfers_settled(finished)
    return read


@jobs_router.post(
    "/{job_id}/complete",
    operation_id="complete_job",
    response_model=wire.JobRead,
    responses=problem_responses(404, 409, 422, 503),
)
def complete_job(
    job_id: JobId, body: wire.JobComplete, request: Request, db: DbDep, metrics: MetricsDep
) -> wire.JobRead:
    """Report a job done with its bytes, duration and checksums (409 if the lease was lost)."""
    read = _report(
        db,
        metrics,
        job_id,
        lambda session: service.complete_job(
            session=session, job_id=job_id, body=body, now=now_of(request)
        ),
    )
    metrics.job_results.labels(state="done").inc()
    metrics.moved_bytes.labels(kind=read.kind).inc(body.bytes)
    return read


@jobs_router.post(
    "/{job_id}/fail",
    operation_id="fail_job",
    response_model=wire.JobRead,
    responses=problem_responses(404, 409, 422, 503),
)
def fail_job(
    job_id: JobId, body: wire.JobFail, request: Request, db: DbDep, metrics: MetricsDep
) -> wire.JobRead:
    """Report a job failed with a reason; the transfer is retried (bounded) or failed."""
    read = _report(
        db,
        metrics,
        job_id,
        lambda session: service.fail_job(
            session=session, job_id=job_id, body=body, now=now_of(request)
        ),
    )
    metrics.job_results.labels(state="failed").inc()
    return read


@jobs_router.get(
    "",
    operation_id="list_jobs",
    response_model=list[wire.JobRead],
    responses=problem_responses(422, 503),
)
def list_jobs(
    db: DbDep,
    transfer_id: Annotated[str | None, Query(max_length=64)] = None,
    state: Annotated[wire.JobState | None, Query()] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 200,
    offset: Annotated[int, Query(ge=0, le=1 << 31)] = 0,
) -> list[wire.JobRead]:
    """Jobs, newest first, optionally of one transfer or in one state."""
    with db.read() as session:
        rows = service.list_jobs(
            session=session, transfer_id=transfer_id, state=state, limit=limit, offset=offset
        )
        return [service.job_read(session, row) for row in rows]
