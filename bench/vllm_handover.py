"""Two real vLLM engines hand over KV: kvplane's connector against vLLM's own NixlConnector.

Same machine, same model (the vLLM tier's small random-weight Llama), same prompts, same
binding (prefill engine on core 0, decode engine on core 1), one pair of engines at a time::

    .venv/bin/python bench/vllm_handover.py [--rounds 20] [--in-flight 1,4] [--prompt-tokens 128]

For each connector and each number of requests in flight, every round sends that many prompts
to the prefill engine (``max_tokens=1``, ``do_remote_decode``), then the same prompts with the
returned ``kv_transfer_params`` to the decode engine (``max_tokens=1``):

- **handover**: the decode leg, from the requests' submission to their first token: the KV load
  (the kvplane ask and WRITEs, or NixlConnector's handshake-cached READs) plus one decode step;
- **TTFT**: the prefill leg plus the decode leg, as a proxy in front of the two engines sees it.

A batch's requests finish together, so each round gives one value per in-flight level; p99 of 20
rounds is their maximum. Each pair first runs two warm-up rounds (the first handover pairs and
connects). The decode's tokens are checked against one engine's for every round. Needs the vLLM
environment (``make vllm-env``).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script

from workers.testing.engine import ControlPlane, free_port  # noqa: E402
from workers.testing.vllm_bed import Engine, prompts, vllm_missing, write_model  # noqa: E402


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def measure(
    prefill: Engine,
    decode: Engine,
    in_flight: int,
    rounds: int,
    prompt_tokens: int,
    oracle: Engine,
    seed: int,
) -> dict[str, Any]:
    handover_s: list[float] = []
    ttft_s: list[float] = []
    mismatches = 0
    for index in range(rounds + 2):
        batch = prompts(seed + index, tuple(prompt_tokens + 7 * i for i in range(in_flight)))
        started = time.perf_counter()
        pre = prefill.generate(batch, 1, [{"do_remote_decode": True}] * len(batch))
        prefilled = time.perf_counter()
        out = decode.generate(batch, 1, pre["params"])
        done = time.perf_counter()
        mismatches += out["tokens"] != oracle.generate(batch, 1)["tokens"]
        if index >= 2:  # warm-up rounds
            handover_s.append(done - prefilled)
            ttft_s.append(done - started)
    return {"handover": handover_s, "ttft": ttft_s, "mismatches": mismatches}


def run_pair(
    kind: str, workdir: Path, model: Path, args: argparse.Namespace
) -> dict[int, dict[str, Any]]:
    plane = None
    engines: list[Engine] = []
    try:
        if kind == "kvplane":
            plane = ControlPlane(workdir / kind)
            (workdir / kind).mkdir(exist_ok=True)
            plane.start()
            prefill = Engine(
                workdir,
                model,
                "prefill",
                "0",
                instance="vllm-prefill",
                control_plane=plane.url,
                log_name=f"{kind}-prefill",
            )
            engines.append(prefill)
            decode = Engine(
                workdir,
                model,
                "decode",
                "1",
                instance="vllm-decode",
                control_plane=plane.url,
                log_name=f"{kind}-decode",
            )
        else:
            # Each NixlConnector engine listens for handshakes on its own side-channel port
            # (vLLM's default, 5600, is one port for both).
            prefill = Engine(
                workdir,
                model,
                "nixl-prefill",
                "0",
                env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())},
                log_name=f"{kind}-prefill",
            )
            engines.append(prefill)
            decode = Engine(
                workdir,
                model,
                "nixl-decode",
                "1",
                env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())},
                log_name=f"{kind}-decode",
            )
        engines.append(decode)
        for engine in engines:
            assert engine.read() == {"ready": True}
        # The oracle is the decode engine by itself (no kv_transfer_params: a plain request).
        return {
            n: measure(prefill, decode, n, args.rounds, args.prompt_tokens, decode, seed=1000 * n)
            for n in args.in_flight
        }
    finally:
        for engine in engines:
            engine.stop()
        if plane is not None:
            plane.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument(
        "--in-flight", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4]
    )
    parser.add_argument("--prompt-tokens", type=int, default=128)
    args = parser.parse_args()
    missing = vllm_missing()
    if missing:
        sys.exit(f"vllm_handover: {missing}")
    with tempfile.TemporaryDirectory(prefix="kvplane-vllm-bench-") as tmp:
        workdir = Path(tmp)
        model = write_model(workdir)
        results = {kind: run_pair(kind, workdir, model, args) for kind in ("kvplane", "nixl")}
    print(
        f"# {time.strftime('%Y-%m-%d')} · {platform.processor() or platform.machine()} · "
        f"{os.cpu_count()} cores · {args.rounds} rounds, prompts of ~{args.prompt_tokens} "
        "tokens, TP1 -> TP1, bfloat16, block size 32"
    )
    print(
        "| in flight | connector | handover p50 | handover p99 | TTFT p50 | TTFT p99 | "
        "tokens = one engine |"
    )
    print("|---|---|---|---|---|---|---|")
    for n in args.in_flight:
        for kind, label in (("kvplane", "kvplane"), ("nixl", "NixlConnector")):
            r = results[kind][n]
            print(
                f"| {n} | {label} | {1e3 * statistics.median(r['handover']):.1f} ms | "
                f"{1e3 * _pct(r['handover'], 0.99):.1f} ms | "
                f"{1e3 * statistics.median(r['ttft']):.1f} ms | "
                f"{1e3 * _pct(r['ttft'], 0.99):.1f} ms | "
                f"{args.rounds + 2 - r['mismatches']}/{args.rounds + 2} |"
            )
    print()
    print("| in flight | handover p50, kvplane ÷ NixlConnector | TTFT p50, kvplane ÷ Nixl |")
    print("|---|---|---|")
    for n in args.in_flight:
        k, x = results["kvplane"][n], results["nixl"][n]
        print(
            f"| {n} | {statistics.median(k['handover']) / statistics.median(x['handover']):.2f}"
            f" | {statistics.median(k['ttft']) / statistics.median(x['ttft']):.2f} |"
        )


if __name__ == "__main__":
    main()
