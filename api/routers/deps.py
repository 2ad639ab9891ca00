"""Dependencies shared by the routers (everything lives on ``app.state``)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from api.db import Database
from api.metrics import Metrics


async def get_db(request: Request) -> Database:
    """The app's database."""
    db: Database = request.app.state.db
    return db


async def get_metrics(request: Request) -> Metrics:
    """The app's metrics."""
    metrics: Metrics = request.app.state.metrics
    return metrics


DbDep = Annotated[Database, Depends(get_db)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
