"""A rank's KV pools as flat torch ``uint8`` tensors (CPU or CUDA).

A pool is ``num_slots`` slots of ``slot_bytes``, ``slot_stride_bytes`` apart: slot ``s`` starts at
byte ``s × slot_stride_bytes`` of the tensor. A worker either allocates its pools (tests, demos,
benchmarks) or attaches to the tensors the engine already owns; either way the executors only ever
see a :class:`Pool` (spec + tensor), and the transports register ``tensor`` with NIXL.

Test pattern: :func:`fill_pattern` writes ``pattern(rank, pool, offset)`` at every byte, where

    pattern(r, p, o) = (lo(o mod 2^16) + hi(o >> 16) + 59·r + 97·p + 1) mod 256
    lo(x) = (x mod 256) + 7·(x >> 8),  hi(h) = 13·h + 31·(h >> 8)

Neighbouring bytes differ, and so do bytes 256, 2^16 or 2^24 apart, so a copy from the wrong rank,
pool, slot, layer or head shows up as a byte mismatch. The formula splits into a 64 KiB page term
and a per-page constant, which makes filling a multi-GiB pool one broadcast add per chunk.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

_PAGE_BYTES = 1 << 16
_FILL_CHUNK_PAGES = 1024  # 64 MiB per broadcast add: bounded temporaries for huge pools


class PoolError(ValueError):
    """A pool spec or an attached tensor is unusable."""


@dataclass(frozen=True)
class PoolSpec:
    """Geometry of one registered pool (the wire ``pools[]`` entry, minus addresses)."""

    id: int
    slot_bytes: int
    slot_stride_bytes: int
    num_slots: int
    layer_group: int = 0

    def __post_init__(self) -> None:
        if self.slot_bytes <= 0 or self.num_slots <= 0:
            raise PoolError(f"pool {self.id}: slot_bytes and num_slots must be positive")
        if self.slot_stride_bytes < self.slot_bytes:
            raise PoolError(
                f"pool {self.id}: slot_stride_bytes {self.slot_stride_bytes} < "
                f"slot_bytes {self.slot_bytes}"
            )

    @property
    def nbytes(self) -> int:
        """Bytes a pool tensor must hold: the last slot need not be padded to the stride."""
        return (self.num_slots - 1) * self.slot_stride_bytes + self.slot_bytes

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PoolSpec:
        """Build from a wire dict (``slot_stride_bytes`` defaults to ``slot_bytes``)."""
        slot_bytes = int(d["slot_bytes"])
        return cls(
            id=int(d["id"]),
            slot_bytes=slot_bytes,
            slot_stride_bytes=int(d.get("slot_stride_bytes") or slot_bytes),
            num_slots=int(d["num_slots"]),
            layer_group=int(d.get("layer_group", 0)),
        )


@dataclass(frozen=True)
class Pool:
    """A pool spec bound to its memory: a 1-D contiguous ``uint8`` tensor."""

    spec: PoolSpec
    tensor: torch.Tensor

    @property
    def id(self) -> int:
        return self.spec.id

    @property
    def base_address(self) -> int:
        """Virtual address of slot 0 (what a rank reports as ``base_address``)."""
        return int(self.tensor.data_ptr())

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    def slot(self, s: int) -> torch.Tensor:
        """The ``slot_bytes`` of slot ``s`` (a view)."""
        start = s * self.spec.slot_stride_bytes
        return self.tensor[start : start + self.spec.slot_bytes]


def _as_specs(specs: Iterable[PoolSpec | Mapping[str, Any]]) -> list[PoolSpec]:
    out = [s if isinstance(s, PoolSpec) else PoolSpec.from_dict(s) for s in specs]
    ids = [s.id for s in out]
    if len(set(ids)) != len(ids):
        raise PoolError(f"duplicate pool ids: {sorted(ids)}")
    return out


def allocate_pools(
    specs: Iterable[PoolSpec | Mapping[str, Any]], device: str | torch.device = "cpu"
) -> dict[int, Pool]:
    """Allocate zeroed pools for ``specs`` on ``device``; keyed by pool id."""
    import torch

    return {
        s.id: Pool(s, torch.zeros(s.nbytes, dtype=torch.uint8, device=device))
        for s in _as_specs(specs)
    }


def attach_pools(
    specs: Iterable[PoolSpec | Mapping[str, Any]],
    tensors: Mapping[int, torch.Tensor],
    device: str | torch.device | None = None,
) -> dict[int, Pool]:
    """Wrap engine-owned tensors as pools, refusing any that the spec does not fit.

    Each tensor must be contiguous and hold at least ``spec.nbytes`` bytes; any dtype is viewed as
    raw bytes (an engine's bf16 KV tensor is fine). With ``device`` given, every tensor must live
    there. Memory is shared, never copied.
    """
    import torch

    pools: dict[int, Pool] = {}
    want = torch.device(device) if device is not None else None
    for s in _as_specs(specs):
        if s.id not in tensors:
            raise PoolError(f"pool {s.id}: no tensor given")
        t = tensors[s.id]
        if not t.is_contiguous():
            raise PoolError(f"pool {s.id}: tensor is not contiguous")
        if want is not None and t.device != want:
            raise PoolError(f"pool {s.id}: tensor on {t.device}, expected {want}")
        flat = t.reshape(-1).view(torch.uint8)
        if flat.numel() < s.nbytes:
            raise PoolError(
                f"pool {s.id}: tensor holds {flat.numel()} bytes, spec needs {s.nbytes} "
                f"({s.num_slots} slots × {s.slot_stride_bytes} stride)"
            )
        pools[s.id] = Pool(s, flat[: s.nbytes])
    return pools


def _hi_term(pages: torch.Tensor, rank: int, pool_id: int) -> torch.Tensor:
    import torch

    h = pages.to(torch.int64)
    return ((13 * h + 31 * (h >> 8) + 59 * rank + 97 * pool_id + 1) & 0xFF).to(torch.uint8)


def _lo_table(device: torch.device) -> torch.Tensor:
    import torch

    x = torch.arange(_PAGE_BYTES, dtype=torch.int64, device=device)
    return (((x & 0xFF) + 7 * (x >> 8)) & 0xFF).to(torch.uint8)


def expected_bytes(rank: int, pool_id: int, offsets: torch.Tensor) -> torch.Tensor:
    """The pattern bytes at ``offsets`` (int64, pool-relative) of ``rank``'s pool ``pool_id``."""
    import torch

    o = offsets.to(torch.int64)
    lo = ((o & 0xFF) + 7 * ((o & (_PAGE_BYTES - 1)) >> 8)) & 0xFF
    return ((lo.to(torch.uint8)) + _hi_term(o >> 16, rank, pool_id)).to(torch.uint8)


def pattern_span(rank: int, pool_id: int, start: int, length: int) -> np.ndarray:
    """The pattern bytes at offsets ``[start, start + length)`` of ``rank``'s pool ``pool_id``, in
    numpy (host-side checks: no torch kernel per call)."""
    return pattern_spans(rank, pool_id, [start], [length])


def pattern_spans(
    rank: int, pool_id: int, starts: Iterable[int], lengths: Iterable[int]
) -> np.ndarray:
    """The pattern bytes of several spans of ``rank``'s pool ``pool_id``, one after another:
    what a receiver expects of the fragments a sender wrote from these offsets.

    Within a 256-byte row of a page the pattern is ``column + constant(row)``. When every span
    is whole rows (KV fragments are: a head's bytes are a multiple of 256), all of them are one
    broadcast add of the row constants onto ``0..255``; otherwise one ``uint8`` add per span and
    page it touches onto a slice of the ``lo`` table. Either way no per-byte ``int64`` offsets,
    which made a fill check of a 4-block request take 50-200 ms."""
    start = np.asarray(starts, dtype=np.int64).reshape(-1)
    length = np.asarray(lengths, dtype=np.int64).reshape(-1)
    base = 59 * rank + 97 * pool_id + 1
    if not ((start | length) & 0xFF).any():
        per_span = length >> 8
        row = np.repeat((start >> 8) - (np.cumsum(per_span) - per_span), per_span)
        row += np.arange(row.size)  # the rows of every span, in order
        page = row >> 8
        constant = (7 * (row & 0xFF) + 13 * page + 31 * (page >> 8) + base) & 0xFF
        rows = np.add(
            constant.astype(np.uint8)[:, None], _COLUMNS[None, :]
        )  # rows outer: 2× faster
        return rows.reshape(-1)
    lo = _lo_np()
    out = np.empty(int(length.sum()), dtype=np.uint8)
    pos = 0
    for first, n in zip(start.tolist(), length.tolist(), strict=True):
        offset, end = first, first + n
        while offset < end:
            within = offset & (_PAGE_BYTES - 1)
            k = min(end - offset, _PAGE_BYTES - within)
            h = offset >> 16
            hi = (13 * h + 31 * (h >> 8) + base) & 0xFF
            np.add(lo[within : within + k], np.uint8(hi), out=out[pos : pos + k])
            offset += k
            pos += k
    return out


_COLUMNS = np.arange(256, dtype=np.uint8)

# Fill-mode checks compare a receive's bytes with the sender's pattern at their sources: a
# cached image of each sender pool's pattern turns that into one gather (about 2.5x faster than
# :func:`pattern_spans` for a 4-block request's 16 KiB fragments). Bounded: past this budget the
# checks compute the spans instead.
PATTERN_CACHE_BYTES = 512 << 20
_IMAGE_ROUND = 1 << 20  # images grow in whole MiB
_images: dict[tuple[int, int], np.ndarray] = {}
_images_lock = threading.Lock()


def pattern_image(rank: int, pool_id: int, nbytes: int) -> np.ndarray | None:
    """The pattern of ``rank``'s pool ``pool_id`` from offset 0, at least ``nbytes`` long, as a
    read-only array cached per (rank, pool) (an image grows when a later call needs more); None
    when it would take the cache past :data:`PATTERN_CACHE_BYTES`."""
    key = (rank, pool_id)
    image = _images.get(key)
    if image is not None and image.size >= nbytes:
        return image
    size = -(-max(nbytes, 1) // _IMAGE_ROUND) * _IMAGE_ROUND
    with _images_lock:
        image = _images.get(key)
        if image is not None and image.size >= nbytes:
            return image
        if sum(v.size for k, v in _images.items() if k != key) + size > PATTERN_CACHE_BYTES:
            return None
        pages = size // _PAGE_BYTES
        h = np.arange(pages, dtype=np.int64)
        hi = ((13 * h + 31 * (h >> 8) + 59 * rank + 97 * pool_id + 1) & 0xFF).astype(np.uint8)
        image = np.empty(size, dtype=np.uint8)
        np.add(_lo_np()[None, :], hi[:, None], out=image.reshape(pages, _PAGE_BYTES))
        image.flags.writeable = False
        _images[key] = image
    return image


@functools.cache
def _lo_np() -> np.ndarray:
    x = np.arange(_PAGE_BYTES, dtype=np.int64)
    table = (((x & 0xFF) + 7 * (x >> 8)) & 0xFF).astype(np.uint8)
    table.flags.writeable = False
    return table


def pattern_tensor(rank: int, pool_id: int, nbytes: int, device: str | torch.device = "cpu"):
    """A fresh ``uint8`` tensor of ``nbytes`` holding the pattern for offsets ``[0, nbytes)``."""
    import torch

    out = torch.empty(nbytes, dtype=torch.uint8, device=device)
    _fill(out, rank, pool_id)
    return out


def _fill(flat: torch.Tensor, rank: int, pool_id: int) -> None:
    import torch

    lo = _lo_table(flat.device)
    n_pages = flat.numel() // _PAGE_BYTES
    for p0 in range(0, n_pages, _FILL_CHUNK_PAGES):
        p1 = min(n_pages, p0 + _FILL_CHUNK_PAGES)
        pages = torch.arange(p0, p1, device=flat.device)
        view = flat[p0 * _PAGE_BYTES : p1 * _PAGE_BYTES].view(p1 - p0, _PAGE_BYTES)
        torch.add(lo.unsqueeze(0), _hi_term(pages, rank, pool_id).unsqueeze(1), out=view)
    tail = flat.numel() - n_pages * _PAGE_BYTES
    if tail:
        start = n_pages * _PAGE_BYTES
        flat[start:].copy_(
            expected_bytes(rank, pool_id, torch.arange(start, start + tail, device=flat.device))
        )


def fill_pattern(rank: int, pool: Pool) -> None:
    """Overwrite every byte of ``pool`` (slot padding included) with the (rank, pool) pattern."""
    _fill(pool.tensor, rank, pool.id)
