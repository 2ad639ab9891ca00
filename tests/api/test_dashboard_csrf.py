"""Dashboard forms: CSRF token and Origin checked before anything else, auth on and off; logout
revokes the session on the server, so a copied cookie stops working. The browser replay of the
attacks is in ``tests/e2e/test_dashboard_csrf.py``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from api.auth import SESSION_COOKIE
from api.csrf import CSRF_COOKIE
from api.demo_fleet import instance_body
from tests.api.test_auth import ORIGIN, bearer, csrf_token, form_post, make_token

DEREGISTER = "/ui/instances/ctx/deregister"


@pytest.fixture(params=[False, True], ids=["auth-off", "auth-on"])
def dashboard(
    request: pytest.FixtureRequest, make_app: Callable[..., FastAPI], db_url: str
) -> Iterator[tuple[TestClient, dict[str, str]]]:
    """A client with a dashboard session (auth on) and an instance ``ctx``; API headers."""
    auth = bool(request.param)
    with TestClient(make_app(auth=auth)) as client:
        headers: dict[str, str] = {}
        if auth:
            headers = bearer(make_token(db_url, "admin")[1])
            _, secret = make_token(db_url, "operator")
            assert form_post(client, "/ui/login", {"token": secret}).status_code == 303
        body = instance_body(role="context", tp=1)
        assert client.put("/v1/instances/ctx", json=body, headers=headers).status_code == 201
        yield client, headers


def _still_there(client: TestClient, headers: dict[str, str]) -> None:
    assert client.get("/v1/instances/ctx", headers=headers).status_code == 200


def _refused(response: Any) -> None:
    assert response.status_code == 403, response.text
    assert "Request refused" in response.text


@pytest.mark.parametrize(
    "origin",
    [None, "null", "https://testserver", "http://testserver:8403", "http://evil.example"],
    ids=["missing", "null", "other-scheme", "other-port", "other-host"],
)
def test_a_form_post_from_another_origin_is_refused(
    dashboard: tuple[TestClient, dict[str, str]], origin: str | None
) -> None:
    client, headers = dashboard
    token = csrf_token(client, DEREGISTER)  # even with a valid token
    response = client.post(
        DEREGISTER,
        data={"confirm": "yes", "csrf_token": token},
        headers={} if origin is None else {"origin": origin},
        follow_redirects=False,
    )
    _refused(response)
    _still_there(client, headers)


def test_a_form_post_without_the_token_is_refused(
    dashboard: tuple[TestClient, dict[str, str]],
) -> None:
    client, headers = dashboard
    same_origin = {"origin": ORIGIN}
    csrf_token(client, DEREGISTER)  # the nonce cookie exists
    for data in ({"confirm": "yes"}, {"confirm": "yes", "csrf_token": "0" * 64}):
        _refused(client.post(DEREGISTER, data=data, headers=same_origin, follow_redirects=False))
    # A token rendered for another browser (another nonce) is worthless here ...
    with TestClient(client.app) as other:
        stolen = csrf_token(other)
    response = client.post(
        DEREGISTER,
        data={"confirm": "yes", "csrf_token": stolen},
        headers=same_origin,
        follow_redirects=False,
    )
    _refused(response)
    # ... and so is a nonce cookie planted by an attacker on another port (cookies ignore ports)
    # without the server's HMAC of it.
    client.cookies.set(CSRF_COOKIE, "A" * 43)
    response = client.post(
        DEREGISTER,
        data={"confirm": "yes", "csrf_token": stolen},
        headers=same_origin,
        follow_redirects=False,
    )
    _refused(response)
    _still_there(client, headers)
    # The dashboard's own form goes through.
    done = form_post(client, DEREGISTER, {"confirm": "yes"})
    assert done.status_code == 303 and done.headers["location"].endswith("notice=deregistered")
    assert client.get("/v1/instances/ctx", headers=headers).status_code == 404


def test_the_csrf_check_comes_before_the_session(
    make_app: Callable[..., FastAPI], db_url: str
) -> None:
    """Auth on: a forged post is refused as such, not answered with a login redirect."""
    with TestClient(make_app(auth=True)) as client:
        response = client.post(
            DEREGISTER, data={"confirm": "yes"}, headers={"origin": ORIGIN}, follow_redirects=False
        )
        _refused(response)
        # Login and logout forms are guarded the same way.
        _, secret = make_token(db_url, "operator")
        for path, data in (("/ui/login", {"token": secret}), ("/ui/logout", {})):
            response = client.post(path, data=data, headers={"origin": "null"})
            _refused(response)
        assert SESSION_COOKIE not in client.cookies


def test_logout_revokes_the_session_on_the_server(
    make_app: Callable[..., FastAPI], db_url: str
) -> None:
    """After logout a copied session cookie is refused at once, not kept until its 8 h expiry."""
    _, secret = make_token(db_url, "operator")
    with TestClient(make_app(auth=True)) as client:
        assert form_post(client, "/ui/login", {"token": secret}).status_code == 303
        assert client.get("/ui/workers").status_code == 200
        copied = client.cookies[SESSION_COOKIE]
        logout = form_post(client, "/ui/logout")
        assert logout.status_code == 303 and logout.headers["location"] == "/ui/login"
        with TestClient(client.app) as thief:
            thief.cookies.set(SESSION_COOKIE, copied)
            page = thief.get("/ui/workers", follow_redirects=False)
            assert page.status_code == 303
            assert page.headers["location"].startswith("/ui/login")
        # Signing in again makes a new session; the old cookie stays dead.
        client.cookies.clear()
        assert form_post(client, "/ui/login", {"token": secret}).status_code == 303
        assert client.cookies[SESSION_COOKIE] != copied
        assert client.get("/ui/workers").status_code == 200
