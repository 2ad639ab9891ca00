"""``kvplane demo``: the main job, end to end, on one machine.

1. start a control plane (``kvplane serve``, a fresh SQLite file) on loopback;
2. register a context instance (TP4; an 8-head target view and a 2-head draft view sharing one
   pool) and a generation instance (TP2), and pair them;
3. start six rank processes on the CPU (``workers/testing/engine.py``: a fake engine per rank that
   owns its KV tensors and embeds a worker), every pool filled with the (rank, pool, byte) pattern;
4. through REST, transfer ``blocks`` blocks staged and then per fragment, both verified: the bytes
   each transfer wrote carry the sender's pattern at the planned offsets, and every route's
   sender and receiver crc32 agree (the receiving rank compares them);
5. a burst of small requests on the same processes: raw NIXL WRITEs (the physical limit), the
   engine path (``send``/``expect`` in process) and REST, with latency percentiles side by side;
   the engine path and REST twice, without checks (fill mode costs them nothing: a receive's
   bytes are marked only when a check needs them) and verified like step 4; raw and the engine
   path in ``BURST_ROUNDS`` rounds, taking turns, their percentiles over every round;
6. sweep every pool byte that no transfer targeted (each must still hold its own pattern), check
   that no block leaked and that the control plane lists every transfer as done, print the
   tables and stop everything. The database keeps the record.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from api.client import Client

BURST_REQUESTS = 32
BURST_BLOCKS = 4
BURST_IN_FLIGHT = 4
BURST_ROUNDS = 4  # raw and the engine path: rounds of BURST_REQUESTS, p50 over all of them
RECORD_WAIT_S = 15.0


def _row(path: str, checks: str, latencies: list[float], throughput: float, failures: int) -> str:
    import numpy as np

    head = f"| {path:<11} | {checks:<10} | {len(latencies):>4} | {failures:>6} |"
    if latencies:
        p50, p99 = (float(np.percentile(latencies, q)) * 1000 for q in (50, 99))
        return f"{head} {p50:>8.2f} | {p99:>8.2f} | {throughput:>12.1f} |"
    return f"{head} {'-':>8} | {'-':>8} | {'-':>12} |"


def _pooled(path: str, checks: str, runs: list[Any], failures: int) -> tuple[Any, ...]:
    """A burst row of several rounds: every round's requests, the median round's rate."""
    import numpy as np

    latencies = [x for run in runs for x in run.latencies_s()]
    return (path, checks, latencies, float(np.median([r.throughput() for r in runs])), failures)


def run_demo(
    *, blocks: int, port: int, database: Path, keep_running: bool, host: str = "127.0.0.1"
) -> int:
    """Run the demo; returns the process exit code (0 only if every byte verified)."""
    from workers.testing.engine import CONTEXT, GENERATION, EngineRun, Fleet, RawRun, run_rest

    database.parent.mkdir(parents=True, exist_ok=True)
    for suffix in ("", "-wal", "-shm"):
        Path(f"{database}{suffix}").unlink(missing_ok=True)
    logs = database.parent / "demo-logs"
    logs.mkdir(exist_ok=True)
    num_slots = max(2 * blocks, 128)
    fleet = Fleet(logs, num_slots=num_slots, fill=True, database=database, port=port, host=host)
    ok = True
    try:
        print(f"control plane: {fleet.server.url} (database {database}, logs in {logs}/)")
        fleet.start()
        print(
            f"pairing {fleet.pairing['id']}: compatible, "
            f"{len(fleet.pairing['warnings'])} warning(s)"
        )
        print(
            "ranks: 6 processes (4 context, 2 generation), each a fake engine embedding a "
            "worker; pools pattern-filled"
        )
        client = Client(fleet.server.url, retries=3)

        # --- REST, one big verified transfer per mode ------------------------------------------
        context_ids = list(range(blocks))
        # The generation ids differ from the context's: a copy to the wrong slot is caught.
        generation_ids = [blocks + i for i in range(blocks)]
        rows = []
        expected_record = 2  # transfers the control plane must list as done at the end
        for mode in ("staged", "fragments"):
            transfer = client.create_transfer(
                {
                    "context": CONTEXT,
                    "generation": GENERATION,
                    "request_id": f"demo-{mode}",
                    "blocks": {"0": {"context": context_ids, "generation": generation_ids}},
                    "execute": True,
                    "mode": mode,
                    "verify": True,
                }
            )
            done = client.get_transfer(transfer["id"], wait_s=60)
            # The receivers compared both sides' sums: the senders' parts decide nothing and
            # come with their next batch of records (about a second).
            ranks = len({r["sender_rank"] for r in done["routes"]}) + len(
                {r["receiver_rank"] for r in done["routes"]}
            )
            parts = client.list_parts(transfer["id"])["items"]
            give_up = time.monotonic() + 5
            while len(parts) < ranks and done["status"] == "done" and time.monotonic() < give_up:
                time.sleep(0.2)
                parts = client.list_parts(transfer["id"])["items"]
            verified = sum((p["result"] or {}).get("verified_bytes") or 0 for p in parts)
            sends = [
                p["result"]["duration_s"]
                for p in parts
                if p["kind"] == "send" and p["state"] == "done"
            ]
            rows.append(
                (
                    mode,
                    done["status"],
                    done["bytes"],
                    done["duration_s"],
                    max(sends, default=float("nan")),
                    done["fragments"],
                    sum(route["runs"] for route in done["routes"]),
                    verified,
                )
            )
            if done["status"] != "done":
                ok = False
                print(f"{mode}: {done['status']}: {done['error']}")
        header = (
            f"| {'mode':<9} | {'status':<6} | {'bytes':>11} | {'end-to-end s':>12} | "
            f"{'slowest sender s':>16} | {'fragments':>9} | {'runs':>5} | "
            f"{'verified bytes':>14} |"
        )
        print()
        print(header)
        print("|" + "|".join("-" * len(cell) for cell in header.split("|")[1:-1]) + "|")
        for mode, status, nbytes, seconds, wire, fragments, runs, verified in rows:
            print(
                f"| {mode:<9} | {status:<6} | {nbytes:>11,} | {seconds or float('nan'):>12.3f} "
                f"| {wire:>16.3f} | {fragments:>9,} | {runs:>5} | {verified:>14,} |"
            )
        print()
        print(
            "end-to-end: dispatch to done, including the first NIXL connection set-up and the "
            "receivers' checks; slowest sender: gather, WRITEs and crc32 of one context rank."
        )

        # --- a burst of small requests, three ways ---------------------------------------------
        print()
        print(
            f"burst: requests of {BURST_BLOCKS} blocks, {BURST_IN_FLIGHT} in flight, on the same "
            f"six processes: raw NIXL and the engine path in {BURST_ROUNDS} rounds of "
            f"{BURST_REQUESTS} (taking turns; p50 over every round), REST {BURST_REQUESTS} each"
        )
        # Raw and the engine path in rounds, the three taking turns (a drift in the machine's
        # speed touches them alike), each row's p50 over all its rounds: one pass of 32
        # requests on two shared cores put raw's own p50 anywhere from 0.7 to 1.9 ms.
        shape: dict[str, Any] = {
            "requests": BURST_REQUESTS,
            "blocks": BURST_BLOCKS,
            "in_flight": BURST_IN_FLIGHT,
        }
        raws: list[RawRun] = []
        engines: dict[bool, list[EngineRun]] = {False: [], True: []}
        for round_ in range(BURST_ROUNDS):
            raws.append(fleet.run_raw(**shape, seed=7 + 100 * round_))
            # Each path twice: without checks (no fill-mode work on their way), then with
            # every byte checked; the same six processes, other seeds.
            for verify, seed in ((False, 8), (True, 10)):
                engine = fleet.run_engine(**shape, seed=seed + 100 * round_, verify=verify)
                engines[verify].append(engine)
                if engine.leaked or not engine.complete:
                    ok = False
                    print(f"FAILED burst: leaked blocks {engine.leaked}, stalled {engine.stalled}")
        problems: list[str] = [e for raw in raws for e in raw.errors]
        burst = [_pooled("raw NIXL", "none", raws, len(problems))]
        for verify, checks, seed in ((False, "none", 9), (True, "every byte", 11)):
            failures = [f for engine in engines[verify] for f in engine.failures.values()]
            rest = run_rest(
                fleet.server.url,
                **shape,
                num_slots=num_slots,
                seed=seed,
                tag=f"demo-rest-{time.time_ns() % 10**9}",
                verify=verify,
            )
            burst.append(_pooled("engine path", checks, engines[verify], len(failures)))
            burst.append(
                ("REST", checks, rest["latencies"], rest["throughput"], len(rest["errors"]))
            )
            problems += [*failures, *rest["errors"]]
            expected_record += BURST_REQUESTS * (BURST_ROUNDS + 1)
        header = (
            f"| {'path':<11} | {'checks':<10} | {'done':>4} | {'failed':>6} | "
            f"{'p50 ms':>8} | {'p99 ms':>8} | {'transfers/s':>12} |"
        )
        print()
        print(header)
        print("|" + "|".join("-" * len(cell) for cell in header.split("|")[1:-1]) + "|")
        for row in burst:
            print(_row(*row))
        print()
        print(
            "raw: the same routes as plain NIXL WRITEs with one notification each (no "
            "gather, scatter or checks); engine: send/expect in process, the request's last "
            "call to its last arrival; REST: POST /v1/transfers?wait= from a client (answered "
            "once the transfer settled). "
            "Checks 'every byte': crc32 on both sides, compared by the receiving rank, which "
            "also checks every byte the request wrote before it says arrived (its fragments' "
            "crc32 against the sender's pattern's, byte by byte where they differ: about "
            "0.7 ms per request and rank in this burst). Checks 'none' pays nothing for the "
            "fill pattern: a receive is only noted, its bytes marked when the rank is idle, "
            "a check or the final sweep needs them. bench/latency.py measures the paths "
            "without fill mode, in more shapes."
        )
        if problems:
            ok = False
            print(f"FAILED burst: {len(problems)} request(s) failed: {problems[:3]}")

        # --- every byte nobody targeted, and the record ---------------------------------------
        stats = fleet.call_all("stats", sweep=True)
        swept = sum(s["swept_bytes"] for s in stats)
        leaked = sum(s["leaked"] for s in stats)
        print()
        print(
            f"swept {swept:,} untouched pool bytes (all still their own pattern); "
            f"{leaked} blocks leaked"
        )
        # The record follows within about a second (engine-path parts come in batches).
        deadline = time.monotonic() + RECORD_WAIT_S
        while True:
            listed = client.list_transfers(limit=1000)
            done_count = sum(t["status"] == "done" for t in listed["items"])
            if done_count >= expected_record or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        print(
            f"record: {listed['total']} transfers in the control plane, {done_count} done "
            f"(engine-path ones included, recorded in batches)"
        )
        if done_count != expected_record or listed["total"] != expected_record:
            ok = False
            print(f"FAILED record: expected {expected_record} transfers, all done")
        ok = ok and leaked == 0
        print()
        print(
            "verified: every byte the checked transfers wrote (the sender's pattern at the "
            "planned offsets), every untouched pool byte, and sender/receiver crc32 of their "
            "routes"
            if ok
            else "FAILED: see above and the logs"
        )
        if keep_running:
            print(
                f"left running: {fleet.server.url} (dashboard at /, API docs at /docs); "
                "Ctrl-C stops"
            )
            try:
                while True:
                    time.sleep(1)
            except KeyboardInterrupt:
                pass
        return 0 if ok else 1
    except Exception as error:
        print(f"FAILED: {type(error).__name__}: {error}")
        return 1
    finally:
        fleet.stop()


__all__ = ["run_demo"]
