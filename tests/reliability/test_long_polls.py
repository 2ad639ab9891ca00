"""Long polls do not starve the server: many waiting claims and transfer polls, and a plain
request still gets its answer while every one of them is still waiting."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx

from .conftest import Server, fleet_bodies, worker_body

WAITERS = 60  # more than the server's thread pool (40 threads by default)
WAIT_S = 10.0


def test_a_plain_request_is_answered_while_sixty_long_polls_wait(
    sqlite_url: str, start_server: Callable[..., Server]
) -> None:
    server = start_server(sqlite_url)
    ctx, gen = fleet_bodies(ctx_tp=1, gen_tp=1)
    with httpx.Client(base_url=server.url, timeout=30) as client:
        client.put("/v1/instances/ctx", json=ctx).raise_for_status()
        client.put("/v1/instances/gen", json=gen).raise_for_status()
        worker = client.post("/v1/workers", json=worker_body("ctx", ctx["ranks"][0], "ctx.r0"))
        worker.raise_for_status()
        worker_id = worker.json()["id"]

    answers: list[int] = []
    lock = threading.Lock()

    def wait_for_a_job() -> None:
        with httpx.Client(base_url=server.url, timeout=60) as waiter:
            response = waiter.post("/v1/jobs/claim", json={"worker_id": worker_id,
                                                           "wait_s": WAIT_S})
        with lock:
            answers.append(response.status_code)

    threads = [threading.Thread(target=wait_for_a_job) for _ in range(WAITERS)]
    for thread in threads:
        thread.start()
    time.sleep(2.0)  # let every claim reach the server and start waiting
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            listed = client.get("/v1/instances")
            with lock:
                finished_before = len(answers)
    finally:
        for thread in threads:
            thread.join(60)
    assert listed.status_code == 200 and listed.json()["total"] == 2
    # The listing did not queue behind the waiting claims (they all ran out their WAIT_S).
    assert finished_before == 0
    assert answers == [204] * WAITERS
