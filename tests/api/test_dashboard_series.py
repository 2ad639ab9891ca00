"""The dashboard's time series (``api.services.dashboard.transfer_series``) on both databases."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import insert

from api.db import Database, utcnow
from api.models import TransferRow
from api.services.dashboard import failure_reason, transfer_series
from web.charts import bar_chart, line_chart, nice_binary_ceiling, nice_ceiling, seconds


def _row(
    created: datetime,
    status: str,
    *,
    after_s: float | None = None,
    size: int = 1 << 20,
    error: str | None = None,
) -> dict[str, Any]:
    return {
        "id": uuid.uuid4().hex,
        "context_name": "ctx",
        "generation_name": "gen",
        "request_id": uuid.uuid4().hex,
        "status": status,
        "execute": True,
        "blocks": {},
        "summary": {"routes": [], "bytes": size, "fragments": 1},
        "bytes": size,
        "fragments": 1,
        "request_hash": "0" * 64,
        "error": error,
        "created_at": created,
        "updated_at": created,
        "finished_at": None if after_s is None else created + timedelta(seconds=after_s),
    }


def test_series_bucket_rates_latency_percentiles_and_failure_reasons(db_url: str) -> None:
    now = utcnow().replace(microsecond=0)
    minute_49 = now - timedelta(minutes=10, seconds=30)  # bucket 49 of 60
    rows = [
        *(_row(minute_49, "done", after_s=s) for s in (0.1, 0.2, 0.3)),
        _row(minute_49, "failed", after_s=1, error="peer_restarted: ctx re-registered"),
        _row(minute_49, "failed", after_s=2, error="job send rank 1: NIXL write timed out"),
        _row(minute_49, "failed", after_s=2, error="job send rank 0: NIXL write timed out"),
        _row(now - timedelta(seconds=20), "planned"),  # the last bucket, never finishes
        _row(now - timedelta(hours=2), "done", after_s=0.5),  # outside the window
    ]
    db = Database(db_url)
    try:
        with db.write() as session:
            session.execute(insert(TransferRow), rows)
        with db.read() as session:
            series = transfer_series(session=session, now=now)
    finally:
        db.dispose()
    assert series.buckets == 60 and series.step_s == 60 and series.rows == 7
    assert series.planned_per_s[49] == pytest.approx(6 / 60)
    assert series.planned_per_s[59] == pytest.approx(1 / 60)
    assert sum(series.planned_per_s) == pytest.approx(7 / 60)
    assert series.done_per_s[49] == pytest.approx(3 / 60) and sum(series.done_per_s) == (
        pytest.approx(3 / 60)
    )
    assert series.bytes_per_s[49] == pytest.approx(3 * (1 << 20) / 60)
    assert series.p50_s[49] == pytest.approx(0.2)
    assert series.p99_s[49] == pytest.approx(0.298)
    assert [i for i, v in enumerate(series.p50_s) if v is not None] == [49]
    assert series.failures == {
        "NIXL write timed out": [2 if i == 49 else 0 for i in range(60)],
        "peer_restarted": [1 if i == 49 else 0 for i in range(60)],
    }


def test_failure_reasons_drop_particulars() -> None:
    assert failure_reason("peer_restarted: gen re-registered") == "peer_restarted"
    assert failure_reason("job receive rank 3: NIXL write timed out") == "NIXL write timed out"
    assert failure_reason("no live worker for context rank 3") == (
        "no live worker for context rank N"
    )
    assert failure_reason("lease expired (job 9f0e2fbcc77e4bb7)") == "lease expired (job N)"
    assert failure_reason(None) == failure_reason("  ") == "unknown"


def test_chart_geometry() -> None:
    assert [nice_ceiling(v) for v in (0, 0.3, 1, 1.1, 7, 0.0451)] == [1, 0.5, 1, 2, 10, 0.05]
    assert nice_binary_ceiling(51.2 * 1024) == 100 * 1024
    assert nice_binary_ceiling(3 << 30) == 5 << 30 and nice_binary_ceiling(700) == 1000
    start = datetime(2026, 1, 1, 12, 0)
    chart = line_chart(
        "c",
        "Latency",
        start=start,
        step_s=60,
        series={"p50": [None, 0.1, 0.2, None], "p99": [None, 0.1, 0.4, None]},
        fmt=seconds,
    )
    # y from 0 to 0.5 s; None breaks the line, zero-free points carry their value.
    assert chart.y_ticks[-1][1] == "500 ms" and chart.x_ticks[-1][1] == "now"
    assert [css for css, _ in chart.segments] == ["s0", "s1"]
    assert [p.title for _, p in chart.points][-1] == "12:02–12:03 UTC · p99: 400 ms"
    assert not chart.empty and "p99 peak 400 ms" in chart.summary
    bars = bar_chart("f", "Failures", start=start, step_s=60, series={"a": [0, 2], "b": [0, 3]})
    assert [b.title for b in bars.bars] == ["12:01–12:02 UTC · a: 2", "12:01–12:02 UTC · b: 3"]
    # stacked: b sits on a, and together they reach the top of the axis (5)
    assert bars.bars[1].y + bars.bars[1].height == pytest.approx(bars.bars[0].y)
    assert bars.y_ticks[-1][1] == "5"
    empty = bar_chart("f", "Failures", start=start, step_s=60, series={})
    assert empty.empty and empty.summary == "Failures, last hour: none"
