"""A claiming process for the queue tests: ``python claimer.py DB_URL WORKER_ID OUT.json GO``.

Connects, writes ``OUT.json.ready``, waits for the file ``GO`` (so that every process starts
claiming at once, whatever its start-up time), then claims and completes jobs of its worker's
rank until none is left, and writes the claimed ids.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from api.db import Database, utcnow
from api.schemas_exec import JobComplete
from api.services import jobs

START_TIMEOUT_S = 120.0


def main(url: str, worker_id: str, out: str, go: str) -> None:
    db = Database(url)
    with db.read() as session:  # connected before it says it is ready
        jobs.list_jobs(session=session, limit=1)
    Path(out + ".ready").touch()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not Path(go).exists():
        if time.monotonic() > deadline:
            raise SystemExit("the test never said go")
        time.sleep(0.005)
    claimed: list[str] = []
    try:
        while True:
            with db.write() as session:
                job = jobs.claim_job(session=session, worker_id=worker_id, now=utcnow())
                if job is None:
                    break
                job_id, token = job.id, str(job.lease_token)
            claimed.append(job_id)
            with db.write() as session:
                jobs.complete_job(
                    session=session,
                    job_id=job_id,
                    body=JobComplete(lease_token=token, bytes=1, duration_s=0.0),
                    now=utcnow(),
                )
    finally:
        db.dispose()
        Path(out).write_text(json.dumps(claimed))


if __name__ == "__main__":
    main(*sys.argv[1:5])
