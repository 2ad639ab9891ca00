"""Killing the control plane while transfers are dispatched loses nothing.

A real server process and fake workers (``conftest.FakeWorker``: the real command stream and the
real ``workers.records.Recorder``, no bytes moved). Executed transfers are pushed to the
workers, which hold their parts; the server is SIGKILLed and the workers' records are posted
while it is down (the recorder retries with backoff). The server starts again on the same
database and port: every record lands exactly once, every transfer settles ``done``, the
workers' command streams reconnect by themselves and a transfer dispatched after the restart
runs too. (Real ``kvplane worker`` processes riding a control-plane outage on the engine path
are covered in ``tests/workers``; this one stays fake so it can count every record.)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from api.client import Client

from .conftest import FakeFleet, Heartbeats, Server, setup_fleet, transfer_body, wait_until

pytestmark = pytest.mark.slow

TRANSFERS = 6


def test_sigkill_mid_transfer_loses_nothing(
    db_url: str, start_server: Callable[..., Server]
) -> None:
    server = start_server(db_url)
    # Retry window: 20 retries, backoff 0.25 s doubling, capped at 2 s (tens of seconds in all).
    with Client(server.url, retries=20, backoff_s=0.25, max_backoff_s=2.0) as client:
        workers = setup_fleet(client)
        with (
            Heartbeats(server.url, list(workers.values())) as beats,
            FakeFleet(server.url, workers, hold=True) as fleet,
        ):
            fleet.wait_streams()
            run_scenario(client, server, workers, fleet)
        assert beats.refused == []


def run_scenario(
    client: Client, server: Server, workers: dict[tuple[str, int], str], fleet: FakeFleet
) -> None:
    transfer_ids = [
        client.create_transfer(transfer_body(f"r{i}", execute=True))["id"] for i in range(TRANSFERS)
    ]
    for worker in fleet:  # ctx r0, ctx r1 send; gen r0 receives: every rank takes part
        worker.wait_commands(TRANSFERS)
        assert {c["transfer_id"] for c in worker.commands} == set(transfer_ids)
    before = {t: client.get_transfer(t) for t in transfer_ids}
    assert {read["status"] for read in before.values()} == {"running"}

    server.kill()
    restarted: dict[str, float] = {}

    def restart() -> None:
        time.sleep(1.0)  # the records below are already being retried against a dead port
        restarted["at"] = time.monotonic()
        server.start()
        restarted["ready"] = time.monotonic()

    thread = threading.Thread(target=restart)
    thread.start()
    released = fleet.release()  # every worker posts its records while the server is down
    assert released == TRANSFERS * len(workers)
    thread.join()
    assert "ready" in restarted, server.log.read_text()[-2000:]

    settled_at: dict[str, float] = {}

    def all_settled() -> bool:
        for transfer_id in transfer_ids:
            if transfer_id not in settled_at and client.get_transfer(transfer_id)["status"] in (
                "done",
                "failed",
            ):
                settled_at[transfer_id] = time.monotonic()
        return len(settled_at) == len(transfer_ids)

    wait_until(all_settled, "every transfer to settle after the restart")
    recorders = [worker.recorder for worker in fleet]
    # A sender's record does not decide a transfer: it may still be backing off. It lands too.
    wait_until(lambda: all(r.pending == 0 for r in recorders), "every record to be posted")
    assert sum(r.dropped for r in recorders) == 0
    refused = sum(worker.transport.unreachable for worker in fleet)
    assert refused > 0  # the records really met the outage (and rode it)
    last_s = max(settled_at.values()) - restarted["at"]
    print(
        f"restart: server ready {restarted['ready'] - restarted['at']:.2f} s after start; "
        f"{len(transfer_ids)} transfers settled {last_s:.2f} s after the restart began "
        f"({max(settled_at.values()) - restarted['ready']:.2f} s after ready); "
        f"{refused} record posts refused (server down) and retried"
    )

    after = {t: client.get_transfer(t) for t in transfer_ids}
    assert {read["status"] for read in after.values()} == {"done"}, after
    for transfer_id, read in before.items():
        assert after[transfer_id]["routes"] == read["routes"]
        assert after[transfer_id]["bytes"] == read["bytes"]
    for transfer_id in transfer_ids:
        parts = client.list_parts(transfer_id)["items"]
        assert sorted((p["kind"], p["instance"], p["rank"], p["state"]) for p in parts) == [
            ("receive", "gen", 0, "done"),
            ("send", "ctx", 0, "done"),
            ("send", "ctx", 1, "done"),
        ]
    # A record batch whose answer was lost is sent again: accepted, counted zero times.
    replay = fleet[("gen", 0)].record(fleet[("gen", 0)].commands[0])
    assert client.record_transfers(workers[("gen", 0)], [replay]) == {"accepted": 0, "settled": []}

    # Nothing was lost: instances, pairing and workers are all there.
    assert {i["name"] for i in client.list_instances()["items"]} == {"ctx", "gen"}
    assert len(client.list_pairings()["items"]) == 1
    assert {w["id"] for w in client.list_workers()["items"]} == set(workers.values())

    # The command streams reconnected on their own: a transfer dispatched now runs.
    fleet.wait_streams(2)
    wait_until(
        lambda: all(w["connected"] for w in client.list_workers()["items"]),
        "every worker's stream to be back",
    )
    fresh = client.create_transfer(transfer_body("after-restart", execute=True))
    done = client.get_transfer(fresh["id"], wait_s=30)
    assert done["status"] == "done", done
    assert all(len(worker.commands) == TRANSFERS + 1 for worker in fleet)
    # Concurrent record batches of several workers never deadlock on the database.
    assert "deadlock detected" not in server.log.read_text()
