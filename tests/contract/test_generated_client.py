"""A Python client generated from the live spec runs the whole flow, typed, ``mypy --strict`` clean.

``openapi-python-client`` (the ``dev`` extra) generates ``kvplane_client`` from a running server's
``/openapi.json``; ``generated_client_flow.py`` (beside this file) must pass ``mypy --strict``
against it and then run register → pair → plan → transfer → fragments through it. Without the
generator the test is skipped loudly, and fails under ``CI=true``.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn

from api.app import create_app
from api.errors import STATUS_TITLES
from api.settings import Settings

HERE = Path(__file__).parent
FLOW = HERE / "generated_client_flow.py"
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
GENERATOR_CONFIG = """\
project_name_override: kvplane-client
package_name_override: kvplane_client
post_hooks: []
"""


def _tool(name: str) -> Path:
    path = Path(sys.executable).parent / name
    found = path if path.exists() else shutil.which(name)
    if found is None:
        reason = f"{name} is not installed (pip install -e '.[dev]')"
        if IN_CI:
            pytest.fail(f"CI=true: {reason}")
        pytest.skip(f"GENERATED CLIENT CHECK SKIPPED: {reason}")
    return Path(found)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def live_url(sqlite_url: str) -> Iterator[str]:
    port = _free_port()
    config = uvicorn.Config(
        create_app(Settings(database_url=sqlite_url)),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        ws="none",
        lifespan="on",
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="generated-client-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=30)


def _run(args: list[str], *, cwd: Path, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        args, cwd=cwd, env=env, capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, f"{' '.join(args)}:\n{done.stdout[-4000:]}{done.stderr[-4000:]}"
    return done.stdout


def test_generated_python_client_runs_the_flow_typed(live_url: str, tmp_path: Path) -> None:
    generator = _tool("openapi-python-client")
    spec = tmp_path / "openapi.json"
    spec.write_text(httpx.get(f"{live_url}/openapi.json", timeout=30).text)
    config = tmp_path / "generator.yaml"
    config.write_text(GENERATOR_CONFIG)
    packages = tmp_path / "packages"
    packages.mkdir()
    _run(
        [
            str(generator),
            "generate",
            "--path",
            str(spec),
            "--meta",
            "none",
            "--output-path",
            str(packages / "kvplane_client"),
            "--config",
            str(config),
        ],
        cwd=tmp_path,
    )
    script = tmp_path / FLOW.name
    shutil.copyfile(FLOW, script)
    env = {**os.environ, "MYPYPATH": str(packages), "PYTHONPATH": str(packages)}

    # Types first: the flow uses typed block lists and plan fields, never additional_properties.
    untyped = [
        node.attr
        for node in ast.walk(ast.parse(script.read_text()))
        if isinstance(node, ast.Attribute)
        and node.attr in ("additional_properties", "additional_keys", "from_dict", "to_dict")
    ]
    assert not untyped, f"the flow must not need untyped access: {untyped}"
    _run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--no-incremental",
            "--cache-dir",
            str(tmp_path / ".mypy_cache"),
            script.name,
        ],
        cwd=tmp_path,
        env=env,
    )

    summary = json.loads(_run([sys.executable, script.name, live_url], cwd=tmp_path, env=env))
    # TP2 context (4 heads per rank) → TP1 generation (8 heads): two routes, one receiver
    # written by both ranks at distinct staging offsets; 16 tokens × 64 × 2 B per head.
    head_block = 16 * 64 * 2
    assert summary["routes"] == 2
    assert summary["writer_ranks"] == [0, 1]
    assert summary["staging"] == {"0": [0, 2 * 2 * 4 * head_block]}
    assert summary["global_heads"] == [[0, 4], [4, 8]]
    assert summary["plan_bytes_per_block"] == 2 * 2 * 8 * head_block  # K+V, 2 layers, 8 heads
    assert summary["layer_groups"] == [0] and summary["cp_sides"] == ["None"]
    assert summary["tokens_per_block"] == 16 and summary["pools"] == 3
    assert summary["warnings"] == []
    # the last min(4, 3) = 3 blocks move, on each route
    assert summary["transfer_blocks"] == [3, 3]
    assert (
        summary["transfer_bytes"]
        == summary["fragment_bytes"]
        == 3 * summary["plan_bytes_per_block"]
    )
    assert summary["transfer_runs"] == summary["plan_runs"]
    assert summary["missing_code"] == "instance_not_found"
    assert summary["missing_title"] == STATUS_TITLES[404]
