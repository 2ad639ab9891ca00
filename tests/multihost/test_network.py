"""The demo fleet across three hosts, and what the network does to its transfers.

One fleet for the module: control plane on ``kvp-cp``, TP4 context on ``kvp-ctx``, TP2 generation
on ``kvp-gen``, every worker on ``--ucx-tls tcp --ucx-net-devices data0``. Every receive is
verified byte for byte.

- the bytes cross the bed's data network: the context and generation hosts' ``data0`` carry at
  least the transfers' bytes, their ``eth0`` (the control network) almost nothing; REST transfers
  run from the root namespace; ``GET /v1/workers`` says which UCX settings each worker runs with
  and that UCX uses ``tcp/data0`` only, and the dashboard flags nothing;
- a lost connection (the context host cut off the data network for longer than TCP's patience,
  ``tcp_retries2=3``): NIXL raises ``nixlRemoteDisconnectError``; every handle fails on both
  sides as ``peer_unreachable`` well before its deadline, and once the link is back the next
  transfers between the same processes succeed;
- a partition that outlasts the deadline while TCP keeps trying (``tcp_retries2=15``, Linux's
  default: the WRITE stays in progress the whole outage): every handle fails at its deadline on
  both sides, every staging byte comes back, and after the link heals the next transfers succeed
  without restarting anything;
- 1 % packet loss each way on the context host and 5 ms of delay each way between the two
  hosts (both on the data network): every transfer completes and verifies.

The faults hit the data network only: the control plane keeps hearing from every worker.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from workers.testing.engine import CONTEXT, Fleet, run_rest
from workers.testing.netbed import DATA_DEVICE, Bed

from .conftest import (
    HOSTS,
    Background,
    assert_clean,
    assert_on_the_data_network,
    nic_bytes,
    payload_bytes,
    wait_released,
    wait_until,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SLOW_LINK = "40mbit"  # 5 MB/s: a 16-block request (about 9 MB) stays in flight for seconds


@pytest.fixture(scope="module")
def fleet(bed: Bed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    running = Fleet(
        tmp_path_factory.mktemp("network"),
        num_slots=64,
        fill=True,
        staging_bytes=32 << 20,
        ucx_tls="tcp",
        ucx_net_devices=DATA_DEVICE,
        host=bed.address("cp"),
        hosts=HOSTS,
    )
    try:
        running.start()
        yield running
    finally:
        running.stop()


def test_bytes_cross_the_data_network_and_workers_report_their_transport(
    bed: Bed, fleet: Fleet
) -> None:
    assert fleet.server.url.startswith(f"http://{bed.address('cp')}:")  # the control network
    hosts = ("ctx", "gen")
    before = {host: nic_bytes(bed, host) for host in hosts}
    run = fleet.run_engine(requests=4, blocks=16, in_flight=2, verify=True, timeout_s=60)
    assert_clean(run)
    after = {host: nic_bytes(bed, host) for host in hosts}
    # Every byte of the four requests crossed both hosts' data NICs (UCX's default on one
    # machine would have used shared memory / CMA: almost nothing on the veths), and not their
    # control NICs (UCX unpinned spreads its lanes over eth0 and data0).
    moved = 4 * payload_bytes(16)
    assert_on_the_data_network(before, after, moved)
    # REST from the driver's namespace: the control plane pushes to the workers' command
    # streams across the bed, and the transfer is recorded done.
    rest = run_rest(
        fleet.server.url,
        requests=2,
        blocks=4,
        in_flight=1,
        num_slots=64,
        seed=3,
        tag="rest-hosts",
        verify=True,
    )
    assert rest["errors"] == [] and len(rest["latencies"]) == 2
    assert fleet.client is not None
    workers = [w for w in fleet.client.list_workers()["items"] if w["status"] == "alive"]
    assert len(workers) == 6
    for worker in workers:
        assert worker["ucx"] == {"backend": "UCX", "tls": "tcp", "net_devices": DATA_DEVICE}

    # What UCX actually uses (from its own log, with the next heartbeat): the data NIC only, no
    # shared memory, although all three namespaces share one kernel.
    def reported() -> list[dict[str, Any]] | None:
        assert fleet.client is not None
        items = [w for w in fleet.client.list_workers()["items"] if w["status"] == "alive"]
        return items if len(items) == 6 and all(w["ucx_in_use"] for w in items) else None

    for worker in wait_until("every worker's UCX report", reported):
        in_use = worker["ucx_in_use"]
        assert in_use["transports"] == [f"tcp/{DATA_DEVICE}"], in_use
        assert in_use["shared_memory"] is False, in_use
    page = httpx.get(f"{fleet.server.url}/ui/workers", timeout=30).text
    assert f"in use: tcp/{DATA_DEVICE}" in page
    assert "outside the pinned devices" not in page


def _engine_failures(run_failures: dict[str, str], role: str) -> list[str]:
    return [reason for who, reason in run_failures.items() if who.startswith(role)]


def test_lost_connection_fails_both_sides_as_peer_unreachable_then_reconnects(
    bed: Bed, fleet: Fleet
) -> None:
    bed.rate("ctx", SLOW_LINK)
    run = Background(fleet, requests=2, blocks=16, in_flight=2, verify=True, timeout_s=30)
    time.sleep(1.5)  # the WRITEs are on the (slow) wire
    bed.partition("ctx")
    time.sleep(10)  # longer than TCP's patience (tcp_retries2=3): UCX fails the connection
    bed.heal("ctx")
    failed = run.join()
    assert failed.complete, failed.stalled
    context = _engine_failures(failed.failures, "context")
    generation = _engine_failures(failed.failures, "generation")
    assert context and generation, failed.failures
    # A sender whose WRITE was on the wire learns from NIXL, well before its deadline.
    for reason in context:
        assert reason.startswith("peer_unreachable"), failed.failures
    # A receiver learns from the sender's abort or from its own re-sent grant. A WRITE that UCX
    # had completed locally (the bytes still in the sender's socket buffer) when the link broke
    # leaves a released sender; the receiver's re-sent grant makes it probe the connection and
    # abort over a new one once the link is back, or the receiver's deadline ends it.
    assert any(r.startswith("peer_unreachable") for r in generation), failed.failures
    for reason in generation:
        assert reason.startswith(("peer_unreachable", "deadline: 30 s passed")), failed.failures
        if reason.startswith("deadline"):  # the sender unreachable, or its bytes lost
            assert "did not write" in reason or "peer_unreachable" in reason, failed.failures
    assert failed.leaked == 0
    wait_released(fleet)

    again = fleet.run_engine(requests=4, blocks=4, in_flight=2, verify=True, timeout_s=60)
    assert_clean(again)


def test_partition_outlasting_the_deadline_fails_both_sides_and_heals(
    bed: Bed, fleet: Fleet
) -> None:
    for host in ("ctx", "gen"):
        bed.tcp_retries(host, 15)  # Linux's default: TCP keeps trying for minutes
    bed.rate("ctx", SLOW_LINK)
    run = Background(fleet, requests=2, blocks=16, in_flight=2, verify=True, timeout_s=4)
    time.sleep(1.0)
    bed.partition("ctx")
    failed = run.join()  # the deadline, not TCP, ends it: the link is still down
    assert failed.complete, failed.stalled
    context = _engine_failures(failed.failures, "context")
    generation = _engine_failures(failed.failures, "generation")
    assert context and generation, failed.failures
    for reason in context + generation:
        assert reason.startswith(("deadline", "peer ")), failed.failures
    assert failed.leaked == 0
    time.sleep(3)
    bed.heal("ctx")
    # Nothing stays behind: no handle pending, the quarantined staging of the failed
    # receives (a late WRITE could still land there) returns when its time to live is over.
    wait_released(fleet)

    again = fleet.run_engine(requests=4, blocks=4, in_flight=2, verify=True, timeout_s=60)
    assert_clean(again)


def test_one_percent_loss_and_5_ms_delay_complete_and_verify(bed: Bed, fleet: Fleet) -> None:
    bed.loss("ctx", 1)
    bed.delay("ctx", "gen", 5)  # each way: a 10 ms round trip between the two hosts
    before = nic_bytes(bed, "ctx")
    run = fleet.run_engine(requests=8, blocks=16, in_flight=4, verify=True, timeout_s=120)
    assert_clean(run)
    # The bytes took the delayed detour between the data addresses, neither NIC.
    after = nic_bytes(bed, "ctx")
    assert all(after[n] - before[n] < payload_bytes(16) for n in after), (before, after)
    assert fleet.client is not None
    assert fleet.client.get_instance(CONTEXT)["status"] == "ready"
