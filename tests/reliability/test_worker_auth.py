"""Real `kvplane worker` processes against a server with auth on: a worker token bound to the
instance (``KVPLANE_TOKEN``) attaches, claims and runs a verified NIXL transfer; a worker holding
another instance's token is refused (403) and exits."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from api.auth import create_token
from api.client import Client
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
                "api.cli",
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
            while sum(w["status"] == "alive" for w in op.list_workers()["items"]) < 2:
                assert time.monotonic() < deadline, [
                    (tmp_path / f"worker-{n}.log").read_text()[-2000:] for n in ("ctx", "gen")
                ]
                assert all(w.poll() is None for w in workers)
                time.sleep(0.2)
            transfer = op.create_transfer({**transfer_body("r1", execute=True), "verify": True})
            done = op.get_transfer(transfer["id"], wait_s=60)
            assert done["status"] == "done", done
    finally:
        for worker in workers:
            worker.terminate()
        for worker in workers:
            try:
                worker.wait(timeout=20)
            except subprocess.TimeoutExpired:
                worker.kill()
