"""``/v1/instances``: register (whole or rank by rank), read, list, delete; one instance's
handovers of the last hour."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Header, Path, Query, Request, Response, status

from api import schemas
from api.errors import problem_responses
from api.routers.deps import DbDep, MetricsDep
from api.services import handovers, registration, stats
from api.services import instances as service

router = APIRouter(prefix="/v1/instances", tags=["instances"])

InstanceName = Annotated[str, Path(pattern=schemas.NAME_PATTERN, description="Instance name")]
IfMatch = Annotated[
    str | None,
    Header(max_length=256, description="Expected `generation` (quoted or not); 412 otherwise"),
]


def _etag(response: Response, generation: int) -> None:
    response.headers["ETag"] = f'"{generation}"'


@router.put(
    "/{name}",
    operation_id="register_instance",
    response_model=schemas.InstanceRead,
    status_code=status.HTTP_200_OK,
    responses={
        201: {"model": schemas.InstanceRead, "description": "Registered (new instance)"},
        **problem_responses(400, 409, 412, 413, 422, 503),
    },
)
def register_instance(
    name: InstanceName,
    body: schemas.InstanceCreate,
    response: Response,
    db: DbDep,
    metrics: MetricsDep,
    if_match: IfMatch = None,
) -> schemas.InstanceRead:
    """Register or replace an instance (identical body: no change; else new generation/epoch)."""
    with db.write() as session:
        # A changed registration fails the instance's active transfers (peer_restarted).
        before = stats.transfer_statuses(
            session=session, transfer_ids=stats.transfer_ids_of_instance(session=session, name=name)
        )
        row, created, changed = registration.register_instance(
            session=session, name=name, body=body, if_match=if_match
        )
        result = service.instance_read(row)
        finished = stats.newly_finished(session=session, before=before)
    metrics.transfers_settled(finished)
    outcome = "created" if created else ("changed" if changed else "unchanged")
    metrics.registrations.labels("instance", outcome).inc()
    response.status_code = status.HTTP_201_CREATED if created else status.HTTP_200_OK
    _etag(response, result.generation)
    return result


@router.put(
    "/{name}/ranks/{rank}",
    operation_id="report_rank",
    response_model=schemas.InstanceRead,
    status_code=status.HTTP_200_OK,
    responses={
        201: {"model": schemas.InstanceRead, "description": "Rank reported for the first time"},
        **problem_responses(400, 404, 409, 412, 413, 422, 503),
    },
)
def report_rank(
    name: InstanceName,
    rank: Annotated[int, Path(ge=0, lt=schemas.MAX_RANKS)],
    body: schemas.RankCreate,
    response: Response,
    db: DbDep,
    metrics: MetricsDep,
    if_match: IfMatch = None,
) -> schemas.InstanceRead:
    """Report one rank's page table; the instance is `ready` once every rank has reported."""
    with db.write() as session:
        # A changed registration fails the instance's active transfers (peer_restarted).
        before = stats.transfer_statuses(
            session=session, transfer_ids=stats.transfer_ids_of_instance(session=session, name=name)
        )
        row, created, changed = registration.report_rank(
            session=session, name=name, rank=rank, body=body, if_match=if_match
        )
        result = service.instance_read(row)
        finished = stats.newly_finished(session=session, before=before)
    metrics.transfers_settled(finished)
    outcome = "created" if created else ("changed" if changed else "unchanged")
    metrics.registrations.labels("rank", outcome).inc()
    response.status_code = status.HTTP_201_CREATED if created else status.HTTP_200_OK
    _etag(response, result.generation)
    return result


@router.get(
    "",
    operation_id="list_instances",
    response_model=schemas.InstanceList,
    responses=problem_responses(422, 503),
)
def list_instances(
    db: DbDep,
    role: Annotated[schemas.Role | None, Query(description="Filter by role")] = None,
    status_: Annotated[
        Literal["incomplete", "ready"] | None, Query(alias="status", description="Filter by status")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=1 << 31)] = 0,
) -> schemas.InstanceList:
    """List instances by name, optionally filtered by role and status."""
    with db.read() as session:
        rows, total = service.list_instances(
            session=session, role=role, status=status_, limit=limit, offset=offset
        )
        items = [service.instance_summary(row) for row in rows]
    return schemas.InstanceList(items=items, total=total, limit=limit, offset=offset)


@router.get(
    "/{name}",
    operation_id="get_instance",
    response_model=schemas.InstanceRead,
    responses=problem_responses(404, 422, 503),
)
def get_instance(name: InstanceName, response: Response, db: DbDep) -> schemas.InstanceRead:
    """One instance with its reported page tables."""
    with db.read() as session:
        result = service.instance_read(service.get_instance(session=session, name=name))
    _etag(response, result.generation)
    return result


@router.get(
    "/{name}/handovers",
    operation_id="get_instance_handovers",
    response_model=schemas.InstanceHandovers,
    responses=problem_responses(404, 422, 503),
)
def get_instance_handovers(
    name: InstanceName, request: Request, db: DbDep
) -> schemas.InstanceHandovers:
    """The instance's handovers created in the last hour (sent as a context instance, received
    as a generation instance): per peer and in all, by outcome, with bytes moved and
    creation-to-done latency (p50, p99), and the latest failures with their errors."""
    with db.read() as session:
        row = service.get_instance(session=session, name=name)
        return handovers.instance_handovers(
            session=session, instance=row, now=request.app.state.clock()
        )


@router.delete(
    "/{name}",
    operation_id="delete_instance",
    status_code=status.HTTP_204_NO_CONTENT,
    response_class=Response,
    responses=problem_responses(404, 412, 422, 503),
)
def delete_instance(
    name: InstanceName, db: DbDep, metrics: MetricsDep, if_match: IfMatch = None
) -> Response:
    """Delete an instance; its pairings and cached plans go with it (transfers are kept)."""
    with db.write() as session:
        before = stats.transfer_statuses(
            session=session, transfer_ids=stats.transfer_ids_of_instance(session=session, name=name)
        )
        registration.delete_instance(session=session, name=name, if_match=if_match)
        finished = stats.newly_finished(session=session, before=before)
    metrics.transfers_settled(finished)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
