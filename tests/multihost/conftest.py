"""Several hosts on one machine (``workers/testing/netbed.py``): the bed, and the demo fleet
across it.

- ``bed`` (session, in ``tests/conftest.py``): namespaces ``kvp-cp``, ``kvp-ctx`` and ``kvp-gen``,
  each with two NICs: ``eth0`` on the control network (10.77.0.1, .2, .3 on the bridge
  ``kvp-br0``), which carries HTTP (the control plane listens on 10.77.0.1, workers register,
  heartbeat and hold their command streams there), and ``data0`` on the data network
  (10.78.0.1, .2, .3 on ``kvp-br1``) for the KV bytes; ``tcp_retries2=3`` in each. The faults
  (loss, rate, partition, delay) hit the data network unless a test names the control one.
  Removed at the end, also after a failure. Where namespaces cannot be built (not root, no
  ``ip``/``nft``) the tier is skipped loudly, except under ``CI=true`` where that is a failure.
- Every test leaves the network healed (``heal`` after it, whatever happened).
- ``make_fleet``: the demo fleet (TP4 context → TP2 generation) with the control plane in
  ``kvp-cp`` (SQLite in the test's directory: namespaces share the file system), the context
  ranks in ``kvp-ctx``, the generation ranks in ``kvp-gen``, every worker on ``UCX_TLS=tcp``
  (``--ucx-tls tcp``), so every byte crosses the bed's veths, and pinned to the data NIC
  (``--ucx-net-devices data0``) by that option alone: the tier runs with neither ``UCX_TLS`` nor
  ``UCX_NET_DEVICES`` in its environment. Pools are pattern-filled and every receive is verified.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("nixl")
pytest.importorskip("torch")
from workers.testing import netbed  # noqa: E402 (after the importorskips)
from workers.testing.engine import EngineRun, Fleet  # noqa: E402

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
HOSTS = {"control": "kvp-cp", "context": "kvp-ctx", "generation": "kvp-gen"}
NUM_SLOTS = 64
WAIT_S = 60.0  # how long a helper waits for something that must happen


@pytest.fixture(autouse=True, scope="session")
def ucx_from_options_only() -> Iterator[None]:
    """No UCX setting reaches a worker through this environment: the options must do it."""
    with pytest.MonkeyPatch.context() as patch:
        for key in ("UCX_TLS", "UCX_NET_DEVICES"):
            patch.delenv(key, raising=False)
        yield


@pytest.fixture(autouse=True)
def healed(request: pytest.FixtureRequest) -> Iterator[None]:
    """Whatever a test broke in the network is repaired after it."""
    yield
    if "bed" in request.fixturenames:
        request.getfixturevalue("bed").heal()


@pytest.fixture
def make_fleet(
    bed: netbed.Bed, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., Fleet]]:
    """Start the demo fleet across the bed's hosts (stopped at the end of the test)."""
    fleets: list[Fleet] = []

    def make(**options: Any) -> Fleet:
        options = {
            "num_slots": NUM_SLOTS,
            "fill": True,
            "staging_bytes": 32 << 20,
            "ucx_tls": "tcp",
            "ucx_net_devices": netbed.DATA_DEVICE,
            **options,
        }
        fleet = Fleet(
            tmp_path_factory.mktemp("multihost"),
            host=bed.address("cp"),
            hosts=HOSTS,
            **options,
        )
        fleets.append(fleet)
        fleet.start()
        return fleet

    try:
        yield make
    finally:
        for fleet in fleets:
            fleet.stop()


class Background:
    """``fleet.run_engine(...)`` on a thread, so a test can break the network meanwhile."""

    def __init__(self, fleet: Fleet, **options: Any) -> None:
        self.result: EngineRun | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fleet, options), daemon=True)
        self._thread.start()

    def _run(self, fleet: Fleet, options: dict[str, Any]) -> None:
        try:
            self.result = fleet.run_engine(**options)
        except BaseException as error:  # handed to the test in join()
            self.error = error

    def join(self, timeout_s: float = 300.0) -> EngineRun:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError("the engine run did not finish")
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


def wait_until(what: str, check: Callable[[], Any], timeout_s: float = WAIT_S) -> Any:
    """Poll ``check`` until it returns something truthy; that value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:.0f} s: {what}")
        time.sleep(0.2)


def assert_clean(run: EngineRun) -> None:
    """Every request arrived, verified, and every block went back to its cache."""
    assert run.complete, run.stalled
    assert run.failures == {}
    assert run.leaked == 0
    for rank in run.ranks:
        assert rank.verify_errors == []
        assert rank.double_allocations == 0


def nic_bytes(bed: netbed.Bed, host: str) -> dict[str, int]:
    """Bytes through ``host``'s NICs so far, sent and received, by network."""
    return {
        network: sum(bed.counters(host, network)[k] for k in ("rx_bytes", "tx_bytes"))
        for network in netbed.NETWORKS
    }


def assert_on_the_data_network(
    before: dict[str, dict[str, int]], after: dict[str, dict[str, int]], moved: int
) -> None:
    """Between two :func:`nic_bytes` snapshots per host, the hosts' data NICs carried at least
    the ``moved`` KV bytes and their control NICs almost nothing: HTTP (heartbeats, records,
    commands) only, under 5 % of it."""
    for host in before:
        crossed = {net: after[host][net] - before[host][net] for net in before[host]}
        assert crossed[netbed.DATA] >= moved, (host, crossed, moved)
        assert crossed[netbed.CONTROL] < moved // 20, (host, crossed, moved)


def payload_bytes(blocks: int, num_slots: int = NUM_SLOTS) -> int:
    """Bytes one demo request of ``blocks`` blocks moves (all routes)."""
    from geometry import compile_plan, expand, parse_instance
    from workers.testing.engine import CONTEXT, GENERATION, demo_bodies, request_blocks

    context, generation = demo_bodies(num_slots=num_slots)
    plan = compile_plan(parse_instance(context, CONTEXT), parse_instance(generation, GENERATION))
    return int(expand(plan, request_blocks(1, 0, blocks, num_slots)).bytes)


def wait_released(fleet: Fleet) -> list[dict[str, Any]]:
    """Wait until no rank holds a handle and every staging byte is free again (failed
    transfers' areas leave quarantine); the ranks' books."""

    def released() -> list[dict[str, Any]] | None:
        books = fleet.call_all("handover_state")
        if all(b["pending"] == 0 and b["staging_free"] == b["staging_total"] for b in books):
            return books
        return None

    books: list[dict[str, Any]] = wait_until("handles and staging released", released)
    return books
