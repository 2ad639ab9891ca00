"""The README's five-minute walkthrough, run command for command against a live server.

The shell blocks between the ``walkthrough:begin`` and ``walkthrough:end`` marks are joined
into one script and run by bash from the repository root, as a reader would paste them, with
``set -e``: a command that fails, or a body in ``examples/`` the API refuses, fails this test.
Only two things differ from a reader's terminal: ``KVPLANE_URL`` points at this test's server,
and ``.venv/bin/`` is the environment running the tests.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.cli.test_operator_cli import _free_port

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DEFAULT_URL_LINE = "export KVPLANE_URL=http://127.0.0.1:8000"


def walkthrough_script() -> str:
    text = README.read_text()
    section = text.split("<!-- walkthrough:begin", 1)[1].split("<!-- walkthrough:end", 1)[0]
    blocks = re.findall(r"```sh\n(.*?)```", section, flags=re.S)
    assert blocks, "no sh block between the walkthrough marks"
    return "\n".join(blocks)


@pytest.fixture
def served(sqlite_url: str) -> Iterator[str]:
    """``kvplane serve`` as its own process, as the walkthrough starts it."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPLANE_")}
    env["KVPLANE_DATABASE_URL"] = sqlite_url
    process = subprocess.Popen(
        [sys.executable, "-m", "cli", "serve", "--port", str(port)],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):  # up to a minute on a loaded machine
            if process.poll() is not None:
                raise RuntimeError(f"kvplane serve exited with {process.returncode}")
            try:
                if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        else:
            raise RuntimeError("kvplane serve did not become ready")
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_the_readme_walkthrough_runs(served: str) -> None:
    assert shutil.which("curl"), "the walkthrough needs curl"
    script = walkthrough_script()
    assert script.count(DEFAULT_URL_LINE) == 1, "the walkthrough sets KVPLANE_URL once"
    script = script.replace(DEFAULT_URL_LINE, "")
    script = script.replace(".venv/bin/", str(Path(sys.executable).parent) + "/")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPLANE_")}
    env["KVPLANE_URL"] = served
    result = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    # Each step shows what the README says it shows.
    assert out.splitlines()[:2] == ["201", "201"]
    assert re.search(r"^ctx-a\s+context\s+ready", out, flags=re.M)
    assert "compatible: True" in result.stderr
    assert "context rank 3 -> generation rank 1: " in out
    assert "receiver rank 0: 2 writer(s)" in out
    assert re.search(r"^[0-9a-f]{32} planned \d+ bytes in \d+ fragments$", out, flags=re.M)
    assert "head_count_mismatch" in out
    assert out.rstrip().endswith("exit code 1: incompatible")
