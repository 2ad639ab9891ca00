"""One vLLM engine driven over stdin/stdout (JSON lines), for the vLLM tier and its benchmark.

Run with the vLLM environment's Python::

    .venv-vllm/bin/python tests/vllm/engine.py --model DIR --role prefill|decode|plain ...

Commands, one JSON object per line; each answer is one line starting with ``@@ ``:

- ``{"op": "generate", "prompts": [[ids], ...], "max_tokens": N, "params": [obj|null, ...]}``:
  greedy generation; ``params`` are each request's ``kv_transfer_params`` (the prefill side
  gets ``{"do_remote_decode": true}``). Answers ``{"tokens", "params", "seconds"}``.
- ``{"op": "idle", "timeout_s": S}``: waits until every KV block is free again (the prefill's
  held blocks are freed when the decode has read them), answers ``{"idle": bool}``.
- ``{"op": "preemptions"}``: how many times the engine preempted a request so far (needs
  ``--log-stats``), answers ``{"preemptions": N}``.
- ``{"op": "quit"}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument(
        "--role",
        choices=("prefill", "decode", "plain", "nixl-prefill", "nixl-decode"),
        required=True,
    )
    parser.add_argument("--instance", default=None)
    parser.add_argument("--control-plane", default=None)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--extra", default="{}", help="more kv_connector_extra_config (JSON)")
    parser.add_argument("--failure-policy", default="fail")
    parser.add_argument("--num-blocks", type=int, default=None, help="the KV cache's blocks")
    parser.add_argument("--log-stats", action="store_true", help="vLLM's metrics, for ops")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kv = None
    if args.role in ("prefill", "decode"):
        extra = {
            "control_plane": args.control_plane,
            "instance": args.instance,
            **json.loads(args.extra),
        }
        kv = KVTransferConfig(
            kv_connector="KvplaneConnector",
            kv_connector_module_path="workers.connectors.vllm",
            kv_role="kv_producer" if args.role == "prefill" else "kv_consumer",
            kv_connector_extra_config=extra,
            kv_load_failure_policy=args.failure_policy,
        )
    elif args.role.startswith("nixl-"):
        kv = KVTransferConfig(
            kv_connector="NixlConnector",
            kv_buffer_device="cpu",
            kv_role="kv_producer" if args.role == "nixl-prefill" else "kv_consumer",
            kv_load_failure_policy=args.failure_policy,
        )
    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        block_size=32,
        enforce_eager=True,
        dtype=args.dtype,
        tensor_parallel_size=args.tp,
        enable_prefix_caching=False,
        max_model_len=2048,
        kv_transfer_config=kv,
        num_gpu_blocks_override=args.num_blocks,
        disable_log_stats=not args.log_stats,
    )
    print("@@ " + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        if op == "quit":
            break
        if op == "generate":
            prompts = command["prompts"]
            params = command.get("params") or [None] * len(prompts)
            sampling = [
                SamplingParams(
                    max_tokens=command.get("max_tokens", 24),
                    temperature=0.0,
                    detokenize=False,
                    ignore_eos=True,
                    extra_args=None if p is None else {"kv_transfer_params": p},
                )
                for p in params
            ]
            started = time.perf_counter()
            outputs = llm.generate(
                [{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False
            )
            seconds = time.perf_counter() - started
            print(
                "@@ "
                + json.dumps(
                    {
                        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
                        "finish": [o.outputs[0].finish_reason for o in outputs],
                        "params": [o.kv_transfer_params for o in outputs],
                        "seconds": seconds,
                    }
                ),
                flush=True,
            )
        elif op == "idle":
            deadline = time.monotonic() + float(command.get("timeout_s", 30))
            idle = llm.reset_prefix_cache()
            while not idle and time.monotonic() < deadline:
                time.sleep(0.2)
                idle = llm.reset_prefix_cache()
            print("@@ " + json.dumps({"idle": idle}), flush=True)
        elif op == "preemptions":
            count = sum(
                getattr(metric, "value", 0)
                for metric in llm.get_metrics()
                if metric.name == "vllm:num_preemptions"
            )
            print("@@ " + json.dumps({"preemptions": count}), flush=True)
        else:
            print("@@ " + json.dumps({"error": f"unknown op {op!r}"}), flush=True)


if __name__ == "__main__":
    main()
