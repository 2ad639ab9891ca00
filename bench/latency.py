"""Handover latency: raw NIXL vs the engine path vs REST, one run, the demo fleet.

    .venv/bin/python bench/latency.py [--quick] [--reps N] [--device cuda] [--json out.json]

One control plane (``kvplane serve``, SQLite) and six rank processes (``workers/testing/engine.py``:
TP4 context with an 8-head target and a 2-head draft view → TP2 generation, each rank a fake
engine embedding a Worker). For 1, 4, 16 and 64 blocks per request and 1, 4 and 16 requests in
flight (closed loop), these paths between the same six processes:

- **raw**: the same routes' byte counts as plain NIXL WRITEs, staging → staging, one notification
  per route, in a tight loop (the handover's progress thread paused meanwhile). A sender keeps
  ``in flight`` requests' WRITEs posted; latency = last receiver's last notification − last
  sender's post. The physical limit of this machine's loopback.
- **raw fragments** (``--paths`` ``rawfrag``): plain NIXL WRITEs of each request's own
  fragments (its block ids, as the engine path gets them), pool to pool from the descriptor lists
  prepared per route, one WRITE and one notification per route, the same tight loop. The memory
  traffic of a handover (scattered 16 KiB head slices of random blocks) without its protocol:
  the engine path's ratio to it is what kvplane's protocol and bookkeeping add, while the ratio
  to **raw** also counts what the layout costs.
- **raw, granted** (``--paths`` ``rawgrant``): raw fragments in the handover's order, with the
  least of its protocol in the same tight loops: each generation rank keeps ``in flight``
  requests granted (one notification to each of its senders per request), and a context rank
  WRITEs a request's fragments when their grant comes. Latency = last grant → last receiver's
  last notification. The floor of the engine path's protocol written in Python, without its
  handles, checks and records.
- **engine**: ``worker.send`` / ``worker.expect`` per request on every rank, with paged-cache
  accounting (each rank keeps ``in flight`` of its own handles pending); latency = last generation
  handle ``arrived`` − last rank's call. All ranks share the machine clock (``time.time()``).
- **engine, receiver ahead** (``--paths`` ``ahead``): the engine path in the usual order of
  disaggregated serving: a generation rank calls ``expect`` as soon as it admitted the request,
  while a context rank computes the prompt's KV for ``--prefill-ms`` (default 5) and only then
  calls ``send``. The receiver's grant is then waiting when ``send`` comes, so latency = last
  generation handle ``arrived`` − last context rank's ``send``: the handover on the time-to-
  first-token path. ``in flight`` counts a context rank's requests in prefill too, and the
  rate includes the modelled prefill, so the row has no rate ratio.
- **REST**: ``POST /v1/transfers?wait=30`` (``execute=true``, answered once the transfer
  settled) from ``in flight`` client threads; the same workers serve it through their command
  stream. Latency = POST sent → answered ``done``.

``--hosts``: the same three paths across three hosts (``workers/testing/netbed.py``, root only): the
control plane in ``kvp-cp``, the context ranks in ``kvp-ctx``, the generation ranks in ``kvp-gen``,
every worker on ``--ucx-tls`` (default ``tcp``: the bytes cross the veths instead of shared
memory) and pinned to the bed's data network (``--ucx-net-devices data0``; HTTP stays on the
control network). Adds GB/s (bytes/request × transfers/s) and the megabytes that left the context
host's data NIC per cell; ``--loss N`` drops N % of the context host's data-network packets each
way (nftables), ``--rate`` limits its data NIC's egress (``tc tbf``), ``--delay-ms`` delays every
packet between the context and generation hosts' data addresses (a user-space TUN relay).

``--reps N`` measures every cell N times, raw, engine and REST taking turns, so that a drift in
the machine's speed touches every path alike: p50 and p99 over all the cell's requests,
transfers/s the median repetition's, and the goals list each repetition's ratio.

transfers/s = requests / (first issue → last outcome). CPU ms/request: user + system CPU time
of the six rank processes and of the control plane during the measurement, per request. Every
path is measured over the same kind of window: from the instant its ranks start together (raw
and engine runs start 0.3 s after the command; the waiting is left out) to its last outcome,
and for the engine and REST paths until the records the run queued are posted and stored (each
rank's recorder flushed at once, rather than a fixed wait whose idle polling of six ranks was
charged to the engine path alone). Cells at 4 blocks run a few hundred requests, so that the
CPU clock's 10 ms ticks do not decide the per-request figure. Prints a markdown table, the CPU
and the load average before and after, and whether the latency goals (:func:`goals`) and the
per-request CPU goals (:func:`cpu_goals`) are met.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script

from geometry import compile_plan, expand, parse_instance  # noqa: E402
from workers.testing.engine import (  # noqa: E402
    CONTEXT,
    GENERATION,
    Fleet,
    cpu_seconds,
    demo_bodies,
    percentile,
    request_blocks,
    run_rest,
)

BLOCKS = (1, 4, 16, 64)
IN_FLIGHT = (1, 4, 16)
REST_EXTRA = (4, 8)  # (blocks, in flight): the cell of the REST goals (p50, transfers/s, CPU)
REST_GOAL_REQUESTS = 160
REST_RETRIES = 5
START_DELAY_S = 0.3  # raw and engine runs: the ranks start together this long after the call
RAW_FRAGMENTS = "raw fragments"
RAW_GRANTED = "raw, granted"
AHEAD = "engine, receiver ahead"
PATH_ORDER = ("raw", RAW_FRAGMENTS, RAW_GRANTED, "engine", AHEAD, "REST")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def request_bytes(num_slots: int, blocks: int) -> int:
    context, generation = demo_bodies(num_slots=num_slots)
    plan = compile_plan(parse_instance(context, CONTEXT), parse_instance(generation, GENERATION))
    pairs = request_blocks(1, 0, blocks, num_slots)
    return int(expand(plan, pairs).bytes)


def requests_for(blocks: int, in_flight: int, quick: bool, path: str = "engine") -> int:
    if path == "REST" and (blocks, in_flight) == REST_EXTRA and not quick:
        # The goal's cell: enough requests that ramp-up and drain do not decide its rate
        # (with 16, the first and last few requests ran below 8 in flight)
        return REST_GOAL_REQUESTS
    if quick:
        return max(8, 2 * in_flight)
    if path == "REST":  # REST is slow here: enough for a median, a bounded run
        return max(48, 6 * in_flight)
    # Enough that a cell's run lasts about a second or more: CPU time is read per process
    # in clock ticks (10 ms), six ranks, so a 30-request run misread it by milliseconds
    # per request.
    if blocks >= 64:
        return max(32, 4 * in_flight)
    if blocks >= 16:
        return max(150, 20 * in_flight)
    return max(300, 40 * in_flight)


class CpuMeter:
    """CPU seconds the rank processes and the control plane spent during one measurement.

    ``start_at`` (``time.time()``): read the starting point at that instant, from a thread,
    instead of now: the ranks of a raw or engine run wait for a common start, and what they
    spend waiting (0.3 s of polling) is not the requests'."""

    def __init__(self, fleet: Fleet, start_at: float | None = None) -> None:
        self.pids = fleet.pids()
        self.start: dict[str, float] = {}
        self._reader: threading.Thread | None = None
        if start_at is None:
            self._read_start()
        else:
            self._reader = threading.Thread(target=self._read_start, args=(start_at,))
            self._reader.start()

    def _read_start(self, at: float = 0.0) -> None:
        time.sleep(max(0.0, at - time.time()))
        self.start = {k: cpu_seconds(v) for k, v in self.pids.items()}
        self.rest_client = time.process_time()  # this process: the REST client threads

    def per_request_ms(self, requests: int) -> dict[str, float]:
        if self._reader is not None:
            self._reader.join()
        out = {k: (cpu_seconds(v) - self.start[k]) * 1e3 / requests for k, v in self.pids.items()}
        out["client"] = (time.process_time() - self.rest_client) * 1e3 / requests
        return out


def row(
    path: str,
    blocks: int,
    in_flight: int,
    nbytes: int,
    latencies: list[float],
    throughput: float,
    failures: int,
    cpu: dict[str, float],
) -> dict[str, Any]:
    return {
        "path": path,
        "blocks": blocks,
        "in_flight": in_flight,
        "bytes": nbytes,
        "n": len(latencies),
        "failed": failures,
        "cpu_ms": cpu,
        "latencies_s": latencies,
        "p50_ms": percentile(latencies, 50) * 1e3,
        "p99_ms": percentile(latencies, 99) * 1e3,
        "per_s": throughput,
    }


def merge_reps(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from a cell's repetitions: percentiles over every request of every repetition,
    the median repetition's transfers/s, mean CPU; each repetition's p50 and rate kept too."""
    if len(reps) == 1:
        return reps[0]
    latencies = [x for r in reps for x in r["latencies_s"]]
    first = reps[0]
    merged = row(
        first["path"],
        first["blocks"],
        first["in_flight"],
        first["bytes"],
        latencies,
        float(np.median([r["per_s"] for r in reps])),
        sum(r["failed"] for r in reps),
        {k: float(np.mean([r["cpu_ms"][k] for r in reps])) for k in first["cpu_ms"]},
    )
    merged["p50_reps_ms"] = [r["p50_ms"] for r in reps]
    merged["per_s_reps"] = [r["per_s"] for r in reps]
    for key in ("nic_mb", "retries_503"):
        if key in first:
            merged[key] = sum(r[key] for r in reps)
    return merged


class _PostgresDatabase:
    """A fresh database on a PostgreSQL server, for one run (the control plane migrates it)."""

    def __init__(self, server_url: str) -> None:
        from sqlalchemy import create_engine, text
        from sqlalchemy.engine import make_url

        self.name = f"kvplane_latency_{os.getpid()}"
        self._admin = create_engine(server_url, isolation_level="AUTOCOMMIT")
        with self._admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{self.name}"'))
        self.url = (
            make_url(server_url).set(database=self.name).render_as_string(hide_password=False)
        )

    def drop(self) -> None:
        from sqlalchemy import text

        with self._admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)'))
        self._admin.dispose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--quick", action="store_true", help="fewer requests per cell")
    parser.add_argument(
        "--reps",
        type=int,
        default=1,
        help="measure every cell this many times, the paths taking turns",
    )
    parser.add_argument("--blocks", default=",".join(map(str, BLOCKS)))
    parser.add_argument("--in-flight", default=",".join(map(str, IN_FLIGHT)))
    parser.add_argument(
        "--paths",
        default="raw,rawfrag,engine,ahead,rest",
        help="raw (staging to staging), rawfrag (the requests' fragments, pool "
        "to pool), rawgrant (rawfrag, each request granted by its receivers first), engine, "
        "ahead (the engine path, generation ranks expecting --prefill-ms before the context "
        "ranks send), rest",
    )
    parser.add_argument(
        "--prefill-ms",
        type=float,
        default=5.0,
        help="ahead: how long a context rank computes before it sends",
    )
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--workdir", type=Path, help="logs and database (default: a temp dir)")
    parser.add_argument(
        "--hosts",
        action="store_true",
        help="across network namespaces kvp-cp / kvp-ctx / kvp-gen (root)",
    )
    parser.add_argument(
        "--ucx-tls", default=None, help="the workers' UCX transports (default with --hosts: tcp)"
    )
    parser.add_argument("--loss", type=int, default=0, help="--hosts: %% packets dropped")
    parser.add_argument("--rate", default=None, help="--hosts: context egress limit (1gbit)")
    parser.add_argument(
        "--delay-ms",
        type=float,
        default=0.0,
        help="--hosts: delay each way between kvp-ctx and kvp-gen (TUN relay)",
    )
    parser.add_argument(
        "--postgres",
        default=None,
        metavar="URL",
        help="the control plane on a fresh database of this PostgreSQL server (created and "
        "dropped here; e.g. postgresql+psycopg://postgres@127.0.0.1:5432/test) instead of SQLite",
    )
    args = parser.parse_args(argv)
    if (args.loss or args.rate or args.delay_ms) and not args.hosts:
        parser.error("--loss, --rate and --delay-ms need --hosts")
    block_counts = [int(x) for x in args.blocks.split(",")]
    flights = [int(x) for x in args.in_flight.split(",")]
    paths = args.paths.split(",")
    unknown = set(paths) - {"raw", "rawfrag", "rawgrant", "engine", "ahead", "rest"}
    if unknown:
        parser.error(f"--paths: unknown {', '.join(sorted(unknown))}")
    if args.prefill_ms < 0:
        parser.error("--prefill-ms must be >= 0")
    num_slots = max(64, max(block_counts) * max(flights + [REST_EXTRA[1]]))

    load_before = os.getloadavg()
    started = time.time()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvplane-latency-"))
    workdir.mkdir(parents=True, exist_ok=True)
    bed = None
    hosts: dict[str, Any] = {}
    if args.hosts:
        from workers.testing import netbed

        why = netbed.available()
        if why:
            print(f"--hosts: {why}", file=sys.stderr)
            return 2
        bed = netbed.Bed().up()
        hosts = {
            "host": bed.address("cp"),
            "ucx_tls": args.ucx_tls or "tcp",
            "ucx_net_devices": netbed.DATA_DEVICE,
            "hosts": {"control": "kvp-cp", "context": "kvp-ctx", "generation": "kvp-gen"},
        }
    elif args.ucx_tls:
        hosts = {"ucx_tls": args.ucx_tls}
    database = _PostgresDatabase(args.postgres) if args.postgres else None
    fleet = Fleet(
        workdir,
        num_slots=num_slots,
        device=args.device,
        staging_bytes=128 << 20,
        server_env=None if database is None else {"KVPLANE_DATABASE_URL": database.url},
        **hosts,
    )
    rows: list[dict[str, Any]] = []

    def nic_mb() -> float:  # what left kvp-ctx: its data NIC, and the delay relay's TUN if any
        if bed is None:
            return 0.0
        sent = bed.counters("ctx")["tx_bytes"]
        if args.delay_ms:
            sent += int(bed.exec("ctx", "cat", "/sys/class/net/kvp-dly/statistics/tx_bytes"))
        return sent / 1e6

    try:
        fleet.start()
        if bed is not None and args.loss:
            bed.loss("ctx", args.loss)
        if bed is not None and args.rate:
            bed.rate("ctx", args.rate)
        if bed is not None and args.delay_ms:
            bed.delay("ctx", "gen", args.delay_ms)
        print(f"fleet up in {time.time() - started:.0f} s (logs in {workdir})", file=sys.stderr)
        # Warm-up: NIXL connections, the REST command streams.
        fleet.run_engine(requests=4, blocks=4, in_flight=2, tag="warm")
        if "rest" in paths:
            run_rest(
                fleet.server.url,
                requests=2,
                blocks=4,
                in_flight=1,
                num_slots=num_slots,
                seed=2,
                tag="warm-rest",
            )
        cells = [(b, n) for b in block_counts for n in flights]
        if "rest" in paths and REST_EXTRA[0] in block_counts and REST_EXTRA not in cells:
            cells.append(REST_EXTRA)
        for seed, (blocks, in_flight) in enumerate(cells, start=10):
            nbytes = request_bytes(num_slots, blocks)
            extra = (blocks, in_flight) == REST_EXTRA and in_flight not in flights
            cell: list[dict[str, Any]] = []
            for rep in range(args.reps):  # the paths take turns: a drift touches each alike
                rep_seed = seed + 1000 * rep
                requests = requests_for(blocks, in_flight, args.quick)
                if "raw" in paths and not extra:
                    start_at = time.time() + START_DELAY_S
                    meter, nic = CpuMeter(fleet, start_at), nic_mb()
                    raw = fleet.run_raw(
                        requests=requests,
                        blocks=blocks,
                        in_flight=in_flight,
                        seed=rep_seed,
                        start_at=start_at,
                    )
                    if raw.errors:
                        print(f"raw {blocks}x{in_flight}: {raw.errors}", file=sys.stderr)
                    lat = raw.latencies_s()
                    cell.append(
                        row(
                            "raw",
                            blocks,
                            in_flight,
                            nbytes,
                            lat,
                            raw.throughput(),
                            requests - len(lat),
                            meter.per_request_ms(requests),
                        )
                    )
                    cell[-1]["nic_mb"] = nic_mb() - nic
                for key, name, layout in (
                    ("rawfrag", RAW_FRAGMENTS, "fragments"),
                    ("rawgrant", RAW_GRANTED, "granted"),
                ):
                    if key not in paths or extra:
                        continue
                    start_at = time.time() + START_DELAY_S
                    meter, nic = CpuMeter(fleet, start_at), nic_mb()
                    raw = fleet.run_raw(
                        requests=requests,
                        blocks=blocks,
                        in_flight=in_flight,
                        seed=rep_seed,
                        start_at=start_at,
                        layout=layout,
                    )
                    if raw.errors:
                        print(f"{name} {blocks}x{in_flight}: {raw.errors}", file=sys.stderr)
                    lat = raw.latencies_s()
                    cell.append(
                        row(
                            name,
                            blocks,
                            in_flight,
                            nbytes,
                            lat,
                            raw.throughput(),
                            requests - len(lat),
                            meter.per_request_ms(requests),
                        )
                    )
                    cell[-1]["nic_mb"] = nic_mb() - nic
                for key, name, prefill_ms in (
                    ("engine", "engine", 0.0),
                    ("ahead", AHEAD, args.prefill_ms),
                ):
                    if key not in paths or extra:
                        continue
                    start_at = time.time() + START_DELAY_S
                    meter, nic = CpuMeter(fleet, start_at), nic_mb()
                    run = fleet.run_engine(
                        requests=requests,
                        blocks=blocks,
                        in_flight=in_flight,
                        seed=rep_seed,
                        start_at=start_at,
                        prefill_ms=prefill_ms,
                    )
                    if run.failures or run.leaked or run.stalled:
                        print(
                            f"{name} {blocks}x{in_flight}: failures "
                            f"{list(run.failures.items())[:3]} leaked {run.leaked} "
                            f"stalled {run.stalled}",
                            file=sys.stderr,
                        )
                    lat = run.latencies_s()
                    fleet.call_all("flush_records")  # the run's batched records belong to it
                    cell.append(
                        row(
                            name,
                            blocks,
                            in_flight,
                            nbytes,
                            lat,
                            run.throughput(),
                            requests - len(lat),
                            meter.per_request_ms(requests),
                        )
                    )
                    cell[-1]["nic_mb"] = nic_mb() - nic
                if "rest" in paths:
                    meter, nic = CpuMeter(fleet), nic_mb()
                    requests = requests_for(blocks, in_flight, args.quick, "REST")
                    rest = run_rest(
                        fleet.server.url,
                        requests=requests,
                        blocks=blocks,
                        in_flight=in_flight,
                        num_slots=num_slots,
                        seed=rep_seed,
                        tag=f"rest-{rep_seed}",
                    )
                    if rest["errors"]:
                        print(f"rest {blocks}x{in_flight}: {rest['errors'][:3]}", file=sys.stderr)
                    fleet.call_all("flush_records")  # send parts are batched: they belong here
                    cell.append(
                        row(
                            "REST",
                            blocks,
                            in_flight,
                            nbytes,
                            rest["latencies"],
                            rest["throughput"],
                            len(rest["errors"]),
                            meter.per_request_ms(requests),
                        )
                    )
                    cell[-1]["retries_503"] = len(rest["retries"])
                    cell[-1]["nic_mb"] = nic_mb() - nic
            for path in PATH_ORDER:
                reps = [r for r in cell if r["path"] == path]
                if reps:
                    rows.append(merge_reps(reps))
            print(
                f"  {blocks} blocks x {in_flight} in flight: "
                + ", ".join(
                    f"{r['path']} p50 {r['p50_ms']:.1f} ms"
                    for r in rows
                    if r["blocks"] == blocks and r["in_flight"] == in_flight
                ),
                file=sys.stderr,
            )
    finally:
        fleet.stop()
        if database is not None:
            database.drop()
        if bed is not None:
            bed.down()
    load_after = os.getloadavg()
    print_report(rows, args, load_before, load_after, time.time() - started)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "rows": rows,
                    "cpu": cpu_model(),
                    "cpus": os.cpu_count(),
                    "device": args.device,
                    "load_before": load_before,
                    "load_after": load_after,
                    "hosts": args.hosts,
                    "ucx_tls": args.ucx_tls or ("tcp" if args.hosts else None),
                    "loss": args.loss,
                    "rate": args.rate,
                    "delay_ms": args.delay_ms,
                },
                indent=1,
            )
        )
    return 0 if all(r["failed"] == 0 for r in rows) else 1


def print_report(
    rows: list[dict[str, Any]],
    args: argparse.Namespace,
    load_before: tuple[float, ...],
    load_after: tuple[float, ...],
    seconds: float,
) -> None:
    raw = {(r["blocks"], r["in_flight"]): r for r in rows if r["path"] == "raw"}
    if args.hosts:
        print(
            f"Across hosts kvp-cp / kvp-ctx / kvp-gen (veths on a bridge), UCX_TLS="
            f"{args.ucx_tls or 'tcp'}"
            + (f", {args.loss} % loss each way on kvp-ctx" if args.loss else "")
            + (f", kvp-ctx egress {args.rate}" if args.rate else "")
            + (f", {args.delay_ms:g} ms each way kvp-ctx <-> kvp-gen" if args.delay_ms else "")
        )
    print(
        f"CPU: {cpu_model()} ({os.cpu_count()} logical CPUs); device {args.device}; "
        f"load average before {'/'.join(f'{x:.2f}' for x in load_before)}, after "
        f"{'/'.join(f'{x:.2f}' for x in load_after)}; {seconds:.0f} s"
        + (" (--quick)" if args.quick else "")
        + (
            f"; every cell {args.reps} times, the paths taking turns (p50/p99 over all its "
            "requests, transfers/s the median repetition's)"
            if args.reps > 1
            else ""
        )
    )
    print()
    hosts = bool(args.hosts)
    print(
        "| path | blocks | in flight | bytes/request | n | p50 ms | p99 ms | transfers/s "
        + ("| GB/s | MB out of kvp-ctx " if hosts else "")
        + "| p50 ÷ raw | transfers/s ÷ raw | CPU ms/request: ranks / server |"
    )
    print(
        "|---|---:|---:|---:|---:|---:|---:|---:|"
        + ("---:|---:|" if hosts else "")
        + "---:|---:|---:|"
    )
    order = {path: i for i, path in enumerate(PATH_ORDER)}
    for r in sorted(rows, key=lambda r: (r["blocks"], r["in_flight"], order[r["path"]])):
        base = raw.get((r["blocks"], r["in_flight"]))
        if base and r["path"] != "raw":
            ratio = f"{r['p50_ms'] / base['p50_ms']:.1f}×"
            tput = "–" if r["path"] == AHEAD else f"{r['per_s'] / base['per_s']:.2f}×"
        else:
            ratio = tput = "–"
        failed = f" ({r['failed']} failed)" if r["failed"] else ""
        if r.get("retries_503"):
            failed += f" ({r['retries_503']} × 503)"
        cpu = r["cpu_ms"]
        net = f"{r['bytes'] * r['per_s'] / 1e9:.3f} | {r.get('nic_mb', 0):.0f} | " if hosts else ""
        print(
            f"| {r['path']} | {r['blocks']} | {r['in_flight']} | {r['bytes']:,} | "
            f"{r['n']}{failed} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['per_s']:.1f} | "
            f"{net}{ratio} | {tput} | {cpu['ranks']:.1f} / {cpu['server']:.1f} |"
        )
    print()
    print("Goals:")
    for goal, met in goals(rows):
        print(f"- {goal}: {'met' if met else 'NOT met'}")
    cpu = cpu_goals(rows)
    if cpu:
        print()
        print("CPU goals (CPU ms/request as in the table):")
        for goal, met in cpu:
            print(f"- {goal}: {'met' if met else 'NOT met'}")
    ahead = [r for r in rows if r["path"] == AHEAD and (r["blocks"], r["in_flight"]) in raw]
    if ahead:
        print()
        print(
            f"{AHEAD} (context ranks send {args.prefill_ms:g} ms after the generation ranks "
            "expect; latency from the last send), p50 against raw (the goals above are "
            "judged on the engine row):"
        )
        for r in sorted(ahead, key=lambda r: (r["blocks"], r["in_flight"])):
            base = raw[(r["blocks"], r["in_flight"])]
            print(
                f"- {r['blocks']} blocks, {r['in_flight']} in flight: {r['p50_ms']:.2f} ms, "
                f"{r['p50_ms'] / base['p50_ms']:.1f}× raw"
            )
    frag = {(r["blocks"], r["in_flight"]): r for r in rows if r["path"] == RAW_FRAGMENTS}
    if frag:
        print()
        print(
            f"The engine path against {RAW_FRAGMENTS} (the same fragments pool to pool, no "
            "protocol), p50 and transfers/s ratios:"
        )
        for r in sorted(rows, key=lambda r: (r["blocks"], r["in_flight"])):
            base = frag.get((r["blocks"], r["in_flight"]))
            if r["path"] == "engine" and base:
                print(
                    f"- {r['blocks']} blocks, {r['in_flight']} in flight: p50 "
                    f"{r['p50_ms'] / base['p50_ms']:.1f}×, transfers/s "
                    f"{r['per_s'] / base['per_s']:.2f}×"
                )
    floors = [p for p in ("raw", RAW_FRAGMENTS, RAW_GRANTED) if any(r["path"] == p for r in rows)]
    at = {(r["path"], r["blocks"], r["in_flight"]): r for r in rows}
    lines = []
    for r in sorted(rows, key=lambda r: (r["blocks"], r["in_flight"])):
        if r["path"] != "engine":
            continue
        ratios = [
            f"{r['cpu_ms']['ranks'] / at[(p, r['blocks'], r['in_flight'])]['cpu_ms']['ranks']:.1f}"
            f"× {p}"
            for p in floors
            if (p, r["blocks"], r["in_flight"]) in at
            and at[(p, r["blocks"], r["in_flight"])]["cpu_ms"]["ranks"] > 0
        ]
        if len(ratios) > 1:
            lines.append(
                f"- {r['blocks']} blocks, {r['in_flight']} in flight: " + ", ".join(ratios)
            )
    if lines:
        print()
        print("The engine ranks' CPU per request against each raw path's:")
        print("\n".join(lines))


def goals(rows: list[dict[str, Any]]) -> list[tuple[str, bool]]:
    def get(path: str, blocks: int, in_flight: int) -> dict[str, Any] | None:
        return next(
            (
                r
                for r in rows
                if (r["path"], r["blocks"], r["in_flight"]) == (path, blocks, in_flight)
            ),
            None,
        )

    out: list[tuple[str, bool]] = []
    for n in sorted({r["in_flight"] for r in rows if r["blocks"] == 4 and r["path"] == "raw"}):
        engine, raw = get("engine", 4, n), get("raw", 4, n)
        if engine and raw:
            per_rep = ""
            if "p50_reps_ms" in engine and "p50_reps_ms" in raw:
                per_rep = "; each repetition " + ", ".join(
                    f"{e / r:.1f}×"
                    for e, r in zip(engine["p50_reps_ms"], raw["p50_reps_ms"], strict=True)
                )
            out.append(
                (
                    f"engine p50 ≤ 2 × raw p50 at 4 blocks, {n} in flight "
                    f"({engine['p50_ms']:.2f} vs {2 * raw['p50_ms']:.2f} ms{per_rep})",
                    engine["p50_ms"] <= 2 * raw["p50_ms"],
                )
            )
    for b in sorted({r["blocks"] for r in rows if r["in_flight"] == 16}):
        engine, raw = get("engine", b, 16), get("raw", b, 16)
        if engine and raw:
            out.append(
                (
                    f"engine transfers/s ≥ 0.5 × raw at 16 in flight, {b} blocks "
                    f"({engine['per_s']:.1f} vs {0.5 * raw['per_s']:.1f}/s)",
                    engine["per_s"] >= 0.5 * raw["per_s"],
                )
            )
    rest = get("REST", 4, 8)
    if rest:
        out.append(
            (
                f"REST at 4 blocks, 8 in flight: p50 ≤ 30 ms ({rest['p50_ms']:.1f} ms)",
                rest["p50_ms"] <= 30,
            )
        )
    single = get("REST", 4, 1)
    if single:
        out.append(
            (
                f"REST at 4 blocks, 1 in flight: p50 ≤ 8 ms ({single['p50_ms']:.1f} ms)",
                single["p50_ms"] <= 8,
            )
        )
    return out


def cpu_goals(rows: list[dict[str, Any]]) -> list[tuple[str, bool]]:
    """The per-request CPU goals: the engine ranks' CPU per request ≤ 1.5 × raw's at
    4 blocks and 4 and 16 in flight; REST at 4 blocks and 8 in flight ≥ 200 transfers/s,
    ≤ 3 ms of control-plane CPU per transfer and the ranks' CPU ≤ 1.2 × the engine path's for
    the same cell (its p50 goals, ≤ 30 ms at 8 in flight and ≤ 8 ms at 1, are in
    :func:`goals`)."""
    at = {(r["path"], r["blocks"], r["in_flight"]): r for r in rows}
    out: list[tuple[str, bool]] = []
    for n in (4, 16):
        engine, raw = at.get(("engine", 4, n)), at.get(("raw", 4, n))
        if engine and raw:
            e, r = engine["cpu_ms"]["ranks"], raw["cpu_ms"]["ranks"]
            out.append(
                (
                    f"engine ranks' CPU ≤ 1.5 × raw's at 4 blocks, {n} in flight "
                    f"({e:.1f} vs {r:.1f} ms/request: {e / r:.1f}×)",
                    e <= 1.5 * r,
                )
            )
    rest, engine = at.get(("REST", 4, 8)), at.get(("engine", 4, 8))
    if rest:
        out.append(
            (
                f"REST at 4 blocks, 8 in flight: ≥ 200 transfers/s ({rest['per_s']:.1f}/s)",
                rest["per_s"] >= 200,
            )
        )
        server = rest["cpu_ms"]["server"]
        out.append(
            (
                f"REST at 4 blocks, 8 in flight: control plane ≤ 3 ms of CPU per transfer "
                f"({server:.1f} ms)",
                server <= 3,
            )
        )
    if rest and engine:
        r, e = rest["cpu_ms"]["ranks"], engine["cpu_ms"]["ranks"]
        out.append(
            (
                f"REST at 4 blocks, 8 in flight: ranks' CPU ≤ 1.2 × the engine path's "
                f"({r:.1f} vs {e:.1f} ms/request: {r / e:.1f}×)",
                r <= 1.2 * e,
            )
        )
    return out


if __name__ == "__main__":
    raise SystemExit(main())
