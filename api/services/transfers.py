"""Transfers: plan one request's KV transfer from a pairing's cached plan and its block lists.

``Idempotency-Key``: the same key with the same body returns the stored transfer; the same key
with another body is a 409. Keys are scoped to the caller: with auth on, each token has its own
key space (stored as ``<token id>/sha256(key)``), so one principal can neither replay, block nor
learn the transfer of another's key; with auth off every caller is the same anonymous principal.

``execute=true`` also starts the transfer's first attempt in the same transaction
(:func:`api.services.execution.dispatch_commands`: the row is stored as its attempt 1 runs); the
router then pushes one command per rank to the workers' open command streams.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from typing import Any

from sqlalchemy import bindparam, func, insert, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, aliased, contains_eager

from api import schemas
from api.db import utcnow
from api.errors import BadRequest, Conflict, NotFound
from api.models import InstanceRow, PairingRow, TransferRow
from api.services.execution import attempt_values, dispatch_commands
from api.services.pairings import cached_plan, load_plan, plan_for_pairing
from geometry import GeometryError, Plan, expand


def request_hash(body: schemas.TransferCreate) -> str:
    """sha256 of the canonical JSON of a transfer request (for Idempotency-Key checks)."""
    canonical = json.dumps(body.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _blocks(raw: dict[str, dict[str, Any]]) -> dict[int, tuple[Any, Any]]:
    """Per layer group ``(context ids, generation ids)``; generation ids may be per CP rank."""
    return {int(group): (lists["context"], lists["generation"]) for group, lists in raw.items()}


def scoped_key(key: str, scope: str | None) -> str:
    """The stored form of an ``Idempotency-Key`` in the key space of principal ``scope``."""
    if not scope:
        return key
    return f"{scope}/{hashlib.sha256(key.encode()).hexdigest()}"


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


# Built once: aliasing per call costs more than the query itself on the hot path.
_CTX = aliased(InstanceRow, name="ctx")
_GEN = aliased(InstanceRow, name="gen")
_PAIRING_BY_NAMES = (
    select(PairingRow)
    .join(_CTX, PairingRow.context_id == _CTX.id)
    .join(_GEN, PairingRow.generation_id == _GEN.id)
    .where(_CTX.name == bindparam("context"), _GEN.name == bindparam("generation"))
    .options(contains_eager(PairingRow.context.of_type(_CTX)))
    .options(contains_eager(PairingRow.generation.of_type(_GEN)))
)


_CURRENT_PLAN_KEY = (
    select(
        PairingRow.id,
        PairingRow.status,
        PairingRow.compatible,
        PairingRow.context_epoch,
        PairingRow.generation_epoch,
        _CTX.epoch,
        _GEN.epoch,
    )
    .join(_CTX, PairingRow.context_id == _CTX.id)
    .join(_GEN, PairingRow.generation_id == _GEN.id)
    .where(_CTX.name == bindparam("context"), _GEN.name == bindparam("generation"))
)


def _cached_plan(session: Session, body: schemas.TransferCreate) -> tuple[str, int, Plan] | None:
    """Hot path: a current, compatible pairing whose plan is in this process's plan cache.

    One Core column query instead of loading three ORM rows; anything unusual (no pairing, stale,
    incompatible, a cache miss) returns None and takes the full path with its errors.
    """
    row = (
        session.connection()
        .execute(_CURRENT_PLAN_KEY, {"context": body.context, "generation": body.generation})
        .first()
    )
    if row is None:
        return None
    pairing_id, status, compatible, context_epoch, generation_epoch, ctx_now, gen_now = row
    if (
        status == "stale"
        or not compatible
        or (ctx_now, gen_now)
        != (
            context_epoch,
            generation_epoch,
        )
    ):
        return None
    hit = cached_plan(
        pairing_id,
        context_epoch,
        generation_epoch,
        body.context_dp_rank,
        body.generation_dp_rank,
    )
    return None if hit is None else (pairing_id, *hit)


def _find_pairing(session: Session, context: str, generation: str) -> PairingRow:
    # One round trip on the hot path: the pairing with both instances (for the epoch check).
    pairing = session.scalars(
        _PAIRING_BY_NAMES, {"context": context, "generation": generation}
    ).one_or_none()
    if pairing is not None:
        return pairing
    for name in (context, generation):
        if session.scalar(select(InstanceRow.id).where(InstanceRow.name == name)) is None:
            raise NotFound(f"instance {name!r} is not registered", code="instance_not_found")
    raise NotFound(
        f"no pairing of {context!r} with {generation!r}; POST /v1/pairings first",
        code="pairing_not_found",
    )


def create_transfer(
    *,
    session: Session,
    body: schemas.TransferCreate,
    idempotency_key: str | None = None,
    idempotency_scope: str | None = None,
    commands: list[tuple[str, dict[str, Any]]] | None = None,
) -> tuple[TransferRow, bool]:
    """Plan a transfer and store it; returns ``(row, created)`` (``created`` false on replay).

    ``idempotency_scope`` names the caller's key space (its token id; None when auth is off).
    With ``execute``, the commands to push to the workers are appended to ``commands``.

    The row is inserted with one Core INSERT (the ORM unit of work costs more than the insert on
    this hot path), already running its first attempt with ``execute``; the returned row is a
    detached copy of what was inserted.
    """
    # The digest only serves Idempotency-Key replays; without a key nothing ever compares it.
    digest = "" if idempotency_key is None else request_hash(body)
    stored_key = None if idempotency_key is None else scoped_key(idempotency_key, idempotency_scope)
    if stored_key is not None:
        existing = _by_key(session, stored_key)
        if existing is not None:
            return _replay(existing, digest, str(idempotency_key)), False
    cached = _cached_plan(session, body)
    if cached is not None:
        pairing_id, plan_id, plan = cached
    else:
        pairing = _find_pairing(session, body.context, body.generation)
        pairing_id = pairing.id
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
        expansion = expand(plan, _blocks(raw_blocks), body.num_tokens)
    except GeometryError as error:
        errors = [
            {"loc": ["body", *problem.loc], "msg": problem.message, "code": problem.code}
            for problem in error.problems
        ]
        # the lists cannot be placed without num_tokens: a code of its own, the rule in the text
        code = "ambiguous_alignment" if error.code == "ambiguous_alignment" else "invalid_blocks"
        raise BadRequest(str(error), code=code, errors=errors) from None
    now = utcnow()
    summary = expansion.to_summary()
    # kept beside the routes (no column of its own): the fragments and the workers' commands
    # expand the same blocks with it again
    summary["num_tokens"] = body.num_tokens
    values = {
        "id": uuid.uuid4().hex,
        "pairing_id": pairing_id,
        "plan_id": plan_id,
        "context_name": body.context,
        "generation_name": body.generation,
        "request_id": body.request_id,
        "context_dp_rank": body.context_dp_rank,
        "generation_dp_rank": body.generation_dp_rank,
        "status": "planned",
        "execute": body.execute,
        "blocks": raw_blocks,
        "summary": summary,
        "bytes": int(summary["bytes"]),
        "fragments": int(summary["fragments"]),
        "idempotency_key": stored_key,
        "request_hash": digest,
        "created_at": now,
        "updated_at": now,
        "mode": body.mode,
        "verify": body.verify,
        "attempt": 0,
        "max_attempts": 3,
    }
    started: list[tuple[str, dict[str, Any]]] = []
    if body.execute:
        # The commands first (503 before anything is stored when a rank has no worker), then
        # the row as its first attempt starts: one INSERT, no read back and no UPDATE.
        started = dispatch_commands(
            session=session,
            transfer=TransferRow(**values),
            attempt=1,
            now=now,
            timeout_s=body.timeout_s,
        )
        values.update(
            attempt_values(attempt=1, commands=started, now=now, timeout_s=body.timeout_s)
        )
    statement = insert(TransferRow)
    if stored_key is None:
        session.connection().execute(statement, values)
    else:
        try:
            with session.begin_nested():
                session.connection().execute(statement, values)
        except IntegrityError:
            # A concurrent request with the same key won the insert.
            existing = _by_key(session, stored_key)
            if existing is None:
                raise
            return _replay(existing, digest, str(idempotency_key)), False
    if commands is not None:
        commands.extend(started)
    return TransferRow(**values), True


def get_transfer(*, session: Session, transfer_id: str) -> TransferRow:
    """The transfer ``transfer_id`` or 404."""
    row = session.get(TransferRow, transfer_id)
    if row is None:
        raise NotFound(f"transfer {transfer_id!r} does not exist", code="transfer_not_found")
    return row


def list_transfers(
    *,
    session: Session,
    status: str | None = None,
    context: str | None = None,
    generation: str | None = None,
    limit: int = 100,
    offset: int = 0,
) -> tuple[list[TransferRow], int]:
    """One page of transfers, newest first, with the total count matching the filters."""
    query = select(TransferRow)
    if status is not None:
        query = query.where(TransferRow.status == status)
    if context is not None:
        query = query.where(TransferRow.context_name == context)
    if generation is not None:
        query = query.where(TransferRow.generation_name == generation)
    total = int(session.scalar(select(func.count()).select_from(query.subquery())) or 0)
    rows = session.scalars(
        query.order_by(TransferRow.created_at.desc(), TransferRow.id).limit(limit).offset(offset)
    )
    return list(rows), total


def transfer_fragments(
    *,
    session: Session,
    transfer_id: str,
    max_per_page: int,
    offset: int = 0,
    limit: int | None = None,
) -> dict[str, Any]:
    """One page of a transfer's fragments, expanded now from its plan and block lists.

    Only the page is built (memory grows with ``limit``, never with the transfer). Without a
    ``limit`` the whole list is answered if it fits in ``max_per_page``; a request for more
    than ``max_per_page`` fragments is a 422 ``too_many_fragments`` naming the limit.
    """
    row = get_transfer(session=session, transfer_id=transfer_id)
    plan = None if row.plan_id is None else load_plan(session=session, plan_id=row.plan_id)
    if plan is None:
        raise Conflict(
            f"the plan of transfer {row.id} was deleted with its pairing", code="plan_gone"
        )
    extra = {"max_fragments_per_page": max_per_page, "fragments": row.fragments}
    if limit is not None and limit > max_per_page:
        raise BadRequest(
            f"limit {limit} is above the page limit of {max_per_page} fragments "
            "(KVPLANE_MAX_FRAGMENTS_PER_PAGE)",
            code="too_many_fragments",
            errors=[{"loc": ["query", "limit"], "msg": f"must be at most {max_per_page}"}],
            extra=extra,
        )
    if limit is None and row.fragments - offset > max_per_page:
        raise BadRequest(
            f"transfer {row.id} has {row.fragments} fragments, more than one page holds "
            f"({max_per_page}, KVPLANE_MAX_FRAGMENTS_PER_PAGE); page with ?offset=&limit= "
            f"(limit at most {max_per_page})",
            code="too_many_fragments",
            extra=extra,
        )
    try:
        expansion = expand(plan, _blocks(row.blocks), num_tokens_of(row))
    except (GeometryError, KeyError, TypeError, ValueError) as error:
        # A row stored before records' blocks were checked: say so, it is not a server bug.
        raise Conflict(
            f"the blocks of transfer {row.id} do not fit its plan: {error}",
            code="blocks_unexpandable",
        ) from None
    return expansion.fragment_page(offset, max_per_page if limit is None else limit)


def num_tokens_of(row: TransferRow) -> int | None:
    """The request's prompt tokens a transfer was planned with (kept in its summary)."""
    value = (row.summary or {}).get("num_tokens")
    return None if value is None else int(value)


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
        num_tokens=num_tokens_of(row),
        execute=row.execute,
        routes=row.summary.get("routes", []),
        bytes=row.bytes,
        fragments=row.fragments,
        created_at=row.created_at,
        updated_at=row.updated_at,
        mode=row.mode,  # type: ignore[arg-type]
        verify=row.verify,
        attempt=row.attempt,
        error=row.error,
        started_at=row.started_at,
        finished_at=row.finished_at,
        duration_s=(
            (row.finished_at - row.started_at).total_seconds()
            if row.finished_at is not None and row.started_at is not None
            else None
        ),
    )
