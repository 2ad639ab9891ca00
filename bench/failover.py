"""REST latency and throughput before, across and after the death of one of two API processes.

    .venv/bin/python bench/failover.py [--postgres URL] [--requests 200] [--routers 4]

Two ``kvplane serve`` processes (A, B) on a fresh PostgreSQL database (created from ``--postgres``,
default ``KVPLANE_TEST_POSTGRES_URL``, dropped at the end), the demo fleet (six rank processes,
``workers/testing/engine.py``) whose workers are given both URLs, A first: every command stream,
heartbeat and record starts on A. ``--routers`` client threads post ``POST /v1/transfers``
(``execute=true``, 4 blocks, one Idempotency-Key per request) and long-poll ``GET ?wait=30``, each
with both URLs (half of them starting on B). After ``--kill-at`` of the requests finished, A is
SIGKILLed. Latency = POST sent → GET answered ``done``, retries through B included.

Prints one row per phase: finished before the kill; in flight at the kill; started in the first
5 s after it; started later. No pass/fail: a table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script

from sqlalchemy import create_engine, text  # noqa: E402
from sqlalchemy.engine import make_url  # noqa: E402

from api.client import Client  # noqa: E402
from api.migrate import upgrade  # noqa: E402
from workers.testing.engine import (  # noqa: E402
    CONTEXT,
    GENERATION,
    ControlPlane,
    Fleet,
    percentile,
)

BLOCKS = 4
NUM_SLOTS = 64
AFTER_WINDOW_S = 5.0
DEFAULT_POSTGRES = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def burst(
    urls: list[str], *, requests: int, routers: int, tag: str, on_progress: Any
) -> list[dict[str, Any]]:
    """``routers`` threads, each its own block lane, until ``requests`` transfers finished."""
    results: list[dict[str, Any]] = []
    lock = threading.Lock()
    counter = iter(range(requests))

    def router(lane: int) -> None:
        order = urls if lane % 2 == 0 else urls[::-1]
        ids = list(range(lane * BLOCKS, (lane + 1) * BLOCKS))
        with Client(order, retries=30, backoff_s=0.1, max_backoff_s=1.0) as client:
            while True:
                with lock:
                    k = next(counter, None)
                if k is None:
                    return
                body = {
                    "context": CONTEXT,
                    "generation": GENERATION,
                    "request_id": f"{tag}-{k}",
                    "execute": True,
                    "blocks": {"0": {"context": ids, "generation": ids}},
                }
                started = time.time()
                try:
                    read = client.create_transfer(body, idempotency_key=f"{tag}-{k}")
                    for _ in range(10):
                        if read["status"] not in ("queued", "running"):
                            break
                        read = client.get_transfer(read["id"], wait_s=30)
                    status = read["status"]
                except Exception as error:
                    status = f"{type(error).__name__}: {error}"
                with lock:
                    results.append({"started": started, "finished": time.time(), "status": status})
                    on_progress(len(results))

    threads = [threading.Thread(target=router, args=(lane,)) for lane in range(routers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def phases(results: list[dict[str, Any]], killed_at: float) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {
        "before the kill": [],
        "in flight at the kill": [],
        f"first {AFTER_WINDOW_S:.0f} s after": [],
        "later": [],
    }
    for r in results:
        if r["finished"] < killed_at:
            out["before the kill"].append(r)
        elif r["started"] <= killed_at:
            out["in flight at the kill"].append(r)
        elif r["started"] <= killed_at + AFTER_WINDOW_S:
            out[f"first {AFTER_WINDOW_S:.0f} s after"].append(r)
        else:
            out["later"].append(r)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--postgres", default=os.environ.get("KVPLANE_TEST_POSTGRES_URL", DEFAULT_POSTGRES)
    )
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--routers", type=int, default=4)
    parser.add_argument(
        "--kill-at",
        type=float,
        default=0.3,
        help="fraction of the requests finished when A is killed",
    )
    args = parser.parse_args(argv)
    if args.routers * BLOCKS > NUM_SLOTS:
        parser.error(f"at most {NUM_SLOTS // BLOCKS} routers")

    name = f"kvplane_failover_{uuid.uuid4().hex[:10]}"
    admin = create_engine(args.postgres, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(args.postgres).set(database=name).render_as_string(hide_password=False)
    try:
        upgrade(url)
        with tempfile.TemporaryDirectory(prefix="kvplane-failover-") as tmp:
            work = Path(tmp)
            servers = []
            for side in ("a", "b"):
                (work / side).mkdir()
                servers.append(ControlPlane(work / side, env={"KVPLANE_DATABASE_URL": url}))
            fleet = Fleet(work, num_slots=NUM_SLOTS, servers=servers)
            try:
                fleet.start()
                a, b = servers
                burst(
                    [a.url, b.url],
                    requests=2 * args.routers,
                    routers=args.routers,
                    tag="warm",
                    on_progress=lambda n: None,
                )
                killed: dict[str, float] = {}
                kill_after = max(1, int(args.requests * args.kill_at))

                def progress(done: int) -> None:
                    if done >= kill_after and "at" not in killed:
                        killed["at"] = time.time()
                        threading.Thread(target=a.kill).start()

                results = burst(
                    [a.url, b.url],
                    requests=args.requests,
                    routers=args.routers,
                    tag="burst",
                    on_progress=progress,
                )
                stats = fleet.call_all("stats")
            finally:
                fleet.stop()
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()

    print(
        f"\n{args.requests} REST transfers ({BLOCKS} blocks, {args.routers} in flight) on two "
        f"API processes; A SIGKILLed after {kill_after}. Load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs.\n"
    )
    print("| phase | n | failed | p50 ms | p99 ms | max ms | transfers/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for phase, rows in phases(results, killed["at"]).items():
        done = [r for r in rows if r["status"] == "done"]
        lat = [(r["finished"] - r["started"]) * 1000 for r in done]
        span = (max(r["finished"] for r in rows) - min(r["started"] for r in rows)) if rows else 0
        rate = f"{len(rows) / span:.1f}" if span > 0 else "–"
        cells = (
            f"{percentile(lat, 50):.0f} | {percentile(lat, 99):.0f} | {max(lat):.0f}"
            if lat
            else "– | – | –"
        )
        print(f"| {phase} | {len(rows)} | {len(rows) - len(done)} | {cells} | {rate} |")
    print(
        f"\ncommands re-sent after the kill and dropped by workers: "
        f"{sum(s['duplicate_commands'] for s in stats)}; workers now on "
        f"{sorted({s['control_plane'] for s in stats})}"
    )
    failed = [r["status"] for r in results if r["status"] != "done"]
    if failed:
        print(f"not done: {failed[:5]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
