"""`kvplane tokens` on the database, and `kvplane serve` refusing to expose an open server."""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from api.app import create_app
from api.settings import Settings

runner = CliRunner()


def invoke(db_url: str, *args: str, env: dict[str, str] | None = None) -> Any:
    from cli.main import cli

    return runner.invoke(cli, list(args), env={"KVPLANE_DATABASE_URL": db_url, **(env or {})})


def test_create_list_revoke(db_url: str) -> None:
    created = invoke(
        db_url, "tokens", "create", "--scope", "admin", "--name", "bootstrap", "--json"
    )
    assert created.exit_code == 0, created.output
    admin = json.loads(created.stdout)
    assert admin["token"].startswith("kvp_") and len(admin["token"]) > 40

    plain = invoke(db_url, "tokens", "create", "--scope", "instance", "--instance", "ctx")
    assert plain.exit_code == 0, plain.output
    secret = plain.stdout.splitlines()[1]
    assert "shown only now" in plain.stderr

    listed = invoke(db_url, "tokens", "list")
    assert listed.exit_code == 0
    assert admin["id"] in listed.stdout and "bootstrap" in listed.stdout
    for leaked in (admin["token"], secret, hashlib.sha256(secret.encode()).hexdigest()):
        assert leaked not in listed.stdout

    with TestClient(create_app(Settings(database_url=db_url, auth=True))) as api:
        headers = {"Authorization": f"Bearer {admin['token']}"}
        assert api.get("/v1/instances", headers=headers).status_code == 200
        assert invoke(db_url, "tokens", "revoke", admin["id"]).exit_code == 0
        assert api.get("/v1/instances", headers=headers).status_code == 401
    rows = [
        json.loads(line) for line in invoke(db_url, "tokens", "list", "--json").stdout.splitlines()
    ]
    assert {row["id"]: row["revoked_at"] is not None for row in rows}[admin["id"]]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--scope", "root"), "scope must be one of instance, worker, operator, admin"),
        (("--scope", "instance"), "an instance token must be bound to an instance"),
        (("--scope", "worker"), "a worker token must be bound to an instance"),
        (
            ("--scope", "operator", "--instance", "ctx"),
            "an operator token is not bound to an instance",
        ),
        (("--scope", "admin", "--instance", "ctx"), "an admin token is not bound to an instance"),
        (
            ("--scope", "instance", "--instance", "ctx", "--rank", "0"),
            "only a worker token can be bound to a rank",
        ),
        (("--scope", "worker", "--rank", "0"), "a worker token must be bound to an instance"),
        (
            ("--scope", "worker", "--instance", "ctx", "--rank", "-1"),
            f"rank must be in [0, {1 << 16})",
        ),
    ],
)
def test_create_refuses_bad_scopes(sqlite_url: str, args: tuple[str, ...], message: str) -> None:
    result = invoke(sqlite_url, "tokens", "create", *args)
    assert result.exit_code == 2
    assert result.stderr == f"error: {message}\n"


def test_database_problems_are_one_line(tmp_path: Any) -> None:
    empty = f"sqlite:///{tmp_path / 'empty.db'}"
    result = invoke(empty, "tokens", "create", "--scope", "admin")
    assert result.exit_code == 2
    assert result.stderr == (
        f"error: the database at {empty} has no kvplane schema (no such table: tokens); "
        "run `kvplane migrate` first\n"
    )
    # Nothing listens on port 1: one line, the password hidden.
    unreachable = "postgresql+psycopg://kv:s3cret@127.0.0.1:1/kv"
    for args in (("migrate",), ("tokens", "list")):
        result = invoke(unreachable, *args)
        assert result.exit_code == 2, result.output
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and "s3cret" not in result.stderr, lines
        assert lines[0].startswith(
            "error: cannot use the database at postgresql+psycopg://kv:***@127.0.0.1:1/kv ("
        )
        assert lines[0].endswith("); check KVPLANE_DATABASE_URL")


def test_revoke_unknown_token(sqlite_url: str) -> None:
    result = invoke(sqlite_url, "tokens", "revoke", "nope")
    assert result.exit_code == 2 and "no token" in result.stderr


@pytest.fixture
def fake_uvicorn(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    import uvicorn

    runs: list[dict[str, Any]] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: runs.append(kwargs))
    return runs


def test_serve_refuses_public_host_without_auth(
    sqlite_url: str, fake_uvicorn: list[dict[str, Any]]
) -> None:
    result = invoke(sqlite_url, "serve", "--host", "0.0.0.0", "--no-migrate")
    assert result.exit_code == 2
    assert "KVPLANE_AUTH=true" in result.stderr and "--insecure" in result.stderr
    assert fake_uvicorn == []


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1"])
def test_serve_on_loopback_needs_no_auth(
    sqlite_url: str, fake_uvicorn: list[dict[str, Any]], host: str
) -> None:
    assert invoke(sqlite_url, "serve", "--host", host, "--no-migrate").exit_code == 0
    assert fake_uvicorn[0]["host"] == host


def test_serve_public_host_with_auth(sqlite_url: str, fake_uvicorn: list[dict[str, Any]]) -> None:
    result = invoke(
        sqlite_url, "serve", "--host", "0.0.0.0", "--no-migrate", env={"KVPLANE_AUTH": "true"}
    )
    assert result.exit_code == 0, result.output
    assert fake_uvicorn[0]["host"] == "0.0.0.0"


def test_serve_insecure_warns_at_every_start(
    sqlite_url: str, fake_uvicorn: list[dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    for _ in range(2):
        with caplog.at_level(logging.WARNING, logger="kvplane.serve"):
            result = invoke(sqlite_url, "serve", "--host", "10.1.2.3", "--insecure", "--no-migrate")
        assert result.exit_code == 0, result.output
    assert len(fake_uvicorn) == 2
    warnings = [r for r in caplog.records if r.name == "kvplane.serve"]
    assert len(warnings) == 2
    assert all("INSECURE" in r.getMessage() and "10.1.2.3" in r.getMessage() for r in warnings)


def test_a_worker_token_bound_to_a_rank(db_url: str) -> None:
    """``--rank`` binds a worker token to one rank of its instance."""
    created = invoke(
        db_url,
        "tokens",
        "create",
        "--scope",
        "worker",
        "--instance",
        "ctx",
        "--rank",
        "1",
        "--json",
    )
    assert created.exit_code == 0, created.output
    token = json.loads(created.stdout)
    assert token["rank"] == 1 and token["instance"] == "ctx"
    plain = invoke(
        db_url, "tokens", "create", "--scope", "worker", "--instance", "ctx", "--rank", "1"
    )
    assert plain.exit_code == 0 and "rank 1 of instance ctx" in plain.stdout
    rows = [
        json.loads(line) for line in invoke(db_url, "tokens", "list", "--json").stdout.splitlines()
    ]
    assert {row["id"]: row["rank"] for row in rows}[token["id"]] == 1
    assert "ctx/1" in invoke(db_url, "tokens", "list").stdout
