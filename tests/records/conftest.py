"""Record fixtures: a small paired fleet in a fresh database, driven through the services."""

from __future__ import annotations

import threading
import time
from datetime import datetime
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from api import schemas, schemas_exec
from api.db import Database, utcnow
from api.demo_fleet import fake_peer
from api.models import InstanceRow, PairingRow
from api.services import execution, instances, pairings, registration, transfers
from api.services import workers as worker_service
from geometry.builders import ViewSpec, instance_body

VIEWS = [ViewSpec("target", layers=2, kv_heads=4, head_dim=8)]


def fleet_bodies(ctx_tp: int = 2, gen_tp: int = 1) -> tuple[dict[str, Any], dict[str, Any]]:
    ctx = instance_body(role="context", views=VIEWS, tp=ctx_tp, tokens_per_block=4, num_slots=64)
    gen = instance_body(role="generation", views=VIEWS, tp=gen_tp, tokens_per_block=4, num_slots=64)
    return ctx, gen


def attach_worker(
    db: Database,
    instance: str,
    rank: int,
    agent: str,
    now: datetime | None = None,
    staging_bytes: int = 1 << 24,
) -> str:
    with db.write() as session:
        row = instances.get_instance(session=session, name=instance)
        body = next(r.body for r in row.ranks if r.rank == rank)
        worker = worker_service.register_worker(
            session=session,
            body=schemas_exec.WorkerCreate.model_validate(
                {"instance": instance, "rank": rank, "peer": fake_peer(body, agent, staging_bytes)}
            ),
            now=now or utcnow(),
        )
        return worker.id


def setup_fleet(
    db: Database, *, ctx_tp: int = 2, gen_tp: int = 1, now: datetime | None = None
) -> dict[str, Any]:
    """ctx (TP ctx_tp) and gen (TP gen_tp), paired, one live worker per rank."""
    ctx, gen = fleet_bodies(ctx_tp, gen_tp)
    with db.write() as session:
        registration.register_instance(
            session=session, name="ctx", body=schemas.InstanceCreate.model_validate(ctx)
        )
        registration.register_instance(
            session=session, name="gen", body=schemas.InstanceCreate.model_validate(gen)
        )
        pairing, _ = pairings.create_pairing(session=session, context="ctx", generation="gen")
        assert pairing.compatible
    workers = {("ctx", r): attach_worker(db, "ctx", r, f"ctx.r{r}", now) for r in range(ctx_tp)} | {
        ("gen", r): attach_worker(db, "gen", r, f"gen.r{r}", now) for r in range(gen_tp)
    }
    return {"workers": workers}


def submit(
    db: Database,
    request_id: str,
    *,
    mode: str = "staged",
    verify: bool = False,
    blocks: int = 4,
    timeout_s: float = 30.0,
    commands: list[Any] | None = None,
) -> str:
    """An executed transfer ``ctx`` → ``gen``; its worker commands go to ``commands``."""
    body = schemas.TransferCreate.model_validate(
        {
            "context": "ctx",
            "generation": "gen",
            "request_id": request_id,
            "blocks": {"0": {"context": list(range(blocks)), "generation": list(range(blocks))}},
            "execute": True,
            "mode": mode,
            "verify": verify,
            "timeout_s": timeout_s,
        }
    )
    with db.write() as session:
        row, _ = transfers.create_transfer(session=session, body=body, commands=commands)
        return row.id


def record(
    db: Database,
    worker_id: str,
    transfer_id: str | None,
    *,
    side: str,
    rank: int,
    status: str = "done",
    attempt: int = 1,
    error: str | None = None,
    checksum: int | None = None,
    sender_checksum: int | None = None,
    routes: list[tuple[int, int]] = (),
    request_id: str = "r",
    now: datetime | None = None,
    **extra: Any,
) -> tuple[int, list[str]]:
    """Post one worker record through the service (as ``POST /v1/transfers/records``)."""
    with db.read() as session:
        epochs = {
            name: epoch
            for name, epoch in session.execute(select(InstanceRow.name, InstanceRow.epoch))
        }
        pairing = session.scalar(select(PairingRow.id))
    when = (now or utcnow()).timestamp() - 0.01  # times within the control plane's window
    body = schemas_exec.TransferRecords.model_validate(
        {
            "worker_id": worker_id,
            "records": [
                {
                    "transfer_id": transfer_id,
                    "attempt": attempt,
                    "request_id": request_id,
                    "pairing_id": pairing,
                    "context": "ctx",
                    "generation": "gen",
                    "context_epoch": epochs["ctx"],
                    "generation_epoch": epochs["gen"],
                    "side": side,
                    "rank": rank,
                    "status": status,
                    "error": error,
                    "bytes": 1,
                    "started_at": when,
                    "finished_at": when + 0.001,
                    "routes": [
                        {
                            "sender_rank": s,
                            "receiver_rank": r,
                            "bytes": 1,
                            "checksum": checksum,
                            **(
                                {}
                                if sender_checksum is None
                                else {"sender_checksum": sender_checksum}
                            ),
                        }
                        for s, r in routes
                    ],
                    **extra,
                }
            ],
        }
    )
    with db.write() as session:
        return execution.record_parts(session=session, body=body, now=now or utcnow())


def status_of(db: Database, transfer_id: str) -> tuple[str, str | None]:
    with db.read() as session:
        row = transfers.get_transfer(session=session, transfer_id=transfer_id)
        return row.status, row.error


class Heartbeats:
    """Keeps workers alive from a background thread while a test's processes run."""

    def __init__(self, db: Database, worker_ids: list[str], interval_s: float = 1.0) -> None:
        self.db, self.worker_ids, self.interval_s = db, worker_ids, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            for worker_id in self.worker_ids:
                with self.db.write() as session:
                    worker_service.heartbeat(session=session, worker_id=worker_id, now=utcnow())

    def __enter__(self) -> Heartbeats:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


@pytest.fixture
def db(db_url: str) -> Any:
    database = Database(db_url)
    yield database
    database.dispose()


def register_over_http(api: TestClient, name: str, body: dict[str, Any]) -> dict[int, str]:
    """Register ``name`` and attach a worker to each of its ranks, over HTTP: rank -> id."""
    assert api.put(f"/v1/instances/{name}", json=body).status_code == 201
    workers = {}
    for rank_body in body["ranks"]:
        answer = api.post(
            "/v1/workers",
            json={
                "instance": name,
                "rank": rank_body["rank"],
                "peer": fake_peer(rank_body, f"{name}.r{rank_body['rank']}"),
            },
        )
        assert answer.status_code == 201, answer.text
        workers[rank_body["rank"]] = answer.json()["id"]
    return workers


def fleet_over_http(
    api: TestClient, *, ctx_tp: int = 1, gen_tp: int = 1, views: Any = VIEWS, gen_dp: bool = False
) -> dict[str, Any]:
    """ctx and gen registered, paired and attached over HTTP."""
    ctx = register_over_http(
        api, "ctx", instance_body(role="context", views=views, tp=ctx_tp, tokens_per_block=4)
    )
    gen = register_over_http(
        api,
        "gen",
        instance_body(
            role="generation", views=views, tp=gen_tp, attention_dp=gen_dp, tokens_per_block=4
        ),
    )
    pairing = api.post("/v1/pairings", json={"context": "ctx", "generation": "gen"}).json()
    assert pairing["compatible"], pairing
    epochs = {name: api.get(f"/v1/instances/{name}").json()["epoch"] for name in ("ctx", "gen")}
    return {"ctx": ctx, "gen": gen, "pairing": pairing["id"], "epochs": epochs}


def engine_record(fleet: dict[str, Any], side: str, rank: int, **fields: Any) -> dict[str, Any]:
    """An engine-path record of ``fleet`` (``fleet_over_http``), finished just now."""
    now = time.time()
    return {
        "request_id": "r1",
        "pairing_id": fleet["pairing"],
        "context": "ctx",
        "generation": "gen",
        "context_epoch": fleet["epochs"]["ctx"],
        "generation_epoch": fleet["epochs"]["gen"],
        "side": side,
        "rank": rank,
        "status": "done",
        "bytes": 64,
        "started_at": now - 0.01,
        "finished_at": now,
        "blocks": {"0": {"context": [0, 1], "generation": [2, 3]}},
        **fields,
    }
