"""Real vLLM engines for the vLLM tier (``tests/vllm``) and ``bench/vllm_handover.py``: each one
a ``tests/vllm/engine.py`` process in the vLLM environment (``.venv-vllm``), bound to its own
core, driven over stdin/stdout.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from workers.testing.engine import ControlPlane, free_port

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "tests" / "vllm"  # engine.py, tiny_model.py
VLLM_PYTHON = Path(os.environ.get("KVPLANE_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
# An engine whose handover or steps stop this long (KV outstanding) dumps its threads to its log.
STALL_DUMP_S = "10"


def vllm_missing() -> str | None:
    """Why the vLLM environment cannot run engines here, or None."""
    if not VLLM_PYTHON.exists():
        return f"no vLLM environment at {VLLM_PYTHON} (make vllm-env)"
    probe = subprocess.run(
        [str(VLLM_PYTHON), "-c", "import vllm, nixl"], capture_output=True, text=True, timeout=300
    )
    if probe.returncode:
        return f"vllm does not import in {VLLM_PYTHON}: {probe.stderr[-400:]}"
    return None


def write_model(
    workdir: Path, *, mla: bool = False, sliding: bool = False, layers: int = 4, kv_heads: int = 4
) -> Path:
    """The tier's small random-weight checkpoint (``tiny_model.py``) under ``workdir``: a GQA
    Llama (``layers`` layers of ``kv_heads`` KV heads), one whose odd layers use a sliding
    window (``sliding``), or (``mla``) a DeepSeek-V2-style model with multi-head latent
    attention."""
    flags = ["--mla"] if mla else ["--sliding"] if sliding else []
    if (layers, kv_heads) != (4, 4):
        flags += ["--layers", str(layers), "--kv-heads", str(kv_heads)]
    model = workdir / "-".join(["model", *(f.strip("-") for f in flags)])
    subprocess.run(
        [str(VLLM_PYTHON), str(HERE / "tiny_model.py"), str(model), *flags],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return model


class Engine:
    """One vLLM engine process (``engine.py``), driven over its stdin/stdout.

    ``core`` binds its OpenMP threads (``"0"``, ``"1"``, or ``"0|1"`` for TP 2, one core per
    rank); ``env`` adds to its environment (e.g. ``KVPLANE_WORKER_HOLD_S``); ``num_blocks`` sizes
    its KV cache; ``log_stats`` keeps vLLM's metrics (the ``preemptions`` op)."""

    def __init__(
        self,
        workdir: Path,
        model: Path,
        role: str,
        core: str,
        *,
        instance: str | None = None,
        control_plane: str | None = None,
        tp: int = 1,
        dtype: str = "bfloat16",
        extra: Mapping[str, Any] | None = None,
        failure_policy: str = "fail",
        env: Mapping[str, str] | None = None,
        log_name: str | None = None,
        num_blocks: int | None = None,
        log_stats: bool = False,
    ) -> None:
        environment = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": core,
            "PYTHONPATH": str(ROOT),
            "KVPLANE_LOG_LEVEL": "INFO",  # a failure's reason, with times, in the engine's log
            "KVPLANE_STALL_DUMP_S": STALL_DUMP_S,  # and where a stalled engine's threads stood
            **(env or {}),
        }
        self.log_path = workdir / f"{log_name or instance or role}.log"
        argv = [
            str(VLLM_PYTHON),
            str(HERE / "engine.py"),
            "--model",
            str(model),
            "--role",
            role,
            "--tp",
            str(tp),
            "--dtype",
            dtype,
            "--failure-policy",
            failure_policy,
            "--extra",
            json.dumps(dict(extra or {})),
        ]
        if instance:
            argv += ["--instance", instance, "--control-plane", str(control_plane)]
        if num_blocks is not None:
            argv += ["--num-blocks", str(num_blocks)]
        if log_stats:
            argv.append("--log-stats")
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=environment,
                start_new_session=True,
            )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, name=f"read-{self.log_path.stem}", daemon=True).start()

    def read(self, timeout_s: float = 600.0) -> dict[str, Any]:
        """The engine's next answer; raises if it exits or says nothing for ``timeout_s`` (an
        engine thread that dies, e.g. on a port already in use, leaves the process running)."""
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(
                f"no answer from {self.log_path.stem} in {timeout_s:.0f} s: {self.log()[-3000:]}"
            ) from None
        if line is None:
            raise RuntimeError(f"the engine exited: {self.log()[-3000:]}")
        return json.loads(line[3:])

    def _pump(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith("@@ "):
                self._lines.put(line)
        self._lines.put(None)

    def send(self, **command: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()

    def call(self, **command: Any) -> dict[str, Any]:
        self.send(**command)
        return self.read()

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int,
        params: Sequence[Mapping[str, Any] | None] | None = None,
    ) -> dict[str, Any]:
        listed = None if params is None else [None if p is None else dict(p) for p in params]
        return self.call(op="generate", prompts=prompts, max_tokens=max_tokens, params=listed)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kvplane_log(self, lines: int = 40) -> str:
        """The last ``lines`` of kvplane's own lines in the engine's log."""
        mine = [line for line in self.log().splitlines() if "kvplane" in line]
        return "\n".join(mine[-lines:])

    def stop(self) -> None:
        # vLLM spawns its engine core (and, with TP, its workers): end the whole group, or
        # their spinning OpenMP threads outlive the test on the cores they are bound to.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()


def prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 4000) for _ in range(n)] for n in lengths]


def handover(
    prefill: Engine,
    decode: Engine,
    prefilled: list[list[int]],
    decoded: list[list[int]],
    max_tokens: int = 16,
    *,
    context: str = "vllm-prefill",
    **extra: Any,
) -> list[list[int]]:
    """Prefill ``prefilled`` on ``prefill``, then decode ``decoded`` on ``decode`` with the
    ``kv_transfer_params`` that came back (plus ``extra``)."""
    pre = prefill.generate(prefilled, 1, [{"do_remote_decode": True}] * len(prefilled))
    params = [{**p, **extra} for p in pre["params"]]
    assert all(p and p["kvplane_context"] == context for p in params), params
    out = decode.generate(decoded, max_tokens, params)
    if "error" in out["finish"]:  # a failed load: say why, from both engines' logs
        raise AssertionError(
            f"the decode finished {out['finish']}\n"
            f"{prefill.log_path.stem}:\n{prefill.kvplane_log()}\n"
            f"{decode.log_path.stem}:\n{decode.kvplane_log()}"
        )
    return out["tokens"]


SERVER_START_S = 240  # an OpenAI server is up in 30-40 s here, alone


class Process:
    """A server process (an OpenAI server, the proxy) in its own session, logging to a file."""

    def __init__(self, argv: list[str], log: Path, env: Mapping[str, str] | None = None) -> None:
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


def connector_config(role: str, name: str, plane: str, **extra: Any) -> str:
    """``--kv-transfer-config`` for ``KvplaneConnector`` (``kv_producer`` or ``kv_consumer``);
    ``extra`` adds to its ``kv_connector_extra_config`` (and ``kv_load_failure_policy``)."""
    policy = extra.pop("kv_load_failure_policy", None)
    config: dict[str, Any] = {
        "kv_connector": "KvplaneConnector",
        "kv_connector_module_path": "workers.connectors.vllm",
        "kv_role": role,
        "kv_connector_extra_config": {"control_plane": plane, "instance": name, **extra},
    }
    if policy:
        config["kv_load_failure_policy"] = policy
    return json.dumps(config)


def openai_server(
    workdir: Path,
    model: Path,
    name: str,
    kv_config: str,
    core: str,
    port: int,
    *,
    prefix_caching: bool = False,
    env: Mapping[str, str] | None = None,
    args: Sequence[str] = (),
) -> Process:
    """vLLM's OpenAI server for ``model`` with ``kv_config``, its threads bound to ``core``."""
    return Process(
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
            "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
            "--skip-tokenizer-init",
            "--kv-transfer-config",
            kv_config,
            *args,
        ],
        workdir / f"{name}.log",
        {
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": core,
            "KVPLANE_STALL_DUMP_S": STALL_DUMP_S,
            "KVPLANE_LOG_LEVEL": "INFO",
            **(env or {}),
        },
    )


def proxy(workdir: Path, prefill: str, decode: str, port: int) -> Process:
    """``examples/vllm_proxy.py`` in front of a prefill and a decode server."""
    return Process(
        [
            sys.executable,
            "examples/vllm_proxy.py",
            "--prefill",
            prefill,
            "--decode",
            decode,
            "--port",
            str(port),
        ],
        workdir / "proxy.log",
    )


def kvplane_holds(url: str) -> dict[str, float]:
    """An OpenAI server's ``vllm:kvplane_holds_total`` by outcome (what freed a held request)."""
    found: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:kvplane_holds_total{"):
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
            found[outcome] = found.get(outcome, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


def recorded(
    url: str, at_least: int, *, status: str = "done", context: str | None = None
) -> list[dict[str, Any]]:
    """The control plane's transfers in ``status`` (of ``context``, if given), once there are
    ``at_least`` of them or after 20 s: the records follow in batches, about a second behind."""
    deadline = time.monotonic() + 20
    while True:
        items = httpx.get(
            f"{url}/v1/transfers", params={"status": status, "limit": 200}, timeout=10
        ).json()["items"]
        found = [t for t in items if context is None or t["context"] == context]
        if len(found) >= at_least or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


class Side:
    """One OpenAI server of a :func:`serve_pair`: its core, connector extra config (and
    ``kv_load_failure_policy``) and more server arguments."""

    def __init__(
        self, core: str, *, extra: Mapping[str, Any] | None = None, args: Sequence[str] = ()
    ) -> None:
        self.core, self.extra, self.args = core, dict(extra or {}), tuple(args)


@contextlib.contextmanager
def serve_pair(
    workdir: Path,
    model: Path,
    plane: str,
    *,
    prefill: Side | None = None,
    decode: Side | None = None,
    prefix_caching: bool = False,
    args: Sequence[str] = (),
) -> Iterator[dict[str, Any]]:
    """A prefill and a decode OpenAI server with ``KvplaneConnector`` (instances
    ``vllm-prefill`` and ``vllm-decode``, cores 0 and 1 unless ``prefill``/``decode`` say
    otherwise; ``args`` go to both), started one at a time (two cores), and the proxy in front.
    Yields their URLs (``proxy``, ``prefill``, ``decode``), ``plane``, ``model`` and the
    ``processes``; everything stops on exit."""
    running: list[Process] = []
    urls: dict[str, str] = {}
    try:
        for name, role, side in (
            ("vllm-prefill", "kv_producer", prefill or Side("0")),
            ("vllm-decode", "kv_consumer", decode or Side("1")),
        ):
            port = free_port()
            config = connector_config(role, name, plane, **side.extra)
            server = openai_server(
                workdir,
                model,
                name,
                config,
                side.core,
                port,
                prefix_caching=prefix_caching,
                args=(*side.args, *args),
            )
            running.append(server)
            urls[name] = f"http://127.0.0.1:{port}"
            server.wait_ready(f"{urls[name]}/health", SERVER_START_S)
        port = free_port()
        front = proxy(workdir, urls["vllm-prefill"], urls["vllm-decode"], port)
        running.append(front)
        front.wait_ready(f"http://127.0.0.1:{port}/healthz", 30)
        yield {
            "plane": plane,
            "proxy": f"http://127.0.0.1:{port}",
            "prefill": urls["vllm-prefill"],
            "decode": urls["vllm-decode"],
            "model": str(model),
            "workdir": workdir,
            "processes": running,
        }
    finally:
        for process in reversed(running):
            process.stop()


def completion(model: str, prompt: list[int], **more: Any) -> dict[str, Any]:
    """A greedy ``/v1/completions`` body that answers token ids (12 unless ``max_tokens``)."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": 12,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        **more,
    }


def complete(url: str, body: Mapping[str, Any], timeout_s: float = 120.0) -> list[int]:
    """The token ids ``url`` completes ``body`` with (asserting a 200)."""
    answer = httpx.post(f"{url}/v1/completions", json=dict(body), timeout=timeout_s)
    assert answer.status_code == 200, answer.text
    return list(answer.json()["choices"][0]["token_ids"])


@contextlib.contextmanager
def engine_bed(
    workdir: Path, model: Path, engines: Sequence[tuple[str, str, str, Mapping[str, Any]]]
) -> Iterator[tuple[ControlPlane, dict[str, Engine]]]:
    """A control plane and ``engines`` on it, each ``(role, instance, core, Engine options)``,
    started one at a time (two cores); everything stops on exit."""
    plane = ControlPlane(workdir)
    plane.start()
    started: dict[str, Engine] = {}
    try:
        for role, name, core, options in engines:
            engine = Engine(
                workdir, model, role, core, instance=name, control_plane=plane.url, **options
            )
            started[name] = engine
            assert engine.read() == {"ready": True}
        yield plane, started
    finally:
        for engine in started.values():
            engine.stop()
        plane.stop()
