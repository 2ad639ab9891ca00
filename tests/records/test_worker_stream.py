"""A worker's two-way stream (``/v1/workers/{id}/stream``): commands down, records up, answered
in order; what a careless or hostile worker sends gets an answer, never a dropped connection;
and record batches that arrive together are written in one transaction."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from api import schemas_exec
from api.auth import create_token
from api.db import Database
from api.records import RecordWriter

from .conftest import engine_record, fleet_over_http


def _lines(data: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in data.splitlines() if line.strip()]


def _answer(ws: Any) -> dict[str, Any]:
    """The next ``recorded`` line (pings and commands on the way are skipped)."""
    while True:
        for message in _lines(ws.receive_bytes()):
            if message["type"] == "recorded":
                return message


def _send(ws: Any, seq: Any, *records: dict[str, Any]) -> None:
    ws.send_bytes(json.dumps({"type": "records", "seq": seq, "records": list(records)}).encode())


def test_records_over_the_stream_settle_and_are_answered_in_order(client: TestClient) -> None:
    fleet = fleet_over_http(client)
    with client.websocket_connect(f"/v1/workers/{fleet['gen'][0]}/stream") as ws:
        assert _lines(ws.receive_bytes()) == [{"type": "hello"}]
        _send(ws, 1, engine_record(fleet, "receive", 0))
        first = _answer(ws)
        assert first["seq"] == 1 and first["accepted"] == 1 and len(first["settled"]) == 1
        _send(ws, 2, engine_record(fleet, "receive", 0))  # the same record again: ignored
        assert _answer(ws) == {"type": "recorded", "seq": 2, "accepted": 0, "settled": []}
    (transfer,) = client.get("/v1/transfers").json()["items"]
    assert transfer["status"] == "done" and transfer["id"] == first["settled"][0]


def test_a_rest_transfer_is_pushed_down_the_stream_and_settled_up_it(client: TestClient) -> None:
    fleet = fleet_over_http(client)
    streams = {side: fleet[name][0] for side, name in (("send", "ctx"), ("receive", "gen"))}
    with (
        client.websocket_connect(f"/v1/workers/{streams['send']}/stream") as send_ws,
        client.websocket_connect(f"/v1/workers/{streams['receive']}/stream") as receive_ws,
    ):
        for ws in (send_ws, receive_ws):
            assert _lines(ws.receive_bytes()) == [{"type": "hello"}]
        created = client.post(
            "/v1/transfers",
            json={
                "context": "ctx",
                "generation": "gen",
                "request_id": "rest-1",
                "blocks": {"0": {"context": [0, 1], "generation": [2, 3]}},
                "execute": True,
            },
        )
        assert created.status_code == 201, created.text
        transfer = created.json()
        for side, ws in (("send", send_ws), ("receive", receive_ws)):
            (command,) = _lines(ws.receive_bytes())
            assert command["type"] == "transfer" and command["side"] == side
            # The line is the typed command, field for field (the spec documents it).
            assert set(command) == set(schemas_exec.TransferCommand.model_fields)
            assert schemas_exec.TransferCommand.model_validate(command).rank == 0
            assert command["transfer_id"] == transfer["id"]
            record = engine_record(
                fleet, side, 0, transfer_id=transfer["id"], attempt=command["attempt"]
            )
            _send(ws, 7, record)
            answer = _answer(ws)
            assert answer["seq"] == 7 and answer["accepted"] == 1, answer
    settled = client.get(f"/v1/transfers/{transfer['id']}").json()
    assert settled["status"] == "done", settled


@pytest.mark.parametrize(
    "message, code",
    [
        (b"not json", "validation_error"),
        (b"[1, 2]", "invalid_message"),
        (b'{"type": "hello", "seq": 1}', "invalid_message"),
        (b'{"type": "records", "records": []}', "invalid_message"),
        (b'{"type": "records", "seq": true, "records": []}', "invalid_message"),
        (b'{"type": "records", "seq": 3, "records": "nope"}', "validation_error"),
        (b'{"type": "records", "seq": 3, "records": [{"side": "sideways"}]}', "validation_error"),
        (b"[" * 100_000 + b"]" * 100_000, "validation_error"),  # deeper than the parser goes
        (b"\xff\xfe not utf-8", "validation_error"),
    ],
)
def test_a_bad_message_gets_an_answer_and_the_stream_goes_on(
    client: TestClient, message: bytes, code: str
) -> None:
    fleet = fleet_over_http(client)
    with client.websocket_connect(f"/v1/workers/{fleet['gen'][0]}/stream") as ws:
        ws.receive_bytes()  # hello
        ws.send_bytes(message)
        answer = _answer(ws)
        assert answer["error"]["code"] == code and answer["error"]["status"] == 422, answer
        _send(ws, 9, engine_record(fleet, "receive", 0))
        assert _answer(ws)["accepted"] == 1


def test_records_are_refused_as_over_http(client: TestClient) -> None:
    """A batch naming another rank's parts: 403, the batch alone, answered by its seq."""
    fleet = fleet_over_http(client, gen_tp=2)
    with client.websocket_connect(f"/v1/workers/{fleet['gen'][0]}/stream") as ws:
        ws.receive_bytes()
        _send(ws, 1, engine_record(fleet, "receive", 1))
        answer = _answer(ws)
        assert answer["seq"] == 1 and answer["error"]["status"] == 403, answer
        bad = engine_record(fleet, "receive", 0, blocks={"0": {"context": [0, 1]}})
        _send(ws, 2, bad)
        assert _answer(ws)["error"]["code"] == "invalid_blocks"


def _closed_with(client: TestClient, path: str, **kwargs: Any) -> tuple[int, str]:
    with (
        pytest.raises(WebSocketDisconnect) as closed,
        client.websocket_connect(path, **kwargs) as ws,
    ):
        ws.receive_bytes()
    return closed.value.code, closed.value.reason


def test_a_stream_that_cannot_serve_closes_with_the_status_it_would_answer(
    client: TestClient,
) -> None:
    assert _closed_with(client, "/v1/workers/nobody/stream") == (4404, "worker_not_found")
    fleet = fleet_over_http(client)
    assert client.delete(f"/v1/workers/{fleet['gen'][0]}").status_code == 204
    assert _closed_with(client, f"/v1/workers/{fleet['gen'][0]}/stream") == (
        4409,
        "worker_retired",
    )


def test_with_auth_on_a_stream_needs_its_workers_token(
    make_app: Callable[..., FastAPI], db_url: str
) -> None:
    def secret(scope: str, instance: str | None = None) -> str:
        database = Database(db_url)
        try:
            with database.write() as session:
                return create_token(session=session, scope=scope, instance=instance)[1]
        finally:
            database.dispose()

    with TestClient(make_app(auth=True)) as api:
        api.headers["Authorization"] = f"Bearer {secret('admin')}"
        fleet = fleet_over_http(api)
        worker = fleet["gen"][0]
        del api.headers["Authorization"]
        path = f"/v1/workers/{worker}/stream"
        assert _closed_with(api, path) == (4401, "unauthorized")
        others = {"Authorization": f"Bearer {secret('worker', 'ctx')}"}
        assert _closed_with(api, path, headers=others) == (4403, "forbidden")
        own = {"Authorization": f"Bearer {secret('worker', 'gen')}"}
        with api.websocket_connect(path, headers=own) as ws:
            assert _lines(ws.receive_bytes()) == [{"type": "hello"}]
            _send(ws, 1, engine_record(fleet, "receive", 0))
            assert _answer(ws)["accepted"] == 1


def test_batches_that_arrive_together_share_one_transaction(app: FastAPI) -> None:
    """Six ranks' batches queued while the writer is busy are written as one group; a batch
    refused in that group is answered with its error and the others commit."""
    with TestClient(app) as api:
        fleet = fleet_over_http(api, ctx_tp=2, gen_tp=2)
        writer: RecordWriter = app.state.records
        db = app.state.db
        held = threading.Event()
        release = threading.Event()
        real_write = db.write

        def slow_write() -> Any:  # the first group waits, so the next batches queue up
            if not held.is_set():
                held.set()
                release.wait(10)
            return real_write()

        db.write = slow_write
        try:
            bodies = [
                schemas_exec.TransferRecords.model_validate(
                    {
                        "worker_id": fleet[name][rank],
                        "records": [
                            engine_record(fleet, side, rank, request_id=f"r{i}") for i in range(3)
                        ],
                    }
                )
                for name, side in (("ctx", "send"), ("gen", "receive"))
                for rank in (0, 1)
            ]
            forged = schemas_exec.TransferRecords.model_validate(
                {"worker_id": fleet["gen"][0], "records": [engine_record(fleet, "receive", 1)]}
            )
            groups = writer.groups
            first = writer.submit(bodies[0])
            assert held.wait(10)
            rest = [writer.submit(body) for body in [*bodies[1:], forged]]
            release.set()
            assert first.result(10).accepted == 3
            answers = [future.exception(10) or future.result() for future in rest]
        finally:
            db.write = real_write
        assert [a.accepted for a in answers[:-1]] == [3, 3, 3]  # type: ignore[union-attr]
        assert getattr(answers[-1], "status", None) == 403
        assert writer.groups - groups == 2  # the first batch, then the five queued together
        statuses = [t["status"] for t in api.get("/v1/transfers").json()["items"]]
        assert statuses == ["done"] * 3


def test_a_waiter_is_answered_with_what_the_record_writer_settled(
    app: FastAPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`GET ?wait=` reads the transfer once, before it waits; the batch that settles it hands
    over the transfer as it settled, so the waiter reads nothing more."""
    from api.routers import transfers as route

    reads: list[str] = []
    real = route.service.get_transfer

    def counted(**kwargs: Any) -> Any:
        reads.append(kwargs["transfer_id"])
        return real(**kwargs)

    with TestClient(app) as api:
        fleet = fleet_over_http(api)
        with api.websocket_connect(f"/v1/workers/{fleet['ctx'][0]}/stream") as ws:
            ws.receive_bytes()
            _send(ws, 1, engine_record(fleet, "send", 0))  # opens the transfer: running
            assert _answer(ws)["accepted"] == 1
        (transfer,) = api.get("/v1/transfers").json()["items"]
        assert transfer["status"] == "running"
        monkeypatch.setattr(route.service, "get_transfer", counted)
        answers: list[Any] = []
        waiter = threading.Thread(
            target=lambda: answers.append(
                api.get(f"/v1/transfers/{transfer['id']}", params={"wait": 20})
            )
        )
        waiter.start()
        completions = app.state.completions
        for _ in range(500):
            if transfer["id"] in completions.waited() and reads:
                break
            threading.Event().wait(0.01)
        with api.websocket_connect(f"/v1/workers/{fleet['gen'][0]}/stream") as ws:
            ws.receive_bytes()
            _send(ws, 1, engine_record(fleet, "receive", 0))
            assert _answer(ws)["settled"] == [transfer["id"]]
        waiter.join(20)
    assert answers[0].json()["status"] == "done"
    assert reads == [transfer["id"]]  # the read before the wait; none after it
