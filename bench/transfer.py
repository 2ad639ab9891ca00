"""Data-mover benchmark: template executors and NIXL transports vs plain copies.

Geometry: context TP4 → generation TP2, 80 layers, K+V, head_dim 128, bf16, 32 tokens per block,
256 blocks. Route sender rank 0 → receiver rank 0: the sender holds 2 heads, the receiver 4, the
sender fills receiver heads [0, 2). HND: 160 runs (one per layer and buffer) of 16 KiB per block;
NHD: 160 runs × 32 tokens of 512 bytes; HND>NHD (conversion, ``--layouts HND>NHD``): 320 runs
(one per layer, buffer and head) × 32 tokens of 256 bytes.

Local rows compare an executor with a plain ``copy_`` of the same number of bytes between two
touched contiguous buffers. NIXL rows run two processes (sender, receiver) and time from the
sender's first gather to the receiver's last scatter (CLOCK_MONOTONIC is shared by processes);
"raw" is one WRITE of the same bytes staging → staging. Every NIXL mode's result is checked
byte for byte once against the local executor.

    python bench/transfer.py [--device cuda] [--blocks 256] [--reps 3] [--skip-nixl]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from workers.executors import copy_local, gather, scatter, staging_layout  # noqa: E402
from workers.pools import allocate_pools, fill_pattern  # noqa: E402
from workers.testing.oracles import HeadSlice  # noqa: E402

TIMEOUT_S = 300.0


def head_slice(layout: str, layers: int) -> HeadSlice:
    """``HND``, ``NHD`` or a conversion ``HND>NHD`` / ``NHD>HND`` (sender > receiver layout)."""
    sender, _, receiver = layout.partition(">")
    return HeadSlice(sender, layers, 32, 128, 2, 2, 4, 0, 0, 2, receiver_layout=receiver or None)  # type: ignore[arg-type]


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def _best(fn, reps: int, device: str) -> float:
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def local_rows(layout: str, args: argparse.Namespace) -> list[tuple[str, float, float]]:
    import torch

    hs = head_slice(layout, args.layers)
    route = hs.route()
    n = args.blocks
    src = allocate_pools([hs.sender_spec(n)], args.device)
    dst = allocate_pools([hs.receiver_spec(n)], args.device)
    fill_pattern(0, src[0])
    fill_pattern(1, dst[0])
    ids = np.arange(n)
    rnd_s, rnd_d = np.random.default_rng(0).permutation(n), np.random.default_rng(1).permutation(n)
    nbytes = staging_layout(route, ids).nbytes
    a = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=args.device)
    b = torch.ones(nbytes, dtype=torch.uint8, device=args.device)
    plain = nbytes / _best(lambda: b.copy_(a), args.reps, args.device)
    staging = torch.empty(nbytes, dtype=torch.uint8, device=args.device)
    gather(route, src, ids, out=staging)
    cases = {
        "copy_local contiguous ids": lambda: copy_local(route, src, dst, ids, ids),
        "copy_local random ids": lambda: copy_local(route, src, dst, rnd_s, rnd_d),
        "gather contiguous ids": lambda: gather(route, src, ids, out=staging),
        "scatter contiguous ids": lambda: scatter(route, staging, dst, ids),
        "gather random ids": lambda: gather(route, src, rnd_s, out=staging),
    }
    if args.device == "cuda":
        cases["copy_local contiguous (strided)"] = lambda: copy_local(
            route, src, dst, ids, ids, method="strided"
        )
    rows = [("plain copy_", plain / 1e9, 1.0)]
    for name, fn in cases.items():
        rate = nbytes / _best(fn, args.reps, args.device)
        rows.append((name, rate / 1e9, rate / plain))
    # Consistency: direct copy == gather + scatter.
    copy_local(route, src, dst, rnd_s, rnd_d)
    want = dst[0].tensor.clone()
    fill_pattern(1, dst[0])
    scatter(route, gather(route, src, rnd_s), dst, rnd_d)
    assert torch.equal(dst[0].tensor, want), "gather+scatter differs from copy_local"
    return rows


# --- NIXL: two processes ----------------------------------------------------------------------


def _peer(role: str, cfg: dict[str, Any], cmds: Any, out: Any) -> None:
    """Process body: set up pools + transport, then serve ("go", mode, chunk) commands."""
    try:
        import torch

        from workers.transport.nixl import NixlTransport

        if cfg["torch_threads"]:
            torch.set_num_threads(cfg["torch_threads"])
        hs = head_slice(cfg["layout"], cfg["layers"])
        route = hs.route()
        n, device = cfg["blocks"], cfg["device"]
        ids = np.arange(n)
        size = staging_layout(route, ids).nbytes
        spec = hs.sender_spec(n) if role == "sender" else hs.receiver_spec(n)
        pools = allocate_pools([spec], device)
        fill_pattern(0 if role == "sender" else 1, pools[0])
        if role == "receiver":
            src = allocate_pools([hs.sender_spec(n)], device)
            fill_pattern(0, src[0])
            want = allocate_pools([hs.receiver_spec(n)], device)
            fill_pattern(1, want[0])
            copy_local(route, src, want, ids, ids)
            del src
        tr = NixlTransport(
            f"bench-{role}", pools, staging_bytes=size, progress_thread=cfg["progress_thread"]
        )
        out.put(("info", tr.peer_info().to_json()))
        peer = cmds.get(timeout=TIMEOUT_S)
        if role == "sender":
            tr.add_peer(peer)
        other = "bench-receiver" if role == "sender" else "bench-sender"
        k = 0
        while (cmd := cmds.get(timeout=TIMEOUT_S)) is not None:
            _, mode, chunk = cmd
            k += 1
            tag = b"%s-%d" % (mode.encode(), k)
            if role == "sender":
                t0 = time.monotonic()
                if mode == "raw":
                    tr.write_raw(other, size, tag=tag, timeout_s=TIMEOUT_S)
                elif mode == "staged":
                    tr.write_staged(other, route, ids, dst_offset=0, tag=tag, chunk_blocks=chunk,
                                    timeout_s=TIMEOUT_S)  # fmt: skip
                else:
                    tr.write_fragments(other, route, ids, ids, tag=tag, timeout_s=TIMEOUT_S)
                out.put(("t", t0))
            else:
                if mode == "staged":
                    tr.receive_staged(other, route, ids, offset=0, tag=tag, chunk_blocks=chunk,
                                      timeout_s=TIMEOUT_S)  # fmt: skip
                else:
                    tr.wait_notif(other, [tag], TIMEOUT_S)
                    _sync(device)
                t1 = time.monotonic()
                ok = None
                if mode != "raw":
                    ok = bool(torch.equal(pools[0].tensor, want[0].tensor))
                    fill_pattern(1, pools[0])  # next run must write everything again
                    _sync(device)
                out.put(("t", (t1, ok)))
        tr.close()
    except BaseException:
        out.put(("error", traceback.format_exc()))


def _get(q: Any, procs: list[Any]) -> Any:
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        try:
            kind, payload = q.get(timeout=0.5)
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                raise RuntimeError("a benchmark peer died or hung") from None
            continue
        if kind == "error":
            raise RuntimeError(payload)
        return payload


def nixl_rows(layout: str, args: argparse.Namespace) -> list[tuple[str, float, float, str]]:
    ctx = mp.get_context("spawn")
    cfg = {"layout": layout, "layers": args.layers, "blocks": args.blocks, "device": args.device,
           "progress_thread": not args.no_progress_thread,
           "torch_threads": args.peer_torch_threads}  # fmt: skip
    cmds = {r: ctx.Queue() for r in ("sender", "receiver")}
    outs = {r: ctx.Queue() for r in ("sender", "receiver")}
    procs = {
        r: ctx.Process(target=_peer, args=(r, cfg, cmds[r], outs[r]), daemon=True)
        for r in ("sender", "receiver")
    }
    for p in procs.values():
        p.start()
    plist = list(procs.values())
    try:
        infos = {r: _get(outs[r], plist) for r in procs}
        cmds["sender"].put(infos["receiver"])
        cmds["receiver"].put(infos["sender"])
        nbytes = staging_layout(head_slice(layout, args.layers).route(), np.arange(args.blocks))
        size = nbytes.nbytes
        modes = [("raw", None), ("staged", None)]
        modes += [("staged", c) for c in args.chunks]
        modes += [("fragments", None)]
        results = []
        for mode, chunk in modes:
            best, ok_all = float("inf"), True
            for _ in range(args.reps + 1):  # the first run warms up connections and pages
                cmds["receiver"].put(("go", mode, chunk))
                cmds["sender"].put(("go", mode, chunk))
                t0 = _get(outs["sender"], plist)
                t1, ok = _get(outs["receiver"], plist)
                ok_all = ok_all and ok is not False
                best = min(best, t1 - t0)
            results.append((mode, chunk, size / best, ok_all))
        raw = results[0][2]
        rows = []
        for mode, chunk, rate, ok in results:
            name = f"{mode}" + (f" chunk={chunk}" if chunk else "")
            check = "n/a" if mode == "raw" else ("ok" if ok else "MISMATCH")
            rows.append((name, rate / 1e9, rate / raw, check))
        return rows
    finally:
        for r in procs:
            cmds[r].put(None)
        for p in plist:
            p.join(30)
            if p.is_alive():
                p.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--chunks", type=int, nargs="*", default=[32, 64])
    parser.add_argument("--layouts", nargs="*", default=["HND", "NHD"])
    parser.add_argument("--skip-nixl", action="store_true")
    parser.add_argument("--skip-local", action="store_true")
    parser.add_argument(
        "--peer-torch-threads", type=int, default=0, help="torch intra-op threads in NIXL peers"
    )
    parser.add_argument(
        "--no-progress-thread", action="store_true", help="NIXL agents without progress thread"
    )
    args = parser.parse_args()
    import torch

    print(
        f"device={args.device} torch={torch.__version__} threads={torch.get_num_threads()} "
        f"cpus={os.cpu_count()} load(1m)={os.getloadavg()[0]:.1f} "
        f"nixl progress thread={'off' if args.no_progress_thread else 'on'}",
        flush=True,
    )
    for layout in args.layouts:
        hs = head_slice(layout, args.layers)
        route = hs.route()
        nbytes = staging_layout(route, np.arange(args.blocks)).nbytes
        seg = route.segments[0]
        print(
            f"\n{layout}: {args.blocks} blocks, {len(seg.runs)} runs × count "
            f"{seg.runs[0].count} × {seg.runs[0].len} B, {nbytes / 2**20:.0f} MiB per transfer"
        )
        if not args.skip_local:
            print(f"  {'local':34s} {'GB/s':>8s} {'vs copy_':>9s}")
            for name, gbps, ratio in local_rows(layout, args):
                print(f"  {name:34s} {gbps:8.2f} {ratio:9.2f}", flush=True)
        if args.skip_nixl:
            continue
        print(f"  {'NIXL, two processes':34s} {'GB/s':>8s} {'vs raw':>9s} {'bytes':>9s}")
        for name, gbps, ratio, check in nixl_rows(layout, args):
            print(f"  {name:34s} {gbps:8.2f} {ratio:9.2f} {check:>9s}", flush=True)


if __name__ == "__main__":
    main()
