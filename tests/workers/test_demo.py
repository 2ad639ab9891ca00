"""``kvplane demo``, the main job (the first half of ``make run``), run as a user runs it: a real
control plane, six real rank processes, NIXL on loopback. It must exit 0 only when every checked
byte is right, and its tables must say what happened."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("nixl")
pytest.importorskip("torch")
from cli.demo import BURST_REQUESTS, BURST_ROUNDS  # noqa: E402
from workers.testing.engine import free_port  # noqa: E402 (after the importorskips)

ROOT = Path(__file__).resolve().parents[2]
KVPLANE = Path(sys.executable).with_name("kvplane")


def test_the_demo_moves_and_checks_every_byte_and_records_every_transfer(tmp_path: Path) -> None:
    database = tmp_path / "demo.db"
    run = subprocess.run(
        [str(KVPLANE), "demo", "--database", str(database), "--port", str(free_port())],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    out = run.stdout
    assert run.returncode == 0, out[-3000:] + run.stderr[-3000:]

    big = dict(re.findall(r"^\| (staged|fragments) +\| (.+)$", out, re.M))
    assert set(big) == {"staged", "fragments"}, out
    for mode, cells in big.items():
        status, nbytes, *_, verified = (c.strip() for c in cells.strip(" |").split("|"))
        assert status == "done" and nbytes == verified and int(nbytes.replace(",", "")) > 0, (
            mode,
            cells,
        )

    burst = re.findall(
        r"^\| (raw NIXL|engine path|REST) +\| (none|every byte) +\| +(\d+) \| +"
        r"(\d+) \| +([\d.]+) \|",
        out,
        re.M,
    )
    assert {(path, checks) for path, checks, *_ in burst} == {
        ("raw NIXL", "none"),
        ("engine path", "none"),
        ("REST", "none"),
        ("engine path", "every byte"),
        ("REST", "every byte"),
    }, out
    for path, checks, done, failed, p50 in burst:
        rounds = 1 if path == "REST" else BURST_ROUNDS  # raw and the engine path: rounds
        assert (int(done), int(failed)) == (BURST_REQUESTS * rounds, 0), (path, checks)
        assert float(p50) > 0, (path, checks)

    assert re.search(r"^swept [\d,]+ untouched pool bytes .*; 0 blocks leaked$", out, re.M), out
    # 2 big transfers + the engine path's rounds and REST's requests, without and with checks
    total = 2 + 2 * BURST_REQUESTS * (BURST_ROUNDS + 1)
    assert f"record: {total} transfers in the control plane, {total} done" in out, out
    assert out.rstrip().endswith("crc32 of their routes"), out[-500:]
    logs = tmp_path / "demo-logs"  # the README names them
    assert database.is_file() and (logs / "server-1.log").is_file()
    assert sorted(p.name for p in logs.glob("demo-*.log")) == [
        *(f"demo-ctx-tp4-{r}.log" for r in range(4)),
        "demo-gen-tp2-0.log",
        "demo-gen-tp2-1.log",
    ]
