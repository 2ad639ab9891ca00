"""Executors against the naive per-fragment oracle, byte for byte over whole pools (CPU)."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.executors import (
    BlockRangeError,
    Route,
    Run,
    Segment,
    TemplateError,
    _families,
    _progressions,
    _touched_slots,
    align_blocks,
    align_request,
    copy_local,
    expand_fragments,
    fragment_indices,
    fragment_tables,
    fragments_crc32,
    gather,
    scatter,
    staging_layout,
)
from workers.pools import PoolSpec, allocate_pools, fill_pattern
from workers.testing.oracles import HeadSlice, reference_copy, reference_staging

METHODS = ["strided", "index"]


def _blocks(rng: np.random.Generator, kind: str, n: int, num_slots: int, unique: bool):
    if kind == "contiguous":
        start = int(rng.integers(0, num_slots - n + 1))
        return np.arange(start, start + n)
    if kind == "descending":
        start = int(rng.integers(n - 1, num_slots)) if n else 0
        return np.arange(start, start - n, -1)
    if kind == "stride2":
        step = 2 if 2 * n <= num_slots else 1
        start = int(rng.integers(0, num_slots - step * n + 1))
        return np.arange(start, start + step * n, step)
    if kind == "two_ranges":
        ids = rng.choice(num_slots - 4, size=2, replace=False)
        half = n // 2
        a, b = np.arange(half), np.arange(n - half)
        out = np.concatenate([ids[0] + a, ids[1] + b + 2]) % num_slots
        return out if not unique or np.unique(out).size == n else rng.permutation(num_slots)[:n]
    if kind == "repeat" and not unique:
        return rng.integers(0, num_slots, size=n)
    return rng.permutation(num_slots)[:n]


KINDS = ["contiguous", "descending", "stride2", "two_ranges", "random", "repeat"]


def _pools_pair(src_specs, dst_specs):
    src = allocate_pools(src_specs)
    dst = allocate_pools(dst_specs)
    for p in src.values():
        fill_pattern(0, p)
    for p in dst.values():
        fill_pattern(1, p)
    return src, dst


def _clone(pools):
    out = allocate_pools([p.spec for p in pools.values()])
    for pid, p in pools.items():
        out[pid].tensor.copy_(p.tensor)
    return out


def _assert_pools_equal(got, want):
    for pid in want:
        g, w = got[pid].tensor, want[pid].tensor
        bad = torch.nonzero(g != w)
        assert bad.numel() == 0, f"pool {pid}: {bad.numel()} bytes differ, first at {int(bad[0])}"


# --- realistic head slices ------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", ["HND", "NHD", "HND>NHD", "NHD>HND"])
def test_head_slice_copy_gather_scatter_match_oracle(layout, kind, method):
    # TP4 -> TP2 shaped: sender 2 heads, receiver 4, sender fills receiver heads [2, 4);
    # "A>B": the sender stores layout A, the receiver B (converted head by head).
    sender, _, receiver = layout.partition(">")
    hs = HeadSlice(sender, 3, 8, 16, 2, 2, 4, 0, 2, 2, receiver_layout=receiver or None)
    route = hs.route()
    rng = np.random.default_rng(7)
    src, dst = _pools_pair([hs.sender_spec(20, pad=48)], [hs.receiver_spec(24, pad=16)])
    bs = _blocks(rng, kind, 9, 20, unique=False)
    bd = _blocks(rng, "random" if kind == "repeat" else kind, 9, 24, unique=True)
    want = _clone(dst)
    reference_copy(route, src, want, bs, bd)

    got = _clone(dst)
    assert copy_local(route, src, got, bs, bd, method=method) == 9 * hs.buffer_bytes(2) * 6
    _assert_pools_equal(got, want)

    staged = gather(route, src, bs, method=method)
    assert torch.equal(staged, reference_staging(route, src, bs))
    got = _clone(dst)
    scatter(route, staged, got, bd, method=method)
    _assert_pools_equal(got, want)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_fragments_crc32_agrees_after_a_copy_and_catches_one_wrong_byte(layout):
    import zlib

    hs = HeadSlice(layout, 3, 8, 16, 2, 2, 4, 0, 2, 2)
    route = hs.route()
    src, dst = _pools_pair([hs.sender_spec(20, pad=48)], [hs.receiver_spec(24, pad=16)])
    bs, bd = np.array([3, 1, 7, 7, 0]), np.array([10, 2, 23, 5, 6])
    fragments = expand_fragments(route, src, dst, bs, bd)
    ((so, do, ln),) = fragments.values()
    # Reference: the crc32 of all the fragments' bytes joined, sliced from the torch tensor.
    source = src[0].tensor
    pieces = [bytes(source[o : o + n].tolist()) for o, n in zip(so, ln, strict=True)]
    expected = zlib.crc32(b"".join(pieces))
    assert fragments_crc32(src, fragments, side="src") == expected
    assert fragments_crc32(dst, fragments, side="dst") != expected  # nothing copied yet
    copy_local(route, src, dst, bs, bd)
    assert fragments_crc32(dst, fragments, side="dst") == expected
    # The device path copies only the touched slots: the same bytes at remapped offsets.
    image, local = _touched_slots(src[0], so)
    assert [bytes(image[o : o + n]) for o, n in zip(local.tolist(), ln.tolist(), strict=True)] == (
        pieces
    )
    dst[0].tensor[int(do[-1]) + int(ln[-1]) - 1] ^= 1  # last byte of the last fragment
    assert fragments_crc32(dst, fragments, side="dst") != expected


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_head_slice_template_is_one_family(layout):
    """All layers' runs of a head slice collapse into one strided copy per block progression."""
    route = HeadSlice(layout, 80, 32, 128, 2, 2, 4, 0, 0, 2).route()
    assert len(_families(route.segments[0])) == 1


# --- random templates -----------------------------------------------------------------------


def _random_case(seed: int):
    rng = np.random.default_rng(seed)
    groups = int(rng.integers(1, 3))
    segments, src_ext, dst_cursor = [], {}, {}
    for _ in range(int(rng.integers(1, 4))):
        g = int(rng.integers(0, groups))
        sp, dp = 2 * g + int(rng.integers(0, 2)), 2 * g + int(rng.integers(0, 2))
        runs = []
        for _ in range(int(rng.integers(1, 4))):  # families of equally shaped runs
            ln, count = int(rng.integers(1, 40)), int(rng.integers(1, 5))
            dst_step = ln + int(rng.integers(0, 9))
            src_step = int(rng.integers(0, 50))
            s0, s_delta = int(rng.integers(0, 200)), int(rng.integers(0, 60))
            gap = int(rng.integers(0, 5))
            # Irregular spacing on one side must split the family (src jitter or dst gap jitter).
            irregular, dst_irregular = bool(rng.integers(0, 2)), bool(rng.integers(0, 2))
            for i in range(int(rng.integers(1, 5))):
                d = dst_cursor.get(dp, 0)
                so = s0 + i * s_delta + (int(rng.integers(0, 3)) if irregular else 0)
                runs.append(Run(so, d, ln, count, src_step, dst_step))
                jitter = int(rng.integers(0, 3)) if dst_irregular else 0
                dst_cursor[dp] = d + (count - 1) * dst_step + ln + gap + jitter
                end = so + (count - 1) * src_step + ln
                src_ext[sp] = max(src_ext.get(sp, 1), end)
        segments.append(Segment(sp, dp, tuple(runs), g))
    route = Route(0, 1, tuple(segments))

    def specs(ext):
        out = []
        for pid, e in sorted(ext.items()):
            slot = e + int(rng.integers(0, 8))
            out.append(PoolSpec(pid, slot, slot + int(rng.integers(0, 16)), 12, pid // 2))
        return out

    src, dst = _pools_pair(specs(src_ext), specs(dst_cursor))
    bs, bd = {}, {}
    for g in range(groups):
        n = int(rng.integers(0, 10))
        kind = KINDS[int(rng.integers(0, len(KINDS)))]
        bs[g] = _blocks(rng, kind, n, 12, unique=False)
        bd[g] = _blocks(rng, "random" if kind == "repeat" else kind, n, 12, unique=True)
    return route, src, dst, bs, bd, rng


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_random_templates_match_oracle(seed):
    route, src, dst, bs, bd, rng = _random_case(seed)
    want = _clone(dst)
    reference_copy(route, src, want, bs, bd)
    ref_staged = reference_staging(route, src, bs)
    for method in METHODS:
        got = _clone(dst)
        copy_local(route, src, got, bs, bd, method=method)
        _assert_pools_equal(got, want)

        staged = gather(route, src, bs, method=method)
        assert torch.equal(staged, ref_staged)
        got = _clone(dst)
        scatter(route, staged, got, bd, method=method)
        _assert_pools_equal(got, want)

    # Chunked into a larger buffer at an offset: same bytes, same result.
    layout = staging_layout(route, bs)
    buf = torch.full((layout.nbytes + 37,), 0xAB, dtype=torch.uint8)
    chunk = int(rng.integers(1, 4))
    for ch in layout.chunks(chunk):
        gather(route, src, bs, out=buf, offset=37, chunk=ch)
    assert torch.equal(buf[37:], ref_staged)
    assert bool((buf[:37] == 0xAB).all())
    got = _clone(dst)
    for ch in reversed(layout.chunks(chunk)):
        scatter(route, buf, got, bd, offset=37, chunk=ch)
    _assert_pools_equal(got, want)


def _table_fragments(route, src, dst, bs, bd, limit=None):
    """(src offset, dst offset, length) of every fragment the prepared tables select, with the
    offsets relative to each pool's base as in expand_fragments, per (src pool, dst pool)."""
    tables = fragment_tables(
        route,
        {k: p.spec for k, p in src.items()},
        {k: p.spec for k, p in dst.items()},
        **({"limit": limit} if limit else {}),
    )
    if tables is None:
        return None
    li, ri = fragment_indices(route, tables, bs, bd)
    rows = []
    for table in tables:  # flatten: index -> (pool, offset, length)
        pools = np.concatenate([np.full(o.size, p) for p, o, _ in table.entries] or [[]])
        offsets = np.concatenate([o for _, o, _ in table.entries] or [[]])
        lengths = np.concatenate([n for _, _, n in table.entries] or [[]])
        rows.append((pools, offsets, lengths))
    (sp, so, sl), (dp, do, dl) = rows
    assert np.array_equal(sl[li], dl[ri])  # a local fragment and its remote one: same length
    return Counter(
        (int(sp[a]), int(dp[b]), int(so[a]), int(do[b]), int(sl[a]))
        for a, b in zip(li.tolist(), ri.tolist(), strict=True)
    )


def _expanded(route, src, dst, bs, bd):
    return Counter(
        (sp, dp, int(a), int(b), int(n))
        for (sp, dp), (so, do, ln) in expand_fragments(route, src, dst, bs, bd).items()
        for a, b, n in zip(so, do, ln, strict=True)
    )


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_prepared_fragment_tables_select_exactly_the_expanded_fragments(seed):
    # The hot path names a request's fragments by index into per-route tables (NIXL prepared
    # descriptor lists); they must be the very fragments expand_fragments computes.
    route, src, dst, bs, bd, _ = _random_case(seed)
    assert _table_fragments(route, src, dst, bs, bd) == _expanded(route, src, dst, bs, bd)


def test_fragment_tables_refuse_out_of_range_ids_and_oversized_routes():
    hs = HeadSlice("HND", 3, 8, 16, 2, 2, 4, 0, 2, 2)
    route = hs.route()
    src, dst = _pools_pair([hs.sender_spec(20, pad=48)], [hs.receiver_spec(24, pad=16)])
    bs, bd = np.array([3, 1, 7]), np.array([10, 2, 23])
    assert _table_fragments(route, src, dst, bs, bd) == _expanded(route, src, dst, bs, bd)
    with pytest.raises(BlockRangeError, match=r"generation block ids must be in 0\.\.23"):
        _table_fragments(route, src, dst, bs, np.array([10, 2, 24]))
    with pytest.raises(BlockRangeError, match=r"context block ids must be in 0\.\.19"):
        _table_fragments(route, src, dst, np.array([3, -1, 7]), bd)
    # 6 fragments per block: 20 source slots need 120 descriptors, more than the limit here
    assert route.fragments_per_block == 6
    assert _table_fragments(route, src, dst, bs, bd, limit=119) is None
    assert _table_fragments(route, src, dst, bs, bd, limit=144) is not None


@settings(max_examples=200, deadline=None)
@given(
    a=st.lists(st.integers(0, 30), max_size=40),
    data=st.data(),
)
def test_progressions_cover_every_pair_once(a, data):
    b = data.draw(st.permutations(list(range(40))))[: len(a)]
    a_arr, b_arr = np.array(a, dtype=np.int64), np.array(b, dtype=np.int64)
    got: Counter[tuple[int, int]] = Counter()
    for s, m, sa, sb in _progressions(a_arr, b_arr):
        assert m >= 1 and sa >= 0 and sb >= 0
        for i in range(m):
            got[(int(a_arr[s]) + i * sa, int(b_arr[s]) + i * sb)] += 1
    assert got == Counter(zip(a, b, strict=True))


def test_contiguous_blocks_are_one_progression():
    a = np.arange(5, 105)
    assert _progressions(a, a + 3) == [(0, 100, 1, 1)]
    assert len(_progressions(np.array([0, 1, 2, 10, 11, 12]), np.arange(6))) == 2


# --- errors ---------------------------------------------------------------------------------


def _two_group_case():
    hs = HeadSlice("HND", 2, 4, 8, 2, 2, 2, 0, 0, 2)
    r0 = hs.route(0, 0, 0)
    r1 = hs.route(1, 1, 1)
    route = Route(0, 0, r0.segments + r1.segments)
    src, dst = _pools_pair(
        [hs.sender_spec(8, 0), PoolSpec(1, hs.slot_bytes(2), hs.slot_bytes(2), 8, 1)],
        [hs.receiver_spec(8, 0), PoolSpec(1, hs.slot_bytes(2), hs.slot_bytes(2), 8, 1)],
    )
    return route, src, dst


def test_out_of_range_destination_fails_before_any_write():
    route, src, dst = _two_group_case()
    before = _clone(dst)
    staged = gather(route, src, {0: [0, 1], 1: [2, 3]})
    with pytest.raises(BlockRangeError, match=r"destination block id 8 at index 1 .* pool 1"):
        scatter(route, staged, dst, {0: [4, 5], 1: [6, 8]})
    with pytest.raises(BlockRangeError, match="destination block id 8"):
        copy_local(route, src, dst, {0: [0, 1], 1: [2, 3]}, {0: [4, 5], 1: [6, 8]})
    _assert_pools_equal(dst, before)


def test_bad_source_ids_and_lists_are_refused():
    route, src, dst = _two_group_case()
    with pytest.raises(BlockRangeError, match="source block id -1 at index 0"):
        gather(route, src, {0: [-1], 1: [0]})
    with pytest.raises(BlockRangeError, match="no block list for layer group"):
        gather(route, src, {0: [1]})
    with pytest.raises(BlockRangeError, match="repeat"):
        copy_local(route, src, dst, [0, 1], [3, 3])
    with pytest.raises(BlockRangeError, match="2 source blocks vs 1 destination"):
        copy_local(route, src, dst, [0, 1], [3])


def test_template_outside_slot_and_short_staging_are_refused():
    src, dst = _pools_pair([PoolSpec(0, 64, 64, 4)], [PoolSpec(0, 64, 80, 4)])
    too_far = Route(0, 0, (Segment(0, 0, (Run(0, 40, 8, 4, 8, 8),)),))  # dst reaches 72 > 64
    with pytest.raises(TemplateError, match="reaches byte 72"):
        copy_local(too_far, src, dst, [0], [0])
    ok = Route(0, 0, (Segment(0, 0, (Run(0, 0, 16),)),))
    with pytest.raises(TemplateError, match="exceeds the staging buffer"):
        gather(ok, src, [0, 1], out=torch.empty(31, dtype=torch.uint8))
    with pytest.raises(TemplateError, match="not among this rank's pools"):
        gather(Route(0, 0, (Segment(5, 0, (Run(0, 0, 16),)),)), src, [0])


def test_align_blocks_pairs_suffixes_and_filters_cp():
    route = Route.from_dict(
        {
            "segments": [{"src_pool": 0, "dst_pool": 0, "runs": [{"src": 0, "dst": 0, "len": 4}]}],
            "cp_modulus": 2,
            "cp_remainder": 1,
        }  # fmt: skip
    )
    src, dst = align_blocks(route, {0: ([9, 1, 2, 3, 4], [7, 8, 5, 6])})
    # Last 4 of each side pair up: (1,7) (2,8) (3,5) (4,6), logical blocks 1..4 of 5; CP keeps
    # the odd logical blocks (never the position in the shorter list).
    assert src[0].tolist() == [1, 3] and dst[0].tolist() == [7, 5]
    helix = dataclasses.replace(route, cp_side="generation")
    src, dst = align_blocks(helix, {0: ([9, 1, 2, 3, 4], [[10, 11, 12], [20, 21]])})
    # one table per generation CP rank: rank 1 holds logical blocks 1 and 3
    assert src[0].tolist() == [1, 3] and dst[0].tolist() == [20, 21]


def test_align_request_reuses_the_lists_of_a_route_over_the_same_groups_and_cp_ranks():
    """One request's routes (another sender, other runs) that cover the same layer groups on
    the same CP rank share their aligned lists; another CP remainder does not."""

    def route(remainder: int) -> Route:
        return Route.from_dict(
            {
                "segments": [
                    {"src_pool": 0, "dst_pool": 0, "runs": [{"src": 0, "dst": 0, "len": 4}]}
                ],
                "cp_modulus": 2,
                "cp_remainder": remainder,
            }
        )

    blocks = {0: ([9, 1, 2, 3, 4], [7, 8, 5, 6])}
    memo: dict = {}
    first = align_request(route(1), blocks, memo=memo)
    again = align_request(dataclasses.replace(route(1), sender_rank=3), blocks, memo=memo)
    assert again[0].sender_rank == 3 and again[1] is first[1] and again[2] is first[2]
    other = align_request(route(0), blocks, memo=memo)
    assert other[1][0].tolist() == [2, 4] and other[2][0].tolist() == [8, 6]
    alone = align_request(route(0), blocks)
    assert alone[1][0].tolist() == [2, 4] and alone[2][0].tolist() == [8, 6]
    assert len(memo) == 2


@pytest.mark.parametrize("large_side", ["context", "generation"])
def test_align_request_runs_a_ratio_as_one_lane_per_sub_block_and_a_partial_tail(large_side):
    segments = [
        {"src_pool": 0, "dst_pool": 0, "sub_block": i, "runs": [{"src": 0, "dst": 0, "len": 4}]}
        for i in range(3)
    ]
    route = Route.from_dict({"segments": segments, "block_ratio": 3, "large_side": large_side,
                             "small_tokens_per_block": 2})  # fmt: skip
    # 15 tokens: 3 large blocks of 6 (the last holds 3), 8 small blocks of 2 (the last holds 1)
    large, small = [7, 8, 9], [1, 2, 3, 4, 5, 6, 10, 11]
    lists = (large, small) if large_side == "context" else (small, large)
    lanes, src, dst = align_request(route, {0: lists}, num_tokens=15)
    big, little = (src, dst) if large_side == "context" else (dst, src)
    assert {g: (big[g].tolist(), little[g].tolist()) for g in sorted(big)} == {
        -4: ([9], [11]),  # the tail: small block 7 (token 14 only), sub-block 1 of large 9
        -3: ([7, 8], [3, 6]),  # sub-block 2
        -2: ([7, 8], [2, 5]),  # sub-block 1 (the tail left out)
        -1: ([7, 8, 9], [1, 4, 10]),  # sub-block 0
    }
    (tail,) = [s for s in lanes.segments if s.layer_group == -4]
    assert tail.runs[0].len == 2  # one token of two: half the run
    assert (lanes.block_ratio, lanes.large_side) == (1, None)
    assert staging_layout(lanes, src).nbytes == 7 * 4 + 2
    with pytest.raises(BlockRangeError) as error:
        align_request(route, {0: lists})
    assert error.value.code == "ambiguous_alignment"


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_fragments_crc32_gathered_sums_as_fragment_by_fragment(layout, monkeypatch):
    from workers import executors

    hs = HeadSlice(layout, 3, 8, 16, 2, 2, 4, 0, 2, 2)
    route = hs.route()
    src, dst = _pools_pair([hs.sender_spec(20, pad=48)], [hs.receiver_spec(24, pad=16)])
    src[0].tensor.copy_(torch.randint(0, 256, src[0].tensor.shape, dtype=torch.uint8))
    bs, bd = np.array([3, 1, 7, 7, 0]), np.array([10, 2, 23, 5, 6])
    fragments = expand_fragments(route, src, dst, bs, bd)
    ((so, do, ln),) = fragments.values()
    image, local = executors._host_image(src[0], so)
    gathered = executors._gather_uniform(image, local, ln)
    pieces = [bytes(image[o : o + n]) for o, n in zip(so.tolist(), ln.tolist(), strict=True)]
    assert gathered is not None  # fragments of one length: one buffer, the fragments in order
    assert gathered.tobytes() == b"".join(pieces)
    crc = fragments_crc32(src, fragments, side="src")
    monkeypatch.setattr(executors, "GATHER_MAX", 0)  # fragment by fragment
    assert executors._gather_uniform(image, local, ln) is None
    assert fragments_crc32(src, fragments, side="src") == crc


def test_gather_takes_fragments_of_one_length_at_any_offset():
    from workers.executors import _gather_uniform

    image = memoryview(bytes(range(256)) * 4)
    got = _gather_uniform(image, np.array([512, 0, 100]), np.array([256, 256, 256]))
    assert got is not None
    assert got.tobytes() == bytes(image[512:768]) + bytes(image[0:256]) + bytes(image[100:356])
    assert _gather_uniform(image, np.array([0, 256]), np.array([256, 128])) is None  # two lengths
    assert _gather_uniform(image, np.array([0]), np.array([4096])) is None  # long: one by one
    empty = np.array([], dtype=np.int64)
    assert _gather_uniform(image, empty, empty) is None


def test_gather_bytes_through_kept_windows_equals_a_plain_gather():
    from workers.executors import Windows, gather_bytes

    image = np.frombuffer(bytes(range(256)) * 64, dtype=np.uint8)
    windows = Windows(limit=2)
    for offsets, length in (([512, 0, 100], 256), ([7, 3000], 64), ([0, 1, 2, 3, 4], 1000)):
        offs, lengths = np.array(offsets), np.full(len(offsets), length)
        plain = gather_bytes(image, offs, lengths)
        kept = gather_bytes(image, offs, lengths, windows=(windows, "img"))
        assert (
            kept.tobytes()
            == plain.tobytes()
            == b"".join(image[o : o + length].tobytes() for o in offsets)
        )
    assert windows.rows("img", image, 64) is windows.rows("img", image, 64)  # kept
    grown = np.concatenate([image, image])  # the key names another image: a new window
    assert windows.rows("img", grown, 64) is not windows.rows("img", image, 64)


@settings(max_examples=300, deadline=None)
@given(
    context=st.lists(st.integers(-2, 40), max_size=7),
    generation=st.lists(st.integers(-2, 40), max_size=7),
)
def test_align_request_plain_lists_align_as_the_general_path_does(context, generation):
    """Plain lists take a shortcut (equal sizes, no CP, no num_tokens); the same lists as numpy
    arrays take the general path: the same pairs, or the same refusal."""
    route = Route.from_dict(
        {"segments": [{"src_pool": 0, "dst_pool": 0, "runs": [{"src": 0, "dst": 0, "len": 4}]}]}
    )

    def run(blocks):
        try:
            _, src, dst = align_request(route, blocks)
        except BlockRangeError as error:
            return ("refused", error.code, str(error))
        return (src[0].dtype, src[0].tolist(), dst[0].tolist())

    shortcut = run({0: (list(context), list(generation))})
    general = run({0: (np.array(context, dtype=np.int64), np.array(generation, dtype=np.int64))})
    assert shortcut == general
