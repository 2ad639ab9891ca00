"""``/v1/transfers``: plan one request's transfer, read it back, expand its fragments."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Header, Path, Query, Request, Response, status

from api import schemas
from api.errors import problem_responses
from api.routers.deps import DbDep, MetricsDep
from api.services import jobs as jobs_service
from api.services import transfers as service

router = APIRouter(prefix="/v1/transfers", tags=["transfers"])

MAX_WAIT_S = 60.0
WAIT_POLL_S = 0.05

TransferId = Annotated[str, Path(min_length=1, max_length=64, description="Transfer id")]


@router.post(
    "",
    operation_id="create_transfer",
    response_model=schemas.TransferRead,
    status_code=status.HTTP_201_CREATED,
    responses={
        200: {"model": schemas.TransferRead, "description": "Replay of an Idempotency-Key"},
        **problem_responses(400, 404, 409, 413, 422, 503),
    },
)
def create_transfer(
    body: schemas.TransferCreate,
    response: Response,
    db: DbDep,
    metrics: MetricsDep,
    idempotency_key: Annotated[
        str | None,
        Header(
            alias="Idempotency-Key",
            min_length=1,
            max_length=256,
            description="Same key + same body: the same transfer; + another body: 409",
        ),
    ] = None,
) -> schemas.TransferRead:
    """Plan one request's KV transfer from the pairing's templates and both block lists."""
    with db.write() as session:
        row, created = service.create_transfer(
            session=session, body=body, idempotency_key=idempotency_key
        )
        result = service.transfer_read(row)
    if created:
        metrics.transfers.inc()
        metrics.transfer_bytes.inc(result.bytes)
    response.status_code = status.HTTP_201_CREATED if created else status.HTTP_200_OK
    return result


@router.get(
    "/{transfer_id}",
    operation_id="get_transfer",
    response_model=schemas.TransferRead,
    responses=problem_responses(404, 422, 503),
)
def get_transfer(
    transfer_id: TransferId,
    request: Request,
    db: DbDep,
    wait: Annotated[
        float,
        Query(
            ge=0,
            le=MAX_WAIT_S,
            description="Long-poll: wait up to this many seconds for "
            "the transfer to be done or failed",
        ),
    ] = 0.0,
) -> schemas.TransferRead:
    """One transfer: status, routes, bytes and fragment count; `?wait=S` long-polls."""
    deadline = time.monotonic() + wait
    while True:
        with db.read() as session:
            result = service.transfer_read(
                service.get_transfer(session=session, transfer_id=transfer_id)
            )
        if result.status not in ("queued", "running") or time.monotonic() >= deadline:
            return result
        # Expired leases must make progress even when no worker of that rank is claiming.
        with db.write() as session:
            jobs_service.reap_expired(session=session, now=request.app.state.clock())
        time.sleep(min(WAIT_POLL_S, max(0.0, deadline - time.monotonic())))


@router.post(
    "/{transfer_id}/retry",
    operation_id="retry_transfer",
    response_model=schemas.TransferRead,
    responses=problem_responses(404, 409, 422, 503),
)
def retry_transfer(transfer_id: TransferId, request: Request, db: DbDep) -> schemas.TransferRead:
    """Run a failed executed transfer again (same plan and blocks, new attempts)."""
    with db.write() as session:
        row = jobs_service.retry_transfer(
            session=session, transfer_id=transfer_id, now=request.app.state.clock()
        )
        return service.transfer_read(row)


@router.get(
    "/{transfer_id}/fragments",
    operation_id="get_transfer_fragments",
    response_model=schemas.TransferFragments,
    responses=problem_responses(404, 409, 422, 503),
)
def get_transfer_fragments(transfer_id: TransferId, db: DbDep) -> schemas.TransferFragments:
    """Every fragment `[src_pool, src_offset, dst_pool, dst_offset, length]`, per route."""
    with db.read() as session:
        return service.transfer_fragments(session=session, transfer_id=transfer_id)
