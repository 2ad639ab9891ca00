"""Real server processes (``python -m api.cli serve``) on this test's database, and a small fleet
registered over HTTP. The servers are SIGKILLed at teardown if a test left them running."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.client import Client
from api.demo import fake_peer
from api.geometry.builders import ViewSpec, instance_body

ROOT = Path(__file__).resolve().parents[2]
VIEWS = [ViewSpec("target", layers=2, kv_heads=4, head_dim=8)]
START_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Server:
    """One ``kvplane serve`` child process."""

    def __init__(self, db_url: str, port: int, log: Path, env: dict[str, str]) -> None:
        self.db_url, self.port, self.log, self.env = db_url, port, log, env
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, *, wait: bool = True) -> Server:
        env = {**os.environ, "KVPLANE_DATABASE_URL": self.db_url, **self.env}
        env.pop("KVPLANE_TOKEN", None)
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "api.cli",
                    "serve",
                    "--port",
                    str(self.port),
                    "--no-migrate",
                ],
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.proc is not None and self.proc.poll() is None, self.log.read_text()
            try:
                if httpx.get(f"{self.url}/readyz", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"server did not start: {self.log.read_text()[-2000:]}")

    def kill(self) -> None:
        """SIGKILL: no shutdown hooks, no flushing (a crash)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Callable[..., Server]]:
    servers: list[Server] = []

    def _start(db_url: str, *, port: int | None = None, wait: bool = True, **env: str) -> Server:
        server = Server(
            db_url,
            port or free_port(),
            tmp_path / f"server-{len(servers)}.log",
            {f"KVPLANE_{key.upper()}": value for key, value in env.items()},
        )
        servers.append(server)
        return server.start(wait=wait)

    yield _start
    for server in servers:
        server.kill()


def fleet_bodies(ctx_tp: int = 2, gen_tp: int = 1) -> tuple[dict[str, Any], dict[str, Any]]:
    ctx = instance_body(role="context", views=VIEWS, tp=ctx_tp, tokens_per_block=4, num_slots=64)
    gen = instance_body(role="generation", views=VIEWS, tp=gen_tp, tokens_per_block=4, num_slots=64)
    return ctx, gen


def worker_body(instance: str, rank_body: dict[str, Any], agent: str) -> dict[str, Any]:
    """A worker registration with a syntactically valid NIXL endpoint (never dereferenced)."""
    return {"instance": instance, "rank": rank_body["rank"], "peer": fake_peer(rank_body, agent)}


def transfer_body(
    request_id: str,
    *,
    execute: bool,
    context: str = "ctx",
    generation: str = "gen",
    blocks: int = 4,
) -> dict[str, Any]:
    return {
        "context": context,
        "generation": generation,
        "request_id": request_id,
        "blocks": {"0": {"context": list(range(blocks)), "generation": list(range(blocks))}},
        "execute": execute,
    }


def setup_fleet(client: Any, ctx_tp: int = 2, gen_tp: int = 1) -> dict[tuple[str, int], str]:
    """ctx and gen registered and paired over HTTP; one worker per rank; worker ids by rank."""
    ctx, gen = fleet_bodies(ctx_tp, gen_tp)
    client.register_instance("ctx", ctx)
    client.register_instance("gen", gen)
    assert client.create_pairing("ctx", "gen")["compatible"]
    workers = {}
    for name, body in (("ctx", ctx), ("gen", gen)):
        for rank_body in body["ranks"]:
            attached = client.register_worker(
                worker_body(name, rank_body, f"{name}.r{rank_body['rank']}")
            )
            workers[(name, rank_body["rank"])] = attached["id"]
    return workers


class Heartbeats:
    """What real workers do: heartbeat every second, riding over outages with the client's retry."""

    def __init__(self, url: str, worker_ids: list[str]) -> None:
        self.client = Client(url, retries=40, backoff_s=0.25, max_backoff_s=1.0)
        self.worker_ids = worker_ids
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(1.0):
            for worker_id in self.worker_ids:
                self.client.heartbeat(worker_id)

    def __enter__(self) -> Heartbeats:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=30)
        self.client.close()
