"""Concurrent writers: every rank of a TP8 instance reports at once; nothing is lost."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI
from fastapi.testclient import TestClient

from api.demo_fleet import instance_body, rank_body


def test_concurrent_rank_reports_all_land(app: FastAPI) -> None:
    with TestClient(app) as client:
        header = instance_body(role="context", tp=8, draft_heads=2, with_ranks=False)
        assert client.put("/v1/instances/ctx", json=header).status_code == 201

        def report(rank: int) -> int:
            # One client per thread, outside `with`: the outer client owns the app's lifespan.
            own = TestClient(app)
            try:
                body = rank_body(rank, group_size=8, draft_heads=2)
                return own.put(f"/v1/instances/ctx/ranks/{rank}", json=body).status_code
            finally:
                own.close()

        with ThreadPoolExecutor(8) as pool:
            statuses = list(pool.map(report, range(8)))
        assert statuses == [201] * 8
        final = client.get("/v1/instances/ctx").json()
        assert final["status"] == "ready"
        assert final["generation"] == 1 + 8
        assert [rank["rank"] for rank in final["ranks"]] == list(range(8))
