"""A decode server with data parallelism (``--data-parallel-size 2``, one engine core per
core) behind the proxy. Each DP rank is an engine of its own, with its own scheduler and KV
cache, so each registers its own kvplane instance (``vllm-decode-dp0``, ``vllm-decode-dp1``)
and pairs with the prefill by itself; completions equal one engine's, whichever DP rank vLLM
gives them to.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from workers.testing.engine import ControlPlane
from workers.testing.vllm_bed import (
    Side,
    complete,
    completion,
    prompts,
    recorded,
    serve_pair,
    write_model,
)

from .conftest import require_vllm

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    require_vllm()
    workdir = tmp_path_factory.mktemp("vllm-dp")
    model = write_model(workdir)
    plane = ControlPlane(workdir)
    plane.start()
    try:
        decode = Side("0|1", args=("--data-parallel-size", "2"))
        with serve_pair(workdir, model, plane.url, decode=decode) as pair:
            yield pair
    finally:
        plane.stop()


def _complete(url: str, servers: dict[str, Any], prompt: list[int]) -> list[int]:
    return complete(url, completion(servers["model"], prompt))


def test_each_dp_rank_is_an_instance_and_decodes_as_one_engine(servers: dict[str, Any]) -> None:
    plane = servers["plane"]
    listed = httpx.get(f"{plane}/v1/instances", timeout=10).json()["items"]
    decodes = sorted(i["name"] for i in listed if i["role"] == "generation")
    assert decodes == ["vllm-decode-dp0", "vllm-decode-dp1"], listed
    assert all(i["status"] == "ready" for i in listed)
    batch = prompts(61, (45, 100, 131, 64, 80, 150))
    alone = [_complete(servers["decode"], servers, p) for p in batch]
    assert [_complete(servers["proxy"], servers, p) for p in batch[:2]] == alone[:2]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda p: _complete(servers["proxy"], servers, p), batch[2:]))
    assert together == alone[2:]
    done = recorded(plane, len(batch))
    assert len(done) == len(batch), done
    assert {t["generation"] for t in done} <= set(decodes)
    pairings = httpx.get(f"{plane}/v1/pairings", timeout=10).json()["items"]
    used = {t["generation"] for t in done}
    assert {(p["context"], p["generation"]) for p in pairings if p["status"] == "compatible"} >= {
        ("vllm-prefill", name) for name in used
    }
