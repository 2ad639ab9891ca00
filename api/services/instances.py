"""Stored registrations: PUT whole or rank by rank, generation/epoch bookkeeping, reads.

Replace semantics of ``PUT /v1/instances/{name}`` (documented in docs/api.md):

- header (everything but ``ranks``) unchanged: each rank in the body is upserted, ranks not in
  the body are kept; an identical body changes nothing;
- header changed: the registration is replaced, ranks not in the body are dropped (a restarted
  instance re-reports them).

Any change bumps ``generation`` and issues a new ``epoch``. Deleting an instance deletes its
pairings and their cached plans; transfers keep their names and payload (their ``pairing_id``
becomes null).

This module stores and reads registrations only; what a new epoch or a deregistration means for
pairings, directories and transfers is :mod:`api.services.registration`, which the routes call.
The other services read registrations from here (:func:`load_geometry`,
:func:`geometry_problem`) and never import the layer above.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session, selectinload

from api import schemas
from api.db import utcnow
from api.errors import BadRequest, NotFound, PreconditionFailed
from api.models import InstanceRow, RankRow
from geometry import GeometryError, Instance, parse_instance, parse_rank


def new_epoch() -> str:
    """A fresh epoch: uuid4 hex."""
    return uuid.uuid4().hex


def geometry_problem(error: GeometryError, prefix: Sequence[str | int] = ("body",)) -> BadRequest:
    """A 422 ``invalid_geometry`` problem listing every planning-core problem by field path."""
    errors = [
        {"loc": [*prefix, *problem.loc], "msg": problem.message, "code": problem.code}
        for problem in error.problems
    ]
    return BadRequest(str(error), code="invalid_geometry", errors=errors)


def check_if_match(row: InstanceRow | None, if_match: str | None) -> None:
    """Raise 412 unless ``If-Match`` (a generation, quoted or not, or ``*``) holds for ``row``."""
    if if_match is None:
        return
    wanted = [part.strip().removeprefix("W/").strip('"') for part in if_match.split(",")]
    if row is None:
        raise PreconditionFailed(f"If-Match {if_match!r}: the instance does not exist")
    if "*" in wanted or str(row.generation) in wanted:
        return
    raise PreconditionFailed(
        f"If-Match {if_match!r} does not match generation {row.generation}",
        extra={"generation": row.generation},
    )


def _header(body: schemas.InstanceCreate) -> dict[str, Any]:
    header = body.model_dump(mode="json", exclude={"ranks"})
    if not header.get("layer_groups"):
        # Stored as before per-request state existed: a re-registration stays a no-op.
        header.pop("layer_groups", None)
    return header


_STATE_VIEW_FIELDS = ("d_state", "section_bytes")


def _rank_body(rank: schemas.RankCreate) -> dict[str, Any]:
    """A rank as stored; state-only view fields are left out when unset (bodies of older
    clients stay byte-identical, so re-registering them changes nothing)."""
    body = rank.model_dump(mode="json")
    for view in body["views"]:
        for key in _STATE_VIEW_FIELDS:
            if view.get(key) is None:
                view.pop(key, None)
    return body


def _find(session: Session, name: str, *, for_update: bool = False) -> InstanceRow | None:
    query = select(InstanceRow).where(InstanceRow.name == name)
    if for_update:
        query = query.with_for_update()
    return session.scalars(query).one_or_none()


def get_instance(*, session: Session, name: str) -> InstanceRow:
    """The instance called ``name`` (with its ranks) or 404."""
    row = session.scalars(
        select(InstanceRow).where(InstanceRow.name == name).options(selectinload(InstanceRow.ranks))
    ).one_or_none()
    if row is None:
        raise NotFound(f"instance {name!r} is not registered", code="instance_not_found")
    return row


def list_instances(
    *,
    session: Session,
    role: str | None = None,
    status: str | None = None,
    limit: int = 100,
    offset: int = 0,
) -> tuple[list[InstanceRow], int]:
    """One page of instances ordered by name, and the total matching the filters."""
    query = select(InstanceRow)
    if role is not None:
        query = query.where(InstanceRow.role == role)
    if status is not None:
        query = query.where(InstanceRow.status == status)
    total = session.scalar(select(func.count()).select_from(query.subquery())) or 0
    rows = session.scalars(
        query.options(selectinload(InstanceRow.ranks))
        .order_by(InstanceRow.name)
        .limit(limit)
        .offset(offset)
    ).all()
    return list(rows), total


def load_geometry(row: InstanceRow) -> Instance:
    """Re-parse a stored registration into the planning core's ``Instance``."""
    return parse_instance({**row.header, "ranks": [rank.body for rank in row.ranks]}, row.name)


def _new_epoch(session: Session, row: InstanceRow, instance: Instance) -> None:
    row.generation += 1
    row.epoch = new_epoch()
    row.status = "ready" if instance.is_complete else "incomplete"
    row.updated_at = utcnow()
    session.flush()


def store_instance(
    *,
    session: Session,
    name: str,
    body: schemas.InstanceCreate,
    if_match: str | None = None,
) -> tuple[InstanceRow, bool, bool]:
    """Store or replace ``name``'s registration; returns ``(row, created, changed)``.

    A change of an existing instance issues a new epoch (see :mod:`api.services.registration`)."""
    header = _header(body)
    rank_bodies = [_rank_body(rank) for rank in body.ranks]
    try:
        instance = parse_instance({**header, "ranks": rank_bodies}, name)
    except GeometryError as error:
        raise geometry_problem(error) from None

    row = _find(session, name, for_update=True)
    check_if_match(row, if_match)
    now = utcnow()
    if row is None:
        row = InstanceRow(
            name=name,
            role=instance.role,
            status="ready" if instance.is_complete else "incomplete",
            generation=1,
            epoch=new_epoch(),
            world_size=instance.world_size,
            header=header,
            created_at=now,
            updated_at=now,
            ranks=[RankRow(rank=r["rank"], body=r, updated_at=now) for r in rank_bodies],
        )
        session.add(row)
        session.flush()
        return row, True, True

    stored = {rank.rank: rank for rank in row.ranks}
    if row.header != header:
        row.header = header
        row.role = instance.role
        row.world_size = instance.world_size
        row.ranks.clear()
        session.flush()
        row.ranks.extend(RankRow(rank=r["rank"], body=r, updated_at=now) for r in rank_bodies)
        _new_epoch(session, row, instance)
        return row, False, True

    changed = False
    for r in rank_bodies:
        old = stored.get(r["rank"])
        if old is None:
            row.ranks.append(RankRow(rank=r["rank"], body=r, updated_at=now))
            changed = True
        elif old.body != r:
            old.body = r
            old.updated_at = now
            changed = True
    if not changed:
        return row, False, False
    given = {r["rank"] for r in rank_bodies}
    for rank, old in stored.items():
        if rank not in given:
            instance = instance.with_rank(parse_rank(instance, old.body))
    _new_epoch(session, row, instance)
    return row, False, True


def store_rank(
    *,
    session: Session,
    name: str,
    rank: int,
    body: schemas.RankCreate,
    if_match: str | None = None,
) -> tuple[InstanceRow, bool, bool]:
    """Store one rank's page table; returns ``(row, created_rank, changed)``.

    A change issues a new epoch (see :mod:`api.services.registration`)."""
    if body.rank != rank:
        raise BadRequest(
            f"body rank {body.rank} differs from the path's rank {rank}",
            code="validation_error",
            errors=[{"loc": ["body", "rank"], "msg": f"must equal the path rank {rank}"}],
        )
    row = lock_instance(session=session, name=name, if_match=if_match)
    rank_body = _rank_body(body)
    stored = {r.rank: r for r in row.ranks}
    old = stored.get(rank)
    if old is not None and old.body == rank_body:
        return row, False, False
    instance = parse_instance({**row.header, "ranks": []}, name)
    try:
        table = parse_rank(instance, rank_body)
    except GeometryError as error:
        raise geometry_problem(error) from None
    instance = instance.with_rank(table)
    for other, stored_rank in stored.items():
        if other != rank:
            instance = instance.with_rank(parse_rank(instance, stored_rank.body))
    now = utcnow()
    if old is None:
        row.ranks.append(RankRow(rank=rank, body=rank_body, updated_at=now))
    else:
        old.body = rank_body
        old.updated_at = now
    _new_epoch(session, row, instance)
    return row, old is None, True


def lock_instance(*, session: Session, name: str, if_match: str | None = None) -> InstanceRow:
    """``name``'s row, locked for a change; 404 when it is not registered, 412 unless
    ``If-Match`` holds."""
    row = _find(session, name, for_update=True)
    if row is None:
        raise NotFound(f"instance {name!r} is not registered", code="instance_not_found")
    check_if_match(row, if_match)
    return row


def remove_instance(*, session: Session, row: InstanceRow) -> None:
    """Delete a locked instance row; its ranks, pairings and cached plans go with it."""
    session.execute(delete(InstanceRow).where(InstanceRow.id == row.id))
    session.expunge(row)


def instance_summary(row: InstanceRow) -> schemas.InstanceSummary:
    """The list-view schema of a stored instance."""
    reported = {rank.rank for rank in row.ranks}
    header = row.header
    return schemas.InstanceSummary(
        name=row.name,
        role=row.role,  # type: ignore[arg-type]
        status=row.status,  # type: ignore[arg-type]
        generation=row.generation,
        epoch=row.epoch,
        model=header.get("model"),
        tp=header["tp"],
        pp=header["pp"],
        cp=header["cp"],
        attention_dp=header["attention_dp"],
        tokens_per_block=header["tokens_per_block"],
        kv_heads_per_rank=header.get("kv_heads_per_rank"),
        total_kv_heads=header.get("total_kv_heads"),
        layer_groups=[
            schemas.LayerGroupCreate.model_validate(g) for g in header.get("layer_groups", [])
        ],
        world_size=row.world_size,
        missing_ranks=[r for r in range(row.world_size) if r not in reported],
        created_at=row.created_at,
        updated_at=row.updated_at,
    )


def instance_read(row: InstanceRow) -> schemas.InstanceRead:
    """The full schema of a stored instance, page tables included."""
    summary = instance_summary(row)
    return schemas.InstanceRead(
        **summary.model_dump(),
        ranks=[schemas.RankCreate.model_validate(rank.body) for rank in row.ranks],
    )
