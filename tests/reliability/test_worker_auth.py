"""Real `kvplane worker` processes against a server with auth on: a worker token bound to the
instance (``KVPLANE_TOKEN``) attaches, holds its command stream and runs a pushed, verified NIXL
transfer end to end (``execute=true``, ``verify=true``: crc32 on both sides and every byte of the
fill pattern checked); a worker holding another instance's token is refused (403) and exits, and
that token gets 403 on the other instance's worker directory, command stream and records."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from api.auth import create_token
from api.client import ApiError, Client
from api.db import Database

from .conftest import ROOT, Server, fleet_bodies, transfer_body

pytest.importorskip("nixl")
pytest.importorskip("torch")
pytestmark = pytest.mark.slow


def token(db_url: str, scope: str, instance: str | None = None) -> str:
    db = Database(db_url)
    try:
        with db.write() as session:
            return create_token(session=session, scope=scope, instance=instance)[1]
    finally:
        db.dispose()


def spawn_worker(url: str, instance: str, secret: str, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "KVPLANE_TOKEN": secret}
    with log.open("wb") as out:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cli",
                "worker",
                "--control-plane",
                url,
                "--instance",
                instance,
                "--rank",
                "0",
                "--fill-pattern",
                "--staging-mib",
                "16",
            ],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def test_workers_run_a_verified_transfer_with_tokens(
    sqlite_url: str, start_server: Callable[..., Server], tmp_path: Path
) -> None:
    server = start_server(sqlite_url, auth="true")
    ctx, gen = fleet_bodies(ctx_tp=1, gen_tp=1)
    with Client(server.url, token=token(sqlite_url, "instance", "ctx")) as c:
        c.register_instance("ctx", ctx)
    with Client(server.url, token=token(sqlite_url, "instance", "gen")) as c:
        c.register_instance("gen", gen)
    workers = []
    try:
        wrong = token(sqlite_url, "worker", "ctx")
        intruder = spawn_worker(server.url, "gen", wrong, tmp_path / "intruder.log")
        assert intruder.wait(timeout=120) != 0
        intruder_log = (tmp_path / "intruder.log").read_text()
        assert "forbidden" in intruder_log
        assert wrong not in intruder_log and wrong[4:20] not in intruder_log
        for name in ("ctx", "gen"):
            workers.append(
                spawn_worker(
                    server.url,
                    name,
                    token(sqlite_url, "worker", name),
                    tmp_path / f"worker-{name}.log",
                )
            )
        with Client(server.url, token=token(sqlite_url, "operator")) as op:
            assert op.create_pairing("ctx", "gen")["compatible"]
            deadline = time.monotonic() + 120
            while (
                sum(w["status"] == "alive" and w["connected"] for w in op.list_workers()["items"])
                < 2
            ):
                assert time.monotonic() < deadline, [
                    (tmp_path / f"worker-{n}.log").read_text()[-2000:] for n in ("ctx", "gen")
                ]
                assert all(w.poll() is None for w in workers)
                time.sleep(0.2)
            transfer = op.create_transfer(transfer_body("r1", execute=True, verify=True))
            done = op.get_transfer(transfer["id"], wait_s=60)
            assert done["status"] == "done", done
            # The receiver compared both sums before it said arrived: the sender's part decides
            # nothing and comes with its worker's next batch of records (about a second).
            parts = op.list_parts(transfer["id"])["items"]
            give_up = time.monotonic() + 15
            while len(parts) < 2 and time.monotonic() < give_up:
                time.sleep(0.2)
                parts = op.list_parts(transfer["id"])["items"]
            assert sorted((p["kind"], p["instance"], p["state"]) for p in parts) == [
                ("receive", "gen", "done"),
                ("send", "ctx", "done"),
            ]
            receive = next(p for p in parts if p["kind"] == "receive")
            assert receive["result"]["verified_bytes"] > 0  # the fill pattern was checked
            checksums = {p["kind"]: [r["checksum"] for r in p["result"]["routes"]] for p in parts}
            assert checksums["send"] == checksums["receive"] and None not in checksums["send"]
            gen_worker = next(
                w for w in op.list_workers(instance="gen")["items"] if w["status"] == "alive"
            )

        # A worker token of ctx may not act for gen's worker.
        with Client(server.url, token=wrong, retries=0) as intruder_client:
            record = {
                "transfer_id": transfer["id"],
                "request_id": "r1",
                "pairing_id": "p",
                "context": "ctx",
                "generation": "gen",
                "context_epoch": "e",
                "generation_epoch": "e",
                "side": "receive",
                "rank": 0,
                "status": "failed",
                "error": "forged",
                "bytes": 0,
                "started_at": 1.0,
                "finished_at": 1.0,
            }
            for call in (
                lambda: intruder_client.get_directory(gen_worker["id"]),
                lambda: next(iter(intruder_client.stream_commands(gen_worker["id"]))),
                lambda: intruder_client.record_transfers(gen_worker["id"], [record]),
                lambda: intruder_client.heartbeat(gen_worker["id"]),
            ):
                with pytest.raises(ApiError) as caught:
                    call()
                assert caught.value.status == 403, caught.value
        with Client(server.url, token=token(sqlite_url, "operator")) as op:
            assert op.get_transfer(transfer["id"])["status"] == "done"  # nothing forged
    finally:
        for worker in workers:
            worker.terminate()
        for worker in workers:
            try:
                worker.wait(timeout=20)
            except subprocess.TimeoutExpired:
                worker.kill()
