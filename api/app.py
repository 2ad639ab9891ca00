"""Application factory: everything the app needs is built here and kept on ``app.state``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI
from sqlalchemy.exc import IntegrityError

from api import __version__, auth, openapi
from api.db import Database, utcnow
from api.dispatch import CommandHub, Completions, PostgresRelay
from api.errors import Conflict, install_error_handlers
from api.limits import BodyLimitMiddleware, DirectoryThrottle, EncodedSlashMiddleware
from api.logs import RequestIdMiddleware
from api.metrics import Metrics, TimingMiddleware
from api.migrate import head_revisions, upgrade
from api.records import RecordWriter
from api.routers import dashboard, docs, execution, health, instances, pairings, transfers
from api.services import stats
from api.settings import Settings

log = logging.getLogger(__name__)

DESCRIPTION = (
    "Control plane for disaggregated LLM serving: instance registration, pairing validation "
    "and KV-cache transfer plans. Errors are RFC 9457 `application/problem+json` with a stable "
    "`code`."
)
OPENAPI_TAGS = [
    {"name": "instances", "description": "Register context/generation instances and page tables"},
    {"name": "pairings", "description": "Validated (context, generation) pairs and their plans"},
    {"name": "compatibility", "description": "Compile-only checks of two inline instance bodies"},
    {"name": "transfers", "description": "Planned KV transfers of single requests"},
    {
        "name": "workers",
        "description": "Worker processes attached to ranks: NIXL endpoints, "
        "their directory of plans and peers, their command stream",
    },
    {"name": "health", "description": "Liveness, readiness and Prometheus metrics"},
]


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build one kvplane app bound to ``settings`` (no import-time side effects)."""
    settings = settings or Settings()
    if settings.migrate_on_startup:
        upgrade(settings.database_url)
    db = Database(settings.database_url, sqlite_busy_timeout_ms=settings.sqlite_busy_timeout_ms)

    def _pairing_counts() -> dict[str, int]:
        from api.services.pairings import count_pairings_by_status

        with db.read() as session:
            return count_pairings_by_status(session=session)

    def _job_counts() -> dict[str, int]:
        with db.read() as session:
            return stats.count_parts_by_state(session=session)

    def _worker_counts() -> dict[str, int]:
        with db.read() as session:
            return stats.count_workers_by_status(session=session, now=app.state.clock())

    metrics = Metrics(_pairing_counts, job_counts=_job_counts, worker_counts=_worker_counts)

    hub = CommandHub()
    completions = Completions()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        hub.bind(asyncio.get_running_loop())
        if settings.demo_fleet:
            from api.demo_fleet import register_demo_fleet

            register_demo_fleet(db)
        # A second lifespan on the same app (tests nest clients) shares the first one's relay.
        own_relay = hub.relay is None and db.engine.dialect.name == "postgresql"
        if own_relay:
            # Several API processes may share this database: relay commands between them.
            hub.relay = PostgresRelay(
                _libpq_url(settings.database_url), hub, completions, resolve=_resolver(app)
            )
            # Ready only once commands pushed by other processes can reach this one.
            from fastapi.concurrency import run_in_threadpool

            if not await run_in_threadpool(hub.relay.listening.wait, 10.0):
                log.warning(
                    "the dispatch relay is not listening yet; commands from other "
                    "API processes may be missed until it is"
                )
        reaper = asyncio.create_task(_reap_overdue_forever(app))
        try:
            yield
        finally:
            reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reaper
            app.state.records.close()
            if own_relay and hub.relay is not None:
                hub.relay.close()
                hub.relay = None
            db.dispose()

    app = FastAPI(
        title="kvplane",
        version=__version__,
        description=DESCRIPTION,
        openapi_tags=OPENAPI_TAGS,
        lifespan=lifespan,
        # /docs and /redoc are served by api.routers.docs, with assets from the package.
        docs_url=None,
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.db = db
    app.state.metrics = metrics
    app.state.clock = utcnow
    app.state.hub = hub
    app.state.completions = completions
    app.state.records = RecordWriter(
        lambda: app.state.db,
        lambda: app.state.clock(),
        completions,
        metrics,
        lambda: hub.relay,
    )
    app.state.migration_heads = head_revisions()

    install_error_handlers(app)

    @app.exception_handler(IntegrityError)
    async def _integrity_error(request, exc):  # type: ignore[no-untyped-def]
        # Two writers raced on a unique key (PostgreSQL, READ COMMITTED); the client may retry.
        log.warning("integrity error on %s: %s", request.url.path, exc.orig)
        handler = app.exception_handlers[Conflict.__mro__[1]]
        return await handler(
            request,
            Conflict("a concurrent request changed the same resource; retry", code="conflict"),
        )

    # Access rules live in api/auth.py (POLICY); every router gets the same guard here.
    guard = [Depends(auth.authorize)]
    app.include_router(health.router, dependencies=guard)
    app.include_router(instances.router, dependencies=guard)
    app.include_router(pairings.router, dependencies=guard)
    app.include_router(pairings.compatibility_router, dependencies=guard)
    app.include_router(transfers.router, dependencies=guard)
    app.include_router(execution.workers_router, dependencies=guard)
    app.include_router(execution.records_router, dependencies=guard)
    app.include_router(execution.stream_router)  # checks its caller itself
    auth.install(app)
    openapi.document(app)
    docs.install(app)
    dashboard.install(app, dependencies=[Depends(auth.dashboard_session)])
    app.add_middleware(
        DirectoryThrottle,
        per_s=settings.directory_reads_per_s,
        burst=settings.directory_burst,
    )  # innermost: only authenticated reads count against a worker's pace
    app.add_middleware(auth.AuthenticateFirst)  # 401 before the body is parsed
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.max_body_bytes)
    app.add_middleware(EncodedSlashMiddleware)
    app.add_middleware(TimingMiddleware, metrics=metrics)
    app.add_middleware(RequestIdMiddleware)  # outermost: every answer carries X-Request-ID
    return app


def _libpq_url(url: str) -> str:
    """The SQLAlchemy URL as psycopg takes it (``postgresql+psycopg://`` → ``postgresql://``)."""
    from sqlalchemy.engine import make_url

    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


WAKE_CHECK_S = 1.0  # waiters woken, overdue transfers reaped: one read each per round
GONE_CHECK_S = 5.0  # workers that fell silent looked for


def _resolver(app: FastAPI) -> Any:
    """What the relay calls with references to commands for workers whose streams this process
    holds: the commands, built from the database (one read per notification)."""
    from api.services import execution

    def resolve(refs: list[tuple[str, str, int, str, int]]) -> list[tuple[str, dict[str, Any]]]:
        db: Database = app.state.db
        with db.read() as session:
            return execution.commands_for_refs(session=session, refs=refs, now=app.state.clock())

    return resolve


async def _reap_overdue_forever(app: FastAPI) -> None:
    """The process's housekeeping, one database read a second whatever the number of waiters:

    - wake the ``?wait=`` long-polls whose transfers settled without this process hearing it
      (a relay notification missed, or another process on SQLite): one read of every waited
      id, so that no waiter polls the database itself;
    - fail dispatched transfers past their deadline (and wake their waiters);
    - every few seconds, bump the directories of the peers of workers that just fell silent.

    Read-only unless there is something to change."""
    from fastapi.concurrency import run_in_threadpool

    from api.services import execution
    from api.services import workers as worker_service

    db: Database = app.state.db
    completions: Completions = app.state.completions
    last_gone_check = app.state.clock()

    def wake() -> None:
        waited = completions.waited()
        if not waited:
            return
        with db.read() as session:
            settled = execution.settled_among(session=session, transfer_ids=waited)
        completions.settled(settled)

    def reap(check_gone: bool) -> None:
        nonlocal last_gone_check
        now = app.state.clock()
        gone: list[int] = []
        with db.read() as session:
            overdue = bool(execution.overdue_transfer_ids(session=session, now=now, limit=1))
            if check_gone:
                gone = worker_service.fell_silent(session=session, since=last_gone_check, now=now)
                last_gone_check = now
        if gone:
            with db.write() as session:
                worker_service.bump_gone(session=session, instance_ids=gone)
        if not overdue:
            return
        with db.write() as session:
            reaped = execution.reap_overdue(session=session, now=now)
            finished = stats.finished(session=session, transfer_ids=reaped)
        completions.settled(reaped)
        app.state.metrics.overdue.inc(len(reaped))
        app.state.metrics.transfers_settled(finished)

    rounds = 0
    while True:
        await asyncio.sleep(WAKE_CHECK_S)
        rounds += 1
        try:
            await run_in_threadpool(wake)
            await run_in_threadpool(reap, rounds % int(GONE_CHECK_S / WAKE_CHECK_S) == 0)
        except Exception as error:  # a busy database: the next round tries again
            log.warning("reaping overdue transfers failed: %s", error)
