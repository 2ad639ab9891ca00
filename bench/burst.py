"""The demo's burst, several times over: how far one run's ratios can be trusted.

    .venv/bin/python bench/burst.py [--rounds 8] [--requests 32] [--in-flight 4] [--blocks 4]

``kvplane demo`` ends with a burst of small requests on its six processes (fill mode): raw NIXL
WRITEs, then the engine path without checks and with every byte checked, and reads each row's
p50 from one pass of ``--requests`` requests. This runs that burst ``--rounds`` times on one
fleet of the same shape (``workers/testing/engine.py``, fill mode, the three paths taking turns
within each round so that a drift in the machine's speed touches them alike) and prints every
round's p50s and ratios to raw, their median, and the p50 over all rounds' requests per path.
The burst's goal: engine path unchecked ≤ 3 × raw, every byte checked ≤ 10 × raw.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script

from latency import cpu_model  # noqa: E402  (bench/, this script's directory)

from workers.testing.engine import Fleet  # noqa: E402

PATHS = (("raw NIXL", None), ("engine, none", False), ("engine, every byte", True))
GOALS = {"engine, none": 3.0, "engine, every byte": 10.0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--in-flight", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--workdir", type=Path, help="logs (default: a temp dir)")
    args = parser.parse_args(argv)
    if min(args.rounds, args.requests, args.in_flight, args.blocks) < 1:
        parser.error("--rounds, --requests, --in-flight and --blocks: at least 1")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvplane-burst-"))
    workdir.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    fleet = Fleet(workdir, num_slots=max(2 * args.blocks, 128), fill=True)
    latencies: dict[str, list[list[float]]] = {name: [] for name, _ in PATHS}
    try:
        fleet.start()
        fleet.run_engine(requests=8, blocks=args.blocks, in_flight=2, tag="warm", verify=True)
        shape = {"requests": args.requests, "blocks": args.blocks, "in_flight": args.in_flight}
        for round_ in range(args.rounds):
            seed = 100 + 10 * round_
            for name, verify in PATHS:
                if verify is None:
                    raw_run = fleet.run_raw(**shape, seed=seed)
                    errors, done = list(raw_run.errors), raw_run.latencies_s()
                else:
                    run = fleet.run_engine(**shape, seed=seed + 1 + verify, verify=verify)
                    errors, done = list(run.failures.values()), run.latencies_s()
                    if run.leaked or not run.complete:
                        errors.append(f"leaked blocks {run.leaked}, stalled {run.stalled}")
                if errors:
                    print(f"round {round_ + 1}, {name}: {errors[:3]}", file=sys.stderr)
                    return 1
                latencies[name].append(done)
    finally:
        fleet.stop()
    p50 = {
        name: [float(np.percentile(r, 50)) * 1e3 for r in runs] for name, runs in latencies.items()
    }
    raw = p50["raw NIXL"]
    print(
        f"CPU: {cpu_model()} ({os.cpu_count()} logical CPUs); "
        f"load average before {'/'.join(f'{x:.2f}' for x in load_before)}, after "
        f"{'/'.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    print(
        f"\n{args.rounds} rounds of {args.requests} requests of {args.blocks} blocks, "
        f"{args.in_flight} in flight, p50 ms (÷ raw):\n"
    )
    print("| round | " + " | ".join(name for name, _ in PATHS) + " |")
    print("|---:|" + "---:|" * len(PATHS))
    for i in range(args.rounds):
        cells = [f"{raw[i]:.2f}"] + [
            f"{p50[name][i]:.2f} ({p50[name][i] / raw[i]:.1f}×)" for name in GOALS
        ]
        print(f"| {i + 1} | " + " | ".join(cells) + " |")
    pooled = {
        name: float(np.percentile(np.concatenate(runs), 50)) * 1e3
        for name, runs in latencies.items()
    }
    print()
    for name, goal in GOALS.items():
        ratios = [p / r for p, r in zip(p50[name], raw, strict=True)]
        met = sum(x <= goal for x in ratios)
        print(
            f"- {name} ≤ {goal:g} × raw: met in {met} of {args.rounds} rounds; ratios "
            f"{min(ratios):.1f}-{max(ratios):.1f}×, median {float(np.median(ratios)):.1f}×; "
            f"over all rounds' requests {pooled[name]:.2f} vs {pooled['raw NIXL']:.2f} ms "
            f"({pooled[name] / pooled['raw NIXL']:.1f}×)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
