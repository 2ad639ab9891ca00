"""Worker metrics and the batched record (``workers/metrics.py``, ``workers/records.py``), with
resolved handles and a stub control plane: no NIXL, no server."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

import workers.fillcheck as fillcheck_module
from api.client import ApiError, TransportError, UnavailableError
from workers.agent import Worker
from workers.directory import PlanEntry
from workers.executors import GATHER_MAX
from workers.handover import ARRIVED, FAILED, RELEASED, Handle
from workers.metrics import WorkerMetrics, describe_worker, instrument
from workers.records import Recorder

ROOT = Path(__file__).resolve().parents[2]

ENTRY = PlanEntry(
    pairing_id="p1",
    context="ctx",
    generation="gen",
    context_epoch="ce",
    generation_epoch="ge",
    context_dp_rank=None,
    generation_dp_rank=None,
    senders=(0, 1),
    receivers=(0,),
    routes=(),
    route_dicts=(),
)


class StubClient:
    """A control plane that answers record batches from a script of outcomes."""

    def __init__(self, outcomes: Sequence[Exception | None] = ()) -> None:
        self.outcomes = list(outcomes)
        self.batches: list[list[Mapping[str, Any]]] = []
        self.calls = 0
        self.lock = threading.Lock()

    def record_transfers(self, worker_id: str, records: Sequence[Mapping[str, Any]]) -> Any:
        with self.lock:
            self.calls += 1
            if any(record.get("bad") for record in records):
                raise ApiError(422, "validation_error", "bad record")
            outcome = self.outcomes.pop(0) if self.outcomes else None
            if outcome is not None:
                raise outcome
            self.batches.append(list(records))
        return {"accepted": len(records), "settled": []}


def resolved(
    side: str,
    state: str,
    nbytes: int = 100,
    seconds: float = 0.002,
    reason: str | None = None,
    **context: Any,
) -> Handle:
    handle = Handle(f"r-{side}-{state}", side, "gen" if side == "send" else "ctx", ENTRY, 30.0)
    handle.blocks = {"0": {"context": [1], "generation": [2]}}
    for key, value in context.items():  # what send/expect sets, else the caller's extras
        if hasattr(handle, key):
            setattr(handle, key, value)
        else:
            handle.context[key] = value
    handle.bytes = nbytes
    handle._resolve(state, reason)
    assert handle.finished_at is not None
    handle.started_at = handle.finished_at - seconds
    return handle


@pytest.fixture
def worker() -> Worker:
    agent = Worker(StubClient(), "ctx", 1, device="cpu")  # type: ignore[arg-type]
    agent.worker_id = "w-1"
    return agent


@pytest.fixture
def receiver() -> Worker:
    """Rank 0 of a generation instance in fill mode; each test hands its check the pools."""
    agent = Worker(StubClient(), "gen", 0, device="cpu", fill=True)  # type: ignore[arg-type]
    agent.worker_id = "w-0"
    return agent


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def test_handovers_are_counted_by_side_and_outcome(worker: Worker) -> None:
    registry = CollectorRegistry()
    metrics = WorkerMetrics.create(registry)
    instrument(worker, metrics)
    instrument(worker, metrics)  # idempotent: one listener, no double counts
    for handle in (
        resolved("send", RELEASED),
        resolved("send", RELEASED, nbytes=50),
        resolved("send", FAILED, reason="deadline"),
        resolved("receive", ARRIVED, nbytes=7),
    ):
        worker._on_finished(handle)

    def count(name: str, **labels: str) -> float:
        return value(registry, name, **labels)

    # The handles' peers: "gen" for the sends, "ctx" for the receive (resolved() above).
    handovers = "kvplane_worker_handovers_total"
    assert count(handovers, peer="gen", side="send", outcome=RELEASED) == 2
    assert count(handovers, peer="gen", side="send", outcome=FAILED) == 1
    assert count(handovers, peer="ctx", side="receive", outcome=ARRIVED) == 1
    assert count(handovers, peer="ctx", side="send", outcome=RELEASED) == 0
    assert count("kvplane_worker_bytes_moved_total", peer="gen", side="send") == 150  # not failed
    assert count("kvplane_worker_bytes_moved_total", peer="ctx", side="receive") == 7
    seconds = "kvplane_worker_handover_seconds"
    assert count(f"{seconds}_count", peer="gen", side="send", outcome=RELEASED) == 2
    assert count(f"{seconds}_sum", peer="gen", side="send", outcome=RELEASED) == pytest.approx(
        0.004, abs=1e-5
    )
    assert (worker.stats.sent, worker.stats.received, worker.stats.failed) == (2, 1, 1)
    assert worker.stats.errors == ["deadline"]


def test_worker_info_names_the_rank(worker: Worker) -> None:
    registry = CollectorRegistry()
    describe_worker(worker, WorkerMetrics.create(registry))
    assert (
        value(
            registry,
            "kvplane_worker_info",
            kv_instance="ctx",
            rank="1",
            device="cpu",
            worker_id="w-1",
        )
        == 1
    )


def test_the_record_of_a_handle_names_its_transfer_and_epochs(worker: Worker) -> None:
    engine = worker._record(resolved("send", RELEASED), None)
    assert (engine["pairing_id"], engine["context_epoch"], engine["generation_epoch"]) == (
        "p1",
        "ce",
        "ge",
    )
    assert engine["status"] == "done" and "transfer_id" not in engine
    assert engine["blocks"] == {"0": {"context": [1], "generation": [2]}}  # creates the row
    rest = worker._record(
        resolved("receive", FAILED, reason="peer_restarted: x", transfer_id="t1", attempt=2), None
    )
    assert (rest["transfer_id"], rest["attempt"], rest["status"], rest["error"]) == (
        "t1",
        2,
        "failed",
        "peer_restarted: x",
    )
    assert "blocks" not in rest


def _wait(predicate: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_records_are_batched_by_count_or_interval() -> None:
    client = StubClient()
    recorder = Recorder(client, lambda: "w-1", batch=5, interval_s=3600)  # type: ignore[arg-type]
    try:
        for i in range(4):
            recorder.add({"n": i})
        time.sleep(0.2)
        assert client.batches == []  # four of five, and the interval is far away
        recorder.add({"n": 4})
        _wait(lambda: client.batches)
        assert [r["n"] for r in client.batches[0]] == [0, 1, 2, 3, 4]
        recorder.add({"n": 5}, urgent=True)  # somebody waits for it: at once
        _wait(lambda: len(client.batches) == 2)
    finally:
        recorder.close()
    assert recorder.pending == 0 and recorder.posted == 6


def test_records_ride_an_outage_and_none_is_lost() -> None:
    down = [
        TransportError(0, "unreachable", "refused"),
        UnavailableError(503, "busy", "x"),
        TransportError(0, "unreachable", "refused"),
    ]
    client = StubClient(down)
    recorder = Recorder(client, lambda: "w-1", batch=1, interval_s=0.05)  # type: ignore[arg-type]
    try:
        for i in range(20):
            recorder.add({"n": i})
        _wait(lambda: recorder.posted == 20, timeout_s=30)
    finally:
        recorder.close()
    delivered = [r["n"] for batch in client.batches for r in batch]
    assert sorted(delivered) == list(range(20)) and len(delivered) == 20
    assert client.calls == len(client.batches) + 3 and recorder.failures == 3


def test_a_refused_record_is_dropped_alone_and_not_retried_forever() -> None:
    client = StubClient()
    recorder = Recorder(client, lambda: "w-1", batch=3, interval_s=3600)  # type: ignore[arg-type]
    try:
        recorder.add({"n": 0})
        recorder.add({"n": 1, "bad": True})
        recorder.add({"n": 2})  # one batch of three: refused, then split
        _wait(lambda: recorder.pending == 0)
    finally:
        recorder.close()
    assert sorted(r["n"] for batch in client.batches for r in batch) == [0, 2]
    assert recorder.posted == 2


def test_a_record_refused_with_any_4xx_is_dropped_and_later_records_flow() -> None:
    """A refusal the worker cannot fix (413, or a 4xx this worker does not know) must not stay
    at the head of the queue: the records behind it would never be posted."""

    class Refusing(StubClient):
        def record_transfers(self, worker_id: str, records: Sequence[Mapping[str, Any]]) -> Any:
            refusal = next((r["refuse"] for r in records if "refuse" in r), None)
            if refusal is not None:
                raise ApiError(refusal, "refused", "no")
            return super().record_transfers(worker_id, records)

    client = Refusing()
    recorder = Recorder(client, lambda: "w-1", batch=4, interval_s=3600)  # type: ignore[arg-type]
    try:
        recorder.add({"n": 0, "refuse": 413})
        recorder.add({"n": 1, "refuse": 410})
        recorder.add({"n": 2})
        recorder.add({"n": 3, "refuse": 400})
        _wait(lambda: recorder.pending == 0, timeout_s=5)
        recorder.add({"n": 4})
        recorder.flush()
    finally:
        recorder.close(timeout_s=0.1)
    assert [r["n"] for batch in client.batches for r in batch] == [2, 4]
    assert recorder.refused == 3 and recorder.posted == 2


def test_the_backlog_is_bounded_and_counts_what_it_dropped() -> None:
    client = StubClient([TransportError(0, "unreachable", "refused")] * 1000)
    recorder = Recorder(
        client,
        lambda: "w-1",
        batch=1000,
        interval_s=3600,  # type: ignore[arg-type]
        max_pending=10,
    )
    try:
        for i in range(25):
            recorder.add({"n": i})
        assert recorder.pending == 10 and recorder.dropped == 15
    finally:
        recorder.close(timeout_s=0.1)


def test_fill_mode_verification_judges_only_targeted_bytes(receiver: Worker) -> None:
    """Bytes an earlier transfer wrote are not corruption; bytes nobody targeted are."""
    import torch

    from workers.agent import VerificationError
    from workers.pools import Pool, PoolSpec, pattern_tensor

    spec = PoolSpec(id=0, slot_bytes=64, slot_stride_bytes=64, num_slots=4)
    worker = receiver
    worker.pools = {0: Pool(spec, pattern_tensor(0, 0, spec.nbytes).clone())}
    worker.fillcheck.fill(worker.pools)
    assert worker.verify_untouched() == spec.nbytes  # nothing targeted, nothing changed
    worker.pools[0].tensor[70] ^= 0xFF  # an earlier transfer's byte in slot 1 ...
    with pytest.raises(VerificationError, match="no transfer targeted"):
        worker.verify_untouched()
    worker.fillcheck._touched[0][64:128] = True  # ... is fine once a transfer targeted slot 1
    assert worker.verify_untouched() == spec.nbytes - 64
    assert worker.verify_transfer(resolved("receive", ARRIVED)) == 0  # it wrote nothing
    assert torch.equal(worker.pools[0].tensor[:64], pattern_tensor(0, 0, 64))


@pytest.mark.parametrize(
    ("tokens_per_block", "head_dim"),
    [(4, 8), (16, 128)],  # 128-byte fragments: compared byte by byte; 8 KiB: by crc32 first
)
def test_fill_mode_verification_checks_every_written_byte_against_the_sender(
    receiver: Worker, tokens_per_block: int, head_dim: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real head-slice route (sender rank 1's 2 heads into heads 2-3 of receiver rank 0, HND,
    blocks 3 and 0 into slots 1 and 2): a correct copy passes and counts both slots; a wrong
    byte, a block copied from the wrong slot or a stray write beside the fragments fails it,
    naming the first offset. Long fragments are compared by their crc32 sums (the pattern's
    kept per fragment); a difference still names the first wrong byte."""
    import dataclasses
    from types import SimpleNamespace

    from workers.agent import VerificationError
    from workers.executors import align_request, expand_fragments, fragments_crc32
    from workers.handover import normalize_blocks
    from workers.pools import Pool, pattern_tensor
    from workers.testing.oracles import HeadSlice, reference_copy

    hs = HeadSlice(
        "HND",
        layers=3,
        tokens_per_block=tokens_per_block,
        head_dim=head_dim,
        elem_bytes=2,
        sender_heads=2,
        receiver_heads=4,
        src_head=0,
        dst_head=2,
        heads=2,
    )
    route = dataclasses.replace(hs.route(), sender_rank=1, receiver_rank=0)
    send_spec, recv_spec = hs.sender_spec(4), hs.receiver_spec(4)
    sender = {0: Pool(send_spec, pattern_tensor(1, 0, send_spec.nbytes).clone())}
    worker = receiver
    worker.pools = {0: Pool(recv_spec, pattern_tensor(0, 0, recv_spec.nbytes).clone())}
    check = worker.fillcheck
    check.fill(worker.pools)
    pools_wire = [{"id": 0, "slot_bytes": send_spec.slot_bytes, "num_slots": 4}]
    worker.handover = SimpleNamespace(  # type: ignore[assignment]
        peer=lambda name, rank: SimpleNamespace(info={"pools": pools_wire})
    )
    handle = Handle("r-1", "receive", "ctx", dataclasses.replace(ENTRY, routes=(route,)), 30.0)
    handle.blocks = {"0": {"context": [3, 0], "generation": [1, 2]}}
    handle.verify = True

    check.note_receive(handle)  # as the handover's on_start: noted, nothing marked yet
    assert not check._touched[0].any() and list(check._unmarked) == [handle]
    target = worker.pools[0].tensor
    before = target.clone()
    reference_copy(route, sender, worker.pools, {0: [3, 0]}, {0: [1, 2]})
    changed = (target != before).numpy()
    written = 2 * route.segments[0].runs[0].len * len(route.segments[0].runs)
    long_fragments = route.segments[0].runs[0].len >= GATHER_MAX
    compared = []  # pool pairs compared byte by byte
    gather = fillcheck_module.gather_bytes
    monkeypatch.setattr(
        fillcheck_module, "gather_bytes", lambda *a, **k: compared.append(1) or gather(*a, **k)
    )
    assert worker.verify_transfer(handle) == 2 * recv_spec.slot_bytes  # written + the rest
    assert bool(compared) != long_fragments  # long fragments: by their sums alone
    assert (
        not long_fragments or len(check._pattern_sums) == written // route.segments[0].runs[0].len
    )
    assert not check._unmarked  # the check marked what was noted first:
    assert int(check._touched[0].sum()) == written  # exactly the fragments' bytes ...
    assert not (changed & ~check._touched[0]).any()  # ... and every changed byte among them
    # As the handover runs it: from the receive's own aligned routes; a fragments-mode route
    # gets the crc32 of the gathered bytes, equal to the sender's sum over its sources.
    aligned, src, dst = align_request(route, normalize_blocks(handle.blocks))
    state = SimpleNamespace(route=aligned, src=src, dst=dst, mode="fragments", checksum=None)
    assert worker.verify_transfer(handle, [state]) == 2 * recv_spec.slot_bytes  # type: ignore[list-item]
    frags = expand_fragments(aligned, {0: send_spec}, worker.pools, src, dst)
    assert state.checksum == fragments_crc32(sender, frags, side="src")

    written_at = int(np.flatnonzero(check._touched[0])[5])
    target[written_at] ^= 0x01
    state.checksum = None
    with pytest.raises(VerificationError, match="1 wrong bytes among those written from rank 1"):
        worker.verify_transfer(handle, [state])  # type: ignore[list-item]
    with pytest.raises(
        VerificationError,
        match=f"1 wrong bytes among those written from rank 1 \\(first at offset {written_at}\\)",
    ):
        worker.verify_transfer(handle)
    target.copy_(before)  # the receiver's slot 1 holds sender block 0 instead of block 3
    reference_copy(route, sender, worker.pools, {0: [0, 0]}, {0: [1, 2]})
    with pytest.raises(VerificationError, match="wrong bytes among those written from rank 1"):
        worker.verify_transfer(handle)
    reference_copy(route, sender, worker.pools, {0: [3, 0]}, {0: [1, 2]})
    stray = recv_spec.slot_stride_bytes * 2 + int(
        np.flatnonzero(~check._touched[0][recv_spec.slot_stride_bytes * 2 :])[0]
    )
    target[stray] ^= 0x80  # beside the fragments of slot 2: nobody targeted it
    with pytest.raises(
        VerificationError,
        match=f"1 bytes that no transfer targeted but that changed \\(first at offset {stray}\\)",
    ):
        worker.verify_transfer(handle)


def test_fill_mode_marks_unverified_receives_only_when_a_check_needs_them(
    receiver: Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A receive without verify is only noted when it starts. A check marks the noted bytes
    before it judges a slot they share (sender rank 2 wrote heads 0-1 of the slot whose heads
    2-3 the checked receive wrote: no false corruption), and so does the sweep; with no check
    for a long while the noted receives stay bounded."""
    import dataclasses
    from types import SimpleNamespace

    from workers.pools import Pool, pattern_tensor
    from workers.testing.oracles import HeadSlice, reference_copy

    def route_of(sender_rank: int, dst_head: int) -> Any:
        hs = HeadSlice(
            "HND",
            layers=2,
            tokens_per_block=4,
            head_dim=8,
            elem_bytes=2,
            sender_heads=2,
            receiver_heads=4,
            src_head=0,
            dst_head=dst_head,
            heads=2,
        )
        route = dataclasses.replace(hs.route(), sender_rank=sender_rank, receiver_rank=0)
        return route, hs.sender_spec(4), hs.receiver_spec(4)

    high, send_spec, recv_spec = route_of(1, 2)
    low, _, _ = route_of(2, 0)
    per_block = high.bytes_per_block(0)  # either route's bytes in one receiver slot
    senders = {
        r: {0: Pool(send_spec, pattern_tensor(r, 0, send_spec.nbytes).clone())} for r in (1, 2)
    }
    pools_wire = [{"id": 0, "slot_bytes": send_spec.slot_bytes, "num_slots": 4}]
    worker = receiver
    worker.handover = SimpleNamespace(  # type: ignore[assignment]
        peer=lambda name, rank: SimpleNamespace(info={"pools": pools_wire})
    )
    check = worker.fillcheck

    def reset() -> None:
        worker.pools = {0: Pool(recv_spec, pattern_tensor(0, 0, recv_spec.nbytes).clone())}
        check.fill(worker.pools)

    def receive(route: Any, src: list[int], dst: list[int], verify: bool = False) -> Handle:
        handle = Handle("r", "receive", "ctx", dataclasses.replace(ENTRY, routes=(route,)), 30.0)
        handle.blocks = {"0": {"context": src, "generation": dst}}
        handle.verify = verify
        check.note_receive(handle)
        reference_copy(route, senders[route.sender_rank], worker.pools, {0: src}, {0: dst})
        return handle

    reset()
    first, second = receive(high, [0], [1]), receive(low, [1], [3])
    assert not check._touched[0].any() and list(check._unmarked) == [first, second]
    assert worker.verify_untouched() == recv_spec.nbytes - 2 * per_block  # the sweep marks
    assert not check._unmarked

    reset()
    other = receive(low, [2], [1])  # unverified, into heads 0-1 of slot 1 ...
    checked = receive(high, [3], [1], verify=True)  # ... whose heads 2-3 this one writes
    assert worker.verify_transfer(checked) == recv_spec.slot_bytes - per_block
    assert not check._unmarked and int(check._touched[0].sum()) == 2 * per_block
    assert other not in check._unmarked

    reset()
    monkeypatch.setattr(fillcheck_module, "UNMARKED_MAX", 1)
    receive(high, [2], [0])
    assert not check._touched[0].any()
    second = receive(high, [3], [2])  # past the bound: the oldest is marked now, on this call
    assert list(check._unmarked) == [second]
    assert int(check._touched[0].sum()) == per_block
    assert worker.verify_untouched() == recv_spec.nbytes - 2 * per_block

    # While the rank is idle (the handover's on_idle hook), a few noted receives at a time.
    reset()
    monkeypatch.setattr(fillcheck_module, "UNMARKED_MAX", 1024)
    monkeypatch.setattr(fillcheck_module, "MARK_WHEN_IDLE", 2)
    noted = [receive(high, [0], [0]), receive(high, [1], [1]), receive(high, [2], [2])]
    check.mark_some()
    assert list(check._unmarked) == noted[2:]
    assert int(check._touched[0].sum()) == 2 * per_block
    check.mark_some()
    check.mark_some()  # nothing left: nothing to do
    assert not check._unmarked and int(check._touched[0].sum()) == 3 * per_block


def test_the_progress_thread_runs_the_idle_hook_only_while_nothing_is_pending() -> None:
    """``on_idle`` runs once the handover has had no pending handle for ``IDLE_HOOK_S``, and not
    while a handle is pending."""
    from types import SimpleNamespace

    from workers.handover import Handover, engine_api

    calls: list[float] = []
    pending = threading.Event()

    class Quiet(Handover):
        def _step(self) -> tuple[bool, bool]:  # no transport: only "is something pending"
            return pending.is_set(), False

    import torch

    transport = SimpleNamespace(staging=torch.empty(64, dtype=torch.uint8), pools={})
    pending.set()
    handover = Quiet(
        transport,  # type: ignore[arg-type]
        instance="gen",
        rank=0,
        on_idle=lambda: calls.append(time.monotonic()),
    )
    try:
        time.sleep(5 * engine_api.IDLE_HOOK_S)
        assert not calls  # busy all along
        idle_at = time.monotonic()
        pending.clear()
        deadline = time.monotonic() + 5
        while not calls and time.monotonic() < deadline:
            time.sleep(0.005)
        assert calls and calls[0] - idle_at >= engine_api.IDLE_HOOK_S
    finally:
        pending.clear()
        handover._closed = True


def test_an_idle_progress_loop_slows_down_but_wakes_at_once(monkeypatch) -> None:
    """Idle for ``IDLE_SLOW_AFTER_S``, the progress loop polls every ``IDLE_SLOW_WAIT_S``
    instead of every ``IDLE_WAIT_S`` (each wake costs CPU); a call still runs at once, and
    while the idle hook says it has more to do the loop keeps the short wait."""
    from types import SimpleNamespace

    import torch

    from workers.handover import Handover, engine_api

    monkeypatch.setattr(engine_api, "IDLE_SLOW_AFTER_S", 0.2)
    monkeypatch.setattr(engine_api, "IDLE_SLOW_WAIT_S", 5.0)
    steps: list[float] = []
    more = threading.Event()

    class Quiet(Handover):
        def _step(self) -> tuple[bool, bool]:  # no transport: never anything pending
            steps.append(time.monotonic())
            while self._inbox:
                self._inbox.popleft()()
            return False, False

    transport = SimpleNamespace(staging=torch.empty(64, dtype=torch.uint8), pools={})

    def quiet(**hooks: Any) -> Quiet:
        return Quiet(transport, instance="gen", rank=0, **hooks)  # type: ignore[arg-type]

    def steps_in(seconds: float) -> int:
        start = len(steps)
        time.sleep(seconds)
        return len(steps) - start

    def close(handover: Handover) -> None:
        handover._closed = True
        handover._wake.set()

    handover = quiet(on_idle=more.is_set)
    try:
        time.sleep(0.5)  # past IDLE_SLOW_AFTER_S
        assert steps_in(1.0) <= 2  # one wake per 5 s (IDLE_WAIT_S: ~200)

        ran = threading.Event()
        handover.call_soon(ran.set)  # a call (send/expect) wakes it, not the next 5 s poll
        assert ran.wait(2.0)

        more.set()  # the idle hook has work left: short waits again
        handover._wake.set()
        time.sleep(0.5)
        assert steps_in(0.5) >= 10
    finally:
        close(handover)

    # A rank that serves asks (its KV ready, waiting to be asked) keeps the short wait.
    asked = quiet(on_ask=lambda ask: None)
    try:
        time.sleep(0.5)
        assert steps_in(0.5) >= 10
    finally:
        close(asked)


def test_importing_the_worker_metrics_pulls_no_server_code() -> None:
    code = (
        "import sys, workers.metrics, workers.agent, workers.handover, api.logs; "
        "bad = [m for m in ('fastapi', 'sqlalchemy', 'starlette') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


class NoAttach(StubClient):
    """A control plane whose heartbeats ``refuse`` (an exception, given the worker) and where
    attaching again (which reads the instance first) is counted and fails."""

    def __init__(self, refuse: Callable[[Worker], Exception]) -> None:
        super().__init__()
        self.refuse, self.attaches = refuse, 0
        self.worker: Worker | None = None

    def heartbeat(self, worker_id: str, **_: Any) -> Any:
        assert self.worker is not None
        raise self.refuse(self.worker)

    def get_instance(self, name: str) -> Any:
        self.attaches += 1
        raise AssertionError("this worker must not attach again")


def run_heartbeats(client: NoAttach) -> Worker:
    """A worker's heartbeat loop on ``client``, until it returns (within 5 s)."""
    agent = Worker(client, "ctx", 1, device="cpu")  # type: ignore[arg-type]
    client.worker = agent
    agent.worker_id = "w-1"
    agent.heartbeat_interval_s = 0.01
    thread = threading.Thread(target=agent._heartbeat_loop, daemon=True)
    thread.start()
    thread.join(timeout=5)
    assert not thread.is_alive()
    return agent


def test_a_superseded_worker_stops_instead_of_attaching_again() -> None:
    """Another worker took the rank over: attaching again would take it back, and the two would
    fight over the rank. The heartbeat's 409 worker_superseded stops this one."""
    from api.client import ConflictError

    client = NoAttach(
        lambda _: ConflictError(409, "worker_superseded", "worker w-2 took rank 1 over")
    )
    assert run_heartbeats(client).superseded and client.attaches == 0


@pytest.mark.parametrize("refusal", ["stopped", "gone"])
def test_a_stopping_worker_never_attaches_again(refusal: str) -> None:
    """A heartbeat in flight while the worker stops meets its own deregistration (409: stopped)
    or a removed row (404): the worker is stopping, so it must not attach again (a second row
    of the rank would read alive after the engine stopped)."""
    from api.client import ConflictError, NotFoundError

    def refuse(agent: Worker) -> Exception:
        agent._stop.set()  # Worker.stop() ran while this heartbeat was on its way
        if refusal == "stopped":
            return ConflictError(409, "worker_stale", "this worker was stopped; attach again")
        return NotFoundError(404, "not_found", "no worker w-1")

    client = NoAttach(refuse)
    agent = run_heartbeats(client)
    assert agent._stop.is_set() and not agent.superseded and client.attaches == 0


def test_a_worker_that_attached_again_outlives_its_old_ids_supersession() -> None:
    """A re-registration makes a heartbeat re-attach (a new worker id), and the control plane
    tells the old id's command stream "superseded by <new id>", possibly before the attach has
    returned on the heartbeat thread. That supersession is this worker's own: it goes on, on its
    new id's stream at once, instead of stopping (the rank would be left without a worker)."""
    streams: list[str] = []
    attaching, stop = threading.Event(), threading.Event()

    class Reattached(StubClient):
        def stream_commands(self, worker_id: str, **_: Any) -> Any:
            streams.append(worker_id)
            if worker_id == "w-1":
                attaching.wait(5)  # the attach (another thread) holds the lock by now
                yield {"type": "superseded", "by": "w-2"}
            else:
                stop.wait(10)  # the new id's stream: nothing more to say

    agent = Worker(Reattached(), "ctx", 1, device="cpu")  # type: ignore[arg-type]
    agent.worker_id = "w-1"

    def attach_elsewhere() -> None:  # the heartbeat thread's attach, still registering
        with agent._attach_lock:
            attaching.set()
            time.sleep(0.3)
            agent.worker_id = "w-2"

    attacher = threading.Thread(target=attach_elsewhere, daemon=True)
    attacher.start()
    commands = threading.Thread(target=agent._command_loop, daemon=True)
    commands.start()
    try:
        deadline = time.monotonic() + 5  # no 2 s backoff before the new id's stream
        while streams != ["w-1", "w-2"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert streams == ["w-1", "w-2"]
        assert not agent.superseded and not agent._stop.is_set()
    finally:
        agent._stop.set()
        stop.set()
        commands.join(timeout=5)
