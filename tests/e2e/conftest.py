"""Browser tests of the dashboard: a live uvicorn server per test, Debian's Chromium via Playwright.

Chromium is never downloaded (no ``playwright install``): the tests drive ``/usr/bin/chromium``
(``KVPLANE_CHROMIUM`` overrides the path). Without it the tier is skipped loudly, except under
``CI=true`` where that is a failure. Screenshots of every page land in
``test-artifacts/screenshots/`` (gitignored).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from api.app import create_app
from api.settings import Settings
from geometry.builders import ViewSpec, instance_body

CHROMIUM = os.environ.get("KVPLANE_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
SCREENSHOTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "screenshots"
SERVER_START_TIMEOUT_S = 10.0
# A laptop screen.
VIEWPORT = {"width": 1440, "height": 900}

_skip_reason: list[str] = []


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _skip_reason:
        terminalreporter.write_sep(
            "!", "e2e (browser) tier SKIPPED: " + _skip_reason[0], red=True, bold=True
        )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class LiveServer:
    """A running kvplane app: its base URL and an HTTP client on it."""

    url: str
    api: httpx.Client


@pytest.fixture
def live_server(sqlite_url: str) -> Iterator[LiveServer]:
    """The app on a fresh migrated SQLite database, served by uvicorn in a thread."""
    with serve(Settings(database_url=sqlite_url)) as server:
        yield server


@contextmanager
def serve(settings: Settings, wrap: Callable[[Any], Any] | None = None) -> Iterator[LiveServer]:
    """The app built from ``settings`` (inside ``wrap``, an ASGI middleware, if given), served
    by uvicorn in a thread on a free port."""
    port = _free_port()
    app: Any = create_app(settings)
    if wrap is not None:
        app = wrap(app)
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", ws="none", lifespan="on"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="e2e-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the e2e server did not start")
        time.sleep(0.02)
    url = f"http://127.0.0.1:{port}"
    with httpx.Client(base_url=url, timeout=30) as client:
        try:
            yield LiveServer(url, client)
        finally:
            server.should_exit = True
            thread.join(timeout=10)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Debian's Chromium under Playwright; skip (fail under CI=true) when it is missing."""
    if not Path(CHROMIUM).exists():
        reason = f"no Chromium at {CHROMIUM} (apt-get install -y chromium)"
        if IN_CI:
            pytest.fail(f"CI=true requires the browser tier: {reason}")
        if not _skip_reason:
            _skip_reason.append(reason)
        pytest.skip(f"e2e tier SKIPPED: {reason}")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A fresh browser page (JavaScript on) on a laptop-sized viewport."""
    context = browser.new_context(viewport=VIEWPORT)
    context.set_default_timeout(10_000)
    try:
        yield context.new_page()
    finally:
        context.close()


@pytest.fixture
def page_no_js(browser: Any) -> Iterator[Any]:
    """A browser page with JavaScript disabled."""
    context = browser.new_context(viewport=VIEWPORT, java_script_enabled=False)
    context.set_default_timeout(10_000)
    try:
        yield context.new_page()
    finally:
        context.close()


def screenshot(page: Any, name: str) -> None:
    """Save a full-page screenshot under ``test-artifacts/screenshots/``."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)


TARGET = ViewSpec("target", layers=4, kv_heads=8, head_dim=128)
DRAFT = ViewSpec("draft", layers=1, kv_heads=2, head_dim=128)


@dataclass
class Fleet:
    """What :func:`seed_fleet` registered: pairing ids by name."""

    compatible: str
    incompatible: str
    attention_dp: str


def _put(api: httpx.Client, name: str, body: dict[str, Any]) -> None:
    response = api.put(f"/v1/instances/{name}", json=body)
    assert response.status_code in (200, 201), response.text


def _pair(api: httpx.Client, context: str, generation: str) -> str:
    response = api.post("/v1/pairings", json={"context": context, "generation": generation})
    assert response.status_code in (200, 201), response.text
    return str(response.json()["id"])


def seed_fleet(api: httpx.Client) -> Fleet:
    """A TP4 context (8-head target + 2-head draft), a TP2 generation, a 4-head generation
    (incompatible), an attention-DP TP2 generation and a context with one rank missing."""
    _put(api, "ctx-tp4", instance_body(role="context", views=[TARGET, DRAFT], tp=4, model="m"))
    _put(api, "gen-tp2", instance_body(role="generation", views=[TARGET, DRAFT], tp=2, model="m"))
    wrong = ViewSpec("target", layers=4, kv_heads=4, head_dim=128)
    _put(api, "gen-4heads", instance_body(role="generation", views=[wrong, DRAFT], tp=2))
    _put(
        api,
        "gen-adp",
        instance_body(role="generation", views=[TARGET, DRAFT], tp=2, attention_dp=True),
    )
    partial = instance_body(role="context", views=[TARGET], tp=2)
    partial["ranks"] = partial["ranks"][:1]
    _put(api, "ctx-partial", partial)
    return Fleet(
        compatible=_pair(api, "ctx-tp4", "gen-tp2"),
        incompatible=_pair(api, "ctx-tp4", "gen-4heads"),
        attention_dp=_pair(api, "ctx-tp4", "gen-adp"),
    )
