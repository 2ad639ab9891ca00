"""Transfers: plan one request's KV transfer from a pairing's cached plan and its block lists.

``Idempotency-Key``: the same key with the same body returns the stored transfer; the same key
with another body is a 409. ``execute=true`` (job queue) is answered 501 until workers land; the
``transfers`` row is where a later ``jobs`` table will point.
"""

from __future__ import annotations

import hashlib
import json
import uuid

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from api import schemas
from api.db import utcnow
from api.errors import BadRequest, Conflict, NotFound, NotImplementedYet
from api.geometry import GeometryError, expand
from api.models import InstanceRow, PairingRow, TransferRow
from api.services.pairings import load_plan, plan_for_pairing


def request_hash(body: schemas.TransferCreate) -> str:
    """sha256 of the canonical JSON of a transfer request (for Idempotency-Key checks)."""
    canonical = json.dumps(body.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _blocks(raw: dict[str, dict[str, list[int]]]) -> dict[int, tuple[list[int], list[int]]]:
    return {int(group): (lists["context"], lists["generation"]) for group, lists in raw.items()}


def _by_key(session: Session, key: str) -> TransferRow | None:
    return session.scalars(
        select(TransferRow).where(TransferRow.idempotency_key == key)
    ).one_or_none()


def _replay(row: TransferRow, digest: str, key: str) -> TransferRow:
    if row.request_hash != digest:
        raise Conflict(
            f"Idempotency-Key {key!r} was used for a different request",
            code="idempotency_key_reused",
            extra={"transfer_id": row.id},
        )
    return row


def _find_pairing(session: Session, context: str, generation: str) -> PairingRow:
    ctx = session.scalars(select(InstanceRow).where(InstanceRow.name == context)).one_or_none()
    gen = session.scalars(select(InstanceRow).where(InstanceRow.name == generation)).one_or_none()
    for name, row in ((context, ctx), (generation, gen)):
        if row is None:
            raise NotFound(f"instance {name!r} is not registered", code="instance_not_found")
    assert ctx is not None and gen is not None
    pairing = session.scalars(
        select(PairingRow).where(
            PairingRow.context_id == ctx.id, PairingRow.generation_id == gen.id
        )
    ).one_or_none()
    if pairing is None:
        raise NotFound(
            f"no pairing of {context!r} with {generation!r}; POST /v1/pairings first",
            code="pairing_not_found",
        )
    return pairing


def create_transfer(
    *,
    session: Session,
    body: schemas.TransferCreate,
    idempotency_key: str | None = None,
) -> tuple[TransferRow, bool]:
    """Plan a transfer and store it; returns ``(row, created)`` (``created`` false on replay)."""
    if body.execute:
        raise NotImplementedYet(
            "execute=true needs the job queue, which is not available yet; plan with "
            "execute=false and move the fragments yourself",
            code="not_implemented",
        )
    digest = request_hash(body)
    if idempotency_key is not None:
        existing = _by_key(session, idempotency_key)
        if existing is not None:
            return _replay(existing, digest, idempotency_key), False
    pairing = _find_pairing(session, body.context, body.generation)
    plan_id, plan = plan_for_pairing(
        session=session,
        pairing=pairing,
        context_dp_rank=body.context_dp_rank,
        generation_dp_rank=body.generation_dp_rank,
    )
    raw_blocks = {
        group: {"context": lists.context, "generation": lists.generation}
        for group, lists in body.blocks.items()
    }
    try:
        expansion = expand(plan, _blocks(raw_blocks))
    except GeometryError as error:
        errors = [
            {"loc": ["body", *problem.loc], "msg": problem.message, "code": problem.code}
            for problem in error.problems
        ]
        raise BadRequest(str(error), code="invalid_blocks", errors=errors) from None
    now = utcnow()
    summary = expansion.to_summary()
    row = TransferRow(
        id=uuid.uuid4().hex,
        pairing_id=pairing.id,
        plan_id=plan_id,
        context_name=body.context,
        generation_name=body.generation,
        request_id=body.request_id,
        context_dp_rank=body.context_dp_rank,
        generation_dp_rank=body.generation_dp_rank,
        status="planned",
        execute=body.execute,
        blocks=raw_blocks,
        summary=summary,
        bytes=int(summary["bytes"]),
        fragments=int(summary["fragments"]),
        idempotency_key=idempotency_key,
        request_hash=digest,
        created_at=now,
        updated_at=now,
    )
    if idempotency_key is None:
        session.add(row)
        session.flush()
        return row, True
    try:
        with session.begin_nested():
            session.add(row)
    except IntegrityError:
        # A concurrent request with the same key won the insert.
        existing = _by_key(session, idempotency_key)
        if existing is None:
            raise
        return _replay(existing, digest, idempotency_key), False
    return row, True


def get_transfer(*, session: Session, transfer_id: str) -> TransferRow:
    """The transfer ``transfer_id`` or 404."""
    row = session.get(TransferRow, transfer_id)
    if row is None:
        raise NotFound(f"transfer {transfer_id!r} does not exist", code="transfer_not_found")
    return row


def transfer_fragments(*, session: Session, transfer_id: str) -> schemas.TransferFragments:
    """Every fragment of a transfer (expanded now from its plan and block lists)."""
    row = get_transfer(session=session, transfer_id=transfer_id)
    plan = None if row.plan_id is None else load_plan(session=session, plan_id=row.plan_id)
    if plan is None:
        raise Conflict(
            f"the plan of transfer {row.id} was deleted with its pairing", code="plan_gone"
        )
    expansion = expand(plan, _blocks(row.blocks))
    return schemas.TransferFragments.model_validate(expansion.to_fragments())


def transfer_read(row: TransferRow) -> schemas.TransferRead:
    """The wire schema of a stored transfer."""
    return schemas.TransferRead(
        id=row.id,
        status=row.status,  # type: ignore[arg-type]
        context=row.context_name,
        generation=row.generation_name,
        request_id=row.request_id,
        pairing_id=row.pairing_id,
        context_dp_rank=row.context_dp_rank,
        generation_dp_rank=row.generation_dp_rank,
        execute=row.execute,
        routes=row.summary.get("routes", []),
        bytes=row.bytes,
        fragments=row.fragments,
        created_at=row.created_at,
        updated_at=row.updated_at,
    )
