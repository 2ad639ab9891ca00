"""The reference engine loop (``workers/testing/engine.py``) on the demo fleet, end to end.

Six rank processes (TP4 context with an 8-head target and a 2-head draft view → TP2 generation),
each a fake engine that owns its pools, allocates and frees block ids like a paged cache and
embeds a real Worker (real NIXL on loopback, a real control plane on SQLite). Every pool is
pattern-filled and every receive verified: written bytes carry the sender's pattern, all others
are untouched. The record must follow: ``GET /v1/transfers`` lists every request as ``done``,
also for requests that ran while the control plane was down.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import pytest

from api.client import Client

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]
pytest.importorskip("nixl")
pytest.importorskip("torch")
from workers.testing.engine import (  # noqa: E402 (after the importorskips)
    CONTEXT,
    GENERATION,
    BlockCache,
    CacheError,
    EngineRun,
    Fleet,
    request_blocks,
)

NUM_SLOTS = 32
BLOCKS = 4


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """One fleet for the module (starting six rank processes takes a while); a test that stops
    the control plane starts it again before it ends."""
    running = Fleet(
        tmp_path_factory.mktemp("engine-loop"),
        num_slots=NUM_SLOTS,
        fill=True,
        staging_bytes=16 << 20,
    )
    try:
        running.start()
        yield running
    finally:
        running.stop()


def _assert_clean(run: EngineRun) -> None:
    assert run.complete, run.stalled
    assert run.failures == {}
    assert run.leaked == 0
    assert not run.stalled
    for rank in run.ranks:
        assert rank.double_allocations == 0
        assert rank.verify_errors == []


def _verified(run: EngineRun) -> int:
    return sum(r.verified_bytes for r in run.ranks if r.role == "generation")


def _engine_ids(fleet: Fleet, run: EngineRun) -> set[str]:
    from api.services.execution import engine_transfer_id

    pairing = fleet.client.get_pairing(fleet.pairing["id"]) if fleet.client else {}
    ctx = fleet.client.get_instance(CONTEXT) if fleet.client else {}
    gen = fleet.client.get_instance(GENERATION) if fleet.client else {}
    return {
        engine_transfer_id(
            str(pairing["id"]), str(ctx["epoch"]), str(gen["epoch"]), f"{run.tag}-{i}"
        )
        for i in range(run.requests)
    }


def _records(client: Client, ids: set[str]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    offset = 0
    while True:
        page = client.list_transfers(limit=1000, offset=offset)
        for item in page["items"]:
            if item["id"] in ids:
                found[item["id"]] = item
        offset += len(page["items"])
        if not page["items"] or offset >= page["total"]:
            return found


def _wait_recorded(fleet: Fleet, ids: set[str], timeout_s: float) -> dict[str, Any]:
    assert fleet.client is not None
    deadline = time.monotonic() + timeout_s
    while True:
        found = _records(fleet.client, ids)
        if len(found) == len(ids) and all(t["status"] == "done" for t in found.values()):
            return found
        if time.monotonic() > deadline:
            statuses = sorted({t["status"] for t in found.values()})
            raise AssertionError(
                f"{len(found)} of {len(ids)} transfers recorded after "
                f"{timeout_s:.0f} s, statuses {statuses}: "
                f"{[t['error'] for t in found.values() if t['error']][:3]}"
            )
        time.sleep(0.2)


class _Sink:
    """Collects what a Recorder posts (the HTTP client's one method it calls)."""

    def __init__(self) -> None:
        self.batches: list[list[Any]] = []

    def record_transfers(self, worker_id: str, records: list[Any]) -> None:
        self.batches.append(list(records))


def test_a_lone_record_is_posted_within_the_interval() -> None:
    from workers.records import Recorder

    sink = _Sink()
    recorder = Recorder(sink, lambda: "w1", interval_s=0.2)  # type: ignore[arg-type]
    try:
        recorder.add({"n": 1})  # neither urgent nor a full batch
        deadline = time.monotonic() + 10
        while not sink.batches and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sink.batches == [[{"n": 1}]]
    finally:
        recorder.close(timeout_s=1)


def test_block_cache_refuses_double_allocation_and_counts_leaks() -> None:
    cache = BlockCache(8)
    cache.reserve([3, 1])
    with pytest.raises(CacheError, match="double allocation"):
        cache.reserve([1, 2])
    assert cache.alloc(2) == [0, 2]
    assert cache.leaked == 4
    cache.free([3, 1, 0, 2])
    with pytest.raises(CacheError, match="not in use"):
        cache.free([3])
    assert cache.leaked == 0 and cache.free_count == 8


def test_request_blocks_are_the_same_everywhere_and_disjoint_in_flight() -> None:
    lanes = NUM_SLOTS // BLOCKS
    maps = [request_blocks(5, i, BLOCKS, NUM_SLOTS) for i in range(lanes)]
    assert maps[0] == request_blocks(5, 0, BLOCKS, NUM_SLOTS)
    assert maps[0] != request_blocks(6, 0, BLOCKS, NUM_SLOTS)
    for side in (0, 1):
        ids = [x for m in maps for x in m[0][side]]
        assert sorted(ids) == list(range(NUM_SLOTS))  # one lane per request, no overlap
    assert request_blocks(5, lanes, BLOCKS, NUM_SLOTS) == maps[0]


def test_fifty_requests_move_every_byte_leak_nothing_and_are_recorded(fleet: Fleet) -> None:
    closed = fleet.run_engine(requests=30, blocks=BLOCKS, in_flight=4, verify=True, seed=3)
    _assert_clean(closed)
    poisson = fleet.run_engine(
        requests=20, blocks=BLOCKS, in_flight=8, verify=True, seed=4, arrival="poisson", rate=40.0
    )
    _assert_clean(poisson)
    assert len(closed.latencies_s()) == 30 and len(poisson.latencies_s()) == 20
    # Every receive checked its bytes: at least every pool byte of both generation ranks once
    # per request (the written ones against the sender's pattern, the rest untouched).
    assert _verified(closed) > 0 and _verified(poisson) > 0
    for run in (closed, poisson):
        assert all(r.verified_bytes for r in run.ranks if r.role == "generation")
    # The record follows within seconds: every request is one transfer, done.
    ids = _engine_ids(fleet, closed) | _engine_ids(fleet, poisson)
    recorded = _wait_recorded(fleet, ids, timeout_s=15)
    assert {t["request_id"] for t in recorded.values()} == (
        {f"{closed.tag}-{i}" for i in range(30)} | {f"{poisson.tag}-{i}" for i in range(20)}
    )
    assert all(t["bytes"] > 0 for t in recorded.values())


def test_sends_after_a_prefill_find_their_grants_waiting_and_move_every_byte(fleet: Fleet) -> None:
    """The usual order (bench/latency.py's "receiver ahead" row): generation ranks expect as
    soon as they admit a request, context ranks send ``prefill_ms`` after they admitted it, up
    to ``in_flight`` of them computing at once. The grants wait for their send; every request
    arrives verified and no block leaks."""
    run = fleet.run_engine(
        requests=8, blocks=BLOCKS, in_flight=4, seed=13, prefill_ms=200.0, verify=True
    )
    _assert_clean(run)
    assert _verified(run) > 0
    assert len(run.latencies_s()) == 8
    # The context ranks sent the first request 200 ms after the generation ranks expected it
    # (later ones depend on which side freed its slot first: each expect takes several ms
    # here, as this fleet's fill mode notes every byte it will write).
    leads = _leads(run)
    assert leads[0] > 0.15, leads
    # Each context rank computed its first four requests at once, not one after the other
    # (that would put 200 ms between its sends).
    for rank in run.ranks:
        if rank.role == "context":
            sends = [t_issue for index, t_issue, *_ in rank.records if index < 4]
            assert max(sends) - min(sends) < 0.15, sends


def _leads(run: EngineRun) -> list[float]:
    """Per request: the last context rank's send − the last generation rank's expect."""
    issued: dict[str, dict[int, float]] = {"context": {}, "generation": {}}
    for rank in run.ranks:
        for index, t_issue, *_ in rank.records:
            side = issued[rank.role]
            side[index] = max(side.get(index, 0.0), t_issue)
    return [issued["context"][i] - issued["generation"][i] for i in sorted(issued["context"])]


def test_a_released_send_is_recorded_only_when_it_has_something_to_say(fleet: Fleet) -> None:
    """The receivers' parts decide an engine transfer and list every route's bytes: the
    senders' successful parts are not recorded (two part rows per transfer, not six). With
    verify too: each receiving rank compared its routes' crc32 with the sums their senders'
    notifications carried, and its part holds both."""
    assert fleet.client is not None
    plain = fleet.run_engine(requests=6, blocks=BLOCKS, in_flight=2, seed=11)
    verified = fleet.run_engine(requests=4, blocks=BLOCKS, in_flight=2, seed=12, verify=True)
    _assert_clean(plain)
    _assert_clean(verified)
    recorded = _wait_recorded(
        fleet, _engine_ids(fleet, plain) | _engine_ids(fleet, verified), timeout_s=15
    )
    plain_ids = _engine_ids(fleet, plain)
    for tid, transfer in recorded.items():
        parts = fleet.client.list_parts(tid)["items"]
        sides = sorted((p["kind"], p["rank"]) for p in parts)
        assert all(p["state"] == "done" for p in parts), parts
        assert sides == [("receive", 0), ("receive", 1)], sides
        # The receivers' route results still account for every sender and every byte.
        routes = [r for p in parts for r in p["result"]["routes"]]
        assert {r["sender_rank"] for r in routes} == {0, 1, 2, 3}
        assert sum(r["bytes"] for r in routes) == transfer["bytes"] > 0
        if tid in plain_ids:
            assert all(r["checksum"] is None for r in routes)
        else:
            assert all(r["checksum"] is not None for r in routes)
            assert all(r["sender_checksum"] == r["checksum"] for r in routes)


@pytest.mark.parametrize("mode", ["staged", "fragments"])
def test_the_engine_api_refuses_bad_block_lists_before_anything_moves(
    fleet: Fleet,
    mode: str,
) -> None:
    """Every rank checks its own side's ids against its pools (each view's pool of the layer
    group), and a receiver refuses duplicate destinations; nothing starts, the ranks stay
    usable."""
    good = list(range(BLOCKS))
    cases = {
        "context": [
            ([0, 1, 2, NUM_SLOTS], good, rf"block ids must be in \[0, {NUM_SLOTS}\)"),
            ([-1, 1, 2, 3], good, r"block ids must be ≥ 0"),  # found while aligning
            ("[1, 2]", good, "flat list of integers"),
        ],
        "generation": [
            (good, [5, 6, 7, NUM_SLOTS + 3], rf"must be in \[0, {NUM_SLOTS}\)"),
            (good, [5, 6, 5, 7], "appears more than once"),
        ],
    }
    for role, bad in cases.items():
        for i, (context_ids, generation_ids, message) in enumerate(bad):
            answers = fleet.call_role(
                role,
                "try_start",
                request_id=f"bad-{mode}-{role}-{i}",
                blocks={0: (context_ids, generation_ids)},
                mode=mode,
            )
            for answer in answers:
                assert answer.get("code") == "invalid_blocks", answer
                assert re.search(message, answer["message"]), answer
    # Both sides align the same two lists (by token position), so a context rank refuses a
    # repeated generation id as the receiver does, at once, rather than at its deadline.
    [answer, *_] = fleet.call_role(
        "context",
        "try_start",
        request_id=f"other-side-{mode}",
        blocks={0: (good, [5, 6, 5, 7])},
        mode=mode,
    )
    assert answer.get("code") == "invalid_blocks", answer
    _assert_clean(
        fleet.run_engine(requests=4, blocks=BLOCKS, in_flight=2, verify=True, seed=31, mode=mode)
    )


def test_a_failed_fragments_receive_keeps_its_blocks_until_no_granted_write_can_land(
    fleet: Fleet,
) -> None:
    # The writers freeze (their grants time out unused): every receive fails at its deadline
    # after granting, in fragments mode (auto, 16 KiB fragments), so a WRITE could have been on
    # its way straight into the generation blocks.
    fleet.call_role("context", "hold_writes", seconds=3.0)
    try:
        failed = fleet.run_engine(requests=2, blocks=BLOCKS, in_flight=2, timeout_s=1.0, seed=21)
    finally:
        fleet.call_role("context", "hold_writes", seconds=0.0)
    assert failed.complete, failed.stalled
    generation = [r for r in failed.ranks if r.role == "generation"]
    for rank in generation:
        assert [rec[3] for rec in rank.records] == ["failed", "failed"], rank.records
        assert all("deadline" in str(rec[4]) for rec in rank.records), rank.records
        # held back from the cache, not leaked: both requests' blocks
        assert rank.quarantined == 2 * BLOCKS and rank.leaked == 0, rank
    # Senders' blocks come back at once (a late WRITE only reads them).
    assert all(r.quarantined == 0 for r in failed.ranks if r.role == "context")
    assert failed.leaked == 0
    # Once the grants' time to live and the margin are over, the blocks are free again.
    again = fleet.run_engine(requests=4, blocks=BLOCKS, in_flight=2, verify=True, seed=22)
    _assert_clean(again)
    assert all(s["quarantined"] == 0 and s["leaked"] == 0 for s in fleet.call_all("stats"))


def test_engine_path_runs_without_the_control_plane_and_the_record_catches_up(
    fleet: Fleet,
) -> None:
    before = fleet.run_engine(requests=4, blocks=BLOCKS, in_flight=2, verify=True, seed=8)
    _assert_clean(before)
    fleet.server.stop()  # terminate the server process: no control plane at all
    try:
        during = fleet.run_engine(requests=12, blocks=BLOCKS, in_flight=4, verify=True, seed=9)
        _assert_clean(during)
        stats = fleet.call_all("stats")
        assert any((s["records_pending"] or 0) > 0 for s in stats), stats  # nothing could post
    finally:
        fleet.server.start()  # same database, same port
    _wait_recorded(fleet, _engine_ids(fleet, before) | _engine_ids(fleet, during), timeout_s=40)


def test_the_raw_baselines_move_every_request_in_each_layout(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """bench/latency.py's raw rows on a fleet of their own (their WRITEs bypass the handover, so
    a fill-mode fleet's sweep would rightly call them stray): every request arrives at both
    generation ranks in each layout. In the granted one the receivers issue each request (their
    grant), the senders issue nothing and WRITE only what was granted."""
    raw_fleet = Fleet(tmp_path_factory.mktemp("raw"), num_slots=NUM_SLOTS, staging_bytes=16 << 20)
    try:
        raw_fleet.start()
        for layout in ("staging", "fragments", "granted"):
            run = raw_fleet.run_raw(requests=12, blocks=BLOCKS, in_flight=3, layout=layout)
            assert run.errors == [], layout
            latencies = run.latencies_s()
            assert len(latencies) == 12 and min(latencies) > 0, layout
            issuers = {role for role, r in run.ranks if r["issued"]}
            assert issuers == ({"generation"} if layout == "granted" else {"context"}), layout
            for role, r in run.ranks:
                if role == "generation":
                    assert sorted(r["arrived"]) == list(range(12)), layout
        with pytest.raises(RuntimeError, match="staging, fragments or granted"):
            raw_fleet.run_raw(requests=1, blocks=BLOCKS, in_flight=1, layout="scattered")
    finally:
        raw_fleet.stop()
