"""The control plane under heavy and hostile traffic: command streams (deadlines, bytes, stalls,
repeats), one worker per rank, endpoint metadata, kept directory revisions, reap reasons."""

from __future__ import annotations

import asyncio
import base64
import re
import time
from datetime import timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError
from sqlalchemy import event

from api import dispatch, schemas_exec
from api.db import Database, utcnow
from api.demo_fleet import fake_peer
from api.dispatch import CommandHub, CommandStreamResponse, encode, render
from api.errors import Conflict
from api.services import execution, registration
from api.services import workers as worker_service
from geometry.builders import instance_body

from .conftest import VIEWS, attach_worker, record, setup_fleet, status_of, submit


def _command(
    xid: str = "t.1", side: str = "send", deadline_s: float | None = None, blocks: int = 4
) -> dict[str, Any]:
    deadline_s = time.time() + 30 if deadline_s is None else deadline_s
    return {
        "type": "transfer",
        "transfer_id": xid.split(".")[0],
        "attempt": 1,
        "xid": xid,
        "side": side,
        "rank": 0,
        "blocks": {"0": {"context": list(range(blocks)), "generation": list(range(blocks))}},
        "deadline_at": deadline_s,
        "timeout_s": 30.0,
    }


# --- deadlines -------------------------------------------------------------------------------


def test_a_command_carries_its_attempts_absolute_deadline(db: Database) -> None:
    setup_fleet(db, ctx_tp=1, gen_tp=1)
    commands: list[Any] = []
    transfer_id = submit(db, "r1", timeout_s=3.0, commands=commands)
    with db.read() as session:
        from api.services.transfers import get_transfer

        deadline = get_transfer(session=session, transfer_id=transfer_id).deadline_at
    assert deadline is not None
    assert {c["deadline_at"] for _, c in commands} == {deadline.timestamp()}


def test_a_command_that_waited_leaves_with_what_is_left_of_its_deadline() -> None:
    now = time.time()
    line = encode(_command(deadline_s=now + 3.0))
    (chunk,) = render([line], now + 2.0)  # two seconds in a queue
    assert b'"timeout_s":1.000' in chunk and b'"deadline_at"' in chunk
    assert render([line], now + 3.5) == []  # past its deadline: never sent


# --- the hub: repeats, bytes, stalls, disconnects ---------------------------------------------


def _run(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


def test_a_stream_carries_a_command_once_however_often_it_is_pushed() -> None:
    async def scenario() -> int:
        hub = CommandHub()
        ticket = hub.connect("w1")
        for _ in range(200):  # two hundred Idempotency-Key replays of one running transfer
            hub.deliver_now([("w1", encode(_command("t.1", "send")))])
        hub.deliver_now([("w1", encode(_command("t.1", "receive")))])
        lines, _, _ = await hub.next_lines(ticket, 0.1)
        return len(lines)

    assert _run(scenario()) == 2


def test_a_reconnected_stream_may_carry_its_owed_commands_again() -> None:
    async def scenario() -> int:
        hub = CommandHub()
        first = hub.connect("w1")
        hub.deliver_now([("w1", encode(_command()))])
        await hub.next_lines(first, 0.1)  # written, then the connection dropped
        hub.disconnect(first)
        second = hub.connect("w1")
        hub.deliver_now([("w1", encode(_command()))])  # the owed re-send on reconnect
        lines, _, _ = await hub.next_lines(second, 0.1)
        return len(lines)

    assert _run(scenario()) == 1


def test_a_queue_over_its_bytes_is_cut_and_shows_disconnected_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(dispatch, "STREAM_BYTES_MAX", 200_000)

    async def scenario() -> tuple[bool, bool, int, int]:
        hub = CommandHub()
        ticket = hub.connect("w1")  # open, never read
        assert hub.connected("w1")
        for i in range(50):  # ~30 KB each
            hub.deliver_now([("w1", encode(_command(f"t{i}.1", blocks=4000)))])
        lines, _, ended = await hub.next_lines(ticket, 0.1)
        return hub.connected("w1"), ended, hub.nbytes, hub.cuts

    connected, ended, queued, cuts = _run(scenario())
    assert not connected and ended and cuts == 1
    assert queued < 200_000


def test_a_stream_whose_write_stalls_is_cut() -> None:
    stalled: list[bool] = []

    async def lines() -> Any:
        yield b"x" * 10
        yield b"y" * 10

    async def never_completes(message: Any) -> None:
        if message.get("body"):
            await asyncio.sleep(3600)  # a worker that does not read: the write never returns

    async def scenario() -> float:
        response = CommandStreamResponse(
            lines(), on_stall=lambda: stalled.append(True), write_timeout_s=0.2
        )
        started = time.monotonic()
        await response.stream_response(never_completes)
        return time.monotonic() - started

    assert _run(scenario()) < 2.0
    assert stalled == [True]


def test_a_dropped_stream_is_disconnected_at_once_and_a_stopped_one_ends() -> None:
    async def scenario() -> tuple[bool, bool, bytes | None, bool]:
        hub = CommandHub()
        ticket = hub.connect("w1")
        hub.disconnect(ticket)
        dropped = hub.connected("w1")  # its queue waits for a reconnect, but it is not open
        holds = hub.holds("w1")
        ticket = hub.connect("w1")
        hub.bind(asyncio.get_running_loop())
        hub.close("w1", {"type": "stopped"})  # DELETE /v1/workers/{id}
        await asyncio.sleep(0)
        _, final, ended = await hub.next_lines(ticket, 1.0)
        return dropped, holds, final, ended

    dropped, holds, final, ended = _run(scenario())
    assert not dropped and holds
    assert final == b'{"type":"stopped"}\n' and ended


# --- one worker per rank, endpoint metadata --------------------------------------------------


def _register(api: TestClient, name: str, role: str) -> dict[str, Any]:
    body = instance_body(role=role, views=VIEWS, tp=1, tokens_per_block=4)
    assert api.put(f"/v1/instances/{name}", json=body).status_code == 201
    return body


def _attach(api: TestClient, name: str, body: dict[str, Any], agent: str, **peer: Any) -> Any:
    return api.post(
        "/v1/workers",
        json={"instance": name, "rank": 0, "peer": {**fake_peer(body["ranks"][0], agent), **peer}},
    )


def test_a_second_worker_on_a_rank_supersedes_the_first_visibly(client: TestClient) -> None:
    body = _register(client, "ctx", "context")
    first = _attach(client, "ctx", body, "ctx.a").json()["id"]
    assert client.post(f"/v1/workers/{first}/heartbeat").status_code == 200
    second = _attach(client, "ctx", body, "ctx.b")
    assert second.status_code == 201, second.text
    answer = client.post(f"/v1/workers/{first}/heartbeat")
    assert answer.status_code == 409 and answer.json()["code"] == "worker_superseded"
    assert second.json()["id"] in answer.json()["detail"]
    listed = {w["id"]: w["status"] for w in client.get("/v1/workers").json()["items"]}
    assert listed == {first: "stopped", second.json()["id"]: "alive"}
    assert client.post(f"/v1/workers/{second.json()['id']}/heartbeat").status_code == 200


def test_an_agent_name_of_a_live_worker_of_another_rank_is_refused(client: TestClient) -> None:
    ctx = _register(client, "ctx", "context")
    gen = _register(client, "gen", "generation")
    assert _attach(client, "ctx", ctx, "agent-1").status_code == 201
    answer = _attach(client, "gen", gen, "agent-1")
    assert answer.status_code == 409 and answer.json()["code"] == "agent_name_taken"


@pytest.mark.parametrize("metadata", ["abc", "abcde===", "ab=c", "A" * ((64 << 10) + 4)])
def test_metadata_must_be_decodable_base64_under_the_cap(client: TestClient, metadata: str) -> None:
    body = _register(client, "ctx", "context")
    answer = _attach(client, "ctx", body, "ctx.a", metadata_b64=metadata)
    assert answer.status_code == 422, answer.text
    assert answer.json()["errors"][0]["loc"][-1] == "metadata_b64"


def test_real_nixl_metadata_fits_the_cap() -> None:
    # 16 pools of a UCX agent on loopback measured 1,161 bytes (1,548 of base64); a thousand
    # regions at ~35 bytes each still fit.
    metadata = base64.b64encode(b"\0" * 40_000).decode()
    peer = fake_peer({"pools": [{"id": 0, "slot_bytes": 64, "num_slots": 4}]}, "a")
    schemas_exec.PeerInfo.model_validate({**peer, "metadata_b64": metadata})
    with pytest.raises(ValidationError):
        schemas_exec.PeerInfo.model_validate({**peer, "metadata_b64": metadata * 2})


def test_stopped_and_superseded_worker_rows_are_collected(db: Database) -> None:
    setup_fleet(db, ctx_tp=1, gen_tp=1)
    for i in range(5):  # a crash-looping worker process: a row per restart
        attach_worker(db, "ctx", 0, f"ctx.r0.{i}")
    with db.read() as session:
        assert len(worker_service.list_workers(session=session, instance="ctx")) == 6
    later = utcnow() + timedelta(seconds=worker_service.WORKER_GC_S + 1)
    attach_worker(db, "ctx", 0, "ctx.r0.late", now=later)
    with db.read() as session:
        assert len(worker_service.list_workers(session=session, instance="ctx")) == 1


# --- listings, directory revisions, heartbeats -----------------------------------------------


class Statements:
    """The SQL statements an engine runs while counting."""

    def __init__(self, db: Database) -> None:
        self.seen: list[str] = []
        event.listen(db.engine, "before_cursor_execute", self._on)

    def _on(self, conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        self.seen.append(statement)


def test_a_listing_reads_no_worker_endpoint(db: Database) -> None:
    setup_fleet(db, ctx_tp=2, gen_tp=1)
    statements = Statements(db)
    with db.read() as session:
        rows = worker_service.list_workers(session=session)
        reads = [worker_service.worker_read(row, utcnow()) for row in rows]
    assert len(reads) == 3
    # The endpoint column is never selected whole (only its UCX settings, extracted in SQL).
    whole = re.compile(r"(SELECT|,)\s*workers\.peer\s*(,|FROM)")
    assert not any(whole.search(s) for s in statements.seen), statements.seen


def _heartbeat_statements(db: Database, worker_id: str) -> int:
    statements = Statements(db)
    with db.write() as session:
        row = worker_service.heartbeat(session=session, worker_id=worker_id, now=utcnow())
        worker_service.directory_revision(session=session, worker=row, now=utcnow())
    return len(statements.seen)


def test_a_heartbeat_costs_the_same_whatever_the_number_of_pairings(db: Database) -> None:
    from api import schemas
    from api.services import pairings

    fleet = setup_fleet(db, ctx_tp=1, gen_tp=1)
    worker = fleet["workers"][("ctx", 0)]
    one = _heartbeat_statements(db, worker)
    gen = instance_body(role="generation", views=VIEWS, tp=1, tokens_per_block=4)
    with db.write() as session:
        for i in range(8):
            registration.register_instance(
                session=session, name=f"gen{i}", body=schemas.InstanceCreate.model_validate(gen)
            )
            pairings.create_pairing(session=session, context="ctx", generation=f"gen{i}")
    assert _heartbeat_statements(db, worker) == one


def test_the_kept_revision_follows_what_the_directory_shows(db: Database) -> None:
    fleet = setup_fleet(db, ctx_tp=1, gen_tp=1)
    ctx = fleet["workers"][("ctx", 0)]

    def revision() -> str:
        with db.read() as session:
            row = worker_service.get_worker(session=session, worker_id=ctx)
            return worker_service.directory_revision(session=session, worker=row, now=utcnow())

    def directory() -> Any:
        with db.read() as session:
            return worker_service.worker_directory(
                session=session, worker_id=ctx, now=utcnow(), read_only=True
            )

    seen = [revision()]
    with db.write() as session:  # the plans, compiled once
        worker_service.worker_directory(session=session, worker_id=ctx, now=utcnow())
    assert directory().revision == seen[-1]
    restarted = attach_worker(db, "gen", 0, "gen.r0.b")  # a peer's worker replaced
    seen.append(revision())
    assert directory().peers["gen"].ranks["0"].worker_id == restarted
    with db.write() as session:
        worker_service.stop_worker(session=session, worker_id=restarted)
    seen.append(revision())
    assert directory().peers["gen"].ranks == {}
    # A peer worker that falls silent: the housekeeping bumps its peers' revision.
    attach_worker(db, "gen", 0, "gen.r0.c")
    seen.append(revision())
    later = utcnow() + timedelta(seconds=worker_service.WORKER_GONE_S + 1)
    with db.write() as session:
        gone = worker_service.fell_silent(session=session, since=utcnow(), now=later)
        worker_service.bump_gone(session=session, instance_ids=gone)
    seen.append(revision())
    assert len(set(seen)) == len(seen)


# --- reap reasons ----------------------------------------------------------------------------


def test_a_reaped_transfer_says_whether_the_silent_ranks_workers_are_alive(db: Database) -> None:
    fleet = setup_fleet(db, ctx_tp=2, gen_tp=1)
    transfer_id = submit(db, "r1", timeout_s=1.0)
    record(db, fleet["workers"][("ctx", 0)], transfer_id, side="send", rank=0)
    soon = utcnow() + timedelta(seconds=1.0 + execution.RECORD_GRACE_S + 1)
    with db.write() as session:  # every worker heartbeats: they ran out of time
        for worker_id in fleet["workers"].values():
            worker_service.heartbeat(session=session, worker_id=worker_id, now=soon)
        assert execution.reap_overdue(session=session, now=soon) == [transfer_id]
    error = status_of(db, transfer_id)[1] or ""
    assert "no report from context rank 1, generation rank 0" in error
    assert "(workers alive)" in error and "gone" not in error

    second = submit(db, "r2", timeout_s=1.0)
    later = soon + timedelta(seconds=worker_service.WORKER_GONE_S + 10)
    with db.write() as session:  # nobody heartbeats any more
        assert execution.reap_overdue(session=session, now=later) == [second]
    error = status_of(db, second)[1] or ""
    assert "context rank 0, context rank 1, generation rank 0: worker gone" in error


def test_a_superseded_worker_is_told_on_its_heartbeat(db: Database) -> None:
    fleet = setup_fleet(db, ctx_tp=1, gen_tp=1)
    attach_worker(db, "ctx", 0, "ctx.r0.b")
    with db.write() as session, pytest.raises(Conflict) as caught:
        worker_service.heartbeat(
            session=session, worker_id=fleet["workers"][("ctx", 0)], now=utcnow()
        )
    assert caught.value.code == "worker_superseded"


# --- relaying between API processes ----------------------------------------------------------


class _BrokenRelay:
    """A relay whose database connection is gone: it cannot publish."""

    published: list[Any] = []

    def publish(self, messages: Any) -> None:
        raise dispatch.RelayError("connection refused")

    def ref_payloads(self, messages: Any) -> list[str]:
        return ["refs"]

    def notify_in(self, session: Any, payloads: Any) -> None:
        raise dispatch.RelayError("connection refused")

    def publish_close(self, worker_id: str, message: Any) -> None:
        pass


def test_a_command_the_relay_cannot_publish_is_a_503_never_a_201(client: TestClient) -> None:
    """The relay's NOTIFY goes in the transaction that stores the transfer: when it fails,
    nothing is stored (a retry creates it), and the answer is a 503."""
    for name, role in (("ctx", "context"), ("gen", "generation")):
        body = _register(client, name, role)
        assert _attach(client, name, body, f"{name}.r0").status_code == 201
    assert client.post("/v1/pairings", json={"context": "ctx", "generation": "gen"}).json()[
        "compatible"
    ]
    hub = client.app.state.hub  # type: ignore[attr-defined]
    relay, hub.relay = hub.relay, _BrokenRelay()  # PostgreSQL's own relay goes back after
    try:
        answer = client.post(
            "/v1/transfers",
            json={
                "context": "ctx",
                "generation": "gen",
                "request_id": "r1",
                "execute": True,
                "blocks": {"0": {"context": [0, 1], "generation": [2, 3]}},
            },
        )
    finally:
        hub.relay = relay
    assert answer.status_code == 503, answer.text
    assert answer.json()["code"] == "commands_undelivered"
    assert client.get("/v1/transfers").json()["items"] == []


def test_relayed_references_are_built_from_the_database(db: Database) -> None:
    fleet = setup_fleet(db, ctx_tp=1, gen_tp=1)
    commands: list[Any] = []
    transfer_id = submit(db, "r1", blocks=20, commands=commands)
    refs = [(w, c["transfer_id"], c["attempt"], c["side"], c["rank"]) for w, c in commands]
    with db.read() as session:
        built = execution.commands_for_refs(session=session, refs=refs, now=utcnow())
    strip = ("timeout_s",)
    assert [(w, {k: v for k, v in c.items() if k not in strip}) for w, c in built] == [
        (w, {k: v for k, v in c.items() if k not in strip}) for w, c in commands
    ]
    record(db, fleet["workers"][("gen", 0)], transfer_id, side="receive", rank=0)
    with db.read() as session:  # settled: nothing to relay any more
        assert execution.commands_for_refs(session=session, refs=refs, now=utcnow()) == []
