"""kvplane's vLLM connector against vLLM's own NixlConnector: what a user waits for, side by side.

Same machine, same model (the vLLM tier's small random-weight Llama), same prompts, the same
binding asked of both (prefill engine on core 0, or ``"0|1"`` at TP 2; decode engine on core 1),
engines started one at a time, each pair's decode first (an idle NixlConnector prefill at TP 2
keeps both cores busy, and a decode engine started after it did not come up in 10 minutes).
Needs the vLLM environment (``make vllm-env``)::

    .venv/bin/python bench/vllm_handover.py                     # everything: 10-13 h
    .venv/bin/python bench/vllm_handover.py --runs 1 --modes offline --tp 1 \\
        --prompt-tokens 128 --in-flight 1 --rounds 2              # a smoke run, ~2 min

Flags (defaults): ``--runs 3``; ``--modes offline,online``; ``--tp 1,2`` (the prefill's TP, the
decode is TP 1); ``--prompt-tokens 128,1000,2000``; ``--in-flight 1,4,8``; ``--rounds 6``
(measured rounds per cell and connector, after the cell's first round); ``--max-tokens 4``
(online); ``--settle-s 1.2`` (pause before every round); ``--isolation restart|freeze``;
``--nixl-affinity vllm|engine``; ``--idle-probe-s 3``; ``--round-timeout-s 300``; ``--seed 0``;
``--workdir DIR`` (keeps the engines' logs; a temporary folder otherwise); ``--first-run 1``,
``--save FILE`` and ``--summarize FILE...`` (below).

How a cell runs. Each round draws new random prompts (no engine has seen them: vLLM serves with
prefix caching on, and a repeated prompt would measure a cache hit), the same ones for both
connectors, and sends them to the pair's decode engine by itself first (**one engine**, no
``kv_transfer_params``; online with a ``cache_salt`` of its own, so the handover cannot reuse
those blocks), then through the pair (**P/D**). Every cell runs ``1 + --rounds`` rounds per
connector; the first is reported apart.

- **offline**: ``tests/vllm/engine.py`` engines over stdin. P/D is the prefill ``generate``
  (``max_tokens=1``, ``do_remote_decode``), then the decode ``generate`` with the returned
  ``kv_transfer_params``. An offline ``generate`` returns when its last request has its last
  token, so both legs and the one-engine call use ``max_tokens=1``: the time is then the batch's
  time to first token, one value per round (the in-flight requests finish together). The tokens
  check compares that one greedy token per request (with this model the first token depends on
  the whole context: a wrong KV changes it).
- **online**: two ``vllm.entrypoints.openai.api_server`` servers per connector (prefix caching on,
  as ``vllm serve`` defaults) and ``examples/vllm_proxy.py`` in front of them. A round starts its
  requests together; TTFT is, per request, the time to the first streamed chunk that carries a
  token (through the proxy for P/D, from the decode server for one engine), so a round gives one
  value per request. ``--max-tokens`` tokens are streamed and compared.

The tables, per run and mode, one row per cell (prefill TP → decode TP, prompt tokens, in flight):

- **TTFT p50**: the median over the cell's measured rounds (its first round left out);
- **kvplane ÷ Nixl**: the two TTFT p50s divided (below 1: kvplane is faster);
- **P/D ÷ one engine**: a connector's TTFT p50 over its decode engine's own TTFT p50 for the same
  prompts: what disaggregation costs a user here. The one-engine p50s are shown too (a
  NixlConnector engine serving alone still has NIXL's spinning thread on its core);
- **first round**: the cell's first round (offline the batch, online its slowest request); marked
  † where it includes first contact (pairing, connections);
- **tokens = one engine**: requests whose greedy tokens equal one engine's, over all rounds;
- **kvplane recorded**: kvplane transfers its control plane records as done for the cell, over
  the P/D requests sent. A request kvplane did not hand over (vLLM recomputed the prompt) would
  still decode right; this column would show it. NixlConnector has no such fallback: it loads or
  fails the request by ``kv_load_failure_policy``, and the bench checks that its prefill
  returned NixlConnector's params (offline).

The summary gives, per cell, the median over runs of each p50 with the runs' range, the median of
each run's ratios and the token counts summed over runs. Each run also prints what every engine
does idle: cores used over ``--idle-probe-s`` seconds, its busiest thread, and the cores its
``VLLM::Worker`` threads may run on.

Idle engines (vLLM CPU 0.32, NIXL 1.5, measured here with /proc): an idle kvplane engine uses
0.01-0.05 of a core, at TP 2 too (a decode engine once showed 0.33 and a TP 2 prefill 0.59, each
once, in the seconds after start-up); an idle NixlConnector engine at TP 1 uses 0.7-1.0 of a core,
all of it in NIXL's UCX progress thread, whether or not it has served a request; an idle
NixlConnector prefill at TP 2 used 1.1 to 2 cores (two ranks, each with such a thread; up to 77 %
system time). The two pairs therefore cannot idle side by side. During NixlConnector's own TP 2
rounds the decode engine gets what its prefill's ranks leave of the cores: this is what a user of
it gets here, and the bench measures it as such.

Isolation. ``--isolation restart`` (default), the fallback planned for idle engines that burn CPU:
for every cell, each connector gets a fresh pair, started, measured and stopped before the other's
starts; the cells alternate which connector goes first. The two never share the cores, every cell's
first round is a first contact, and rounds interleave only at the cell level. ``--isolation
freeze`` starts both pairs once per run, mode and TP and interleaves single rounds (kvplane, Nixl,
Nixl, kvplane, ...), keeping the idle NixlConnector pair stopped (``SIGSTOP`` to its process
groups, ``SIGCONT`` before its round; the kvplane pair is never stopped: its workers heartbeat the
control plane every second and count as gone after 10 s). It needs ~3.5 h less for the full run,
but it is not neutral to NixlConnector. Measured here (online, TP 1, 128 tokens, 1 in flight, 24
rounds each, the machine shared): never frozen, 1 round stalled ~30 s and 2 took 4-6 s; frozen for
4 s between rounds, 5 rounds took 13-31 s. Prefer ``restart`` for reported numbers.

Failures. With ``--isolation restart`` a connector's cell that fails (an engine that does not
start in 300 s, exits, or does not answer a round in ``--round-timeout-s``) is listed under the
run's table with the first line of its error (its log tail goes to stderr), keeps the rounds it
finished, and the run goes on with the next cell's fresh pair; the exit status is then 2. With
``--isolation freeze`` a failure ends the bench (status 1) after printing what was measured.

NixlConnector stalls. In both cases some NixlConnector rounds take 25-31 s. The prefill's log
then says "Releasing expired KV blocks ... retrieved by 0 remote worker(s) before lease expired"
and, seconds later, "Potentially invalid KV blocks ... were retrieved by a decode worker": the
decode read nothing for the 30 s lease (``kv_lease_duration``), then read blocks the prefill had
already freed. Their tokens matched one engine's, but for one TP 2 → TP 1 round (36 s, offline,
seen while building this bench): its decode's token differed. The bench leaves these rounds in
(they are what a user waits for); they raise the p50 only where they are frequent.

NixlConnector's core. On a CPU host its worker calls ``os.sched_setaffinity(0, [last core of each
NUMA node])`` (``nixl/base_worker.py``) after NIXL's progress thread exists. Observed here: the
worker's main thread, the one that runs the model, moves to core 1, and the progress thread stays
spinning on the engine's own core. A prefill engine bound to core 0 thus computes on core 1 beside
the decode engine (at TP 2, rank 0 does too), and core 0 holds only the spinning thread (the idle
table's "0, 1" for NixlConnector's prefill). ``--nixl-affinity vllm`` (default) measures that, as
a user gets it; ``--nixl-affinity engine`` moves the moved threads back to the engine's own core
after start-up, so both connectors compute on the same cores.

Time here (2 vCPUs; smoke runs of one 128-token cell, 1 + 2 rounds). TP 1, quiet machine: a
pair starts in ~45 s offline and ~55 s online; both modes took 3.8 min. TP 2, load average
8-28 from other work: pairs started in 70-150 s; offline took 3.9 min; online 9 min, most of it
NixlConnector's rounds (first round 253 s, then ~21 s each, its decode past the 30 s lease).
Estimated full default run (3 runs × 2 modes × 2 TPs × 9 cells, 216 pair starts, 7 rounds per
connector and cell): 10-13 hours: ~3.5-4.5 h of pair starts, ~1.5 h of kvplane's and TP 1
NixlConnector's rounds, and 5-7 h of NixlConnector's TP 2 rounds, the least certain part.
``--tp 1`` alone: ~2.5-3 h. ``--isolation freeze`` saves ~3.5 h of starts (see above for why it
is not the default). Run it on a quiet machine (the header prints the load average at the start).

Split over several invocations (a quiet window of a few hours each): ``--tp``, ``--modes``,
``--runs`` and ``--first-run N`` (the first run's number) choose the piece, ``--save FILE``
appends each measured cell to a JSON-lines file as its pair finishes (with the header it was
measured under), and ``--summarize FILE...`` prints the per-run tables and the summary of every
saved piece together, starting no engine::

    .venv/bin/python bench/vllm_handover.py --runs 1 --first-run 2 --tp 1 --save runs.jsonl
    .venv/bin/python bench/vllm_handover.py --summarize runs.jsonl
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import platform
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script

from workers.testing.engine import ControlPlane, free_port  # noqa: E402
from workers.testing.vllm_bed import (  # noqa: E402
    Engine,
    Process,
    connector_config,
    openai_server,
    proxy,
    vllm_missing,
    write_model,
)

CONNECTORS = ("kvplane", "nixl")
BLOCK_SIZE = 32  # the bed's engines and servers
MAX_MODEL_LEN = 2048  # the tier's model (and engine.py)
VOCAB = (5, 4000)  # token ids drawn for prompts, as workers.testing.vllm_bed.prompts does
START_TIMEOUT_S = 300.0  # one engine or server start: 45-70 s here, 100-160 s under load
RECORDS_TIMEOUT_S = 20.0  # kvplane's transfer records follow in batches, about a second behind
CLOCK_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
LOG_TAIL_CHARS = 3000
# START_ORDER: each pair starts its decode engine, then its prefill. An idle NixlConnector
# prefill at TP 2 keeps both cores busy (~2 cores, mostly system time, measured); a decode engine
# started after it got ~0.05 of a core and was not up after 10 minutes.


class BenchError(RuntimeError):
    """An engine, a server or a request failed; the message carries the logs' tails."""


# --- what is measured ------------------------------------------------------------------------


@dataclass(frozen=True)
class Cell:
    tp: int  # the prefill's TP; the decode is TP 1
    prompt_tokens: int
    in_flight: int


@dataclass
class Sample:
    """One connector's results in one cell of one run and mode."""

    ttft_s: list[float] = field(default_factory=list)  # measured rounds (P/D)
    alone_s: list[float] = field(default_factory=list)  # measured rounds (one engine)
    first_s: float | None = None
    first_contact: bool = False
    equal: int = 0
    requests: int = 0
    recorded: int | None = None  # kvplane only: transfers done on its control plane
    error: str | None = None  # why the connector's cell stopped (--isolation restart)


Results = dict[tuple[int, str, Cell, str], Sample]  # (run, mode, cell, connector)


def fresh_prompts(key: str, tokens: int, count: int) -> list[list[int]]:
    """``count`` prompts of ``tokens`` random ids, drawn from ``key`` (new for every round)."""
    rng = random.Random(key)
    return [[rng.randrange(*VOCAB) for _ in range(tokens)] for _ in range(count)]


# --- processes: CPU use, freezing, affinity --------------------------------------------------


def _stat_fields(path: Path) -> list[str] | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    return [text[text.find("(") + 1 : text.rfind(")")], *text[text.rfind(")") + 2 :].split()]


def _allowed_cores(pid: str, tid: str) -> str:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                return line.split()[1]
    return "?"


@dataclass(frozen=True)
class Thread:
    pid: str
    tid: str
    name: str
    cores: str  # Cpus_allowed_list


def session_threads(session: int) -> dict[Thread, int]:
    """Every thread of the processes in ``session`` (a process group started with
    ``start_new_session``), with the clock ticks it has used."""
    found: dict[Thread, int] = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        stat = _stat_fields(Path(f"/proc/{pid}/stat"))
        if stat is None or int(stat[4]) != session:  # [name, state, ppid, pgrp, session, ...]
            continue
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                task = _stat_fields(Path(f"/proc/{pid}/task/{tid}/stat"))
                if task is not None:
                    thread = Thread(pid, tid, task[0], _allowed_cores(pid, tid))
                    found[thread] = int(task[12]) + int(task[13])  # utime + stime
    return found


@dataclass(frozen=True)
class Idle:
    cores_used: float
    busiest: str
    worker_cores: str


def idle_use(sessions: dict[str, int], seconds: float) -> dict[str, Idle]:
    """What each process group uses over ``seconds`` while nobody sends it anything."""
    before = {name: session_threads(sid) for name, sid in sessions.items()}
    time.sleep(seconds)
    found = {}
    for name, sid in sessions.items():
        after = session_threads(sid)
        used = {
            t: (ticks - before[name].get(t, 0)) * CLOCK_TICK_S / seconds
            for t, ticks in after.items()
        }
        top = max(used, key=lambda t: used[t], default=None)
        busiest = "-" if top is None else f"{top.name} {used[top]:.2f} on {top.cores}"
        workers = sorted({t.cores for t in after if t.name.startswith("VLLM::Worker")})
        found[name] = Idle(sum(used.values()), busiest, ", ".join(workers) or "-")
    return found


def signal_group(session: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(session, signum)


def pin_back(session: int, last_core: int) -> int:
    """Move the threads that NixlConnector pinned to ``last_core`` back to their process's own
    core (the one core its other single-core threads are bound to); returns how many moved."""
    by_process: dict[str, list[Thread]] = {}
    for thread in session_threads(session):
        by_process.setdefault(thread.pid, []).append(thread)
    moved = 0
    for threads in by_process.values():
        own = {t.cores for t in threads if t.cores.isdigit()} - {str(last_core)}
        if len(own) != 1:
            continue  # unbound, or bound to the last core itself: nothing to undo
        core = int(own.pop())
        for thread in threads:
            if thread.cores == str(last_core):
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(int(thread.tid), {core})
                    moved += 1
    return moved


# --- the pairs -------------------------------------------------------------------------------


class Pair:
    """One connector's prefill and decode engines (online: servers and their proxy), alive for
    one run, mode and TP."""

    def __init__(
        self, connector: str, workdir: Path, model: Path, tp: int, args: argparse.Namespace
    ) -> None:
        self.connector = connector
        self.workdir = workdir / connector
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.model = model
        self.tp = tp
        self.dtype = "float32" if tp > 1 else "bfloat16"  # TP 2 and TP 1 agree only in float32
        self.args = args
        self.plane: ControlPlane | None = None
        self.sessions: dict[str, int] = {}  # name -> process group, for idle use and freezing
        self.frozen = False
        self.recorded_before = 0
        self.pinned_back = 0

    @property
    def freezes(self) -> bool:
        # See the module docstring: kvplane's workers heartbeat; with --isolation restart a pair
        # is never up beside the other.
        return self.connector == "nixl" and self.args.isolation == "freeze"

    def start(self) -> None:
        if self.connector == "kvplane":
            self.plane = ControlPlane(self.workdir)
            self.plane.start()
            assert self.plane.process is not None
            self.sessions["control plane"] = self.plane.process.pid
        self._start()

    def _started(self, name: str, session: int) -> None:
        """``name`` is up: apply ``--nixl-affinity`` and freeze it (NixlConnector)."""
        self.sessions[name] = session
        if self.connector == "nixl":
            if self.args.nixl_affinity == "engine":
                self.pinned_back += pin_back(session, max(os.sched_getaffinity(0)))
            if self.freezes:
                signal_group(session, signal.SIGSTOP)
                self.frozen = True

    def freeze(self) -> None:
        if self.freezes:
            for session in self.sessions.values():
                signal_group(session, signal.SIGSTOP)
            self.frozen = True

    def thaw(self) -> None:
        if self.frozen:
            for session in self.sessions.values():
                signal_group(session, signal.SIGCONT)
            self.frozen = False

    def recorded(self, expected: int) -> int:
        """kvplane transfers done on the control plane since the last call (waits for up to
        ``expected`` of them)."""
        assert self.plane is not None
        deadline = time.monotonic() + RECORDS_TIMEOUT_S
        while True:
            total = httpx.get(
                f"{self.plane.url}/v1/transfers",
                params={"status": "done", "context": "vllm-prefill", "limit": 1},
                timeout=10,
            ).json()["total"]
            if total - self.recorded_before >= expected or time.monotonic() > deadline:
                break
            time.sleep(0.25)
        found, self.recorded_before = total - self.recorded_before, total
        return int(found)

    def check_params(self, params: Sequence[Any]) -> None:
        key = "kvplane_context" if self.connector == "kvplane" else "remote_block_ids"
        if not all(isinstance(p, dict) and key in p for p in params):
            raise BenchError(f"{self.connector}: the prefill returned no handover: {params!r}")

    def stop(self) -> None:
        self.thaw()
        self._stop()
        if self.plane is not None:
            self.plane.stop()

    def _start(self) -> None:
        raise NotImplementedError

    def _stop(self) -> None:
        raise NotImplementedError

    def round(self, batch: list[list[int]]) -> tuple[list[float], list[float], int]:
        """P/D TTFTs, one-engine TTFTs, and how many requests' tokens equal one engine's."""
        raise NotImplementedError


class OfflinePair(Pair):
    def _start(self) -> None:
        self.engines: dict[str, Engine] = {}
        for name, core, tp in (  # decode first: see START_ORDER
            ("decode", "1", 1),
            ("prefill", "0|1" if self.tp > 1 else "0", self.tp),
        ):
            kvplane = self.connector == "kvplane"
            engine = Engine(
                self.workdir,
                self.model,
                name if kvplane else f"nixl-{name}",
                core,
                instance=f"vllm-{name}" if kvplane else None,
                control_plane=self.plane.url if self.plane else None,
                tp=tp,
                dtype=self.dtype,
                # NixlConnector's handshake listener: one port per engine (vLLM's default is
                # one port for all).
                env=None if kvplane else {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())},
                log_name=name,
            )
            self.engines[name] = engine
            if self._answer(name, START_TIMEOUT_S) != {"ready": True}:
                raise BenchError(
                    f"{self.connector} {name} did not start: {engine.log()[-LOG_TAIL_CHARS:]}"
                )
            self._started(name, engine.process.pid)

    def _answer(self, name: str, timeout_s: float) -> dict[str, Any]:
        try:
            return self.engines[name].read(timeout_s=timeout_s)
        except (RuntimeError, TimeoutError) as error:  # the message has the engine's log tail
            raise BenchError(f"{self.connector} {name}: {error}") from None

    def _generate(
        self, name: str, batch: list[list[int]], params: Sequence[Any] | None
    ) -> dict[str, Any]:
        self.engines[name].send(op="generate", prompts=batch, max_tokens=1, params=params)
        return self._answer(name, self.args.round_timeout_s)

    def round(self, batch: list[list[int]]) -> tuple[list[float], list[float], int]:
        started = time.perf_counter()
        alone = self._generate("decode", batch, None)
        alone_s = time.perf_counter() - started
        started = time.perf_counter()
        prefilled = self._generate("prefill", batch, [{"do_remote_decode": True}] * len(batch))
        self.check_params(prefilled["params"])
        decoded = self._generate("decode", batch, prefilled["params"])
        ttft_s = time.perf_counter() - started
        equal = sum(
            mine == theirs and "error" not in (finish or "")
            for mine, theirs, finish in zip(
                decoded["tokens"], alone["tokens"], decoded["finish"], strict=True
            )
        )
        return [ttft_s], [alone_s], equal

    def _stop(self) -> None:
        for engine in getattr(self, "engines", {}).values():
            engine.stop()


class OnlinePair(Pair):
    def _start(self) -> None:
        self.servers: dict[str, Process] = {}
        self.urls: dict[str, str] = {}
        self.client = httpx.Client(
            timeout=self.args.round_timeout_s, limits=httpx.Limits(max_connections=64)
        )
        self.pool = concurrent.futures.ThreadPoolExecutor(max(self.args.in_flight))
        for name, role, core in (  # decode first: see START_ORDER
            ("decode", "kv_consumer", "1"),
            ("prefill", "kv_producer", "0|1" if self.tp > 1 else "0"),
        ):
            tp = self.tp if name == "prefill" else 1
            if self.connector == "kvplane":
                assert self.plane is not None
                config = connector_config(role, f"vllm-{name}", self.plane.url)
                env = None
            else:
                config = json.dumps(
                    {"kv_connector": "NixlConnector", "kv_buffer_device": "cpu", "kv_role": role}
                )
                env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
            port = free_port()
            server = openai_server(
                self.workdir,
                self.model,
                name,
                config,
                core,
                port,
                prefix_caching=True,  # vllm serve's default
                env=env,
                args=("--tensor-parallel-size", str(tp), "--dtype", self.dtype),
            )
            self.servers[name] = server
            self.urls[name] = f"http://127.0.0.1:{port}"
            try:
                server.wait_ready(f"{self.urls[name]}/health", START_TIMEOUT_S)
            except (RuntimeError, TimeoutError) as error:
                raise BenchError(f"{self.connector} {name} server: {error}") from None
            self._started(name, server.process.pid)
        port = free_port()
        front = proxy(self.workdir, self.urls["prefill"], self.urls["decode"], port)
        self.servers["proxy"] = front
        self.urls["proxy"] = f"http://127.0.0.1:{port}"
        try:
            front.wait_ready(f"{self.urls['proxy']}/healthz", 60)
        except (RuntimeError, TimeoutError) as error:
            raise BenchError(f"{self.connector} proxy: {error}") from None
        self.sessions["proxy"] = front.process.pid
        self.freeze()  # NixlConnector's: its proxy too, with its servers

    def _failure(self, what: str) -> BenchError:
        """What failed, with the reason from whichever process exited or, else, every log."""
        for name, server in self.servers.items():
            code = server.process.poll()
            if code is not None:
                tail = server.log.read_text(errors="replace")[-LOG_TAIL_CHARS:]
                return BenchError(f"{self.connector} {name} exited ({code}) during {what}:\n{tail}")
        tails = "\n".join(
            f"--- {name}:\n{server.log.read_text(errors='replace')[-LOG_TAIL_CHARS // 2 :]}"
            for name, server in self.servers.items()
        )
        return BenchError(f"{self.connector}: {what} failed\n{tails}")

    def _stream(
        self, url: str, prompt: list[int], barrier: threading.Barrier, **more: Any
    ) -> tuple[float, list[int]]:
        body = {
            "model": str(self.model),
            "prompt": prompt,
            "max_tokens": self.args.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream": True,
            **more,
        }
        tokens: list[int] = []
        first_s: float | None = None
        barrier.wait()
        started = time.perf_counter()
        with self.client.stream("POST", f"{url}/v1/completions", json=body) as answer:
            if answer.status_code != 200:
                answer.read()
                raise self._failure(f"a completion ({answer.status_code}: {answer.text[:500]})")
            for line in answer.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise self._failure(f"a completion ({chunk['error']})")
                for choice in chunk.get("choices", []):
                    ids = choice.get("token_ids") or []
                    if ids and first_s is None:
                        first_s = time.perf_counter() - started
                    tokens += ids
        if first_s is None:
            raise self._failure("a completion (no token streamed)")
        return first_s, tokens

    def _together(
        self, url: str, batch: list[list[int]], **more: Any
    ) -> list[tuple[float, list[int]]]:
        barrier = threading.Barrier(len(batch))
        futures = [self.pool.submit(self._stream, url, prompt, barrier, **more) for prompt in batch]
        try:
            return [future.result() for future in futures]
        except httpx.HTTPError as error:
            barrier.abort()
            raise self._failure(f"a completion ({error!r})") from None

    def round(self, batch: list[list[int]]) -> tuple[list[float], list[float], int]:
        alone = self._together(self.urls["decode"], batch, cache_salt="one-engine")
        handed = self._together(self.urls["proxy"], batch)
        equal = sum(mine == theirs for (_, mine), (_, theirs) in zip(handed, alone, strict=True))
        return [t for t, _ in handed], [t for t, _ in alone], equal

    def _stop(self) -> None:
        if hasattr(self, "pool"):
            self.pool.shutdown(cancel_futures=True)
            self.client.close()
        for server in reversed(list(getattr(self, "servers", {}).values())):
            server.stop()


PAIRS: dict[str, type[Pair]] = {"offline": OfflinePair, "online": OnlinePair}


# --- the comparison --------------------------------------------------------------------------


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def started(
    connectors: Sequence[str],
    mode: str,
    workdir: Path,
    model: Path,
    tp: int,
    args: argparse.Namespace,
) -> Iterator[dict[str, Pair]]:
    """``connectors``' pairs, started one engine at a time (kvplane first: it is quiet while
    NixlConnector's engines start), always stopped."""
    pairs = {c: PAIRS[mode](c, workdir, model, tp, args) for c in connectors}
    try:
        for connector in connectors:
            _log(f"{workdir.name}: starting {connector}")
            pairs[connector].start()
        yield pairs
    finally:
        for connector, pair in pairs.items():
            try:
                pair.stop()
            except Exception as error:  # stop the other pair all the same
                _log(f"stopping {connector}: {error!r}")
            if pair.pinned_back:
                _log(f"--nixl-affinity engine moved {pair.pinned_back} {connector} threads back")


def probe_idle(pairs: dict[str, Pair], seconds: float) -> dict[str, Idle]:
    """Each pair idle on its own (the other frozen, or quiet)."""
    seen = {}
    for connector, pair in pairs.items():
        pair.thaw()
        seen.update({f"{connector} {n}": i for n, i in idle_use(pair.sessions, seconds).items()})
        pair.freeze()
    return seen


def run_cell(
    key: str,
    cell: Cell,
    pairs: dict[str, Pair],
    samples: dict[str, Sample],
    args: argparse.Namespace,
) -> None:
    """``1 + --rounds`` rounds of ``cell`` on ``pairs``; with two pairs their rounds interleave,
    the order flipping each round."""
    order = list(pairs)
    for index in range(1 + args.rounds):
        batch = fresh_prompts(f"{key}-{index}", cell.prompt_tokens, cell.in_flight)
        for connector in order if index % 2 == 0 else order[::-1]:
            pair, sample = pairs[connector], samples[connector]
            pair.thaw()
            time.sleep(args.settle_s)
            ttft_s, alone_s, equal = pair.round(batch)
            pair.freeze()
            sample.equal += equal
            sample.requests += len(batch)
            if index == 0:
                sample.first_s = max(ttft_s)
            else:
                sample.ttft_s += ttft_s
                sample.alone_s += alone_s
    if "kvplane" in pairs:
        samples["kvplane"].recorded = pairs["kvplane"].recorded(samples["kvplane"].requests)


def measure(
    run: int,
    mode: str,
    tp: int,
    workdir: Path,
    model: Path,
    args: argparse.Namespace,
    results: Results,
    idle: dict[tuple[int, str, int], dict[str, Idle]],
    on_cell: Callable[[], None] = lambda: None,
) -> None:
    """Every cell of one run, mode and TP, for both connectors (``--isolation``); ``on_cell``
    is called after each (``--save``)."""
    cells = [Cell(tp, t, n) for t in args.prompt_tokens for n in args.in_flight]
    name = f"run{run}-{mode}-tp{tp}"
    for position, cell in enumerate(cells):
        first_contact = position == 0 or args.isolation == "restart"
        samples = {c: Sample(first_contact=first_contact) for c in CONNECTORS}
        for connector in CONNECTORS:
            results[(run, mode, cell, connector)] = samples[connector]
    keys = {cell: f"{args.seed}-{name}-{cell.prompt_tokens}-{cell.in_flight}" for cell in cells}

    def samples_of(cell: Cell) -> dict[str, Sample]:
        return {c: results[(run, mode, cell, c)] for c in CONNECTORS}

    if args.isolation == "freeze":
        with started(CONNECTORS, mode, workdir / name, model, tp, args) as pairs:
            idle[(run, mode, tp)] = probe_idle(pairs, args.idle_probe_s)
            for cell in cells:
                _log(f"{name}: {cell}")
                run_cell(keys[cell], cell, pairs, samples_of(cell), args)
                on_cell()
        return
    for position, cell in enumerate(cells):  # restart: one pair at a time, fresh per cell
        order = CONNECTORS if position % 2 == 0 else CONNECTORS[::-1]
        for connector in order:
            where = workdir / f"{name}-cell{position}"
            try:
                with started((connector,), mode, where, model, tp, args) as pairs:
                    if position == 0:
                        seen = probe_idle(pairs, args.idle_probe_s)
                        idle.setdefault((run, mode, tp), {}).update(seen)
                    _log(f"{name}: {cell} {connector}")
                    run_cell(keys[cell], cell, pairs, samples_of(cell), args)
            except BenchError as error:  # this cell's pair only: the next cell starts afresh
                results[(run, mode, cell, connector)].error = str(error)
                _log(f"{name}: {cell} {connector} FAILED: {error}")
            on_cell()


# --- tables ----------------------------------------------------------------------------------


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{1e3 * seconds:.1f}" if seconds < 0.1 else f"{1e3 * seconds:.0f}"


def _p50(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _r(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


HEADER = (
    "| TP | prompt | in flight | TTFT p50 kvplane (ms) | TTFT p50 Nixl (ms) | kvplane ÷ Nixl | "
    "P/D ÷ one engine, kvplane | P/D ÷ one engine, Nixl | one engine p50, kvplane / Nixl (ms) | "
    "first round kvplane (ms) | first round Nixl (ms) | tokens = one engine, kvplane | "
    "tokens = one engine, Nixl | kvplane recorded |"
)
RULE = "|---" * HEADER.count(" | ") + "|---|"


@dataclass(frozen=True)
class Row:
    """One cell's numbers, from one run or as medians over runs."""

    ttft: dict[str, float | None]
    alone: dict[str, float | None]
    first: dict[str, float | None]
    speed_ratio: float | None
    pd_ratio: dict[str, float | None]
    equal: dict[str, tuple[int, int]]
    recorded: tuple[int, int] | None
    first_contact: bool
    failed: dict[str, int]  # cells (per run: 0 or 1; summary: runs) whose rounds stopped early
    spread: dict[str, tuple[float, float]] = field(default_factory=dict)


def row_of(samples: dict[str, Sample]) -> Row:
    ttft = {c: _p50(s.ttft_s) for c, s in samples.items()}
    alone = {c: _p50(s.alone_s) for c, s in samples.items()}
    k = samples["kvplane"]
    return Row(
        ttft=ttft,
        alone=alone,
        first={c: s.first_s for c, s in samples.items()},
        speed_ratio=_ratio(ttft["kvplane"], ttft["nixl"]),
        pd_ratio={c: _ratio(ttft[c], alone[c]) for c in CONNECTORS},
        equal={c: (s.equal, s.requests) for c, s in samples.items()},
        recorded=None if k.recorded is None else (k.recorded, k.requests),
        first_contact=k.first_contact,
        failed={c: int(s.error is not None) for c, s in samples.items()},
    )


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summary_row(rows: list[Row]) -> Row:
    def total(pairs: list[tuple[int, int] | None]) -> tuple[int, int]:
        present = [p for p in pairs if p is not None]
        return sum(p[0] for p in present), sum(p[1] for p in present)

    spread = {}
    for c in CONNECTORS:
        values = [v for v in (r.ttft[c] for r in rows) if v is not None]
        if len(values) > 1:
            spread[c] = (min(values), max(values))
    return Row(
        ttft={c: _median([r.ttft[c] for r in rows]) for c in CONNECTORS},
        alone={c: _median([r.alone[c] for r in rows]) for c in CONNECTORS},
        first={c: _median([r.first[c] for r in rows]) for c in CONNECTORS},
        speed_ratio=_median([r.speed_ratio for r in rows]),
        pd_ratio={c: _median([r.pd_ratio[c] for r in rows]) for c in CONNECTORS},
        equal={c: total([r.equal[c] for r in rows]) for c in CONNECTORS},
        recorded=total([r.recorded for r in rows]) if any(r.recorded for r in rows) else None,
        first_contact=rows[0].first_contact,
        failed={c: sum(r.failed[c] for r in rows) for c in CONNECTORS},
        spread=spread,
    )


def print_row(cell: Cell, row: Row) -> None:
    def ttft(c: str) -> str:
        text = _ms(row.ttft[c])
        if c in row.spread:
            low, high = row.spread[c]
            text += f" ({_ms(low)}-{_ms(high)})"
        if row.failed[c]:
            text += f" failed ×{row.failed[c]}"
        return text

    mark = " †" if row.first_contact else ""
    counts = {c: f"{row.equal[c][0]}/{row.equal[c][1]}" for c in CONNECTORS}
    recorded = "-" if row.recorded is None else f"{row.recorded[0]}/{row.recorded[1]}"
    print(
        f"| {cell.tp} → 1 | {cell.prompt_tokens} | {cell.in_flight} | {ttft('kvplane')} | "
        f"{ttft('nixl')} | {_r(row.speed_ratio)} | {_r(row.pd_ratio['kvplane'])} | "
        f"{_r(row.pd_ratio['nixl'])} | {_ms(row.alone['kvplane'])} / {_ms(row.alone['nixl'])} | "
        f"{_ms(row.first['kvplane'])}{mark} | {_ms(row.first['nixl'])}{mark} | "
        f"{counts['kvplane']} | {counts['nixl']} | {recorded} |"
    )


def print_run(
    run: int, mode: str, results: Results, idle: dict[tuple[int, str, int], dict[str, Idle]]
) -> None:
    cells = [cell for (r, m, cell, c) in results if r == run and m == mode and c == "kvplane"]
    if not cells:
        return
    print(f"\n## Run {run}, {mode}\n")
    print(HEADER)
    print(RULE)
    for cell in cells:
        print_row(cell, row_of({c: results[(run, mode, cell, c)] for c in CONNECTORS}))
    failures = [
        (cell, c, results[(run, mode, cell, c)].error)
        for cell in cells
        for c in CONNECTORS
        if results[(run, mode, cell, c)].error
    ]
    if failures:
        print("\nFailed cells (their rounds so far are in the row; full logs on stderr):\n")
        for cell, c, error in failures:
            first = (error or "").strip().splitlines()[0][:300]
            print(
                f"- TP {cell.tp} → 1, {cell.prompt_tokens} tokens, {cell.in_flight} in flight, "
                f"{c}: {first}"
            )
    for tp in sorted({cell.tp for cell in cells}):
        seen = idle.get((run, mode, tp))
        if not seen:
            continue
        print(f"\nIdle, TP {tp} → 1 (each pair alone, the other frozen or quiet):\n")
        print(
            "| process group | cores used | busiest thread (cores used, allowed cores) | "
            "VLLM::Worker threads' allowed cores |"
        )
        print("|---|---|---|---|")
        for name, use in seen.items():
            print(f"| {name} | {use.cores_used:.2f} | {use.busiest} | {use.worker_cores} |")
    sys.stdout.flush()


def print_summary(modes: Sequence[str], results: Results) -> None:
    runs = sorted({r for (r, _, _, _) in results})
    print(f"\n## Summary: median over {len(runs)} run(s) of each cell's p50 (range over runs)")
    for mode in modes:
        cells = list(
            dict.fromkeys(cell for (_, m, cell, c) in results if m == mode and c == "kvplane")
        )
        if not cells:
            continue
        print(f"\n### {mode}\n")
        print(HEADER)
        print(RULE)
        for cell in cells:
            rows = [
                row_of({c: results[(r, mode, cell, c)] for c in CONNECTORS})
                for r in runs
                if (r, mode, cell, "kvplane") in results
            ]
            print_row(cell, summary_row(rows))
    print(
        "\n† the cell's first round includes first contact (pairing, connections): every "
        "cell with --isolation restart, a pair's first cell with --isolation freeze. TTFT "
        "p50s exclude each cell's first round."
    )


def header(args: argparse.Namespace) -> str:
    cpu = platform_cpu()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (
        f"# vLLM handover, kvplane vs NixlConnector · {time.strftime('%Y-%m-%d %H:%M')} · {cpu} · "
        f"{len(os.sched_getaffinity(0))} cores · {args.runs} run(s) · "
        f"modes {', '.join(args.modes)} · "
        f"1 + {args.rounds} rounds per cell · bfloat16 at TP 1 → 1, float32 at TP 2 → 1 · "
        f"block size {BLOCK_SIZE} · online: prefix caching on, {args.max_tokens} tokens; "
        f"offline: 1 token · settle {args.settle_s} s · NixlConnector affinity: "
        f"{args.nixl_affinity} · isolation: {args.isolation} · load average at start {load}"
    )


def platform_cpu() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


# --- main ------------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _modes(text: str) -> list[str]:
    modes = [m for m in text.split(",") if m]
    unknown = set(modes) - set(PAIRS)
    if unknown or not modes:
        raise argparse.ArgumentTypeError(f"modes are offline and online, not {sorted(unknown)}")
    return modes


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="whole comparisons (default 3)")
    parser.add_argument(
        "--first-run", type=int, default=1, help="the number of the first run (pieces of a run)"
    )
    parser.add_argument(
        "--save",
        type=Path,
        default=None,
        help="append every cell's samples to this JSON-lines file",
    )
    parser.add_argument(
        "--summarize",
        type=Path,
        nargs="+",
        default=None,
        help="print the tables of these --save files (no engines start)",
    )
    parser.add_argument("--modes", type=_modes, default=["offline", "online"])
    parser.add_argument("--tp", type=_ints, default=[1, 2], help="prefill TP: 1, 2 or both")
    parser.add_argument("--prompt-tokens", type=_ints, default=[128, 1000, 2000])
    parser.add_argument("--in-flight", type=_ints, default=[1, 4, 8])
    parser.add_argument("--rounds", type=int, default=6, help="measured rounds per cell (+1 first)")
    parser.add_argument("--max-tokens", type=int, default=4, help="tokens per online request")
    parser.add_argument("--settle-s", type=float, default=1.2, help="pause before every round")
    parser.add_argument(
        "--nixl-affinity",
        choices=("vllm", "engine"),
        default="vllm",
        help="leave NixlConnector's last-core pinning (vllm) or undo it (engine)",
    )
    parser.add_argument(
        "--isolation",
        choices=("freeze", "restart"),
        default="restart",
        help="freeze the idle NixlConnector pair between rounds, or restart both pairs per cell",
    )
    parser.add_argument("--idle-probe-s", type=float, default=3.0)
    parser.add_argument("--round-timeout-s", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=None, help="keep logs here")
    args = parser.parse_args(argv)
    if any(tp not in (1, 2) for tp in args.tp):
        parser.error("--tp: 1 or 2 (two cores)")
    if args.runs < 1 or args.rounds < 1 or min(args.in_flight) < 1 or args.first_run < 1:
        parser.error("--runs, --first-run, --rounds and --in-flight must be at least 1")
    if max(args.prompt_tokens) + args.max_tokens > MAX_MODEL_LEN or min(args.prompt_tokens) < 1:
        parser.error(f"prompts of 1 to {MAX_MODEL_LEN - args.max_tokens} tokens")
    return args


@contextlib.contextmanager
def _workdir(path: Path | None) -> Iterator[Path]:
    if path is not None:
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="kvplane-vllm-bench-") as tmp:
        yield Path(tmp)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    if args.summarize:
        return summarize(args.summarize)
    missing = vllm_missing()
    if missing:
        sys.exit(f"vllm_handover: {missing}")
    # A plain kill must still stop the engines (the finally blocks), frozen ones included.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results: Results = {}
    idle: dict[tuple[int, str, int], dict[str, Idle]] = {}
    started = time.monotonic()
    measured_under = header(args)
    print(measured_under, flush=True)
    failure: BaseException | None = None
    printed: set[tuple[int, str]] = set()
    saved: set[tuple[int, str, Cell, str]] = set()
    with _workdir(args.workdir) as workdir:
        model = write_model(workdir)
        try:
            for run in range(args.first_run, args.first_run + args.runs):
                for mode in args.modes:
                    for tp in args.tp:
                        measure(
                            run,
                            mode,
                            tp,
                            workdir,
                            model,
                            args,
                            results,
                            idle,
                            lambda: save(args, results, saved, measured_under),
                        )
                    print_run(run, mode, results, idle)
                    printed.add((run, mode))
        except (Exception, KeyboardInterrupt, SystemExit) as error:
            failure = error
            if not isinstance(error, BenchError | KeyboardInterrupt | SystemExit):
                traceback.print_exc()
            # what the failed run measured before it failed
            save(args, results, saved, measured_under)
            for run, mode in dict.fromkeys((r, m) for (r, m, _, _) in results):
                if (run, mode) not in printed:
                    print_run(run, mode, results, idle)
    print_summary(args.modes, results)
    print(f"\nWall time: {(time.monotonic() - started) / 60:.1f} min", flush=True)
    if failure is not None:
        print(f"\nvllm_handover FAILED: {failure}", file=sys.stderr)
        return 1
    failed = sum(sample.error is not None for sample in results.values())
    if failed:
        print(f"\nvllm_handover: {failed} connector cell(s) failed (listed above)", file=sys.stderr)
        return 2
    return 0


# --- runs split over several invocations -----------------------------------------------------


def save(
    args: argparse.Namespace,
    results: Results,
    saved: set[tuple[int, str, Cell, str]],
    measured_under: str,
) -> None:
    """Append to ``--save`` the samples not written yet, one JSON line each, with what the run
    was measured under (the header printed at its start)."""
    if args.save is None:
        return
    with args.save.open("a") as out:
        for key, sample in results.items():
            if key in saved or (not sample.requests and sample.error is None):
                continue  # written, or a cell not measured yet
            run, mode, cell, connector = key
            line = {
                "run": run,
                "mode": mode,
                "cell": asdict(cell),
                "connector": connector,
                "sample": asdict(sample),
                "header": measured_under,
            }
            out.write(json.dumps(line) + "\n")
            saved.add(key)


def load(paths: Sequence[Path]) -> tuple[Results, list[str]]:
    """The samples of ``--save`` files (a later line for the same run, mode, cell and
    connector replaces an earlier one) and the distinct headers they were measured under."""
    results: Results = {}
    headers: list[str] = []
    for path in paths:
        try:
            texts = path.read_text().splitlines()
        except OSError as error:
            sys.exit(f"vllm_handover: {path}: cannot read it ({error.strerror})")
        for number, text in enumerate(texts, 1):
            if not text.strip():
                continue
            try:
                line = json.loads(text)
                key = (
                    int(line["run"]),
                    str(line["mode"]),
                    Cell(**line["cell"]),
                    str(line["connector"]),
                )
                results[key] = Sample(**line["sample"])
            except (ValueError, KeyError, TypeError) as error:
                sys.exit(f"vllm_handover: {path}:{number}: not a saved sample ({error})")
            if line.get("header") and line["header"] not in headers:
                headers.append(line["header"])
    for run, mode, cell, _ in list(results):  # a connector a failed piece never reached
        for connector in CONNECTORS:
            results.setdefault((run, mode, cell, connector), Sample())
    return results, headers


def summarize(paths: Sequence[Path]) -> int:
    """``--summarize``: the per-run tables and the summary of saved samples."""
    results, headers = load(paths)
    if not results:
        sys.exit("vllm_handover: no saved samples in " + ", ".join(map(str, paths)))
    print("# vLLM handover, kvplane vs NixlConnector: saved runs\n")
    print("Measured under:\n")
    for line in headers:
        print(f"- {line.removeprefix('# ')}")
    modes = [m for m in ("offline", "online") if any(k[1] == m for k in results)]
    for run in sorted({k[0] for k in results}):
        for mode in modes:
            print_run(run, mode, results, {})
    print_summary(modes, results)
    return 2 if any(sample.error is not None for sample in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
