"""Real server processes (``python -m cli serve``) on this test's database, a small fleet
registered over HTTP, and fake workers that speak the real worker protocol without NIXL.

- :class:`Server`: one ``kvplane serve`` child process; SIGKILLed at teardown if a test left it
  running.
- :class:`FakeWorker`: what a ``kvplane worker`` does on the control-plane side, minus the bytes.
  It holds its command stream (``GET /v1/workers/{id}/commands``) on a thread, reconnecting like
  ``workers/agent.py`` when the stream drops, and answers every pushed ``transfer`` command with
  one record of its part, posted through the real :class:`workers.records.Recorder` (batched,
  retried with backoff while the control plane is down). ``hold=True`` keeps the commands until
  :meth:`FakeWorker.release`, so transfers stay ``running`` as long as a test needs.
- :class:`Heartbeats`: what real workers do every second, riding over outages with the client's
  retry.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.client import ApiError, Client, TransportError
from api.demo_fleet import fake_peer
from geometry.builders import ViewSpec, instance_body
from workers.records import Recorder

ROOT = Path(__file__).resolve().parents[2]
VIEWS = [ViewSpec("target", layers=2, kv_heads=4, head_dim=8)]
START_TIMEOUT_S = 60.0
WAIT_TIMEOUT_S = 60.0  # how long a helper waits for something that must happen


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
                    "cli",
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
    **extra: Any,
) -> dict[str, Any]:
    return {
        "context": context,
        "generation": generation,
        "request_id": request_id,
        "blocks": {"0": {"context": list(range(blocks)), "generation": list(range(blocks))}},
        "execute": execute,
        **extra,
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


@dataclass
class TwoProcesses:
    """Two API processes on one PostgreSQL database, clients on each, the fleet set up on A."""

    a: Server
    b: Server
    on_a: Client
    on_b: Client
    workers: dict[tuple[str, int], str]


@pytest.fixture
def two_processes(postgres_url: str, start_server: Callable[..., Server]) -> Iterator[TwoProcesses]:
    a = start_server(postgres_url)
    b = start_server(postgres_url)
    with Client(a.url) as on_a, Client(b.url) as on_b:
        yield TwoProcesses(a, b, on_a, on_b, setup_fleet(on_a))


def wait_until(predicate: Callable[[], bool], what: str, timeout_s: float = WAIT_TIMEOUT_S) -> None:
    """Poll ``predicate`` until it holds (a test helper, not a timed assertion)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


class _Transport(httpx.HTTPTransport):
    """An HTTP transport that counts refused connections (``unreachable``) and can hang up its
    open streams from another thread (closing a client does not wake a thread blocked reading
    a stream; shutting the socket down does)."""

    def __init__(self) -> None:
        super().__init__()
        self.unreachable = 0
        self._sockets: list[socket.socket] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        try:
            response = super().handle_request(request)
        except httpx.ConnectError:
            self.unreachable += 1
            raise
        stream = response.extensions.get("network_stream")
        sock = None if stream is None else stream.get_extra_info("socket")
        if sock is not None:
            self._sockets.append(sock)
        return response

    def hang_up(self) -> None:
        for sock in self._sockets:
            with contextlib.suppress(OSError):  # already closed
                sock.shutdown(socket.SHUT_RDWR)


class FakeWorker:
    """One rank's worker on the control-plane side: command stream in, records out.

    Every ``transfer`` command it receives is answered with a record of its part (``done``, or
    ``outcome``): the record a real worker's handle produces, without moving bytes. Like the
    real worker it drops a command whose ``xid`` and side it has seen (delivery is at least
    once); ``duplicates`` counts them.
    """

    def __init__(
        self,
        url: str,
        worker_id: str,
        *,
        token: str | None = None,
        hold: bool = False,
        resend: bool = False,
        outcome: str = "done",
    ) -> None:
        self.url, self.worker_id = url, worker_id
        self.hold, self.resend, self.outcome = hold, resend, outcome
        self.commands: list[dict[str, Any]] = []  # every transfer command received, in order
        self.held: list[dict[str, Any]] = []
        self.hellos = 0  # streams opened (one per connection, reconnects included)
        self.duplicates = 0  # commands received again (and dropped)
        self._seen: set[tuple[str, str]] = set()
        self.errors: list[str] = []
        self._pairings: dict[tuple[str, str], str] = {}
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._hangup = _Transport()
        self._stream = Client(url, token=token, retries=0, transport=self._hangup)
        self.transport = _Transport()  # the records' (and directory's) connection
        self._client = Client(
            url, token=token, retries=5, backoff_s=0.2, max_backoff_s=1.0, transport=self.transport
        )
        self.recorder = Recorder(self._client, lambda: worker_id)
        self._thread = threading.Thread(
            target=self._run, daemon=True, name=f"fake-worker-{worker_id[:8]}"
        )
        self._thread.start()

    # --- the command stream --------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                for message in self._stream.stream_commands(self.worker_id, read_timeout_s=30):
                    if self._stop.is_set():
                        return
                    if message.get("type") == "hello":
                        with self._cond:
                            self.hellos += 1
                            self._cond.notify_all()
                    elif message.get("type") == "transfer":
                        self._on_command(message)
            except Exception as error:  # a dropped stream: reconnect, as workers/agent.py does
                if self._stop.is_set():
                    return
                with self._cond:
                    self.errors.append(f"{type(error).__name__}: {error}")
                    del self.errors[:-50]
            self._stop.wait(0.2)

    def _on_command(self, command: dict[str, Any]) -> None:
        with self._cond:
            key = (command["xid"], command["side"])
            if key in self._seen:
                self.duplicates += 1
                return
            self._seen.add(key)
            self.commands.append(command)
            if self.hold:
                self.held.append(command)
            self._cond.notify_all()
        if not self.hold:
            self._answer([command])

    def _answer(self, commands: list[dict[str, Any]]) -> None:
        records = [self.record(command) for command in commands]
        for record in records:
            self.recorder.add(record, urgent=True)  # REST transfers have a waiter: post now
        if self.resend and records:
            # The same batch once more on another connection, at the same time: a batch whose
            # answer was lost is sent again. The control plane must count each part once.
            try:
                self._client.record_transfers(self.worker_id, records)
            except ApiError as error:
                with self._cond:
                    self.errors.append(f"resend: {error}")

    def record(self, command: dict[str, Any]) -> dict[str, Any]:
        """The record of this worker's part of ``command`` (what ``Worker._record`` posts)."""
        now = time.time()
        return {
            "transfer_id": command["transfer_id"],
            "attempt": int(command["attempt"]),
            "request_id": command["request_id"],
            "pairing_id": self._pairing_id(command["context"], command["generation"]),
            "context": command["context"],
            "generation": command["generation"],
            "context_epoch": command["context_epoch"],
            "generation_epoch": command["generation_epoch"],
            "context_dp_rank": command["context_dp_rank"],
            "generation_dp_rank": command["generation_dp_rank"],
            "side": command["side"],
            "rank": int(command["rank"]),
            "status": self.outcome,
            "error": None if self.outcome == "done" else "fake worker: told to fail",
            "bytes": 1,
            "mode": command["mode"],
            "verify": bool(command["verify"]),
            "started_at": now,
            "finished_at": now,
        }

    def _pairing_id(self, context: str, generation: str) -> str:
        """From the worker's directory, as the real worker's plan entry has it."""
        if (context, generation) not in self._pairings:
            try:
                directory = self._client.get_directory(self.worker_id)
                self._pairings = {
                    (p["context"], p["generation"]): p["id"] for p in directory["pairings"]
                }
            except ApiError as error:
                with self._cond:
                    self.errors.append(f"directory: {error}")
        return self._pairings.get((context, generation), "unknown")

    # --- test controls -------------------------------------------------------------------

    def release(self) -> int:
        """Answer every held command now (and every later one at once); how many were held."""
        with self._cond:
            held, self.held, self.hold = self.held, [], False
        self._answer(held)
        return len(held)

    def wait_streams(self, count: int = 1, timeout_s: float = WAIT_TIMEOUT_S) -> None:
        """Until ``count`` streams were opened (the first, or a reconnect after a restart)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.hellos >= count, timeout_s):
                raise AssertionError(
                    f"worker {self.worker_id}: {self.hellos} stream(s) opened, "
                    f"not {count}: {self.errors[-3:]}"
                )

    def wait_commands(self, count: int, timeout_s: float = WAIT_TIMEOUT_S) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: len(self.commands) >= count, timeout_s):
                raise AssertionError(
                    f"worker {self.worker_id}: {len(self.commands)} "
                    f"command(s), not {count}: {self.errors[-3:]}"
                )

    def close(self) -> None:
        """Stop streaming; flush the record (bounded)."""
        self._stop.set()
        self.recorder.close(timeout_s=5.0)
        self._hangup.hang_up()  # ends a stream that is still reading
        self._thread.join(timeout=10)
        self._stream.close()
        self._client.close()

    def __enter__(self) -> FakeWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class FakeFleet:
    """One :class:`FakeWorker` per worker id; a context manager that closes them all."""

    def __init__(self, url: str, workers: dict[tuple[str, int], str], **options: Any) -> None:
        self.workers = {
            key: FakeWorker(url, worker_id, **options) for key, worker_id in workers.items()
        }

    def __getitem__(self, key: tuple[str, int]) -> FakeWorker:
        return self.workers[key]

    def __iter__(self) -> Iterator[FakeWorker]:
        return iter(self.workers.values())

    def wait_streams(self, count: int = 1) -> None:
        for worker in self:
            worker.wait_streams(count)

    def release(self) -> int:
        return sum(worker.release() for worker in self)

    def __enter__(self) -> FakeFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        for worker in self:
            worker.close()


class Heartbeats:
    """What real workers do: heartbeat every second, riding over outages with the client's retry
    (and beating again when an outage outlasts it). Refusals are kept in ``refused``."""

    def __init__(self, url: str, worker_ids: list[str]) -> None:
        self.client = Client(url, retries=40, backoff_s=0.25, max_backoff_s=1.0)
        self.worker_ids = worker_ids
        self.refused: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(1.0):
            for worker_id in self.worker_ids:
                try:
                    self.client.heartbeat(worker_id)
                except TransportError:
                    pass  # the control plane is down for longer than the retries: next beat
                except ApiError as error:
                    self.refused.append(f"{worker_id}: {error}")

    def __enter__(self) -> Heartbeats:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=60)
        self.client.close()
