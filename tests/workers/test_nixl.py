"""NIXL (UCX) transfers between real processes on loopback, every receiver byte checked."""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from dataclasses import asdict

import numpy as np
import pytest
import torch

pytest.importorskip("nixl")

from workers.executors import BlockRangeError, Route, staging_layout  # noqa: E402
from workers.pools import allocate_pools, fill_pattern  # noqa: E402
from workers.testing.oracles import (  # noqa: E402
    HeadSlice,
    loopback_receiver,
    loopback_sender,
    reference_copy,
)
from workers.transport import TransferTimeout, TransportError  # noqa: E402
from workers.transport.nixl import NixlTransport, PeerInfo  # noqa: E402

pytestmark = [pytest.mark.slow]


def _route_dict(route: Route) -> dict:
    return {
        "sender_rank": route.sender_rank,
        "receiver_rank": route.receiver_rank,
        "segments": [
            {"src_pool": s.src_pool, "dst_pool": s.dst_pool, "layer_group": s.layer_group,
             "runs": [asdict(r) for r in s.runs]}
            for s in route.segments
        ],
    }  # fmt: skip


class Loopback:
    """One receiver and two sender processes, alive for the module; a job per transfer."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.cmds = [ctx.Queue() for _ in range(3)]
        self.outs = [ctx.Queue() for _ in range(3)]
        bodies = [loopback_receiver, loopback_sender, loopback_sender]
        self.procs = [
            ctx.Process(target=b, args=(c, o), daemon=True)
            for b, c, o in zip(bodies, self.cmds, self.outs, strict=True)
        ]
        for p in self.procs:
            p.start()

    def get(self, i: int, what: str, timeout: float = 120.0):
        deadline = time.monotonic() + timeout
        while True:
            try:
                kind, payload = self.outs[i].get(timeout=0.5)
                break
            except queue.Empty:
                dead = [p.exitcode for p in self.procs if p.exitcode is not None]
                if dead:
                    pytest.fail(f"a peer process exited (codes {dead}) before sending {what}")
                if time.monotonic() > deadline:
                    pytest.fail(f"no {what} within {timeout}s")
        if kind == "error":
            pytest.fail(f"{what} failed in the peer process:\n{payload}")
        return payload

    def run(self, receiver_cfg: dict, sender_cfgs: list[dict]) -> tuple[dict, list[dict]]:
        self.cmds[0].put(receiver_cfg)
        info = self.get(0, "receiver metadata")
        for i, cfg in enumerate(sender_cfgs, start=1):
            self.cmds[i].put({**cfg, "peer": info})
        sent = [self.get(i, "sender result") for i in range(1, len(sender_cfgs) + 1)]
        return self.get(0, "receiver result"), sent

    def close(self) -> None:
        for c in self.cmds:
            c.put(None)
        for p in self.procs:
            p.join(20)
            if p.is_alive():
                p.kill()


@pytest.fixture(scope="module")
def loopback():
    lb = Loopback()
    yield lb
    lb.close()


def _tp4_to_tp2(layout: str):
    """Context TP4 (2 heads/rank) → generation TP2 (4 heads/rank); ranks 0, 1 fill receiver 0."""
    slices = [HeadSlice(layout, 4, 8, 16, 2, 2, 4, 0, 2 * w, 2) for w in range(2)]
    return slices, slices[0].sender_spec(40, pad=64), slices[0].receiver_spec(48, pad=32)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("layout", "chunk_blocks"), [("HND", None), ("NHD", 4), ("HND", 3)])
def test_staged_two_writers_into_exact_offsets(loopback, layout, chunk_blocks):
    slices, sspec, dspec = _tp4_to_tp2(layout)
    rng = np.random.default_rng(3)
    n = 11
    writers, senders, offset = [], [], 0
    for w, hs in enumerate(slices):
        route = _route_dict(hs.route())
        bs = rng.permutation(40)[:n].tolist() if w else list(range(7, 7 + n))
        bd = [int(x) for x in rng.permutation(48)[:n]] if w else list(range(30, 30 + n))
        size = staging_layout(hs.route(), bs).nbytes
        common = {"route": route, "src_blocks": bs, "dst_blocks": bd, "offset": offset,
                  "tag": f"t1/w{w}", "chunk_blocks": chunk_blocks, "mode": "staged"}  # fmt: skip
        writers.append({**common, "agent": f"ctx-r{w}", "rank": w, "specs": [asdict(sspec)]})
        senders.append({**common, "agent": f"ctx-r{w}", "rank": w, "specs": [asdict(sspec)],
                        "staging_bytes": size})  # fmt: skip
        offset += size
    receiver = {"agent": f"gen-r0-{layout}-{chunk_blocks}", "rank": 5,
                "specs": [asdict(dspec)], "staging_bytes": offset, "writers": writers}  # fmt: skip
    got, sent = loopback.run(receiver, senders)
    assert [s["bytes"] for s in sent] == [offset // 2, offset // 2]
    assert got["mismatched"] == 0
    assert got["changed"] > 0  # the oracle compared against moved bytes, not an idle pool


@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_per_fragment_writes_straight_into_pools(loopback, layout):
    slices, sspec, dspec = _tp4_to_tp2(layout)
    hs = slices[1]
    bs, bd = [3, 4, 5, 6, 20, 1], [47, 0, 9, 10, 11, 2]
    cfg = {"route": _route_dict(hs.route()), "src_blocks": bs, "dst_blocks": bd, "offset": 0,
           "tag": "frag", "chunk_blocks": None, "mode": "fragments", "agent": "ctx-r1", "rank": 1,
           "specs": [asdict(sspec)]}  # fmt: skip
    receiver = {"agent": f"gen-frag-{layout}", "rank": 5, "specs": [asdict(dspec)],
                "staging_bytes": 1,
                "writers": [cfg]}  # fmt: skip
    got, sent = loopback.run(receiver, [{**cfg, "staging_bytes": 1}])
    assert sent[0]["bytes"] == len(bs) * hs.route().segments[0].bytes_per_block
    assert got["mismatched"] == 0 and got["changed"] > 0


# --- in-process: peers, timeouts and refusals ------------------------------------------------


@pytest.fixture
def pair():
    hs = HeadSlice("HND", 2, 4, 8, 2, 2, 4, 0, 2, 2)
    src = allocate_pools([hs.sender_spec(8)])
    dst = allocate_pools([hs.receiver_spec(8)])
    fill_pattern(0, src[0])
    fill_pattern(1, dst[0])
    size = staging_layout(hs.route(), [0, 1, 2]).nbytes
    made = []

    def make(name, pools, staging):
        t = NixlTransport(name, pools, staging_bytes=staging)
        made.append(t)
        return t

    yield hs, src, dst, size, make
    for t in made:
        t.close()


@pytest.mark.timeout(60)
def test_restarted_peer_is_replaced_and_old_agent_dropped(pair):
    hs, src, dst, size, make = pair
    sender = make("s", src, size)
    first = make("r", dst, size)
    sender.add_peer(PeerInfo.from_json(first.peer_info().to_json()))
    first.close()
    # The receiver restarts: new pools, same agent name, new metadata via the control plane.
    dst2 = allocate_pools([hs.receiver_spec(8)])
    fill_pattern(1, dst2[0])
    second = make("r", dst2, size)
    sender.add_peer(second.peer_info().to_json())
    assert sender.peers == ("r",)
    # The WRITE completes while the receiver does not poll (it calls receive_staged only after
    # write_staged returned): NIXL's progress thread drives the receiving side.
    sender.write_staged("r", hs.route(), [0, 1, 2], dst_offset=0, tag=b"x", timeout_s=10)
    second.receive_staged("s", hs.route(), [5, 6, 7], offset=0, tag=b"x", timeout_s=10)
    want = allocate_pools([hs.receiver_spec(8)])
    fill_pattern(1, want[0])
    reference_copy(hs.route(), src, want, [0, 1, 2], [5, 6, 7])
    assert torch.equal(dst2[0].tensor, want[0].tensor)

    sender.remove_peer("r")
    with pytest.raises(TransportError, match="unknown peer 'r'"):
        sender.write_staged("r", hs.route(), [0], dst_offset=0, tag=b"y")


def _wait_done(transport, pending, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not transport.poll(pending):
        assert time.monotonic() < deadline, "the WRITE did not complete"
        time.sleep(0.001)


@pytest.mark.timeout(60)
def test_prepared_fragment_writes_land_and_follow_a_restarted_peer(pair):
    # The handover's per-fragment path: NIXL prepared descriptor lists per route and peer,
    # fragments named by index. A peer that comes back under the same agent name with new pools
    # must get a fresh list: a cached one would write into its old addresses.
    hs, src, dst, size, make = pair
    route = hs.route()
    sender = make("ps", src, size)
    receivers = [make("pr", dst, size)]
    sender.add_peer(receivers[0].peer_info().to_json())
    for attempt, (bs, bd) in enumerate([([0, 1, 2], [5, 6, 7]), ([3, 3, 7], [0, 4, 2])]):
        pools = dst if attempt == 0 else allocate_pools([hs.receiver_spec(8)])
        if attempt:  # the receiver restarts: same agent name, new pools and metadata
            fill_pattern(1, pools[0])
            receivers[0].close()
            receivers[0] = make("pr", pools, size)
            sender.add_peer(receivers[0].peer_info().to_json())
        nbytes = staging_layout(route, bs).nbytes
        pending = sender.post_fragments(
            "pr", route, np.array(bs), np.array(bd), b"done", "prepared"
        )
        assert pending is not None and pending.nbytes == nbytes
        assert sender._tables[("pr", route.fingerprint)] is not None  # the prepared path
        _wait_done(sender, pending)
        want = allocate_pools([hs.receiver_spec(8)])
        fill_pattern(1, want[0])
        reference_copy(route, src, want, bs, bd)
        assert torch.equal(pools[0].tensor, want[0].tensor), f"attempt {attempt}"
        assert receivers[0].wait_notif("ps", [b"done"], timeout_s=10) == b"done"


@pytest.mark.timeout(60)
def test_routes_too_large_to_prepare_post_each_requests_own_descriptors(pair):
    # The fallback of the per-fragment path (e.g. token-major runs over a large pool): tables
    # over the limit are not prepared, and each request's fragments are posted by address.
    hs, src, dst, size, make = pair
    route = hs.route()
    sender = make("fs", src, size)
    receiver = make("fr", dst, size)
    sender.add_peer(receiver.peer_info().to_json())
    sender.fragment_table_max = route.fragments_per_block * 8 - 1  # one slot short
    for bs, bd in (([0, 1, 2], [5, 6, 7]), ([7, 3, 3], [0, 4, 1])):
        pending = sender.post_fragments("fr", route, bs, bd, b"fb", "fallback")
        assert sender._tables[("fr", route.fingerprint)] is None  # not prepared
        assert not sender._prepped
        assert pending is not None and pending.nbytes == staging_layout(route, bs).nbytes
        _wait_done(sender, pending)
        assert receiver.wait_notif("fs", [b"fb"], timeout_s=10) == b"fb"
    want = allocate_pools([hs.receiver_spec(8)])
    fill_pattern(1, want[0])
    for bs, bd in (([0, 1, 2], [5, 6, 7]), ([7, 3, 3], [0, 4, 1])):
        reference_copy(route, src, want, bs, bd)
    assert torch.equal(dst[0].tensor, want[0].tensor)
    assert sender.post_fragments("fr", route, [], [], b"x", "nothing") is None
    with pytest.raises(BlockRangeError):
        sender.post_fragments("fr", route, [0], [8], b"x", "out of range")


@pytest.mark.timeout(60)
def test_waits_time_out_and_oversized_writes_are_refused(pair):
    hs, src, dst, size, make = pair
    sender = make("s2", src, size)
    receiver = make("r2", dst, size)
    sender.add_peer(receiver.peer_info())
    with pytest.raises(TransferTimeout, match="no notification"):
        receiver.receive_staged("s2", hs.route(), [1, 2, 3], offset=0, tag=b"never",
                                timeout_s=0.3)  # fmt: skip
    with pytest.raises(TransportError, match="exceeds 'r2'"):
        sender.write_staged("r2", hs.route(), [0, 1, 2], dst_offset=1, tag=b"z")
    with pytest.raises(TransportError, match="local staging holds"):
        sender.write_staged("r2", hs.route(), [0, 1, 2, 3], dst_offset=0, tag=b"z")
    with pytest.raises(ValueError, match="destination block id 8"):
        sender.write_fragments("r2", hs.route(), [0], [8], tag=b"z")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tpb", [(8, 2), (2, 8)])
def test_block_size_ratio_staged_and_per_fragment(tpb):
    """A plan with different tokens_per_block: the request's lanes (one per sub-block, one for a
    partial last block) travel through both NIXL paths and land where the naive reference copy
    puts them."""
    import geometry
    from geometry.builders import ViewSpec, instance_body
    from workers.executors import align_request
    from workers.pools import PoolSpec

    bodies = [
        instance_body(
            role=role, views=[ViewSpec("target", 2, 4, 8)], tp=1, tokens_per_block=t, num_slots=16
        )  # fmt: skip
        for role, t in (("context", tpb[0]), ("generation", tpb[1]))
    ]
    plan = geometry.compile_plan(*(geometry.parse_instance(b, b["role"][:3]) for b in bodies))
    (plan_route,) = [r.to_dict() for r in plan.routes]
    # 71 tokens: the small side's last block holds 1 token of 2, the large side's 7 of 8
    route, bs, bd = align_request(
        plan_route, {0: ([9, 1, 2, 3, 4, 5, 6, 7, 8], [15, 14, 13, 12, 0, 10, 11, 1, 2])}, 71
    )
    assert sum(ids.size for ids in bs.values()) == 9  # the small side's 9 blocks move
    specs = [PoolSpec.from_dict(b["ranks"][0]["pools"][0]) for b in bodies]
    src = allocate_pools([specs[0]])
    fill_pattern(0, src[0])
    want = allocate_pools([specs[1]])
    fill_pattern(1, want[0])
    reference_copy(route, src, want, bs, bd)
    size = staging_layout(route, bs).nbytes
    for mode in ("staged", "fragments"):
        dst = allocate_pools([specs[1]])
        fill_pattern(1, dst[0])
        sender = NixlTransport(f"s-{mode}-{tpb[0]}", src, staging_bytes=size)
        receiver = NixlTransport(f"r-{mode}-{tpb[0]}", dst, staging_bytes=size)
        try:
            sender.add_peer(receiver.peer_info())
            if mode == "staged":
                sender.write_staged(receiver.name, route, bs, dst_offset=0, tag=b"q", timeout_s=10)
                receiver.receive_staged(sender.name, route, bd, offset=0, tag=b"q", timeout_s=10)
            else:
                sender.write_fragments(receiver.name, route, bs, bd, tag=b"f", timeout_s=10)
        finally:
            sender.close()
            receiver.close()
        assert torch.equal(dst[0].tensor, want[0].tensor), mode
    assert not torch.equal(want[0].tensor, allocate_pools([specs[1]])[0].tensor)
