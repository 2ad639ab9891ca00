"""``/v1/workers``: attach, heartbeat, stop; each worker's directory, command stream and records.

The per-request path does not pass through here for engines that embed a worker. What does:
a worker's directory (its pairings' templates and peers, refetched when the heartbeat's
``directory_revision`` changes), its command stream (REST ``execute=true`` pushes to it) and
its batched records of finished transfer parts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime
from typing import Annotated, Any

import anyio
from anyio.abc import TaskGroup
from fastapi import APIRouter, Body, Path, Query, Request, Response, WebSocket, status
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from sqlalchemy.exc import SQLAlchemyError
from starlette.websockets import WebSocketDisconnect

from api import auth
from api import schemas_exec as wire
from api.db import Database
from api.dispatch import (
    HELLO,
    KEEPALIVE_S,
    PING,
    WRITE_TIMEOUT_S,
    CommandHub,
    CommandStreamResponse,
    Line,
    Ticket,
    encode,
    render,
)
from api.errors import BadRequest, KvplaneError, problem_responses
from api.records import RecordWriter
from api.routers.deps import DbDep, MetricsDep
from api.services import execution
from api.services import workers as service
from api.services.liveness import MEMO

log = logging.getLogger(__name__)

workers_router = APIRouter(prefix="/v1/workers", tags=["workers"])
records_router = APIRouter(prefix="/v1/transfers", tags=["transfers"])
# The workers' WebSocket stream checks its caller itself (the routers' guard reads HTTP requests).
stream_router = APIRouter(prefix="/v1/workers")

WorkerId = Annotated[str, Path(min_length=1, max_length=64, description="Worker id")]


def now_of(request: Request) -> datetime:
    """The app's clock (injectable in tests)."""
    clock: service.Clock = request.app.state.clock
    return clock()


def hub_of(request: Request) -> CommandHub:
    hub: CommandHub = request.app.state.hub
    return hub


@workers_router.post(
    "",
    operation_id="register_worker",
    response_model=wire.WorkerAttached,
    status_code=status.HTTP_201_CREATED,
    responses=problem_responses(404, 409, 413, 422, 503),
)
def register_worker(
    body: wire.WorkerCreate, request: Request, db: DbDep, metrics: MetricsDep
) -> wire.WorkerAttached:
    """Attach a worker process to one rank: its pools' addresses and its NIXL endpoint. A rank
    has one worker: the one attached there before is superseded (its heartbeat answers 409
    `worker_superseded`, its command stream ends with a `superseded` line) and stops. 409
    `agent_name_taken`: a live worker of another rank has this NIXL agent name."""
    now = now_of(request)
    superseded: list[str] = []
    with db.write() as session:
        row = service.register_worker(session=session, body=body, now=now, superseded=superseded)
        read = service.worker_read(row, now)
    for old in superseded:  # told on its stream (and by 409 worker_superseded on its heartbeat)
        hub_of(request).close(old, {"type": "superseded", "by": row.id})
    metrics.worker_heartbeats.inc()
    return wire.WorkerAttached(
        **read.model_dump(), heartbeat_interval_s=service.HEARTBEAT_INTERVAL_S
    )


@workers_router.get(
    "",
    operation_id="list_workers",
    response_model=wire.WorkerList,
    responses=problem_responses(422, 503),
)
def list_workers(
    request: Request,
    db: DbDep,
    instance: Annotated[str | None, Query(max_length=128)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 500,
    offset: Annotated[int, Query(ge=0, le=1 << 31)] = 0,
) -> Response:
    """Workers with their status (alive, gone, stopped, stale)."""
    now = now_of(request)
    hub = hub_of(request)
    with db.read() as session:
        rows = service.list_workers(session=session, instance=instance, limit=limit, offset=offset)
    listing = wire.WorkerList(
        items=[service.worker_read(row, now, connected=hub.connected(row.id)) for row in rows]
    )
    # Built and validated once here: serialized directly, not validated again on the way out.
    return Response(content=listing.model_dump_json(), media_type="application/json")


@workers_router.post(
    "/{worker_id}/heartbeat",
    operation_id="worker_heartbeat",
    response_model=wire.WorkerRead,
    responses=problem_responses(404, 409, 422, 503),
)
async def worker_heartbeat(
    worker_id: WorkerId,
    request: Request,
    db: DbDep,
    metrics: MetricsDep,
    body: Annotated[wire.WorkerHeartbeat | None, Body()] = None,
) -> Response:
    """A worker is alive, and says what UCX uses for its peer connections once it knows (the
    body is optional). The answer's `directory_revision` tells it when to refetch its
    directory (409 `worker_stale`: its instance re-registered, attach again). A live worker's
    `heartbeat_at` is written at most every 2 s; the heartbeats in between are answered from
    memory (`heartbeat_at` is then the last written one)."""
    now = now_of(request)
    hub = hub_of(request)
    report = body.ucx_in_use if body is not None else None
    kept = MEMO.answer(worker_id, now) if report is None else None
    if kept is not None:
        read = kept.model_copy(
            update={
                "connected": hub.connected(worker_id),
                "heartbeat_age_s": max(0.0, (now - kept.heartbeat_at).total_seconds()),
            }
        )
    else:
        read = await run_in_threadpool(_heartbeat_written, db, hub, worker_id, now, report)
    metrics.worker_heartbeats.inc()
    # Built and validated here: serialized directly, not validated again on the way out.
    return Response(content=read.model_dump_json(), media_type="application/json")


def _heartbeat_written(
    db: Database,
    hub: CommandHub,
    worker_id: str,
    now: datetime,
    report: wire.UcxInUse | None,
) -> wire.WorkerRead:
    """A heartbeat that writes: one UPDATE and one read for a live worker (then kept in
    :data:`MEMO`), the whole row otherwise (a UCX report, a worker back from "gone", or a 409)."""
    generation = MEMO.generation()
    with db.write() as session:
        live = (
            None
            if report is not None
            else service.live_heartbeat(session=session, worker_id=worker_id, now=now)
        )
        if live is not None:
            revision = service.revision_of(live.instance_epoch, live.directory_revision, live.rank)
            read = service.worker_read(
                live, now, connected=hub.connected(worker_id), revision=revision
            )
        else:
            row = service.heartbeat(
                session=session, worker_id=worker_id, now=now, ucx_in_use=report
            )
            revision = service.directory_revision(session=session, worker=row, now=now)
            read = service.worker_read(row, now, connected=hub.connected(row.id), revision=revision)
    MEMO.keep(worker_id, now, read, generation)
    return read


@workers_router.get(
    "/{worker_id}/directory",
    operation_id="get_worker_directory",
    response_model=wire.WorkerDirectory,
    responses=problem_responses(404, 409, 422, 429, 503),
)
def get_worker_directory(worker_id: WorkerId, request: Request, db: DbDep) -> Response:
    """The worker's directory: compiled templates of every pairing that involves its instance
    (every DP combination, its rank's routes) and its peers' live workers and endpoints. Reads
    are paced per worker (`KVPLANE_DIRECTORY_READS_PER_S`, default 10 a second in bursts of
    20): one over the pace waits up to 1 s for its turn, else 429 `rate_limited` with
    `Retry-After`."""
    now = now_of(request)
    # Answered as the JSON encoded when the revision was built: no validation per request.
    try:
        with db.read() as session:  # a plan missing from the cache: compiled in a write below
            body = service.worker_directory_json(
                session=session, worker_id=worker_id, now=now, read_only=True
            )
    except service.PlanNotCached:
        with db.write() as session:
            body = service.worker_directory_json(session=session, worker_id=worker_id, now=now)
    return Response(content=body, media_type="application/json")


@workers_router.get(
    "/{worker_id}/commands",
    operation_id="stream_worker_commands",
    response_class=StreamingResponse,
    responses={
        200: {
            "description": "Newline-delimited JSON: `hello`, then `transfer` commands "
            "(each line a `TransferCommand`) and `ping` keep-alives, and a last `stopped` or "
            "`superseded` line",
            "content": {
                "application/x-ndjson": {"schema": {"$ref": "#/components/schemas/TransferCommand"}}
            },
        },
        **problem_responses(404, 409, 422, 503),
    },
)
def stream_worker_commands(worker_id: WorkerId, request: Request, db: DbDep) -> StreamingResponse:
    """The push channel of REST `execute=true`: held open by the worker, one JSON line per
    command (a newer stream of the same worker replaces this one). A stream that opens first
    re-sends the commands of running transfers its rank has not recorded yet. A command's
    `timeout_s` is what is left of its `deadline_at` (Unix seconds) when its line is written.
    The stream ends with a `stopped` or `superseded` line when the worker is stopped or another
    worker attaches to its rank; it is cut when the worker does not read it."""
    with db.read() as session:
        service.current_worker(session=session, worker_id=worker_id)
    hub = hub_of(request)
    claim: list[Ticket] = []

    async def lines() -> AsyncIterator[bytes]:
        ticket = hub.connect(worker_id)
        claim.append(ticket)
        try:
            yield HELLO
            # After connecting (a push from now on lands in this queue): what the worker may
            # have missed while it held no stream here (see api/dispatch.py).
            hub.deliver_now(await run_in_threadpool(_owed, db, worker_id, now_of(request)))
            while True:
                batch, final, ended = await hub.next_lines(ticket, KEEPALIVE_S)
                # Commands queued meanwhile leave together (a chunk per MiB): few writes, and
                # few passes through the middleware.
                chunks = render(batch, now_of(request).timestamp())
                for chunk in chunks:
                    yield chunk
                if final is not None:
                    yield final
                if ended:  # replaced by a newer stream of the worker, stopped, or cut
                    return
                if not chunks:
                    yield PING
        finally:
            hub.disconnect(ticket)

    return CommandStreamResponse(
        lines(),
        on_stall=lambda: hub.cut(claim[0] if claim else None, "a write stalled"),
        media_type="application/x-ndjson",
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
    )


def _owed(db: Database, worker_id: str, now: datetime) -> list[tuple[str, Line]]:
    """The commands a stream that opens re-sends: what its worker may have missed while it held
    no stream here (see api/dispatch.py)."""
    try:
        with db.read() as session:
            commands = execution.commands_owed_to(session=session, worker_id=worker_id, now=now)
        return [(worker, encode(command)) for worker, command in commands]
    except Exception as error:  # the stream itself must not fail for it
        log.warning(
            "worker %s: cannot look up the commands it may have missed: %s", worker_id, error
        )
        return []


@stream_router.websocket("/{worker_id}/stream")
async def worker_stream(websocket: WebSocket, worker_id: str) -> None:
    """A worker's two-way stream (WebSocket): the command stream's lines down, its records up.

    Down, each binary message holds one or more JSON lines, those of
    `GET /v1/workers/{id}/commands` (`hello`, `transfer`, `ping`, a last `stopped` or
    `superseded`), and `recorded` lines that answer the worker's record batches. Up, a message
    is `{"type": "records", "seq": N, "records": [...]}` (the records of
    `POST /v1/transfers/records`); its answer is `{"type": "recorded", "seq": N, "accepted",
    "settled"}` or `{"type": "recorded", "seq": N, "error": {"status", "code", "detail"}}`.
    Batches are answered in order. A stream that cannot serve closes with code 4000 + the HTTP
    status it would have answered (4401, 4403, 4404, 4409) and the problem's code as reason."""
    app = websocket.app
    db: Database = app.state.db
    await websocket.accept()
    try:
        if app.state.settings.auth:
            principal = await auth.authenticate(websocket)  # type: ignore[arg-type]
            await auth.check(websocket, principal, "stream_worker_commands")  # type: ignore[arg-type]
        await run_in_threadpool(_current, db, worker_id)
    except KvplaneError as error:
        await websocket.close(code=4000 + error.status, reason=error.code[:120])
        return
    hub: CommandHub = app.state.hub
    writer: RecordWriter = app.state.records
    ticket = hub.connect(worker_id)
    lock = asyncio.Lock()

    async def send(data: bytes) -> None:
        async with lock, asyncio.timeout(WRITE_TIMEOUT_S):
            await websocket.send_bytes(data)

    async def commands() -> None:
        await send(HELLO)
        hub.deliver_now(await run_in_threadpool(_owed, db, worker_id, app.state.clock()))
        while True:
            batch, final, ended = await hub.next_lines(ticket, KEEPALIVE_S)
            chunks = render(batch, app.state.clock().timestamp())
            for chunk in chunks:
                await send(chunk)
            if final is not None:
                await send(final)
            if ended:  # replaced by a newer stream of the worker, stopped, or cut
                return
            if not chunks:
                await send(PING)

    async def records() -> None:
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                return
            data = message.get("bytes") or (message.get("text") or "").encode()
            answer = await _recorded(writer, worker_id, data)
            await send(json.dumps(answer, separators=(",", ":")).encode() + b"\n")

    async def until_either_ends(job: Callable[[], Awaitable[None]], group: TaskGroup) -> None:
        try:
            await job()
        except TimeoutError:  # a send that did not complete: the worker does not read
            hub.cut(ticket, "a write stalled")
        except WebSocketDisconnect:
            pass
        group.cancel_scope.cancel()

    try:
        async with anyio.create_task_group() as group:
            group.start_soon(until_either_ends, commands, group)
            group.start_soon(until_either_ends, records, group)
        with contextlib.suppress(Exception):
            await websocket.close()
    finally:
        hub.disconnect(ticket)


def _current(db: Database, worker_id: str) -> None:
    with db.read() as session:
        service.current_worker(session=session, worker_id=worker_id)


async def _recorded(writer: RecordWriter, worker_id: str, data: bytes) -> dict[str, Any]:
    """The answer to one message of a worker's stream: its record batch written, or why not."""
    seq: Any = None
    try:
        message = json.loads(data)
        if not isinstance(message, dict) or message.get("type") != "records":
            raise BadRequest(
                'a worker stream message is {"type": "records", "seq": N, "records": [...]}',
                code="invalid_message",
            )
        seq = message.get("seq")
        if not isinstance(seq, int) or isinstance(seq, bool):
            seq = None
            raise BadRequest("a records message needs an integer seq", code="invalid_message")
        body = wire.TransferRecords.model_validate(
            {"worker_id": worker_id, "records": message.get("records")}
        )
        accepted = await asyncio.wrap_future(writer.submit(body))
    except (ValueError, RecursionError) as error:  # not JSON, too deep, or invalid records
        detail = str(error)[:2000]
        return {"type": "recorded", "seq": seq, "error": _problem(422, "validation_error", detail)}
    except KvplaneError as error:
        return {
            "type": "recorded",
            "seq": seq,
            "error": _problem(error.status, error.code, error.detail),
        }
    except SQLAlchemyError as error:
        log.warning("worker %s: a record batch was not written: %s", worker_id, error)
        detail = "the database did not take the batch; send it again"
        return {"type": "recorded", "seq": seq, "error": _problem(503, "unavailable", detail)}
    return {"type": "recorded", "seq": seq, **accepted.model_dump(mode="json")}


def _problem(status: int, code: str, detail: str) -> dict[str, Any]:
    return {"status": status, "code": code, "detail": detail}


@workers_router.delete(
    "/{worker_id}",
    operation_id="stop_worker",
    status_code=status.HTTP_204_NO_CONTENT,
    responses=problem_responses(404, 422, 503),
)
def stop_worker(worker_id: WorkerId, request: Request, db: DbDep) -> Response:
    """A worker shutting down cleanly: it leaves its peers' directories, and its command
    stream ends (a `stopped` line)."""
    with db.write() as session:
        service.stop_worker(session=session, worker_id=worker_id)
    hub_of(request).close(worker_id, {"type": "stopped"})
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@records_router.post(
    "/records",
    operation_id="record_transfers",
    response_model=wire.RecordsAccepted,
    responses=problem_responses(403, 404, 409, 413, 422, 503),
)
async def record_transfers(body: wire.TransferRecords, request: Request) -> wire.RecordsAccepted:
    """A worker's batch of finished transfer parts (repeats are ignored). Settles transfers
    and wakes their `?wait=` long-polls. Refused whole: times outside a window of the control
    plane's clock (422 `record_time_out_of_range`), a pairing that is not the record's own
    instances' (403 `pairing_mismatch`), blocks its plan cannot expand, a layer group without
    its context or generation list included (422 `invalid_blocks`; the transfer, if another
    record opened it, fails with the reason). Workers send their records over their stream
    (`/v1/workers/{id}/stream`) where they can; both ways are written alike, together with
    the batches that arrive meanwhile."""
    writer: RecordWriter = request.app.state.records
    return await asyncio.wrap_future(writer.submit(body))


@records_router.get(
    "/{transfer_id}/parts",
    operation_id="list_transfer_parts",
    response_model=wire.PartList,
    responses=problem_responses(404, 422, 503),
)
def list_transfer_parts(
    transfer_id: Annotated[str, Path(min_length=1, max_length=64)],
    db: DbDep,
    state: Annotated[wire.PartState | None, Query()] = None,
) -> wire.PartList:
    """Each rank's recorded part of one transfer (every attempt)."""
    from api.services.transfers import get_transfer

    with db.read() as session:
        get_transfer(session=session, transfer_id=transfer_id)
        rows = execution.list_parts(
            session=session, transfer_id=transfer_id, state=state, limit=1000
        )
        return wire.PartList(items=[execution.part_read(session, row) for row in rows])
