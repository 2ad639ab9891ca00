"""Registering, re-registering and deregistering an instance, with everything that follows.

A registration is stored by :mod:`api.services.instances`. What follows from it reaches three
other services, so it lives here, above all of them (none of them imports this module):

- a **new epoch** (any change to an existing instance's registration, :func:`instance_changed`):
  every pairing and cached plan that uses the instance becomes ``stale``, the directories of its
  own and its peers' workers are bumped, and its active transfers fail (``peer_restarted``):
  jobs planned on the old epoch must never run against the new memory layout;
- a **deregistration** (:func:`delete_instance`): its active transfers fail (``peer_left``) and its
  peers' directories are bumped before the row, its pairings and cached plans are deleted.

Routes, the dashboard and the demo fleet call these, not the storage functions.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from api import schemas
from api.db import utcnow
from api.models import InstanceRow
from api.services import instances
from api.services.execution import fail_transfers_of_instance
from api.services.pairings import bump_peer_directories, mark_stale_for_instance


def register_instance(
    *,
    session: Session,
    name: str,
    body: schemas.InstanceCreate,
    if_match: str | None = None,
) -> tuple[InstanceRow, bool, bool]:
    """Register or replace ``name``; returns ``(row, created, changed)``."""
    row, created, changed = instances.store_instance(
        session=session, name=name, body=body, if_match=if_match
    )
    if changed and not created:  # a first registration starts at its first epoch
        instance_changed(session=session, row=row)
    return row, created, changed


def report_rank(
    *,
    session: Session,
    name: str,
    rank: int,
    body: schemas.RankCreate,
    if_match: str | None = None,
) -> tuple[InstanceRow, bool, bool]:
    """Store one rank's page table; returns ``(row, created_rank, changed)``."""
    row, created, changed = instances.store_rank(
        session=session, name=name, rank=rank, body=body, if_match=if_match
    )
    if changed:
        instance_changed(session=session, row=row)
    return row, created, changed


def instance_changed(*, session: Session, row: InstanceRow) -> None:
    """``row`` has a new epoch: its pairings and plans go stale, directories are bumped and its
    active transfers fail."""
    mark_stale_for_instance(session=session, instance_id=row.id)
    bump_peer_directories(session, row.id, itself=True)
    # Jobs planned on the old epoch must never run against the new memory layout.
    fail_transfers_of_instance(
        session=session,
        instance_id=row.id,
        now=row.updated_at,
        reason=f"peer_restarted: {row.name} re-registered (new epoch {row.epoch}); no byte of "
        "the old layout is used",
    )


def delete_instance(*, session: Session, name: str, if_match: str | None = None) -> None:
    """Delete ``name``, its ranks, pairings and cached plans (transfers are kept)."""
    row = instances.lock_instance(session=session, name=name, if_match=if_match)
    fail_transfers_of_instance(
        session=session,
        instance_id=row.id,
        now=utcnow(),
        reason=f"peer_left: {row.name} was deregistered",
    )
    bump_peer_directories(session, row.id)
    instances.remove_instance(session=session, row=row)
