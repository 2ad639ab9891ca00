"""Bearer tokens, scopes and the one table that says who may call which route.

Auth is off by default (a loopback development server); ``KVPLANE_AUTH=true`` turns it on.
Then every request carries ``Authorization: Bearer <secret>``; the database stores only
``sha256(secret)`` (the secret is 256 random bits, shown once by ``kvplane tokens create``).

Scopes:

- ``instance``: register, update, read and deregister **its own** instance (token bound to a name);
- ``worker``: register workers, heartbeat, read their directory and command stream, and record
  transfer parts of **its own** instance; a worker token may also be bound to **one rank**
  (``tokens create --rank R``): then it acts only for workers of that rank. An unbound worker
  token acts for every rank of its instance (one token per node or per engine); it still reads
  its instance's whole registration;
- ``operator``: pairings, transfers, compatibility, every read, ``/metrics``, the dashboard;
- ``admin``: everything (and tokens, which are managed on the database by the CLI).

:data:`POLICY` maps each ``operationId`` to a :class:`Rule`; :func:`authorize` is added to every
API router at include time (``api/app.py``). A route missing from the table is admin-only (fail
closed) and ``tests/api/test_auth.py`` fails until it gets a rule. ``/healthz`` and ``/readyz``
stay open. The dashboard uses a signed session cookie made at ``/ui/login`` from an operator token
(``HttpOnly``, ``SameSite=Strict``); the cookie carries a session id (a ``dashboard_sessions``
row), an expiry and an HMAC, never the secret. The session and its token are looked up on every
request, so logging out (which revokes the row on the server), revoking the token or the expiry
each end it, and a copied cookie is worth nothing afterwards. Dashboard forms are guarded against
CSRF by :mod:`api.csrf` before anything else. No secret or hash ever appears in a log line, an
error or a page.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Receive, Scope, Send

from api import csrf
from api.cookies import SESSION_COOKIE
from api.db import Database, utcnow
from api.errors import BadRequest, Forbidden, NotFound, Unauthorized, problem_response
from api.models import (
    NAME_LENGTH,
    DashboardSessionRow,
    InstanceRow,
    TokenRow,
    TransferRow,
    WorkerRow,
)
from web.pages import templates

SCOPES = ("instance", "worker", "operator", "admin")
#: Scopes bound to one instance name.
BOUND_SCOPES = ("instance", "worker")
TOKEN_PREFIX = "kvp_"
#: Upper bound of a rank a worker token may be bound to (far above any world size).
MAX_RANKS = 1 << 16
LOGIN_PATH = "/ui/login"


@dataclass(frozen=True)
class Principal:
    """Who is calling: a token's id, scope, (for bound scopes) instance name and (for a worker
    token bound to one) rank."""

    token_id: str
    scope: str
    instance: str | None = None
    rank: int | None = None


# ---------------------------------------------------------------------------------------------
# tokens (services: keyword-only, take session=, never commit)


def new_secret() -> str:
    """A fresh token secret: 256 random bits, URL-safe."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_secret(secret: str) -> str:
    """What the database stores: sha256 of the secret (hex)."""
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def _article(word: str) -> str:
    """``an`` before ``instance``, ``operator``, ``admin``; ``a`` before ``worker``."""
    return "an" if word[:1] in "aeiou" else "a"


def create_token(
    *,
    session: Session,
    scope: str,
    instance: str | None = None,
    name: str = "",
    rank: int | None = None,
) -> tuple[TokenRow, str]:
    """Store a new token; returns the row and the secret (the only time it exists in clear)."""
    if scope not in SCOPES:
        raise BadRequest(f"scope must be one of {', '.join(SCOPES)}", code="validation_error")
    if scope in BOUND_SCOPES and not instance:
        raise BadRequest(
            f"{_article(scope)} {scope} token must be bound to an instance",
            code="validation_error",
        )
    if scope not in BOUND_SCOPES and instance:
        raise BadRequest(
            f"{_article(scope)} {scope} token is not bound to an instance",
            code="validation_error",
        )
    if instance is not None and len(instance) > NAME_LENGTH:
        raise BadRequest("instance name too long", code="validation_error")
    if rank is not None and scope != "worker":
        raise BadRequest("only a worker token can be bound to a rank", code="validation_error")
    if rank is not None and not 0 <= rank < MAX_RANKS:
        raise BadRequest(f"rank must be in [0, {MAX_RANKS})", code="validation_error")
    secret = new_secret()
    row = TokenRow(
        id=uuid.uuid4().hex,
        name=name[:NAME_LENGTH],
        scope=scope,
        instance=instance,
        secret_hash=hash_secret(secret),
        created_at=utcnow(),
        rank=rank,
    )
    session.add(row)
    session.flush()
    return row, secret


def list_tokens(*, session: Session) -> list[TokenRow]:
    """Every token, oldest first (revoked ones included)."""
    return list(session.scalars(select(TokenRow).order_by(TokenRow.created_at, TokenRow.id)))


def revoke_token(*, session: Session, token_id: str, now: datetime | None = None) -> TokenRow:
    """Revoke a token (idempotent); its sessions end with it."""
    row = session.get(TokenRow, token_id)
    if row is None:
        raise NotFound(f"no token {token_id!r}", code="token_not_found")
    if row.revoked_at is None:
        row.revoked_at = now or utcnow()
    return row


def _principal(row: TokenRow | None) -> Principal | None:
    if row is None or row.revoked_at is not None:
        return None
    return Principal(token_id=row.id, scope=row.scope, instance=row.instance, rank=row.rank)


def principal_for_secret(*, session: Session, secret: str) -> Principal | None:
    """The live token with this secret, or None."""
    row = session.scalar(select(TokenRow).where(TokenRow.secret_hash == hash_secret(secret)))
    return _principal(row)


def principal_for_id(*, session: Session, token_id: str) -> Principal | None:
    """The live token with this id, or None."""
    return _principal(session.get(TokenRow, token_id))


# ---------------------------------------------------------------------------------------------
# the policy: operationId -> who may call it

_UNKNOWN = object()  # the target does not exist: let the route answer 404


@dataclass(frozen=True)
class Target:
    """What a request acts on: the instance(s) concerned and, for a worker or job, its rank."""

    parties: tuple[str, ...]
    rank: int | None = None


Owner = Callable[[Request], Awaitable[Any]]  # -> Target | _UNKNOWN | None (names nothing)


@dataclass(frozen=True)
class Rule:
    """``scopes`` may call the route on anything; ``own`` only on their own instance."""

    scopes: frozenset[str] = frozenset()
    own: frozenset[str] = frozenset()
    owner: Owner | None = None
    open: bool = False


async def _json_body(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except (ValueError, RecursionError):  # not JSON (or nested too deep): names no target
        return None


async def _json_field(request: Request, key: str) -> Any:
    body = await _json_body(request)
    value = body.get(key) if isinstance(body, dict) else None
    return value if isinstance(value, str) else None


def _db(request: Request) -> Database:
    db: Database = request.app.state.db
    return db


async def _path_name(request: Request) -> Any:
    name = request.path_params.get("name")
    return Target((name,)) if isinstance(name, str) else None


async def _body_worker_registration(request: Request) -> Any:
    body = await _json_body(request)
    if not isinstance(body, dict) or not isinstance(body.get("instance"), str):
        return None
    rank = body.get("rank")
    return Target((body["instance"],), rank if type(rank) is int else None)


def _instance_of(request: Request, model: type[WorkerRow], key: str | None) -> Any:
    if key is None:
        return None
    with _db(request).read() as session:
        row = session.execute(
            select(InstanceRow.name, model.rank)
            .join(model, model.instance_id == InstanceRow.id)
            .where(model.id == key)
        ).first()
    return _UNKNOWN if row is None else Target((row[0],), row[1])


async def _path_worker(request: Request) -> Any:
    return await run_in_threadpool(
        _instance_of, request, WorkerRow, request.path_params.get("worker_id")
    )


async def _body_worker(request: Request) -> Any:
    worker_id = await _json_field(request, "worker_id")
    return await run_in_threadpool(_instance_of, request, WorkerRow, worker_id)


async def _body_transfer_parties(request: Request) -> Any:
    """A transfer concerns both its instances: either engine may plan it."""
    body = await _json_body(request)
    if not isinstance(body, dict):
        return None
    names = tuple(
        str(body[key]) for key in ("context", "generation") if isinstance(body.get(key), str)
    )
    return Target(names) if names else None


def _transfer_parties(request: Request, transfer_id: str | None) -> Any:
    if transfer_id is None:
        return None
    with _db(request).read() as session:
        row = session.execute(
            select(TransferRow.context_name, TransferRow.generation_name).where(
                TransferRow.id == transfer_id
            )
        ).first()
    return _UNKNOWN if row is None else Target((row[0], row[1]))


async def _path_transfer(request: Request) -> Any:
    return await run_in_threadpool(
        _transfer_parties, request, request.path_params.get("transfer_id")
    )


OPEN = Rule(open=True)
ADMIN = Rule()
OPERATOR = Rule(scopes=frozenset({"operator"}))
_INSTANCE = frozenset({"instance"})
_WORKER = frozenset({"worker"})

POLICY: dict[str, Rule] = {
    # health
    "healthz": OPEN,
    "readyz": OPEN,
    "metrics": OPERATOR,
    # instances: an instance registers itself; operators read and deregister
    "register_instance": Rule(own=_INSTANCE, owner=_path_name),
    "report_rank": Rule(own=_INSTANCE, owner=_path_name),
    "get_instance": Rule(scopes=frozenset({"operator"}), own=_INSTANCE | _WORKER, owner=_path_name),
    "list_instances": OPERATOR,
    "get_instance_handovers": OPERATOR,
    "delete_instance": Rule(scopes=frozenset({"operator"}), own=_INSTANCE, owner=_path_name),
    # pairings, compatibility, transfers
    "create_pairing": OPERATOR,
    "list_pairings": OPERATOR,
    "get_pairing": OPERATOR,
    "validate_pairing": OPERATOR,
    "get_pairing_plan": OPERATOR,
    "check_compatibility": OPERATOR,
    # an engine (instance token) plans and long-polls the transfers of its own instance
    "create_transfer": Rule(
        scopes=frozenset({"operator"}), own=_INSTANCE, owner=_body_transfer_parties
    ),
    "list_transfers": OPERATOR,
    "get_transfer": Rule(scopes=frozenset({"operator"}), own=_INSTANCE, owner=_path_transfer),
    "retry_transfer": OPERATOR,
    "get_transfer_fragments": OPERATOR,
    # workers: a worker acts for its own instance (and rank, when bound); operators read
    "register_worker": Rule(own=_WORKER, owner=_body_worker_registration),
    "list_workers": OPERATOR,
    "worker_heartbeat": Rule(own=_WORKER, owner=_path_worker),
    "stop_worker": Rule(own=_WORKER, owner=_path_worker),
    "get_worker_directory": Rule(own=_WORKER, owner=_path_worker),
    "stream_worker_commands": Rule(own=_WORKER, owner=_path_worker),
    # a worker records parts of its own instance (the service checks each record's side)
    "record_transfers": Rule(own=_WORKER, owner=_body_worker),
    "list_transfer_parts": OPERATOR,
}


def operation_of(request: Request) -> str:
    """The matched route's operationId (or function name)."""
    route = request.scope.get("route")
    return str(getattr(route, "operation_id", None) or getattr(route, "name", ""))


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()


def _lookup_secret(request: Request, secret: str) -> Principal | None:
    with _db(request).read() as session:
        return principal_for_secret(session=session, secret=secret)


async def authenticate(request: Request) -> Principal:
    """The caller's principal from its bearer token (401 when missing, unknown or revoked)."""
    secret = _bearer(request)
    if secret is None:
        raise Unauthorized("this server requires `Authorization: Bearer <token>`")
    principal = await run_in_threadpool(_lookup_secret, request, secret)
    if principal is None:
        raise Unauthorized("the bearer token is unknown or revoked")
    request.state.principal = principal
    return principal


async def check(request: Request, principal: Principal, operation: str) -> None:
    """403 unless ``principal`` may call ``operation`` (on this request's target)."""
    rule = POLICY.get(operation, ADMIN)
    if principal.scope == "admin" or principal.scope in rule.scopes:
        return
    if principal.scope in rule.own and rule.owner is not None:
        target = await rule.owner(request)
        if target is _UNKNOWN:
            return
        if isinstance(target, Target) and principal.instance in target.parties:
            if principal.rank is None or target.rank is None or target.rank == principal.rank:
                return
            raise Forbidden(
                f"this {principal.scope} token is bound to rank {principal.rank} of instance "
                f"{principal.instance!r}; {operation} here concerns rank {target.rank}"
            )
        raise Forbidden(
            f"this {principal.scope} token is bound to instance {principal.instance!r}; "
            f"{operation} here concerns another instance"
        )
    raise Forbidden(f"{_article(principal.scope)} {principal.scope} token may not call {operation}")


async def authorize(request: Request) -> None:
    """Router dependency: enforce :data:`POLICY` when auth is on."""
    if not request.app.state.settings.auth:
        return
    operation = operation_of(request)
    if POLICY.get(operation, ADMIN).open:
        return
    principal = getattr(request.state, "principal", None)  # set by AuthenticateFirst
    if not isinstance(principal, Principal):
        principal = await authenticate(request)
    await check(request, principal, operation)


class AuthenticateFirst:
    """Pure ASGI middleware: with auth on, a guarded API route's caller is authenticated (401)
    before anything reads the body, so an anonymous client learns nothing from a 400 or 422.

    FastAPI parses a request's JSON body before it solves the router dependencies; this runs
    ahead of both. The principal is left in the request state for :func:`authorize`, which
    then applies the scope rules (those may need the body: a worker's instance, a transfer's).
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        app = scope.get("app")
        if scope["type"] != "http" or app is None or not app.state.settings.auth:
            await self.app(scope, receive, send)
            return
        from api.routes import matching_route

        route = matching_route(app, scope["path"], scope["method"])
        guarded = route is not None and any(
            getattr(dep, "dependency", None) is authorize
            for dep in getattr(route, "dependencies", None) or ()
        )
        operation = str(getattr(route, "operation_id", None) or getattr(route, "name", ""))
        if not guarded or POLICY.get(operation, ADMIN).open:
            await self.app(scope, receive, send)
            return
        try:
            await authenticate(Request(scope))
        except Unauthorized as error:
            response = problem_response(
                error.status, error.code, error.detail, headers=error.headers
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


# ---------------------------------------------------------------------------------------------
# dashboard sessions


class LoginRequired(Exception):
    """The dashboard needs a session; answered with a redirect to the login form."""

    def __init__(self, next_path: str) -> None:
        super().__init__(next_path)
        self.next_path = next_path


@dataclass
class SessionKeys:
    """The HMAC key of session cookies and CSRF tokens (from settings, else random per process)."""

    key: bytes = field(default_factory=lambda: secrets.token_bytes(32))

    def sign(self, session_id: str, expires_at: int) -> str:
        payload = f"{session_id}.{expires_at}"
        mac = hmac.new(self.key, payload.encode(), hashlib.sha256).hexdigest()
        return f"{payload}.{mac}"

    def verify(self, cookie: str, now: float) -> str | None:
        """The session id of a well-signed, unexpired cookie, or None."""
        parts = cookie.split(".")
        if len(parts) != 3:
            return None
        session_id, expires, mac = parts
        expected = hmac.new(
            self.key, f"{session_id}.{expires}".encode(), hashlib.sha256
        ).hexdigest()
        if not hmac.compare_digest(mac, expected):
            return None
        if not expires.isdigit() or int(expires) < now:
            return None
        return session_id


def start_session(*, session: Session, token_id: str, ttl_s: int, now: datetime) -> str:
    """Store a new dashboard session of ``token_id`` (and drop expired ones); its id."""
    session.execute(delete(DashboardSessionRow).where(DashboardSessionRow.expires_at < now))
    row = DashboardSessionRow(
        id=uuid.uuid4().hex,
        token_id=token_id,
        created_at=now,
        expires_at=now + timedelta(seconds=ttl_s),
    )
    session.add(row)
    session.flush()
    return row.id


def end_session(*, session: Session, session_id: str, now: datetime) -> bool:
    """Revoke a dashboard session (logout); False when it was unknown or already over."""
    result = session.execute(
        update(DashboardSessionRow)
        .where(DashboardSessionRow.id == session_id, DashboardSessionRow.revoked_at.is_(None))
        .values(revoked_at=now)
    )
    return bool(getattr(result, "rowcount", 0))


def principal_for_session(*, session: Session, session_id: str, now: datetime) -> Principal | None:
    """The principal of a live dashboard session (not revoked, not expired, token live)."""
    row = session.get(DashboardSessionRow, session_id)
    if row is None or row.revoked_at is not None or row.expires_at <= now:
        return None
    return principal_for_id(session=session, token_id=row.token_id)


def _session_id(request: Request) -> str | None:
    cookie = request.cookies.get(SESSION_COOKIE)
    if not cookie:
        return None
    keys: SessionKeys = request.app.state.session_keys
    return keys.verify(cookie, time.time())


def _dashboard_principal(request: Request) -> Principal | None:
    session_id = _session_id(request)
    if session_id is None:
        return None
    with _db(request).read() as session:
        return principal_for_session(session=session, session_id=session_id, now=utcnow())


def _safe_next(path: str | None) -> str:
    # Only local paths: a login form must not become an open redirect.
    if not path or not path.startswith("/") or path.startswith("//") or "\\" in path:
        return "/"
    return path


async def dashboard_session(request: Request) -> None:
    """Dashboard dependency: an operator (or admin) session, or a bearer token, when auth is on."""
    if not request.app.state.settings.auth:
        return
    if _bearer(request) is not None:
        principal = await authenticate(request)
    else:
        found = await run_in_threadpool(_dashboard_principal, request)
        if found is None:
            target = request.url.path
            if request.url.query:
                target += "?" + request.url.query
            raise LoginRequired(target if request.method == "GET" else "/")
        principal = found
    if principal.scope not in ("operator", "admin"):
        raise Forbidden(
            "the dashboard needs an operator token, "
            f"not {_article(principal.scope)} {principal.scope} token"
        )
    request.state.principal = principal


login_router = APIRouter(include_in_schema=False)


def _login_page(request: Request, next_path: str, error: str | None, status_code: int) -> Response:
    response = templates.TemplateResponse(
        request,
        "login.html",
        {
            "next": _safe_next(next_path),
            "error": error,
            "notice": None,
            "nav": None,
            **csrf.context(request),
        },
        status_code=status_code,
    )
    return csrf.attach(request, response)


@login_router.get(LOGIN_PATH, response_class=HTMLResponse)
def login_form(request: Request, next: str = "/") -> Response:
    """The dashboard's login form (paste an operator token)."""
    return _login_page(request, next, None, 200)


@login_router.post(LOGIN_PATH, response_model=None)
async def login(request: Request) -> Response:
    """Exchange an operator token for a session cookie (the token itself is never stored)."""
    form = await csrf.protect(request)
    next_path = _safe_next(form.get("next"))
    secret = form.get("token", "").strip()
    principal = await run_in_threadpool(_lookup_secret, request, secret) if secret else None
    if principal is None:
        return _login_page(request, next_path, "Unknown or revoked token.", 401)
    if principal.scope not in ("operator", "admin"):
        return _login_page(
            request, next_path, f"A {principal.scope} token cannot open the dashboard.", 403
        )
    settings = request.app.state.settings
    ttl_s = int(settings.session_ttl_s)
    now = utcnow()

    def store() -> str:
        with _db(request).write() as session:
            return start_session(session=session, token_id=principal.token_id, ttl_s=ttl_s, now=now)

    session_id = await run_in_threadpool(store)
    expires_at = int(now.timestamp()) + ttl_s
    keys: SessionKeys = request.app.state.session_keys
    response = RedirectResponse(next_path, status_code=303)
    response.set_cookie(
        SESSION_COOKIE,
        keys.sign(session_id, expires_at),
        max_age=int(settings.session_ttl_s),
        path="/",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
    return response


@login_router.post("/ui/logout", response_model=None)
async def logout(request: Request) -> Response:
    """End the dashboard session: revoked on the server, then the cookie is cleared."""
    await csrf.protect(request)
    session_id = _session_id(request)
    if session_id is not None:

        def revoke() -> None:
            with _db(request).write() as session:
                end_session(session=session, session_id=session_id, now=utcnow())

        await run_in_threadpool(revoke)
    response = RedirectResponse(LOGIN_PATH, status_code=303)
    response.delete_cookie(SESSION_COOKIE, path="/", httponly=True, samesite="strict")
    return response


def _problem(description: str) -> dict[str, Any]:
    schema = {"$ref": "#/components/schemas/Problem"}
    return {"description": description, "content": {"application/problem+json": {"schema": schema}}}


def document(app: FastAPI) -> None:
    """Declare bearer auth in the OpenAPI spec as this server enforces it.

    The ``bearer`` scheme, each operation's ``x-kvplane-scopes`` and its 401/403 answers are
    always documented. The security *requirement* follows the runtime setting: with
    ``KVPLANE_AUTH=true`` every protected operation declares ``security: [{"bearer": []}]``; with
    auth off (the default) no operation declares one, because none needs a token (a generated
    client then takes a plain client everywhere; one with a token works too, the token is
    ignored). ``security: [{}, {"bearer": []}]`` would say the same, but generators such as
    openapi-python-client read any non-empty list as "token required".
    """
    build = app.openapi
    enforced = bool(app.state.settings.auth)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        spec = build()
        spec.setdefault("components", {}).setdefault("securitySchemes", {})["bearer"] = {
            "type": "http",
            "scheme": "bearer",
            "description": "A kvplane token (`kvplane tokens create`). Enforced only when the "
            "server runs with KVPLANE_AUTH=true: only then do operations declare it in "
            "`security`; `x-kvplane-scopes` lists the scopes each one accepts.",
        }
        for item in spec["paths"].values():
            for operation in item.values():
                rule = POLICY.get(operation.get("operationId", ""), ADMIN)
                if rule.open:
                    continue
                if enforced:
                    operation["security"] = [{"bearer": []}]
                operation["x-kvplane-scopes"] = sorted(
                    {"admin", *rule.scopes} | {f"{scope} (own instance)" for scope in rule.own}
                )
                responses = operation.setdefault("responses", {})
                responses.setdefault("401", _problem("Missing, unknown or revoked bearer token"))
                responses.setdefault("403", _problem("The token's scope does not cover this"))
        return spec

    app.openapi = openapi  # type: ignore[method-assign]


def install(app: FastAPI) -> None:
    """Session keys, the login routes and the login redirect (call before the dashboard)."""
    document(app)
    secret = app.state.settings.session_secret
    app.state.session_keys = (
        SessionKeys(key=secret.get_secret_value().encode()) if secret else SessionKeys()
    )
    app.include_router(login_router)

    @app.exception_handler(LoginRequired)
    async def _login_required(_request: Request, exc: LoginRequired) -> Response:
        return RedirectResponse(f"{LOGIN_PATH}?next={quote(exc.next_path, safe='')}", 303)

    @app.exception_handler(csrf.CsrfRefused)
    async def _csrf_refused(request: Request, exc: csrf.CsrfRefused) -> Response:
        response = templates.TemplateResponse(
            request,
            "not_found.html",
            {
                "title": "Request refused",
                "message": exc.detail,
                "notice": None,
                "nav": None,
                "code": exc.code,
                **csrf.context(request),
            },
            status_code=exc.status,
        )
        return csrf.attach(request, response)


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
    import ipaddress

    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exposure_refusal(host: str, *, auth: bool) -> str | None:
    """Why ``kvplane serve`` must not bind ``host`` as configured, or None when it may."""
    if auth or is_loopback(host):
        return None
    return (
        f"refusing to serve on {host} without authentication: set KVPLANE_AUTH=true (tokens: "
        "`kvplane tokens create`), or pass --insecure"
    )
