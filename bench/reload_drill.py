"""Reload drill: a peer reloaded after a remote disconnect, in a loop, at the NixlTransport
level, to see whether NIXL/UCX crashes.

The sequence a generation rank once met before it segfaulted in ``libuct``: the first transfer
after a partition healed failed with ``NIXL_ERR_REMOTE_DISCONNECT``; the peer was reloaded
(``remove_remote_agent``, ``add_remote_agent``) while WRITEs to it were still posted and
notifications unread; an abort notice to another rank behind the partition failed; the next
``get_new_notifs`` crashed. One iteration here:

1. a zygote process (torch and NIXL imported, no agent) forks peers ``b`` and ``c`` (and, with
   ``--reload restarted``, ``b``'s successor under ``b``'s agent name), each a ``NixlTransport``
   with its own progress thread that notifies ``a`` every ``--peer-notif-ms`` until it stops,
   and hands their ``peer_info()`` to rank ``a``;
2. ``a`` loads ``b`` and ``c``, completes one small WRITE to each (connections up); ``b`` and ``c``
   are stopped (SIGSTOP: the partition, nothing more is read) and ``a`` posts ``--writes`` WRITEs
   of ``--write-mib`` MiB to each (``UCX_TLS=tcp``, loopback TCP): they stay queued;
3. ``b`` and ``c`` are killed (SIGKILL): the connections fail; ``a`` polls its WRITEs until one
   fails: the disconnect;
4. ``--order unsafe``: ``remove_peer(b)`` + ``add_peer(b)`` (``b``'s successor's endpoint, or with
   ``--reload dead`` ``b``'s own, which no longer answers) while the other WRITEs to ``b`` and ``c``
   are still posted and unreleased and notifications unread, a notification to ``c`` (fails,
   or is lost), then ``drain_notifications`` and polls for ``--settle-ms``, and a WRITE over the
   new connection to ``b``'s successor.
   ``--order safe`` (the handover since 75f1a41): every posted WRITE polled to its end or
   released, notifications drained, and only then the reload, the notice and the polls;
5. with ``--verify``: a fresh peer ``d`` gets one WRITE of ``a``'s pool (an iteration-specific
   pattern) and checks every byte: ``a``'s endpoint still works after the drill.

Rank ``a`` runs without NIXL's progress thread, as kvplane's workers do (``--progress-thread``
gives it one), in a child process with ``faulthandler`` on, ``UCX_HANDLE_ERRORS=bt`` (UCX's
native backtrace after faulthandler's) and UCX's log at ``diag`` (``warn`` logs nothing here;
``diag`` one line per reset connection) in a file of its own. A crash is an exit by signal,
counted against the iteration and phase it interrupted; its stderr (faulthandler, UCX's
backtrace) and the tail of UCX's log are kept, and a new rank process runs the iterations left.
A Python error in an iteration is counted as an error, not a crash. ``--crash-at N`` segfaults
rank ``a`` in iteration ``N`` on purpose, to check that accounting.

    python bench/reload_drill.py --order unsafe --iterations 200 --verify
    python bench/reload_drill.py --order safe --iterations 200 --verify
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import faulthandler
import itertools
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RANK = "drill-a"
POOL_SLOT_BYTES = 64 << 10
POOL_SLOTS = 32  # rank a's pool, written to the fresh peer d: 2 MiB
DETECT_TIMEOUT_S = 10.0
SPAWN_TIMEOUT_S = 60.0
VERIFY_TIMEOUT_S = 20.0
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """SIGKILL this process when its parent exits (Linux; a crashed rank leaves no peers)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _flush_c_streams() -> None:
    """UCX writes its log through stdio: flush it so a crash loses no line already logged."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).fflush(None)


def _read_line(fd: int, timeout_s: float) -> bytes | None:
    """One line from a pipe (None: EOF or timeout)."""
    buf = b""
    deadline = time.monotonic() + timeout_s
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 1)  # byte by byte: nothing after the line is consumed
        if not chunk:
            return None
        buf += chunk
    return buf


# --- peers: forked by a zygote ---------------------------------------------------------------


def _peer_main(cmd: dict[str, Any], out_fd: int) -> None:
    """A forked peer: publish its endpoint, then sleep until killed (or, ``verify``: wait for
    rank a's WRITE and report how many bytes differ from the pattern)."""
    code = 0
    try:
        _die_with_parent()
        os.dup2(2, 1)  # stdout is the zygote's channel to rank a: nothing else may write there
        from workers.pools import PoolSpec, allocate_pools, pattern_tensor
        from workers.transport.nixl import NixlTransport

        slots = int(cmd["pool_slots"])
        pools = allocate_pools([PoolSpec(0, POOL_SLOT_BYTES, POOL_SLOT_BYTES, slots)])
        t = NixlTransport(
            cmd["name"], pools, staging_bytes=int(cmd["staging_bytes"]), ucx_tls="tcp"
        )
        os.write(out_fd, (json.dumps(t.peer_info().to_json()) + "\n").encode())
        verify = cmd.get("verify")
        if verify is None:
            notify = cmd.get("notify")
            if notify is not None:  # notifications to rank a until stopped: grants, aborts
                t.add_peer(notify["rank"])
                for k in itertools.count():
                    with contextlib.suppress(Exception):
                        t.send_notif(RANK, b"n|%s|%d" % (cmd["name"].encode(), k))
                    time.sleep(notify["every_ms"] / 1000)
            while True:
                time.sleep(3600)
        try:
            t.wait_notif(RANK, [verify["tag"].encode()], timeout_s=VERIFY_TIMEOUT_S)
            want = pattern_tensor(int(verify["pattern"]), 0, pools[0].spec.nbytes)
            result = {"mismatched": int((pools[0].tensor != want).sum()), "nbytes": want.numel()}
        except Exception as e:
            result = {"error": f"{type(e).__name__}: {e}"}
        os.write(out_fd, (json.dumps(result) + "\n").encode())
        t.close()
    except BaseException:
        code = 1
        with contextlib.suppress(Exception):
            os.write(out_fd, (json.dumps({"error": traceback.format_exc()}) + "\n").encode())
    os._exit(code)


def zygote_main() -> None:
    """Fork peers on request (stdin/stdout, one JSON line each): no import per peer."""
    _die_with_parent()
    import nixl._api  # noqa: F401  (loaded once here; UCX itself loads in each peer)
    import torch  # noqa: F401

    import workers.transport.nixl  # noqa: F401

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # killed peers are reaped by the kernel
    children: dict[str, tuple[int, int]] = {}
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            reply: dict[str, Any]
            if cmd["op"] == "spawn":  # several at once: they start in parallel
                pipes = {}
                for peer in cmd["peers"]:
                    r, w = os.pipe()
                    pid = os.fork()
                    if pid == 0:
                        os.close(r)
                        _peer_main(peer, w)
                    os.close(w)
                    children[peer["key"]] = (pid, r)
                    pipes[peer["key"]] = (pid, r)
                reply = {}
                for key, (pid, r) in pipes.items():
                    got = _read_line(r, SPAWN_TIMEOUT_S)
                    info = json.loads(got) if got else {"error": "no endpoint from the peer"}
                    reply[key] = {"pid": pid, "info": info}
            elif cmd["op"] == "result":
                pid, r = children.pop(cmd["key"])
                got = _read_line(r, VERIFY_TIMEOUT_S + 5)
                os.close(r)
                reply = json.loads(got) if got else {"error": "the peer sent no result"}
            elif cmd["op"] == "forget":
                pid, r = children.pop(cmd["key"])
                os.close(r)
                reply = {}
            else:
                break
            sys.stdout.write(json.dumps(reply) + "\n")
            sys.stdout.flush()
    finally:
        for pid, _ in children.values():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


class Zygote:
    """Rank a's handle on the zygote process."""

    def __init__(self, log_path: Path) -> None:
        env = dict(os.environ, UCX_LOG_LEVEL="error")
        env.pop("UCX_LOG_FILE", None)
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--role", "zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(log_path, "ab"),  # noqa: SIM115 (the child holds it)
            env=env,
        )

    def ask(self, cmd: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the zygote exited ({self.proc.poll()})")
        return json.loads(line)

    def spawn(self, peers: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """Start peers, in parallel (key: ``name``, ``staging_bytes``, ``verify``); their pid
        and endpoint (``info``), by key."""
        reply = self.ask(
            {
                "op": "spawn",
                "peers": [
                    {
                        "key": key,
                        "name": p["name"],
                        "staging_bytes": p["staging_bytes"],
                        "pool_slots": POOL_SLOTS if p.get("verify") else 1,
                        "verify": p.get("verify"),
                        "notify": p.get("notify"),
                    }
                    for key, p in peers.items()
                ],
            }
        )
        for key, got in reply.items():
            if "error" in got["info"]:
                raise RuntimeError(f"peer {key} did not start: {got['info']['error']}")
        return reply

    def close(self) -> None:
        with contextlib.suppress(Exception):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# --- rank a ----------------------------------------------------------------------------------


_PHASE_TIMES: dict[str, float] = {}
_PHASE_AT = [0.0, ""]


def _phase(name: str) -> None:
    now = time.monotonic()
    if _PHASE_AT[1]:
        _PHASE_TIMES[str(_PHASE_AT[1])] = round((now - float(_PHASE_AT[0])) * 1000, 1)
    _PHASE_AT[:] = [now, name]
    _flush_c_streams()
    print(f"PHASE {name}", flush=True)


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:300]


def _poll_quiet(t: Any, p: Any) -> str | None:
    """Poll one WRITE: None while in flight, else ``done`` or the error."""
    from workers.transport import TransportError

    try:
        return "done" if t.poll(p) else None
    except TransportError as e:
        return _error(e)


def _write(t: Any, peer: str, offset: int, nbytes: int, notif: bytes, what: str) -> Any:
    """Post one WRITE of rank a's staging at ``offset`` into ``peer``'s staging at ``offset``."""
    import numpy as np

    info = t.peer_info_of(peer)
    remote = t.desc(np.array([info.staging_address + offset]), np.array([nbytes]), info.device_id)
    return t.post_write(peer, t.local_staging_desc(offset, nbytes), remote, notif, what)


def _wait(t: Any, p: Any, timeout_s: float) -> str:
    """Poll one WRITE to its end: ``done``, the error, or ``timeout``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = _poll_quiet(t, p)
        if state is not None:
            return state
        time.sleep(0.0005)
    return "timeout"


def rank_iteration(t: Any, zygote: Zygote, i: int, args: argparse.Namespace) -> dict[str, Any]:
    """One drill iteration on rank a's transport ``t`` (the steps of the module docstring)."""
    from workers.transport import TransportError

    nbytes = args.write_mib << 20
    out: dict[str, Any] = {"i": i}
    read = [0]

    def drain() -> None:
        read[0] += sum(len(msgs) for msgs in t.drain_notifications().values())

    _phase("spawn")
    names = {role: f"drill-{role}{i}" for role in ("b", "c")}
    notify = None
    if args.peer_notif_ms > 0:  # every peer sends rank a notifications until it stops
        notify = {"rank": t.peer_info().to_json(), "every_ms": args.peer_notif_ms}
    wanted = {
        role: {"name": name, "staging_bytes": args.writes * nbytes, "notify": notify}
        for role, name in names.items()
    }
    if args.reload == "restarted":  # b's successor under b's agent name, loaded at the reload
        wanted["b2"] = {**wanted["b"], "staging_bytes": 1 << 20}
    peers = zygote.spawn(wanted)
    _phase("load")
    for role in ("b", "c"):
        t.add_peer(peers[role]["info"])
        warm = _wait(t, _write(t, names[role], 0, 4096, b"warm", f"warm-up to {role}"), 10.0)
        if warm != "done":
            raise RuntimeError(f"warm-up WRITE to {role}: {warm}")
    if not args.no_stop:
        _phase("stop")
        for role in ("b", "c"):  # the partition: the peers stop reading, the WRITEs queue
            os.kill(int(peers[role]["pid"]), signal.SIGSTOP)
    _phase("post")
    pending = [
        (
            role,
            _write(t, names[role], k * nbytes, nbytes, b"w|%d|%d" % (i, k), f"write {k} to {role}"),
        )
        for k in range(args.writes)
        for role in ("b", "c")
    ]
    states: list[str | None] = [None] * len(pending)
    _phase("kill")
    for role in ("b", "c"):  # the connections fail
        os.kill(int(peers[role]["pid"]), signal.SIGKILL)
    t_kill = time.monotonic()
    _phase("detect")
    detected: str | None = None
    while detected is None and time.monotonic() - t_kill < DETECT_TIMEOUT_S:
        for j, (role, p) in enumerate(pending):
            if states[j] is None:
                states[j] = _poll_quiet(t, p)
                if states[j] not in (None, "done"):
                    detected = f"write to {role}: {states[j]}"
                    break
        if all(s is not None for s in states):
            break  # every WRITE completed before the kill: a notification shows it
        time.sleep(0.0005)
    if detected is None:
        try:
            t.send_notif(names["b"], b"ping")
        except TransportError as e:
            detected = f"notification to b: {_error(e)}"
    out["detect_ms"] = round((time.monotonic() - t_kill) * 1000, 1)
    out["detected"] = detected or "none"
    out["done_before_kill"] = states.count("done")

    def settle(window_s: float) -> None:
        """Polls of every WRITE still posted and notification reads, for ``window_s``."""
        end = time.monotonic() + window_s
        while True:
            for j, (_, p) in enumerate(pending):
                if states[j] is None:
                    states[j] = _poll_quiet(t, p)
            drain()
            if time.monotonic() >= end:
                return
            time.sleep(0.001)

    if args.order == "safe":  # the handover since 75f1a41: nothing posted, everything read
        _phase("release")
        end = time.monotonic() + 2.0
        settle(0.0)
        while any(s is None for s in states) and time.monotonic() < end:
            settle(0.01)
        for _, p in pending:
            t.release(p)
        drain()
    out["posted_at_reload"] = t.outstanding(names["b"]) + t.outstanding(names["c"])
    out["notifs_read_before_reload"] = read[0]
    _phase("reload")
    try:
        t.remove_peer(names["b"])
        target = peers["b2" if args.reload == "restarted" else "b"]["info"]
        t.add_peer(target)
        out["reload"] = "ok"
    except TransportError as e:
        out["reload"] = _error(e)
    _phase("notice")
    try:
        t.send_notif(names["c"], b"abort|%d" % i)
        out["notice"] = "sent"
    except TransportError as e:
        out["notice"] = _error(e)
    _phase("progress")
    drain()
    after = None
    if out["reload"] == "ok" and args.reload == "restarted":  # the new connection, used at once
        try:
            after = _write(t, names["b"], 0, 1 << 20, b"after", "after the reload")
        except TransportError as e:
            out["after_reload"] = _error(e)
    settle(args.settle_ms / 1000)
    if after is not None:
        out["after_reload"] = _wait(t, after, 10.0)
    _phase("cleanup")
    for _, p in pending:
        t.release(p)
    out["errors_seen"] = sum(s not in (None, "done") for s in states)
    out["notifs_read"] = read[0]
    for role in ("b", "c"):
        with contextlib.suppress(TransportError):
            t.remove_peer(names[role])
    for key, peer in peers.items():
        with contextlib.suppress(OSError):
            os.kill(int(peer["pid"]), signal.SIGKILL)
        zygote.ask({"op": "forget", "key": key})
    drain()
    if args.crash_at == i:  # self-check of the crash accounting: a real segfault, here
        _phase("crash-at")
        ctypes.string_at(0)
    if args.verify:
        _phase("verify")
        out["verify"] = verify_fresh_peer(t, zygote, i)
    return out


def verify_fresh_peer(t: Any, zygote: Zygote, i: int) -> str:
    """One WRITE of rank a's pool into a fresh peer's pool; ``ok`` when every byte arrived."""
    import numpy as np

    from workers.pools import fill_pattern

    pattern = 1 + i % 250
    pool = t.pools[0]
    fill_pattern(pattern, pool)
    name, tag = f"drill-d{i}", f"verify|{i}"
    verify = {"tag": tag, "pattern": pattern}
    d = zygote.spawn({"d": {"name": name, "staging_bytes": 1, "verify": verify}})["d"]
    t.add_peer(d["info"])
    info = t.peer_info_of(name)
    n = pool.spec.nbytes
    p = t.post_write(
        name,
        t.desc(np.array([pool.base_address]), np.array([n]), t.device_id),
        t.desc(np.array([info.pools[0].base_address]), np.array([n]), info.device_id),
        tag.encode(),
        "verify",
    )
    deadline = time.monotonic() + VERIFY_TIMEOUT_S
    try:
        while not t.poll(p):
            if time.monotonic() > deadline:
                return "the WRITE to the fresh peer did not complete"
            time.sleep(0.0005)
    except Exception as e:
        return f"WRITE to the fresh peer failed: {_error(e)}"
    finally:
        t.release(p)
    result = zygote.ask({"op": "result", "key": "d"})
    t.remove_peer(name)
    if "error" in result:
        return f"fresh peer: {result['error']}"
    if result["mismatched"]:
        return f"{result['mismatched']} of {result['nbytes']} bytes differ"
    return "ok"


def rank_main(args: argparse.Namespace) -> None:
    """Rank a: run iterations ``--start`` .. ``--iterations - 1``, one RESULT line each."""
    _die_with_parent()
    from workers.pools import PoolSpec, allocate_pools
    from workers.transport.nixl import NixlTransport

    out = Path(args.out)
    zygote = Zygote(out / "zygote.stderr")
    pools = allocate_pools([PoolSpec(0, POOL_SLOT_BYTES, POOL_SLOT_BYTES, POOL_SLOTS)])
    t = NixlTransport(
        RANK,
        pools,
        staging_bytes=args.writes * (args.write_mib << 20),
        ucx_tls="tcp",
        progress_thread=args.progress_thread,
    )
    t.reconnect_inline = False  # as the handover: reloads are the drill's own steps
    # After UCX loaded: UCX installs its fatal-signal handler (a native backtrace, into its log)
    # only over the default one, and faulthandler calls the handler it replaced after its own.
    faulthandler.enable(all_threads=True)
    try:
        for i in range(args.start, args.iterations):
            print(f"BEGIN {i}", flush=True)
            faulthandler.dump_traceback_later(args.iteration_timeout_s, exit=True)
            t0 = time.monotonic()
            try:
                result = rank_iteration(t, zygote, i, args)
            except Exception as e:
                result = {"i": i, "error": _error(e), "trace": traceback.format_exc()[-2000:]}
            faulthandler.cancel_dump_traceback_later()
            _phase("end")
            result["ms"] = round((time.monotonic() - t0) * 1000, 1)
            result["phase_ms"] = dict(_PHASE_TIMES)
            _PHASE_TIMES.clear()
            _PHASE_AT[:] = [0.0, ""]
            _flush_c_streams()
            print("RESULT " + json.dumps(result), flush=True)
    finally:
        zygote.close()
        t.close()


# --- runner ----------------------------------------------------------------------------------


def _tail(path: Path, nbytes: int = 20000) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-nbytes:].decode("utf-8", "replace")


def _ucx_logs(out: Path, pid: int) -> list[Path]:
    return sorted(out.glob(f"ucx-rank.{pid}.log*"))


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the drill: rank a in child processes, restarted after a crash."""
    out = Path(args.out or tempfile.mkdtemp(prefix=f"reload-drill-{args.order}-"))
    out.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    crashes: list[dict[str, Any]] = []
    start, starts = 0, 0
    t_run = time.monotonic()
    while start < args.iterations:
        starts += 1
        stderr_path = out / f"rank-{starts}.stderr"
        env = dict(
            os.environ,
            UCX_LOG_LEVEL=args.ucx_log_level,
            UCX_LOG_FILE=str(out / "ucx-rank.%p.log"),
            UCX_LOG_FILE_SIZE="4m",
            # this UCX build defaults to none: its native backtrace follows faulthandler's
            UCX_HANDLE_ERRORS="bt",
            PYTHONPATH=str(ROOT),
        )
        cmd = [sys.executable, __file__, "--role", "rank", "--start", str(start)]
        cmd += _forward(args) + ["--out", str(out)]
        with open(stderr_path, "wb") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=env)
        assert proc.stdout is not None
        current, phase = None, ""
        for raw in proc.stdout:
            line = raw.decode().rstrip("\n")
            if line.startswith("BEGIN "):
                current, phase = int(line.split()[1]), "begin"
            elif line.startswith("PHASE "):
                phase = line.split()[1]
            elif line.startswith("RESULT "):
                results.append(json.loads(line[7:]))
                current = None
                if not args.quiet:
                    _print_iteration(results[-1])
        rc = proc.wait()
        kind = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit {rc}"
        if current is None:
            if rc != 0:  # before the first iteration or after the last
                crashes.append({"i": None, "exit": kind, "phase": phase, "pid": proc.pid})
                crashes[-1]["faulthandler"] = _tail(stderr_path)
            break  # every iteration reported
        crash = {
            "i": current,
            "exit": kind,
            "phase": phase,
            "pid": proc.pid,
            "stderr": str(stderr_path),
            "faulthandler": _tail(stderr_path),
            "ucx_log": [str(p) for p in _ucx_logs(out, proc.pid)],
            "ucx_log_tail": "".join(_tail(p, 3000) for p in _ucx_logs(out, proc.pid)[-1:]),
        }
        crashes.append(crash)
        if not args.quiet:
            print(f"  iteration {current}: rank exited by {kind} in phase {phase}", flush=True)
        start = current + 1
    return summarize(args, out, results, crashes, time.monotonic() - t_run)


def _forward(args: argparse.Namespace) -> list[str]:
    flags = [
        "--order",
        args.order,
        "--iterations",
        str(args.iterations),
        "--writes",
        str(args.writes),
        "--write-mib",
        str(args.write_mib),
        "--settle-ms",
        str(args.settle_ms),
        "--iteration-timeout-s",
        str(args.iteration_timeout_s),
        "--crash-at",
        str(args.crash_at),
    ]
    if args.verify:
        flags.append("--verify")
    if args.progress_thread:
        flags.append("--progress-thread")
    if args.no_stop:
        flags.append("--no-stop")
    flags += ["--reload", args.reload, "--peer-notif-ms", str(args.peer_notif_ms)]
    return flags


def _print_iteration(r: dict[str, Any]) -> None:
    if "error" in r:
        print(f"  iteration {r['i']}: error {r['error']}", flush=True)
        return
    print(
        f"  iteration {r['i']}: {r['ms']:.0f} ms, detected in {r['detect_ms']:.0f} ms "
        f"({r['detected'][:60]}), posted at reload {r['posted_at_reload']}, "
        f"notice {r['notice'][:40]}" + (f", verify {r['verify']}" if "verify" in r else ""),
        flush=True,
    )


def summarize(
    args: argparse.Namespace,
    out: Path,
    results: list[dict[str, Any]],
    crashes: list[dict[str, Any]],
    wall_s: float,
) -> dict[str, Any]:
    ok = [r for r in results if "error" not in r]
    times = sorted(r["ms"] for r in results)
    signals = [c for c in crashes if str(c.get("exit", "")).startswith("signal")]
    return {
        "order": args.order,
        "iterations": args.iterations,
        "completed": len(results),
        "crashes": len(signals),
        "other_exits": len(crashes) - len(signals),
        "errors": len(results) - len(ok),
        "error_samples": [r["error"] for r in results if "error" in r][:5],
        "verified": sum(r.get("verify") == "ok" for r in ok),
        "verify_failures": [r["verify"] for r in ok if r.get("verify", "ok") != "ok"][:5],
        "detected_by_write": sum(r["detected"].startswith("write") for r in ok),
        "detected_by_notification": sum(r["detected"].startswith("notif") for r in ok),
        "undetected": sum(r["detected"] == "none" for r in ok),
        "posted_at_reload_mean": round(statistics.fmean(r["posted_at_reload"] for r in ok), 2)
        if ok
        else 0.0,
        "reload_failed": sum(r["reload"] != "ok" for r in ok),
        "notice_failed": sum(r["notice"] != "sent" for r in ok),
        "after_reload_done": sum(r.get("after_reload") == "done" for r in ok),
        "notifs_read_before_reload_mean": round(
            statistics.fmean(r.get("notifs_read_before_reload", 0) for r in ok), 1
        )
        if ok
        else 0.0,
        "ms_median": round(statistics.median(times), 1) if times else None,
        "ms_max": times[-1] if times else None,
        "wall_s": round(wall_s, 1),
        "out": str(out),
        "crash_details": crashes,
        "results": results,
        "settings": {
            "writes": args.writes,
            "write_mib": args.write_mib,
            "settle_ms": args.settle_ms,
            "progress_thread": args.progress_thread,
            "ucx_log_level": args.ucx_log_level,
            "reload": args.reload,
            "peer_notif_ms": args.peer_notif_ms,
            "stop_first": not args.no_stop,
        },
    }


def print_summary(s: dict[str, Any]) -> None:
    rows = [
        ("order", s["order"]),
        ("iterations run / asked", f"{s['completed'] + len(s['crash_details'])} / "
         f"{s['iterations']}"),
        ("crashes (exit by signal)", s["crashes"]),
        ("other abnormal exits", s["other_exits"]),
        ("iterations with a Python error", s["errors"]),
        ("disconnect seen by a WRITE / a notification / not", f"{s['detected_by_write']} / "
         f"{s['detected_by_notification']} / {s['undetected']}"),
        ("WRITEs posted at the reload (mean)", s["posted_at_reload_mean"]),
        ("reloads that failed", s["reload_failed"]),
        ("notices that failed", s["notice_failed"]),
        ("WRITEs over the reloaded connection done", s["after_reload_done"]),
        ("notifications read before the reload (mean)", s["notifs_read_before_reload_mean"]),
        ("fresh-peer transfers verified", s["verified"]),
        ("ms per iteration (median / max)", f"{s['ms_median']} / {s['ms_max']}"),
        ("wall s", s["wall_s"]),
        ("logs", s["out"]),
    ]  # fmt: skip
    width = max(len(k) for k, _ in rows)
    print()
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    for c in s["crash_details"]:
        print(f"\n--- iteration {c['i']}: {c['exit']} in phase {c['phase']} (pid {c['pid']})")
        if c.get("faulthandler"):
            print("faulthandler / stderr tail:\n" + c["faulthandler"][-3000:])
        if c.get("ucx_log_tail"):
            print("UCX log tail:\n" + c["ucx_log_tail"][-2000:])
    for e in s["error_samples"]:
        print(f"error: {e}")
    for v in s["verify_failures"]:
        print(f"verify: {v}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--order", choices=("unsafe", "safe"), default="unsafe")
    ap.add_argument("--iterations", type=int, default=100)
    ap.add_argument("--writes", type=int, default=4, help="WRITEs posted to each peer")
    ap.add_argument("--write-mib", type=int, default=16, help="MiB per WRITE")
    ap.add_argument("--settle-ms", type=int, default=200, help="polls after the notice")
    ap.add_argument(
        "--reload",
        choices=("restarted", "dead"),
        default="restarted",
        help="load b's successor (same agent name, answers) or b's own metadata again (dead)",
    )
    ap.add_argument(
        "--peer-notif-ms",
        type=float,
        default=2.0,
        help="each peer notifies rank a this often until it stops (0: never)",
    )
    ap.add_argument("--verify", action="store_true", help="a fresh peer's bytes, per iteration")
    ap.add_argument(
        "--progress-thread",
        action="store_true",
        help="rank a with NIXL's progress thread (kvplane's workers run without one)",
    )
    ap.add_argument(
        "--no-stop", action="store_true", help="kill the peers without stopping them first"
    )
    ap.add_argument(
        "--ucx-log-level",
        default="diag",
        help="rank a's UCX_LOG_LEVEL (warn logs nothing here; diag: every reset connection)",
    )
    ap.add_argument("--iteration-timeout-s", type=float, default=60.0)
    ap.add_argument("--crash-at", type=int, default=-1, help="self-check: segfault there")
    ap.add_argument("--out", help="logs (default: a new temporary folder)")
    ap.add_argument("--json", help="write the summary here")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--role", choices=("runner", "rank", "zygote"), default="runner")
    ap.add_argument("--start", type=int, default=0)
    args = ap.parse_args(argv)
    if args.role == "zygote":
        zygote_main()
        return 0
    if args.role == "rank":
        rank_main(args)
        return 0
    summary = run(args)
    print_summary(summary)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
