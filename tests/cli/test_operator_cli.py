"""Operator commands (`kvplane instances|pairings|plan|transfers|workers`) against a live server."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from typer.testing import CliRunner

from api.app import create_app
from api.demo_fleet import fake_peer
from api.settings import Settings
from cli.main import cli
from geometry.builders import ViewSpec, instance_body

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
            workers = {}
            for name, body in (("ctx", ctx), ("gen", gen)):
                for rank_body in body["ranks"]:
                    attached = api.post(
                        "/v1/workers",
                        json={
                            "instance": name,
                            "rank": rank_body["rank"],
                            "peer": fake_peer(rank_body, f"{name}.r{rank_body['rank']}"),
                            "pid": 19451 + rank_body["rank"],
                        },
                    )
                    attached.raise_for_status()
                    workers[(name, rank_body["rank"])] = attached.json()["id"]
            transfer = api.post(
                "/v1/transfers",
                json={
                    "context": "ctx",
                    "generation": "gen",
                    "request_id": "req-7",
                    "execute": True,
                    "blocks": {"0": {"context": [0, 1, 2], "generation": [5, 6, 7]}},
                },
            )
            transfer.raise_for_status()
            # The context workers record their parts (as real workers do); the receiver has not.
            (pairing,) = api.get(f"/v1/workers/{workers[('ctx', 0)]}/directory").json()["pairings"]
            for rank in (0, 1):
                api.post(
                    "/v1/transfers/records",
                    json={
                        "worker_id": workers[("ctx", rank)],
                        "records": [
                            {
                                "transfer_id": transfer.json()["id"],
                                "request_id": "req-7",
                                "pairing_id": pairing["id"],
                                "context": "ctx",
                                "generation": "gen",
                                "context_epoch": pairing["context_epoch"],
                                "generation_epoch": pairing["generation_epoch"],
                                "side": "send",
                                "rank": rank,
                                "status": "done",
                                "bytes": 64,
                                "started_at": time.time(),
                                "finished_at": time.time() + 0.001,
                            }
                        ],
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


#: Every command that talks to a control plane, with arguments that would otherwise work.
REMOTE_COMMANDS = [
    ["instances", "list"],
    ["instances", "show", "ctx"],
    ["pairings", "list"],
    ["pairings", "check", "ctx", "gen"],
    ["plan", "show", "ctx", "gen", "--receiver-rank", "0"],
    ["transfers", "list"],
    ["transfers", "show", "t-1"],
    ["workers", "list"],
    ["worker", "--instance", "ctx", "--rank", "0"],
]


def _kvplane_process(args: list[str], url: str | None) -> subprocess.CompletedProcess[str]:
    """``kvplane ARGS`` as a real process (what an operator's shell runs), KVPLANE_URL set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPLANE_")}
    if url is not None:
        env["KVPLANE_URL"] = url
    return subprocess.run(
        [sys.executable, "-m", "cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize("args", REMOTE_COMMANDS, ids=lambda a: " ".join(a[:2]))
def test_unreachable_control_plane_is_one_line_naming_the_url(args: list[str]) -> None:
    # KVPLANE_URL, not --control-plane: every command reads the same variable.
    url = f"http://127.0.0.1:{_free_port()}"
    result = _kvplane_process(args, url)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        f"error: cannot reach the control plane at {url} ([Errno 111] Connection refused); "
        "check --control-plane or KVPLANE_URL"
    ]


@pytest.mark.parametrize("args", REMOTE_COMMANDS, ids=lambda a: " ".join(a[:2]))
def test_remote_commands_show_their_env_vars_in_help(args: list[str]) -> None:
    command = args[:2] if args[0] != "worker" else args[:1]
    result = runner.invoke(cli, [*command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "[env var: KVPLANE_URL]" in result.output
    assert "[env var: KVPLANE_TOKEN]" in result.output


def _all_commands(group: Any, prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    yield prefix
    for name, command in getattr(group, "commands", {}).items():
        yield from _all_commands(command, (*prefix, name))


def test_help_texts_read_as_plain_text() -> None:
    import typer.main

    commands = list(_all_commands(typer.main.get_command(cli)))
    assert ("worker",) in commands and ("tokens", "create") in commands
    for command in commands:
        result = runner.invoke(cli, [*command, "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0, (command, result.output)
        assert "``" not in result.output, (command, result.output)
        assert ":class:" not in result.output, command


def test_serve_reads_host_and_port_variables() -> None:
    result = runner.invoke(cli, ["serve", "--help"], env={"COLUMNS": "200"})
    assert "[env var: KVPLANE_HOST]" in result.output
    assert "[env var: KVPLANE_PORT]" in result.output


def test_pairings_list(server: str) -> None:
    result = kvplane(server, "pairings", "list")
    assert result.exit_code == 0, result.output
    header, *rows = result.stdout.splitlines()
    assert header.split() == [
        "ID",
        "CONTEXT",
        "GENERATION",
        "STATUS",
        "ERRORS",
        "WARNINGS",
        "VALIDATED",
    ]
    assert [row.split()[1:6] for row in rows] == [["ctx", "gen", "compatible", "0", "0"]]
    listed = json.loads(kvplane(server, "pairings", "list", "--json").stdout)
    assert listed["total"] == 1 and listed["items"][0]["context"] == "ctx"
    empty = kvplane(server, "pairings", "list", "--instance", "gen-bad")
    assert empty.stdout == "no pairings with instance=gen-bad\n"


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


def test_out_of_range_ranks_are_errors_naming_the_range(server: str) -> None:
    # gen is TP1: rank 1 does not exist, which is not the same as "nothing is sent to it".
    result = kvplane(server, "plan", "show", "ctx", "gen", "--receiver-rank", "1")
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert result.stderr.strip() == "error: --receiver-rank 1 is out of range: gen has only rank 0"
    # ctx is TP2: a worker for its rank 5 is refused before it allocates anything.
    worker = _kvplane_process(["worker", "--instance", "ctx", "--rank", "5"], server)
    assert worker.returncode == 2, worker.stderr
    assert worker.stderr.strip() == (
        "error: --rank 5 is out of range: ctx has ranks 0-1 (tp=2 pp=1 cp=1)"
    )
    # A dp rank out of range is refused by the server, with its code.
    dp = kvplane(
        server, "plan", "show", "ctx", "gen", "--receiver-rank", "0", "--context-dp-rank", "3"
    )
    assert dp.exit_code == 2 and "dp_rank_out_of_range" in dp.stderr
    # A misspelt instance filter is an error, not an empty list.
    nobody = kvplane(server, "workers", "list", "--instance", "nope")
    assert nobody.exit_code == 2 and nobody.stderr.startswith("error: instance_not_found")


def test_worker_for_an_unknown_instance_is_one_line(server: str) -> None:
    result = _kvplane_process(["worker", "--instance", "nope", "--rank", "0"], server)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "error: instance_not_found: instance 'nope' is not registered"
    ]


def test_transfers_list_and_show(server: str) -> None:
    result = kvplane(server, "transfers", "list")
    assert result.exit_code == 0, result.output
    header, row = result.stdout.splitlines()
    fields = dict(zip(header.split(), row.split(), strict=False))
    assert (fields["STATUS"], fields["CONTEXT"], fields["REQUEST"]) == ("running", "ctx", "req-7")
    assert kvplane(server, "transfers", "list", "--status", "done").stdout == (
        "no transfers with status=done\n"
    )
    page = json.loads(kvplane(server, "transfers", "list", "--json").stdout)
    transfer_id = page["items"][0]["id"]

    shown = kvplane(server, "transfers", "show", transfer_id)
    assert shown.exit_code == 0, shown.output
    assert shown.stdout.startswith(f"transfer {transfer_id}: running, ctx -> gen")
    part_lines = shown.stdout.split("\n\n")[1].splitlines()
    assert part_lines[0].split()[:2] == ["PART", "SIDE"]
    assert sorted(line.split()[1] for line in part_lines[1:]) == ["send", "send"]
    data = json.loads(kvplane(server, "transfers", "show", transfer_id, "--json").stdout)
    assert data["request_id"] == "req-7" and len(data["parts"]) == 2


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
    # PIDs are identifiers: no thousands separators.
    assert sorted(r[6] for r in rows) == ["19451", "19451", "19452"]


def test_an_empty_list_says_so(server: str) -> None:
    result = kvplane(server, "workers", "list", "--instance", "gen-bad")
    assert result.exit_code == 0, result.output
    assert result.stdout == "no workers with instance=gen-bad\n"
