"""8 processes x 120 mixed requests against one real server process, on SQLite and PostgreSQL.

Registrations of distinct instances, pairings, planned transfers (execute=false), executed
transfers pushed over the command streams of three fake workers (``conftest.FakeWorker``), the
workers' records (each batch sent twice at once, as after a lost answer), ``GET ?wait=``
long-polls and reads, all at once. Afterwards: zero 5xx other than 503 with Retry-After, every
row exactly once (counts checked on the database), every executed transfer ``done`` and no part
recorded twice.
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

from .conftest import FakeFleet, Heartbeats, Server, setup_fleet

pytestmark = pytest.mark.slow

PROCESSES = 8
INSTANCES, EXTRA, REQUESTS = 20, 10, 120  # per process (load_client.py)
LOAD_CLIENT = Path(__file__).with_name("load_client.py")


def test_eight_processes_mixed_load(
    db_url: str, start_server: Callable[..., Server], tmp_path: Path
) -> None:
    server = start_server(db_url)
    with Client(server.url) as client:
        workers = setup_fleet(client)
    with (
        Heartbeats(server.url, list(workers.values())) as beats,
        FakeFleet(server.url, workers, resend=True) as fleet,
    ):
        fleet.wait_streams()
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    str(LOAD_CLIENT),
                    server.url,
                    str(i),
                    str(tmp_path / f"load-{i}.json"),
                ]
            )
            for i in range(PROCESSES)
        ]
        assert [proc.wait(timeout=280) for proc in procs] == [0] * PROCESSES
        # A sender's part does not decide its transfer: the senders may still be reading.
        for worker in fleet:
            worker.wait_commands(PROCESSES * INSTANCES)
        recorders = [worker.recorder for worker in fleet]
        assert all(worker.recorder.flush(30) for worker in fleet)
        commands = {key: len(fleet[key].commands) for key in workers}
        errors = [error for worker in fleet for error in worker.errors]
    assert beats.refused == []
    assert errors == []
    # Concurrent record batches (three workers, each batch twice) never deadlock on the database.
    assert "deadlock detected" not in server.log.read_text()
    assert sum(r.dropped for r in recorders) == 0
    results = [json.loads((tmp_path / f"load-{i}.json").read_text()) for i in range(PROCESSES)]

    assert [r["requests"] for r in results] == [REQUESTS] * PROCESSES
    assert [bad for r in results for bad in r["bad"]] == []
    statuses: Counter[str] = Counter()
    for r in results:
        statuses.update(r["statuses"])
    assert all(int(code) < 500 or code == "503" for code in statuses), statuses
    executed = [transfer_id for r in results for transfer_id in r["executed"]]
    assert len(executed) == len(set(executed)) == PROCESSES * INSTANCES
    settled: Counter[str] = Counter()
    for r in results:
        settled.update(r["settled"])
    assert settled == {"done": PROCESSES * INSTANCES}
    # Every rank's worker got exactly one command per executed transfer.
    assert set(commands.values()) == {PROCESSES * INSTANCES}, commands

    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:

            def count(model, *where) -> int:  # type: ignore[no-untyped-def]
                return int(conn.scalar(select(func.count()).select_from(model).where(*where)))

            assert count(InstanceRow) == 2 + PROCESSES * (INSTANCES + 1)
            assert count(PairingRow) == 1 + PROCESSES * INSTANCES
            planned = PROCESSES * (INSTANCES + EXTRA)
            assert count(TransferRow, TransferRow.request_id.like("load-%")) == planned
            assert count(TransferRow, TransferRow.request_id.like("exec-%")) == len(executed)
            assert count(TransferRow) == planned + len(executed)
            distinct = conn.scalar(select(func.count(func.distinct(TransferRow.request_id))))
            assert distinct == planned + len(executed)
            assert (
                count(TransferRow, TransferRow.execute.is_(True), TransferRow.status != "done") == 0
            )
            # One part per rank taking part (ctx r0, ctx r1 send; gen r0 receives), never two.
            assert count(JobRow) == 3 * len(executed)
            parts = conn.execute(
                select(JobRow.transfer_id, JobRow.attempt, JobRow.kind, JobRow.rank)
            ).all()
            assert len(set(parts)) == len(parts) == 3 * len(executed)
            assert {row[0] for row in parts} == set(executed)
    finally:
        engine.dispose()

    latencies = sorted(x for r in results for x in r["latencies"])
    waits = sorted(x for r in results for x in r["waits"])
    retries = Counter[str]()
    for r in results:
        retries.update(r["retries"])
    print(
        f"load {db_url.split(':')[0]}: {sum(statuses.values())} responses {dict(statuses)}, "
        f"retries {dict(retries)}, {len(executed)} executed transfers done, "
        f"{sum(r.posted for r in recorders)} records posted (+ as many resent), "
        f"p50 {statistics.median(latencies) * 1000:.1f} ms, "
        f"p99 {latencies[int(len(latencies) * 0.99)] * 1000:.1f} ms, "
        f"?wait p50 {statistics.median(waits) * 1000:.1f} ms"
    )
