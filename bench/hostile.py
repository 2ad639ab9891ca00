"""Heavy and hostile traffic against one ``kvplane serve`` (loopback only), row by row.

    .venv/bin/python bench/hostile.py [--rows 1,3,4,5,13,probes] [--workers 400] [--polls 1000]
                                      [--pairings 31] [--large 600] [--replays 200]
                                      [--postgres URL]   # row 2: two API processes

Each row starts a fresh server (a child process on 127.0.0.1, SQLite in a temporary directory,
or PostgreSQL for row 2) and prints one figure line; the server's RSS and CPU time are read
from ``/proc``. Every loop is bounded in count and time. A table for docs/benchmarks.md, not
a pass/fail test.

- 1: ``--workers`` workers attached with metadata at the cap (64 KiB of base64): ``GET
  /v1/workers`` p50 and the server's RSS growth over 20 listings (4 at a time);
- 2: two API processes on PostgreSQL, workers' streams on A: ``--relayed`` transfers of 20,000
  blocks posted to B: how many reach both workers;
- 3: a command stream held open and never read, ``--large`` transfers of 20,000 blocks pushed
  to it: RSS growth, and how long until ``GET /v1/workers`` shows it disconnected;
- 4: ``--polls`` held long polls (``GET /v1/transfers/{id}?wait=``): ``/healthz`` and
  ``POST /v1/transfers`` p50 while they wait, and idle;
- 5/6: ``--pairings`` pairings vs 1: directory GET p50 (reads at a worker's pace), heartbeat
  server CPU, and ``POST /v1/transfers`` p50 with 4 directory pollers in a tight loop vs idle;
- 13: ``--replays`` ``Idempotency-Key`` replays of a running transfer: transfer lines in the
  stream;
- probes (rows 7–12, 14, 15): one forged or stale request each, and the answer.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from api.demo_fleet import fake_peer  # noqa: E402
from api.migrate import upgrade  # noqa: E402
from api.schemas_exec import MAX_METADATA_B64  # noqa: E402
from geometry.builders import ViewSpec, instance_body  # noqa: E402

HOST = "127.0.0.1"  # loopback only
VIEWS = [ViewSpec("target", layers=2, kv_heads=4, head_dim=8)]
BIG_SLOTS = 20_480
TICK = os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


@contextmanager
def server(database_url: str) -> Iterator[tuple[str, int]]:
    """A ``kvplane`` app under uvicorn in a child process: ``(base URL, pid)``."""
    port = _free_port()
    base = f"http://{HOST}:{port}"
    env = {
        **os.environ,
        "KVPLANE_DATABASE_URL": database_url,
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    command = [
        sys.executable,
        "-m",
        "uvicorn",
        "--factory",
        "api.app:create_app",
        "--host",
        HOST,
        "--port",
        str(port),
        "--log-level",
        "error",
        "--no-access-log",
        "--backlog",
        "4096",
    ]
    process = subprocess.Popen(command, env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{base}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError("the benchmark server did not start")
            time.sleep(0.05)
        yield base, process.pid
    finally:
        process.terminate()
        process.wait(timeout=10)


@contextmanager
def sqlite_url() -> Iterator[str]:
    with TemporaryDirectory() as tmp:
        url = f"sqlite:///{Path(tmp) / 'hostile.db'}"
        upgrade(url)
        yield url


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def p50_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000 if samples else float("nan")


def timed(call: Any, count: int) -> list[float]:
    samples = []
    for _ in range(count):
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
    return samples


# --- fleet helpers ---------------------------------------------------------------------------


def register(
    api: httpx.Client, name: str, role: str, *, tp: int = 1, num_slots: int = 64
) -> dict[str, Any]:
    body = instance_body(role=role, views=VIEWS, tp=tp, tokens_per_block=4, num_slots=num_slots)
    answer = api.put(f"/v1/instances/{name}", json=body)
    answer.raise_for_status()
    return body


def attach(
    api: httpx.Client,
    name: str,
    body: dict[str, Any],
    rank: int = 0,
    metadata_b64: str | None = None,
) -> str:
    peer = fake_peer(body["ranks"][rank], f"{name}.r{rank}.{uuid.uuid4().hex[:6]}")
    if metadata_b64 is not None:
        peer["metadata_b64"] = metadata_b64
    answer = api.post("/v1/workers", json={"instance": name, "rank": rank, "peer": peer})
    answer.raise_for_status()
    return str(answer.json()["id"])


def pair(api: httpx.Client, context: str, generation: str) -> str:
    answer = api.post("/v1/pairings", json={"context": context, "generation": generation})
    answer.raise_for_status()
    return str(answer.json()["id"])


def transfer(request_id: str, blocks: int = 4, execute: bool = True, **extra: Any) -> dict:
    ids = list(range(blocks))
    return {
        "context": "ctx",
        "generation": "gen",
        "request_id": request_id,
        "execute": execute,
        "blocks": {"0": {"context": ids, "generation": ids}},
        **extra,
    }


def pair_fleet(api: httpx.Client, num_slots: int = 64) -> dict[str, str]:
    ctx = register(api, "ctx", "context", num_slots=num_slots)
    gen = register(api, "gen", "generation", num_slots=num_slots)
    workers = {"ctx": attach(api, "ctx", ctx), "gen": attach(api, "gen", gen)}
    pair(api, "ctx", "gen")
    return workers


class Beats:
    """Heartbeats for ``worker_ids`` once a second, from a thread."""

    def __init__(self, base: str, worker_ids: list[str]) -> None:
        self.base, self.ids, self.stop = base, worker_ids, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        with httpx.Client(base_url=self.base, timeout=10) as api:
            while not self.stop.wait(1.0):
                for worker_id in self.ids:
                    api.post(f"/v1/workers/{worker_id}/heartbeat")

    def __enter__(self) -> Beats:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


class StreamReader:
    """Reads one worker's command stream in a thread, counting transfer lines."""

    def __init__(self, base: str, worker_id: str) -> None:
        self.base, self.worker_id = base, worker_id
        self.lines: list[dict[str, Any]] = []
        self.hello = threading.Event()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        with (
            httpx.Client(timeout=httpx.Timeout(30, read=60)) as api,
            api.stream("GET", f"{self.base}/v1/workers/{self.worker_id}/commands") as response,
        ):
            for line in response.iter_lines():
                if self.stop.is_set():
                    return
                if line.strip():
                    message = json.loads(line)
                    if message.get("type") == "hello":
                        self.hello.set()
                    elif message.get("type") == "transfer":
                        self.lines.append(message)

    def __enter__(self) -> StreamReader:
        self.thread.start()
        self.hello.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()


# --- rows ------------------------------------------------------------------------------------


def row_1(workers: int) -> str:
    metadata = base64.b64encode(os.urandom(MAX_METADATA_B64 * 3 // 4)).decode()
    with (
        sqlite_url() as url,
        server(url) as (base, pid),
        httpx.Client(base_url=base, timeout=60) as api,
    ):
        body = register(api, "big", "context", tp=8)
        for i in range(workers):  # 400 workers: 50 instances of 8 ranks
            name = f"big{i // 8}"
            if i % 8 == 0:
                register(api, name, "context", tp=8)
            attach(api, name, body, rank=i % 8, metadata_b64=metadata)
        before = rss_mb(pid)
        samples = timed(lambda: api.get("/v1/workers", params={"limit": 1000}), 10)
        peak = rss_mb(pid)

        def four() -> None:
            threads = [
                threading.Thread(
                    target=lambda: httpx.get(
                        f"{base}/v1/workers", params={"limit": 1000}, timeout=60
                    )
                )
                for _ in range(4)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()

        for _ in range(3):
            four()
            peak = max(peak, rss_mb(pid))
    return (
        f"row 1: {workers} workers x {MAX_METADATA_B64 // 1024} KiB metadata: GET /v1/workers "
        f"p50 {p50_ms(samples):.0f} ms; server RSS +{peak - before:.0f} MB over 22 "
        f"listings (4 at a time)"
    )


def row_3(large: int) -> str:
    with (
        sqlite_url() as url,
        server(url) as (base, pid),
        httpx.Client(base_url=base, timeout=60) as api,
    ):
        workers = pair_fleet(api, num_slots=BIG_SLOTS)
        with Beats(base, list(workers.values())):
            # The context worker's stream: opened, then never read.
            raw = socket.create_connection((HOST, int(base.rsplit(":", 1)[1])))
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            raw.sendall(
                f"GET /v1/workers/{workers['ctx']}/commands HTTP/1.1\r\nHost: x\r\n\r\n".encode()
            )
            time.sleep(0.5)
            before = rss_mb(pid)
            peak, disconnected_after = before, None
            started = time.monotonic()
            for i in range(large):
                api.post("/v1/transfers", json=transfer(f"big{i}", blocks=20_000, timeout_s=300))
                peak = max(peak, rss_mb(pid))
                if i % 20 == 0 and disconnected_after is None:
                    listed = {
                        w["id"]: w["connected"] for w in api.get("/v1/workers").json()["items"]
                    }
                    if not listed[workers["ctx"]]:
                        disconnected_after = time.monotonic() - started
                if time.monotonic() - started > 300:
                    break
            raw.close()
    cut = (
        "never"
        if disconnected_after is None
        else f"{disconnected_after:.1f} s after the first push"
    )
    return (
        f"row 3: a never-read stream, {large} transfers of 20,000 blocks: server RSS "
        f"+{peak - before:.0f} MB; shown disconnected {cut}"
    )


def row_4(polls: int) -> str:
    with (
        sqlite_url() as url,
        server(url) as (base, pid),
        httpx.Client(base_url=base, timeout=60) as api,
    ):
        workers = pair_fleet(api)
        with Beats(base, list(workers.values())):
            running = api.post("/v1/transfers", json=transfer("held", timeout_s=120)).json()
            idle_health = timed(lambda: api.get("/healthz"), 50)
            k = iter(range(10**6))
            idle_post = timed(
                lambda: api.post("/v1/transfers", json=transfer(f"p{next(k)}", execute=False)), 50
            )
            held: list[Any] = []

            async def hold() -> None:
                limits = httpx.Limits(max_connections=polls + 10)
                async with httpx.AsyncClient(base_url=base, limits=limits, timeout=120) as client:
                    held.extend(
                        await asyncio.gather(
                            *[
                                client.get(f"/v1/transfers/{running['id']}", params={"wait": 40})
                                for _ in range(polls)
                            ],
                            return_exceptions=True,
                        )
                    )

            thread = threading.Thread(target=lambda: asyncio.run(hold()), daemon=True)
            thread.start()
            time.sleep(12)  # every poll connected and waiting
            cpu0 = cpu_s(pid)
            health = timed(lambda: api.get("/healthz"), 50)
            post = timed(
                lambda: api.post("/v1/transfers", json=transfer(f"p{next(k)}", execute=False)), 50
            )
            busy = cpu_s(pid) - cpu0
            thread.join(timeout=60)
    waited = sum(
        1 for r in held if isinstance(r, httpx.Response) and r.json().get("status") == "running"
    )
    return (
        f"row 4: {polls} held long polls ({waited} answered `running` at the end of their "
        f"40 s wait): /healthz p50 {p50_ms(health):.1f} ms (idle "
        f"{p50_ms(idle_health):.1f}), POST /v1/transfers p50 {p50_ms(post):.1f} ms (idle "
        f"{p50_ms(idle_post):.1f}); server CPU {busy:.2f} s over those 100 requests"
    )


DIRECTORY_PER_S = 10.0  # the server's default pace of a worker's directory reads
DIRECTORY_BURST = 20


def _pairing_figures(count: int) -> tuple[float, float, float, float]:
    """``(directory GET p50 ms, heartbeat server CPU ms, POST p50 idle, POST p50 with 4
    directory pollers)`` with ``count`` pairings of one context instance."""
    with (
        sqlite_url() as url,
        server(url) as (base, pid),
        httpx.Client(base_url=base, timeout=60) as api,
    ):
        ctx = register(api, "ctx", "context")
        ctx_worker = attach(api, "ctx", ctx)
        for i in range(count):
            name = "gen" if i == 0 else f"gen{i}"
            body = register(api, name, "generation")
            attach(api, name, body)
            pair(api, "ctx", name)
        api.get(f"/v1/workers/{ctx_worker}/directory")  # the plans, compiled once
        time.sleep(DIRECTORY_BURST / DIRECTORY_PER_S)  # the pace's burst, whole again

        def paced_read() -> None:  # a read at the worker's pace: what the read itself costs
            api.get(f"/v1/workers/{ctx_worker}/directory")
            time.sleep(1 / DIRECTORY_PER_S)

        directory = [s - 1 / DIRECTORY_PER_S for s in timed(paced_read, 30)]
        cpu0 = cpu_s(pid)
        beats = 200
        timed(lambda: api.post(f"/v1/workers/{ctx_worker}/heartbeat"), beats)
        heartbeat_cpu = (cpu_s(pid) - cpu0) / beats
        k = iter(range(10**6))
        idle = timed(
            lambda: api.post("/v1/transfers", json=transfer(f"i{next(k)}", execute=False)), 50
        )
        stop = threading.Event()

        def poll() -> None:
            with httpx.Client(base_url=base, timeout=60) as poller:
                while not stop.is_set():
                    poller.get(f"/v1/workers/{ctx_worker}/directory")

        # Four clients reading the directory in a tight loop: the server paces them (10 reads a
        # second per worker; a read over the pace waits its turn, up to 1 s, then 429).
        pollers = [threading.Thread(target=poll, daemon=True) for _ in range(4)]
        for thread in pollers:
            thread.start()
        busy = timed(
            lambda: api.post("/v1/transfers", json=transfer(f"b{next(k)}", execute=False)), 50
        )
        stop.set()
        for thread in pollers:
            thread.join(timeout=30)
    return p50_ms(directory), heartbeat_cpu * 1000, p50_ms(idle), p50_ms(busy)


def row_5_6(pairings: int) -> str:
    figures = {count: _pairing_figures(count) for count in (1, pairings)}
    one, many = figures[1], figures[pairings]
    return (
        f"rows 5/6: directory GET p50 {one[0]:.1f} ms at 1 pairing, {many[0]:.1f} ms at "
        f"{pairings}; heartbeat server CPU {one[1]:.2f} / {many[1]:.2f} ms; POST "
        f"/v1/transfers p50 with 4 directory pollers {many[3]:.1f} ms vs idle "
        f"{many[2]:.1f} ms ({pairings} pairings)"
    )


def row_13(replays: int) -> str:
    with (
        sqlite_url() as url,
        server(url) as (base, _),
        httpx.Client(base_url=base, timeout=60) as api,
    ):
        workers = pair_fleet(api)
        with (
            Beats(base, list(workers.values())),
            StreamReader(base, workers["ctx"]) as ctx,
            StreamReader(base, workers["gen"]) as gen,
        ):
            statuses = [
                api.post(
                    "/v1/transfers",
                    json=transfer("replayed", timeout_s=120),
                    headers={"Idempotency-Key": "k1"},
                ).status_code
                for _ in range(replays + 1)
            ]
            time.sleep(1.0)
            lines = len(ctx.lines) + len(gen.lines)
    return (
        f"row 13: 1 POST + {replays} Idempotency-Key replays of a running transfer "
        f"({statuses.count(201)} x 201, {statuses.count(200)} x 200): {lines} command "
        f"lines in the 2 owed ranks' streams"
    )


def row_2(postgres: str, relayed: int) -> str:
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    name = f"kvplane_hostile_{uuid.uuid4().hex[:8]}"
    admin = create_engine(postgres, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(postgres).set(database=name).render_as_string(hide_password=False)
    try:
        upgrade(url)
        with (
            server(url) as (a, _),
            server(url) as (b, _),
            httpx.Client(base_url=a, timeout=60) as on_a,
            httpx.Client(base_url=b, timeout=60) as on_b,
        ):
            workers = pair_fleet(on_a, num_slots=BIG_SLOTS)
            with (
                Beats(a, list(workers.values())),
                StreamReader(a, workers["ctx"]) as ctx,
                StreamReader(a, workers["gen"]) as gen,
            ):
                for i in range(relayed):
                    on_b.post(
                        "/v1/transfers", json=transfer(f"r{i}", blocks=20_000, timeout_s=60)
                    ).raise_for_status()
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline and (
                    len(ctx.lines) < relayed or len(gen.lines) < relayed
                ):
                    time.sleep(0.2)
                reached = min(
                    len({c["xid"] for c in ctx.lines}), len({c["xid"] for c in gen.lines})
                )
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
    return (
        f"row 2: two API processes on PostgreSQL, streams on A: {relayed} transfers of "
        f"20,000 blocks posted to B reached both workers: {reached} of {relayed}"
    )


def probes() -> list[str]:
    out = []
    with (
        sqlite_url() as url,
        server(url) as (base, _),
        httpx.Client(base_url=base, timeout=60) as api,
    ):
        workers = pair_fleet(api)
        victim = register(api, "victim", "generation")
        del victim
        epochs = {
            n: api.get(f"/v1/instances/{n}").json()["epoch"] for n in ("ctx", "gen", "victim")
        }
        pairing = api.get("/v1/pairings").json()["items"][0]["id"]
        now = time.time()

        def record(worker: str, **fields: Any) -> httpx.Response:
            base_record = {
                "request_id": "probe",
                "pairing_id": pairing,
                "context": "ctx",
                "generation": "gen",
                "context_epoch": epochs["ctx"],
                "generation_epoch": epochs["gen"],
                "side": "receive",
                "rank": 0,
                "status": "done",
                "bytes": 1,
                "started_at": now - 0.1,
                "finished_at": now,
                "blocks": {"0": {"context": [0], "generation": [1]}},
            }
            return api.post(
                "/v1/transfers/records",
                json={"worker_id": worker, "records": [{**base_record, **fields}]},
            )

        def code(answer: httpx.Response) -> str:
            body = answer.json()
            return f"{answer.status_code} {body.get('code', body)}"

        out.append(
            "row 8: started_at 100 years ahead -> "
            + code(record(workers["gen"], started_at=now + 3.2e9, finished_at=now + 3.2e9))
        )
        out.append(
            "row 8: a ctx worker naming victim as its peer -> "
            + code(
                record(
                    workers["ctx"],
                    side="send",
                    generation="victim",
                    generation_epoch=epochs["victim"],
                )
            )
        )
        for raw in ("1e12", "Infinity"):
            body = json.dumps(
                {
                    "worker_id": workers["gen"],
                    "records": [
                        {
                            "request_id": "probe",
                            "pairing_id": pairing,
                            "context": "ctx",
                            "generation": "gen",
                            "context_epoch": epochs["ctx"],
                            "generation_epoch": epochs["gen"],
                            "side": "receive",
                            "rank": 0,
                            "status": "done",
                            "bytes": 1,
                            "started_at": now,
                            "finished_at": 0,
                        }
                    ],
                }
            )
            body = body.replace('"finished_at": 0', f'"finished_at": {raw}')
            answer = api.post(
                "/v1/transfers/records", content=body, headers={"Content-Type": "application/json"}
            )
            out.append(f"row 9: finished_at {raw} -> {code(answer)}")
        out.append(
            "row 10: blocks beyond the pool -> "
            + code(
                record(
                    workers["gen"],
                    request_id="bad-blocks",
                    blocks={"0": {"context": [0], "generation": [99_999]}},
                )
            )
        )
        first = record(workers["gen"], request_id="twice", bytes=1000)
        for _ in range(4):
            record(workers["gen"], request_id="twice", bytes=1000)
        moved = [
            line
            for line in api.get("/metrics").text.splitlines()
            if line.startswith('kvplane_moved_bytes_total{kind="receive"}')
        ]
        out.append(f"row 12: one record posted 5 times ({first.status_code}) -> {moved}")
        gen = api.get("/v1/instances/gen").json()
        second = api.post(
            "/v1/workers",
            json={"instance": "gen", "rank": 0, "peer": fake_peer(gen["ranks"][0], "gen.second")},
        )
        out.append(
            f"row 14: a second worker on gen rank 0 -> {second.status_code}; the "
            f"first's heartbeat -> " + code(api.post(f"/v1/workers/{workers['gen']}/heartbeat"))
        )
        bad = fake_peer(gen["ranks"][0], "gen.third")
        bad["metadata_b64"] = "abcde"
        out.append(
            "row 14: undecodable metadata_b64 -> "
            + code(api.post("/v1/workers", json={"instance": "gen", "rank": 0, "peer": bad}))
        )
        with StreamReader(base, workers["ctx"]):
            api.delete(f"/v1/workers/{workers['ctx']}")
            time.sleep(0.3)
            listed = {w["id"]: w["connected"] for w in api.get("/v1/workers").json()["items"]}
        out.append(f"row 15: a DELETEd worker's stream -> connected {listed[workers['ctx']]}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,3,4,5,13,probes")
    parser.add_argument("--workers", type=int, default=400)
    parser.add_argument("--polls", type=int, default=1000)
    parser.add_argument("--pairings", type=int, default=31)
    parser.add_argument("--large", type=int, default=600)
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument("--relayed", type=int, default=10)
    parser.add_argument("--postgres", default=None, help="row 2: a PostgreSQL admin URL")
    args = parser.parse_args()
    rows = set(args.rows.split(","))
    print(
        f"# bench/hostile.py on {socket.gethostname()}, {os.cpu_count()} cores, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        flush=True,
    )
    if "1" in rows:
        print(row_1(args.workers), flush=True)
    if "2" in rows and args.postgres:
        print(row_2(args.postgres, args.relayed), flush=True)
    if "3" in rows:
        print(row_3(args.large), flush=True)
    if "4" in rows:
        print(row_4(args.polls), flush=True)
    if "5" in rows:
        print(row_5_6(args.pairings), flush=True)
    if "13" in rows:
        print(row_13(args.replays), flush=True)
    if "probes" in rows:
        for line in probes():
            print(line, flush=True)


if __name__ == "__main__":
    main()
