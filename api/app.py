"""Application factory: everything the app needs is built here and kept on ``app.state``."""

from __future__ import annotations

from fastapi import FastAPI

from api import __version__
from api.settings import Settings


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build one kvplane app bound to ``settings`` (no import-time side effects)."""
    settings = settings or Settings()
    app = FastAPI(title="kvplane", version=__version__)
    app.state.settings = settings

    @app.get("/healthz", tags=["health"], operation_id="healthz")
    def healthz() -> dict[str, str]:
        """Liveness: the process answers."""
        return {"status": "ok"}

    return app
