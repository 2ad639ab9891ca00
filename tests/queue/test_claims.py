"""Real concurrent processes claim: every job is leased exactly once (SQLite, PostgreSQL)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select

from api.db import Database
from api.models import JobRow

from .conftest import Heartbeats, attach_worker, setup_fleet, submit

CLAIMER = Path(__file__).with_name("claimer.py")
PROCESSES = 4
TRANSFERS = 60


@pytest.mark.slow
def test_concurrent_processes_claim_every_job_exactly_once(db: Database, db_url: str,
                                                           tmp_path: Path) -> None:
    fleet = setup_fleet(db, ctx_tp=1, gen_tp=1)
    ids = [submit(db, f"req-{i}", mode="fragments") for i in range(TRANSFERS)]
    assert len(set(ids)) == TRANSFERS
    # several workers serve the same rank (a standby, or a restart overlapping the old one)
    workers = [attach_worker(db, "ctx", 0, f"ctx.r0.p{i}") for i in range(PROCESSES)]
    outputs = [tmp_path / f"claims-{i}.json" for i in range(PROCESSES)]
    go = tmp_path / "go"
    with Heartbeats(db, [fleet["workers"][("gen", 0)], *workers]):
        processes = [
            subprocess.Popen([sys.executable, str(CLAIMER), db_url, worker, str(out), str(go)])
            for worker, out in zip(workers, outputs, strict=True)
        ]
        # Every process connected before any claims: otherwise the first one up could drain
        # the queue alone while the others still import.
        deadline = time.monotonic() + 120
        while not all(Path(f"{out}.ready").exists() for out in outputs):
            assert all(p.poll() is None for p in processes), "a claiming process died"
            assert time.monotonic() < deadline, "the claiming processes did not start"
            time.sleep(0.01)
        go.touch()
        for process in processes:
            assert process.wait(timeout=240) == 0, "a claiming process failed"
    claims = [job for out in outputs for job in json.loads(out.read_text())]
    with db.read() as session:
        all_jobs = set(session.scalars(select(JobRow.id)))
        states = {state: count for state, count in session.execute(
            select(JobRow.state, func.count()).group_by(JobRow.state))}
    assert len(claims) == len(set(claims)), "a job was claimed twice"
    assert set(claims) == all_jobs, "a job was never claimed"
    assert states == {"done": TRANSFERS}
    # the load really was shared between the processes
    assert sum(1 for out in outputs if json.loads(out.read_text())) >= 2
