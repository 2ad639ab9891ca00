"""Operator commands (`kvplane instances|pairings|plan|transfers|workers`) against a live server."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from typer.testing import CliRunner

from api.app import create_app
from api.cli import cli
from api.demo import fake_peer
from api.geometry.builders import ViewSpec, instance_body
from api.settings import Settings

runner = CliRunner()
VIEWS = [ViewSpec("target", layers=2, kv_heads=4, head_dim=8)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def server(sqlite_url: str) -> Iterator[str]:
    """uvicorn in a thread on a free port, a fresh migrated SQLite database, a small fleet:
    ctx (TP2, 4 heads), gen (TP1), paired; gen-bad (other head_dim); a worker per rank of ctx
    and gen; one executed transfer."""
    port = _free_port()
    config = uvicorn.Config(
        create_app(Settings(database_url=sqlite_url)),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        ws="none",
        lifespan="on",
    )
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, name="cli-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=url, timeout=30) as api:
            ctx = instance_body(role="context", views=VIEWS, tp=2, tokens_per_block=4)
            gen = instance_body(role="generation", views=VIEWS, tp=1, tokens_per_block=4)
            bad = instance_body(
                role="generation",
                tp=1,
                tokens_per_block=4,
                views=[ViewSpec("target", layers=2, kv_heads=4, head_dim=16)],
            )
            for name, body in (("ctx", ctx), ("gen", gen), ("gen-bad", bad)):
                api.put(f"/v1/instances/{name}", json=body).raise_for_status()
            api.post("/v1/pairings", json={"context": "ctx", "generation": "gen"})
            for name, body in (("ctx", ctx), ("gen", gen)):
                for rank_body in body["ranks"]:
                    api.post(
                        "/v1/workers",
                        json={
                            "instance": name,
                            "rank": rank_body["rank"],
                            "peer": fake_peer(rank_body, f"{name}.r{rank_body['rank']}"),
                        },
                    ).raise_for_status()
            api.post(
                "/v1/transfers",
                json={
                    "context": "ctx",
                    "generation": "gen",
                    "request_id": "req-7",
                    "execute": True,
                    "blocks": {"0": {"context": [0, 1, 2], "generation": [5, 6, 7]}},
                },
            ).raise_for_status()
        yield url
    finally:
        uv.should_exit = True
        thread.join(timeout=10)


def kvplane(url: str, *args: str) -> Any:
    return runner.invoke(cli, list(args), env={"KVPLANE_URL": url})


def test_instances_list_and_show(server: str) -> None:
    result = kvplane(server, "instances", "list")
    assert result.exit_code == 0, result.output
    header, *rows = result.stdout.splitlines()
    assert header.split()[:3] == ["NAME", "ROLE", "STATUS"]
    assert [row.split()[:3] for row in rows] == [
        ["ctx", "context", "ready"],
        ["gen", "generation", "ready"],
        ["gen-bad", "generation", "ready"],
    ]
    # columns are aligned: every row starts its ROLE column where the header does
    assert {row.index(row.split()[1]) for row in rows} == {header.index("ROLE")}

    listed = json.loads(kvplane(server, "instances", "list", "--json").stdout)
    assert listed["total"] == 3

    result = kvplane(server, "instances", "show", "ctx")
    assert result.exit_code == 0, result.output
    assert "tp=2" in result.stdout
    view_rows = [line.split() for line in result.stdout.splitlines()[2:]]
    # rank, pool, ..., kv heads 2 of 4 per rank, layers 0-1
    assert [(r[0], r[8], r[9], r[-1]) for r in view_rows] == [
        ("0", "2", "4", "0-1"),
        ("1", "2", "4", "0-1"),
    ]
    assert json.loads(kvplane(server, "instances", "show", "ctx", "--json").stdout)["tp"] == 2


def test_api_errors_print_code_and_detail_and_exit_2(server: str) -> None:
    result = kvplane(server, "instances", "show", "nope")
    assert result.exit_code == 2
    assert result.stderr.startswith("error: instance_not_found: ")
    assert result.stdout == ""


def test_unreachable_control_plane_exits_2() -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    result = runner.invoke(cli, ["workers", "list", "--control-plane", url])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: unreachable: ")


def test_pairings_check_exit_codes(server: str) -> None:
    ok = kvplane(server, "pairings", "check", "ctx", "gen")
    assert ok.exit_code == 0, ok.output
    assert ok.stdout.startswith("ctx -> gen: compatible")
    bad = kvplane(server, "pairings", "check", "ctx", "gen-bad")
    assert bad.exit_code == 1, bad.output
    assert "INCOMPATIBLE" in bad.stdout
    assert "head_geometry_mismatch" in bad.stdout or "mismatch" in bad.stdout
    report = json.loads(kvplane(server, "pairings", "check", "ctx", "gen-bad", "--json").stdout)
    assert report["compatible"] is False and report["errors"]


def test_plan_show_names_the_sender_of_each_head_range(server: str) -> None:
    result = kvplane(server, "plan", "show", "ctx", "gen", "--receiver-rank", "0")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert "2 writer(s)" in lines[0]
    header = lines[1].split()
    rows = [dict(zip(header, line.split(), strict=True)) for line in lines[2:]]
    # gen rank 0 holds all 4 heads; ctx rank 0 fills heads [0,2), ctx rank 1 heads [2,4)
    assert [(r["SENDER"], r["RECV_HEADS"], r["SENDER_HEADS"]) for r in rows] == [
        ("0", "[0,2)", "[0,2)"),
        ("1", "[2,4)", "[0,2)"),
    ]
    data = json.loads(
        kvplane(server, "plan", "show", "ctx", "gen", "--receiver-rank", "0", "--json").stdout
    )
    assert [s["sender_rank"] for s in data["slices"]] == [0, 1]
    missing = kvplane(server, "plan", "show", "gen-bad", "gen", "--receiver-rank", "0")
    assert missing.exit_code == 2 and "pairing_not_found" in missing.stderr


def test_transfers_list_and_show(server: str) -> None:
    result = kvplane(server, "transfers", "list")
    assert result.exit_code == 0, result.output
    header, row = result.stdout.splitlines()
    fields = dict(zip(header.split(), row.split(), strict=False))
    assert (fields["STATUS"], fields["CONTEXT"], fields["REQUEST"]) == ("queued", "ctx", "req-7")
    assert kvplane(server, "transfers", "list", "--status", "done").stdout.splitlines()[1:] == []
    page = json.loads(kvplane(server, "transfers", "list", "--json").stdout)
    transfer_id = page["items"][0]["id"]

    shown = kvplane(server, "transfers", "show", transfer_id)
    assert shown.exit_code == 0, shown.output
    assert shown.stdout.startswith(f"transfer {transfer_id}: queued, ctx -> gen")
    job_lines = shown.stdout.split("\n\n")[1].splitlines()
    assert job_lines[0].split()[:2] == ["JOB", "KIND"]
    assert sorted(line.split()[1] for line in job_lines[1:]) == ["receive", "send", "send"]
    data = json.loads(kvplane(server, "transfers", "show", transfer_id, "--json").stdout)
    assert data["request_id"] == "req-7" and len(data["jobs"]) == 3


def test_workers_list(server: str) -> None:
    result = kvplane(server, "workers", "list")
    assert result.exit_code == 0, result.output
    rows = [line.split() for line in result.stdout.splitlines()[1:]]
    assert sorted((r[1], r[2], r[3]) for r in rows) == [
        ("ctx", "0", "alive"),
        ("ctx", "1", "alive"),
        ("gen", "0", "alive"),
    ]
    data = json.loads(kvplane(server, "workers", "list", "--json", "--instance", "gen").stdout)
    assert [w["rank"] for w in data["items"]] == [0]
