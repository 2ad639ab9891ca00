"""``/v1/transfers``: plan one request's transfer, read it back, expand its fragments."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Annotated, Any

from fastapi import APIRouter, Header, Path, Query, Request, Response, status
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from api import schemas
from api.db import Database
from api.dispatch import RECONNECT_GRACE_S, CommandHub, Completions, RelayError
from api.errors import Unavailable, problem_responses
from api.routers.deps import DbDep, MetricsDep
from api.services import execution
from api.services import transfers as service

router = APIRouter(prefix="/v1/transfers", tags=["transfers"])
log = logging.getLogger(__name__)

MAX_WAIT_S = 60.0

TransferId = Annotated[str, Path(min_length=1, max_length=64, description="Transfer id")]


@router.post(
    "",
    operation_id="create_transfer",
    response_model=schemas.TransferRead,
    status_code=status.HTTP_201_CREATED,
    responses={
        200: {"model": schemas.TransferRead, "description": "Replay of an Idempotency-Key"},
        **problem_responses(400, 404, 409, 413, 422, 503),
    },
)
async def create_transfer(
    body: schemas.TransferCreate,
    request: Request,
    response: Response,
    db: DbDep,
    metrics: MetricsDep,
    idempotency_key: Annotated[
        str | None,
        Header(
            alias="Idempotency-Key",
            min_length=1,
            max_length=256,
            description="Same key + same body: the same transfer; + another body: 409. "
            "Keys are scoped to the calling token (auth on).",
        ),
    ] = None,
    wait: Annotated[
        float,
        Query(
            ge=0,
            le=MAX_WAIT_S,
            description="With `execute`: answer once the transfer is done or failed, or after "
            "this many seconds (still `queued` or `running`: `GET ?wait=` goes on), in one "
            "round trip instead of a `GET ?wait=` after the `201`",
        ),
    ] = 0.0,
) -> schemas.TransferRead:
    """Plan one request's KV transfer from the pairing's templates and both block lists; with
    `execute`, push it to the workers of every rank taking part (503 when one has none). A
    replay of a running transfer pushes again what no rank has recorded yet. `?wait=S` (with
    `execute`) answers when it settles, like `GET /v1/transfers/{id}?wait=S`."""
    deadline = time.monotonic() + wait
    principal = getattr(request.state, "principal", None)
    hub: CommandHub = request.app.state.hub
    relay = hub.relay

    def create() -> tuple[schemas.TransferRead, bool, list[tuple[str, dict[str, Any]]]]:
        commands: list[tuple[str, dict[str, Any]]] = []
        with db.write() as session:
            row, created = service.create_transfer(
                session=session,
                body=body,
                idempotency_key=idempotency_key,
                idempotency_scope=None if principal is None else principal.token_id,
                commands=commands,
            )
            if not created and row.execute and row.status in ("queued", "running"):
                # A replay: the first attempt may have died with the API process that took
                # it, after its commit and before its push. Send again what no rank has
                # recorded yet (a worker drops a command it already has).
                commands = execution.commands_owed(
                    session=session, now=request.app.state.clock(), transfers=[row]
                )
            if relay is not None and commands:
                # The other API processes' share leaves with this transaction (PostgreSQL
                # delivers a NOTIFY at commit): stored and pushed together, or neither.
                try:
                    relay.notify_in(session, relay.ref_payloads(hub.remote(commands)))
                except RelayError as error:
                    raise _undelivered(str(error)) from None
            return service.transfer_read(row), created, commands

    result, created, commands = await run_in_threadpool(create)
    waiting = wait > 0 and result.status in ("queued", "running")
    completions: Completions = request.app.state.completions
    # Listen before the push: a transfer that settles at once still wakes the wait.
    event = completions.event(result.id) if waiting else None
    try:
        await run_in_threadpool(push_commands, request, commands, relay is not None)
        if created:
            metrics.transfer_planned(
                context=result.context,
                generation=result.generation,
                bytes_=result.bytes,
                fragments=result.fragments,
                runs=sum(int(getattr(route, "runs", 0) or 0) for route in result.routes),
            )
        if event is not None:
            # A new transfer's commands left after the event listened: no need to read it
            # again before the first wait.
            result = await _settled(
                db, result.id, event, deadline, result if created else None, completions
            )
    finally:
        if event is not None:
            completions.release(result.id)
    response.status_code = status.HTTP_201_CREATED if created else status.HTTP_200_OK
    return result


async def _settled(
    db: Database,
    transfer_id: str,
    event: asyncio.Event,
    deadline: float,
    current: schemas.TransferRead | None = None,
    completions: Completions | None = None,
) -> schemas.TransferRead:
    """The transfer once it is no longer queued or running, or as it is at ``deadline``.
    Nothing here polls the database: the records route of this process, the relay from the
    others, and the process's housekeeping (app.py: settled elsewhere, or reaped at its
    deadline) set ``event``. ``current``: the transfer as the caller read it after ``event``
    started listening (the first read is skipped)."""

    def read() -> schemas.TransferRead:
        with db.read() as session:
            return service.transfer_read(
                service.get_transfer(session=session, transfer_id=transfer_id)
            )

    while True:
        # A set before this read is answered by the read (or was stale: a transfer that
        # settled, was retried and runs again); a set after it ends the wait below. The
        # record writer of this process hands over what it settled: no read then.
        kept = completions.result(transfer_id) if completions is not None else None
        if current is not None:
            result, current = current, None
        elif kept is not None and kept.status not in ("queued", "running"):
            return kept  # type: ignore[no-any-return]
        else:
            event.clear()
            result = await run_in_threadpool(read)
        if result.status not in ("queued", "running"):
            return result
        left = deadline - time.monotonic()
        if left <= 0:
            return result
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(left):
                await event.wait()
        if not event.is_set():
            return await run_in_threadpool(read)
        kept = completions.result(transfer_id) if completions is not None else None
        if kept is not None and kept.status not in ("queued", "running"):
            return kept  # type: ignore[no-any-return]


def push_commands(
    request: Request, commands: list[tuple[str, dict[str, Any]]], relayed: bool = False
) -> None:
    """Hand the commands to the workers' streams (after the commit: a worker that reports at
    once must find the transfer). A worker whose stream is not open gets its commands if it
    opens it within the reconnect grace; else its part fails at the deadline. Say so now.
    Commands the relay could not hand to the other API processes fail their transfers at once:
    503 ``commands_undelivered``, never a ``201`` for a command nobody will get."""
    hub: CommandHub = request.app.state.hub
    try:
        missed = hub.push(commands, relayed=relayed)
    except RelayError as error:
        ids = sorted({command["transfer_id"] for _, command in commands})
        db = request.app.state.db
        with db.write() as session:
            execution.fail_transfers(
                session=session,
                transfer_ids=ids,
                now=request.app.state.clock(),
                reason=f"commands_undelivered: {error}",
            )
        raise _undelivered(f"{error}; transfer(s) {', '.join(ids)} failed") from None
    if missed:
        log.warning(
            "no command stream open for worker(s) %s; their commands wait %.0f s for "
            "it, then their transfers fail at their deadline",
            ", ".join(sorted(set(missed))),
            RECONNECT_GRACE_S,
        )


def _undelivered(why: str) -> Unavailable:
    return Unavailable(
        "commands could not be relayed to the API process that holds the workers' streams "
        f"({why}): retry",
        code="commands_undelivered",
        headers={"Retry-After": "1"},
    )


@router.get(
    "",
    operation_id="list_transfers",
    response_model=schemas.TransferList,
    responses=problem_responses(422, 503),
)
def list_transfers(
    db: DbDep,
    status_: Annotated[
        schemas.TransferStatus | None, Query(alias="status", description="Filter by status")
    ] = None,
    context: Annotated[str | None, Query(max_length=128, description="Context instance")] = None,
    generation: Annotated[
        str | None, Query(max_length=128, description="Generation instance")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=1 << 31)] = 0,
) -> schemas.TransferList:
    """List transfers, newest first, optionally by status and instances."""
    with db.read() as session:
        rows, total = service.list_transfers(
            session=session,
            status=status_,
            context=context,
            generation=generation,
            limit=limit,
            offset=offset,
        )
        items = [service.transfer_read(row) for row in rows]
    return schemas.TransferList(items=items, total=total, limit=limit, offset=offset)


@router.get(
    "/{transfer_id}",
    operation_id="get_transfer",
    response_model=schemas.TransferRead,
    responses=problem_responses(404, 422, 503),
)
async def get_transfer(
    transfer_id: TransferId,
    request: Request,
    db: DbDep,
    metrics: MetricsDep,
    wait: Annotated[
        float,
        Query(
            ge=0,
            le=MAX_WAIT_S,
            description="Long-poll: wait up to this many seconds for "
            "the transfer to be done or failed",
        ),
    ] = 0.0,
) -> schemas.TransferRead:
    """One transfer: status, routes, bytes and fragment count; `?wait=S` long-polls (it wakes
    when the transfer settles, not on a timer)."""
    deadline = time.monotonic() + wait
    completions: Completions = request.app.state.completions

    def read() -> schemas.TransferRead:
        with db.read() as session:
            return service.transfer_read(
                service.get_transfer(session=session, transfer_id=transfer_id)
            )

    if wait <= 0:
        return await run_in_threadpool(read)
    # Listen before the first read: a settle between the read and the wait still wakes us.
    event = completions.event(transfer_id)
    try:
        return await _settled(db, transfer_id, event, deadline, completions=completions)
    finally:
        completions.release(transfer_id)


@router.post(
    "/{transfer_id}/retry",
    operation_id="retry_transfer",
    response_model=schemas.TransferRead,
    responses=problem_responses(404, 409, 422, 503),
)
def retry_transfer(transfer_id: TransferId, request: Request, db: DbDep) -> schemas.TransferRead:
    """Run a failed executed transfer again (same plan and blocks, next attempt)."""
    with db.write() as session:
        row, commands = execution.retry_transfer(
            session=session, transfer_id=transfer_id, now=request.app.state.clock()
        )
        result = service.transfer_read(row)
    push_commands(request, commands)
    return result


@router.get(
    "/{transfer_id}/fragments",
    operation_id="get_transfer_fragments",
    response_model=schemas.TransferFragments,
    responses=problem_responses(404, 409, 422, 503),
)
def get_transfer_fragments(
    transfer_id: TransferId,
    request: Request,
    db: DbDep,
    offset: Annotated[
        int, Query(ge=0, le=1 << 62, description="Number of the first fragment to return")
    ] = 0,
    limit: Annotated[
        int | None,
        Query(
            ge=1,
            description="Most fragments to return, at most KVPLANE_MAX_FRAGMENTS_PER_PAGE "
            "(50,000 by default). Without it the whole list, if it fits in one page.",
        ),
    ] = None,
) -> Response:
    """Fragments `[src_pool, src_offset, dst_pool, dst_offset, length]` per route, one page at
    a time (`offset`, `limit`, `next_offset`); above the page limit: 422 `too_many_fragments`."""
    max_per_page = int(request.app.state.settings.max_fragments_per_page)
    with db.read() as session:
        page = service.transfer_fragments(
            session=session,
            transfer_id=transfer_id,
            max_per_page=max_per_page,
            offset=offset,
            limit=limit,
        )
    # Serialized directly: validating up to a page of int lists again would double the cost.
    return JSONResponse(page)
