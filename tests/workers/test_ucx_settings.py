"""UCX settings are explicit NIXL transport options: they reach UCX, leave the process's
environment as it was, and travel with the endpoint's published info. (That UCX really keeps to
the devices it was given: ``test_ucx_in_use.py``, ``tests/multihost``.)"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("nixl")
pytest.importorskip("torch")

from workers.pools import PoolSpec, allocate_pools  # noqa: E402
from workers.transport.nixl import NixlTransport, PeerInfo  # noqa: E402


def _pools() -> dict:
    return allocate_pools(
        [PoolSpec(id=0, slot_bytes=256, slot_stride_bytes=256, num_slots=4)], "cpu"
    )


def _pinned(name: str) -> NixlTransport:
    """A transport given both UCX options: TCP on the loopback device."""
    return NixlTransport(
        name,
        _pools(),
        staging_bytes=4096,
        progress_thread=False,
        ucx_tls="tcp",
        ucx_net_devices="lo",
    )


def test_ucx_options_are_reported_and_the_environment_is_left_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("UCX_TLS", raising=False)
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    transport = _pinned("ucx-opt")
    try:
        assert "UCX_TLS" not in os.environ and "UCX_NET_DEVICES" not in os.environ
        assert transport.ucx.tls == "tcp" and transport.ucx.net_devices == "lo"
        info = transport.peer_info().to_json()
        assert info["ucx"] == {"backend": "UCX", "tls": "tcp", "net_devices": "lo"}
        assert PeerInfo.from_json(info).ucx == transport.ucx
    finally:
        transport.close()


def test_without_options_the_process_environment_or_ucx_defaults_apply(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("UCX_TLS", "tcp,self")
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    transport = NixlTransport("ucx-env", _pools(), staging_bytes=4096, progress_thread=False)
    try:
        assert transport.ucx.tls == "tcp,self"
        assert transport.ucx.net_devices == "default"
        assert os.environ["UCX_TLS"] == "tcp,self"
    finally:
        transport.close()


def test_options_win_over_the_process_environment_which_is_restored(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("UCX_TLS", "tcp,self")
    monkeypatch.setenv("UCX_NET_DEVICES", "eth9")  # no such device: UCX would refuse it
    transport = _pinned("ucx-over")
    try:
        assert transport.ucx.tls == "tcp" and transport.ucx.net_devices == "lo"
        assert os.environ["UCX_TLS"] == "tcp,self"
        assert os.environ["UCX_NET_DEVICES"] == "eth9"
    finally:
        transport.close()
