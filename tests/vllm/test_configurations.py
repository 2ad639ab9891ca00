"""The vLLM configurations users run, through two OpenAI servers and the proxy: prefix caching
on both sides, chunked prefill on the prefill (``--max-num-batched-tokens`` below the prompt
lengths), a decode whose KV space is small enough that it queues requests, and prompts of up to
2,000 tokens that share a prefix, eight in flight. Every completion must carry the tokens
that the decode server computes by itself for the same prompt (under a cache salt of its own,
so that neither run reuses the other's blocks). The engines run in float32: chunked prefill and
prefix hits sum attention in another order than one pass does, and in bfloat16 that alone
turns some greedy continuations after a few dozen tokens (measured), so the oracle would not be
about KV.
"""

from __future__ import annotations

import concurrent.futures
import re
import time
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

DECODE_BLOCKS = 70  # 2,240 tokens of KV: far less than eight long prompts need at once
CHUNK_TOKENS = 256  # the prefill's token budget per step: longer prompts prefill in chunks
_METRIC = r"^{name}(?:\{{[^}}]*\}})?\s+(\S+)$"


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    require_vllm()
    workdir = tmp_path_factory.mktemp("vllm-configurations")
    model = write_model(workdir)
    plane = ControlPlane(workdir)
    plane.start()
    try:
        with serve_pair(
            workdir,
            model,
            plane.url,
            prefill=Side(
                "0",
                args=("--max-num-batched-tokens", str(CHUNK_TOKENS), "--enable-chunked-prefill"),
            ),
            decode=Side(
                "1",
                extra={"kv_load_failure_policy": "recompute"},
                args=("--num-gpu-blocks-override", str(DECODE_BLOCKS)),
            ),
            prefix_caching=True,
            args=("--dtype", "float32"),
        ) as pair:
            yield pair
    finally:
        plane.stop()


def _body(servers: dict[str, Any], prompt: list[int], **more: Any) -> dict[str, Any]:
    return completion(servers["model"], prompt, **{"max_tokens": 48, **more})


def _complete(url: str, body: dict[str, Any]) -> list[int]:
    return complete(url, body, timeout_s=300.0)


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    values = re.findall(_METRIC.format(name=re.escape(name)), text, re.M)
    assert values, f"no {name} in /metrics"
    return sum(float(v) for v in values)


def _settled(url: str, within_s: float = 5.0) -> float:
    deadline = time.monotonic() + within_s
    while True:
        usage = _metric(url, "vllm:kv_cache_usage_perc")
        if usage == 0.0 or time.monotonic() > deadline:
            return usage
        time.sleep(0.2)


def test_long_prompts_sharing_a_prefix_eight_at_a_time(servers: dict[str, Any]) -> None:
    """Eight prompts of 330 to 2,000 tokens that share their first 300 (prefix-cache hits on
    both sides), all at once through the proxy: the prefill runs them in chunks of 256 tokens,
    the decode, short of KV space, queues them, and every completion equals one engine's."""
    shared = prompts(201, (300,))[0]
    tails = prompts(202, (50, 200, 700, 1100, 1400, 1700, 30, 400))
    batch = [shared + tail for tail in tails]
    alone = [
        _complete(servers["decode"], _body(servers, p, cache_salt="one-engine")) for p in batch
    ]
    assert len({tuple(t) for t in alone}) == len(batch)
    before = len(recorded(servers["plane"], 0))
    with concurrent.futures.ThreadPoolExecutor(len(batch)) as pool:
        together = list(pool.map(lambda p: _complete(servers["proxy"], _body(servers, p)), batch))
    assert together == alone
    # Every prompt was a kvplane handover.
    done = recorded(servers["plane"], before + len(batch))
    assert len(done) == before + len(batch), done
    assert _settled(servers["prefill"]) == 0.0
    assert _settled(servers["decode"]) == 0.0


def test_a_prompt_cached_on_the_decode_loads_only_its_new_blocks(
    servers: dict[str, Any],
) -> None:
    """A follow-up turn: the decode's prefix cache holds the conversation so far; the prefill
    computes the whole longer prompt; only the blocks past the decode's cache move, and the
    tokens equal one engine's."""
    first = prompts(203, (640,))[0]
    assert _complete(servers["proxy"], _body(servers, first, max_tokens=8))
    follow_up = first + prompts(204, (500,))[0]
    alone = _complete(servers["decode"], _body(servers, follow_up, cache_salt="one-engine"))
    before = httpx.get(f"{servers['plane']}/v1/transfers", params={"limit": 1}, timeout=10)
    assert _complete(servers["proxy"], _body(servers, follow_up)) == alone
    deadline = time.monotonic() + 20
    while True:
        newest = httpx.get(
            f"{servers['plane']}/v1/transfers", params={"limit": 1}, timeout=10
        ).json()["items"][0]
        if newest["id"] != before.json()["items"][0]["id"] and newest["status"] == "done":
            break
        assert time.monotonic() < deadline, newest
        time.sleep(0.3)
    block_bytes = 4 * 32 * 64 * 4 * 4  # heads x tokens x (K and V dims) x float32 x layers
    full = -(-len(follow_up) // 32) * block_bytes
    assert 0 < newest["bytes"] < full  # the cached blocks did not move again
    assert _settled(servers["prefill"]) == 0.0
    assert _settled(servers["decode"]) == 0.0
