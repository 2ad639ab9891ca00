"""The instance page's handovers (and ``GET /v1/instances/{name}/handovers``) on both databases.

Everything is driven through the API as engines drive it: instances register, workers attach,
and each rank's worker records its part of an engine-path handover (``POST
/v1/transfers/records``, no transfer id); the control plane's clock is injected, so every
handover's latency (creation → done) is known to the millisecond.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from html.parser import HTMLParser

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from api.db import utcnow
from api.demo_fleet import fake_peer
from geometry.builders import ViewSpec, instance_body
from web.format import duration, human_bytes

VIEWS = [ViewSpec("target", layers=2, kv_heads=4, head_dim=8)]
BLOCKS = {"0": {"context": [0, 1, 2, 3], "generation": [4, 5, 6, 7]}}


class Clock:
    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


class Fleet:
    """ctx-a (TP2) paired with gen-a and gen-b (TP1), a worker on every rank; ctx-idle alone."""

    def __init__(self, api: TestClient, clock: Clock) -> None:
        self.api, self.clock = api, clock
        self.workers: dict[tuple[str, int], str] = {}
        bodies = {
            "ctx-a": instance_body(role="context", views=VIEWS, tp=2, tokens_per_block=4),
            "gen-a": instance_body(role="generation", views=VIEWS, tokens_per_block=4),
            "gen-b": instance_body(role="generation", views=VIEWS, tokens_per_block=4),
            "ctx-idle": instance_body(role="context", views=VIEWS, tokens_per_block=4),
        }
        for name, body in bodies.items():
            assert api.put(f"/v1/instances/{name}", json=body).status_code == 201
            for rank in body["ranks"]:
                answer = api.post(
                    "/v1/workers",
                    json={
                        "instance": name,
                        "rank": rank["rank"],
                        "peer": fake_peer(rank, f"{name}.r{rank['rank']}"),
                    },
                )
                assert answer.status_code == 201, answer.text
                self.workers[(name, rank["rank"])] = answer.json()["id"]
        self.pairings = {}
        for generation in ("gen-a", "gen-b"):
            answer = api.post("/v1/pairings", json={"context": "ctx-a", "generation": generation})
            assert answer.json()["compatible"], answer.text
            self.pairings[generation] = answer.json()["id"]
        self.epochs = {name: api.get(f"/v1/instances/{name}").json()["epoch"] for name in bodies}

    def record(
        self,
        generation: str,
        request_id: str,
        side: str,
        rank: int,
        started: datetime,
        *,
        error: str | None = None,
    ) -> None:
        """One rank's part of an engine-path handover ctx-a → ``generation``, recorded at the
        clock's time; ``error`` fails it."""
        instance = "ctx-a" if side == "send" else generation
        record = {
            "request_id": request_id,
            "pairing_id": self.pairings[generation],
            "context": "ctx-a",
            "generation": generation,
            "context_epoch": self.epochs["ctx-a"],
            "generation_epoch": self.epochs[generation],
            "side": side,
            "rank": rank,
            "status": "failed" if error else "done",
            "error": error,
            "bytes": 1,
            "started_at": started.timestamp(),
            "finished_at": self.clock.now.timestamp(),
            "blocks": BLOCKS,
        }
        answer = self.api.post(
            "/v1/transfers/records",
            json={"worker_id": self.workers[(instance, rank)], "records": [record]},
        )
        assert answer.status_code == 200, answer.text

    def handover(
        self,
        generation: str,
        request_id: str,
        started: datetime,
        latency_s: float,
        *,
        outcome: str = "done",
        error: str | None = None,
    ) -> None:
        """Both senders' parts, then the receiver's, ``latency_s`` after ``started``: ``done``,
        ``failed`` (the receiver's part failed with ``error``) or ``running`` (no receiver)."""
        self.clock.now = started + timedelta(seconds=latency_s)
        for rank in (0, 1):
            self.record(generation, request_id, "send", rank, started)
        if outcome != "running":
            self.record(generation, request_id, "receive", 0, started, error=error)


class Cells(HTMLParser):
    """The cells of every ``<tr data-peer>`` of one table: ``{peer: {data-col: text}}``."""

    def __init__(self, table_class: str) -> None:
        super().__init__()
        self.table_class = table_class
        self.rows: dict[str, dict[str, str]] = {}
        self._in_table = False
        self._row: dict[str, str] | None = None
        self._col: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "table" and found.get("class") == self.table_class:
            self._in_table = True
        elif self._in_table and tag == "tr" and "data-peer" in found:
            self._row = self.rows.setdefault(found["data-peer"] or "", {})
        elif self._row is not None and tag == "td" and found.get("data-col"):
            self._col = found["data-col"]
            self._row[self._col] = ""

    def handle_endtag(self, tag: str) -> None:
        if tag == "table":
            self._in_table = False
        elif tag == "tr":
            self._row = None
        elif tag == "td":
            self._col = None

    def handle_data(self, data: str) -> None:
        if self._row is not None and self._col is not None:
            self._row[self._col] += data.strip()


def handover_rows(html: str) -> dict[str, dict[str, str]]:
    """The handovers table of an instance page: per peer (``""``: every peer), per column."""
    parser = Cells("handovers")
    parser.feed(html)
    return parser.rows


@pytest.fixture
def clock() -> Clock:
    # A whole second: SQLite's date arithmetic is exact to the millisecond.
    return Clock(utcnow().replace(microsecond=0) - timedelta(minutes=10))


@pytest.fixture
def api(make_app: Callable[..., FastAPI], clock: Clock) -> Iterator[TestClient]:
    app = make_app()
    app.state.clock = clock
    with TestClient(app) as client:
        yield client


def test_the_instance_page_counts_handovers_per_peer_and_outcome(
    api: TestClient, clock: Clock
) -> None:
    fleet = Fleet(api, clock)
    base = clock.now
    # Before the window (created 2 h ago): counted nowhere.
    fleet.handover("gen-b", "old", base - timedelta(hours=2), 0.5)
    fleet.handover("gen-a", "a1", base, 0.2)
    fleet.handover("gen-a", "a2", base + timedelta(seconds=1), 0.4)
    fleet.handover(
        "gen-a", "a3", base + timedelta(seconds=2), 0.3, outcome="failed", error="UCX timed out"
    )
    fleet.handover("gen-a", "a4", base + timedelta(seconds=3), 0.1, outcome="running")
    fleet.handover("gen-b", "b1", base + timedelta(seconds=4), 1.0)
    fleet.handover(
        "gen-b", "b2", base + timedelta(seconds=5), 0.6, outcome="failed", error="peer_restarted"
    )
    clock.now = base + timedelta(seconds=10)

    listed = api.get("/v1/transfers", params={"context": "ctx-a", "limit": 100}).json()["items"]
    assert {t["request_id"]: t["status"] for t in listed} == {
        "old": "done",
        "a1": "done",
        "a2": "done",
        "a3": "failed",
        "a4": "running",
        "b1": "done",
        "b2": "failed",
    }
    moved = {
        generation: sum(
            t["bytes"]
            for t in listed
            if t["generation"] == generation and t["status"] == "done" and t["request_id"] != "old"
        )
        for generation in ("gen-a", "gen-b")
    }
    assert moved["gen-a"] > 0 and moved["gen-b"] > 0

    page = api.get("/ui/instances/ctx-a")
    assert page.status_code == 200, page.text
    rows = handover_rows(page.text)
    assert rows["gen-a"] == {
        "total": "4",
        "done": "2",
        "failed": "1",
        "in-flight": "1",
        "planned": "0",
        "bytes": human_bytes(moved["gen-a"]),
        "p50": "200 ms",  # nearest rank of [0.2, 0.4]
        "p99": "400 ms",
    }
    assert rows["gen-b"] == {
        "total": "2",
        "done": "1",
        "failed": "1",
        "in-flight": "0",
        "planned": "0",
        "bytes": human_bytes(moved["gen-b"]),
        "p50": "1 s",
        "p99": "1 s",
    }
    assert rows[""] == {  # every peer: [0.2, 0.4, 1.0]
        "total": "6",
        "done": "3",
        "failed": "2",
        "in-flight": "1",
        "planned": "0",
        "bytes": human_bytes(moved["gen-a"] + moved["gen-b"]),
        "p50": "400 ms",
        "p99": "1 s",
    }
    # Peers link to their pages and pairings; counts to the transfers they count.
    text = page.text
    assert f'href="/ui/pairings/{fleet.pairings["gen-a"]}"' in text
    assert 'href="/ui/instances/gen-b"' in text
    assert 'href="/ui/transfers?context=ctx-a&amp;generation=gen-a&amp;status=failed"' in text
    # The latest failures, newest first, with their reasons and links to the transfers.
    failures = text[text.index('id="handover-failures"') :]
    assert failures.index(">b2</a>") < failures.index(">a3</a>")
    assert "generation rank 0: peer_restarted" in failures
    assert "generation rank 0: UCX timed out" in failures
    ids = {t["request_id"]: t["id"] for t in listed}
    assert f'href="/ui/transfers/{ids["a3"]}"' in failures

    # The link from the failed count lists exactly that handover.
    failed = api.get(
        "/ui/transfers", params={"context": "ctx-a", "generation": "gen-a", "status": "failed"}
    )
    assert failed.status_code == 200
    assert ">a3</a>" in failed.text and ">a1</a>" not in failed.text
    assert "Only transfers from" in failed.text

    # The receiving side sees the same handovers from its end.
    rows = handover_rows(api.get("/ui/instances/gen-a").text)
    assert list(rows) == ["ctx-a"]  # one peer: no total row
    assert rows["ctx-a"]["total"] == "4" and rows["ctx-a"]["failed"] == "1"

    # The JSON counterpart holds the same numbers.
    read = api.get("/v1/instances/ctx-a/handovers")
    assert read.status_code == 200, read.text
    body = read.json()
    assert body["role"] == "context" and body["window_s"] == 3600
    by_peer = {p["peer"]: p for p in body["peers"]}
    assert {k: by_peer["gen-a"][k] for k in ("total", "done", "failed", "running", "queued")} == {
        "total": 4,
        "done": 2,
        "failed": 1,
        "running": 1,
        "queued": 0,
    }
    assert by_peer["gen-a"]["bytes_moved"] == moved["gen-a"]
    assert by_peer["gen-a"]["p50_s"] == pytest.approx(0.2, abs=1e-3)
    assert by_peer["gen-b"]["pairing_id"] == fleet.pairings["gen-b"]
    assert body["total"]["p99_s"] == pytest.approx(1.0, abs=1e-3)
    assert [f["request_id"] for f in body["failures"]] == ["b2", "a3"]


def test_an_instance_without_handovers_says_so(api: TestClient, clock: Clock) -> None:
    fleet = Fleet(api, clock)
    fleet.handover("gen-a", "a1", clock.now, 0.2)
    for name in ("ctx-idle", "gen-b"):
        page = api.get(f"/ui/instances/{name}")
        assert page.status_code == 200
        assert "No handovers in the last hour" in page.text
        assert 'class="handovers"' not in page.text
    body = api.get("/v1/instances/ctx-idle/handovers").json()
    assert body["peers"] == [] and body["failures"] == []
    assert body["total"]["total"] == 0 and body["total"]["p50_s"] is None
    assert api.get("/v1/instances/nobody/handovers").status_code == 404


def test_latencies_read_in_milliseconds_below_a_second() -> None:
    assert [duration(s) for s in (0.0123, 0.2, 0.9994, 0.99996, 1.0, 12.5)] == [
        "12.3 ms",
        "200 ms",
        "999 ms",
        "1 s",
        "1 s",
        "12.5 s",
    ]
