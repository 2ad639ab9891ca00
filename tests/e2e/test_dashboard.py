"""The dashboard in a real browser against a live server with data registered over HTTP."""

from __future__ import annotations

import re
import uuid
from datetime import timedelta
from typing import Any

import pytest
from playwright.sync_api import expect
from sqlalchemy import insert, select

from api import models, schemas
from api.db import Database, utcnow
from api.models import TransferRow
from api.services.pairings import create_pairing
from api.services.registration import register_instance
from geometry.builders import ViewSpec, instance_body
from tests.e2e.conftest import DRAFT, TARGET, LiveServer, screenshot, seed_fleet

pytestmark = pytest.mark.timeout(60)


def _stat(page: Any, name: str) -> str:
    return str(page.locator(f'[data-stat="{name}"]').inner_text()).strip()


def _route_cells(page: Any, selector: str = "svg.rank-map g.route") -> set[tuple[int, int, int]]:
    cells = page.locator(selector)
    found = set()
    for index in range(cells.count()):
        cell = cells.nth(index)
        found.add(
            (
                int(cell.get_attribute("data-sender")),
                int(cell.get_attribute("data-receiver")),
                int(cell.get_attribute("data-bytes")),
            )
        )
    assert len(found) == cells.count(), "two cells for one (sender, receiver) route"
    return found


def _plan_routes(plan: dict[str, Any]) -> set[tuple[int, int, int]]:
    return {
        (r["sender_rank"], r["receiver_rank"], r["bytes_per_block"])
        for r in plan["routes"]
        if r["bytes_per_block"] > 0
    }


def test_overview_counts_match_the_api_and_refresh_live(live_server: LiveServer, page: Any) -> None:
    page.goto(live_server.url + "/")
    expect(page.get_by_text("No instances are registered yet")).to_be_visible()
    screenshot(page, "00-overview-empty")

    seed_fleet(live_server.api)
    instances = live_server.api.get("/v1/instances").json()
    pairings = live_server.api.get("/v1/pairings").json()["items"]
    page.goto(live_server.url + "/")
    assert _stat(page, "instances-total") == str(instances["total"]) == "5"
    ready = sum(1 for item in instances["items"] if item["status"] == "ready")
    assert _stat(page, "instances-ready") == str(ready) == "4"
    assert _stat(page, "instances-incomplete") == "1"
    for status in ("compatible", "incompatible", "stale"):
        expected = sum(1 for item in pairings if item["status"] == status)
        assert _stat(page, f"pairings-{status}") == str(expected)
    assert _stat(page, "pairings-incompatible") == "1"
    screenshot(page, "01-overview")

    # htmx polls the counters: a registration shows up without a reload.
    body = instance_body(role="generation", views=[TARGET, DRAFT], tp=1)
    assert live_server.api.put("/v1/instances/gen-tp1", json=body).status_code == 201
    expect(page.locator('[data-stat="instances-total"]')).to_have_text("6", timeout=8000)


def test_instance_pages_show_every_ranks_head_geometry(live_server: LiveServer, page: Any) -> None:
    seed_fleet(live_server.api)
    page.goto(live_server.url + "/ui/instances")
    rows = page.locator("table tbody tr")
    expect(rows).to_have_count(5)
    expect(page.get_by_role("row", name=re.compile("ctx-partial"))).to_contain_text("incomplete")
    screenshot(page, "10-instances")

    page.get_by_role("link", name="ctx-tp4").click()
    expect(page.get_by_role("heading", level=1)).to_contain_text("ctx-tp4")
    views = page.locator("table.views tbody tr")
    expect(views).to_have_count(8)  # 4 ranks × (target + draft)
    # Rank 3's draft view: 2 heads over TP 4 → 1 head per rank, shard 1 of 2, replica 1 of 2.
    draft_rank3 = views.nth(7)
    expect(draft_rank3).to_contain_text("draft")
    expect(draft_rank3).to_contain_text("[1, 2)")
    expect(draft_rank3).to_contain_text("1 of 2 / 1 of 2")
    screenshot(page, "11-instance-ctx-tp4")

    page.goto(live_server.url + "/ui/instances/gen-4heads")
    target = page.locator("table.views tbody tr").first
    expect(target.locator("td.heads").nth(1)).to_have_text("4")  # total heads: 4, not 8
    screenshot(page, "12-instance-gen-4heads")


def test_instance_page_shows_its_handovers_by_peer(
    live_server: LiveServer, sqlite_url: str, page: Any
) -> None:
    seed_fleet(live_server.api)
    now = utcnow()

    def row(
        request_id: str,
        generation: str,
        status: str,
        *,
        after_s: float | None = None,
        error: str | None = None,
        age_s: float = 60,
    ) -> dict[str, Any]:
        created = now - timedelta(seconds=age_s)
        return {
            "id": uuid.uuid4().hex,
            "context_name": "ctx-tp4",
            "generation_name": generation,
            "request_id": request_id,
            "status": status,
            "execute": True,
            "blocks": {},
            "summary": {"routes": [], "bytes": 3 << 20, "fragments": 8},
            "bytes": 3 << 20,
            "fragments": 8,
            "request_hash": "0" * 64,
            "error": error,
            "created_at": created,
            "updated_at": created,
            "finished_at": None if after_s is None else created + timedelta(seconds=after_s),
        }

    db = Database(sqlite_url)
    try:
        with db.write() as session:
            session.execute(
                insert(TransferRow),
                [
                    row("h-1", "gen-tp2", "done", after_s=0.25),
                    row("h-2", "gen-tp2", "done", after_s=0.75),
                    row("h-3", "gen-tp2", "failed", after_s=2, error="generation rank 1: NIXL"),
                    row("h-4", "gen-adp", "running"),
                    row("h-old", "gen-adp", "done", after_s=0.1, age_s=7200),
                ],
            )
    finally:
        db.dispose()

    page.goto(live_server.url + "/ui/instances/ctx-tp4")
    table = page.locator("table.handovers")
    expect(table.locator("tbody tr")).to_have_count(2)
    tp2 = table.locator('tr[data-peer="gen-tp2"]')
    for column, text in {
        "total": "3",
        "done": "2",
        "failed": "1",
        "in-flight": "0",
        "bytes": "6 MiB",
        "p50": "250 ms",
        "p99": "750 ms",
    }.items():
        expect(tp2.locator(f'[data-col="{column}"]')).to_have_text(text)
    expect(table.locator('tr[data-peer="gen-adp"] [data-col="in-flight"]')).to_have_text("1")
    expect(table.locator('tfoot [data-col="total"]')).to_have_text("4")  # not the 2 h old one
    failures = page.locator("table.handover-failures tbody tr")
    expect(failures).to_have_count(1)
    expect(failures.first).to_contain_text("h-3")
    expect(failures.first).to_contain_text("generation rank 1: NIXL")
    screenshot(page, "13-instance-handovers")

    tp2.locator('[data-col="failed"] a').click()
    expect(page.locator("table tbody tr")).to_have_count(1)
    expect(page.locator("table tbody tr").first).to_contain_text("h-3")
    page.go_back()
    tp2.get_by_role("link", name="gen-tp2").click()
    expect(page.get_by_role("heading", level=1)).to_contain_text("gen-tp2")
    received = page.locator('table.handovers tr[data-peer="ctx-tp4"]')
    expect(received.locator('[data-col="total"]')).to_have_text("3")

    page.goto(live_server.url + "/ui/instances/gen-4heads")
    expect(page.locator("main")).to_contain_text("No handovers in the last hour")
    expect(page.locator("table.handovers")).to_have_count(0)


def test_incompatible_pairing_lists_its_error_codes(live_server: LiveServer, page: Any) -> None:
    fleet = seed_fleet(live_server.api)
    page.goto(live_server.url + "/ui/pairings")
    expect(page.locator("table tbody tr")).to_have_count(3)
    screenshot(page, "20-pairings")

    api_errors = live_server.api.get(f"/v1/pairings/{fleet.incompatible}").json()["errors"]
    page.goto(live_server.url + f"/ui/pairings/{fleet.incompatible}")
    for code in {error["code"] for error in api_errors}:
        group = page.locator(f"#error-{code}")
        expect(group).to_be_visible()
        expect(group.locator("caption")).to_contain_text(code)
    group = page.locator("#error-head_count_mismatch")
    expect(group).to_contain_text("total_kv_heads")
    expect(group).to_contain_text("4 / 8")
    expect(page.locator("svg.rank-map")).to_have_count(0)
    screenshot(page, "21-pairing-incompatible")

    page.goto(live_server.url + "/ui/compatibility")
    matrix = page.locator("table.matrix")
    expect(matrix.get_by_role("row", name=re.compile("ctx-tp4"))).to_contain_text("incompatible")
    expect(matrix.get_by_role("row", name=re.compile("ctx-partial"))).to_contain_text("not paired")
    screenshot(page, "22-compatibility")


def test_rank_map_has_one_cell_per_route_with_bytes(live_server: LiveServer, page: Any) -> None:
    fleet = seed_fleet(live_server.api)
    plan = live_server.api.get(f"/v1/pairings/{fleet.compatible}/plan").json()
    page.goto(live_server.url + f"/ui/pairings/{fleet.compatible}")
    assert _route_cells(page) == _plan_routes(plan)
    # The hover title names the views and head ranges of the route's slices.
    title = page.locator('svg.rank-map g.route[data-sender="1"][data-receiver="0"] > title')
    expect(title).to_contain_text("target[key,value]")
    expect(title).to_contain_text("heads [2, 4)")
    screenshot(page, "23-pairing-compatible")

    # Head slices of receiver rank 1: senders 2 and 3 fill the target, sender 2 the draft.
    page.get_by_label("Receiver rank", exact=True).select_option("1")
    page.get_by_role("button", name="Show", exact=True).click()
    expect(page.get_by_role("heading", name="Head slices of receiver rank 1")).to_be_visible()
    expected = {route["sender_rank"] for route in plan["routes"] if route["receiver_rank"] == 1}
    bars = page.locator("svg.head-slices g.slice")
    senders = {int(bars.nth(i).get_attribute("data-sender")) for i in range(bars.count())}
    assert senders == expected == {2, 3}
    expect(page.locator("svg.head-slices")).to_contain_text("rank 3: [6, 8)")
    screenshot(page, "24-pairing-head-slices")


def test_attention_dp_form_picks_the_plan(live_server: LiveServer, page: Any) -> None:
    fleet = seed_fleet(live_server.api)
    page.goto(live_server.url + f"/ui/pairings/{fleet.attention_dp}")
    page.get_by_label("Generation DP rank", exact=True).select_option("1")
    page.get_by_role("button", name="Show plan").click()
    expect(page).to_have_url(re.compile("generation_dp_rank=1"))
    plan = live_server.api.get(
        f"/v1/pairings/{fleet.attention_dp}/plan", params={"generation_dp_rank": 1}
    ).json()
    cells = _route_cells(page)
    assert cells == _plan_routes(plan)
    assert {receiver for _, receiver, _ in cells} == {1}
    screenshot(page, "25-pairing-attention-dp")


def test_revalidate_clears_a_stale_pairing(live_server: LiveServer, page: Any) -> None:
    fleet = seed_fleet(live_server.api)
    body = instance_body(role="generation", views=[TARGET, DRAFT], tp=2, model="m", num_slots=32)
    assert live_server.api.put("/v1/instances/gen-tp2", json=body).status_code == 200
    page.goto(live_server.url + f"/ui/pairings/{fleet.compatible}")
    expect(page.locator("h1 .badge")).to_have_text("stale")
    page.get_by_role("link", name="Re-validate…").click()
    screenshot(page, "26-confirm-revalidate")
    page.get_by_role("button", name="Re-validate").click()
    expect(page.get_by_role("status")).to_contain_text("re-validated")
    expect(page.locator("h1 .badge")).to_have_text("compatible")
    assert live_server.api.get(f"/v1/pairings/{fleet.compatible}").json()["status"] == (
        "compatible"
    )
    expect(page.locator("svg.rank-map g.route")).to_have_count(4)


def test_deregister_removes_the_instance(live_server: LiveServer, page: Any) -> None:
    seed_fleet(live_server.api)
    page.goto(live_server.url + "/ui/instances/gen-4heads")
    page.get_by_role("link", name="Deregister…").click()
    expect(page.get_by_role("heading", level=1)).to_have_text("Deregister gen-4heads?")
    expect(page.locator("main")).to_contain_text("1 pairing(s)")
    page.get_by_role("button", name="Deregister").click()
    expect(page.get_by_role("status")).to_contain_text("Instance deregistered")
    expect(page.get_by_role("link", name="gen-4heads")).to_have_count(0)
    assert live_server.api.get("/v1/instances/gen-4heads").status_code == 404
    assert live_server.api.get("/v1/pairings").json()["total"] == 2

    # A forged cross-site post is refused.
    forged = live_server.api.post(
        "/ui/instances/gen-tp2/deregister",
        content="confirm=yes",
        headers={
            "content-type": "application/x-www-form-urlencoded",
            "origin": "http://evil.example",
        },
    )
    assert forged.status_code == 403
    assert live_server.api.get("/v1/instances/gen-tp2").status_code == 200


def test_every_page_reads_without_javascript(live_server: LiveServer, page_no_js: Any) -> None:
    fleet = seed_fleet(live_server.api)
    transfer = live_server.api.post(
        "/v1/transfers",
        json={
            "context": "ctx-tp4",
            "generation": "gen-tp2",
            "request_id": "req-0001",
            "blocks": {"0": {"context": [3, 4, 5, 6], "generation": [10, 11, 12, 13]}},
            "execute": False,
        },
    )
    assert transfer.status_code == 201, transfer.text
    transfer_id = transfer.json()["id"]
    page = page_no_js
    pages = {
        "30-nojs-overview": ("/", "Instances"),
        "31-nojs-pairing": (f"/ui/pairings/{fleet.compatible}", "Rank map"),
        "32-transfers": ("/ui/transfers", "req-0001"),
        "33-transfer": (f"/ui/transfers/{transfer_id}", "Routes"),
        "34-workers": ("/ui/workers", "Workers"),
        "35-not-found": ("/ui/instances/nope", "is not registered"),
    }
    for name, (path, text) in pages.items():
        response = page.goto(live_server.url + path)
        assert response is not None
        assert response.status == (404 if "nope" in path else 200), path
        expect(page.locator("main")).to_contain_text(text)
        screenshot(page, name)
    page.goto(live_server.url + "/ui/transfers")
    row = page.locator("table tbody tr").first
    expect(row).to_contain_text("planned")
    expect(row).to_contain_text(str(transfer.json()["fragments"]))


def test_large_fleet_pages_are_paginated(
    live_server: LiveServer, sqlite_url: str, page: Any
) -> None:
    """200 instances, 100 pairings and 10,000 transfers: every list shows one page of them."""
    db = Database(sqlite_url)
    try:
        with db.write() as session:
            small = [ViewSpec("target", layers=2, kv_heads=8, head_dim=64)]
            for index in range(100):
                for role, tp in (("context", 4), ("generation", 2)):
                    body = schemas.InstanceCreate.model_validate(
                        instance_body(role=role, views=small, tp=tp, num_slots=8)
                    )
                    register_instance(session=session, name=f"{role[:3]}-{index:03d}", body=body)
            for index in range(100):
                create_pairing(
                    session=session, context=f"con-{index:03d}", generation=f"gen-{index:03d}"
                )
        now = utcnow()
        rows = [
            {
                "id": uuid.uuid4().hex,
                "context_name": f"con-{i % 100:03d}",
                "generation_name": f"gen-{i % 100:03d}",
                "request_id": f"bulk-{i:05d}",
                "status": ("done", "failed", "planned", "queued")[i % 4],
                "execute": False,
                "blocks": {},
                "summary": {"routes": [], "bytes": 4096, "fragments": 8},
                "bytes": 4096,
                "fragments": 8,
                "request_hash": "0" * 64,
                "created_at": now,
                "updated_at": now,
            }
            for i in range(10_000)
        ]
        with db.write() as session:
            session.execute(insert(TransferRow), rows)
    finally:
        db.dispose()

    page.goto(live_server.url + "/")
    assert _stat(page, "instances-total") == "200"
    assert _stat(page, "transfers-total") == "10000"
    assert _stat(page, "transfers-failed-hour") == "2500"
    page.goto(live_server.url + "/ui/transfers")
    expect(page.locator("table tbody tr")).to_have_count(50)
    expect(page.locator("main")).to_contain_text("page 1 of 200 (10000 in all)")
    page.get_by_role("link", name="next →").click()
    expect(page.locator("main")).to_contain_text("page 2 of 200")
    screenshot(page, "40-transfers-10k")
    page.goto(live_server.url + "/ui/instances?role=context")
    expect(page.locator("table tbody tr")).to_have_count(50)
    expect(page.locator("main")).to_contain_text("page 1 of 2 (100 in all)")
    page.goto(live_server.url + "/ui/compatibility")
    expect(page.locator("table.matrix tbody tr")).to_have_count(20)
    expect(page.locator("table.matrix thead th")).to_have_count(12)
    expect(page.locator("table.matrix td.cell-compatible")).to_have_count(12)
    screenshot(page, "41-compatibility-200")


def test_workers_and_parts_of_a_failed_transfer(
    live_server: LiveServer, sqlite_url: str, page: Any
) -> None:
    """Workers (alive and gone) and the recorded parts of a failed transfer."""
    seed_fleet(live_server.api)
    transfer = live_server.api.post(
        "/v1/transfers",
        json={
            "context": "ctx-tp4",
            "generation": "gen-tp2",
            "request_id": "req-failed",
            "blocks": {"0": {"context": [1, 2], "generation": [7, 8]}},
            "execute": False,
        },
    ).json()
    db = Database(sqlite_url)
    now = utcnow()
    try:
        with db.write() as session:
            ctx = session.scalars(
                select(models.InstanceRow).where(models.InstanceRow.name == "ctx-tp4")
            ).one()
            row = session.get(TransferRow, transfer["id"])
            assert row is not None
            row.status, row.execute, row.attempt = "failed", True, 1
            row.started_at, row.finished_at = now - timedelta(seconds=2), now
            row.error = "job send rank 1: NIXL write timed out"
            workers = []
            # Ranks 0-2 alive, rank 3 silent for 10 minutes (gone), and a retired worker of
            # rank 0 (stopped: it left on purpose, which the overview must not call gone).
            for rank in range(5):
                worker = models.WorkerRow(
                    id=f"worker-{rank}",
                    instance_id=ctx.id,
                    rank=rank % 4,
                    epoch=ctx.epoch,
                    device=f"cuda:{rank}",
                    stopped=rank == 4,
                    transport="nixl",
                    agent=f"agent-{rank}",
                    peer={},
                    host="node-a",
                    pid=4000 + rank,
                    heartbeat_at=now - timedelta(seconds=1 if rank < 3 else 600),
                )
                session.add(worker)
                workers.append(worker)
            for rank, state in ((0, "done"), (1, "failed"), (2, "done"), (3, "done")):
                session.add(
                    models.JobRow(
                        id=f"job-{rank}",
                        transfer_id=transfer["id"],
                        kind="send",
                        instance_id=ctx.id,
                        rank=rank,
                        epoch=ctx.epoch,
                        state=state,
                        attempt=1,
                        claims=0,
                        worker_id=f"worker-{rank}",
                        finished_at=now,
                        payload={},
                        result={"bytes": 1 << 20, "duration_s": 0.004} if state == "done" else None,
                        error="NIXL write timed out" if state == "failed" else None,
                    )
                )
    finally:
        db.dispose()

    page.goto(live_server.url + "/")
    assert _stat(page, "workers-total") == "5"
    assert _stat(page, "workers-alive") == "3"
    assert _stat(page, "workers-gone") == "1"
    assert _stat(page, "workers-stopped") == "1"
    assert _stat(page, "workers-stale") == "0"
    # The same counts as the API's own statuses.
    api_statuses = [w["status"] for w in live_server.api.get("/v1/workers").json()["items"]]
    assert sorted(api_statuses) == ["alive", "alive", "alive", "gone", "stopped"]
    assert _stat(page, "transfers-failed-hour") == "1"
    page.goto(live_server.url + "/ui/workers")
    expect(page.locator("table tbody tr")).to_have_count(5)
    expect(page.get_by_role("row", name=re.compile("cuda:3"))).to_contain_text("gone")
    expect(page.get_by_role("row", name=re.compile("cuda:4"))).to_contain_text("stopped")
    expect(page.get_by_role("row", name=re.compile("cuda:2"))).to_contain_text("alive")
    screenshot(page, "50-workers")

    page.goto(live_server.url + "/ui/transfers")
    expect(page.locator("table tbody tr").first).to_contain_text("NIXL write timed out")
    page.goto(live_server.url + f"/ui/transfers/{transfer['id']}")
    jobs = page.locator("table", has_text="Each rank's part of this transfer").locator("tbody tr")
    expect(jobs).to_have_count(4)
    failed = jobs.filter(has_text="job-1")
    expect(failed).to_contain_text("failed")
    expect(failed).to_contain_text("NIXL write timed out")
    expect(jobs.filter(has_text="job-0")).to_contain_text("1 MiB")
    screenshot(page, "51-transfer-failed")

    # Retry needs a live worker on every rank: the refusal names the missing ones.
    page.get_by_role("link", name="Retry…").click()
    page.get_by_role("button", name="Retry").click()
    expect(page.get_by_role("heading", level=1)).to_have_text("Not retried")
    expect(page.locator("main")).to_contain_text("no live worker for context rank 3")
    screenshot(page, "52-retry-refused")
    assert live_server.api.get(f"/v1/transfers/{transfer['id']}").json()["status"] == "failed"
