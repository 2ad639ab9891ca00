"""HTTP benchmark of the control plane: req/s and p50/p99 per operation, SQLite and PostgreSQL.

A real uvicorn server runs in a child process (or, with ``--in-thread``, a thread of this one);
an httpx client drives it over loopback (one connection per client thread). Operations, each
on a fresh migrated database:

- ``GET /healthz`` (no database: the ceiling of this stack),
- register a TP8 context instance, 8 ranks × 2 views (target + draft), new name each time,
- re-validate a TP8 → TP2 pairing (``POST /v1/pairings/{id}/validate``),
- ``POST /v1/transfers`` with 256 blocks (plan cached after the first request).

The operations take turns in rounds (``--rounds``), so the "vs /healthz" ratios compare
requests sent in the same minutes of the run.

Usage: ``.venv/bin/python bench/api.py [--requests N] [--concurrency C] [--rounds R]
[--postgres URL]``.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from tempfile import TemporaryDirectory

import httpx
import uvicorn
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from api.app import create_app  # noqa: E402
from api.demo_fleet import instance_body  # noqa: E402
from api.migrate import upgrade  # noqa: E402
from api.settings import Settings  # noqa: E402

BLOCKS = 256
DEFAULT_POSTGRES = os.environ.get(
    "KVPLANE_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def serve(database_url: str, *, in_thread: bool = False) -> Iterator[str]:
    """Run the app under uvicorn (a child process, or a thread of this one); yield its base URL."""
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    if in_thread:
        app = create_app(Settings(database_url=database_url))
        server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
        )
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.01)
        try:
            yield base
        finally:
            server.should_exit = True
            thread.join(timeout=10)
        return
    env = {**os.environ, "KVPLANE_DATABASE_URL": database_url}
    command = [sys.executable, "-m", "uvicorn", "--factory", "api.app:create_app"]
    command += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    command += ["--no-access-log"]
    process = subprocess.Popen(command, env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError("the benchmark server did not start")
            time.sleep(0.05)
        yield base
    finally:
        process.terminate()
        process.wait(timeout=10)


@contextmanager
def sqlite_database() -> Iterator[str]:
    with TemporaryDirectory() as tmp:
        url = f"sqlite:///{Path(tmp) / 'bench.db'}"
        upgrade(url)
        yield url


@contextmanager
def postgres_database(admin_url: str) -> Iterator[str]:
    name = f"kvplane_bench_{uuid.uuid4().hex[:8]}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(admin_url).set(database=name).render_as_string(hide_password=False)
    try:
        upgrade(url)
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@dataclass
class Tally:
    """Requests, busy seconds and latencies of one operation, summed over the rounds."""

    requests: int = 0
    elapsed: float = 0.0
    latencies: list[float] = field(default_factory=list)

    def row(self, label: str, name: str, ceiling: float) -> list[str]:
        rate = self.requests / self.elapsed
        quantiles = statistics.quantiles(self.latencies, n=100)
        p50, p99 = quantiles[49] * 1000, quantiles[98] * 1000
        return [label, name, f"{rate:,.0f}", f"{p50:.2f}", f"{p99:.2f}", f"{rate / ceiling:.0%}"]


Call = Callable[[httpx.Client, int], httpx.Response]


def measure(
    base: str, requests: int, concurrency: int, call: Call, start: int, tally: Tally
) -> None:
    """Send ``requests`` calls spread over ``concurrency`` clients; add them to ``tally``.

    Call ``i`` gets the index ``start + i`` (operations that create resources name them by it).
    """
    lock = threading.Lock()
    per_client = max(1, requests // concurrency)

    def worker(client_index: int) -> None:
        with httpx.Client(base_url=base, timeout=30) as client:
            local = []
            for i in range(per_client):
                began = time.perf_counter()
                response = call(client, start + client_index * per_client + i)
                local.append(time.perf_counter() - began)
                if response.status_code >= 300:
                    raise RuntimeError(f"{response.status_code}: {response.text[:300]}")
            with lock:
                tally.latencies.extend(local)

    began = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(worker, range(concurrency)))
    tally.elapsed += time.perf_counter() - began
    tally.requests += per_client * concurrency


def bench_database(
    label: str, url: str, requests: int, concurrency: int, in_thread: bool, rounds: int
) -> list[list[str]]:
    """One row per operation. The operations take turns in ``rounds`` rounds, so that a drift of
    the machine's speed during the run touches every row alike and the ratios stay comparable."""
    context = instance_body(role="context", tp=8, draft_heads=2, num_slots=4096)
    generation = instance_body(role="generation", tp=2, draft_heads=2, num_slots=4096)
    with serve(url, in_thread=in_thread) as base, httpx.Client(base_url=base, timeout=30) as setup:
        setup.put("/v1/instances/ctx", json=context).raise_for_status()
        setup.put("/v1/instances/gen", json=generation).raise_for_status()
        pairing = setup.post("/v1/pairings", json={"context": "ctx", "generation": "gen"})
        pairing.raise_for_status()
        pairing_id = pairing.json()["id"]
        transfer = {
            "context": "ctx",
            "generation": "gen",
            "blocks": {"0": {"context": list(range(BLOCKS)), "generation": list(range(BLOCKS))}},
        }
        cases: list[tuple[str, Call]] = [
            ("GET /healthz (ceiling)", lambda c, i: c.get("/healthz")),
            (
                "PUT instance TP8, 8 ranks x 2 views",
                lambda c, i: c.put(f"/v1/instances/bench-{i}", json=context),
            ),
            (
                "POST pairing validate (TP8->TP2)",
                lambda c, i: c.post(f"/v1/pairings/{pairing_id}/validate"),
            ),
            (
                f"POST /v1/transfers ({BLOCKS} blocks)",
                lambda c, i: c.post("/v1/transfers", json={**transfer, "request_id": f"r{i}"}),
            ),
        ]
        tallies = [Tally() for _ in cases]
        warm_up = max(10, requests // 10)
        for _, call in cases:
            measure(base, warm_up, 1, call, start=10**6, tally=Tally())
        per_round = max(concurrency, requests // rounds)
        for round_ in range(rounds):
            for (_, call), tally in zip(cases, tallies, strict=True):
                measure(base, per_round, concurrency, call, start=round_ * per_round, tally=tally)
    ceiling = tallies[0].requests / tallies[0].elapsed
    return [
        tally.row(label, name, ceiling) for (name, _), tally in zip(cases, tallies, strict=True)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument(
        "--rounds", type=int, default=5, help="operations take turns, requests/rounds at a time"
    )
    parser.add_argument("--postgres", default=DEFAULT_POSTGRES, help="admin URL; '' to skip")
    parser.add_argument(
        "--in-thread", action="store_true", help="server in a thread of this process"
    )
    args = parser.parse_args()

    rows: list[list[str]] = []
    with sqlite_database() as url:
        rows += bench_database(
            "SQLite", url, args.requests, args.concurrency, args.in_thread, args.rounds
        )
    if args.postgres:
        try:
            with postgres_database(args.postgres) as url:
                rows += bench_database(
                    "PostgreSQL", url, args.requests, args.concurrency, args.in_thread, args.rounds
                )
        except Exception as error:  # no server: report, keep the SQLite numbers
            print(f"PostgreSQL skipped: {error.__class__.__name__}: {error}", file=sys.stderr)

    header = ["database", "operation", "req/s", "p50 ms", "p99 ms", "vs /healthz"]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    where = "thread" if args.in_thread else "child process"
    print(
        f"requests={args.requests} concurrency={args.concurrency} rounds={args.rounds} "
        f"server={where}"
    )
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |")


if __name__ == "__main__":
    main()
