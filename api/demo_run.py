"""``kvplane demo``: the main job, end to end, on one machine.

1. start a control plane (uvicorn, fresh SQLite file) on 127.0.0.1;
2. register a context instance (TP4; an 8-head target view and a 2-head draft view sharing one
   pool) and a generation instance (TP2), and pair them;
3. start six real worker processes on the CPU (four context ranks, two generation ranks), every
   pool filled with the (rank, pool, byte) pattern;
4. transfer ``blocks`` blocks through real NIXL on loopback, staged and then per-fragment, each
   verified: every generation byte is checked by its worker (written bytes carry the sender's
   pattern, all others are untouched) and every route's sender/receiver crc32 must agree;
5. print a table and stop everything.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from api.client import ApiError, Client
from api.geometry.builders import ViewSpec, instance_body

CONTEXT = "demo-ctx-tp4"
GENERATION = "demo-gen-tp2"
WORKER_START_TIMEOUT_S = 120.0


def demo_bodies(num_slots: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The demo fleet: Llama-like 8-head target (4 layers) + 2-head one-layer draft, bf16, HND."""
    views = [ViewSpec("target", 4, 8, 128), ViewSpec("draft", 1, 2, 128)]
    context = instance_body(role="context", views=views, tp=4, num_slots=num_slots,
                            model="demo-llama")
    generation = instance_body(role="generation", views=views, tp=2, num_slots=num_slots,
                               model="demo-llama")
    return context, generation


def _spawn(args: list[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with log_path.open("wb") as log_file:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


def _wait_for(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except (ApiError, OSError, httpx.HTTPError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def _stop(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 15
    for process in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=5)


def run_demo(*, blocks: int, port: int, database: Path, keep_running: bool,
             host: str = "127.0.0.1") -> int:
    """Run the demo; returns the process exit code (0 only if every byte verified)."""
    database.parent.mkdir(parents=True, exist_ok=True)
    for suffix in ("", "-wal", "-shm"):
        Path(f"{database}{suffix}").unlink(missing_ok=True)
    logs = database.parent / "demo-logs"
    logs.mkdir(exist_ok=True)
    # The demo's own control plane listens on loopback only, without auth.
    env = {**os.environ, "KVPLANE_DATABASE_URL": f"sqlite:///{database.resolve()}",
           "KVPLANE_AUTH": "false"}
    kvplane = [sys.executable, "-m", "api.cli"]
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    processes: list[subprocess.Popen[bytes]] = []
    try:
        print(f"control plane: {url} (database {database}, logs in {logs}/)")
        processes.append(_spawn([*kvplane, "serve", "--host", host, "--port", str(port)],
                                logs / "server.log", env))
        client = Client(url, retries=2)
        _wait_for(lambda: client._http.get("/readyz").status_code == 200, 60, "the server")

        context, generation = demo_bodies(num_slots=max(2 * blocks, 128))
        client.register_instance(CONTEXT, context)
        client.register_instance(GENERATION, generation)
        pairing = client.create_pairing(CONTEXT, GENERATION)
        if not pairing["compatible"]:
            print("pairing refused:", pairing["errors"])
            return 1
        print(f"pairing {pairing['id']}: compatible, {len(pairing['warnings'])} warning(s)")

        for name, world in ((CONTEXT, 4), (GENERATION, 2)):
            for rank in range(world):
                processes.append(_spawn(
                    [*kvplane, "worker", "--control-plane", url, "--instance", name,
                     "--rank", str(rank), "--fill-pattern", "--staging-mib", "64"],
                    logs / f"worker-{name}-{rank}.log", env))
        _wait_for(
            lambda: sum(w["status"] == "alive" for w in client.list_workers()["items"]) == 6,
            WORKER_START_TIMEOUT_S, "six workers to attach")
        print("workers: 6 attached (4 context ranks, 2 generation ranks), pools pattern-filled")

        context_ids = list(range(blocks))
        # Prefix caching on the generation side would shorten its list; here the ids differ
        # so that a copy to the wrong slot is caught.
        generation_ids = [blocks + i for i in range(blocks)]
        rows = []
        ok = True
        for mode in ("staged", "fragments"):
            transfer = client.create_transfer({
                "context": CONTEXT, "generation": GENERATION, "request_id": f"demo-{mode}",
                "blocks": {"0": {"context": context_ids, "generation": generation_ids}},
                "execute": True, "mode": mode, "verify": True,
            })
            done = client.get_transfer(transfer["id"], wait_s=60)
            jobs = client.list_parts(transfer["id"])["items"]
            verified = sum((job["result"] or {}).get("verified_bytes") or 0 for job in jobs
                           if job["state"] == "done")
            runs = sum(route["runs"] for route in done["routes"])
            seconds = done["duration_s"] or float("nan")
            sends = [job["result"]["duration_s"] for job in jobs
                     if job["kind"] == "send" and job["state"] == "done"]
            wire = max(sends, default=float("nan"))
            rows.append((mode, done["status"], done["bytes"], seconds, wire,
                         done["bytes"] / wire / 1e9, done["fragments"], runs, verified))
            if done["status"] != "done":
                ok = False
                print(f"{mode}: {done['status']}: {done['error']}")
        header = (f"| {'mode':<9} | {'status':<6} | {'bytes':>11} | {'end-to-end s':>12} | "
                  f"{'send jobs s':>11} | {'GB/s':>6} | {'fragments':>9} | {'runs':>5} | "
                  f"{'verified bytes':>14} |")
        print()
        print(header)
        print("|" + "|".join("-" * len(cell) for cell in header.split("|")[1:-1]) + "|")
        for mode, status, nbytes, seconds, wire, rate, fragments, runs, verified in rows:
            print(f"| {mode:<9} | {status:<6} | {nbytes:>11,} | {seconds:>12.3f} | "
                  f"{wire:>11.3f} | {rate:>6.2f} | {fragments:>9,} | {runs:>5} | "
                  f"{verified:>14,} |")
        print()
        print("end-to-end: first claim to done (claims, NIXL connection set-up, the receivers' "
              "full-pool verification); send jobs: the slowest sender's gather + NIXL writes; "
              "GB/s = bytes / send jobs s (with verify, both include the sender's crc32). "
              "Per-fragment mode moves no bytes on the receivers; its receive jobs only wait "
              "for the writes and check them.")
        print()
        print("verified: every byte of both generation ranks' pools (written bytes carry the "
              "sending rank's pattern, all others are untouched), and sender/receiver crc32 of "
              "every route" if ok else "FAILED: see above and the logs")
        if keep_running:
            print(f"left running: {url} (dashboard at /, API docs at /docs); Ctrl-C stops")
            try:
                while True:
                    time.sleep(1)
            except KeyboardInterrupt:
                pass
        return 0 if ok else 1
    finally:
        # Workers first (they deregister through the server), then the server.
        _stop(processes[1:])
        _stop(processes[:1])
