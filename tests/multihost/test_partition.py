"""A long cut of the data network: transfers fail on time, with the peer named, and heal.

The demo fleet across the bed with its data plane pinned to the data NIC (``--ucx-net-devices
data0``), so the control plane keeps hearing every worker while the data network is cut. The
context host's data link is cut for 12 s; requests with a 3 s deadline start 0.5 s before the
cut (their bytes on a slow wire), at the cut and 6 s into it. Every one of them must end
``failed`` on every rank within its deadline + 1 s, with a reason that names the peer (but a
sender whose share of the first request left whole before the cut): a rank
whose connection failed reloads the peer off its progress thread (probing it with an agent of
its own), so nothing blocks the handles that could fail meanwhile. After the heal every transfer
succeeds between the same processes, and no worker died. Three cuts in a row: every rank still
alive at the end, no handle pending, every staging grant returned.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from workers.testing.engine import CONTEXT, GENERATION, Fleet
from workers.testing.netbed import Bed

from .conftest import Background, assert_clean, wait_released, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SLOW_LINK = "40mbit"  # 5 MB/s: a 16-block request (about 9 MB) is on the wire for ~2 s
DEADLINE_S = 3.0
CUT_S = 12.0
CUT_AT = 1.0  # seconds after the run's start
ARRIVALS = [0.5, 1.0, 7.0]  # before the cut, at it, 6 s into it


CYCLES = 3


def test_three_12_s_cuts_fail_every_transfer_by_its_deadline_naming_the_peer_then_heal(
    bed: Bed, make_fleet: Callable[..., Fleet]
) -> None:
    fleet = make_fleet(ucx_net_devices="data0")
    assert_clean(fleet.run_engine(requests=4, blocks=4, in_flight=2, verify=True, timeout_s=30))
    pids = fleet.pids()["ranks"]
    for cycle in range(CYCLES):
        _cut_and_heal(bed, fleet, f"cut{cycle}")
        # After the heal: the same processes, every worker alive, no handle pending, every
        # staging byte back, and every transfer succeeds.
        wait_released(fleet)
        again = fleet.run_engine(requests=6, blocks=4, in_flight=2, verify=True, timeout_s=30)
        assert_clean(again)
        assert fleet.pids()["ranks"] == pids, f"cycle {cycle}: a rank restarted"
        assert all(process.is_alive() for _, process, _ in fleet.ranks), f"cycle {cycle}"
        assert fleet.client is not None
        workers = fleet.client.list_workers()["items"]
        assert sum(1 for w in workers if w["status"] == "alive") == len(pids), f"cycle {cycle}"
    wait_released(fleet)


def _cut_and_heal(bed: Bed, fleet: Fleet, tag: str) -> None:
    bed.rate("ctx", SLOW_LINK)
    start = time.time() + 1.0
    run = Background(
        fleet,
        requests=len(ARRIVALS),
        blocks=16,
        in_flight=len(ARRIVALS),
        verify=True,
        timeout_s=DEADLINE_S,
        at=ARRIVALS,
        tag=tag,
        start_delay_s=start - time.time(),
    )
    time.sleep(max(0.0, start + CUT_AT - time.time()))
    bed.partition("ctx")
    cut = time.time()
    failed = run.join()
    ended = time.time()
    time.sleep(max(0.0, cut + CUT_S - time.time()))
    bed.heal("ctx")

    # Every handle of every request ended within its deadline + 1 s of its start, while the
    # link was still down: failed, with the peer named (a sender whose share left whole before
    # the cut excepted; every receiver failed).
    assert failed.complete, failed.stalled
    assert ended < cut + CUT_S, f"{tag}: the handles ended only after the heal"
    records = [(rank, rec) for rank in failed.ranks for rec in rank.records]
    assert len(records) == len(ARRIVALS) * len(failed.ranks)
    for rank, (index, issued, done, state, reason) in records:
        who = f"{tag}: {rank.role} rank {rank.rank} request {index}"
        assert done - issued <= DEADLINE_S + 1.0, (who, round(done - issued, 2), reason)
        if state == "released" and rank.role == "context" and index == 0:
            # The request started before the cut: this sender's share may have left whole
            # (UCX done with it, the bytes in the kernel's socket buffer) before the link
            # went down; its receiver fails it.
            continue
        assert state == "failed", (who, state, reason)
        peer = GENERATION if rank.role == "context" else CONTEXT
        assert f"{peer} rank " in reason, (who, reason)
    assert failed.leaked == 0
    took = sorted(done - issued for _, (_, issued, done, state, _) in records if state == "failed")
    print(f"{tag}: {len(took)} of {len(records)} handles failed, in {took[0]:.2f}-{took[-1]:.2f} s")
    for index in range(len(ARRIVALS)):  # every receiver of every request failed it
        assert all(
            rec[3] == "failed"
            for rank in failed.ranks
            if rank.role == "generation"
            for rec in rank.records
            if rec[0] == index
        ), (tag, index)

    # The control plane recorded the ranks' own reasons: no reap as "worker gone".
    def recorded() -> list[dict[str, Any]] | None:
        assert fleet.client is not None
        items = fleet.client.list_transfers(status="failed", limit=1000)["items"]
        mine = [t for t in items if str(t["request_id"]).startswith(f"{tag}-")]
        return mine if len(mine) == len(ARRIVALS) else None

    for transfer in wait_until(f"{tag}: the transfers recorded failed", recorded):
        assert "worker gone" not in (transfer["error"] or ""), transfer
