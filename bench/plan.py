"""Planning-core benchmark: compile time, template size, expansion time (prints a table).

Model: 80 target layers with 8 KV heads (head_dim 128, bf16, 32 tokens per block) plus one draft
layer with 2 KV heads in the same pool. Scenarios: TP 8→2, TP 2→8, PP 4→1 and attention-DP 8→TP 2.
For each: time to validate the pairing, time to compile the rank map and templates, template runs,
and for 1,000 and 10,000 blocks the time of ``expand`` (align and check block lists, per-route
counts) and of materializing every fragment as arrays, HND and NHD, HND → NHD conversion
(one strided run per layer, buffer and head), and HND with a 4:1 block-size ratio either way
(``4:1``: context 128 tokens per block, generation 32; ``1:4`` the reverse). For a ratio,
``blocks`` counts large blocks (the small side lists 4× as many) and the template holds one
strided run per (layer, buffer, sub-block).

Run: ``.venv/bin/python bench/plan.py [--repeat N]``. Timings are medians of N runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from geometry import compile_plan, expand, parse_instance, validate_pairing  # noqa: E402
from geometry.builders import ViewSpec, instance_body  # noqa: E402

SCENARIOS = {
    "TP8 -> TP2": ({"tp": 8}, {"tp": 2}, None),
    "TP2 -> TP8": ({"tp": 2}, {"tp": 8}, None),
    "PP4 -> PP1": ({"pp": 4}, {"tp": 1}, None),
    "ADP8 -> TP2": ({"tp": 8, "attention_dp": True}, {"tp": 2}, 3),
}


def median_ms(fn: Callable[[], object], repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()
    header = (
        f"| {'scenario':<12} | {'layout':<7} | {'validate ms':>11} | {'compile ms':>10} | "
        f"{'routes':>6} | {'runs':>5} | {'blocks':>6} | {'expand ms':>9} | "
        f"{'fragments':>10} | {'materialize ms':>14} |"
    )
    print(header)
    print("|" + "|".join("-" * (len(cell)) for cell in header.split("|")[1:-1]) + "|")
    for layout, (ctx_tpb, gen_tpb) in (
        ("HND", (32, 32)),
        ("NHD", (32, 32)),
        ("HND>NHD", (32, 32)),
        ("HND 4:1", (128, 32)),
        ("HND 1:4", (32, 128)),
    ):
        ctx_layout, _, gen_layout = layout.split()[0].partition(">")
        ratio = max(ctx_tpb, gen_tpb) // min(ctx_tpb, gen_tpb)

        def views(kind: str) -> list[ViewSpec]:
            return [
                ViewSpec("target", 80, 8, 128, layout=kind),
                ViewSpec("draft", 1, 2, 128, layout=kind),
            ]

        for name, (ctx_par, gen_par, ctx_dp) in SCENARIOS.items():
            ctx_views, gen_views = views(ctx_layout), views(gen_layout or ctx_layout)
            ctx = parse_instance(
                instance_body(role="context", views=ctx_views, num_slots=20_000 * ratio,
                              tokens_per_block=ctx_tpb, **ctx_par),
                "ctx",
            )  # fmt: skip
            gen = parse_instance(
                instance_body(role="generation", views=gen_views, num_slots=20_000 * ratio,
                              tokens_per_block=gen_tpb, **gen_par),
                "gen",
            )  # fmt: skip
            validate_ms = median_ms(lambda c=ctx, g=gen: validate_pairing(c, g), args.repeat)
            compile_ms = median_ms(
                lambda c=ctx, g=gen, d=ctx_dp: compile_plan(c, g, d, None), args.repeat
            )
            plan = compile_plan(ctx, gen, ctx_dp, None)
            for blocks in (1_000, 10_000):
                # large blocks; the small side (if any) lists ``ratio`` times as many
                ids = (
                    list(range(blocks * (ratio if ctx_tpb < gen_tpb else 1))),
                    list(range(blocks * (ratio if gen_tpb < ctx_tpb else 1))),
                )
                # the prompt fills the lists (num_tokens: blocks pair by token position)
                tokens = blocks * max(ctx_tpb, gen_tpb)
                expand_ms = median_ms(
                    lambda p=plan, i=ids, n=tokens: expand(p, {0: i}, n), args.repeat
                )
                expansion = expand(plan, {0: ids}, tokens)

                def materialize(e=expansion) -> None:
                    for route in e.routes:
                        for part in route.parts:
                            part.fragment_arrays()

                materialize_ms = median_ms(materialize, max(3, args.repeat // 3))
                print(
                    f"| {name:<12} | {layout:<7} | {validate_ms:>11.2f} | {compile_ms:>10.2f} | "
                    f"{len(plan.routes):>6} | {plan.runs:>5} | {blocks:>6} | {expand_ms:>9.3f} | "
                    f"{expansion.fragments:>10,} | {materialize_ms:>14.1f} |"
                )


if __name__ == "__main__":
    main()
