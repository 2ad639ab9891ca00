"""Killing the control plane mid-transfer loses nothing.

A real server process, fake workers driven through ``api.client.Client``: executed transfers are
queued, one job is leased, the server is SIGKILLed and started again on the same database and port.
The worker's ``complete`` (same lease token) is sent while the server is down: the client's retry
and backoff carry it over the restart. Every transfer then finishes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from api.client import Client, ConflictError

from .conftest import Heartbeats, Server, setup_fleet, transfer_body

pytestmark = pytest.mark.slow


def finish(client: Client, workers: dict[tuple[str, int], str], transfer_ids: list[str]) -> None:
    """Claim and complete every runnable job until all transfers are done (or a deadline)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        states = {t: client.get_transfer(t)["status"] for t in transfer_ids}
        if all(state == "done" for state in states.values()):
            return
        assert "failed" not in states.values(), [
            (t["error"], client.list_jobs(transfer_id=t["id"]))
            for t in map(client.get_transfer, transfer_ids)
        ]
        for worker_id in workers.values():
            client.heartbeat(worker_id)
            lease = client.claim_job(worker_id)
            if lease is not None:
                client.complete_job(
                    lease["id"],
                    {"lease_token": lease["lease_token"], "bytes": 1, "duration_s": 0.0},
                )
    raise AssertionError(f"transfers not done: {states}")


def test_sigkill_mid_transfer_loses_nothing(
    db_url: str, start_server: Callable[..., Server]
) -> None:
    server = start_server(db_url)
    # Retry window: 20 retries, backoff 0.25 s doubling, capped at 2 s (tens of seconds in all).
    with Client(server.url, retries=20, backoff_s=0.25, max_backoff_s=2.0) as client:
        workers = setup_fleet(client)
        with Heartbeats(server.url, list(workers.values())):
            run_scenario(client, server, workers)


def run_scenario(client: Client, server: Server, workers: dict[tuple[str, int], str]) -> None:
    transfer_ids = [
        client.create_transfer(transfer_body(f"r{i}", execute=True))["id"] for i in range(3)
    ]
    lease = client.claim_job(workers[("ctx", 0)])
    assert lease is not None
    before = {t: client.get_transfer(t) for t in transfer_ids}
    assert before[lease["transfer_id"]]["status"] == "running"

    server.kill()
    restarted: dict[str, Any] = {}

    def restart() -> None:
        time.sleep(0.5)  # the completion below is already retrying against a dead port
        started = time.monotonic()
        server.start()
        restarted["after_s"] = time.monotonic() - started

    thread = threading.Thread(target=restart)
    thread.start()
    t0 = time.monotonic()
    done = client.complete_job(
        lease["id"], {"lease_token": lease["lease_token"], "bytes": 1, "duration_s": 0.0}
    )
    rode_s = time.monotonic() - t0
    thread.join()
    assert done["state"] == "done"
    assert rode_s >= 0.5  # it really waited for the restart
    print(
        f"restart: server ready {restarted['after_s']:.2f} s after start; "
        f"complete() rode {rode_s:.2f} s over the outage"
    )

    # The fenced retry of a completion that landed is refused, never counted twice.
    with pytest.raises(ConflictError):
        client.complete_job(
            lease["id"], {"lease_token": lease["lease_token"], "bytes": 1, "duration_s": 0.0}
        )
    # Nothing was lost: instances, pairing, workers, transfers and jobs are all there.
    assert {i["name"] for i in client.list_instances()["items"]} == {"ctx", "gen"}
    assert len(client.list_pairings()["items"]) == 1
    assert {w["id"] for w in client.list_workers()["items"]} == set(workers.values())
    after = {t: client.get_transfer(t) for t in transfer_ids}
    for transfer_id, read in before.items():
        assert after[transfer_id]["routes"] == read["routes"]
        assert after[transfer_id]["bytes"] == read["bytes"]
    jobs = client.list_jobs(limit=1000)
    assert {j["id"] for j in jobs if j["state"] == "done"} == {lease["id"]}

    finish(client, workers, transfer_ids)
    assert all(j["state"] == "done" for j in client.list_jobs(limit=1000))
