"""Two ``kvplane serve`` processes on one PostgreSQL database.

The workers hold their command streams on process A (and heartbeat and record there); a router
posts ``POST /v1/transfers`` with ``execute=true`` to process B. B has no stream of those
workers: it relays the commands through ``LISTEN``/``NOTIFY`` (``api/dispatch.py``,
``PostgresRelay``), A pushes them into the streams, the workers' records settle the transfers on
A, and a ``GET ?wait=`` long-poll on B wakes (A's records route notifies every process of what
it settled; B would also re-read once a second). Also the mixed case: one worker's stream on each
process.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

import pytest

from api.client import Client

from .conftest import FakeFleet, Heartbeats, TwoProcesses, transfer_body

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

TRANSFERS = 10


def test_commands_cross_processes_through_the_relay(two_processes: TwoProcesses) -> None:
    two = two_processes
    a, on_a, on_b, workers = two.a, two.on_a, two.on_b, two.workers
    with Heartbeats(a.url, list(workers.values())), FakeFleet(a.url, workers) as fleet:
        fleet.wait_streams()
        assert all(w["connected"] for w in on_a.list_workers()["items"])
        assert not any(w["connected"] for w in on_b.list_workers()["items"])
        waits = []
        for i in range(TRANSFERS):
            started = time.monotonic()
            transfer = on_b.create_transfer(transfer_body(f"r{i}", execute=True))
            done = on_b.get_transfer(transfer["id"], wait_s=30)
            waits.append(time.monotonic() - started)
            assert done["status"] == "done", done
            assert on_a.get_transfer(transfer["id"])["status"] == "done"
        # Every command crossed exactly once (none lost, none delivered twice).
        assert {len(worker.commands) for worker in fleet} == {TRANSFERS}
        # The receiver's part settles it; the senders' parts follow in their batches (up to a
        # second behind, more on a loaded machine).
        deadline = time.monotonic() + 15
        while True:
            parts = on_b.list_parts(transfer["id"])["items"]
            if len(parts) >= 3 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert sorted((p["kind"], p["rank"]) for p in parts) == [
            ("receive", 0),
            ("send", 0),
            ("send", 1),
        ]
    print(
        f"relay: {TRANSFERS} transfers posted on B, streams and records on A: POST + "
        f"?wait on B p50 {statistics.median(waits) * 1000:.0f} ms, "
        f"max {max(waits) * 1000:.0f} ms"
    )


def test_a_transfer_split_over_two_processes_settles(two_processes: TwoProcesses) -> None:
    two = two_processes
    a, b, on_a, on_b, workers = two.a, two.b, two.on_a, two.on_b, two.workers
    # The senders stream from A, the receiver from B; each records where it streams.
    senders = {k: v for k, v in workers.items() if k[0] == "ctx"}
    receivers = {k: v for k, v in workers.items() if k[0] == "gen"}
    with (
        Heartbeats(a.url, list(workers.values())),
        FakeFleet(a.url, senders) as on_a_fleet,
        FakeFleet(b.url, receivers) as on_b_fleet,
    ):
        on_a_fleet.wait_streams()
        on_b_fleet.wait_streams()
        results: dict[str, Any] = {}
        for name, client in (("a", on_a), ("b", on_b)):
            transfer = client.create_transfer(transfer_body(f"via-{name}", execute=True))

            # A waiter on each process.
            def wait(client: Client, key: str, transfer_id: str = transfer["id"]) -> None:
                results[key] = client.get_transfer(transfer_id, wait_s=30)

            waiters = [
                threading.Thread(target=wait, args=(c, f"{name}-{n}"))
                for n, c in (("a", on_a), ("b", on_b))
            ]
            for waiter in waiters:
                waiter.start()
            for waiter in waiters:
                waiter.join(60)
        assert sorted(results) == ["a-a", "a-b", "b-a", "b-b"]
        assert {r["status"] for r in results.values()} == {"done"}, results
        assert {len(w.commands) for w in [*on_a_fleet, *on_b_fleet]} == {2}
