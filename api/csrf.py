"""Cross-site request forgery defence of the dashboard's forms (login, logout, every action).

Every state-changing dashboard request is an urlencoded POST form. Before anything else runs
(the session lookup, the form's own handling), :func:`protect` requires both:

1. **Origin**: the browser's ``Origin`` header equals this server's own origin, scheme included
   (``http://127.0.0.1:8000`` as the request reached it; behind a TLS proxy the scheme comes from
   ``X-Forwarded-Proto``, which uvicorn trusts from loopback by default). A missing ``Origin``,
   ``Origin: null`` (what Chromium sends from a sandboxed iframe and after a cross-origin 307
   redirect) and the same host under another scheme or port are refused.
2. **Token** (signed double submit): the hidden field ``csrf_token`` equals
   ``HMAC(key, "csrf" | nonce | session cookie)``, where ``nonce`` is the random value of the
   ``kvplane_csrf`` cookie (HttpOnly, SameSite=Strict) and ``key`` the server's session key.
   A page on another origin cannot read the token; one that plants its own ``kvplane_csrf``
   cookie (cookies ignore ports, so any loopback port can) cannot compute the HMAC for it.
   Binding to the session cookie makes a token die with its session. This works with auth off
   (no session: the nonce alone) as with auth on.

A refusal is ``403 csrf_refused``, an HTML page that says why (a stale tab: reload the form).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from typing import Any, TypeVar
from urllib.parse import parse_qs

from fastapi import Request
from starlette.responses import Response

from api.cookies import CSRF_COOKIE, SESSION_COOKIE
from api.errors import Forbidden

CSRF_FIELD = "csrf_token"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_R = TypeVar("_R", bound=Response)
_NONCE = re.compile(r"^[A-Za-z0-9_-]{43}$")  # secrets.token_urlsafe(32)


class CsrfRefused(Forbidden):
    """A dashboard form post that failed the origin or token check."""

    code = "csrf_refused"
    title = "Request refused"


def _key(request: Request) -> bytes:
    key: bytes = request.app.state.session_keys.key
    return key


def _session_cookie(request: Request) -> str:
    return request.cookies.get(SESSION_COOKIE, "")


def nonce(request: Request) -> str:
    """This browser's CSRF nonce: its cookie's, or a new one that :func:`attach` will set."""
    current = getattr(request.state, "csrf_nonce", None)
    if isinstance(current, str):
        return current
    value = request.cookies.get(CSRF_COOKIE, "")
    if not _NONCE.match(value):
        value = secrets.token_urlsafe(32)
        request.state.csrf_new = True
    request.state.csrf_nonce = value
    return value


def _token(key: bytes, nonce_value: str, session: str) -> str:
    message = f"csrf|{nonce_value}|{session}".encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def token(request: Request) -> str:
    """The token a form rendered for this request must carry in ``csrf_token``."""
    return _token(_key(request), nonce(request), _session_cookie(request))


def attach(request: Request, response: _R) -> _R:
    """Set the nonce cookie on ``response`` when this request made a new one."""
    if getattr(request.state, "csrf_new", False):
        response.set_cookie(
            CSRF_COOKIE,
            nonce(request),
            path="/",
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )
    return response


def _own_origin(request: Request) -> str:
    return f"{request.url.scheme}://{request.headers.get('host', '')}"


def check_origin(request: Request) -> None:
    """403 unless the request's ``Origin`` is exactly this server's origin."""
    origin = request.headers.get("origin")
    if origin is None:
        raise CsrfRefused("refused: the form post carries no Origin header")
    if origin == "null":
        raise CsrfRefused(
            "refused: the form was posted from an opaque origin (a sandboxed frame or a "
            "cross-site redirect)"
        )
    if origin.lower() != _own_origin(request).lower():
        raise CsrfRefused(f"refused: a form post from {origin} (this dashboard is not there)")


async def protect(request: Request) -> dict[str, str]:
    """Dependency: for an unsafe method, check origin and token, then return the parsed form.

    The form is kept on ``request.state.form`` for the route (see ``form_fields``).
    """
    form = getattr(request.state, "form", None)
    if isinstance(form, dict):
        return form
    if request.method in SAFE_METHODS:
        return {}
    check_origin(request)
    body = (await request.body()).decode("utf-8", "replace")
    fields = {key: values[-1] for key, values in parse_qs(body).items()}
    sent = fields.get(CSRF_FIELD, "")
    cookie = request.cookies.get(CSRF_COOKIE, "")
    expected = _token(_key(request), cookie, _session_cookie(request))
    if not _NONCE.match(cookie) or not hmac.compare_digest(sent.encode(), expected.encode()):
        raise CsrfRefused(
            "refused: the form's CSRF token is missing or does not match this browser's "
            "session; reload the page and submit the form again"
        )
    request.state.form = fields
    return fields


def context(request: Request) -> dict[str, Any]:
    """Template variables every dashboard page needs for its forms."""
    return {"csrf_field": CSRF_FIELD, "csrf_token": token(request)}
