"""Execution record: dispatching REST transfers to workers, and what workers report back.

The hot path runs in the workers (``workers/handover/``): every rank computes its routes from
its cached directory, so the control plane is not on a request's way. What is left here:

- **dispatch** (REST ``execute=true``): :func:`dispatch_commands` checks that every rank taking
  part has a live worker and builds one command per rank; a new transfer is stored already
  running (:func:`attempt_values`: its attempt and deadline), a retry goes through
  :func:`prepare_dispatch`. The router pushes the commands over each worker's open command
  stream (``api/dispatch.py``).
- **records**: workers report each finished part (one rank's side of one transfer) in batches;
  :func:`record_parts` stores them in the ``jobs`` table (one row per transfer, attempt, kind and
  rank; a repeated record is ignored, so a batch may be retried) and settles the transfer. An
  engine-path transfer gets its row from its first record (its id is derived from the pairing,
  both epochs and the request id, so every rank's record lands on one row).
- **settle**: a transfer is ``failed`` as soon as one part failed; ``done`` when every receiver
  rank's part is done (with ``verify``, every sender's too, and every route's sender and receiver
  crc32 agree). Parts that arrive later are stored but change nothing.
- **deadlines**: :func:`reap_overdue` fails a dispatched transfer that is not settled by its
  deadline (plus a grace for the batched record), naming the ranks that never reported. A
  re-registered or deleted instance fails its running transfers (``peer_restarted`` /
  ``peer_left``); the workers learn it from their directory and fail their handles too.
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, cast

from sqlalchemy import Table, bindparam, func, insert, or_, select, update
from sqlalchemy.orm import Session

from api import schemas_exec as wire
from api.errors import BadRequest, Conflict, Forbidden, KvplaneError, NotFound, Unavailable
from api.models import NO_DP_RANK, InstanceRow, JobRow, PairingRow, PlanRow, TransferRow, WorkerRow
from api.services.pairings import plan_for_pairing
from api.services.workers import current_worker, instance_by_name, live_worker_ids, live_workers
from geometry import Plan, summarize

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 30.0
RECORD_GRACE_S = 5.0  # a worker reports within a second; allow for a slow batch
ENGINE_RECORD_GRACE_S = 30.0  # engine-path rows wait this long for the other ranks' records
REAP_BATCH = 100  # overdue transfers one request fails at most (issue 13 item 1: bounded work)
ACTIVE = ("queued", "running")


class UnexpandableBlocks(BadRequest):
    """An engine-path record whose block lists its pairing's plan cannot expand (422
    ``invalid_blocks``); the transfer it names fails with the reason, where it exists."""


def engine_transfer_id(
    pairing_id: str, context_epoch: str, generation_epoch: str, request_id: str
) -> str:
    """The id of an engine-path transfer: the same on every rank that records a part of it."""
    key = f"{pairing_id}|{context_epoch}|{generation_epoch}|{request_id}"
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def participants(summary: dict[str, Any]) -> tuple[set[int], set[int]]:
    """``(sender ranks, receiver ranks)`` that move bytes in a transfer's summary."""
    routes = [r for r in summary.get("routes", []) if r.get("bytes", 0) > 0]
    return {int(r["sender_rank"]) for r in routes}, {int(r["receiver_rank"]) for r in routes}


def xid(transfer_id: str, attempt: int) -> str:
    """The id the workers use on the wire: one per attempt, so stale news never mix."""
    return f"{transfer_id}.{attempt}"


# --- dispatch --------------------------------------------------------------------------------


def dispatch_commands(
    *, session: Session, transfer: TransferRow, attempt: int, now: datetime, timeout_s: float
) -> list[tuple[str, dict[str, Any]]]:
    """``[(worker_id, command)]`` of ``attempt`` of ``transfer``, one per rank taking part;
    changes nothing. Raises ``503 workers_unavailable`` when a rank has no live worker."""
    epochs, workers = live_worker_ids(
        session, (transfer.context_name, transfer.generation_name), now
    )
    senders, receivers = participants(transfer.summary)
    ctx, gen = workers[transfer.context_name], workers[transfer.generation_name]
    missing = [f"context rank {r}" for r in sorted(senders) if r not in ctx]
    missing += [f"generation rank {r}" for r in sorted(receivers) if r not in gen]
    if missing:
        raise Unavailable(
            f"no live worker for {', '.join(missing)}; start `kvplane worker` for every rank",
            code="workers_unavailable",
            headers={"Retry-After": "2"},
        )
    command = _command(
        transfer,
        attempt,
        epochs[transfer.context_name],
        epochs[transfer.generation_name],
        now + timedelta(seconds=timeout_s),
        now,
    )
    commands = [(ctx[r], _for_rank(command, "send", r)) for r in sorted(senders)]
    commands += [(gen[r], _for_rank(command, "receive", r)) for r in sorted(receivers)]
    return commands


def attempt_values(
    *, attempt: int, commands: Sequence[Any], now: datetime, timeout_s: float
) -> dict[str, Any]:
    """The transfer columns an attempt with these commands starts with."""
    return {
        "attempt": attempt,
        "status": "running" if commands else "done",
        "error": None,
        "started_at": now,
        "finished_at": None if commands else now,
        "deadline_at": now + timedelta(seconds=timeout_s),
        "updated_at": now,
    }


def prepare_dispatch(
    *, session: Session, transfer: TransferRow, plan: Plan, now: datetime, timeout_s: float
) -> list[tuple[str, dict[str, Any]]]:
    """Start the transfer's next attempt: ``[(worker_id, command)]`` to push, one per rank.

    Raises ``503 workers_unavailable`` (nothing changed) when a rank has no live worker.
    """
    attempt = transfer.attempt + 1
    commands = dispatch_commands(
        session=session, transfer=transfer, attempt=attempt, now=now, timeout_s=timeout_s
    )
    for key, value in attempt_values(
        attempt=attempt, commands=commands, now=now, timeout_s=timeout_s
    ).items():
        setattr(transfer, key, value)
    session.flush()
    return commands


def _command(
    transfer: TransferRow,
    attempt: int,
    context_epoch: str,
    generation_epoch: str,
    deadline: datetime,
    now: datetime,
) -> dict[str, Any]:
    """What every rank of one attempt is told (``side`` and ``rank`` added per rank, then the
    whole checked as a :class:`~api.schemas_exec.TransferCommand` by :func:`_for_rank`).

    ``deadline_at`` is the attempt's deadline (Unix seconds); ``timeout_s`` what is left of it
    now. The command stream writes ``timeout_s`` again as each line leaves
    (``api/dispatch.py``), so a command that waited does not run past the deadline."""
    return {
        "type": "transfer",
        "transfer_id": transfer.id,
        "attempt": attempt,
        "xid": xid(transfer.id, attempt),
        "request_id": transfer.request_id,
        "context": transfer.context_name,
        "generation": transfer.generation_name,
        "context_epoch": context_epoch,
        "generation_epoch": generation_epoch,
        "context_dp_rank": transfer.context_dp_rank,
        "generation_dp_rank": transfer.generation_dp_rank,
        "blocks": transfer.blocks,
        "num_tokens": (transfer.summary or {}).get("num_tokens"),
        "mode": transfer.mode,
        "verify": transfer.verify,
        "deadline_at": deadline.timestamp(),
        "timeout_s": (deadline - now).total_seconds(),
    }


def _for_rank(command: dict[str, Any], side: str, rank: int) -> dict[str, Any]:
    """The command line of one rank: :class:`~api.schemas_exec.TransferCommand`, checked here
    (a few microseconds) so that a worker never gets a line its model refuses."""
    return wire.TransferCommand.model_validate({**command, "side": side, "rank": rank}).model_dump()


MIN_RESEND_S = 0.5  # a command with less time left than this would only fail at its worker
RESEND_BATCH = 1000  # running transfers one stream (re)connection looks at, at most


def commands_owed(
    *,
    session: Session,
    now: datetime,
    transfers: Sequence[TransferRow],
    worker: WorkerRow | None = None,
) -> list[tuple[str, dict[str, Any]]]:
    """The commands of running ``transfers`` that may never have reached their workers:
    ``[(worker_id, command)]`` for every rank taking part that has recorded no part of the
    current attempt, sent to the rank's live worker if it attached before the attempt started
    (so it is the worker the attempt was dispatched to); only to ``worker`` when given.

    Engine-path transfers (rows created by their first record, running until every rank's
    record is in) are never dispatched, so nothing is owed for them. The worker may have the
    command already (it is running it, or its record is still on the way): workers drop a
    command whose ``xid`` and side they have seen. ``timeout_s`` is what is left of the
    attempt's deadline, so both sides still give up together.
    """
    running = [
        t
        for t in transfers
        if t.status in ACTIVE
        and t.execute
        and t.attempt > 0
        and t.deadline_at is not None
        and t.started_at is not None
        and (t.deadline_at - now).total_seconds() > MIN_RESEND_S
    ]
    if not running:
        return []
    reported = set(
        session.execute(
            select(JobRow.transfer_id, JobRow.attempt, JobRow.kind, JobRow.rank).where(
                JobRow.transfer_id.in_([t.id for t in running])
            )
        ).all()
    )
    instances: dict[str, tuple[InstanceRow, dict[int, WorkerRow]]] = {}

    def ranks_of(name: str) -> tuple[InstanceRow, dict[int, WorkerRow]]:
        if name not in instances:
            instance = instance_by_name(session, name)
            instances[name] = (instance, live_workers(session, instance, now, ids_only=True))
        return instances[name]

    owed: list[tuple[str, dict[str, Any]]] = []
    for transfer in running:
        assert transfer.deadline_at is not None and transfer.started_at is not None
        try:
            context, senders_live = ranks_of(transfer.context_name)
            generation, receivers_live = ranks_of(transfer.generation_name)
        except NotFound:
            continue  # an instance left: its transfers fail on their own
        if transfer.pairing_id is not None and transfer.id == engine_transfer_id(
            transfer.pairing_id, context.epoch, generation.epoch, transfer.request_id
        ):
            continue  # an engine-path transfer: the engines started it, nobody dispatched it
        command = _command(
            transfer, transfer.attempt, context.epoch, generation.epoch, transfer.deadline_at, now
        )
        senders, receivers = participants(transfer.summary)
        for side, ranks, live in (
            ("send", senders, senders_live),
            ("receive", receivers, receivers_live),
        ):
            for rank in sorted(ranks):
                target = live.get(rank)
                if (
                    target is None
                    or (transfer.id, transfer.attempt, side, rank) in reported
                    or target.registered_at > transfer.started_at
                    or (worker is not None and target.id != worker.id)
                ):
                    continue
                owed.append((target.id, _for_rank(command, side, rank)))
    return owed


def commands_for_refs(
    *, session: Session, refs: Sequence[tuple[str, str, int, str, int]], now: datetime
) -> list[tuple[str, dict[str, Any]]]:
    """The commands that relayed references name (``(worker_id, transfer_id, attempt, side,
    rank)``), built from the database as :func:`commands_owed` builds them: only for a transfer
    still running that attempt with time left (others are news too old to act on)."""
    ids = sorted({ref[1] for ref in refs})
    transfers = {
        row.id: row for row in session.scalars(select(TransferRow).where(TransferRow.id.in_(ids)))
    }
    epochs = dict(
        session.execute(
            select(InstanceRow.name, InstanceRow.epoch).where(
                InstanceRow.name.in_(
                    {
                        name
                        for t in transfers.values()
                        for name in (t.context_name, t.generation_name)
                    }
                )
            )
        ).all()
    )
    commands: list[tuple[str, dict[str, Any]]] = []
    for worker_id, transfer_id, attempt, side, rank in refs:
        transfer = transfers.get(transfer_id)
        if (
            transfer is None
            or transfer.status not in ACTIVE
            or transfer.attempt != attempt
            or transfer.deadline_at is None
            or (transfer.deadline_at - now).total_seconds() <= MIN_RESEND_S
            or transfer.context_name not in epochs
            or transfer.generation_name not in epochs
        ):
            continue
        command = _command(
            transfer,
            attempt,
            epochs[transfer.context_name],
            epochs[transfer.generation_name],
            transfer.deadline_at,
            now,
        )
        commands.append((worker_id, _for_rank(command, side, rank)))
    return commands


def commands_owed_to(
    *, session: Session, worker_id: str, now: datetime
) -> list[tuple[str, dict[str, Any]]]:
    """What a worker whose command stream just opened may have missed (see
    :func:`commands_owed`): running transfers of its instance in which its rank takes part."""
    worker = current_worker(session=session, worker_id=worker_id)
    instance = worker.instance
    column = TransferRow.context_name if instance.role == "context" else TransferRow.generation_name
    transfers = list(
        session.scalars(
            select(TransferRow)
            .where(
                TransferRow.status.in_(ACTIVE),
                column == instance.name,
                TransferRow.execute.is_(True),
                TransferRow.deadline_at > now,
            )
            .order_by(TransferRow.started_at)
            .limit(RESEND_BATCH)
        )
    )
    return commands_owed(session=session, now=now, transfers=transfers, worker=worker)


def retry_transfer(
    *, session: Session, transfer_id: str, now: datetime, timeout_s: float = DEFAULT_TIMEOUT_S
) -> tuple[TransferRow, list[Any]]:
    """Operator action: run a failed transfer again (next attempt, same plan and blocks)."""
    transfer = session.get(TransferRow, transfer_id, with_for_update=True, populate_existing=True)
    if transfer is None:
        raise NotFound(f"transfer {transfer_id!r} does not exist", code="transfer_not_found")
    if transfer.status != "failed" or not transfer.execute:
        raise Conflict(
            f"only a failed executed transfer can be retried (status {transfer.status})",
            code="transfer_not_retryable",
        )
    plan = current_plan(session, transfer)
    if plan is None:
        raise Conflict(
            "the transfer's plan was deleted with its pairing, or an instance re-registered "
            "since it was planned: POST /v1/transfers again",
            code="plan_gone",
        )
    return transfer, prepare_dispatch(
        session=session, transfer=transfer, plan=plan, now=now, timeout_s=timeout_s
    )


def current_plan(session: Session, transfer: TransferRow) -> Plan | None:
    """The transfer's plan if it still describes both instances' memory (else None)."""
    if transfer.plan_id is None:
        return None
    row = session.get(PlanRow, transfer.plan_id)
    if row is None or row.stale:
        return None
    epochs = {
        name: session.scalar(select(InstanceRow.epoch).where(InstanceRow.name == name))
        for name in (transfer.context_name, transfer.generation_name)
    }
    if (epochs[transfer.context_name], epochs[transfer.generation_name]) != (
        row.context_epoch,
        row.generation_epoch,
    ):
        return None
    return Plan.from_dict(row.body)


# --- records ---------------------------------------------------------------------------------


def _unix(value: float) -> datetime:
    return datetime.fromtimestamp(value, tz=UTC)


def record_parts(
    *,
    session: Session,
    body: wire.TransferRecords,
    now: datetime,
    stored: list[wire.TransferRecord] | None = None,
) -> tuple[int, list[str]]:
    """Store a worker's batch of finished parts; returns ``(accepted, settled transfer ids)``
    and appends to ``stored`` the records that were new (what the metrics count).

    What a record may say is checked before anything is stored (the batch is refused whole; the
    worker's recorder then splits it and drops the bad record): its times lie in a window of the
    control plane's clock (422 ``record_time_out_of_range``), an engine-path record names a
    pairing of its own two instances (403 ``pairing_mismatch``) and block lists the pairing's
    plan can expand (422 ``invalid_blocks``). A part of a rank that takes no part in the
    transfer (no route of its plan) is ignored: it can neither settle nor fail it.

    Set-wise, whatever the batch's size: one locking read of its transfers, one read of their
    recorded parts, one multi-row insert, then one read of the transfers this batch can decide
    and of their parts. A transfer is read by six batches (one per rank), so these reads take
    plain rows of the columns they need, not ORM objects: whole ORM rows (JSON columns
    decoded) were a third of the control plane's CPU per engine-path request.
    """
    worker = recording_worker(session, body.worker_id)
    for record in body.records:
        own = record.context if record.side == "send" else record.generation
        if own != worker.instance_name or record.rank != worker.rank:
            raise Forbidden(
                f"worker {worker.id} serves {worker.instance_name} rank {worker.rank}; it cannot "
                f"record {record.side} parts of {own} rank {record.rank}",
                code="forbidden",
            )
    _check_times(body.records, now)
    _check_pairings(session, body.records)
    # (transfer id, record) in id order; an engine-path id is a digest, computed once here
    records = sorted(((_record_transfer_id(r), r) for r in body.records), key=lambda p: p[0])
    ids = sorted({tid for tid, _ in records})
    plans: dict[tuple[Any, ...], tuple[PairingRow | None, PlanRow | None, Plan | None]] = {}
    _insert_engine_rows(session, records, now, plans)
    # Plain statements on the connection (the ORM's execute path cost as much as the SQL; this
    # function flushes what it changes through the ORM itself).
    conn = session.connection()
    # Lock the batch's transfers first, in id order. Otherwise a part's insert takes a key-share
    # lock on its transfer and settling then waits for FOR UPDATE: two workers' batches over the
    # same transfers deadlock on PostgreSQL. The lock also makes the check-then-insert of parts
    # safe against the same batch arriving twice at once.
    transfers: dict[str, Any] = {row.id: row for row in conn.execute(_LOCK, {"ids": ids})}
    described: dict[str, TransferRow] = {}
    for tid, record in records:
        row = transfers.get(tid)
        if (
            record.transfer_id is None
            and row is not None
            and row.pairing_id is None
            and record.blocks
            and tid not in described
        ):
            # The first record(s) may lack block lists: one that has them describes it.
            orm = session.get(TransferRow, tid, populate_existing=True)
            assert orm is not None
            if not orm.blocks:
                _set_columns(orm, _description(session, tid, record, plans))
                session.flush()
            described[tid] = orm
    recorded = {tuple(row) for row in conn.execute(_RECORDED, {"ids": ids})}
    deciding: dict[str, Any] = {}
    rows = []
    for tid, record in records:
        transfer = transfers.get(tid)
        if transfer is None or transfer.attempt != record.attempt:
            continue  # an older attempt's news (or an unknown REST id): nothing to change
        summary = described[tid].summary if tid in described else transfer.summary
        if not _takes_part(session, tid, record, summary, plans):
            log.info(
                "transfer %s: %s rank %d takes no part in it; its record is ignored",
                tid,
                record.side,
                record.rank,
            )
            continue
        if (transfer.context_name, transfer.generation_name) != (record.context, record.generation):
            # A worker records parts of its own instance's transfers only: a record naming
            # its own instance must not settle a transfer between two others.
            raise Forbidden(
                f"transfer {transfer.id} runs {transfer.context_name} -> "
                f"{transfer.generation_name}, not {record.context} -> {record.generation}",
                code="forbidden",
            )
        key = (transfer.id, transfer.attempt, record.side, record.rank)
        if key in recorded:
            continue  # a repeated record (a retried batch): stored once
        recorded.add(key)
        rows.append(_part_row(transfer, worker, record, now))
        if stored is not None:
            stored.append(record)
        # Without verify, a sender's successful part decides nothing (the receivers' parts
        # do): the transfer is not settled for it.
        if record.side == "receive" or record.status == "failed" or transfer.verify:
            deciding[transfer.id] = transfer
    if rows:  # plain INSERT of dicts: an ORM object per part cost a quarter of the batch
        conn.execute(_INSERT_PARTS, rows)
    if not deciding:
        return len(rows), []
    # Their status and summary as they are now (locked above): plain rows, or the ORM row of
    # one described here.
    current = [
        described.get(row.id, row) for row in conn.execute(_DECIDE, {"ids": sorted(deciding)})
    ]
    return len(rows), settle_many(session=session, transfers=current, now=now)


# The record path's statements, built once (composing a statement costs about as much as
# running it on SQLite, and a REST transfer's urgent records come one per batch).


def _ids() -> Any:
    return bindparam("ids", expanding=True)


# What record_parts reads of the batch's transfers (their JSON columns only where it settles)
_LOCK = (
    select(
        TransferRow.id,
        TransferRow.attempt,
        TransferRow.context_name,
        TransferRow.generation_name,
        TransferRow.verify,
        TransferRow.pairing_id,
        TransferRow.summary,
    )
    .where(TransferRow.id.in_(_ids()))
    .order_by(TransferRow.id)
    .with_for_update()
)
_RECORDED = select(JobRow.transfer_id, JobRow.attempt, JobRow.kind, JobRow.rank).where(
    JobRow.transfer_id.in_(_ids())
)
_INSERT_PARTS = insert(cast(Table, JobRow.__table__))
# What deciding a transfer reads of it (settle_many, _outcome, finish)
_DECIDE = (
    select(
        TransferRow.id,
        TransferRow.attempt,
        TransferRow.status,
        TransferRow.verify,
        TransferRow.summary,
    )
    .where(TransferRow.id.in_(_ids()))
    .order_by(TransferRow.id)
)
_EXISTING = select(TransferRow.id).where(TransferRow.id.in_(_ids()))
_PART_COLUMNS = (
    JobRow.transfer_id,
    JobRow.attempt,
    JobRow.kind,
    JobRow.rank,
    JobRow.state,
    JobRow.error,
    JobRow.finished_at,
)
_PARTS = select(*_PART_COLUMNS).where(JobRow.transfer_id.in_(_ids()))
_PARTS_RESULTS = select(*_PART_COLUMNS, JobRow.result).where(JobRow.transfer_id.in_(_ids()))
_SETTLE_DONE = (
    update(TransferRow)
    .where(TransferRow.id.in_(_ids()), TransferRow.status.in_(ACTIVE))
    .values(
        status="done",
        error=None,
        finished_at=bindparam("now", type_=TransferRow.finished_at.type),
        updated_at=bindparam("now", type_=TransferRow.updated_at.type),
    )
    .returning(TransferRow.id)
    .execution_options(synchronize_session=False)
)


RECORD_MAX_AGE_S = 86_400.0  # records queued through an outage longer than this are refused
RECORD_CLOCK_SKEW_S = 300.0  # how far ahead of the control plane's clock a worker's may run


def _check_times(records: Sequence[wire.TransferRecord], now: datetime) -> None:
    """422 ``record_time_out_of_range`` unless every record started at most a day ago, finished
    after it started and at most a few minutes ahead of the control plane's clock. (A forged
    time would keep an engine-path transfer running for years, or top every listing.)"""
    now_s = now.timestamp()
    errors: list[dict[str, Any]] = []
    for index, record in enumerate(records):
        if record.started_at < now_s - RECORD_MAX_AGE_S:
            errors.append(
                {
                    "loc": ["body", "records", index, "started_at"],
                    "msg": f"more than {RECORD_MAX_AGE_S:.0f} s before the control plane's clock",
                }
            )
        if record.finished_at > now_s + RECORD_CLOCK_SKEW_S:
            errors.append(
                {
                    "loc": ["body", "records", index, "finished_at"],
                    "msg": f"more than {RECORD_CLOCK_SKEW_S:.0f} s after the control plane's clock",
                }
            )
        if record.finished_at < record.started_at:
            errors.append(
                {"loc": ["body", "records", index, "finished_at"], "msg": "before started_at"}
            )
    if errors:
        raise BadRequest(
            f"{len(errors)} record time(s) outside the window of the control plane's clock "
            f"({now.isoformat()}): a worker's clock must be synchronized",
            code="record_time_out_of_range",
            errors=errors[:20],
        )


_PAIRING_NAMES = (
    select(PairingRow.id, InstanceRow.name, PairingRow.generation_id)
    .join(InstanceRow, InstanceRow.id == PairingRow.context_id)
    .where(PairingRow.id.in_(_ids()))
)
_NAMES = select(InstanceRow.id, InstanceRow.name).where(InstanceRow.id.in_(_ids()))


def _check_pairings(session: Session, records: Sequence[wire.TransferRecord]) -> None:
    """403 ``pairing_mismatch`` unless every engine-path record names a pairing of its own
    context and generation: a worker cannot make up a transfer with an instance it is not
    paired with. (A REST record names its transfer, which says who takes part.)"""
    wanted = {r.pairing_id for r in records if r.transfer_id is None}
    if not wanted:
        return
    conn = session.connection()
    rows = list(conn.execute(_PAIRING_NAMES, {"ids": sorted(wanted)}))
    names = dict(conn.execute(_NAMES, {"ids": sorted({row[2] for row in rows})}).all())
    pairs = {pid: (context, names.get(gen_id)) for pid, context, gen_id in rows}
    for record in records:
        if record.transfer_id is None and pairs.get(record.pairing_id) != (
            record.context,
            record.generation,
        ):
            raise Forbidden(
                f"pairing {record.pairing_id!r} is not a pairing of {record.context} with "
                f"{record.generation}: a record names its own instances' pairing",
                code="pairing_mismatch",
            )


def _takes_part(
    session: Session,
    tid: str,
    record: wire.TransferRecord,
    summary: dict[str, Any] | None,
    plans: dict[tuple[Any, ...], tuple[PairingRow | None, PlanRow | None, Plan | None]],
) -> bool:
    """Whether the record's rank moves bytes in the transfer: by its summary's routes, or for
    an engine-path transfer not described yet, by its plan's (no plan known: its own word)."""
    if summary and summary.get("routes"):
        senders, receivers = participants(summary)
    elif record.transfer_id is None:
        key = (
            record.pairing_id,
            record.context_epoch,
            record.generation_epoch,
            record.context_dp_rank,
            record.generation_dp_rank,
        )
        if key not in plans:
            plans[key] = _plan_of(session, tid, record)
        plan = plans[key][2]
        if plan is None:
            return True
        senders = {route.sender_rank for route in plan.routes}
        receivers = {route.receiver_rank for route in plan.routes}
    else:
        return True
    return record.rank in (senders if record.side == "send" else receivers)


def _record_transfer_id(record: wire.TransferRecord) -> str:
    if record.transfer_id is not None:
        return record.transfer_id
    return engine_transfer_id(
        record.pairing_id, record.context_epoch, record.generation_epoch, record.request_id
    )


def _insert_engine_rows(
    session: Session,
    records: Sequence[tuple[str, wire.TransferRecord]],
    now: datetime,
    plans: dict[tuple[Any, ...], tuple[PairingRow | None, PlanRow | None, Plan | None]],
) -> None:
    """Create the rows of the batch's engine-path transfers that do not exist yet, before any
    row lock is taken, in id order, each ``ON CONFLICT DO NOTHING``.

    Created later, one by one among the locks (as before), a row that another batch inserted
    after this one's ``FOR UPDATE`` is locked out of id order: two batches of different workers
    over the same engine transfers then deadlock on PostgreSQL (a 503 the worker retries, but
    its records come late). Here a batch only waits on another's uncommitted insert of the same
    id, in id order, holding no row lock yet: no cycle.
    """
    engine_ids = {tid for tid, record in records if record.transfer_id is None}
    if not engine_ids:
        return
    # Most of a batch's transfers exist already (another rank's record came first): building
    # and sending their rows only for the conflict to drop them cost more than this read.
    engine_ids -= set(
        session.connection().execute(_EXISTING, {"ids": sorted(engine_ids)}).scalars()
    )
    rows: dict[str, dict[str, Any]] = {}
    summaries: dict[tuple[Any, ...], dict[Any, dict[str, Any]]] = {}
    for tid, record in records:
        if tid in engine_ids and tid not in rows:
            rows[tid] = _engine_row(tid, record, now)
            if record.blocks:  # described at once: no UPDATE of the new row later
                rows[tid].update(_description(session, tid, record, plans, summaries))
    if not rows:
        return
    from sqlalchemy.dialects import postgresql, sqlite

    dialect = postgresql if session.get_bind().dialect.name == "postgresql" else sqlite
    # On the table, not the ORM entity: the ORM's bulk path costs more than the insert.
    statement = dialect.insert(TransferRow.__table__).on_conflict_do_nothing(index_elements=["id"])
    session.connection().execute(statement, [rows[tid] for tid in sorted(rows)])


def _engine_row(tid: str, record: wire.TransferRecord, now: datetime) -> dict[str, Any]:
    """The row an engine-path transfer gets from its first record (no plan yet)."""
    started = _unix(record.started_at)
    return {
        "id": tid,
        "pairing_id": None,
        "plan_id": None,
        "context_name": record.context,
        "generation_name": record.generation,
        "request_id": record.request_id,
        "context_dp_rank": record.context_dp_rank,
        "generation_dp_rank": record.generation_dp_rank,
        "status": "running",
        "execute": True,
        "blocks": {},
        "summary": {"routes": [], "bytes": 0, "fragments": 0},
        "bytes": 0,
        "fragments": 0,
        "idempotency_key": None,
        "request_hash": "",
        "created_at": started,
        "updated_at": now,
        "mode": record.mode,
        "verify": record.verify,
        "attempt": 1,
        "max_attempts": 1,
        "started_at": started,
        # The other ranks' records may arrive a batch (or an outage) later than this one.
        "deadline_at": max(
            started + timedelta(seconds=record.timeout_s or DEFAULT_TIMEOUT_S),
            now + timedelta(seconds=ENGINE_RECORD_GRACE_S),
        ),
    }


_RECORDER = (
    select(
        WorkerRow.id,
        WorkerRow.instance_id,
        WorkerRow.rank,
        WorkerRow.epoch,
        InstanceRow.name.label("instance_name"),
    )
    .join(InstanceRow, InstanceRow.id == WorkerRow.instance_id)
    .where(WorkerRow.id == bindparam("worker_id"))
)


def recording_worker(session: Session, worker_id: str) -> Any:
    """The worker posting records: its id, instance (id and ``instance_name``), rank and epoch.
    Records of a worker that was stopped, or whose instance re-registered since, are still the
    truth about what happened then: only an unknown worker is refused. (One plain read: the
    ORM row carries the worker's NIXL metadata, and a REST transfer's records come one per
    batch.)"""
    row = session.connection().execute(_RECORDER, {"worker_id": worker_id}).one_or_none()
    if row is None:
        raise NotFound(f"worker {worker_id!r} is not registered", code="worker_not_found")
    return row


def _description(
    session: Session,
    tid: str,
    record: wire.TransferRecord,
    plans: dict[tuple[Any, ...], tuple[PairingRow | None, PlanRow | None, Plan | None]],
    summaries: dict[tuple[Any, ...], dict[Any, dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """An engine-path transfer's pairing, plan, blocks and summary from a record, as column
    values (``plans``: the batch's pairings and plans, looked up and parsed once;
    ``summaries``: the batch's summaries per plan, kept per block count, see
    :func:`~geometry.expand.summarize`)."""
    key = (
        record.pairing_id,
        record.context_epoch,
        record.generation_epoch,
        record.context_dp_rank,
        record.generation_dp_rank,
    )
    if key not in plans:
        plans[key] = _plan_of(session, tid, record)
    pairing, plan_row, plan = plans[key]
    blocks = record.blocks or {}
    for group, lists in blocks.items():
        if set(lists) != {"context", "generation"}:  # a missing side would expand to nothing
            raise UnexpandableBlocks(
                f"engine transfer {tid}: layer group {group} needs a context and a generation "
                f"list, not {sorted(lists)}",
                code="invalid_blocks",
                errors=[
                    {"loc": ["body", "records", "blocks", group], "msg": "context, generation"}
                ],
                extra={"transfer_id": tid},
            )
    summary: dict[str, Any] = {"routes": [], "bytes": 0, "fragments": 0}
    if plan is not None:
        try:
            summary = summarize(
                plan,
                {int(g): (v["context"], v["generation"]) for g, v in blocks.items()},
                record.num_tokens,
                None if summaries is None else summaries.setdefault(key, {}),
            )
        except Exception as error:  # stored, it would settle the transfer with 0 bytes
            raise UnexpandableBlocks(
                f"engine transfer {tid}: its blocks do not fit the pairing's plan: {error}",
                code="invalid_blocks",
                errors=[{"loc": ["body", "records", "blocks"], "msg": str(error)[:500]}],
                extra={"transfer_id": tid},
            ) from None
    summary["num_tokens"] = record.num_tokens
    return {
        "pairing_id": None if pairing is None else pairing.id,
        "plan_id": None if plan_row is None else plan_row.id,
        "blocks": blocks,
        "summary": summary,
        "bytes": int(summary["bytes"]),
        "fragments": int(summary["fragments"]),
    }


def _set_columns(row: TransferRow, values: dict[str, Any]) -> None:
    for name, value in values.items():
        setattr(row, name, value)


def _plan_of(
    session: Session, tid: str, record: wire.TransferRecord
) -> tuple[PairingRow | None, PlanRow | None, Plan | None]:
    """The pairing and plan an engine-path record names (compiled if it is not cached yet)."""
    pairing = session.get(PairingRow, record.pairing_id)
    plan_row = (
        None
        if pairing is None
        else session.scalars(
            select(PlanRow).where(
                PlanRow.pairing_id == pairing.id,
                PlanRow.context_epoch == record.context_epoch,
                PlanRow.generation_epoch == record.generation_epoch,
                PlanRow.context_dp_rank
                == (NO_DP_RANK if record.context_dp_rank is None else record.context_dp_rank),
                PlanRow.generation_dp_rank
                == (NO_DP_RANK if record.generation_dp_rank is None else record.generation_dp_rank),
            )
        ).first()
    )
    if (
        plan_row is None
        and pairing is not None
        and (pairing.context_epoch, pairing.generation_epoch)
        == (record.context_epoch, record.generation_epoch)
    ):
        try:
            plan_id, _ = plan_for_pairing(
                session=session,
                pairing=pairing,
                context_dp_rank=record.context_dp_rank,
                generation_dp_rank=record.generation_dp_rank,
            )
            plan_row = session.get(PlanRow, plan_id)
        except (Conflict, KvplaneError) as error:
            log.warning("engine transfer %s: no plan: %s", tid, error)
    if plan_row is None:
        return pairing, None, None
    try:
        return pairing, plan_row, Plan.from_dict(plan_row.body)
    except Exception as error:  # a record is kept whatever its plan says
        log.warning("engine transfer %s: unreadable plan %s: %s", tid, plan_row.id, error)
        return pairing, plan_row, None


def _part_row(
    transfer: Any, worker: Any, record: wire.TransferRecord, now: datetime
) -> dict[str, Any]:
    """The ``jobs`` row of one recorded part, as INSERT parameters."""
    return {
        "id": uuid.uuid4().hex,
        "transfer_id": transfer.id,
        "kind": record.side,
        "instance_id": worker.instance_id,
        "rank": record.rank,
        "epoch": worker.epoch,
        "state": record.status,
        "attempt": transfer.attempt,
        "claims": 0,
        "worker_id": worker.id,
        "not_before": _unix(record.started_at),
        "staging_offset": 0,
        "staging_bytes": 0,
        "payload": {},
        "result": {
            "bytes": record.bytes,
            "duration_s": max(0.0, record.finished_at - record.started_at),
            "routes": [r.model_dump() for r in record.routes],
            "verified_bytes": record.verified_bytes,
        },
        "error": record.error,
        "created_at": _unix(record.started_at),
        "updated_at": now,
        "finished_at": _unix(record.finished_at),
    }


def settle(*, session: Session, transfer_id: str, attempt: int, now: datetime) -> bool:
    """Finish the transfer if its parts decide it; True when this call finished it."""
    transfer = session.get(TransferRow, transfer_id, with_for_update=True, populate_existing=True)
    if transfer is None or transfer.attempt != attempt:
        return False
    return bool(settle_many(session=session, transfers=[transfer], now=now))


def settle_many(*, session: Session, transfers: Sequence[Any], now: datetime) -> list[str]:
    """Finish every transfer (locked by the caller) whose parts decide it, reading all their
    parts at once; returns the ids this call finished. ``transfers``: ORM rows, or plain rows
    of at least the columns in ``_DECIDING``."""
    active = [t for t in transfers if t.status in ACTIVE]
    if not active:
        return []
    parts: dict[str, list[Any]] = {t.id: [] for t in active}
    attempts = {t.id: t.attempt for t in active}
    # Plain rows, not ORM objects: a batch of 256 records settles ~1,500 parts at once. Their
    # results (JSON) only matter for the checksums of verified transfers.
    statement = _PARTS_RESULTS if any(t.verify for t in active) else _PARTS
    for part in session.execute(statement, {"ids": list(parts)}):
        if part.attempt == attempts[part.transfer_id]:
            parts[part.transfer_id].append(part)
    finished, done = [], []
    for transfer in active:
        outcome = _outcome(transfer, parts[transfer.id], now)
        if outcome is None:
            continue
        if outcome[0] == "done" and len(active) > 1:
            done.append(transfer.id)
        elif finish(session, transfer, outcome[0], now, outcome[1]):
            finished.append(transfer.id)
    if done:  # one guarded UPDATE for all of them
        finished += session.scalars(_SETTLE_DONE, {"ids": done, "now": now}).all()
        for transfer in active:
            if transfer.id in done and isinstance(transfer, TransferRow):
                session.expire(transfer)
    return sorted(finished)


def _outcome(transfer: Any, parts: Sequence[Any], now: datetime) -> tuple[str, str | None] | None:
    """``(status, error)`` when the recorded parts decide the transfer, else None."""
    senders, receivers = participants(transfer.summary)
    if transfer.summary.get("routes"):  # a rank that moves no bytes decides nothing
        parts = [p for p in parts if p.rank in (senders if p.kind == "send" else receivers)]
    failed = [p for p in parts if p.state == "failed"]
    if failed:
        first = min(failed, key=lambda p: (p.finished_at or now, p.kind, p.rank))
        side = "context" if first.kind == "send" else "generation"
        return "failed", f"{side} rank {first.rank}: {first.error or 'failed'}"
    done = {(p.kind, p.rank) for p in parts if p.state == "done"}
    if not transfer.summary.get("routes"):  # an engine record without blocks: its own word
        senders, receivers = set(), {p.rank for p in parts if p.kind == "receive"}
        if not receivers:
            return None
    if not all(("receive", r) in done for r in receivers):
        return None
    if transfer.verify:
        # A route whose receiver compared both sums (its part carries the sender's) needs no
        # send record; the senders of the other routes' sums do.
        compared = _compared_routes(parts)
        routes = [r for r in transfer.summary.get("routes", []) if r.get("bytes", 0) > 0]
        needed = {
            int(r["sender_rank"])
            for r in routes
            if (int(r["sender_rank"]), int(r["receiver_rank"])) not in compared
        }
        if not routes:  # an engine record without blocks: every sender that recorded
            needed = set(senders)
        if not all(("send", r) in done for r in needed):
            return None
        mismatch = _checksum_mismatch(parts)
        if mismatch is not None:
            return "failed", f"checksum_mismatch: {mismatch}"
    return "done", None


def _compared_routes(parts: Sequence[Any]) -> set[tuple[int, int]]:
    """Routes whose receiving rank recorded the sender's crc32 beside its own (it compared
    them before it said arrived)."""
    return {
        (int(route["sender_rank"]), int(route["receiver_rank"]))
        for part in parts
        if part.kind == "receive" and part.state == "done"
        for route in (part.result or {}).get("routes", [])
        if route.get("sender_checksum") is not None
    }


def _checksum_mismatch(parts: Sequence[Any]) -> str | None:
    sent: dict[tuple[int, int], int | None] = {}
    received: dict[tuple[int, int], int | None] = {}
    for part in parts:
        target = sent if part.kind == "send" else received
        for route in (part.result or {}).get("routes", []):
            key = (route["sender_rank"], route["receiver_rank"])
            target[key] = route.get("checksum")
            if part.kind == "receive" and route.get("sender_checksum") is not None:
                sent.setdefault(key, route["sender_checksum"])
    for key, checksum in sent.items():
        if key in received and received[key] != checksum:
            return (
                f"route {key[0]}->{key[1]}: sender crc32 {checksum}, receiver crc32 {received[key]}"
            )
    return None


def finish(
    session: Session, transfer: Any, status: str, now: datetime, error: str | None = None
) -> bool:
    """One guarded UPDATE: exactly one caller finishes a transfer (an ORM row, refreshed, or a
    plain row with its id)."""
    changed = session.execute(
        update(TransferRow)
        .where(TransferRow.id == transfer.id, TransferRow.status.in_(ACTIVE))
        .values(
            status=status,
            error=None if error is None else error[:2000],
            finished_at=now,
            updated_at=now,
        )
        .returning(TransferRow.id)
        .execution_options(synchronize_session=False)
    ).scalar_one_or_none()
    if isinstance(transfer, TransferRow):
        session.refresh(transfer)
    if changed is not None and status == "failed":
        log.warning("transfer %s failed: %s", transfer.id, error)
    return changed is not None


# --- deadlines and instance changes ----------------------------------------------------------


def settled_among(*, session: Session, transfer_ids: Sequence[str]) -> list[str]:
    """Those of ``transfer_ids`` that are no longer active (one read)."""
    return list(
        session.scalars(
            select(TransferRow.id).where(
                TransferRow.id.in_(list(transfer_ids)), TransferRow.status.not_in(ACTIVE)
            )
        )
    )


def overdue_transfer_ids(*, session: Session, now: datetime, limit: int = REAP_BATCH) -> list[str]:
    """Dispatched transfers past their deadline (plus the record's grace), oldest first, at most
    ``limit`` (a request never takes on an unbounded amount of work)."""
    cutoff = now - timedelta(seconds=RECORD_GRACE_S)
    return list(
        session.scalars(
            select(TransferRow.id)
            .where(
                TransferRow.status.in_(ACTIVE),
                TransferRow.deadline_at.is_not(None),
                TransferRow.deadline_at < cutoff,
            )
            .order_by(TransferRow.deadline_at, TransferRow.id)
            .limit(limit)
        )
    )


def reap_overdue(*, session: Session, now: datetime, limit: int = REAP_BATCH) -> list[str]:
    """Fail at most ``limit`` dispatched transfers past their deadline (oldest first, in id order
    for the locks), naming the ranks that never reported; the next call takes the next ones."""
    reaped = []
    for transfer_id in sorted(overdue_transfer_ids(session=session, now=now, limit=limit)):
        transfer = session.get(
            TransferRow, transfer_id, with_for_update=True, populate_existing=True
        )
        if transfer is None or transfer.status not in ACTIVE:
            continue
        reported = {
            (kind, rank)
            for kind, rank in session.execute(
                select(JobRow.kind, JobRow.rank).where(
                    JobRow.transfer_id == transfer.id, JobRow.attempt == transfer.attempt
                )
            )
        }
        senders, receivers = participants(transfer.summary)
        silent = [
            ("context", transfer.context_name, r)
            for r in sorted(senders)
            if ("send", r) not in reported
        ]
        silent += [
            ("generation", transfer.generation_name, r)
            for r in sorted(receivers)
            if ("receive", r) not in reported
        ]
        if finish(session, transfer, "failed", now, _silence(session, silent, now)):
            reaped.append(transfer.id)
    return reaped


def _silence(session: Session, silent: Sequence[tuple[str, str, int]], now: datetime) -> str:
    """Why a transfer is reaped: the silent ranks whose workers still heartbeat (they ran out
    of time, e.g. a peer unreachable across a network cut) apart from those whose worker is
    gone (or never was)."""
    if not silent:
        return (
            "deadline: no report within the transfer's deadline (the control plane "
            "restarted, or its records were lost)"
        )
    try:
        _, live = live_worker_ids(session, sorted({name for _, name, _ in silent}), now)
    except NotFound:
        live = {}
    alive = [f"{side} rank {r}" for side, name, r in silent if r in live.get(name, {})]
    gone = [f"{side} rank {r}" for side, name, r in silent if r not in live.get(name, {})]
    reasons = []
    if alive:
        reasons.append(
            f"no report from {', '.join(alive)} within the transfer's deadline (workers alive)"
        )
    if gone:
        reasons.append(
            f"no report from {', '.join(gone)}: worker gone (or the control plane restarted)"
        )
    return "deadline: " + "; ".join(reasons)


def fail_transfers(
    *, session: Session, transfer_ids: Sequence[str], now: datetime, reason: str
) -> list[str]:
    """Fail these transfers if they are still active (in id order); the ids it failed."""
    failed = []
    for transfer_id in sorted(transfer_ids):
        transfer = session.get(
            TransferRow, transfer_id, with_for_update=True, populate_existing=True
        )
        if transfer is not None and finish(session, transfer, "failed", now, reason):
            failed.append(transfer_id)
    return failed


def fail_transfers_of_instance(
    *, session: Session, instance_id: int, now: datetime, reason: str
) -> int:
    """An instance re-registered or left: fail every running transfer that involves it."""
    instance = session.get(InstanceRow, instance_id)
    if instance is None:
        return 0
    transfers = list(
        session.scalars(
            select(TransferRow)
            .where(
                TransferRow.status.in_(ACTIVE),
                or_(
                    TransferRow.context_name == instance.name,
                    TransferRow.generation_name == instance.name,
                ),
            )
            .order_by(TransferRow.id)
            .with_for_update()
            .execution_options(populate_existing=True)
        )
    )
    for transfer in transfers:
        finish(session, transfer, "failed", now, reason)
    return len(transfers)


# --- reads -----------------------------------------------------------------------------------


def list_parts(
    *,
    session: Session,
    transfer_id: str | None = None,
    state: str | None = None,
    limit: int = 200,
    offset: int = 0,
) -> list[JobRow]:
    query = select(JobRow).order_by(JobRow.created_at.desc(), JobRow.kind, JobRow.rank)
    if transfer_id is not None:
        query = query.where(JobRow.transfer_id == transfer_id)
    if state is not None:
        query = query.where(JobRow.state == state)
    return list(session.scalars(query.limit(limit).offset(offset)))


def count_parts_by_state(*, session: Session) -> dict[str, int]:
    rows = session.execute(select(JobRow.state, func.count()).group_by(JobRow.state))
    return {state: int(count) for state, count in rows}


def part_read(session: Session, row: JobRow) -> wire.PartRead:
    instance = session.get(InstanceRow, row.instance_id)
    return wire.PartRead(
        id=row.id,
        transfer_id=row.transfer_id,
        kind=row.kind,  # type: ignore[arg-type]
        instance=instance.name if instance else "?",
        rank=row.rank,
        state=row.state,  # type: ignore[arg-type]
        attempt=row.attempt,
        worker_id=row.worker_id,
        result=row.result,
        error=row.error,
        created_at=row.created_at,
        finished_at=row.finished_at,
    )
