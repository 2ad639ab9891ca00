"""Failed peers are probed off the progress thread with backoff, and become ready to reload
once a probe reaches them (workers/handover/reloads.py). The probe here is a stand-in for
``NixlTransport.probe_peer`` that blocks like an unreachable host; the real probe runs in
tests/multihost/test_partition.py."""

from __future__ import annotations

import threading
import time
from typing import Any

from workers.handover import reloads
from workers.handover.reloads import PeerReloads


class SlowNetwork:
    """``probe_peer`` that takes ``block_s`` and fails until ``up`` is set."""

    name = "ctx-0"

    def __init__(self, block_s: float) -> None:
        self.block_s = block_s
        self.up = threading.Event()
        self.probes: list[float] = []
        self.notes: list[bytes | None] = []

    def probe_peer(self, info: Any, note: bytes | None = None) -> str | None:
        self.probes.append(time.monotonic())
        self.notes.append(note)
        time.sleep(self.block_s)
        return None if self.up.is_set() else "NIXL_ERR_BACKEND: Destination is unreachable"


def test_a_failed_peer_is_probed_with_backoff_without_blocking_the_caller(
    monkeypatch: Any,
) -> None:
    monkeypatch.setattr(reloads, "PROBE_FIRST_S", 0.05)
    monkeypatch.setattr(reloads, "PROBE_MAX_S", 0.2)
    network = SlowNetwork(block_s=0.1)
    woken = threading.Event()
    peers = PeerReloads(network, woken.set, "t", lambda agent: {"agent": agent})  # type: ignore[arg-type]
    try:
        t0 = time.monotonic()
        peers.mark("gen-0", ConnectionError("nixlRemoteDisconnectError"))
        assert time.monotonic() - t0 < 0.05  # marking never waits for the network
        assert peers.stale("gen-0") is not None and peers.ready() == []
        why = peers.why("gen-0")
        assert why is not None and "nixlRemoteDisconnectError" in why

        time.sleep(1.0)
        assert peers.ready() == [] and not woken.is_set()
        assert len(network.probes) >= 3
        gaps = [b - a for a, b in zip(network.probes, network.probes[1:], strict=False)]
        assert gaps[-1] > gaps[0]  # backing off
        assert max(gaps) < 0.2 + 0.1 + 0.1  # at most PROBE_MAX_S apart (plus the probe)
        why = peers.why("gen-0")
        assert why is not None and "Destination is unreachable" in why  # the latest error

        network.up.set()
        assert woken.wait(2.0)
        assert peers.ready() == ["gen-0"] and peers.any_ready
        # Every probe asks the peer to load this rank again too (both sides start over).
        assert set(network.notes) == {reloads.RELOAD_ME + b"ctx-0"}
        peers.done("gen-0")
        assert peers.stale("gen-0") is None and peers.why("gen-0") is None
        assert not peers.any_ready
        assert "gen-0" in peers.reloaded
    finally:
        peers.close()


def test_a_failed_reload_probes_again_and_a_retired_peer_is_forgotten(monkeypatch: Any) -> None:
    monkeypatch.setattr(reloads, "PROBE_FIRST_S", 0.02)
    network = SlowNetwork(block_s=0.0)
    network.up.set()
    woken = threading.Event()
    known = {"gen-0"}
    peers = PeerReloads(
        network,  # type: ignore[arg-type]
        woken.set,
        "t",
        lambda agent: {"agent": agent} if agent in known else None,
    )
    try:
        peers.mark("gen-0", "connection reset")
        assert woken.wait(2.0)
        assert peers.ready() == ["gen-0"]
        woken.clear()
        peers.mark("gen-0", "lost again")  # the same connection again: still ready
        assert peers.ready() == ["gen-0"]
        peers.mark("gen-0", "reload failed", reload_failed=True)  # probe again
        assert peers.ready() == [] and not peers.any_ready
        assert woken.wait(2.0) and peers.ready() == ["gen-0"]

        known.clear()  # retired: its rank has another worker now
        peers.forget("gen-0")
        assert peers.stale("gen-0") is None and peers.ready() == []
    finally:
        peers.close()


def test_a_peer_that_asks_is_reloaded_at_the_next_step_without_asking_back() -> None:
    network = SlowNetwork(block_s=0.0)
    woken = threading.Event()
    peers = PeerReloads(
        network,  # type: ignore[arg-type]
        woken.set,
        "t",
        lambda agent: {"agent": agent} if agent == "gen-0" else None,
    )
    try:
        peers.requested("stranger")  # not a peer of this rank: ignored
        assert peers.stale("stranger") is None and not peers.any_ready
        peers.requested("gen-0")
        assert woken.is_set() and peers.any_ready and peers.ready() == ["gen-0"]
        stale = peers.stale("gen-0")
        assert stale is not None and stale.asked is False
        peers.done("gen-0")
        assert network.probes == []  # it answered: no probe, and nothing asked back
    finally:
        peers.close()
