"""``/v1/workers``: attach, heartbeat, stop; each worker's directory, command stream and records.

The per-request path does not pass through here for engines that embed a worker. What does:
a worker's directory (its pairings' templates and peers, refetched when the heartbeat's
``directory_revision`` changes), its command stream (REST ``execute=true`` pushes to it) and
its batched records of finished transfer parts.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Body, Path, Query, Request, Response, status
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse

from api import schemas_exec as wire
from api.dispatch import (
    HELLO,
    KEEPALIVE_S,
    PING,
    CommandHub,
    CommandStreamResponse,
    Completions,
    Line,
    Ticket,
    encode,
    render,
)
from api.errors import problem_responses
from api.routers.deps import DbDep, MetricsDep
from api.services import execution, stats
from api.services import workers as service

log = logging.getLogger(__name__)

workers_router = APIRouter(prefix="/v1/workers", tags=["workers"])
records_router = APIRouter(prefix="/v1/transfers", tags=["transfers"])

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
def worker_heartbeat(
    worker_id: WorkerId,
    request: Request,
    db: DbDep,
    metrics: MetricsDep,
    body: Annotated[wire.WorkerHeartbeat | None, Body()] = None,
) -> wire.WorkerRead:
    """A worker is alive, and says what UCX uses for its peer connections once it knows (the
    body is optional). The answer's `directory_revision` tells it when to refetch its
    directory (409 `worker_stale`: its instance re-registered, attach again)."""
    now = now_of(request)
    with db.write() as session:  # one UPDATE and one read of the kept revision, O(1)
        row = service.heartbeat(
            session=session,
            worker_id=worker_id,
            now=now,
            ucx_in_use=body.ucx_in_use if body is not None else None,
        )
        revision = service.directory_revision(session=session, worker=row, now=now)
        read = service.worker_read(
            row, now, connected=hub_of(request).connected(row.id), revision=revision
        )
    metrics.worker_heartbeats.inc()
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
            "description": "Newline-delimited JSON: `hello`, then `transfer` commands and "
            "`ping` keep-alives",
            "content": {"application/x-ndjson": {}},
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

    def owed() -> list[tuple[str, Line]]:
        try:
            with db.read() as session:
                commands = execution.commands_owed_to(
                    session=session, worker_id=worker_id, now=now_of(request)
                )
            return [(worker, encode(command)) for worker, command in commands]
        except Exception as error:  # the stream itself must not fail for it
            log.warning(
                "worker %s: cannot look up the commands it may have missed: %s", worker_id, error
            )
            return []

    async def lines() -> AsyncIterator[bytes]:
        ticket = hub.connect(worker_id)
        claim.append(ticket)
        try:
            yield HELLO
            # After connecting (a push from now on lands in this queue): what the worker may
            # have missed while it held no stream here (see api/dispatch.py).
            hub.deliver_now(await run_in_threadpool(owed))
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
def record_transfers(
    body: wire.TransferRecords, request: Request, db: DbDep, metrics: MetricsDep
) -> wire.RecordsAccepted:
    """A worker's batch of finished transfer parts (repeats are ignored). Settles transfers
    and wakes their `?wait=` long-polls. Refused whole: times outside a window of the control
    plane's clock (422 `record_time_out_of_range`), a pairing that is not the record's own
    instances' (403 `pairing_mismatch`), blocks its plan cannot expand, a layer group without
    its context or generation list included (422 `invalid_blocks`; the transfer, if another
    record opened it, fails with the reason)."""
    now = now_of(request)
    stored: list[wire.TransferRecord] = []
    try:
        with db.write() as session:
            accepted, settled = execution.record_parts(
                session=session, body=body, now=now, stored=stored
            )
            finished = stats.finished(session=session, transfer_ids=settled)
    except execution.UnexpandableBlocks as error:
        # Refused whole; a transfer the other side's records already opened fails now, with
        # the reason, instead of waiting for a part that will never be stored.
        with db.write() as session:
            failed = execution.fail_transfers(
                session=session,
                transfer_ids=[error.extra["transfer_id"]],
                now=now,
                reason=error.detail,
            )
            finished = stats.finished(session=session, transfer_ids=failed)
        request.app.state.completions.settled(failed)
        metrics.transfers_settled(finished)
        raise
    completions: Completions = request.app.state.completions
    completions.settled(settled)
    relay = hub_of(request).relay
    if settled and relay is not None:  # waiters on the other API processes wake too
        relay.publish_settled(settled)
    metrics.record_batches.inc()
    for record in stored:  # repeats, other attempts' and unknown transfers' records: not
        metrics.part_results.labels(state=record.status).inc()
        metrics.moved_bytes.labels(kind=record.side).inc(record.bytes)
    metrics.transfers_settled(finished)
    return wire.RecordsAccepted(accepted=accepted, settled=settled)


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
