"""The last hour's transfer charts (server-side SVG) on the overview and transfers pages."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from playwright.sync_api import expect
from sqlalchemy import insert

from api.db import Database, utcnow
from api.models import TransferRow
from tests.api.test_dashboard_series import _row
from tests.e2e.conftest import LiveServer, screenshot

pytestmark = pytest.mark.timeout(60)

CHARTS = ("chart-rate", "chart-bytes", "chart-latency", "chart-failures")


def _titles(page: Any, chart: str, what: str) -> list[str]:
    return [str(text) for text in page.locator(f"#{chart} svg {what} > title").all_text_contents()]


def test_charts_show_the_last_hour(page: Any, live_server: LiveServer, sqlite_url: str) -> None:
    page.goto(live_server.url + "/")
    for chart in CHARTS:  # a fresh fleet: every chart is there, and says it is empty
        expect(page.locator(f"#{chart}")).to_have_attribute("data-empty", "yes")
    expect(page.locator("#chart-latency")).to_contain_text("nothing in the last hour")

    seeded = utcnow() - timedelta(minutes=10, seconds=30)
    rows = [
        *(_row(seeded, "done", after_s=s) for s in (0.1, 0.2, 0.3)),
        _row(seeded, "failed", after_s=1, error="peer_restarted: ctx re-registered"),
        _row(seeded, "failed", after_s=2, error="job send rank 1: NIXL write timed out"),
    ]
    db = Database(sqlite_url)
    try:
        with db.write() as session:
            session.execute(insert(TransferRow), rows)
    finally:
        db.dispose()

    for path in ("/", "/ui/transfers"):
        page.goto(live_server.url + path)
        for chart in CHARTS:
            expect(page.locator(f"#{chart}")).to_have_attribute("data-empty", "no")
            expect(page.locator(f"#{chart} svg")).to_have_attribute("role", "img")
        # One minute holds everything: its hover titles give the numbers.
        assert [t.split(" · ")[1] for t in _titles(page, "chart-rate", "circle")] == [
            "planned: 0.0833/s",
            "done: 0.05/s",
        ]
        assert [t.split(" · ")[1] for t in _titles(page, "chart-bytes", "circle")] == [
            "moved: 51.2 KiB/s"
        ]
        assert [t.split(" · ")[1] for t in _titles(page, "chart-latency", "circle")] == [
            "p50: 200 ms",
            "p99: 298 ms",
        ]
        assert sorted(t.split(" · ")[1] for t in _titles(page, "chart-failures", "rect")) == [
            "NIXL write timed out: 1",
            "peer_restarted: 1",
        ]
        legend = page.locator("#chart-failures .legend li").all_text_contents()
        assert sorted(legend) == ["NIXL write timed out", "peer_restarted"]
        summary = page.locator("#chart-latency svg").get_attribute("aria-label")
        assert summary == (
            "Handover latency (created → done), last hour: p50 peak 200 ms; p99 peak 298 ms"
        )
        screenshot(page, f"70-charts{path.replace('/', '-')}")
