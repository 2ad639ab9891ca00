"""Control-plane node failure: two ``kvplane serve`` processes on one PostgreSQL database, one dies.

Clients and workers are given both URLs (``KVPLANE_URL=http://a,http://b``) and fail over on
their own (``api/client.py``). Delivery of REST commands is at least once (``api/dispatch.py``):

- fake workers (the real command stream and recorder, no bytes): a command relayed while its
  worker held no stream anywhere reaches it when the stream opens; a command pushed on process A
  while the worker's stream had just moved to process B reaches it on B; an ``Idempotency-Key``
  replay of a running transfer re-sends what no rank has recorded, once, and nothing after;
- the real thing: the demo fleet (6 rank processes, real NIXL on loopback, pools pattern-filled,
  every receive verified), a burst of REST ``execute=true`` transfers from routers holding both
  URLs, the engine path running between the same workers, and process A, which holds every
  worker's command stream, heartbeat and records, SIGKILLed mid-burst. Every REST transfer ends
  ``done`` and verified, exactly one row per request (``Idempotency-Key``), every engine request
  completes and its record reaches the database through B. The drill runs twice: on loopback,
  and across the network-namespace bed (``workers/testing/netbed.py``: both API processes on the
  control host, context and generation ranks on hosts of their own, UCX over TCP on the veths).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, func, select

from api.client import Client
from api.models import TransferRow

from .conftest import (
    FakeFleet,
    Heartbeats,
    Server,
    TwoProcesses,
    transfer_body,
    wait_until,
)

pytestmark = [pytest.mark.slow, pytest.mark.postgres]


def _rows_per_request(db_url: str, prefix: str) -> dict[str, int]:
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                select(TransferRow.request_id, func.count())
                .where(TransferRow.request_id.like(f"{prefix}%"))
                .group_by(TransferRow.request_id)
            ).all()
    finally:
        engine.dispose()
    return {str(request_id): int(count) for request_id, count in rows}


# --- fake workers: the delivery rules -----------------------------------------------------------


def test_a_stream_that_opens_gets_the_commands_it_missed(two_processes: TwoProcesses) -> None:
    two = two_processes
    a, b, on_b, workers = two.a, two.b, two.on_b, two.workers
    with Heartbeats(f"{a.url},{b.url}", list(workers.values())):
        # No stream open anywhere (a worker between two API processes): B relays, nobody
        # holds the stream, the notification is dropped.
        ids = [on_b.create_transfer(transfer_body(f"m{i}", execute=True))["id"] for i in range(3)]
        assert {on_b.get_transfer(t)["status"] for t in ids} == {"running"}
        with FakeFleet(f"{a.url},{b.url}", workers) as fleet:
            for transfer_id in ids:
                assert on_b.get_transfer(transfer_id, wait_s=30)["status"] == "done"
            for worker in fleet:
                assert sorted(c["transfer_id"] for c in worker.commands) == sorted(ids)
                assert worker.duplicates == 0


def test_a_command_pushed_where_the_stream_just_left_follows_it(
    two_processes: TwoProcesses,
) -> None:
    two = two_processes
    a, b, on_a, on_b, workers = two.a, two.b, two.on_a, two.on_b, two.workers
    with (
        Heartbeats(a.url, list(workers.values())),
        FakeFleet(f"{a.url},{b.url}", workers) as fleet,
    ):
        fleet.wait_streams()
        for worker in fleet:  # every stream drops; each worker reconnects to B
            worker._hangup.hang_up()
        fleet.wait_streams(2)
        wait_until(
            lambda: all(w["connected"] for w in on_b.list_workers()["items"]),
            "every stream to be open on B",
        )
        # A still counts the streams as "dropped moments ago": it used to queue the
        # command for them there, where nobody would read it.
        transfer = on_a.create_transfer(transfer_body("moved", execute=True))
        assert on_a.get_transfer(transfer["id"], wait_s=30)["status"] == "done"
        assert {len(worker.commands) for worker in fleet} == {1}


def test_a_replay_resends_what_no_rank_recorded_and_nothing_more(
    postgres_url: str, start_server: Callable[..., Server], two_processes: TwoProcesses
) -> None:
    two = two_processes
    a, on_a, on_b, workers = two.a, two.on_a, two.on_b, two.workers
    with (
        Heartbeats(a.url, list(workers.values())),
        FakeFleet(a.url, workers, hold=True) as fleet,
    ):
        fleet.wait_streams()
        body = transfer_body("replayed", execute=True)
        first = on_a.create_transfer(body, idempotency_key="k-1")
        for worker in fleet:
            worker.wait_commands(1)
        # The router's answer was lost; it asks B with the same key: the same transfer. Its
        # commands are relayed again (A might have died before pushing them), but A's streams
        # carried them already: a replay adds nothing to a stream.
        again = on_b.create_transfer(body, idempotency_key="k-1")
        assert again["id"] == first["id"]
        time.sleep(1.0)
        assert all(w.duplicates == 0 for w in fleet)
        assert fleet.release() == len(workers)
        assert on_b.get_transfer(first["id"], wait_s=30)["status"] == "done"
        # Once every rank recorded its part, a replay re-sends nothing.
        assert on_b.create_transfer(body, idempotency_key="k-1")["id"] == first["id"]
        fresh = on_b.create_transfer(transfer_body("after", execute=True))
        assert on_b.get_transfer(fresh["id"], wait_s=30)["status"] == "done"
        assert {w.duplicates for w in fleet} == {0}
        assert {len(w.commands) for w in fleet} == {2}
    assert _rows_per_request(postgres_url, "replayed") == {"replayed": 1}


# --- the real fleet: one API process SIGKILLed mid-burst ----------------------------------------

NUM_SLOTS = 64
ENGINE_SLOTS = 32  # block ids [0, 32) for the engine path, [32, 64) for REST: no shared blocks
BLOCKS = 4
ROUTERS = 4  # REST client threads, one block lane each
REST_TRANSFERS = 48
KILL_AFTER = 12  # REST transfers finished before process A dies
ENGINE_ROUND = 24  # engine requests per round; rounds run until the burst is over


@pytest.fixture(params=["loopback", "hosts"])
def two_process_fleet(
    request: pytest.FixtureRequest, postgres_url: str, tmp_path: Path
) -> Iterator[Any]:
    """Two API processes on one PostgreSQL database and the demo fleet. ``hosts``: across the
    network-namespace bed: both API processes in ``kvp-cp`` (10.77.0.1 on the control network,
    two ports; PostgreSQL through its Unix socket), the context ranks in ``kvp-ctx``, the
    generation ranks in ``kvp-gen``, every worker on ``UCX_TLS=tcp`` pinned to the data network
    (``data0``); the routers (this process) reach ``kvp-cp`` over the control bridge."""
    pytest.importorskip("nixl")
    pytest.importorskip("torch")
    from workers.testing.engine import ControlPlane, Fleet

    placement: dict[str, Any] = {}
    server: dict[str, Any] = {}
    database = postgres_url
    if request.param == "hosts":
        bed = request.getfixturevalue("bed")
        database = request.getfixturevalue("postgres_socket_url")
        server = {"host": bed.address("cp"), "netns": "kvp-cp"}
        placement = {
            "hosts": {"control": "kvp-cp", "context": "kvp-ctx", "generation": "kvp-gen"},
            "ucx_tls": "tcp",
            "ucx_net_devices": "data0",
        }
    servers = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        servers.append(
            ControlPlane(tmp_path / name, env={"KVPLANE_DATABASE_URL": database}, **server)
        )
    fleet = Fleet(
        tmp_path,
        num_slots=NUM_SLOTS,
        fill=True,
        staging_bytes=16 << 20,
        servers=servers,
        **placement,
    )
    try:
        fleet.start()
        yield fleet
    finally:
        fleet.stop()


class _Routers:
    """``ROUTERS`` threads posting ``execute=true`` transfers and long-polling them, each with
    both URLs (half of them starting on B), each request with its own Idempotency-Key."""

    def __init__(self, urls: list[str], tag: str) -> None:
        self.urls, self.tag = urls, tag
        self.results: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self.lock = threading.Lock()
        self.counter = iter(range(REST_TRANSFERS))
        self.threads = [threading.Thread(target=self._run, args=(lane,)) for lane in range(ROUTERS)]

    def start(self) -> _Routers:
        for thread in self.threads:
            thread.start()
        return self

    def join(self) -> None:
        for thread in self.threads:
            thread.join(timeout=600)

    def done_count(self) -> int:
        with self.lock:
            return len(self.results)

    def _run(self, lane: int) -> None:
        urls = self.urls if lane % 2 == 0 else self.urls[::-1]
        ids = list(range(ENGINE_SLOTS + lane * BLOCKS, ENGINE_SLOTS + (lane + 1) * BLOCKS))
        with Client(urls, retries=30, backoff_s=0.1, max_backoff_s=1.0) as client:
            while True:
                with self.lock:
                    k = next(self.counter, None)
                if k is None:
                    return
                request_id = f"{self.tag}-{k}"
                body = {
                    "context": "demo-ctx-tp4",
                    "generation": "demo-gen-tp2",
                    "request_id": request_id,
                    "execute": True,
                    "verify": True,
                    "blocks": {"0": {"context": ids, "generation": ids}},
                }
                started = time.time()
                first_url = client.url
                try:
                    read = client.create_transfer(body, idempotency_key=request_id)
                    for _ in range(10):
                        if read["status"] not in ("queued", "running"):
                            break
                        read = client.get_transfer(read["id"], wait_s=30)
                except Exception as error:  # the test fails on it below
                    with self.lock:
                        self.errors.append(f"{request_id}: {type(error).__name__}: {error}")
                    continue
                with self.lock:
                    self.results.append(
                        {
                            "request_id": request_id,
                            "id": read["id"],
                            "status": read["status"],
                            "error": read.get("error"),
                            "started": started,
                            "finished": time.time(),
                            "moved": client.url != first_url,
                        }
                    )


def _phase_table(results: list[dict[str, Any]], killed_at: float) -> str:
    phases: dict[str, list[dict[str, Any]]] = {"before": [], "across the kill": [], "after": []}
    for r in results:
        if r["finished"] < killed_at:
            phases["before"].append(r)
        elif r["started"] <= killed_at:
            phases["across the kill"].append(r)
        else:
            phases["after"].append(r)
    lines = [f"{'REST transfers':<18}{'n':>4}{'p50 ms':>9}{'max ms':>9}{'per s':>8}"]
    for name, rows in phases.items():
        if not rows:
            lines.append(f"{name:<18}{0:>4}")
            continue
        lat = [(r["finished"] - r["started"]) * 1000 for r in rows]
        span = max(r["finished"] for r in rows) - min(r["started"] for r in rows)
        lines.append(
            f"{name:<18}{len(rows):>4}{statistics.median(lat):>9.0f}{max(lat):>9.0f}"
            f"{len(rows) / max(span, 1e-9):>8.1f}"
        )
    return "\n".join(lines)


@pytest.mark.timeout(900)
def test_one_api_process_killed_mid_burst_loses_and_duplicates_nothing(
    two_process_fleet: Any, postgres_url: str
) -> None:
    from api.services.execution import engine_transfer_id
    from workers.testing.engine import CONTEXT, GENERATION

    fleet = two_process_fleet
    a, b = fleet.servers
    tag = f"burst{time.time_ns() % 10**9}"
    rounds: list[Any] = []
    round_errors: list[str] = []
    killed: dict[str, float] = {}
    burst_over = threading.Event()

    def engine() -> None:  # the hot path, between the same workers, all along
        n = 0
        while True:
            # Until the burst is over and at least one round ran wholly after the kill.
            after = "at" in killed and any(started > killed["at"] for started, _ in rounds)
            if burst_over.is_set() and (after or "at" not in killed):
                return
            started = time.time()
            try:
                run = fleet.run_engine(
                    requests=ENGINE_ROUND,
                    blocks=BLOCKS,
                    in_flight=2,
                    seed=n + 1,
                    tag=f"{tag}-e{n}",
                    verify=True,
                    num_slots=ENGINE_SLOTS,
                    timeout_s=30.0,
                )
            except Exception as error:
                round_errors.append(f"{type(error).__name__}: {error}")
                return
            rounds.append((started, run))
            n += 1

    engine_thread = threading.Thread(target=engine)
    engine_thread.start()
    routers = _Routers([a.url, b.url], tag).start()
    try:
        wait_until(
            lambda: (
                routers.done_count() >= KILL_AFTER or not any(t.is_alive() for t in routers.threads)
            ),
            "the first REST transfers",
            300,
        )
        killed["at"] = time.time()
        a.kill()  # holds every worker's command stream, heartbeat and records
        routers.join()
    finally:
        burst_over.set()
        engine_thread.join(timeout=600)

    # REST: every transfer done and verified; one row per request (the Idempotency-Key).
    assert routers.errors == []
    assert len(routers.results) == REST_TRANSFERS
    failed = [r for r in routers.results if r["status"] != "done"]
    assert failed == []
    rows = _rows_per_request(postgres_url, f"{tag}-")
    rest_rows = {k: v for k, v in rows.items() if not k.removeprefix(f"{tag}-").startswith("e")}
    assert rest_rows == {f"{tag}-{k}": 1 for k in range(REST_TRANSFERS)}
    with Client(b.url) as on_b:
        for result in routers.results:
            parts = on_b.list_parts(result["id"])["items"]
            receives = [p for p in parts if p["kind"] == "receive"]
            assert len(receives) == 2 and all(p["state"] == "done" for p in receives)
            assert all((p["result"] or {}).get("verified_bytes") for p in receives), parts

        # The engine path never noticed: every round complete, clean and verified.
        assert round_errors == []
        assert any(started > killed["at"] for started, _ in rounds)
        for _, run in rounds:
            assert run.complete, run.stalled
            assert run.failures == {}
            assert run.leaked == 0
            assert all(rank.verify_errors == [] for rank in run.ranks)
            assert sum(r.verified_bytes for r in run.ranks if r.role == "generation") > 0

        # Its records caught up, through B.
        pairing = on_b.get_pairing(fleet.pairing["id"])
        ctx, gen = on_b.get_instance(CONTEXT), on_b.get_instance(GENERATION)
        engine_ids = {
            engine_transfer_id(
                str(pairing["id"]), str(ctx["epoch"]), str(gen["epoch"]), f"{run.tag}-{i}"
            )
            for _, run in rounds
            for i in range(run.requests)
        }

        def recorded() -> bool:
            found = 0
            offset = 0
            while True:
                page = on_b.list_transfers(status="done", limit=1000, offset=offset)
                found += sum(1 for t in page["items"] if t["id"] in engine_ids)
                offset += len(page["items"])
                if not page["items"] or offset >= page["total"]:
                    return found == len(engine_ids)

        wait_until(recorded, "every engine request's record to reach the database", 120)

        # Every worker is alive and streams from B now.
        wait_until(
            lambda: all(
                w["status"] == "alive" and w["connected"] for w in on_b.list_workers()["items"]
            ),
            "every worker alive and streaming from B",
            60,
        )
    stats = fleet.call_all("stats")
    assert {s["control_plane"] for s in stats} == {b.url}
    # Concurrent record batches of six workers (engine path and REST) never deadlock.
    assert [server.log_tail(10**7).count("deadlock detected") for server in (a, b)] == [0, 0]
    # No handle failed on any rank: a command re-sent after the kill never started a second
    # (doomed) handle, and nothing was re-sent for engine-path transfers.
    assert [s["errors"] for s in stats if s["failed"]] == []
    moved = sum(1 for r in routers.results if r["moved"])
    engine_lat = [
        (started > killed["at"], statistics.median(run.latencies_s()) * 1000)
        for started, run in rounds
    ]
    print(
        f"\nfailover: A killed after {KILL_AFTER} of {REST_TRANSFERS} REST transfers; "
        f"{moved} routers' requests moved to B mid-request; commands re-sent and dropped "
        f"by workers: {sum(s['duplicate_commands'] for s in stats)}"
    )
    print(_phase_table(routers.results, killed["at"]))
    slowest = max(routers.results, key=lambda r: r["finished"] - r["started"])
    with Client(b.url) as on_b:
        read = on_b.get_transfer(slowest["id"])
        parts = on_b.list_parts(slowest["id"])["items"]
    print(
        f"slowest REST transfer: {slowest['request_id']} started "
        f"{slowest['started'] - killed['at']:+.2f} s from the kill, took "
        f"{slowest['finished'] - slowest['started']:.2f} s (attempt {read['attempt']}, "
        f"created {read['created_at']}, finished {read['finished_at']}; parts finished "
        f"{sorted(str(p['finished_at']) for p in parts)})"
    )
    print(
        "engine rounds (p50 ms, before/after the kill): "
        + ", ".join(f"{'after' if after else 'before'} {p50:.1f}" for after, p50 in engine_lat)
    )
