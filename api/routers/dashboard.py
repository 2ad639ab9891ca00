"""The operator dashboard: server-rendered pages at ``/`` and ``/ui/...`` (not in the OpenAPI).

Pages read through the same services and database sessions as the REST API. Actions are POST
forms behind a confirmation page (no JavaScript needed); htmx only refreshes the overview.
A POST must carry ``confirm=yes``, come from this dashboard's own origin and carry its CSRF
token (:mod:`api.csrf`, checked before the session and anything else), so neither a cross-site
form, a sandboxed frame nor a redirect can deregister an instance.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from functools import partial
from typing import Annotated, Any
from urllib.parse import urlencode

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles

from api import csrf
from api.db import utcnow
from api.errors import KvplaneError, NotFound
from api.routers.deps import DbDep
from api.routers.transfers import push_commands
from api.schemas import NAME_PATTERN
from api.services import dashboard as queries
from api.services import execution as execution_service
from api.services import handovers as handover_service
from api.services import instances as instance_service
from api.services import pairings as pairing_service
from api.services import registration
from api.services import transfers as transfer_service
from api.services import workers as worker_service
from geometry import GeometryError, Instance, active_ranks, view_geometry
from web import charts, diagrams
from web.format import rate
from web.pages import STATIC_DIR, STATIC_URL, templates

PAGE_SIZE = 50
MATRIX_ROWS = 20
MATRIX_COLUMNS = 12

router = APIRouter(include_in_schema=False)

NOTICES = {
    "revalidated": "Pairing re-validated.",
    "deregistered": "Instance deregistered; its pairings and cached plans were deleted.",
    "retried": "Transfer re-queued.",
}
TRANSFER_STATUSES = ("planned", "queued", "running", "done", "failed")
PAIRING_STATUSES = ("compatible", "incompatible", "stale")

Page = Annotated[int, Query(ge=1, le=1 << 20)]
InstanceFilter = Annotated[str | None, Query(pattern=NAME_PATTERN)]
DpRank = Annotated[int | None, Query(ge=0, lt=4096)]


def install(app: FastAPI, dependencies: Sequence[Any] = ()) -> None:
    """Serve the dashboard pages (behind the CSRF check, then ``dependencies``) and their
    static files from ``app``."""
    app.include_router(router, dependencies=[Depends(csrf.protect), *dependencies])
    app.mount(STATIC_URL, StaticFiles(directory=str(STATIC_DIR)), name="dashboard-static")


def _render(request: Request, name: str, status_code: int = 200, **context: Any) -> HTMLResponse:
    notice = NOTICES.get(request.query_params.get("notice", ""))
    response = templates.TemplateResponse(
        request,
        name,
        {"notice": notice, "query": partial(_query, request), **csrf.context(request), **context},
        status_code=status_code,
    )
    return csrf.attach(request, response)


def _not_found(request: Request, error: KvplaneError) -> HTMLResponse:
    return _render(request, "not_found.html", status_code=404, message=error.detail)


def _pages(total: int, page: int, size: int = PAGE_SIZE) -> dict[str, int]:
    pages = max(1, -(-total // size))
    return {"page": page, "pages": pages, "total": total, "size": size}


def _query(request: Request, **changes: Any) -> str:
    """The current query string with ``changes`` applied (``None`` removes a key)."""
    params = dict(request.query_params)
    params.pop("notice", None)
    for key, change in changes.items():
        if change is None:
            params.pop(key, None)
        else:
            params[key] = str(change)
    return "?" + urlencode(params) if params else "?"


async def form_fields(request: Request) -> dict[str, str]:
    """The urlencoded form body, once :func:`api.csrf.protect` has passed it."""
    return await csrf.protect(request)


FormDep = Annotated[dict[str, str], Depends(form_fields)]


def _confirmed(form: dict[str, str]) -> bool:
    return form.get("confirm") == "yes"


def _now(request: Request) -> datetime:
    clock = getattr(request.app.state, "clock", None)
    return clock() if callable(clock) else utcnow()


# ---------------------------------------------------------------------------------------------
# overview


def transfer_charts(series: queries.TransferSeries) -> list[charts.Chart]:
    """The four charts of the last hour (overview and transfers pages)."""
    start, step_s = series.start, series.step_s
    return [
        charts.line_chart(
            "chart-rate",
            "Transfers per second",
            series={"planned": series.planned_per_s, "done": series.done_per_s},
            fmt=charts.per_second,
            start=start,
            step_s=step_s,
        ),
        charts.line_chart(
            "chart-bytes",
            "Bytes per second (done)",
            series={"moved": series.bytes_per_s},
            fmt=charts.bytes_per_second,
            binary=True,
            start=start,
            step_s=step_s,
        ),
        charts.line_chart(
            "chart-latency",
            "Handover latency (created → done)",
            series={"p50": series.p50_s, "p99": series.p99_s},
            fmt=charts.seconds,
            start=start,
            step_s=step_s,
        ),
        charts.bar_chart(
            "chart-failures",
            "Failures by reason",
            series=series.failures,
            start=start,
            step_s=step_s,
        ),
    ]


def _charts(session: Any, request: Request) -> dict[str, Any]:
    series = queries.transfer_series(session=session, now=_now(request))
    return {"charts": transfer_charts(series), "series": series}


@router.get("/", response_class=HTMLResponse)
def overview(request: Request, db: DbDep) -> HTMLResponse:
    """Counts and health of the fleet, refreshed live; transfer charts of the last hour."""
    with db.read() as session:
        stats = queries.overview(session=session, now=_now(request))
        shown = _charts(session, request)
    return _render(request, "overview.html", stats=stats, nav="overview", **shown)


@router.get("/ui/overview", response_class=HTMLResponse, response_model=None)
def overview_fragment(request: Request, db: DbDep) -> Response:
    """The overview's counters alone (polled by htmx); a browser asking for it gets ``/``."""
    if request.headers.get("hx-request") != "true":
        return RedirectResponse("/", status_code=303)
    with db.read() as session:
        stats = queries.overview(session=session, now=_now(request))
    return _render(request, "_overview_stats.html", stats=stats)


# ---------------------------------------------------------------------------------------------
# instances


@router.get("/ui/instances", response_class=HTMLResponse)
def instance_list(
    request: Request,
    db: DbDep,
    role: Annotated[str | None, Query(pattern="^(context|generation)$")] = None,
    status: Annotated[str | None, Query(pattern="^(ready|incomplete)$")] = None,
    page: Page = 1,
) -> HTMLResponse:
    """Every registered instance, by name."""
    with db.read() as session:
        rows, total = instance_service.list_instances(
            session=session,
            role=role,
            status=status,
            limit=PAGE_SIZE,
            offset=(page - 1) * PAGE_SIZE,
        )
        items = [instance_service.instance_summary(row) for row in rows]
    return _render(
        request,
        "instances.html",
        nav="instances",
        items=items,
        role=role,
        status=status,
        pager=_pages(total, page),
    )


def _geometry_rows(instance: Instance) -> list[dict[str, Any]]:
    """One entry per reported rank: its pools and every view with its computed head geometry."""
    result = []
    for table in instance.ranks:
        if table is None:
            continue
        views = []
        for view in table.views:
            entry: dict[str, Any] = {"view": view, "layers": view.layers}
            try:
                entry["geometry"] = view_geometry(instance, table, view)
            except GeometryError as error:
                entry["error"] = str(error)
            if view.num_kv_heads is None and view.layout not in ("REPLICATED", "SECTIONED"):
                entry["legacy"] = True
            views.append(entry)
        pp_rank, tp_rank, cp_rank = instance.coords(table.rank)
        result.append(
            {
                "rank": table.rank,
                "coords": {"pp": pp_rank, "tp": tp_rank, "cp": cp_rank},
                "pools": [table.pools[key] for key in sorted(table.pools)],
                "views": views,
                "has_agent": table.agent_metadata is not None,
            }
        )
    return result


@router.get("/ui/instances/{name}", response_class=HTMLResponse)
def instance_detail(request: Request, name: str, db: DbDep) -> HTMLResponse:
    """One instance: parallelism, its handovers of the last hour, its pairings and every
    rank's page table."""
    with db.read() as session:
        try:
            row = instance_service.get_instance(session=session, name=name)
        except NotFound as error:
            return _not_found(request, error)
        summary = instance_service.instance_summary(row)
        geometry = instance_service.load_geometry(row)
        pairings = queries.pairings_of_instance(session=session, instance_id=row.id)
        handovers = handover_service.instance_handovers(
            session=session, instance=row, now=_now(request)
        )
    return _render(
        request,
        "instance.html",
        nav="instances",
        instance=summary,
        ranks=_geometry_rows(geometry),
        pairings=pairings,
        handovers=handovers,
    )


@router.get("/ui/instances/{name}/deregister", response_class=HTMLResponse)
def instance_deregister_confirm(request: Request, name: str, db: DbDep) -> HTMLResponse:
    """Ask before deleting an instance."""
    with db.read() as session:
        try:
            row = instance_service.get_instance(session=session, name=name)
        except NotFound as error:
            return _not_found(request, error)
        pairings = queries.pairings_of_instance(session=session, instance_id=row.id)
    return _render(
        request,
        "confirm.html",
        nav="instances",
        title=f"Deregister {name}?",
        consequences=[
            f"{len(pairings)} pairing(s) and their cached plans will be deleted.",
            "Its transfers still in flight fail (peer_left); finished ones are kept.",
            "A running instance re-registers itself with PUT /v1/instances/{name}.",
        ],
        action=f"/ui/instances/{name}/deregister",
        button="Deregister",
        cancel=f"/ui/instances/{name}",
        danger=True,
    )


@router.post("/ui/instances/{name}/deregister", response_model=None)
def instance_deregister(request: Request, name: str, form: FormDep, db: DbDep) -> Response:
    """Delete an instance (after confirmation)."""
    if not _confirmed(form):
        return RedirectResponse(f"/ui/instances/{name}/deregister", status_code=303)
    try:
        with db.write() as session:
            registration.delete_instance(session=session, name=name)
    except NotFound as error:
        return _not_found(request, error)
    return RedirectResponse("/ui/instances?notice=deregistered", status_code=303)


# ---------------------------------------------------------------------------------------------
# pairings


@router.get("/ui/pairings", response_class=HTMLResponse)
def pairing_list(
    request: Request,
    db: DbDep,
    status: Annotated[str | None, Query(pattern="^(compatible|incompatible|stale)$")] = None,
    page: Page = 1,
) -> HTMLResponse:
    """Stored pairings, newest first."""
    with db.read() as session:
        rows, total = pairing_service.list_pairings(
            session=session, status=status, limit=PAGE_SIZE, offset=(page - 1) * PAGE_SIZE
        )
        items = [pairing_service.pairing_read(row) for row in rows]
    return _render(
        request,
        "pairings.html",
        nav="pairings",
        items=items,
        status=status,
        statuses=PAIRING_STATUSES,
        pager=_pages(total, page),
    )


@router.get("/ui/compatibility", response_class=HTMLResponse)
def compatibility(
    request: Request,
    db: DbDep,
    context_page: Page = 1,
    generation_page: Page = 1,
) -> HTMLResponse:
    """Every context × generation instance with the stored pairing status."""
    with db.read() as session:
        matrix = queries.compatibility_matrix(
            session=session,
            context_offset=(context_page - 1) * MATRIX_ROWS,
            generation_offset=(generation_page - 1) * MATRIX_COLUMNS,
            context_limit=MATRIX_ROWS,
            generation_limit=MATRIX_COLUMNS,
        )
    return _render(
        request,
        "compatibility.html",
        nav="pairings",
        matrix=matrix,
        context_pager=_pages(matrix.context_total, context_page, MATRIX_ROWS),
        generation_pager=_pages(matrix.generation_total, generation_page, MATRIX_COLUMNS),
    )


def _group_issues(issues: list[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]]]]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for issue in issues:
        groups.setdefault(issue["code"], []).append(issue)
    return list(groups.items())


def _safe_active(instance: Instance, dp_rank: int | None, field: str) -> tuple[int, ...]:
    try:
        return active_ranks(instance, dp_rank, field)
    except GeometryError:
        return ()


@router.get("/ui/pairings/{pairing_id}", response_class=HTMLResponse)
def pairing_detail(
    request: Request,
    pairing_id: str,
    db: DbDep,
    context_dp_rank: DpRank = None,
    generation_dp_rank: DpRank = None,
    receiver: DpRank = None,
) -> HTMLResponse:
    """A pairing's report grouped by code, its rank map and one receiver's head slices."""
    with db.read() as session:
        try:
            row = pairing_service.get_pairing(session=session, pairing_id=pairing_id)
        except NotFound as error:
            return _not_found(request, error)
        pairing = pairing_service.pairing_read(row)
        context = instance_service.load_geometry(row.context)
        generation = instance_service.load_geometry(row.generation)
        current = (
            row.status != "stale"
            and row.context.epoch == row.context_epoch
            and row.generation.epoch == row.generation_epoch
        )
    # A DP rank only means something under attention-DP; there it defaults to 0.
    context_dp_rank = (context_dp_rank or 0) if context.attention_dp else None
    generation_dp_rank = (generation_dp_rank or 0) if generation.attention_dp else None
    plan: dict[str, Any] | None = None
    plan_error: str | None = None
    if pairing.compatible and current:
        try:
            with db.write() as session:
                _plan_id, compiled = pairing_service.get_plan(
                    session=session,
                    pairing_id=pairing_id,
                    context_dp_rank=context_dp_rank,
                    generation_dp_rank=generation_dp_rank,
                )
            plan = compiled.to_dict()
        except KvplaneError as error:
            plan_error = error.detail
    rank_map = slices = None
    receivers: tuple[int, ...] = ()
    if plan is not None:
        senders = _safe_active(context, context_dp_rank, "context_dp_rank")
        receivers = _safe_active(generation, generation_dp_rank, "generation_dp_rank")
        rank_map = diagrams.rank_map(
            plan,
            context_world=context.world_size,
            generation_world=generation.world_size,
            active_senders=senders,
            active_receivers=receivers,
        )
        if receiver is None or receiver not in receivers:
            receiver = receivers[0] if receivers else None
        if receiver is not None and generation.ranks[receiver] is not None:
            slices = diagrams.head_slices(plan, generation, receiver)
    return _render(
        request,
        "pairing.html",
        nav="pairings",
        pairing=pairing,
        context=context,
        generation=generation,
        current=current,
        errors=_group_issues([issue.model_dump() for issue in pairing.errors]),
        warnings=_group_issues([issue.model_dump() for issue in pairing.warnings]),
        plan=plan,
        plan_error=plan_error,
        rank_map=rank_map,
        slices=slices,
        receivers=receivers,
        receiver=receiver,
        context_dp_rank=context_dp_rank,
        generation_dp_rank=generation_dp_rank,
    )


@router.get("/ui/pairings/{pairing_id}/validate", response_class=HTMLResponse)
def pairing_validate_confirm(request: Request, pairing_id: str, db: DbDep) -> HTMLResponse:
    """Ask before re-validating a pairing."""
    with db.read() as session:
        try:
            pairing = pairing_service.pairing_read(
                pairing_service.get_pairing(session=session, pairing_id=pairing_id)
            )
        except NotFound as error:
            return _not_found(request, error)
    return _render(
        request,
        "confirm.html",
        nav="pairings",
        title=f"Re-validate {pairing.context} → {pairing.generation}?",
        consequences=[
            "The pairing is validated against both instances' current registrations.",
            "Its status becomes compatible or incompatible (a stale mark is cleared).",
        ],
        action=f"/ui/pairings/{pairing_id}/validate",
        button="Re-validate",
        cancel=f"/ui/pairings/{pairing_id}",
        danger=False,
    )


@router.post("/ui/pairings/{pairing_id}/validate", response_model=None)
def pairing_validate(request: Request, pairing_id: str, form: FormDep, db: DbDep) -> Response:
    """Re-validate a pairing (after confirmation)."""
    if not _confirmed(form):
        return RedirectResponse(f"/ui/pairings/{pairing_id}/validate", status_code=303)
    try:
        with db.write() as session:
            pairing_service.validate_pairing_by_id(session=session, pairing_id=pairing_id)
    except NotFound as error:
        return _not_found(request, error)
    return RedirectResponse(f"/ui/pairings/{pairing_id}?notice=revalidated", status_code=303)


# ---------------------------------------------------------------------------------------------
# transfers and workers


def _transfer_row(row: Any, stats: queries.JobStats | None) -> dict[str, Any]:
    routes = row.summary.get("routes", []) if isinstance(row.summary, dict) else []
    started, finished = row.started_at, row.finished_at
    seconds = (finished - started).total_seconds() if started and finished else None
    return {
        "row": row,
        "runs": sum(int(route.get("runs", 0)) for route in routes),
        "routes": len(routes),
        "duration_s": seconds,
        "rate": rate(row.bytes, seconds) if row.status == "done" else "—",
        "error": row.error or (stats.error if stats else None),
        "attempt": row.attempt,
        "jobs": stats.jobs if stats else 0,
    }


@router.get("/ui/transfers", response_class=HTMLResponse)
def transfer_list(
    request: Request,
    db: DbDep,
    status: Annotated[str | None, Query(pattern="^(planned|queued|running|done|failed)$")] = None,
    context: InstanceFilter = None,
    generation: InstanceFilter = None,
    page: Page = 1,
) -> HTMLResponse:
    """Recent transfers, newest first; of one status, context or generation instance."""
    filtered = status is not None or context is not None or generation is not None
    with db.read() as session:
        rows, total = queries.list_transfers(
            session=session,
            status=status,
            context=context,
            generation=generation,
            limit=PAGE_SIZE,
            offset=(page - 1) * PAGE_SIZE,
        )
        stats = queries.job_stats(session=session, transfer_ids=[row.id for row in rows])
        items = [_transfer_row(row, stats.get(row.id)) for row in rows]
        shown = _charts(session, request) if page == 1 and not filtered else {}
    return _render(
        request,
        "transfers.html",
        nav="transfers",
        items=items,
        status=status,
        context=context,
        generation=generation,
        filtered=filtered,
        statuses=TRANSFER_STATUSES,
        pager=_pages(total, page),
        **shown,
    )


@router.get("/ui/transfers/{transfer_id}", response_class=HTMLResponse)
def transfer_detail(request: Request, transfer_id: str, db: DbDep) -> HTMLResponse:
    """One transfer: its routes and every rank's recorded part (state, worker, result)."""
    with db.read() as session:
        try:
            row = transfer_service.get_transfer(session=session, transfer_id=transfer_id)
        except NotFound as error:
            return _not_found(request, error)
        stats = queries.job_stats(session=session, transfer_ids=[row.id]).get(row.id)
        item = _transfer_row(row, stats)
        transfer = transfer_service.transfer_read(row)
        jobs = sorted(
            (
                execution_service.part_read(session, part)
                for part in execution_service.list_parts(
                    session=session, transfer_id=row.id, limit=1000
                )
            ),
            key=lambda part: (-part.attempt, part.kind, part.rank),
        )
    return _render(
        request,
        "transfer.html",
        nav="transfers",
        item=item,
        transfer=transfer,
        jobs=jobs,
        can_retry=transfer.status == "failed" and transfer.execute,
    )


@router.get("/ui/transfers/{transfer_id}/retry", response_class=HTMLResponse)
def transfer_retry_confirm(request: Request, transfer_id: str, db: DbDep) -> HTMLResponse:
    """Ask before re-running a failed transfer."""
    with db.read() as session:
        try:
            row = transfer_service.get_transfer(session=session, transfer_id=transfer_id)
        except NotFound as error:
            return _not_found(request, error)
        request_id = row.request_id
    return _render(
        request,
        "confirm.html",
        nav="transfers",
        title=f"Retry transfer of request {request_id}?",
        consequences=[
            "The transfer runs again (a new attempt, same plan and blocks).",
            "Its command goes to the live worker of every rank involved.",
        ],
        action=f"/ui/transfers/{transfer_id}/retry",
        button="Retry",
        cancel=f"/ui/transfers/{transfer_id}",
        danger=False,
    )


@router.post("/ui/transfers/{transfer_id}/retry", response_model=None)
def transfer_retry(request: Request, transfer_id: str, form: FormDep, db: DbDep) -> Response:
    """Re-run a failed transfer (after confirmation)."""
    if not _confirmed(form):
        return RedirectResponse(f"/ui/transfers/{transfer_id}/retry", status_code=303)
    try:
        with db.write() as session:
            _, commands = execution_service.retry_transfer(
                session=session, transfer_id=transfer_id, now=_now(request)
            )
        push_commands(request, commands)  # 503 when the relay cannot deliver them
    except NotFound as error:
        return _not_found(request, error)
    except KvplaneError as error:
        return _render(
            request,
            "not_found.html",
            status_code=409,
            title="Not retried",
            message=error.detail,
            back=f"/ui/transfers/{transfer_id}",
        )
    return RedirectResponse(f"/ui/transfers/{transfer_id}?notice=retried", status_code=303)


@router.get("/ui/workers", response_class=HTMLResponse)
def worker_list(request: Request, db: DbDep, page: Page = 1) -> HTMLResponse:
    """Workers: instance, rank, device, transport (UCX settings, what UCX uses and what of it is
    outside the pinned devices), heartbeat age, health and current lease."""
    now = _now(request)
    with db.read() as session:
        total = queries.count_workers(session=session)
        rows = worker_service.list_workers(
            session=session, limit=PAGE_SIZE, offset=(page - 1) * PAGE_SIZE
        )
        hub = request.app.state.hub
        items = [
            worker_service.worker_read(row, now, connected=hub.connected(row.id)) for row in rows
        ]
    return _render(
        request,
        "workers.html",
        nav="workers",
        items=items,
        outside={w.id: worker_service.ucx_outside_pinned(w.ucx, w.ucx_in_use) for w in items},
        pager=_pages(total, page),
        gone_after_s=worker_service.WORKER_GONE_S,
    )
