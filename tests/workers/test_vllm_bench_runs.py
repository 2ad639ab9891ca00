"""``bench/vllm_handover.py --save`` / ``--summarize``: a comparison split over several
invocations (its full run takes 10-13 h) gives the same tables as one invocation would."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "vllm_handover.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("vllm_handover_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _sample(bench: ModuleType, ttft_ms: float, alone_ms: float) -> object:
    return bench.Sample(
        ttft_s=[ttft_ms / 1000] * 3,
        alone_s=[alone_ms / 1000] * 3,
        first_s=1.5,
        first_contact=True,
        equal=4,
        requests=4,
    )


def test_pieces_of_runs_saved_apart_summarize_as_one(
    bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cell = bench.Cell(1, 128, 1)
    saved = tmp_path / "runs.jsonl"
    # Run 1 in one invocation, run 2 in another (``--first-run 2``), a TTFT per run and
    # connector: kvplane 40 then 60 ms, Nixl 100 then 80 ms.
    for run, kvplane_ms, nixl_ms in ((1, 40.0, 100.0), (2, 60.0, 80.0)):
        args = bench.parse(
            ["--runs", "1", "--first-run", str(run), "--modes", "online", "--save", str(saved)]
        )
        results = {
            (run, "online", cell, "kvplane"): _sample(bench, kvplane_ms, 20.0),
            (run, "online", cell, "nixl"): _sample(bench, nixl_ms, 25.0),
            (run, "online", bench.Cell(1, 1000, 1), "kvplane"): bench.Sample(),  # not measured
        }
        written: set[tuple[object, ...]] = set()
        bench.save(args, results, written, f"run {run}")
        bench.save(args, results, written, f"run {run}")  # written once
    lines = saved.read_text().splitlines()
    assert len(lines) == 4
    assert {json.loads(line)["run"] for line in lines} == {1, 2}

    assert bench.main(["--summarize", str(saved)]) == 0
    out = capsys.readouterr().out
    assert "## Run 1, online" in out and "## Run 2, online" in out
    assert "- run 1\n- run 2" in out  # what each piece was measured under
    summary = out.split("## Summary")[1]
    assert "median over 2 run(s)" in summary
    row = next(line for line in summary.splitlines() if line.startswith("| 1 → 1"))
    # medians: kvplane 50 ms (40-60), Nixl 90 ms (80-100); kvplane ÷ Nixl: median of 0.4, 0.75
    assert "50.0" in row and "90.0" in row and "0.57" in row, row


def test_a_line_that_is_not_a_sample_is_named(bench: ModuleType, tmp_path: Path) -> None:
    saved = tmp_path / "runs.jsonl"
    saved.write_text('{"run": 1, "mode": "online"}\n')
    with pytest.raises(SystemExit, match="runs.jsonl:1: not a saved sample"):
        bench.main(["--summarize", str(saved)])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(SystemExit, match="no saved samples"):
        bench.main(["--summarize", str(empty)])
    with pytest.raises(SystemExit, match="missing.jsonl: cannot read"):
        bench.main(["--summarize", str(tmp_path / "missing.jsonl")])
