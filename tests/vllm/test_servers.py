"""The commands of docs/integrators.md, section 3a, as a user runs them: two vLLM OpenAI servers
with ``KvplaneConnector`` and ``examples/vllm_proxy.py`` in front of them.

Completions through the proxy (one at a time, several at once, and streamed) must carry the
tokens that the decode server computes by itself for the same prompt, and each one must be a
kvplane transfer, done, in the control plane's record.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from workers.testing.engine import ControlPlane
from workers.testing.vllm_bed import (
    complete,
    completion,
    kvplane_holds,
    prompts,
    serve_pair,
    write_model,
)

from .conftest import require_vllm

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    require_vllm()
    workdir = tmp_path_factory.mktemp("vllm-servers")
    model = write_model(workdir)
    plane = ControlPlane(workdir)
    plane.start()
    try:
        with serve_pair(workdir, model, plane.url) as pair:
            yield pair
    finally:
        plane.stop()


def _body(servers: dict[str, Any], prompt: list[int], **more: Any) -> dict[str, Any]:
    return completion(servers["model"], prompt, **more)


def _complete(url: str, body: dict[str, Any]) -> list[int]:
    return complete(url, body)


def _done_transfers(plane: str, at_least: int) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 20  # records follow in batches, about a second behind
    while True:
        items = httpx.get(f"{plane}/v1/transfers", params={"limit": 100}, timeout=10).json()[
            "items"
        ]
        done = [t for t in items if t["status"] == "done"]
        if len(done) >= at_least or time.monotonic() > deadline:
            return done
        time.sleep(0.5)


def test_completions_through_the_proxy_equal_one_server(servers: dict[str, Any]) -> None:
    batch = prompts(31, (45, 128, 161))
    alone = [_complete(servers["decode"], _body(servers, p)) for p in batch]
    assert len({tuple(t) for t in alone}) == len(batch)
    # One at a time, then all at once.
    assert [_complete(servers["proxy"], _body(servers, p)) for p in batch] == alone
    with concurrent.futures.ThreadPoolExecutor(len(batch)) as pool:
        together = list(pool.map(lambda p: _complete(servers["proxy"], _body(servers, p)), batch))
    assert together == alone
    done = _done_transfers(servers["plane"], 2 * len(batch))
    assert len(done) == 2 * len(batch)
    assert {(t["context"], t["generation"]) for t in done} == {("vllm-prefill", "vllm-decode")}


def test_a_streamed_completion_through_the_proxy(servers: dict[str, Any]) -> None:
    prompt = prompts(32, (99,))[0]
    alone = _complete(servers["decode"], _body(servers, prompt))
    streamed: list[int] = []
    body = _body(servers, prompt, stream=True)
    with httpx.stream("POST", f"{servers['proxy']}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    streamed += choice.get("token_ids") or []
    assert streamed == alone


def _series(url: str, name: str) -> dict[tuple[str, str, str], float]:
    """``{(peer, side, outcome or ""): value}`` of a kvplane series on a vLLM server."""
    found: dict[tuple[str, str, str], float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            key = (labels["peer"], labels["side"], labels.get("outcome", ""))
            found[key] = found.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


def test_handovers_show_in_vllms_own_metrics(servers: dict[str, Any]) -> None:
    """vLLM's KVConnectorStats carry each rank's handovers to the servers' ``/metrics``:
    counted by peer, side and outcome, with their bytes."""
    before = _series(servers["decode"], "vllm:kvplane_handovers_total")
    batch = prompts(33, (70, 90))
    for prompt in batch:
        _complete(servers["proxy"], _body(servers, prompt))
    arrived = ("vllm-prefill", "receive", "arrived")
    deadline = time.monotonic() + 20  # vLLM records stats as its engines step and log
    while time.monotonic() < deadline:
        after = _series(servers["decode"], "vllm:kvplane_handovers_total")
        if after.get(arrived, 0) >= before.get(arrived, 0) + len(batch):
            break
        time.sleep(0.5)
    assert after.get(arrived, 0) >= before.get(arrived, 0) + len(batch), after
    assert _series(servers["decode"], "vllm:kvplane_bytes_total")[("vllm-prefill", "receive", "")]
    sent = _series(servers["prefill"], "vllm:kvplane_handovers_total")
    assert sent.get(("vllm-decode", "send", "released"), 0) >= len(batch), sent
    # ... and each held request's end: these were freed because the decode asked
    while (holds := kvplane_holds(servers["prefill"])).get("sent", 0) < len(batch):
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert holds.get("sent", 0) >= len(batch), holds
