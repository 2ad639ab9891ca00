"""Two CSRF attacks on the dashboard that a security probe found, replayed in Chromium.

An attacker page on another loopback port makes the victim's browser post the deregister form:

- **307**: an auto-submitted form posts to the attacker's own server, which answers
  ``307 Temporary Redirect`` to the dashboard's form action; the browser re-posts the body there
  (with ``Origin: null``, the redirect being cross-origin).
- **sandboxed iframe**: a ``sandbox="allow-forms allow-scripts"`` frame (an opaque origin, so
  ``Origin: null``) submits the form straight at the dashboard.

With auth off the attacker is ``localhost:Q`` against ``127.0.0.1:P``; with auth on it is
``127.0.0.1:Q``, same-site with the dashboard, so the browser even sends the victim's
``SameSite=Strict`` session cookie along the 307. Before the fix every one of these removed the
instance; now each post reaches the server and is refused with 403 before anything else.
"""

from __future__ import annotations

import html
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from api.auth import create_token
from api.db import Database
from api.settings import Settings
from tests.e2e.conftest import LiveServer, _free_port, seed_fleet, serve

pytestmark = pytest.mark.timeout(90)

VICTIM = "gen-4heads"
TARGET_PATH = f"/ui/instances/{VICTIM}/deregister"
ARRIVAL_TIMEOUT_S = 30.0  # how long the forged post may take to arrive (not a timing check)


class Attacker:
    """A hostile web server on another loopback port: attack pages and a 307 bounce."""

    def __init__(self, host: str, target: str) -> None:
        self.port = _free_port()
        self.host = host
        self.target = target  # the dashboard's deregister form action
        attacker = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_args: Any) -> None:  # quiet
                pass

            def _page(self, body: str) -> None:
                data = body.encode()
                self.send_response(200)
                self.send_header("content-type", "text/html; charset=utf-8")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                if self.path == "/redirect":
                    self._page(attacker.redirect_page())
                elif self.path == "/iframe":
                    self._page(attacker.iframe_page())
                else:
                    self.send_error(404)

            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("content-length", "0")))
                self.send_response(307)
                self.send_header("location", attacker.target)
                self.send_header("content-length", "0")
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def redirect_page(self) -> str:
        return (
            "<!doctype html><body onload='document.forms[0].submit()'>"
            f"<form method='post' action='{self.url}/bounce'>"
            "<input type='hidden' name='confirm' value='yes'></form></body>"
        )

    def iframe_page(self) -> str:
        # A handshake instead of submitting at once: a submission from inside the frame's own
        # load can be dropped by Chromium, and a message posted to a frame that is still on
        # its initial about:blank is lost. The frame says "ready"; the parent answers "go".
        inner = (
            "<body><form method='post' action='" + self.target + "'>"
            "<input type='hidden' name='confirm' value='yes'></form><script>"
            "addEventListener('message', () => document.forms[0].submit());"
            "parent.postMessage('ready', '*');</script></body>"
        )
        return (
            "<!doctype html><body><script>addEventListener('message', (event) => "
            "event.source.postMessage('go', '*'));</script>"
            "<iframe sandbox='allow-forms allow-scripts' "
            f'srcdoc="{html.escape(inner)}"></iframe></body>'
        )

    def __enter__(self) -> Attacker:
        self.thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


class Posts:
    """ASGI wrapper around the dashboard's app: records the status of every POST to ``path``.

    Playwright does not reliably report requests of a sandboxed frame (Chromium runs it out of
    process), so the test learns from the server itself that the forged post arrived.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.statuses: list[int] = []
        self.arrived = threading.Event()

    def __call__(self, app: Any) -> Any:
        async def recorded(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != self.path:
                await app(scope, receive, send)
                return

            async def send_recording(message: Any) -> None:
                if message["type"] == "http.response.start":
                    self.statuses.append(int(message["status"]))
                    self.arrived.set()
                await send(message)

            await app(scope, receive, send_recording)

        return recorded

    def wait(self) -> int:
        """The status of the first recorded post (waits for it to arrive)."""
        assert self.arrived.wait(ARRIVAL_TIMEOUT_S), f"no POST {self.path} reached the server"
        return self.statuses[0]


def _attack(page: Any, attacker: Attacker, path: str, posts: Posts) -> int:
    """Open the attacker's page; the status the dashboard answered the forged post with."""
    page.goto(attacker.url + path)
    return posts.wait()


@pytest.fixture
def posts() -> Posts:
    return Posts(TARGET_PATH)


@pytest.fixture
def server(sqlite_url: str, posts: Posts) -> Iterator[LiveServer]:
    """The dashboard with auth off, its deregister posts recorded."""
    with serve(Settings(database_url=sqlite_url), wrap=posts) as live:
        yield live


@pytest.fixture
def auth_server(sqlite_url: str, posts: Posts) -> Iterator[tuple[LiveServer, str]]:
    """The dashboard with auth on; an admin bearer on its API client, an operator secret."""
    db = Database(sqlite_url)
    try:
        with db.write() as session:
            _, admin = create_token(session=session, scope="admin")
            _, operator = create_token(session=session, scope="operator")
    finally:
        db.dispose()
    with serve(Settings(database_url=sqlite_url, auth=True), wrap=posts) as live:
        live.api.headers["Authorization"] = f"Bearer {admin}"
        yield live, operator


@pytest.mark.parametrize("path", ["/redirect", "/iframe"], ids=["307-redirect", "sandboxed-iframe"])
def test_cross_site_attacks_cannot_deregister(
    server: LiveServer, posts: Posts, page: Any, path: str
) -> None:
    seed_fleet(server.api)
    with Attacker("localhost", server.url + TARGET_PATH) as attacker:
        status = _attack(page, attacker, path, posts)
    assert status == 403, f"the forged post was answered {status}"
    assert server.api.get(f"/v1/instances/{VICTIM}").status_code == 200
    # The dashboard's own form still works in the same browser.
    page.goto(server.url + TARGET_PATH)
    page.get_by_role("button", name="Deregister").click()
    page.get_by_role("status").filter(has_text="Instance deregistered").wait_for()
    assert server.api.get(f"/v1/instances/{VICTIM}").status_code == 404


@pytest.mark.parametrize("path", ["/redirect", "/iframe"], ids=["307-redirect", "sandboxed-iframe"])
def test_same_site_attacks_cannot_deregister_with_a_signed_in_victim(
    auth_server: tuple[LiveServer, str], posts: Posts, page: Any, path: str
) -> None:
    server, operator = auth_server
    seed_fleet(server.api)
    page.goto(f"{server.url}/ui/login")
    page.get_by_label("Token").fill(operator)
    page.get_by_role("button", name="Sign in").click()
    page.get_by_role("heading", level=1).wait_for()
    assert page.url.rstrip("/") == server.url  # signed in, on the overview
    with Attacker("127.0.0.1", server.url + TARGET_PATH) as attacker:  # same site, other port
        status = _attack(page, attacker, path, posts)
    assert status == 403, f"the forged post was answered {status}"
    assert server.api.get(f"/v1/instances/{VICTIM}").status_code == 200
