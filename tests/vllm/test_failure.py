"""The prefill vLLM engine dies in the middle of a handover.

The prefill engine holds every send for a minute (``KVPLANE_WORKER_HOLD_S``, the workers' fault
injection), so the decode engine's load is certainly in flight when the prefill's whole process
group is killed. The decode engine (``kv_load_failure_policy="recompute"``) must then recompute
the prompts itself and answer what one engine answers, leak no block, and take the next
requests from a prefill engine restarted under the same name (a new epoch) without a restart of
its own.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from workers.testing.engine import ControlPlane
from workers.testing.vllm_bed import Engine, handover, prompts, write_model

from .conftest import require_vllm

pytestmark = pytest.mark.slow

LOAD_TIMEOUT_S = 8.0  # the decode's receive fails after this


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    require_vllm()
    workdir = tmp_path_factory.mktemp("vllm-failure")
    model = write_model(workdir)
    plane = ControlPlane(workdir)
    plane.start()
    engines: list[Engine] = []

    def prefill(hold_s: float, name: str) -> Engine:
        engine = Engine(
            workdir,
            model,
            "prefill",
            "0",
            instance="vllm-prefill",
            control_plane=plane.url,
            env={"KVPLANE_WORKER_HOLD_S": str(hold_s)},
            log_name=name,
        )
        engines.append(engine)
        return engine

    try:
        stalling = prefill(60.0, "prefill-stalling")
        decode = Engine(
            workdir,
            model,
            "decode",
            "1",
            instance="vllm-decode",
            control_plane=plane.url,
            failure_policy="recompute",
            extra={"timeout_s": LOAD_TIMEOUT_S},
        )
        engines.append(decode)
        assert stalling.read() == {"ready": True} and decode.read() == {"ready": True}
        yield {"plane": plane, "prefill": stalling, "decode": decode, "restart": prefill}
    finally:
        for engine in engines:
            engine.stop()
        plane.stop()


def _epoch(url: str) -> str:
    return str(httpx.get(f"{url}/v1/instances/vllm-prefill", timeout=10).json()["epoch"])


def _transfers(url: str, status: str, count: int) -> list[dict[str, Any]]:
    """The control plane's transfers in ``status`` (the records follow about a second behind)."""
    deadline = time.monotonic() + 20
    while True:
        listed = httpx.get(
            f"{url}/v1/transfers", params={"status": status, "limit": 100}, timeout=10
        ).json()["items"]
        if len(listed) >= count or time.monotonic() > deadline:
            return listed
        time.sleep(0.5)


def test_a_prefill_killed_mid_handover_is_recomputed_and_replaced(bed: dict[str, Any]) -> None:
    url, decode = bed["plane"].url, bed["decode"]
    batch = prompts(11, (70, 150))
    alone = bed["prefill"].generate(batch, 12)["tokens"]
    pre = bed["prefill"].generate(batch, 1, [{"do_remote_decode": True}] * len(batch))
    epoch = _epoch(url)

    # The decode engine asks for the KV; the prefill's ranks hold the sends, then die.
    decode.send(op="generate", prompts=batch, max_tokens=12, params=pre["params"])
    time.sleep(3.0)
    bed["prefill"].stop()
    started = time.monotonic()
    answer = decode.read()
    # The loads failed and vLLM recomputed the prompts: the tokens are one engine's.
    assert answer["tokens"] == alone
    assert time.monotonic() - started < LOAD_TIMEOUT_S + 20
    assert "loading" in decode.log() and "failed" in decode.log(), decode.log()[-3000:]
    # The control plane's record says which transfers failed, and why.
    failed = _transfers(url, "failed", len(batch))
    assert len(failed) == len(batch), failed
    assert all("vllm-prefill" in t["error"] for t in failed), failed
    # No block is left held on the decode engine.
    assert decode.call(op="idle", timeout_s=10) == {"idle": True}

    # The same instance comes back (a new process: a new epoch) and serves the running decode
    # engine, which was not restarted.
    restarted = bed["restart"](0.0, "prefill-restarted")
    assert restarted.read() == {"ready": True}
    assert _epoch(url) != epoch
    following = prompts(12, (45, 129, 96))
    alone = restarted.generate(following, 12)["tokens"]
    assert handover(restarted, decode, following, following, 12) == alone
    done = _transfers(url, "done", len(following))
    assert len(done) == len(following), done
    assert restarted.call(op="idle", timeout_s=30) == {"idle": True}
    assert decode.call(op="idle", timeout_s=10) == {"idle": True}
