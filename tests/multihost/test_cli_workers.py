"""The operators' walkthrough (docs/operators.md, "Several hosts"): ``kvplane serve`` in
``kvp-cp`` on the control network, ``kvplane worker --ucx-tls tcp --ucx-net-devices data0`` in
``kvp-ctx`` and ``kvp-gen`` (the option alone: no ``UCX_NET_DEVICES`` in their environment); a
burst of REST transfers (``execute=true``, verified) moves across the bed's data network while
the control network carries only HTTP, and ``GET /v1/workers`` reports each worker's UCX settings
and that UCX uses ``tcp/data0`` only."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from api.client import Client
from geometry.builders import ViewSpec, instance_body
from workers.testing.engine import REPO, ControlPlane
from workers.testing.netbed import DATA_DEVICE, Bed

from .conftest import assert_on_the_data_network, nic_bytes, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

VIEWS = [ViewSpec("target", layers=2, kv_heads=4, head_dim=64)]
TOKENS_PER_BLOCK = 64  # 128 KiB a block: a transfer's bytes dwarf the HTTP around it
BURST = 8  # transfers of 8 blocks each


@pytest.fixture
def server(bed: Bed, tmp_path: Path) -> Iterator[ControlPlane]:
    running = ControlPlane(tmp_path, host=bed.address("cp"), netns=bed.ns("cp"))
    try:
        running.start()
        yield running
    finally:
        running.stop()


def test_cli_workers_on_two_hosts(bed: Bed, server: ControlPlane, tmp_path: Path) -> None:
    client = Client(server.url, retries=3, backoff_s=0.2)
    processes: list[subprocess.Popen[bytes]] = []
    environ = {k: v for k, v in os.environ.items() if k not in ("UCX_TLS", "UCX_NET_DEVICES")}
    try:
        for name, role, tp in (("ctx", "context", 2), ("gen", "generation", 1)):
            body = instance_body(
                role=role, views=VIEWS, tp=tp, tokens_per_block=TOKENS_PER_BLOCK, num_slots=32
            )
            client.register_instance(name, body)
            for rank in range(tp):
                argv = [
                    sys.executable,
                    "-m",
                    "cli",
                    "worker",
                    "--control-plane",
                    server.url,
                    "--instance",
                    name,
                    "--rank",
                    str(rank),
                    "--fill-pattern",
                    "--staging-mib",
                    "16",
                    "--ucx-tls",
                    "tcp",
                    "--ucx-net-devices",
                    DATA_DEVICE,
                ]
                with (tmp_path / f"{name}-{rank}.log").open("wb") as log:
                    processes.append(
                        subprocess.Popen(
                            bed.command(name, argv),
                            cwd=REPO,
                            stdout=log,
                            stderr=subprocess.STDOUT,
                            env={**environ, "KVPLANE_AUTH": "false"},
                            start_new_session=True,
                        )
                    )
        assert client.create_pairing("ctx", "gen")["compatible"]

        def serving() -> list[dict[str, Any]] | None:
            items = client.list_workers()["items"]
            alive = [w for w in items if w["status"] == "alive" and w["connected"]]
            return alive if len(alive) == 3 else None

        workers = wait_until("three workers serving", serving)
        for worker in workers:
            assert worker["ucx"] == {"backend": "UCX", "tls": "tcp", "net_devices": DATA_DEVICE}
        hosts = ("ctx", "gen")
        before = {host: nic_bytes(bed, host) for host in hosts}
        moved = 0
        for k in range(BURST):
            created = client.create_transfer(
                {
                    "context": "ctx",
                    "generation": "gen",
                    "request_id": f"across-{k}",
                    "blocks": {"0": {"context": list(range(8)), "generation": list(range(8, 16))}},
                    "execute": True,
                    "verify": True,
                    "timeout_s": 30,
                }
            )
            done = client.get_transfer(created["id"], wait_s=60)
            assert done["status"] == "done", done["error"]
            moved += done["bytes"]
        assert moved == BURST * 8 * (128 << 10)
        after = {host: nic_bytes(bed, host) for host in hosts}
        assert_on_the_data_network(before, after, moved)

        # What UCX uses, from its log: only the device it was given.
        def reported() -> list[dict[str, Any]] | None:
            items = [w for w in client.list_workers()["items"] if w["status"] == "alive"]
            return items if items and all(w["ucx_in_use"] for w in items) else None

        for worker in wait_until("every worker's UCX report", reported):
            assert worker["ucx_in_use"]["transports"] == [f"tcp/{DATA_DEVICE}"], worker
    finally:
        client.close()
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        for process in processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)
