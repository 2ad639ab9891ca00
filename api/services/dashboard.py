"""The dashboard's read-only queries: fleet counts, the compatibility matrix, pages of
transfers and the charts' time series.

Every query is paginated or aggregated in SQL and filters on indexed columns (``status``,
``role``, ``pairing_id``, the pairings' instance ids), so a fleet of hundreds of instances and
tens of thousands of transfers renders in one round trip per table.

Workers and transfer parts themselves are read through ``api.services.workers`` and
``api.services.execution``; only counts live here. The pages are drawn by ``web``
(``api.routers.dashboard`` hands it what these return).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, func, select
from sqlalchemy.orm import Session, defer

from api.db import utcnow
from api.models import InstanceRow, JobRow, PairingRow, TransferRow, WorkerRow
from api.services.stats import count_workers_by_status

IN_FLIGHT_STATUSES = ("queued", "running")
FAILED_WINDOW = timedelta(hours=1)


@dataclass
class Overview:
    """Fleet counts for the overview page."""

    instances: dict[str, int] = field(default_factory=dict)
    roles: dict[str, int] = field(default_factory=dict)
    pairings: dict[str, int] = field(default_factory=dict)
    transfers: dict[str, int] = field(default_factory=dict)
    transfers_in_flight: int = 0
    transfers_failed_last_hour: int = 0
    bytes_moved: int = 0
    bytes_planned: int = 0
    #: Workers by status, as ``GET /v1/workers`` and ``/metrics`` name it: ``alive``,
    #: ``gone`` (no heartbeat), ``stale`` (its instance re-registered) and ``stopped``.
    workers: dict[str, int] = field(default_factory=dict)
    jobs: dict[str, int] = field(default_factory=dict)

    @property
    def instance_total(self) -> int:
        return sum(self.instances.values())

    @property
    def pairing_total(self) -> int:
        return sum(self.pairings.values())

    @property
    def transfer_total(self) -> int:
        return sum(self.transfers.values())

    @property
    def worker_total(self) -> int:
        return sum(self.workers.values())


def _grouped(session: Session, col: Any) -> dict[str, int]:
    return {
        str(key): int(count)
        for key, count in session.execute(select(col, func.count()).group_by(col))
    }


def overview(*, session: Session, now: datetime | None = None) -> Overview:
    """Counts and health of the whole fleet (a handful of grouped, indexed queries)."""
    now = now or utcnow()
    result = Overview(
        instances=_grouped(session, InstanceRow.status),
        roles=_grouped(session, InstanceRow.role),
        pairings=_grouped(session, PairingRow.status),
        transfers=_grouped(session, TransferRow.status),
    )
    result.transfers_in_flight = sum(result.transfers.get(s, 0) for s in IN_FLIGHT_STATUSES)
    result.transfers_failed_last_hour = int(
        session.scalar(
            select(func.count())
            .select_from(TransferRow)
            .where(TransferRow.status == "failed", TransferRow.updated_at >= now - FAILED_WINDOW)
        )
        or 0
    )
    result.bytes_moved = int(
        session.scalar(
            select(func.coalesce(func.sum(TransferRow.bytes), 0)).where(
                TransferRow.status == "done"
            )
        )
        or 0
    )
    result.bytes_planned = int(
        session.scalar(select(func.coalesce(func.sum(TransferRow.bytes), 0))) or 0
    )
    result.workers = count_workers_by_status(session=session, now=now)
    result.jobs = _grouped(session, JobRow.state)
    return result


def instance_names(*, session: Session, ids: set[int]) -> dict[int, str]:
    """``{id: name}`` of the given instances."""
    if not ids:
        return {}
    rows = session.execute(select(InstanceRow.id, InstanceRow.name).where(InstanceRow.id.in_(ids)))
    return {int(i): str(name) for i, name in rows}


@dataclass
class Matrix:
    """One page of the context × generation compatibility matrix."""

    contexts: list[tuple[int, str, str]]  # id, name, status
    generations: list[tuple[int, str, str]]
    cells: dict[tuple[int, int], tuple[str, str]]  # (ctx id, gen id) -> (pairing id, status)
    context_total: int
    generation_total: int


def compatibility_matrix(
    *,
    session: Session,
    context_offset: int,
    generation_offset: int,
    context_limit: int,
    generation_limit: int,
) -> Matrix:
    """One page of contexts × generations (by name) with the stored pairing status."""

    def side(role: str, offset: int, size: int) -> tuple[list[tuple[int, str, str]], int]:
        total = int(
            session.scalar(
                select(func.count()).select_from(InstanceRow).where(InstanceRow.role == role)
            )
            or 0
        )
        rows = session.execute(
            select(InstanceRow.id, InstanceRow.name, InstanceRow.status)
            .where(InstanceRow.role == role)
            .order_by(InstanceRow.name)
            .limit(size)
            .offset(offset)
        )
        return [(int(i), str(n), str(s)) for i, n, s in rows], total

    contexts, context_total = side("context", context_offset, context_limit)
    generations, generation_total = side("generation", generation_offset, generation_limit)
    cells: dict[tuple[int, int], tuple[str, str]] = {}
    if contexts and generations:
        rows = session.execute(
            select(
                PairingRow.context_id, PairingRow.generation_id, PairingRow.id, PairingRow.status
            ).where(
                and_(
                    PairingRow.context_id.in_([c[0] for c in contexts]),
                    PairingRow.generation_id.in_([g[0] for g in generations]),
                )
            )
        )
        for ctx_id, gen_id, pairing_id, status in rows:
            cells[(int(ctx_id), int(gen_id))] = (str(pairing_id), str(status))
    return Matrix(contexts, generations, cells, context_total, generation_total)


def pairings_of_instance(*, session: Session, instance_id: int) -> list[tuple[str, str, str]]:
    """``(pairing id, peer name, status)`` of every pairing using one instance."""
    ctx_side = session.execute(
        select(PairingRow.id, InstanceRow.name, PairingRow.status)
        .join(InstanceRow, InstanceRow.id == PairingRow.generation_id)
        .where(PairingRow.context_id == instance_id)
    )
    gen_side = session.execute(
        select(PairingRow.id, InstanceRow.name, PairingRow.status)
        .join(InstanceRow, InstanceRow.id == PairingRow.context_id)
        .where(PairingRow.generation_id == instance_id)
    )
    found = [(str(i), str(n), str(s)) for i, n, s in [*ctx_side, *gen_side]]
    return sorted(found, key=lambda item: item[1])


def list_transfers(
    *,
    session: Session,
    status: str | None,
    limit: int,
    offset: int,
    context: str | None = None,
    generation: str | None = None,
) -> tuple[list[TransferRow], int]:
    """One page of transfers, newest first, without their block lists; of one status, context
    or generation instance where given."""
    conditions = [
        column == value
        for column, value in (
            (TransferRow.status, status),
            (TransferRow.context_name, context),
            (TransferRow.generation_name, generation),
        )
        if value is not None
    ]
    query = select(TransferRow).where(*conditions)
    count = select(func.count()).select_from(TransferRow).where(*conditions)
    total = int(session.scalar(count) or 0)
    rows = session.scalars(
        query.options(defer(TransferRow.blocks))
        .order_by(TransferRow.created_at.desc(), TransferRow.id)
        .limit(limit)
        .offset(offset)
    ).all()
    return list(rows), total


@dataclass
class JobStats:
    """What the recorded parts of one transfer say: how many, and the first error."""

    jobs: int
    error: str | None


def job_stats(*, session: Session, transfer_ids: list[str]) -> dict[str, JobStats]:
    """Per-transfer job counts and first error for one page of transfers (one grouped query)."""
    if not transfer_ids:
        return {}
    rows = session.execute(
        select(JobRow.transfer_id, func.count(), func.min(JobRow.error))
        .where(JobRow.transfer_id.in_(transfer_ids))
        .group_by(JobRow.transfer_id)
    )
    return {
        str(tid): JobStats(int(n), None if message is None else str(message))
        for tid, n, message in rows
    }


def count_workers(*, session: Session) -> int:
    """How many workers are registered."""
    return int(session.scalar(select(func.count()).select_from(WorkerRow)) or 0)


#: The charts cover this window in :data:`SERIES_BUCKETS` equal steps (one minute each).
SERIES_WINDOW = timedelta(hours=1)
SERIES_BUCKETS = 60
#: At most this many transfers of the window are read for the charts (the newest ones).
SERIES_MAX_ROWS = 200_000
#: Failure reasons beyond this many (the most frequent first) are summed as ``other``.
SERIES_MAX_REASONS = 5


@dataclass
class TransferSeries:
    """Per-minute series of the last hour, from the transfers table (oldest bucket first).

    ``planned_per_s``: transfers created; ``done_per_s`` and ``bytes_per_s``: transfers that
    finished ``done`` and their bytes, by finish time; ``p50_s``/``p99_s``: creation-to-done
    latency of those (``None`` for a minute without one); ``failures``: failed transfers per
    minute by reason (:func:`failure_reason`).
    """

    start: datetime
    step_s: int
    planned_per_s: list[float]
    done_per_s: list[float]
    bytes_per_s: list[float]
    p50_s: list[float | None]
    p99_s: list[float | None]
    failures: dict[str, list[int]]
    rows: int
    truncated: bool

    @property
    def buckets(self) -> int:
        return len(self.planned_per_s)


_JOB_PREFIX = re.compile(r"^job \w+ rank \d+: ")
_NUMBERS = re.compile(r"\b(?:[0-9a-f]{8,}|\d+(?:\.\d+)?)\b")


def failure_reason(error: str | None) -> str:
    """A failure's reason without its particulars (ids, ranks, byte counts), for grouping.

    ``peer_restarted: ctx re-registered`` → ``peer_restarted``;
    ``job send rank 1: NIXL write timed out`` → ``NIXL write timed out``;
    ``no live worker for context rank 3`` → ``no live worker for context rank N``.
    """
    text = _JOB_PREFIX.sub("", (error or "").strip())
    if not text:
        return "unknown"
    head = text.split(":", 1)[0].strip() or text
    return _NUMBERS.sub("N", head)[:60]


def transfer_series(
    *,
    session: Session,
    now: datetime,
    window: timedelta = SERIES_WINDOW,
    buckets: int = SERIES_BUCKETS,
) -> TransferSeries:
    """The charts' data: one indexed range query on ``created_at``, bucketed here.

    Percentiles have no portable SQL (SQLite has none), so the rows of the window, four small
    columns each, are read and bucketed with numpy.
    """
    import numpy as np

    start = now - window
    step_s = window.total_seconds() / buckets
    rows = session.execute(
        select(
            TransferRow.created_at,
            TransferRow.finished_at,
            TransferRow.status,
            TransferRow.bytes,
            TransferRow.error,
        )
        .where(TransferRow.created_at >= start)
        .order_by(TransferRow.created_at.desc())
        .limit(SERIES_MAX_ROWS + 1)
    ).all()
    truncated = len(rows) > SERIES_MAX_ROWS
    rows = rows[:SERIES_MAX_ROWS]

    def bucket_of(moment: datetime | None) -> int:
        if moment is None:
            return -1
        index = int((moment - start).total_seconds() // step_s)
        return index if 0 <= index < buckets else -1

    created = np.array([bucket_of(row[0]) for row in rows], dtype=np.int64)
    finished = np.array([bucket_of(row[1]) for row in rows], dtype=np.int64)
    status = np.array([row[2] for row in rows], dtype=object)
    sizes = np.array([row[3] or 0 for row in rows], dtype=np.float64)
    latency = np.array(
        [(row[1] - row[0]).total_seconds() if row[1] is not None else np.nan for row in rows],
        dtype=np.float64,
    )

    def per_bucket(mask: Any, where: Any, weights: Any = None) -> Any:
        chosen = mask & (where >= 0)
        return np.bincount(
            where[chosen], weights=None if weights is None else weights[chosen], minlength=buckets
        )

    everything = np.ones(len(rows), dtype=bool)
    done = status == "done"
    p50: list[float | None] = [None] * buckets
    p99: list[float | None] = [None] * buckets
    done_in_window = done & (finished >= 0)
    for index in np.unique(finished[done_in_window]):
        values = latency[done_in_window & (finished == index)]
        p50[int(index)] = float(np.percentile(values, 50))
        p99[int(index)] = float(np.percentile(values, 99))

    by_reason: dict[str, Any] = {}
    for row, bucket in zip(rows, finished, strict=True):
        if row[2] == "failed" and bucket >= 0:
            counts = by_reason.setdefault(failure_reason(row[4]), np.zeros(buckets, np.int64))
            counts[bucket] += 1
    ranked = sorted(by_reason.items(), key=lambda item: (-int(item[1].sum()), item[0]))
    failures = {reason: [int(v) for v in counts] for reason, counts in ranked[:SERIES_MAX_REASONS]}
    if len(ranked) > SERIES_MAX_REASONS:
        rest = sum((counts for _, counts in ranked[SERIES_MAX_REASONS:]), np.zeros(buckets))
        failures["other"] = [int(v) for v in rest]
    return TransferSeries(
        start=start,
        step_s=int(step_s),
        planned_per_s=[float(v) / step_s for v in per_bucket(everything, created)],
        done_per_s=[float(v) / step_s for v in per_bucket(done, finished)],
        bytes_per_s=[float(v) / step_s for v in per_bucket(done, finished, sizes)],
        p50_s=p50,
        p99_s=p99,
        failures=failures,
        rows=len(rows),
        truncated=truncated,
    )
