"""CUDA executors and VRAM NIXL registration (skipped without a GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from workers.executors import copy_local, expand_fragments, fragments_crc32, gather, scatter
from workers.pools import allocate_pools, attach_pools, fill_pattern
from workers.testing.oracles import HeadSlice, reference_copy, reference_staging

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _cpu_and_cuda(specs, rank):
    cpu = allocate_pools(specs)
    cuda = allocate_pools(specs, device="cuda")
    for pid in cpu:
        fill_pattern(rank, cpu[pid])
        fill_pattern(rank, cuda[pid])
    return cpu, cuda


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["auto", "index", "strided"])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_cuda_executors_match_cpu_oracle(layout, method):
    hs = HeadSlice(layout, 4, 16, 64, 2, 2, 4, 0, 2, 2)
    route = hs.route()
    src_cpu, src = _cpu_and_cuda([hs.sender_spec(64, pad=128)], 0)
    dst_cpu, dst = _cpu_and_cuda([hs.receiver_spec(64)], 1)
    assert torch.equal(src[0].tensor.cpu(), src_cpu[0].tensor)  # pattern is device-independent
    rng = np.random.default_rng(0)
    bs = np.concatenate([np.arange(10, 30), rng.permutation(64)[:12]])
    bd = rng.permutation(64)[:32]
    reference_copy(route, src_cpu, dst_cpu, bs, bd)

    copy_local(route, src, dst, bs, bd, method=method)
    torch.cuda.synchronize()
    assert torch.equal(dst[0].tensor.cpu(), dst_cpu[0].tensor)

    staged = gather(route, src, bs, method=method)
    assert staged.is_cuda
    assert torch.equal(staged.cpu(), reference_staging(route, src_cpu, bs))
    _, fresh = _cpu_and_cuda([hs.receiver_spec(64)], 1)
    scatter(route, staged, fresh, torch.as_tensor(bd, device="cuda"), method=method)
    torch.cuda.synchronize()
    assert torch.equal(fresh[0].tensor.cpu(), dst_cpu[0].tensor)


@pytest.mark.timeout(120)
def test_cuda_fragments_crc32_matches_cpu():
    hs = HeadSlice("NHD", 4, 16, 64, 2, 2, 4, 0, 2, 2)
    route = hs.route()
    src_cpu, src = _cpu_and_cuda([hs.sender_spec(64, pad=128)], 0)
    dst_cpu, dst = _cpu_and_cuda([hs.receiver_spec(64)], 1)
    bs, bd = np.arange(40, 8, -1), np.arange(32)
    fragments = expand_fragments(route, src_cpu, dst_cpu, bs, bd)
    for side, cpu, cuda in (("src", src_cpu, src), ("dst", dst_cpu, dst)):
        assert fragments_crc32(cuda, fragments, side=side) == fragments_crc32(
            cpu, fragments, side=side
        )


@pytest.mark.timeout(120)
def test_cuda_attach_engine_tensor():
    hs = HeadSlice("HND", 2, 16, 64, 2, 2, 2, 0, 0, 2)
    spec = hs.sender_spec(8)
    engine = torch.zeros(spec.nbytes // 2, dtype=torch.bfloat16, device="cuda")
    pools = attach_pools([spec], {0: engine}, device="cuda")
    assert pools[0].base_address == engine.data_ptr() and pools[0].device.type == "cuda"


@pytest.mark.timeout(120)
def test_vram_to_vram_nixl_staged_and_fragments():
    pytest.importorskip("nixl")
    from workers.executors import staging_layout
    from workers.transport.nixl import NixlTransport

    hs = HeadSlice("NHD", 4, 16, 64, 2, 2, 4, 0, 2, 2)
    route = hs.route()
    src_cpu, src = _cpu_and_cuda([hs.sender_spec(32)], 0)
    dst_cpu, dst = _cpu_and_cuda([hs.receiver_spec(32)], 1)
    bs, bd = list(range(4, 20)), list(range(31, 15, -1))
    reference_copy(route, src_cpu, dst_cpu, bs, bd)
    size = staging_layout(route, bs).nbytes
    with (
        NixlTransport("vram-s", src, staging_bytes=size) as s,
        NixlTransport("vram-r", dst, staging_bytes=size) as r,
    ):
        assert s.peer_info().mem_type == "VRAM"
        s.add_peer(r.peer_info().to_json())
        s.write_staged("vram-r", route, bs, dst_offset=0, tag=b"v", chunk_blocks=5, timeout_s=30)
        r.receive_staged("vram-s", route, bd, offset=0, tag=b"v", chunk_blocks=5, timeout_s=30)
        assert torch.equal(dst[0].tensor.cpu(), dst_cpu[0].tensor)
        fill_pattern(1, dst[0])
        torch.cuda.synchronize()
        s.write_fragments("vram-r", route, bs, bd, tag=b"f", timeout_s=30)
        r.wait_notif("vram-s", [b"f"], 30)
        assert torch.equal(dst[0].tensor.cpu(), dst_cpu[0].tensor)
