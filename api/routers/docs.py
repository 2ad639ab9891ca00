"""API docs pages, ``/docs`` (Swagger UI) and ``/redoc`` (ReDoc), that need no network.

FastAPI's own pages load their JavaScript and CSS from a CDN, so on an air-gapped cluster they
stay blank. The same assets ship in the ``fastapi-offline`` wheel (MIT; Swagger UI is
Apache-2.0, ReDoc MIT), a dependency of kvplane: this module serves them from the installed
package under :data:`ASSETS_URL`, and the pages reference nothing outside this server.
"""

from __future__ import annotations

from pathlib import Path

import fastapi_offline
from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

ASSETS_DIR = Path(fastapi_offline.__file__).resolve().parent / "static"
ASSETS_URL = "/docs-assets"
#: The pages may load nothing from another host. ReDoc's sidebar links a logo on its makers'
#: CDN; the browser drops that request instead of leaking it (blob: is ReDoc's search worker).
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; font-src 'self' data:; worker-src 'self' blob:; connect-src 'self'"
)


def install(app: FastAPI) -> None:
    """Serve ``/docs``, ``/redoc`` and their assets (build ``app`` with ``docs_url=None``)."""
    openapi_url = app.openapi_url or "/openapi.json"
    title = f"{app.title} {app.version}"

    @app.get("/docs", include_in_schema=False)
    def swagger_ui() -> HTMLResponse:
        return _local_only(
            get_swagger_ui_html(
                openapi_url=openapi_url,
                title=f"{title}: API docs",
                swagger_js_url=f"{ASSETS_URL}/swagger-ui-bundle.js",
                swagger_css_url=f"{ASSETS_URL}/swagger-ui.css",
                swagger_favicon_url=f"{ASSETS_URL}/favicon.png",
                oauth2_redirect_url=None,
                # Swagger UI would otherwise ask a public validator service about the spec.
                swagger_ui_parameters={"validatorUrl": None},
            )
        )

    @app.get("/redoc", include_in_schema=False)
    def redoc() -> HTMLResponse:
        return _local_only(
            get_redoc_html(
                openapi_url=openapi_url,
                title=f"{title}: API reference",
                redoc_js_url=f"{ASSETS_URL}/redoc.standalone.js",
                redoc_favicon_url=f"{ASSETS_URL}/favicon.png",
                with_google_fonts=False,
            )
        )

    app.mount(ASSETS_URL, StaticFiles(directory=str(ASSETS_DIR)), name="docs-assets")


def _local_only(page: HTMLResponse) -> HTMLResponse:
    page.headers["Content-Security-Policy"] = CONTENT_SECURITY_POLICY
    return page
