"""8 processes x 100 mixed requests against one real server process, on SQLite and PostgreSQL.

Registrations of distinct instances, pairings, planned transfers (execute=false), worker claims
(and completions) and reads, all at once. Afterwards: zero 5xx other than 503 with Retry-After,
every row exactly once (counts checked on the database), no job claimed twice.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import create_engine, func, select

from api.client import Client
from api.models import InstanceRow, JobRow, PairingRow, TransferRow

from .conftest import Heartbeats, Server, setup_fleet, transfer_body

pytestmark = pytest.mark.slow

PROCESSES = 8
EXECUTED = 20  # executed transfers queued before the load: their jobs are what claims find
LOAD_CLIENT = Path(__file__).with_name("load_client.py")


def test_eight_processes_mixed_load(
    db_url: str, start_server: Callable[..., Server], tmp_path: Path
) -> None:
    server = start_server(db_url)
    with Client(server.url) as client:
        workers = setup_fleet(client)
        executed = [
            client.create_transfer(transfer_body(f"exec-{i}", execute=True))["id"]
            for i in range(EXECUTED)
        ]
        jobs_before = {job["id"] for job in client.list_jobs(limit=1000)}
    worker_ids = json.dumps(list(workers.values()))
    with Heartbeats(server.url, list(workers.values())):
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    str(LOAD_CLIENT),
                    server.url,
                    str(i),
                    worker_ids,
                    str(tmp_path / f"load-{i}.json"),
                ]
            )
            for i in range(PROCESSES)
        ]
        assert [proc.wait(timeout=240) for proc in procs] == [0] * PROCESSES
    results = [json.loads((tmp_path / f"load-{i}.json").read_text()) for i in range(PROCESSES)]

    assert [r["requests"] for r in results] == [100] * PROCESSES
    assert [bad for r in results for bad in r["bad"]] == []
    statuses: Counter[str] = Counter()
    for r in results:
        statuses.update(r["statuses"])
    assert all(int(code) < 500 or code == "503" for code in statuses), statuses

    claimed = [job_id for r in results for job_id in r["claimed"]]
    assert len(claimed) == len(set(claimed)), "a job was claimed twice"
    assert set(claimed) <= jobs_before

    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:

            def count(model, *where) -> int:  # type: ignore[no-untyped-def]
                return int(conn.scalar(select(func.count()).select_from(model).where(*where)))

            assert count(InstanceRow) == 2 + PROCESSES * 21
            assert count(PairingRow) == 1 + PROCESSES * 20
            assert count(TransferRow, TransferRow.request_id.like("load-%")) == PROCESSES * 30
            assert count(TransferRow) == EXECUTED + PROCESSES * 30
            distinct = conn.scalar(
                select(func.count(func.distinct(TransferRow.request_id))).where(
                    TransferRow.request_id.like("load-%")
                )
            )
            assert distinct == PROCESSES * 30
            assert count(JobRow) == len(jobs_before)
            done = set(conn.scalars(select(JobRow.id).where(JobRow.state == "done")))
            assert set(claimed) == done
    finally:
        engine.dispose()
    assert executed

    latencies = sorted(x for r in results for x in r["latencies"])
    retries = Counter[str]()
    for r in results:
        retries.update(r["retries"])
    print(
        f"load {db_url.split(':')[0]}: {sum(statuses.values())} responses {dict(statuses)}, "
        f"retries {dict(retries)}, jobs claimed {len(claimed)}/{len(jobs_before)}, "
        f"p50 {statistics.median(latencies) * 1000:.1f} ms, "
        f"p99 {latencies[int(len(latencies) * 0.99)] * 1000:.1f} ms"
    )
