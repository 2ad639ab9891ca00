"""``/docs`` (Swagger UI) and ``/redoc`` render with no network beyond this server.

Every request the page makes to any host other than the loopback server is aborted and
recorded, as on an air-gapped cluster; the pages must still render the spec's operations, and
no request may even try to leave.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import pytest
from playwright.sync_api import expect

from tests.e2e.conftest import SCREENSHOTS, LiveServer


def _offline(page: Any) -> list[str]:
    """Abort every request that leaves 127.0.0.1; returns the list of those attempted."""
    blocked: list[str] = []

    def route(route: Any) -> None:
        url = route.request.url
        if urlsplit(url).hostname == "127.0.0.1" or url.startswith(("data:", "blob:")):
            route.continue_()
        else:
            blocked.append(url)
            route.abort()

    page.context.route("**/*", route)
    return blocked


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("path", "operation"),
    [("/docs", "register_instance"), ("/redoc", "register_instance")],
)
def test_api_docs_render_without_network(
    page: Any, live_server: LiveServer, path: str, operation: str
) -> None:
    blocked = _offline(page)
    failed: list[tuple[str, str | None]] = []
    errors: list[str] = []
    page.on("requestfailed", lambda request: failed.append((request.url, request.failure)))
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(live_server.url + path)
    if path == "/docs":
        # Swagger UI lists every operation; the first tag's routes are expanded.
        # Swagger UI parses a 1.5 MB bundle and the spec first: slow on a loaded machine.
        expect(page.locator(".swagger-ui .info .title")).to_contain_text("kvplane", timeout=60_000)
        expect(page.locator(f"#operations-instances-{operation}")).to_be_visible()
        expect(page.locator(".opblock-tag", has_text="transfers")).to_be_visible()
    else:
        # ReDoc parses a 1 MB bundle and the whole spec first: slow on a loaded machine.
        (
            expect(page.get_by_role("heading", name="kvplane", exact=False).first).to_be_visible(
                timeout=60_000
            ),
            errors,
        )
        # ReDoc renders one section per operation, with its id in the anchor.
        expect(page.locator(f'[id="operation/{operation}"]')).to_be_attached()
        expect(page.locator("body")).to_contain_text("Register or replace an instance")
    # The viewport only: a full-page shot of ReDoc's long page takes longer than it is worth.
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"60-api-docs{path.replace('/', '-')}.png"))
    assert blocked == [], f"{path} tried to reach the network: {blocked}"
    # The only other failures allowed are ones the page's Content-Security-Policy stopped inside
    # the browser (ReDoc's sidebar logo on its makers' CDN): they never reached the network.
    assert [(url, why) for url, why in failed if why != "csp"] == [], failed
    assert all(urlsplit(url).hostname != "127.0.0.1" for url, _ in failed), failed
    assert errors == [], f"{path} raised in the page: {errors}"
