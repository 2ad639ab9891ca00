"""Pairings: validate a (context, generation) pair, store its report, compile and cache plans.

A pairing's ``status`` is ``compatible`` or ``incompatible`` after validation and ``stale`` once
either instance re-registers (new epoch); ``validate_pairing_by_id`` re-validates and clears it.
Plans are cached in ``plans`` under (pairing, both epochs, both dp ranks) and, because such a row
never changes, also in a small in-process LRU keyed by the same (globally unique) values. A plan
enters the LRU only when the transaction that stored or read it commits.
"""

from __future__ import annotations

import threading
import uuid
from collections import OrderedDict
from typing import Any

from sqlalchemy import event, func, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, aliased

from api import schemas
from api.db import utcnow
from api.errors import BadRequest, Conflict, Incompatible, NotFound
from api.models import NO_DP_RANK, InstanceRow, PairingRow, PlanRow
from api.services.instances import geometry_problem, load_geometry
from api.services.liveness import MEMO
from geometry import GeometryError, Instance, Plan, compile_plan, parse_instance
from geometry import validate_pairing as validate_geometry

PLAN_MEMO_SIZE = 256

PlanKey = tuple[str, str, str, int, int]
_memo: OrderedDict[PlanKey, tuple[int, Plan]] = OrderedDict()
_memo_lock = threading.Lock()


def _memo_get(key: PlanKey) -> tuple[int, Plan] | None:
    with _memo_lock:
        hit = _memo.get(key)
        if hit is not None:
            _memo.move_to_end(key)
        return hit


def cached_plan(
    pairing_id: str,
    context_epoch: str,
    generation_epoch: str,
    context_dp_rank: int | None,
    generation_dp_rank: int | None,
) -> tuple[int, Plan] | None:
    """``(plan_id, plan)`` from this process's plan cache, or None (no database access)."""
    cdp = NO_DP_RANK if context_dp_rank is None else context_dp_rank
    gdp = NO_DP_RANK if generation_dp_rank is None else generation_dp_rank
    return _memo_get((pairing_id, context_epoch, generation_epoch, cdp, gdp))


def _memo_put(key: PlanKey, value: tuple[int, Plan]) -> None:
    with _memo_lock:
        _memo[key] = value
        _memo.move_to_end(key)
        while len(_memo) > PLAN_MEMO_SIZE:
            _memo.popitem(last=False)


_PENDING = "kvplane_pending_plans"


def _memo_on_commit(session: Session, key: PlanKey, value: tuple[int, Plan]) -> None:
    """Cache ``value`` once ``session``'s transaction commits.

    A plan row that is rolled back with its request (bad blocks, no live worker, ...) must never
    be served from the cache: its id would dangle, and the database may hand it out again to
    another pairing's plan.
    """
    session.info.setdefault(_PENDING, {})[key] = value


@event.listens_for(Session, "after_commit")
def _publish_pending_plans(session: Session) -> None:
    if session.in_nested_transaction():  # a savepoint released: the outer one may still fail
        return
    for key, value in session.info.pop(_PENDING, {}).items():
        _memo_put(key, value)


@event.listens_for(Session, "after_rollback")
def _drop_pending_plans(session: Session) -> None:
    # Any rollback, a savepoint's included: a cache miss later is cheap, a dangling id is not.
    session.info.pop(_PENDING, None)


def bump_directories(session: Session, instance_ids: set[int] | list[int]) -> None:
    """The directories of these instances' workers changed: bump their kept revision (the
    heartbeat answer carries it; each worker refetches its directory when it changes). Every
    change a heartbeat answers (a worker's status, its directory) comes through here: the
    answers kept between liveness windows are forgotten."""
    MEMO.forget_with(session)
    if instance_ids:
        session.execute(
            update(InstanceRow)
            .where(InstanceRow.id.in_(sorted(instance_ids)))
            .values(directory_revision=InstanceRow.directory_revision + 1)
            .execution_options(synchronize_session=False)
        )


def peer_instance_ids(session: Session, instance_id: int) -> set[int]:
    """The instances paired with ``instance_id``, whatever the pairings' status."""
    rows = session.execute(
        select(PairingRow.context_id, PairingRow.generation_id).where(
            or_(PairingRow.context_id == instance_id, PairingRow.generation_id == instance_id)
        )
    )
    return {gen if ctx == instance_id else ctx for ctx, gen in rows}


def bump_peer_directories(session: Session, instance_id: int, *, itself: bool = False) -> None:
    """Something of ``instance_id`` that its peers' directories show changed (its epoch, a
    worker of it); ``itself``: its own workers' directories too."""
    ids = peer_instance_ids(session, instance_id)
    bump_directories(session, ids | {instance_id} if itself else ids)


def mark_stale_for_instance(*, session: Session, instance_id: int) -> int:
    """Mark every pairing (and cached plan) using ``instance_id`` stale; returns the count."""
    uses = or_(PairingRow.context_id == instance_id, PairingRow.generation_id == instance_id)
    result = session.execute(
        update(PairingRow)
        .where(uses)
        .values(status="stale")
        .execution_options(synchronize_session=False)
    )
    ids = select(PairingRow.id).where(uses).scalar_subquery()
    session.execute(
        update(PlanRow)
        .where(PlanRow.pairing_id.in_(ids))
        .values(stale=True)
        .execution_options(synchronize_session=False)
    )
    session.expire_all()
    return int(getattr(result, "rowcount", 0) or 0)


def _instance_by_name(session: Session, name: str, *, lock: bool = False) -> InstanceRow:
    query = select(InstanceRow).where(InstanceRow.name == name)
    if lock:
        # FOR SHARE: a re-registration (which holds FOR UPDATE on the row) finishes first and we
        # read its new epoch, or waits for our commit and then marks what we stored stale.
        query = query.with_for_update(read=True).execution_options(populate_existing=True)
    row = session.scalars(query).one_or_none()
    if row is None:
        raise NotFound(f"instance {name!r} is not registered", code="instance_not_found")
    return row


def _check_roles(context: InstanceRow, generation: InstanceRow) -> None:
    wrong = [
        f"{side} {row.name!r} has role {row.role!r}"
        for side, row in (("context", context), ("generation", generation))
        if row.role != side
    ]
    if wrong:
        raise Conflict("; ".join(wrong), code="wrong_role")


def _apply_validation(row: PairingRow, context: InstanceRow, generation: InstanceRow) -> None:
    report = validate_geometry(load_geometry(context), load_geometry(generation)).to_dict()
    row.context_epoch = context.epoch
    row.generation_epoch = generation.epoch
    row.compatible = bool(report["compatible"])
    row.status = "compatible" if row.compatible else "incompatible"
    row.report = report
    row.validated_at = utcnow()


def create_pairing(*, session: Session, context: str, generation: str) -> tuple[PairingRow, bool]:
    """Validate and store the pairing of two registered instances; returns ``(row, created)``.

    An incompatible pairing is stored with its report (not an error). Posting an existing pair
    re-validates it.
    """
    # The instances are read under a shared row lock before anything else. Reading them
    # unlocked and then waiting on the pairing row (which a concurrent re-registration has
    # just marked stale) would store a validation of the old epoch as current (PostgreSQL,
    # READ COMMITTED; SQLite serializes writers anyway).
    ctx = _instance_by_name(session, context, lock=True)
    gen = _instance_by_name(session, generation, lock=True)
    _check_roles(ctx, gen)
    row = session.scalars(
        select(PairingRow)
        .where(PairingRow.context_id == ctx.id, PairingRow.generation_id == gen.id)
        .with_for_update()
    ).one_or_none()
    created = row is None
    if row is None:
        row = PairingRow(id=uuid.uuid4().hex, context_id=ctx.id, generation_id=gen.id)
        row.created_at = utcnow()
    _apply_validation(row, ctx, gen)
    if created:
        session.add(row)
    row.context = ctx
    row.generation = gen
    session.flush()
    bump_directories(session, {ctx.id, gen.id})
    return row, created


def get_pairing(*, session: Session, pairing_id: str) -> PairingRow:
    """The pairing ``pairing_id`` or 404."""
    row = session.get(PairingRow, pairing_id)
    if row is None:
        raise NotFound(f"pairing {pairing_id!r} does not exist", code="pairing_not_found")
    return row


def list_pairings(
    *,
    session: Session,
    status: str | None = None,
    instance: str | None = None,
    limit: int = 100,
    offset: int = 0,
) -> tuple[list[PairingRow], int]:
    """One page of pairings (newest first), optionally filtered by status or instance name."""
    query = select(PairingRow)
    if status is not None:
        query = query.where(PairingRow.status == status)
    if instance is not None:
        ctx, gen = aliased(InstanceRow), aliased(InstanceRow)
        query = (
            query.join(ctx, PairingRow.context_id == ctx.id)
            .join(gen, PairingRow.generation_id == gen.id)
            .where(or_(ctx.name == instance, gen.name == instance))
        )
    total = session.scalar(select(func.count()).select_from(query.subquery())) or 0
    rows = session.scalars(
        query.order_by(PairingRow.created_at.desc(), PairingRow.id).limit(limit).offset(offset)
    ).all()
    return list(rows), total


def count_pairings_by_status(*, session: Session) -> dict[str, int]:
    """``{status: count}`` over every pairing (for metrics and the dashboard)."""
    rows = session.execute(select(PairingRow.status, func.count()).group_by(PairingRow.status))
    return {status: int(count) for status, count in rows}


def validate_pairing_by_id(*, session: Session, pairing_id: str) -> PairingRow:
    """Re-validate a pairing against the instances' current registrations (clears ``stale``)."""
    row = session.scalars(
        select(PairingRow).where(PairingRow.id == pairing_id).with_for_update()
    ).one_or_none()
    if row is None:
        raise NotFound(f"pairing {pairing_id!r} does not exist", code="pairing_not_found")
    _apply_validation(row, row.context, row.generation)
    session.flush()
    bump_directories(session, {row.context_id, row.generation_id})
    return row


def _require_current(row: PairingRow) -> None:
    if (
        row.status == "stale"
        or row.context.epoch != row.context_epoch
        or row.generation.epoch != row.generation_epoch
    ):
        raise Conflict(
            f"pairing {row.id} is stale: an instance re-registered since validation; "
            f"POST /v1/pairings/{row.id}/validate",
            code="pairing_stale",
        )
    if not row.compatible:
        raise Incompatible(
            f"pairing {row.id} is incompatible ({len(row.report.get('errors', []))} errors)",
            code="pairing_incompatible",
            extra={"report": row.report},
        )


def plan_problem(error: GeometryError) -> BadRequest | Incompatible:
    """The problem for a ``compile_plan`` refusal: 409 when incompatible, else 422 naming fields."""
    errors = [
        {"loc": ["query", *problem.loc], "msg": problem.message, "code": problem.code}
        for problem in error.problems
    ]
    if error.code == "incompatible":
        return Incompatible(str(error), code="incompatible", errors=errors)
    return BadRequest(str(error), code=error.code, errors=errors)


def get_plan(
    *,
    session: Session,
    pairing_id: str,
    context_dp_rank: int | None = None,
    generation_dp_rank: int | None = None,
) -> tuple[int, Plan]:
    """The compiled plan of a current, compatible pairing: ``(plan_row_id, plan)``, cached."""
    return plan_for_pairing(
        session=session,
        pairing=get_pairing(session=session, pairing_id=pairing_id),
        context_dp_rank=context_dp_rank,
        generation_dp_rank=generation_dp_rank,
    )


def plan_for_pairing(
    *,
    session: Session,
    pairing: PairingRow,
    context_dp_rank: int | None,
    generation_dp_rank: int | None,
) -> tuple[int, Plan]:
    """Like :func:`get_plan` for a loaded pairing row (compiles and stores on a cache miss)."""
    _require_current(pairing)
    cdp = NO_DP_RANK if context_dp_rank is None else context_dp_rank
    gdp = NO_DP_RANK if generation_dp_rank is None else generation_dp_rank
    key: PlanKey = (pairing.id, pairing.context_epoch, pairing.generation_epoch, cdp, gdp)
    hit = _memo_get(key)
    if hit is not None:
        return hit
    where = (
        PlanRow.pairing_id == pairing.id,
        PlanRow.context_epoch == pairing.context_epoch,
        PlanRow.generation_epoch == pairing.generation_epoch,
        PlanRow.context_dp_rank == cdp,
        PlanRow.generation_dp_rank == gdp,
    )
    stored = session.scalars(select(PlanRow).where(*where)).one_or_none()
    if stored is not None:
        value = (stored.id, Plan.from_dict(stored.body))
        _memo_on_commit(session, key, value)
        return value
    try:
        plan = compile_plan(
            load_geometry(pairing.context),
            load_geometry(pairing.generation),
            context_dp_rank,
            generation_dp_rank,
        )
    except GeometryError as error:
        raise plan_problem(error) from None
    row = PlanRow(
        pairing_id=pairing.id,
        context_epoch=pairing.context_epoch,
        generation_epoch=pairing.generation_epoch,
        context_dp_rank=cdp,
        generation_dp_rank=gdp,
        stale=False,
        body=plan.to_dict(),
        created_at=utcnow(),
    )
    try:
        with session.begin_nested():
            session.add(row)
    except IntegrityError:
        # Another process compiled the same plan first; theirs is identical.
        row = session.scalars(select(PlanRow).where(*where)).one()
    value = (row.id, plan)
    _memo_on_commit(session, key, value)
    return value


def load_plan(*, session: Session, plan_id: int) -> Plan | None:
    """A stored plan by row id (``None`` when it was deleted with its pairing)."""
    row = session.get(PlanRow, plan_id)
    return None if row is None else Plan.from_dict(row.body)


def plan_summary(plan: Plan) -> schemas.PlanSummary:
    """Route, segment and run counts of a plan and its bytes per block."""
    return schemas.PlanSummary(
        routes=len(plan.routes),
        segments=sum(len(route.segments) for route in plan.routes),
        runs=plan.runs,
        bytes_per_block=plan.bytes_per_block,
    )


def check_compatibility(
    *,
    context: schemas.InstanceInline,
    generation: schemas.InstanceInline,
    context_dp_rank: int | None = None,
    generation_dp_rank: int | None = None,
) -> schemas.CompatibilityRead:
    """Validate two inline instance bodies (nothing stored); a plan summary when compatible."""
    instances: list[Instance] = []
    for side, body in (("context", context), ("generation", generation)):
        if body.role != side:
            raise BadRequest(
                f"{side} body has role {body.role!r}",
                code="wrong_role",
                errors=[{"loc": ["body", side, "role"], "msg": f"must be {side!r}"}],
            )
        data = body.model_dump(mode="json", exclude={"name"})
        try:
            instances.append(parse_instance(data, body.name))
        except GeometryError as error:
            raise geometry_problem(error, ("body", side)) from None
    report: dict[str, Any] = validate_geometry(instances[0], instances[1]).to_dict()
    result = schemas.CompatibilityRead.model_validate(report)
    if result.compatible:
        try:
            plan = compile_plan(instances[0], instances[1], context_dp_rank, generation_dp_rank)
        except GeometryError as error:
            raise plan_problem(error) from None
        result.plan = plan_summary(plan)
    return result


def pairing_read(row: PairingRow) -> schemas.PairingRead:
    """The wire schema of a stored pairing."""
    report = row.report
    return schemas.PairingRead(
        id=row.id,
        context=row.context.name,
        generation=row.generation.name,
        status=row.status,  # type: ignore[arg-type]
        compatible=row.compatible,
        errors=report.get("errors", []),
        warnings=report.get("warnings", []),
        context_epoch=row.context_epoch,
        generation_epoch=row.generation_epoch,
        created_at=row.created_at,
        validated_at=row.validated_at,
    )
