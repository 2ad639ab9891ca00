"""Long polls do not starve the server: sixty ``GET /v1/transfers/{id}?wait=`` waiters and a
score of open command streams, and a plain request still gets its answer while every one of them
is still waiting. When the workers' records then arrive, every waiter wakes with ``done``."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx

from api.client import Client

from .conftest import (
    FakeFleet,
    Heartbeats,
    Server,
    fleet_bodies,
    transfer_body,
    worker_body,
)

WAITERS = 60  # more than the server's thread pool (40 threads by default)
EXTRA_STREAMS = 20  # idle workers (of idle instances) holding their command streams open too
WAIT_S = 30.0


def test_a_plain_request_is_answered_while_sixty_long_polls_wait(
    sqlite_url: str, start_server: Callable[..., Server]
) -> None:
    server = start_server(sqlite_url)
    ctx, gen = fleet_bodies(ctx_tp=1, gen_tp=1)
    with Client(server.url) as client:
        client.register_instance("ctx", ctx)
        client.register_instance("gen", gen)
        assert client.create_pairing("ctx", "gen")["compatible"]
        # A rank has one worker: the idle streams belong to idle instances of their own.
        for i in range(EXTRA_STREAMS):
            client.register_instance(f"idle{i}", ctx)
        idle = {
            (f"idle{i}", 0): client.register_worker(
                worker_body(f"idle{i}", ctx["ranks"][0], f"idle{i}.r0")
            )["id"]
            for i in range(EXTRA_STREAMS)
        }
        workers = {
            (name, 0): client.register_worker(worker_body(name, body["ranks"][0], f"{name}.r0"))[
                "id"
            ]
            for name, body in (("ctx", ctx), ("gen", gen))
        }
        with (
            Heartbeats(server.url, list(workers.values())),
            FakeFleet(server.url, idle | workers, hold=True) as fleet,
        ):
            fleet.wait_streams()
            transfer_ids = [
                client.create_transfer(transfer_body(f"r{i}", execute=True))["id"]
                for i in range(WAITERS)
            ]
            fleet[("ctx", 0)].wait_commands(WAITERS)
            fleet[("gen", 0)].wait_commands(WAITERS)
            listed, finished_before, answers = wait_and_list(server, transfer_ids, fleet)
            assert all(not fleet[key].commands for key in idle)
    assert listed.status_code == 200 and listed.json()["total"] == 2 + EXTRA_STREAMS
    # The listing did not queue behind the waiting long-polls (none had returned yet) ...
    assert finished_before == 0
    # ... and every waiter woke with its transfer settled, not at the end of its wait.
    assert sorted(answers) == sorted((t, "done") for t in transfer_ids)


def wait_and_list(
    server: Server, transfer_ids: list[str], fleet: FakeFleet
) -> tuple[httpx.Response, int, list[tuple[str, str]]]:
    answers: list[tuple[str, str]] = []
    lock = threading.Lock()
    started = threading.Semaphore(0)

    def wait_for(transfer_id: str) -> None:
        with httpx.Client(base_url=server.url, timeout=WAIT_S + 30) as waiter:
            started.release()
            response = waiter.get(f"/v1/transfers/{transfer_id}", params={"wait": WAIT_S})
        with lock:
            answers.append((transfer_id, response.json()["status"]))

    threads = [threading.Thread(target=wait_for, args=(t,)) for t in transfer_ids]
    for thread in threads:
        thread.start()
    for _ in threads:
        started.acquire()
    try:
        time.sleep(2.0)  # let every waiter's request reach the server and start waiting
        with httpx.Client(base_url=server.url, timeout=60) as client:
            listed = client.get("/v1/instances")
            with lock:
                finished_before = len(answers)
        fleet.release()  # the workers' records arrive: every waiter wakes
    finally:
        for thread in threads:
            thread.join(WAIT_S + 30)
    return listed, finished_before, answers
