"""Read-only counts and transition checks behind the Prometheus metrics.

Services never see the metrics registry; routes that may finish transfers take a snapshot of the
transfers they could touch (:func:`transfer_statuses`) before calling a service and ask
:func:`newly_finished` afterwards, in the same transaction. A transfer leaves ``queued``/
``running`` through one guarded ``UPDATE`` (see ``api/services/execution.py``), so exactly one
request observes each transition, whichever API process serves it.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta

from sqlalchemy import case, func, or_, select
from sqlalchemy.orm import Session

from api.models import InstanceRow, TransferRow, WorkerRow
from api.services.execution import count_parts_by_state
from api.services.workers import WORKER_GONE_S

ACTIVE_TRANSFER = ("queued", "running")
FINISHED_TRANSFER = ("done", "failed")

__all__ = [
    "count_parts_by_state",
    "count_workers_by_status",
    "finished",
    "newly_finished",
    "transfer_ids_of_instance",
    "transfer_statuses",
]


def count_workers_by_status(*, session: Session, now: datetime) -> dict[str, int]:
    """Workers by status (``alive``, ``gone``, ``stopped``, ``stale``), as ``worker_status``."""
    cutoff = now - timedelta(seconds=WORKER_GONE_S)
    status = case(
        (WorkerRow.stopped.is_(True), "stopped"),
        (WorkerRow.epoch != InstanceRow.epoch, "stale"),
        (WorkerRow.heartbeat_at < cutoff, "gone"),
        else_="alive",
    )
    rows = session.execute(
        select(status, func.count()).select_from(WorkerRow).join(InstanceRow).group_by(status)
    )
    return {str(name): int(count) for name, count in rows}


def transfer_statuses(*, session: Session, transfer_ids: Iterable[str]) -> dict[str, str]:
    """The current status of each of ``transfer_ids`` that is queued or running."""
    ids = sorted(set(transfer_ids))
    if not ids:
        return {}
    rows = session.execute(
        select(TransferRow.id, TransferRow.status).where(
            TransferRow.id.in_(ids), TransferRow.status.in_(ACTIVE_TRANSFER)
        )
    )
    return {str(tid): str(status) for tid, status in rows}


def finished(*, session: Session, transfer_ids: Iterable[str]) -> list[tuple[str, float]]:
    """``(status, seconds)`` of ``transfer_ids`` that are done or failed (for the metrics)."""
    ids = sorted(set(transfer_ids))
    if not ids:
        return []
    return newly_finished(session=session, before={tid: "running" for tid in ids})


def transfer_ids_of_instance(*, session: Session, name: str) -> list[str]:
    """Active transfers involving instance ``name`` (re-registration or deletion fails them)."""
    return list(
        session.scalars(
            select(TransferRow.id).where(
                TransferRow.status.in_(ACTIVE_TRANSFER),
                or_(TransferRow.context_name == name, TransferRow.generation_name == name),
            )
        )
    )


def newly_finished(*, session: Session, before: dict[str, str]) -> list[tuple[str, float]]:
    """Of the transfers active in ``before``, those now done or failed: ``(status, seconds)``.

    Seconds run from creation to finish: what the generation engine waited.
    """
    if not before:
        return []
    rows = session.execute(
        select(TransferRow.status, TransferRow.created_at, TransferRow.finished_at).where(
            TransferRow.id.in_(sorted(before)), TransferRow.status.in_(FINISHED_TRANSFER)
        )
    )
    return [
        (str(status), (finished - created).total_seconds() if finished and created else 0.0)
        for status, created, finished in rows
    ]
