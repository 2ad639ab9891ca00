"""``/healthz``, ``/readyz`` and ``/metrics``."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text

from api import schemas
from api.errors import Unavailable, problem_responses
from api.migrate import current_revisions
from api.routers.deps import DbDep, MetricsDep

router = APIRouter(tags=["health"])


@router.get(
    "/healthz",
    operation_id="healthz",
    response_model=schemas.Health,
    response_model_exclude_none=True,
)
def healthz() -> schemas.Health:
    """Liveness: the process answers."""
    return schemas.Health(status="ok")


@router.get(
    "/readyz",
    operation_id="readyz",
    response_model=schemas.Health,
    response_model_exclude_none=True,
    responses=problem_responses(503),
)
def readyz(request: Request, db: DbDep) -> schemas.Health:
    """Readiness: the database answers and its schema is at the newest migration."""
    heads: set[str] = request.app.state.migration_heads
    with db.engine.connect() as conn:
        conn.execute(text("SELECT 1"))
        current = current_revisions(conn)
    if current != heads:
        raise Unavailable(
            f"database schema at {sorted(current) or 'nothing'}, expected {sorted(heads)}; "
            "run `kvplane migrate`",
            code="not_ready",
            headers={"Retry-After": "5"},
        )
    return schemas.Health(status="ok")


@router.get(
    "/metrics",
    operation_id="metrics",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}},
)
def metrics(metrics: MetricsDep) -> Response:
    """Prometheus metrics of this process."""
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
