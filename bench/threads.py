"""Where the CPU goes: a per-thread CPU account of the demo fleet during one engine-path run.

    .venv/bin/python bench/threads.py [--blocks 4] [--in-flight 16] [--requests 1500] [--verify]

The same fleet as ``bench/latency.py`` (one control plane on SQLite, six rank processes from
``workers/testing/engine.py``). Before and after one run of the engine path (``worker.send`` /
``worker.expect`` on every rank, closed loop), it reads each thread's user + system CPU time
from ``/proc/<pid>/task/<tid>/stat`` (Linux) and prints, per request, the CPU of every kind of
thread: the fake engine's own thread (``MainThread``, where ``send``/``expect`` run), the
handover's progress thread, the record poster, heartbeat and command-stream threads, threads
that Python does not know (NIXL's and UCX's own), and the control plane (all its threads
together). The account starts when the ranks start together (not while they wait 0.3 s for it)
and ends with the run, the control plane's once every rank's recorder has posted the run's
batched records (flushed at once). Prints a markdown table (with each kind's kernel time: for
shared memory, UCX copies a WRITE with process_vm_writev, so the copy shows there), the
throughput and the load average.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script

from workers.testing.engine import Fleet, cpu_seconds  # noqa: E402


def thread_cpu(pid: int) -> dict[int, tuple[float, float]]:
    """``(user + system, system)`` CPU seconds of every thread of ``pid`` so far."""
    out: dict[int, tuple[float, float]] = {}
    ticks = os.sysconf("SC_CLK_TCK")
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended
        out[int(tid)] = ((int(fields[11]) + int(fields[12])) / ticks, int(fields[12]) / ticks)
    return out


def kind_of(name: str | None) -> str:
    """A thread's kind: its Python name without the instance and rank it serves."""
    if name is None:
        return "native (NIXL, UCX)"
    return re.sub(r"^kvplane-handover-.*", "kvplane-handover (progress)", name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--in-flight", type=int, default=16)
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument(
        "--verify",
        action="store_true",
        help="fill mode: every request's bytes checked (crc32 on both sides, the fill check)",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        help="also profile every rank during the run (yappi, CPU clock; pip install yappi) "
        "and write its pstats here, one file per rank",
    )
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    workdir = Path(tempfile.mkdtemp(prefix="kvplane-threads-"))
    num_slots = max(64, args.blocks * args.in_flight * 2)
    fleet = Fleet(workdir, num_slots=num_slots, staging_bytes=128 << 20, fill=args.verify)
    checks = {"verify": True} if args.verify else {}
    try:
        fleet.start()
        fleet.run_engine(requests=8, blocks=args.blocks, in_flight=2, tag="warm", **checks)
        pids = fleet.pids()
        roles = [spec.role for spec, _, _ in fleet.ranks]
        names = fleet.call_all("threads")
        start_at = time.time() + 0.3
        before: dict[int, dict[int, tuple[float, float]]] = {}
        server_before: list[float] = []

        def read_start() -> None:  # at the ranks' common start, not while they wait for it
            time.sleep(max(0.0, start_at - time.time()))
            before.update({pid: thread_cpu(pid) for pid in pids["ranks"]})
            server_before.append(cpu_seconds(pids["server"]))

        if args.profile:
            args.profile.mkdir(parents=True, exist_ok=True)
            fleet.call_all("profile")
        reader = threading.Thread(target=read_start)
        reader.start()
        run = fleet.run_engine(
            requests=args.requests,
            blocks=args.blocks,
            in_flight=args.in_flight,
            seed=7,
            tag="threads",
            start_at=start_at,
            **checks,
        )
        reader.join()
        if args.profile:
            fleet.call_all("profile", directory=str(args.profile))
        after = {pid: thread_cpu(pid) for pid in pids["ranks"]}
        fleet.call_all("flush_records")  # the run's batched records belong to it
        server_ms = (cpu_seconds(pids["server"]) - server_before[0]) * 1e3 / args.requests
    finally:
        fleet.stop()
    if run.failures or run.leaked:
        print(f"run: {len(run.failures)} failed, {run.leaked} blocks leaked", file=sys.stderr)
    per_kind: dict[tuple[str, str], float] = defaultdict(float)
    kernel: dict[tuple[str, str], float] = defaultdict(float)
    ranks_of: dict[str, int] = defaultdict(int)
    for pid, role, known in zip(pids["ranks"], roles, names, strict=True):
        ranks_of[role] += 1
        known = {int(k): v for k, v in known.items()}
        for tid, (cpu, system) in after[pid].items():
            was, was_system = before[pid].get(tid, (0.0, 0.0))
            key = (role, kind_of(known.get(tid)))
            per_kind[key] += (cpu - was) * 1e3 / args.requests
            kernel[key] += (system - was_system) * 1e3 / args.requests
    total = sum(per_kind.values()) + server_ms
    print(
        f"{args.requests} requests of {args.blocks} blocks, {args.in_flight} in flight"
        f"{', every byte checked' if args.verify else ''}: "
        f"{run.throughput():.0f} transfers/s; {os.cpu_count()} logical CPUs; load average "
        f"before {'/'.join(f'{x:.2f}' for x in load_before)}, after "
        f"{'/'.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    print()
    print("| process | thread | CPU ms/request | of which kernel | share |")
    print("|---|---|---:|---:|---:|")
    for (role, kind), ms in sorted(per_kind.items(), key=lambda kv: -kv[1]):
        if ms >= 0.005:
            print(
                f"| {role} ranks ({ranks_of[role]}) | {kind} | {ms:.2f} | "
                f"{kernel[(role, kind)]:.2f} | {100 * ms / total:.0f} % |"
            )
    print(f"| control plane | all threads | {server_ms:.2f} | | {100 * server_ms / total:.0f} % |")
    print(f"| **all** | | **{total:.2f}** | **{sum(kernel.values()):.2f}** (ranks) | |")
    return 0 if not run.failures and not run.leaked else 1


if __name__ == "__main__":
    raise SystemExit(main())
