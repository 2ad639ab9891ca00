"""Pools: allocation, attaching engine tensors, and the (rank, pool, byte) test pattern."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from workers.pools import (
    PoolError,
    PoolSpec,
    allocate_pools,
    attach_pools,
    expected_bytes,
    fill_pattern,
    pattern_span,
    pattern_spans,
    pattern_tensor,
)


def test_allocate_gives_zeroed_pools_with_distinct_addresses():
    pools = allocate_pools(
        [PoolSpec(0, 100, 128, 5), {"id": 3, "slot_bytes": 64, "num_slots": 2, "layer_group": 1}]
    )
    assert pools[0].tensor.numel() == 4 * 128 + 100  # last slot is not padded
    assert pools[3].spec.slot_stride_bytes == 64 and pools[3].spec.layer_group == 1
    assert pools[0].base_address != pools[3].base_address
    assert not pools[0].tensor.any()
    assert pools[0].slot(2).data_ptr() == pools[0].base_address + 256


def test_spec_and_duplicate_ids_are_refused():
    with pytest.raises(PoolError, match="slot_stride_bytes 8 < slot_bytes 16"):
        PoolSpec(0, 16, 8, 1)
    with pytest.raises(PoolError, match="duplicate pool ids"):
        allocate_pools([PoolSpec(1, 8, 8, 1), PoolSpec(1, 8, 8, 1)])


def test_attach_shares_engine_memory_of_any_dtype():
    engine = torch.zeros(4, 64, dtype=torch.bfloat16)  # 512 bytes
    pools = attach_pools([PoolSpec(0, 128, 128, 4)], {0: engine})
    assert pools[0].base_address == engine.data_ptr()
    fill_pattern(2, pools[0])
    assert torch.equal(engine.view(torch.uint8).reshape(-1), pattern_tensor(2, 0, 512))


def test_attach_refuses_unfit_tensors():
    spec = PoolSpec(0, 128, 128, 4)
    with pytest.raises(PoolError, match="holds 511 bytes, spec needs 512"):
        attach_pools([spec], {0: torch.zeros(511, dtype=torch.uint8)})
    with pytest.raises(PoolError, match="not contiguous"):
        attach_pools([spec], {0: torch.zeros(64, 16, dtype=torch.uint8).t()})
    with pytest.raises(PoolError, match="no tensor given"):
        attach_pools([spec], {})
    with pytest.raises(PoolError, match="expected cuda"):
        attach_pools([spec], {0: torch.zeros(512, dtype=torch.uint8)}, device="cuda")


def test_pattern_is_deterministic_and_distinguishes_rank_pool_and_offset():
    n = (1 << 16) * 3 + 1234  # crosses pages and has a tail
    a = pattern_tensor(1, 2, n)
    offsets = torch.arange(n)
    assert torch.equal(a, expected_bytes(1, 2, offsets))
    assert torch.equal(a, pattern_tensor(1, 2, n))
    for other in (pattern_tensor(0, 2, n), pattern_tensor(1, 3, n)):
        assert (a != other).all()
    # Bytes one, 256, 2^16 and 2^24 apart differ: misplaced copies cannot hide.
    big = torch.arange(0, 1 << 25, 4099)
    for delta in (1, 256, 1 << 16, 1 << 24):
        assert (expected_bytes(0, 0, big) != expected_bytes(0, 0, big + delta)).all()


def test_pattern_spans_are_the_pattern_across_page_boundaries():
    """Any spans (one add per page), and spans of whole 256-byte rows (one broadcast add for
    all of them, the shape of KV fragments), one after another as a receiver checks them."""
    rng = np.random.default_rng(3)
    n = (1 << 18) + 777
    rows = n // 256
    for rank, pool in ((0, 0), (3, 1)):
        whole = pattern_tensor(rank, pool, n).numpy()
        spans = [(0, n), (0, 0), ((1 << 16) - 5, 10), (1 << 17, 1)]
        spans += [
            (int(a), int(b))
            for a, b in zip(rng.integers(0, n // 2, 20), rng.integers(0, n // 2, 20), strict=True)
        ]
        in_rows = [(0, rows * 256), ((1 << 16) - 512, 1024), (256 * 7, 0), (1 << 17, 256)]
        in_rows += [
            (256 * int(a), 256 * int(b))
            for a, b in zip(
                rng.integers(0, rows // 2, 20), rng.integers(0, rows // 2, 20), strict=True
            )
        ]
        for start, length in spans + in_rows:
            got = pattern_span(rank, pool, start, length)
            assert got.dtype == np.uint8 and got.shape == (length,)
            assert np.array_equal(got, whole[start : start + length]), (start, length)
        for group in (spans, in_rows):
            starts, lengths = zip(*group, strict=True)
            assert np.array_equal(
                pattern_spans(rank, pool, starts, lengths),
                np.concatenate([whole[a : a + b] for a, b in group]),
            )


def test_pattern_images_are_the_pattern_and_grow_within_their_budget(monkeypatch):
    """The cached image of a sender pool's pattern (what fill checks gather from) is the
    pattern at every offset, grows when a later check reaches further, and is refused past
    the cache's budget (the checks then compute the spans)."""
    from workers import pools as pools_module

    monkeypatch.setattr(pools_module, "_images", {})
    n = (3 << 20) + 12345
    for rank, pool in ((0, 0), (5, 2)):
        small = pools_module.pattern_image(rank, pool, 1000)
        assert small is not None and small.size == 1 << 20 and not small.flags.writeable
        assert np.array_equal(small, pattern_tensor(rank, pool, small.size).numpy())
        grown = pools_module.pattern_image(rank, pool, n)
        assert grown is not None and grown.size >= n
        assert np.array_equal(grown[:n], pattern_tensor(rank, pool, n).numpy())
        assert pools_module.pattern_image(rank, pool, 10) is grown  # cached
    monkeypatch.setattr(pools_module, "PATTERN_CACHE_BYTES", 9 << 20)
    assert pools_module.pattern_image(1, 1, 2 << 20) is None  # 8 MiB cached + 2 > 9
    assert pools_module.pattern_image(1, 1, 1 << 20) is not None


def test_worker_modules_import_without_the_control_plane():
    code = (
        "import sys; import workers.pools, workers.executors, workers.testing.oracles, "
        "workers.transport.local, workers.transport.nixl; "
        "bad = [m for m in ('sqlalchemy', 'fastapi', 'alembic') if m in sys.modules]; "
        "assert not bad, bad; assert 'nixl' not in sys.modules, 'nixl imported eagerly'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
