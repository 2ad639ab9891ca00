"""The context host dies mid-transfer and comes back.

Every process of ``kvp-ctx`` (the four context ranks) is SIGKILLed while requests are on the
wire. The generation ranks fail those requests by their deadline and give every block back; the
control plane marks the dead workers ``gone`` once their heartbeats are older than
``WORKER_GONE_S``. The host returns: its engine registers the instance again (a new epoch),
pairs, and new workers attach; the next requests run and verify, on the new epoch only: the
generation side refuses anything planned with the old one.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from api.services.workers import WORKER_GONE_S
from workers.testing.engine import CONTEXT, Fleet, RunResult
from workers.testing.netbed import Bed

from .conftest import assert_clean, wait_released, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

DEADLINE_S = 15.0


def _context_workers(fleet: Fleet) -> list[dict[str, Any]]:
    assert fleet.client is not None
    return list(fleet.client.list_workers(instance=CONTEXT)["items"])


def test_context_host_dies_mid_transfer_and_comes_back(bed: Bed, make_fleet: Any) -> None:
    fleet: Fleet = make_fleet()
    assert fleet.client is not None
    old_epoch = fleet.client.get_instance(CONTEXT)["epoch"]
    old_workers = {w["id"] for w in _context_workers(fleet)}
    assert len(old_workers) == 4

    bed.rate("ctx", "40mbit")  # requests stay on the wire for seconds
    args = {
        "requests": 2,
        "blocks": 16,
        "in_flight": 2,
        "seed": 5,
        "tag": "death",
        "start_at": time.time() + 0.5,
        "verify": True,
        "timeout_s": DEADLINE_S,
    }
    answers: dict[str, Any] = {}

    def run(role: str) -> None:
        try:
            answers[role] = fleet.call_role(role, "run", **args)
        except Exception as error:  # the context ranks die mid-call
            answers[role] = error

    threads = [threading.Thread(target=run, args=(role,)) for role in ("context", "generation")]
    for thread in threads:
        thread.start()
    time.sleep(2.0)
    killed = fleet.kill_role("context")
    assert len(killed) == 4
    for thread in threads:
        thread.join(DEADLINE_S + 60)
    generation = [RunResult(**r) for r in answers["generation"]]
    for rank in generation:
        assert not rank.stalled
        assert [r[3] for r in rank.records] == ["failed", "failed"], rank.records
        for _, issued, finished, _, reason in rank.records:
            assert reason, rank.records
            # Failed by the deadline (plus the progress loop's tick), not left hanging.
            assert finished - issued < DEADLINE_S + 2.0, rank.records
        assert rank.leaked == 0  # every block back in the generation engine's cache
    bed.heal("ctx")

    # The control plane sees the heartbeats stop: gone within one WORKER_GONE_S window.
    wait_until(
        "the dead context workers are gone",
        lambda: all(
            w["status"] == "gone" for w in _context_workers(fleet) if w["id"] in old_workers
        ),
        timeout_s=WORKER_GONE_S + 10,
    )

    fleet.restart_role("context")
    new_epoch = fleet.client.get_instance(CONTEXT)["epoch"]
    assert new_epoch != old_epoch
    workers = _context_workers(fleet)
    alive = [w for w in workers if w["status"] == "alive"]
    assert len(alive) == 4
    assert {w["epoch"] for w in alive} == {new_epoch}
    assert not {w["id"] for w in alive} & old_workers
    # The new workers attached to the old ones' ranks: those are superseded (stopped), or gone.
    assert all(
        w["status"] in ("gone", "stale", "stopped") for w in workers if w["id"] in old_workers
    )

    again = fleet.run_engine(requests=4, blocks=4, in_flight=2, verify=True, timeout_s=60)
    assert_clean(again)
    wait_released(fleet)
    # What the control plane recorded of the new requests names the new epoch only.
    pairing = fleet.client.get_pairing(fleet.pairing["id"])
    assert pairing["context_epoch"] == new_epoch
    assert fleet.client is not None
    client = fleet.client

    def recorded() -> list[dict[str, Any]] | None:
        rows = [
            t
            for t in client.list_transfers(limit=200)["items"]
            if t["request_id"].startswith(again.tag)
        ]
        return rows if len(rows) == 4 and all(t["status"] == "done" for t in rows) else None

    records = wait_until("the new requests are recorded as done", recorded)
    assert {t["pairing_id"] for t in records} == {fleet.pairing["id"]}
