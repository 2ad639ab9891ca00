"""The PostgreSQL tier is skipped loudly without a server, and fails instead under CI=true."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
UNREACHABLE = "postgresql+psycopg://postgres@127.0.0.1:1/none"


def _run_postgres_tier(ci: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KVPLANE_TEST_POSTGRES_URL": UNREACHABLE, "CI": ci}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-m",
            "postgres",
            "-p",
            "no:cacheprovider",
            "tests/migrations/test_migrations.py",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_without_server_the_tier_is_skipped_loudly() -> None:
    result = _run_postgres_tier(ci="")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PostgreSQL tier SKIPPED" in result.stdout
    assert "skipped" in result.stdout


def test_without_server_ci_fails() -> None:
    result = _run_postgres_tier(ci="true")
    assert result.returncode != 0
    assert "CI=true requires PostgreSQL" in result.stdout
