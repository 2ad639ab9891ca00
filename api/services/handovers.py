"""One instance's handovers: its transfers of a recent window, per peer and outcome.

A context instance sends handovers and a generation instance receives them; either way a
handover is one row of the transfers table (an engine-path transfer gets its row from its first
worker record, a REST transfer from ``POST /v1/transfers``), found by the instance's name on its
side (names survive a deregistration, pairing ids do not). The window is bounded by
``created_at`` (indexed), so the cost follows the window's traffic, never the whole history.

Everything is aggregated in SQL, in statements that run alike on SQLite and PostgreSQL: counts,
bytes and latency percentiles per peer, the same across peers, the newest failures, and the
pairing of each peer.
Latency runs from creation to done, as on the dashboard's charts and in the
``kvplane_transfer_duration_seconds`` metric. Percentiles are nearest-rank (the smallest
latency with at least ``q`` of them at or below it): ``row_number()`` over the done handovers
in latency order, picked where the row number is ``ceil(q × n)`` (SQLite has no percentile
function, and this needs none).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, and_, case, func, select
from sqlalchemy.orm import Session

from api import schemas
from api.db import seconds_between
from api.models import InstanceRow, PairingRow, TransferRow

HANDOVER_WINDOW = timedelta(hours=1)
LATEST_FAILURES = 10
PERCENTILES = (50, 99)
STATUSES = ("planned", "queued", "running", "done", "failed")


def _nearest_rank(percent: int, count: Any) -> Any:
    """``ceil(percent / 100 × count)`` in integer SQL arithmetic (1 for one value)."""
    return (count * percent + 99) // 100


def _aggregates(ranked: Any) -> list[ColumnElement[Any]]:
    """Counts by status, bytes done, latency percentiles and the newest creation time of the
    rows of ``ranked`` (a subquery of :func:`_ranked`)."""
    done = ranked.c.status == "done"
    return [
        func.count().label("total"),
        *(func.sum(case((ranked.c.status == s, 1), else_=0)).label(s) for s in STATUSES),
        func.sum(case((done, ranked.c.bytes), else_=0)).label("bytes_moved"),
        *(
            func.max(
                case((and_(done, ranked.c.k == _nearest_rank(p, ranked.c.n)), ranked.c.latency_s))
            ).label(f"p{p}_s")
            for p in PERCENTILES
        ),
        func.max(ranked.c.created_at).label("last_at"),
    ]


def _ranked(window: Any, peer: Any, by_peer: bool) -> Any:
    """The transfers ``window`` selects, each with its latency rank among those of its status
    (and peer, ``by_peer``): the percentiles pick done rows by it."""
    latency = seconds_between(TransferRow.created_at, TransferRow.finished_at)
    partition = [peer, TransferRow.status] if by_peer else [TransferRow.status]
    return (
        select(
            peer.label("peer"),
            TransferRow.status,
            TransferRow.bytes,
            TransferRow.created_at,
            latency.label("latency_s"),
            func.row_number()
            .over(partition_by=partition, order_by=[latency, TransferRow.id])
            .label("k"),
            func.count().over(partition_by=partition).label("n"),
        )
        .where(window)
        .subquery()
    )


def _counts(row: Any) -> dict[str, Any]:
    return {
        "total": int(row.total or 0),
        **{status: int(getattr(row, status) or 0) for status in STATUSES},
        "bytes_moved": int(row.bytes_moved or 0),
        "p50_s": None if row.p50_s is None else float(row.p50_s),
        "p99_s": None if row.p99_s is None else float(row.p99_s),
    }


def instance_handovers(
    *,
    session: Session,
    instance: InstanceRow,
    now: datetime,
    window: timedelta = HANDOVER_WINDOW,
    failures: int = LATEST_FAILURES,
) -> schemas.InstanceHandovers:
    """``instance``'s handovers created in the ``window`` before ``now``: per peer (by name),
    in all, and the newest ``failures`` failed ones."""
    since = now - window
    sending = instance.role == "context"
    own = TransferRow.context_name if sending else TransferRow.generation_name
    peer = TransferRow.generation_name if sending else TransferRow.context_name
    window_rows = and_(TransferRow.created_at >= since, own == instance.name)

    per_peer = _ranked(window_rows, peer, by_peer=True)
    rows = session.execute(
        select(per_peer.c.peer, *_aggregates(per_peer))
        .group_by(per_peer.c.peer)
        .order_by(per_peer.c.peer)
    ).all()
    everyone = _ranked(window_rows, peer, by_peer=False)
    total = session.execute(select(*_aggregates(everyone))).one()

    peer_instance = PairingRow.generation_id if sending else PairingRow.context_id
    own_instance = PairingRow.context_id if sending else PairingRow.generation_id
    pairings = {
        str(name): str(pairing_id)
        for name, pairing_id in session.execute(
            select(InstanceRow.name, PairingRow.id)
            .join(InstanceRow, InstanceRow.id == peer_instance)
            .where(own_instance == instance.id)
        )
    }
    failed = session.execute(
        select(
            TransferRow.id,
            TransferRow.request_id,
            peer,
            TransferRow.error,
            TransferRow.created_at,
            TransferRow.finished_at,
        )
        .where(window_rows, TransferRow.status == "failed")
        .order_by(
            func.coalesce(TransferRow.finished_at, TransferRow.updated_at).desc(), TransferRow.id
        )
        .limit(failures)
    ).all()
    return schemas.InstanceHandovers(
        instance=instance.name,
        role=instance.role,  # type: ignore[arg-type]
        since=since,
        window_s=int(window.total_seconds()),
        peers=[
            schemas.HandoverPeer(
                peer=row.peer,
                pairing_id=pairings.get(row.peer),
                last_at=row.last_at,
                **_counts(row),
            )
            for row in rows
        ],
        total=schemas.HandoverCounts(**_counts(total)),
        failures=[
            schemas.HandoverFailure(
                transfer_id=tid,
                request_id=request_id,
                peer=name,
                error=error,
                created_at=created,
                finished_at=finished,
            )
            for tid, request_id, name, error, created, finished in failed
        ],
    )
