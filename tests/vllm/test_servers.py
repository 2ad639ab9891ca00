"""The commands of docs/integrators.md, section 3a, as a user runs them: two vLLM OpenAI servers
with ``KvplaneConnector`` and ``examples/vllm_proxy.py`` in front of them.

Completions through the proxy (one at a time, several at once, and streamed) must carry the
tokens that the decode server computes by itself for the same prompt, and each one must be a
kvplane transfer, done, in the control plane's record.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from workers.testing.engine import ControlPlane, free_port
from workers.testing.vllm_bed import ROOT, VLLM_PYTHON, prompts, write_model

from .conftest import require_vllm

pytestmark = pytest.mark.slow

START_S = 240  # an OpenAI server is up in 30-40 s here, alone


def _connector(role: str, name: str, plane: str) -> str:
    return json.dumps(
        {
            "kv_connector": "KvplaneConnector",
            "kv_connector_module_path": "workers.connectors.vllm",
            "kv_role": role,
            "kv_connector_extra_config": {"control_plane": plane, "instance": name},
        }
    )


class Process:
    def __init__(self, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log = log
        with log.open("w") as out:
            self.process = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                cwd=ROOT,
                start_new_session=True,
            )

    def wait_ready(self, url: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.log.stem} exited: {self.log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            time.sleep(0.5)
        raise TimeoutError(
            f"{self.log.stem} not up in {timeout_s} s: {self.log.read_text()[-3000:]}"
        )

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    require_vllm()
    workdir = tmp_path_factory.mktemp("vllm-servers")
    model = write_model(workdir)
    plane = ControlPlane(workdir)
    plane.start()
    running: list[Process] = []
    try:
        urls = {}
        for name, role, core in (
            ("vllm-prefill", "kv_producer", "0"),
            ("vllm-decode", "kv_consumer", "1"),
        ):
            port = free_port()
            server = Process(
                [
                    str(VLLM_PYTHON),
                    "-m",
                    "vllm.entrypoints.openai.api_server",
                    "--model",
                    str(model),
                    "--port",
                    str(port),
                    "--block-size",
                    "32",
                    "--enforce-eager",
                    "--no-enable-prefix-caching",
                    "--skip-tokenizer-init",
                    "--kv-transfer-config",
                    _connector(role, name, plane.url),
                ],
                workdir / f"{name}.log",
                {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": core},
            )
            running.append(server)
            urls[name] = f"http://127.0.0.1:{port}"
            server.wait_ready(f"{urls[name]}/health", START_S)  # one at a time: two cores
        port = free_port()
        proxy = Process(
            [
                sys.executable,
                "examples/vllm_proxy.py",
                "--prefill",
                urls["vllm-prefill"],
                "--decode",
                urls["vllm-decode"],
                "--port",
                str(port),
            ],
            workdir / "proxy.log",
        )
        running.append(proxy)
        proxy.wait_ready(f"http://127.0.0.1:{port}/healthz", 30)
        yield {
            "plane": plane.url,
            "proxy": f"http://127.0.0.1:{port}",
            "decode": urls["vllm-decode"],
            "model": str(model),
        }
    finally:
        for process in reversed(running):
            process.stop()
        plane.stop()


def _body(servers: dict[str, Any], prompt: list[int], **more: Any) -> dict[str, Any]:
    return {
        "model": servers["model"],
        "prompt": prompt,
        "max_tokens": 12,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        **more,
    }


def _complete(url: str, body: dict[str, Any]) -> list[int]:
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return list(answer.json()["choices"][0]["token_ids"])


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
