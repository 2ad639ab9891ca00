"""``/v1/transfers``: plan one request's transfer, read it back, expand its fragments."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Path, Response, status

from api import schemas
from api.errors import problem_responses
from api.routers.deps import DbDep, MetricsDep
from api.services import transfers as service

router = APIRouter(prefix="/v1/transfers", tags=["transfers"])

TransferId = Annotated[str, Path(min_length=1, max_length=64, description="Transfer id")]


@router.post(
    "",
    operation_id="create_transfer",
    response_model=schemas.TransferRead,
    status_code=status.HTTP_201_CREATED,
    responses={
        200: {"model": schemas.TransferRead, "description": "Replay of an Idempotency-Key"},
        **problem_responses(400, 404, 409, 413, 422, 501, 503),
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
def get_transfer(transfer_id: TransferId, db: DbDep) -> schemas.TransferRead:
    """One transfer: status, routes, bytes and fragment count."""
    with db.read() as session:
        return service.transfer_read(service.get_transfer(session=session, transfer_id=transfer_id))


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
