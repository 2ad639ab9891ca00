"""The reload drill (bench/reload_drill.py) in the handover's order: a peer whose
connection failed while WRITEs to it were queued is reloaded only after every WRITE was released
and every notification read. Real NIXL over loopback TCP, rank a in a child process whose crash
(an exit by signal) the drill counts; after each iteration a fresh peer checks every byte rank a
writes to it. A second test makes the drill's rank segfault on purpose, so a crash is seen to
count and to leave its faulthandler output behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("nixl")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

DRILL = Path(__file__).resolve().parents[2] / "bench" / "reload_drill.py"
ITERATIONS = 10


def _drill(tmp_path: Path, *flags: str) -> dict[str, Any]:
    summary = tmp_path / "summary.json"
    run = subprocess.run(
        [sys.executable, str(DRILL), "--quiet", "--out", str(tmp_path / "logs")]
        + ["--json", str(summary), *flags],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads(summary.read_text())


def test_reloads_in_the_handovers_order_never_crash_and_the_rank_keeps_working(tmp_path):
    s = _drill(tmp_path, "--order", "safe", "--iterations", str(ITERATIONS), "--verify")
    crashes = [
        (c["i"], c["exit"], c["phase"], c.get("faulthandler", "")) for c in s["crash_details"]
    ]
    assert crashes == [], crashes
    assert s["errors"] == 0, s["error_samples"]
    assert s["completed"] == ITERATIONS
    # The sequence happened each time: the connections failed with WRITEs queued, the disconnect
    # was seen, b was loaded again (its successor answered) and carried a WRITE at once.
    assert s["undetected"] == 0
    assert s["reload_failed"] == 0
    assert s["after_reload_done"] == ITERATIONS
    assert [r["posted_at_reload"] for r in s["results"]] == [0] * ITERATIONS
    assert all(r["errors_seen"] > 0 for r in s["results"])  # queued WRITEs failed, not finished
    # After every iteration rank a still moves bytes: a fresh peer checked each one.
    assert s["verify_failures"] == []
    assert s["verified"] == ITERATIONS


def test_a_crash_of_the_rank_is_counted_with_its_traceback(tmp_path):
    s = _drill(tmp_path, "--order", "safe", "--iterations", "2", "--crash-at", "0")
    assert s["crashes"] == 1
    (crash,) = s["crash_details"]
    assert (crash["i"], crash["exit"], crash["phase"]) == (0, "signal SIGSEGV", "crash-at")
    assert "Fatal Python error: Segmentation fault" in crash["faulthandler"]
    assert "Caught signal 11" in crash["faulthandler"]  # UCX's own handler ran after it
    assert [r["i"] for r in s["results"]] == [1]  # a new rank process ran the rest
