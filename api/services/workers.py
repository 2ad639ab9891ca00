"""Workers: attach, heartbeat, stop, and the directory each worker caches for the hot path.

A worker attaches to one rank with its pools' addresses and its NIXL endpoint; the control plane
keeps it in the worker directory. Its *directory* (:func:`worker_directory`) holds what its hot
path needs: for every compatible, current pairing that involves its instance, the plan of every
DP-rank combination (only the routes that involve its rank), and the live workers of the peer
instance with their endpoints. Its :func:`directory_revision` is a digest of what the directory
depends on (epochs, pairings, peer workers); the heartbeat answer carries it, so a worker refetches
its directory within one heartbeat interval of a re-registration, a new pairing or a restarted
peer. A worker whose instance re-registered is ``stale`` (409 ``worker_stale``) and attaches again.
"""

from __future__ import annotations

import hashlib
import re
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import bindparam, delete, or_, select, update
from sqlalchemy.orm import Session, load_only

from api import schemas_exec as wire
from api.errors import BadRequest, Conflict, NotFound
from api.models import InstanceRow, PairingRow, WorkerRow
from api.services.instances import load_geometry
from api.services.pairings import bump_peer_directories, cached_plan, plan_for_pairing
from geometry.plan import dp_choices

HEARTBEAT_INTERVAL_S = 1.0
WORKER_GONE_S = 10.0

Clock = Callable[[], datetime]


def instance_by_name(session: Session, name: str) -> InstanceRow:
    row = session.scalars(select(InstanceRow).where(InstanceRow.name == name)).one_or_none()
    if row is None:
        raise NotFound(f"instance {name!r} is not registered", code="instance_not_found")
    return row


WORKER_GC_S = 3600.0  # a worker row silent this long (stopped, superseded, stale, gone) goes


def register_worker(
    *, session: Session, body: wire.WorkerCreate, now: datetime, superseded: list[str] | None = None
) -> WorkerRow:
    """Attach a worker to a rank; its pools must be exactly the rank's registered pools.
    The ids of the workers it superseded are appended to ``superseded``.

    A rank has one worker: one that attaches to an occupied rank supersedes the worker there
    (a restarted process, or a second one started by mistake), which is told (409
    ``worker_superseded`` on its heartbeat, a last line on its command stream) and stops. An
    agent name taken by a live worker of another rank is refused (409 ``agent_name_taken``):
    peers load NIXL metadata by agent name. Rows silent for :data:`WORKER_GC_S` are deleted.
    """
    instance = instance_by_name(session, body.instance)
    if body.rank >= instance.world_size:
        raise BadRequest(
            f"rank {body.rank} is outside {instance.name}'s world size {instance.world_size}",
            code="rank_out_of_range",
            errors=[{"loc": ["body", "rank"], "msg": "rank out of range"}],
        )
    rank_row = next((r for r in instance.ranks if r.rank == body.rank), None)
    if rank_row is None:
        raise Conflict(
            f"{instance.name} rank {body.rank} has not reported its page table yet",
            code="rank_not_reported",
        )
    _check_pools(rank_row.body.get("pools", []), body.peer.pools)
    cutoff = now - timedelta(seconds=WORKER_GONE_S)
    taken = session.execute(
        select(WorkerRow.id, WorkerRow.instance_id, WorkerRow.rank).where(
            WorkerRow.agent == body.peer.agent, *_live(cutoff)
        )
    ).first()
    if taken is not None and (taken.instance_id, taken.rank) != (instance.id, body.rank):
        raise Conflict(
            f"agent name {body.peer.agent!r} belongs to live worker {taken.id} of another rank; "
            "NIXL peers tell agents apart by name",
            code="agent_name_taken",
        )
    row_id = uuid.uuid4().hex
    replaced = list(
        session.scalars(
            update(WorkerRow)
            .where(
                WorkerRow.instance_id == instance.id,
                WorkerRow.rank == body.rank,
                WorkerRow.stopped.is_(False),
            )
            .values(stopped=True, superseded_by=row_id)
            .returning(WorkerRow.id)
            .execution_options(synchronize_session=False)
        )
    )
    session.execute(
        delete(WorkerRow).where(WorkerRow.heartbeat_at < now - timedelta(seconds=WORKER_GC_S))
    )
    row = WorkerRow(
        id=row_id,
        instance_id=instance.id,
        rank=body.rank,
        epoch=instance.epoch,
        device=body.device,
        transport=body.transport,
        agent=body.peer.agent,
        peer=body.peer.model_dump(mode="json"),
        host=body.host,
        pid=body.pid,
        stopped=False,
        registered_at=now,
        heartbeat_at=now,
    )
    session.add(row)
    session.flush()
    bump_peer_directories(session, instance.id)
    if superseded is not None:
        superseded.extend(replaced)
    return row


def _check_pools(registered: Sequence[dict[str, Any]], attached: Sequence[wire.PeerPool]) -> None:
    """The worker's pools must be the registered ones: same ids and byte geometry."""
    want = {
        int(p["id"]): (
            int(p.get("layer_group", 0)),
            int(p["slot_bytes"]),
            int(p.get("slot_stride_bytes") or p["slot_bytes"]),
            int(p["num_slots"]),
        )
        for p in registered
    }
    have = {p.id: (p.layer_group, p.slot_bytes, p.slot_stride_bytes, p.num_slots) for p in attached}
    if want != have:
        raise Conflict(
            "the worker's pools differ from the rank's registered pools "
            f"(registered {want}, attached {have})",
            code="pool_mismatch",
        )


def get_worker(*, session: Session, worker_id: str) -> WorkerRow:
    row = session.get(WorkerRow, worker_id)
    if row is None:
        raise NotFound(f"worker {worker_id!r} is not registered", code="worker_not_found")
    return row


def current_worker(*, session: Session, worker_id: str) -> WorkerRow:
    """A worker that may act: not stopped, attached to its instance's current epoch."""
    row = get_worker(session=session, worker_id=worker_id)
    if row.superseded_by is not None:
        raise Conflict(
            f"worker {row.superseded_by} attached to {row.instance.name} rank {row.rank} after "
            "this one and took the rank over: stop (do not attach again)",
            code="worker_superseded",
        )
    if row.stopped:
        raise Conflict("this worker was stopped; attach again", code="worker_retired")
    if row.epoch != row.instance.epoch:
        raise Conflict(
            f"{row.instance.name} re-registered since this worker attached; attach again",
            code="worker_stale",
        )
    return row


def live_heartbeat(*, session: Session, worker_id: str, now: datetime) -> Any | None:
    """The common heartbeat, as one small UPDATE: a worker that is current (not stopped nor
    superseded, attached to its instance's epoch) and was heard from within
    ``WORKER_GONE_S`` gets its ``heartbeat_at`` moved to ``now``. Returns its listed columns
    (see ``_LISTED``) and its instance's directory counter; None when the update matched
    nothing (:func:`heartbeat` then says why, or brings a "gone" worker back)."""
    current_epoch = (
        select(InstanceRow.epoch).where(InstanceRow.id == WorkerRow.instance_id).scalar_subquery()
    )
    updated = session.execute(
        update(WorkerRow)
        .where(
            WorkerRow.id == worker_id,
            WorkerRow.superseded_by.is_(None),
            WorkerRow.epoch == current_epoch,
            *_live(now - timedelta(seconds=WORKER_GONE_S)),
        )
        .values(heartbeat_at=now)
        .execution_options(synchronize_session=False)
    )
    if getattr(updated, "rowcount", 0) != 1:
        return None
    return session.execute(
        select(*_LISTED, InstanceRow.directory_revision)
        .join(InstanceRow, InstanceRow.id == WorkerRow.instance_id)
        .where(WorkerRow.id == worker_id)
    ).one()


def heartbeat(
    *, session: Session, worker_id: str, now: datetime, ucx_in_use: wire.UcxInUse | None = None
) -> WorkerRow:
    """Record a heartbeat and what UCX uses, when the worker says (409 when it must attach
    again)."""
    row = current_worker(session=session, worker_id=worker_id)
    if (now - row.heartbeat_at).total_seconds() > WORKER_GONE_S:
        # Back from "gone": it reappears in its peers' directories.
        bump_peer_directories(session, row.instance_id)
    row.heartbeat_at = now
    if ucx_in_use is not None:
        report = ucx_in_use.model_dump(mode="json")
        if row.ucx_in_use != report:
            row.ucx_in_use = report
    return row


def stop_worker(*, session: Session, worker_id: str) -> None:
    """A worker shutting down cleanly; it leaves its peers' directories."""
    row = get_worker(session=session, worker_id=worker_id)
    if not row.stopped:
        row.stopped = True
        bump_peer_directories(session, row.instance_id)


def worker_status(row: Any, instance_epoch: str, now: datetime) -> str:
    if row.stopped:
        return "stopped"
    if row.epoch != instance_epoch:
        return "stale"
    if (now - row.heartbeat_at).total_seconds() > WORKER_GONE_S:
        return "gone"
    return "alive"


# UCX transports on no network device, which UCX_NET_DEVICES does not restrict: the loopback to
# itself, shared memory between processes of one kernel (ucx_in_use flags those on its own) and
# an accelerator's copies.
_NOT_NETWORK = re.compile(r"(self|posix|sysv|cma|knem|xpmem|cuda_\w+|gdr_copy|rocm_\w+|ze_\w+)")


def ucx_outside_pinned(ucx: wire.UcxSettings | None, in_use: wire.UcxInUse | None) -> list[str]:
    """The network transports in use (``tcp/eth0``) whose device is not among the devices the
    worker pinned (``ucx.net_devices``, UCX_NET_DEVICES: exact names, ``all``); empty when it
    pinned none or nothing is known yet. UCX itself never strays: a transport listed here means
    the pin did not reach UCX (NIXL's own device parameter, for one, is not honoured for TCP)."""
    if ucx is None or in_use is None or ucx.net_devices == "default":
        return []
    pinned = {name.strip() for name in ucx.net_devices.split(",")}
    if "all" in pinned:
        return []
    outside = []
    for tl in in_use.transports:
        transport, _, device = tl.partition("/")
        if _NOT_NETWORK.fullmatch(transport) or device.startswith("memory"):
            continue
        if device not in pinned:
            outside.append(tl)
    return outside


# What a listing shows of a worker: every column but its endpoint (``peer`` holds the NIXL
# metadata, up to the metadata cap per worker), of which only the UCX settings are read, in SQL.
_LISTED = (
    WorkerRow.id,
    WorkerRow.rank,
    WorkerRow.epoch,
    WorkerRow.device,
    WorkerRow.transport,
    WorkerRow.agent,
    WorkerRow.host,
    WorkerRow.pid,
    WorkerRow.stopped,
    WorkerRow.registered_at,
    WorkerRow.heartbeat_at,
    WorkerRow.ucx_in_use,
    InstanceRow.name.label("instance_name"),
    InstanceRow.epoch.label("instance_epoch"),
    WorkerRow.peer["ucx"].label("ucx"),
)


def list_workers(
    *, session: Session, instance: str | None = None, limit: int = 500, offset: int = 0
) -> list[Any]:
    """One page of workers as plain rows of the listed columns (see ``_LISTED``)."""
    query = (
        select(*_LISTED)
        .join(InstanceRow, InstanceRow.id == WorkerRow.instance_id)
        .order_by(InstanceRow.name, WorkerRow.rank, WorkerRow.registered_at.desc())
    )
    if instance is not None:
        query = query.where(InstanceRow.name == instance)
    return list(session.execute(query.limit(limit).offset(offset)))


def worker_read(
    row: Any, now: datetime, *, connected: bool = False, revision: str | None = None
) -> wire.WorkerRead:
    """The wire view of a worker: an ORM row, or a plain row of :func:`list_workers`."""
    if isinstance(row, WorkerRow):
        name, instance_epoch = row.instance.name, row.instance.epoch
        ucx = (row.peer or {}).get("ucx")
    else:
        name, instance_epoch, ucx = row.instance_name, row.instance_epoch, row.ucx
    return wire.WorkerRead(
        id=row.id,
        instance=name,
        rank=row.rank,
        epoch=row.epoch,
        device=row.device,
        transport=row.transport,
        agent=row.agent,
        host=row.host,
        pid=row.pid,
        status=worker_status(row, instance_epoch, now),  # type: ignore[arg-type]
        registered_at=row.registered_at,
        heartbeat_at=row.heartbeat_at,
        heartbeat_age_s=max(0.0, (now - row.heartbeat_at).total_seconds()),
        connected=connected,
        directory_revision=revision,
        ucx=ucx,
        ucx_in_use=None if row.ucx_in_use is None else wire.UcxInUse.model_validate(row.ucx_in_use),
    )


def _live(cutoff: Any) -> tuple[Any, ...]:
    """What makes a worker live, besides its instance's current epoch: not stopped, and a
    heartbeat since ``cutoff`` (a datetime, or a bound parameter of a prepared statement)."""
    return (WorkerRow.stopped.is_(False), WorkerRow.heartbeat_at >= cutoff)


def live_workers(
    session: Session, instance: InstanceRow, now: datetime, *, ids_only: bool = False
) -> dict[int, WorkerRow]:
    """The newest live worker of each rank of ``instance`` (current epoch, heartbeating).

    ``ids_only``: load only each row's id, rank and registration time, not its endpoint (the
    NIXL metadata, kilobytes of JSON per worker): the directory's revision and a stream's owed
    commands need no more."""
    cutoff = now - timedelta(seconds=WORKER_GONE_S)
    query = select(WorkerRow)
    if ids_only:
        query = query.options(load_only(WorkerRow.id, WorkerRow.rank, WorkerRow.registered_at))
    rows = session.scalars(
        query.where(
            WorkerRow.instance_id == instance.id, WorkerRow.epoch == instance.epoch, *_live(cutoff)
        ).order_by(WorkerRow.rank, WorkerRow.registered_at.desc())
    )
    found: dict[int, WorkerRow] = {}
    for row in rows:
        found.setdefault(row.rank, row)
    return found


# Built once: composing these statements cost more than running them.
_EPOCHS = select(InstanceRow.name, InstanceRow.epoch).where(
    InstanceRow.name.in_(bindparam("names", expanding=True))
)
_LIVE_IDS = (
    select(InstanceRow.name, WorkerRow.rank, WorkerRow.id)
    .join(InstanceRow, InstanceRow.id == WorkerRow.instance_id)
    .where(
        InstanceRow.name.in_(bindparam("names", expanding=True)),
        WorkerRow.epoch == InstanceRow.epoch,
        *_live(bindparam("cutoff")),
    )
    .order_by(WorkerRow.rank, WorkerRow.registered_at.desc())
)


def live_worker_ids(
    session: Session, names: Sequence[str], now: datetime
) -> tuple[dict[str, str], dict[str, dict[int, str]]]:
    """``({name: epoch}, {name: {rank: worker id}})`` of these instances: the id of each rank's
    newest live worker (as :func:`live_workers`), in two plain reads. Every REST transfer
    dispatches: the four ORM queries this replaced were a tenth of its control-plane CPU.
    Raises ``404 instance_not_found``."""
    unique = sorted(set(names))
    conn = session.connection()
    epochs = {name: epoch for name, epoch in conn.execute(_EPOCHS, {"names": unique})}
    for name in names:
        if name not in epochs:
            raise NotFound(f"instance {name!r} is not registered", code="instance_not_found")
    ranks: dict[str, dict[int, str]] = {name: {} for name in names}
    cutoff = now - timedelta(seconds=WORKER_GONE_S)
    for name, rank, worker_id in conn.execute(_LIVE_IDS, {"names": unique, "cutoff": cutoff}):
        ranks[name].setdefault(rank, worker_id)
    return epochs, ranks


# --- the directory ---------------------------------------------------------------------------


def _pairings_of(session: Session, instance: InstanceRow) -> list[PairingRow]:
    """Compatible pairings of ``instance`` whose epochs are both current."""
    rows = session.scalars(
        select(PairingRow)
        .where(
            or_(PairingRow.context_id == instance.id, PairingRow.generation_id == instance.id),
            PairingRow.status == "compatible",
        )
        .order_by(PairingRow.id)
    )
    return [
        row
        for row in rows
        if row.context.epoch == row.context_epoch and row.generation.epoch == row.generation_epoch
    ]


def _peer_instance(row: PairingRow, instance: InstanceRow) -> InstanceRow:
    return row.generation if row.context_id == instance.id else row.context


def _paired_instances(session: Session, instance: InstanceRow) -> list[InstanceRow]:
    """Every instance paired with ``instance``, whatever the pairing's status: a peer that
    re-registered (its pairing now stale) must still reach the directory with its new epoch, so
    that in-flight handles planned with the old one fail at once."""
    rows = session.scalars(
        select(PairingRow).where(
            or_(PairingRow.context_id == instance.id, PairingRow.generation_id == instance.id)
        )
    )
    return sorted(
        {_peer_instance(row, instance).id: _peer_instance(row, instance) for row in rows}.values(),
        key=lambda row: row.name,
    )


def revision_of(epoch: str, counter: int, rank: int) -> str:
    """The directory revision of a worker of ``rank`` on an instance at ``epoch`` whose kept
    counter is ``counter`` (see ``InstanceRow.directory_revision``): no digest over pairings."""
    return hashlib.sha256(f"{epoch}|{counter}|{rank}".encode()).hexdigest()[:24]


def directory_revision(*, session: Session, worker: WorkerRow, now: datetime) -> str:
    """The revision of ``worker``'s directory: one read of its instance's kept counter, bumped
    by every change the directory depends on (``services/pairings.py``, bump_directories):
    epochs, pairings, peer workers attaching, stopping, coming back or going silent."""
    instance = worker.instance  # loaded with the worker (current_worker reads its epoch)
    return revision_of(instance.epoch, instance.directory_revision, worker.rank)


def fell_silent(*, session: Session, since: datetime, now: datetime) -> list[int]:
    """Instances with a worker whose last heartbeat turned "gone" between ``since`` and
    ``now`` (it left its peers' directories; nothing wrote to say so)."""
    gone = timedelta(seconds=WORKER_GONE_S)
    return list(
        session.execute(
            select(WorkerRow.instance_id)
            .distinct()
            .where(
                WorkerRow.stopped.is_(False),
                WorkerRow.heartbeat_at >= since - gone,
                WorkerRow.heartbeat_at < now - gone,
            )
        ).scalars()
    )


def bump_gone(*, session: Session, instance_ids: Sequence[int]) -> None:
    """Bump the directories of the peers of these instances (see :func:`fell_silent`)."""
    for instance_id in sorted(set(instance_ids)):
        bump_peer_directories(session, instance_id)


DIRECTORY_CACHE_SIZE = 256  # built directories kept per process, by worker and revision
_directories: OrderedDict[tuple[str, str], tuple[wire.WorkerDirectory, bytes]] = OrderedDict()
_directories_lock = threading.Lock()


class PlanNotCached(Exception):
    """A directory needs a plan that is not compiled and stored yet (a write)."""


def worker_directory(
    *, session: Session, worker_id: str, now: datetime, read_only: bool = False
) -> wire.WorkerDirectory:
    """The worker's directory (see :func:`worker_directory_json`)."""
    return _directory(session, worker_id, now, read_only)[0]


def worker_directory_json(
    *, session: Session, worker_id: str, now: datetime, read_only: bool = False
) -> bytes:
    """The worker's directory as the JSON the route answers (encoded once per revision)."""
    return _directory(session, worker_id, now, read_only)[1]


def _directory(
    session: Session, worker_id: str, now: datetime, read_only: bool
) -> tuple[wire.WorkerDirectory, bytes]:
    """The worker's directory: its pairings' plans (its routes only) and its peers.

    Built once per revision (the kept counter changes with everything it shows) and kept in
    this process, so a poll of an unchanged directory costs a worker read and a counter read,
    whatever the number of pairings. ``read_only``: raise :class:`PlanNotCached` rather than
    compile and store a missing plan (the caller retries in a write transaction)."""
    worker = current_worker(session=session, worker_id=worker_id)
    revision = directory_revision(session=session, worker=worker, now=now)
    key = (worker.id, revision)
    with _directories_lock:
        hit = _directories.get(key)
        if hit is not None:
            _directories.move_to_end(key)
            return hit
    directory = _build_directory(session, worker, revision, now, read_only)
    built = (directory, directory.model_dump_json().encode())
    with _directories_lock:
        _directories[key] = built
        while len(_directories) > DIRECTORY_CACHE_SIZE:
            _directories.popitem(last=False)
    return built


def _build_directory(
    session: Session, worker: WorkerRow, revision: str, now: datetime, read_only: bool
) -> wire.WorkerDirectory:
    instance = worker.instance
    role = instance.role
    pairings: list[wire.DirectoryPairing] = []
    peers: dict[str, wire.DirectoryPeer] = {}
    for pairing in _pairings_of(session, instance):
        peer = _peer_instance(pairing, instance)
        plans = []
        for cdp in dp_choices(load_geometry(pairing.context)):
            for gdp in dp_choices(load_geometry(pairing.generation)):
                hit = cached_plan(
                    pairing.id, pairing.context_epoch, pairing.generation_epoch, cdp, gdp
                )
                if hit is None and read_only:
                    raise PlanNotCached(pairing.id)
                _, plan = hit or plan_for_pairing(
                    session=session, pairing=pairing, context_dp_rank=cdp, generation_dp_rank=gdp
                )
                side = "sender_rank" if role == "context" else "receiver_rank"
                routes = [
                    {k: v for k, v in route.to_dict().items() if k != "slices"}
                    for route in plan.routes
                    if getattr(route, side) == worker.rank
                ]
                plans.append(
                    wire.DirectoryPlan(
                        context_dp_rank=cdp,
                        generation_dp_rank=gdp,
                        senders=sorted({r.sender_rank for r in plan.routes}),
                        receivers=sorted({r.receiver_rank for r in plan.routes}),
                        routes=routes,
                    )
                )
        pairings.append(
            wire.DirectoryPairing(
                id=pairing.id,
                context=pairing.context.name,
                generation=pairing.generation.name,
                context_epoch=pairing.context_epoch,
                generation_epoch=pairing.generation_epoch,
                plans=plans,
            )
        )
        peers[peer.name] = wire.DirectoryPeer(
            epoch=peer.epoch,
            ranks={
                str(rank): wire.DirectoryWorker(worker_id=row.id, peer=row.peer)
                for rank, row in sorted(live_workers(session, peer, now).items())
            },
        )
    for peer in _paired_instances(session, instance):
        peers.setdefault(peer.name, wire.DirectoryPeer(epoch=peer.epoch, ranks={}))
    return wire.WorkerDirectory(
        revision=revision,
        instance=instance.name,
        role=role,
        rank=worker.rank,
        epoch=instance.epoch,
        pairings=pairings,
        peers=peers,
    )
