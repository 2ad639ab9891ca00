"""Auth: bearer tokens with scopes, bound instances, the dashboard session, no leaked secrets."""

from __future__ import annotations

import hashlib
import logging
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from api.auth import POLICY, SESSION_COOKIE, create_token, revoke_token
from api.db import Database
from api.demo_fleet import instance_body

TRANSFER = {
    "context": "ctx",
    "generation": "gen",
    "request_id": "r1",
    "blocks": {"0": {"context": [0, 1], "generation": [2, 3]}},
    "execute": True,
}


def make_token(
    db_url: str, scope: str, instance: str | None = None, rank: int | None = None
) -> tuple[str, str]:
    """(id, secret) of a fresh token."""
    db = Database(db_url)
    try:
        with db.write() as session:
            row, secret = create_token(session=session, scope=scope, instance=instance, rank=rank)
            return row.id, secret
    finally:
        db.dispose()


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def peer_body(instance: dict[str, Any], name: str, rank: int) -> dict[str, Any]:
    """A worker registration with a syntactically valid NIXL endpoint."""
    pools = instance["ranks"][rank]["pools"]
    return {
        "instance": name,
        "rank": rank,
        "peer": {
            "agent": f"{name}.r{rank}",
            "metadata_b64": "bWV0YWRhdGE=",
            "mem_type": "DRAM",
            "device_id": 0,
            "pools": [
                {
                    "slot_stride_bytes": pool["slot_bytes"],
                    **pool,
                    "base_address": 4096 * (pool["id"] + 1),
                }
                for pool in pools
            ],
            "staging": {"address": 1 << 20, "bytes": 1 << 24},
        },
    }


@pytest.fixture
def auth_app(make_app: Callable[..., FastAPI]) -> FastAPI:
    return make_app(auth=True)


@pytest.fixture
def api(auth_app: FastAPI) -> Iterator[TestClient]:
    with TestClient(auth_app) as test_client:
        yield test_client


@pytest.fixture
def tokens(db_url: str) -> dict[str, str]:
    """Secrets of one token per role: admin, operator, ctx/gen instance and worker tokens."""
    return {
        "admin": make_token(db_url, "admin")[1],
        "operator": make_token(db_url, "operator")[1],
        "ctx": make_token(db_url, "instance", "ctx")[1],
        "gen": make_token(db_url, "instance", "gen")[1],
        "ctx-worker": make_token(db_url, "worker", "ctx")[1],
        "gen-worker": make_token(db_url, "worker", "gen")[1],
    }


ORIGIN = "http://testserver"  # the TestClient's base URL: the dashboard's own origin


def csrf_token(client: TestClient, page: str = "/ui/login") -> str:
    """The CSRF token of a dashboard form (fetching the page also sets the nonce cookie)."""
    found = re.search(r'name="csrf_token" value="([0-9a-f]{64})"', client.get(page).text)
    assert found, f"no CSRF token on {page}"
    return found.group(1)


def form_post(
    client: TestClient, path: str, data: dict[str, str] | None = None, **headers: str
) -> Any:
    """A dashboard form post as a browser on the dashboard's own origin sends it."""
    return client.post(
        path,
        data={**(data or {}), "csrf_token": csrf_token(client)},
        headers={"origin": ORIGIN, **headers},
        follow_redirects=False,
    )


def problem(response: Any, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    assert response.json()["code"] == code


def register_fleet(api: TestClient, tokens: dict[str, str]) -> dict[str, Any]:
    ctx = instance_body(role="context", tp=2)
    gen = instance_body(role="generation", tp=1)
    assert api.put("/v1/instances/ctx", json=ctx, headers=bearer(tokens["ctx"])).status_code == 201
    assert api.put("/v1/instances/gen", json=gen, headers=bearer(tokens["gen"])).status_code == 201
    pairing = api.post(
        "/v1/pairings",
        json={"context": "ctx", "generation": "gen"},
        headers=bearer(tokens["operator"]),
    )
    assert pairing.status_code == 201 and pairing.json()["compatible"]
    return {"ctx": ctx, "gen": gen}


def test_every_route_has_an_access_rule(auth_app: FastAPI) -> None:
    operations = {
        op["operationId"] for item in auth_app.openapi()["paths"].values() for op in item.values()
    }
    missing = operations - set(POLICY)
    assert not missing, f"add these operations to api.auth.POLICY: {sorted(missing)}"


def test_missing_or_bad_token_is_401(api: TestClient, db_url: str, tokens: dict[str, str]) -> None:
    for headers in (
        {},
        bearer("kvp_not-a-token"),
        {"Authorization": "Basic Zm9vOmJhcg=="},
        {"Authorization": "Bearer "},
    ):
        response = api.get("/v1/instances", headers=headers)
        problem(response, 401, "unauthorized")
        assert response.headers["www-authenticate"].startswith("Bearer")
    response = api.put("/v1/instances/ctx", json=instance_body(role="context", tp=1))
    problem(response, 401, "unauthorized")
    # Health stays open; the spec too (automation needs it to find the routes).
    assert api.get("/healthz").status_code == 200
    assert api.get("/readyz").status_code == 200
    assert api.get("/openapi.json").status_code == 200


def test_revoked_token_is_401(api: TestClient, db_url: str) -> None:
    token_id, secret = make_token(db_url, "operator")
    assert api.get("/v1/instances", headers=bearer(secret)).status_code == 200
    db = Database(db_url)
    with db.write() as session:
        revoke_token(session=session, token_id=token_id)
    db.dispose()
    problem(api.get("/v1/instances", headers=bearer(secret)), 401, "unauthorized")


def test_metrics_need_operator(api: TestClient, tokens: dict[str, str]) -> None:
    problem(api.get("/metrics"), 401, "unauthorized")
    problem(api.get("/metrics", headers=bearer(tokens["ctx"])), 403, "forbidden")
    assert api.get("/metrics", headers=bearer(tokens["operator"])).status_code == 200
    assert api.get("/metrics", headers=bearer(tokens["admin"])).status_code == 200


def test_instance_token_registers_only_its_own_instance(
    api: TestClient, tokens: dict[str, str]
) -> None:
    body = instance_body(role="context", tp=1)
    own = bearer(tokens["ctx"])
    assert api.put("/v1/instances/ctx", json=body, headers=own).status_code == 201
    problem(api.put("/v1/instances/gen", json=body, headers=own), 403, "forbidden")
    problem(
        api.put("/v1/instances/ctx", json=body, headers=bearer(tokens["gen"])), 403, "forbidden"
    )
    # Workers and operators do not register instances (admin does everything).
    problem(
        api.put("/v1/instances/ctx", json=body, headers=bearer(tokens["ctx-worker"])),
        403,
        "forbidden",
    )
    problem(
        api.put("/v1/instances/ctx", json=body, headers=bearer(tokens["operator"])),
        403,
        "forbidden",
    )
    assert (
        api.put("/v1/instances/ctx", json=body, headers=bearer(tokens["admin"])).status_code == 200
    )
    rank = body["ranks"][0]
    problem(api.put("/v1/instances/gen/ranks/0", json=rank, headers=own), 403, "forbidden")
    # Reads of its own instance only; no pairings, transfers or listings.
    assert api.get("/v1/instances/ctx", headers=own).status_code == 200
    problem(api.get("/v1/instances/gen", headers=own), 403, "forbidden")
    problem(api.get("/v1/instances", headers=own), 403, "forbidden")
    problem(
        api.post("/v1/pairings", json={"context": "ctx", "generation": "gen"}, headers=own),
        403,
        "forbidden",
    )
    # transfers only between other instances are not its business (its own: see below)
    elsewhere = {**TRANSFER, "context": "c2", "generation": "g2"}
    problem(api.post("/v1/transfers", json=elsewhere, headers=own), 403, "forbidden")
    problem(api.delete("/v1/instances/gen", headers=own), 403, "forbidden")
    assert api.delete("/v1/instances/ctx", headers=own).status_code == 204


def test_operator_scope(api: TestClient, tokens: dict[str, str]) -> None:
    register_fleet(api, tokens)
    op = bearer(tokens["operator"])
    transfer = api.post("/v1/transfers", json={**TRANSFER, "execute": False}, headers=op)
    assert transfer.status_code == 201, transfer.text
    for path in (
        "/v1/instances",
        "/v1/pairings",
        "/v1/workers",
        f"/v1/transfers/{transfer.json()['id']}",
        f"/v1/transfers/{transfer.json()['id']}/parts",
    ):
        assert api.get(path, headers=op).status_code == 200, path
    # Operators do not act as workers.
    record = {"worker_id": "x" * 32, "records": [{}]}
    problem(api.post("/v1/transfers/records", json=record, headers=op), 403, "forbidden")


def test_engines_plan_and_poll_their_own_transfers(
    api: TestClient, db_url: str, tokens: dict[str, str]
) -> None:
    register_fleet(api, tokens)
    planned = {**TRANSFER, "execute": False}
    # the generation engine posts the request's transfer and long-polls it; the context engine
    # only reads it
    created = api.post("/v1/transfers", json=planned, headers=bearer(tokens["gen"]))
    assert created.status_code == 201, created.text
    path = f"/v1/transfers/{created.json()['id']}"
    assert api.get(path, headers=bearer(tokens["gen"])).status_code == 200
    assert api.get(path, headers=bearer(tokens["ctx"])).status_code == 200
    # an engine of another instance neither plans nor reads it
    other = make_token(db_url, "instance", "elsewhere")[1]
    problem(api.post("/v1/transfers", json=planned, headers=bearer(other)), 403, "forbidden")
    problem(api.get(path, headers=bearer(other)), 403, "forbidden")
    # nor do worker tokens, and an unknown transfer stays a plain 404 for an engine
    problem(api.get(path, headers=bearer(tokens["gen-worker"])), 403, "forbidden")
    problem(
        api.get("/v1/transfers/" + "0" * 32, headers=bearer(tokens["gen"])),
        404,
        "transfer_not_found",
    )


def test_worker_token_acts_only_for_its_instance(api: TestClient, tokens: dict[str, str]) -> None:
    bodies = register_fleet(api, tokens)
    ctx_w, gen_w = bearer(tokens["ctx-worker"]), bearer(tokens["gen-worker"])
    problem(
        api.post("/v1/workers", json=peer_body(bodies["gen"], "gen", 0), headers=ctx_w),
        403,
        "forbidden",
    )
    problem(
        api.post(
            "/v1/workers", json=peer_body(bodies["ctx"], "ctx", 0), headers=bearer(tokens["ctx"])
        ),
        403,
        "forbidden",
    )
    ctx_workers = []
    for rank in (0, 1):
        attached = api.post(
            "/v1/workers", json=peer_body(bodies["ctx"], "ctx", rank), headers=ctx_w
        )
        assert attached.status_code == 201, attached.text
        ctx_workers.append(attached.json()["id"])
    gen_worker = api.post("/v1/workers", json=peer_body(bodies["gen"], "gen", 0), headers=gen_w)
    assert gen_worker.status_code == 201
    gen_id = gen_worker.json()["id"]

    assert (
        api.post("/v1/transfers", json=TRANSFER, headers=bearer(tokens["operator"])).status_code
        == 201
    )
    # A worker reads its own instance (it needs its page table), not others.
    assert api.get("/v1/instances/ctx", headers=ctx_w).status_code == 200
    problem(api.get("/v1/instances/gen", headers=ctx_w), 403, "forbidden")
    problem(api.get("/v1/instances", headers=ctx_w), 403, "forbidden")
    # Heartbeats, directories, command streams and records of another instance's worker are
    # refused.
    problem(api.post(f"/v1/workers/{gen_id}/heartbeat", headers=ctx_w), 403, "forbidden")
    problem(api.get(f"/v1/workers/{gen_id}/directory", headers=ctx_w), 403, "forbidden")
    problem(api.get(f"/v1/workers/{gen_id}/commands", headers=ctx_w), 403, "forbidden")
    assert api.post(f"/v1/workers/{ctx_workers[0]}/heartbeat", headers=ctx_w).status_code == 200
    directory = api.get(f"/v1/workers/{ctx_workers[0]}/directory", headers=ctx_w)
    assert directory.status_code == 200, directory.text
    (pairing,) = directory.json()["pairings"]
    executed = api.post(
        "/v1/transfers",
        json={**TRANSFER, "request_id": "r-exec", "execute": True},
        headers=bearer(tokens["operator"]),
    )
    assert executed.status_code == 201, executed.text
    record = {
        "transfer_id": executed.json()["id"],
        "request_id": "r-exec",
        "pairing_id": pairing["id"],
        "context": "ctx",
        "generation": "gen",
        "context_epoch": pairing["context_epoch"],
        "generation_epoch": pairing["generation_epoch"],
        "side": "send",
        "rank": 0,
        "status": "failed",
        "error": "test",
        "bytes": 0,
        "started_at": time.time(),
        "finished_at": time.time(),
    }
    # The generation's worker token cannot record through a context worker ...
    problem(
        api.post(
            "/v1/transfers/records",
            json={"worker_id": ctx_workers[0], "records": [record]},
            headers=gen_w,
        ),
        403,
        "forbidden",
    )
    # ... nor make its own worker record the context's side.
    problem(
        api.post(
            "/v1/transfers/records", json={"worker_id": gen_id, "records": [record]}, headers=gen_w
        ),
        403,
        "forbidden",
    )
    problem(api.delete(f"/v1/workers/{ctx_workers[1]}", headers=gen_w), 403, "forbidden")
    # Its own part: accepted.
    accepted = api.post(
        "/v1/transfers/records",
        json={"worker_id": ctx_workers[0], "records": [record]},
        headers=ctx_w,
    )
    assert accepted.status_code == 200, accepted.text
    assert accepted.json()["settled"] == [executed.json()["id"]]
    # Unknown ids are the route's business: 404, not 403.
    problem(
        api.post("/v1/workers/nope/heartbeat", headers=ctx_w),
        404,
        api.post("/v1/workers/nope/heartbeat", headers=bearer(tokens["admin"])).json()["code"],
    )
    # A malformed record body cannot name a worker: refused, never let through.
    assert api.post("/v1/transfers/records", content=b"{", headers=ctx_w).status_code in (403, 400)


def test_auth_off_by_default(client: TestClient) -> None:
    assert client.get("/v1/instances").status_code == 200
    assert client.get("/").status_code == 200


def test_no_secret_in_logs_or_responses(
    api: TestClient, db_url: str, tokens: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    secret = tokens["ctx"]
    digest = hashlib.sha256(secret.encode()).hexdigest()
    bodies: list[str] = []
    headers_seen: list[str] = []
    own = bearer(secret)
    attempts = [
        ("PUT", "/v1/instances/gen", {"json": instance_body(role="context", tp=1)}, own),
        ("PUT", "/v1/instances/ctx", {"json": {"role": "context"}}, own),
        ("PUT", "/v1/instances/ctx", {"content": b"{not json"}, own),
        ("GET", "/v1/instances", {}, own),
        ("GET", "/v1/instances/ctx", {}, own),
        ("GET", "/metrics", {}, own),
        ("POST", "/v1/transfers", {"json": TRANSFER}, own),
        ("GET", "/v1/instances", {}, bearer(secret + "x")),
        ("GET", "/v1/instances", {}, bearer(secret[:-1])),
        ("GET", "/v1/instances", {}, {"Authorization": secret}),
        ("GET", "/", {}, own),
        ("GET", "/ui/instances", {}, {"Cookie": f"{SESSION_COOKIE}={secret}"}),
    ]
    for method, path, kwargs, headers in attempts:
        response = api.request(method, path, headers=headers, follow_redirects=False, **kwargs)
        assert response.status_code >= 300, (method, path)
        bodies.append(response.text)
        headers_seen.append(repr(response.headers))
    login = form_post(api, "/ui/login", {"token": secret, "next": "/"})
    assert login.status_code == 403
    bodies.append(login.text)
    headers_seen.append(repr(login.headers))
    logs = caplog.text + "\n".join(repr(record.__dict__) for record in caplog.records)
    for haystack in (logs, *bodies, *headers_seen):
        assert secret not in haystack
        assert secret[4:20] not in haystack
        assert digest not in haystack


def test_dashboard_needs_an_operator_session(
    api: TestClient, db_url: str, tokens: dict[str, str]
) -> None:
    page = api.get("/ui/instances?page=1", follow_redirects=False)
    assert page.status_code == 303
    assert page.headers["location"] == "/ui/login?next=%2Fui%2Finstances%3Fpage%3D1"
    form = api.get("/ui/login")
    assert form.status_code == 200 and 'name="token"' in form.text
    # Wrong tokens: the form again, no cookie.
    for secret, status in (("kvp_nope", 401), (tokens["ctx"], 403)):
        refused = form_post(api, "/ui/login", {"token": secret})
        assert refused.status_code == status
        assert SESSION_COOKIE not in refused.cookies
    token_id, secret = make_token(db_url, "operator")
    login = form_post(api, "/ui/login", {"token": secret, "next": "//evil.example/x"})
    assert login.status_code == 303
    assert login.headers["location"] == "/"  # no open redirect
    cookie_header = login.headers["set-cookie"]
    assert "HttpOnly" in cookie_header and "SameSite=strict" in cookie_header.replace(
        "SameSite=Strict", "SameSite=strict"
    )
    assert secret not in cookie_header
    assert api.get("/ui/instances").status_code == 200
    # Dashboard actions need the session too (and a confirmation).
    register_fleet(api, tokens)
    anonymous = TestClient(api.app)
    refused = form_post(anonymous, "/ui/instances/ctx/deregister", {"confirm": "yes"})
    assert refused.status_code == 303 and refused.headers["location"].startswith("/ui/login")
    assert api.get("/v1/instances/ctx", headers=bearer(tokens["operator"])).status_code == 200
    done = form_post(api, "/ui/instances/ctx/deregister", {"confirm": "yes"})
    assert done.status_code == 303
    problem(
        api.get("/v1/instances/ctx", headers=bearer(tokens["operator"])), 404, "instance_not_found"
    )
    # A tampered cookie is no session; revoking the token ends the session.
    session_id = api.cookies[SESSION_COOKIE].split(".")[0]
    api.cookies.set(SESSION_COOKIE, api.cookies[SESSION_COOKIE].replace(session_id, "0" * 32))
    assert api.get("/ui/instances", follow_redirects=False).status_code == 303
    api.cookies.clear()
    assert form_post(api, "/ui/login", {"token": secret}).status_code == 303
    assert api.get("/ui/workers").status_code == 200
    db = Database(db_url)
    with db.write() as session:
        revoke_token(session=session, token_id=token_id)
    db.dispose()
    assert api.get("/ui/workers", follow_redirects=False).status_code == 303
    # Logging out clears the cookie.
    logout = form_post(api, "/ui/logout")
    assert logout.status_code == 303 and logout.headers["location"] == "/ui/login"


def test_session_from_another_process_key_is_refused(
    make_app: Callable[..., FastAPI], db_url: str
) -> None:
    _, secret = make_token(db_url, "operator")
    with TestClient(make_app(auth=True, session_secret="one")) as first:
        assert form_post(first, "/ui/login", {"token": secret}).status_code == 303
        cookie = first.cookies[SESSION_COOKIE]
    with TestClient(make_app(auth=True, session_secret="one")) as same_key:
        same_key.cookies.set(SESSION_COOKIE, cookie)
        assert same_key.get("/ui/workers").status_code == 200
    with TestClient(make_app(auth=True)) as random_key:
        random_key.cookies.set(SESSION_COOKIE, cookie)
        assert random_key.get("/ui/workers", follow_redirects=False).status_code == 303


def test_idempotency_keys_are_scoped_to_the_caller(api: TestClient, tokens: dict[str, str]) -> None:
    """Another principal's ``Idempotency-Key`` neither collides nor reveals a transfer id."""
    register_fleet(api, tokens)
    key = {"Idempotency-Key": "req-1"}
    planned = {**TRANSFER, "execute": False}
    first = api.post("/v1/transfers", json=planned, headers={**bearer(tokens["gen"]), **key})
    assert first.status_code == 201, first.text
    # Another engine takes the same key for another request: its own transfer, no 409.
    other_body = {**planned, "request_id": "r2"}
    other = api.post("/v1/transfers", json=other_body, headers={**bearer(tokens["ctx"]), **key})
    assert other.status_code == 201, other.text
    assert first.json()["id"] not in other.text
    assert other.json()["id"] != first.json()["id"]
    # ... and taking a key first does not block the other principal's own request.
    third_key = {"Idempotency-Key": "req-3"}
    squat = api.post(
        "/v1/transfers", json=other_body, headers={**bearer(tokens["ctx"]), **third_key}
    )
    assert squat.status_code == 201, squat.text
    own = api.post("/v1/transfers", json=planned, headers={**bearer(tokens["gen"]), **third_key})
    assert own.status_code == 201, own.text
    # Within one principal the key keeps its meaning: replay → 200, another body → 409.
    replay = api.post("/v1/transfers", json=planned, headers={**bearer(tokens["gen"]), **key})
    assert replay.status_code == 200 and replay.json()["id"] == first.json()["id"]
    reused = api.post("/v1/transfers", json=other_body, headers={**bearer(tokens["gen"]), **key})
    problem(reused, 409, "idempotency_key_reused")
    assert reused.json()["transfer_id"] == first.json()["id"]


@pytest.mark.parametrize(
    "content", [b"{", b"\xff\xfe", b"[" * 1000 + b"]" * 1000], ids=["truncated", "utf8", "deep"]
)
def test_authentication_comes_before_parsing_the_body(api: TestClient, content: bytes) -> None:
    """An anonymous malformed body is 401, not 400: the server authenticates before it reads a
    body, so an anonymous caller gets nothing parsed."""
    for method, path in (
        ("PUT", "/v1/instances/ctx"),
        ("POST", "/v1/transfers"),
        ("POST", "/v1/pairings"),
        ("POST", "/v1/transfers/records"),
    ):
        response = api.request(
            method, path, content=content, headers={"content-type": "application/json"}
        )
        problem(response, 401, "unauthorized")
        response = api.request(
            method,
            path,
            content=content,
            headers={"content-type": "application/json", **bearer("kvp_unknown")},
        )
        problem(response, 401, "unauthorized")


def test_a_rank_bound_worker_token_acts_only_for_its_rank(
    api: TestClient, db_url: str, tokens: dict[str, str]
) -> None:
    """A worker token bound to rank 0 of ``ctx`` acts for rank 0 only (it still reads the
    instance, as any worker of it does): a leaked rank token cannot act for the other ranks."""
    bodies = register_fleet(api, tokens)
    rank0 = bearer(make_token(db_url, "worker", "ctx", rank=0)[1])
    rank1 = bearer(make_token(db_url, "worker", "ctx", rank=1)[1])
    problem(
        api.post("/v1/workers", json=peer_body(bodies["ctx"], "ctx", 1), headers=rank0),
        403,
        "forbidden",
    )
    workers = {}
    for rank, headers in ((0, rank0), (1, rank1)):
        attached = api.post(
            "/v1/workers", json=peer_body(bodies["ctx"], "ctx", rank), headers=headers
        )
        assert attached.status_code == 201, attached.text
        workers[rank] = attached.json()["id"]
    # It reads its instance's page table (all ranks) like any worker of the instance.
    assert api.get("/v1/instances/ctx", headers=rank0).status_code == 200
    # Another rank's worker: no heartbeat, directory, command stream, records or stop.
    problem(api.post(f"/v1/workers/{workers[1]}/heartbeat", headers=rank0), 403, "forbidden")
    problem(api.get(f"/v1/workers/{workers[1]}/directory", headers=rank0), 403, "forbidden")
    problem(api.get(f"/v1/workers/{workers[1]}/commands", headers=rank0), 403, "forbidden")
    problem(api.delete(f"/v1/workers/{workers[1]}", headers=rank0), 403, "forbidden")
    assert api.post(f"/v1/workers/{workers[0]}/heartbeat", headers=rank0).status_code == 200
    # Nor another rank's records.
    gen_worker = api.post(
        "/v1/workers", json=peer_body(bodies["gen"], "gen", 0), headers=bearer(tokens["gen-worker"])
    )
    assert gen_worker.status_code == 201, gen_worker.text
    executed = api.post(
        "/v1/transfers", json={**TRANSFER, "execute": True}, headers=bearer(tokens["operator"])
    )
    assert executed.status_code == 201, executed.text
    (pairing,) = api.get(f"/v1/workers/{workers[1]}/directory", headers=rank1).json()["pairings"]
    record = {
        "transfer_id": executed.json()["id"],
        "request_id": TRANSFER["request_id"],
        "pairing_id": pairing["id"],
        "context": "ctx",
        "generation": "gen",
        "context_epoch": pairing["context_epoch"],
        "generation_epoch": pairing["generation_epoch"],
        "side": "send",
        "rank": 1,
        "status": "failed",
        "error": "test",
        "bytes": 0,
        "started_at": time.time(),
        "finished_at": time.time(),
    }
    batch = {"worker_id": workers[1], "records": [record]}
    problem(api.post("/v1/transfers/records", json=batch, headers=rank0), 403, "forbidden")
    assert api.post("/v1/transfers/records", json=batch, headers=rank1).status_code == 200
    # An unbound worker token of the instance may still act for every rank (documented).
    unbound = bearer(tokens["ctx-worker"])
    for worker_id in workers.values():
        assert api.post(f"/v1/workers/{worker_id}/heartbeat", headers=unbound).status_code == 200
