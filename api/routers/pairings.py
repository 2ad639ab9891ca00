"""``/v1/pairings`` and ``/v1/compatibility``: validate pairs, store reports, serve plans."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Response, status

from api import schemas
from api.errors import problem_responses
from api.routers.deps import DbDep
from api.services import pairings as service

router = APIRouter(tags=["pairings"])
compatibility_router = APIRouter(tags=["compatibility"])

PairingId = Annotated[str, Path(min_length=1, max_length=64, description="Pairing id")]
DpRank = Annotated[int | None, Query(ge=0, lt=schemas.MAX_PARALLEL)]


@router.post(
    "/v1/pairings",
    operation_id="create_pairing",
    response_model=schemas.PairingRead,
    status_code=status.HTTP_201_CREATED,
    responses={
        200: {"model": schemas.PairingRead, "description": "Existing pair, re-validated"},
        **problem_responses(400, 404, 409, 413, 422, 503),
    },
)
def create_pairing(
    body: schemas.PairingCreate, response: Response, db: DbDep
) -> schemas.PairingRead:
    """Validate a (context, generation) pair and store it with its report (even if incompatible)."""
    with db.write() as session:
        row, created = service.create_pairing(
            session=session, context=body.context, generation=body.generation
        )
        result = service.pairing_read(row)
    response.status_code = status.HTTP_201_CREATED if created else status.HTTP_200_OK
    return result


@router.get(
    "/v1/pairings",
    operation_id="list_pairings",
    response_model=schemas.PairingList,
    responses=problem_responses(422, 503),
)
def list_pairings(
    db: DbDep,
    status_: Annotated[schemas.PairingStatus | None, Query(alias="status")] = None,
    instance: Annotated[
        str | None, Query(max_length=128, description="Pairings using this instance")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=1 << 31)] = 0,
) -> schemas.PairingList:
    """List pairings, newest first."""
    with db.read() as session:
        rows, total = service.list_pairings(
            session=session, status=status_, instance=instance, limit=limit, offset=offset
        )
        items = [service.pairing_read(row) for row in rows]
    return schemas.PairingList(items=items, total=total, limit=limit, offset=offset)


@router.get(
    "/v1/pairings/{pairing_id}",
    operation_id="get_pairing",
    response_model=schemas.PairingRead,
    responses=problem_responses(404, 422, 503),
)
def get_pairing(pairing_id: PairingId, db: DbDep) -> schemas.PairingRead:
    """One pairing with the report of its last validation."""
    with db.read() as session:
        return service.pairing_read(service.get_pairing(session=session, pairing_id=pairing_id))


@router.post(
    "/v1/pairings/{pairing_id}/validate",
    operation_id="validate_pairing",
    response_model=schemas.PairingRead,
    responses=problem_responses(404, 422, 503),
)
def validate_pairing(pairing_id: PairingId, db: DbDep) -> schemas.PairingRead:
    """Re-validate against the instances' current registrations (clears `stale`)."""
    with db.write() as session:
        row = service.validate_pairing_by_id(session=session, pairing_id=pairing_id)
        return service.pairing_read(row)


@router.get(
    "/v1/pairings/{pairing_id}/plan",
    operation_id="get_pairing_plan",
    response_model=schemas.PlanRead,
    responses=problem_responses(404, 409, 422, 503),
)
def get_pairing_plan(
    pairing_id: PairingId,
    db: DbDep,
    context_dp_rank: DpRank = None,
    generation_dp_rank: DpRank = None,
) -> dict[str, Any]:
    """The compiled transfer templates (409 when the pairing is stale or incompatible)."""
    with db.write() as session:
        _plan_id, plan = service.get_plan(
            session=session,
            pairing_id=pairing_id,
            context_dp_rank=context_dp_rank,
            generation_dp_rank=generation_dp_rank,
        )
    return plan.to_dict()


@compatibility_router.post(
    "/v1/compatibility",
    operation_id="check_compatibility",
    response_model=schemas.CompatibilityRead,
    responses=problem_responses(400, 409, 413, 422),
)
def check_compatibility(body: schemas.CompatibilityCheck) -> schemas.CompatibilityRead:
    """Validate two inline instance bodies against each other; nothing is stored."""
    return service.check_compatibility(
        context=body.context,
        generation=body.generation,
        context_dp_rank=body.context_dp_rank,
        generation_dp_rank=body.generation_dp_rank,
    )
