"""Fill-pattern verification: a worker in ``fill`` mode checks what its receives wrote.

:meth:`FillCheck.fill` writes the (rank, pool, byte) pattern into every pool of the rank
(:func:`~workers.pools.fill_pattern`). For every transfer it receives with ``verify``, the check
compares the bytes this transfer was meant to write (the sender's pattern at the planned source
offsets) and every byte that no transfer has targeted since the fill (still its own pattern):
earlier transfers' bytes are never mistaken for corruption. A receive without ``verify`` is only
noted when it starts; the bytes it writes are marked as targeted when a check needs them, or a
few at a time while the rank's progress thread is idle.

The worker (``workers/agent.py``) holds one :class:`FillCheck` and hands its hooks to the
handover: :meth:`~FillCheck.note_receive` (``on_start``), :meth:`~FillCheck.check_filled`
(``check``) and :meth:`~FillCheck.mark_some` (``on_idle``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from workers.crc import crc32, crc32_combine
from workers.executors import GATHER_MAX, Windows, expand_fragments, gather_bytes, uniform_length
from workers.handover import Handle
from workers.pools import (
    PATTERN_CACHE_BYTES,
    Pool,
    PoolSpec,
    fill_pattern,
    pattern_image,
    pattern_span,
    pattern_spans,
)

if TYPE_CHECKING:
    from workers.directory import Directory, PeerWorker
    from workers.executors import Route
    from workers.handover.handles import RouteState

log = logging.getLogger("kvplane.worker")

# Fill checks keep the crc32 of the sender's pattern per fragment (a few per slot); past this
# many (about 46 MB of dict) they start over.
PATTERN_SUMS_MAX = 1 << 18
# Fill mode: receives noted but not yet marked in _touched; past this, each new one marks the
# oldest (a worker that runs unverified receives for a long while, then checks, stays bounded).
UNMARKED_MAX = 1024
# Fill mode: noted receives marked per call of the handover's idle hook (see mark_some)
MARK_WHEN_IDLE = 2  # about 1 ms: a request that starts meanwhile waits no longer


class VerificationError(RuntimeError):
    """Fill-pattern verification found wrong bytes."""


# One pool pair of a receive (FillCheck._planned_writes): sender rank × 10⁶ + sender pool,
# destination pool, then per fragment the source offsets, destination offsets and lengths, and
# the one length they all have (0 when they differ).
_Writes = tuple[int, int, np.ndarray, np.ndarray, np.ndarray, int]


class _AnySpec(dict):  # type: ignore[type-arg]
    """A stand-in for a peer's pool specs where only destination offsets matter (any source id
    is in range: the sender checks its own)."""

    def __missing__(self, key: int) -> PoolSpec:
        return PoolSpec(id=key, slot_bytes=1, slot_stride_bytes=1, num_slots=1 << 62)


class Tally(Protocol):
    """Where the checks count the bytes they read (a worker's stats)."""

    verified_bytes: int


class FillCheck:
    """One rank's fill-pattern verification: :meth:`fill` its pools, then the handover's hooks
    (:meth:`note_receive`, :meth:`check_filled`, :meth:`mark_some`), :meth:`verify_transfer`
    and the sweep :meth:`verify_untouched`. ``peer_of(instance, rank)``: the peer worker whose
    published pools a receive's sources lie in (None: no endpoint)."""

    def __init__(
        self,
        rank: int,
        stats: Tally,
        peer_of: Callable[[str, int], PeerWorker | None],
    ) -> None:
        self.rank = rank
        self.stats = stats  # verified_bytes counts what the checks read
        self.peer_of = peer_of
        self.pools: dict[int, Pool] = {}  # the rank's pools, as last filled
        self._touched: dict[int, np.ndarray] = {}  # bytes some transfer targeted since the fill
        # Receives started whose bytes are not in _touched yet (see note_receive).
        self._unmarked: OrderedDict[Handle, None] = OrderedDict()
        self._marks_lock = threading.Lock()
        self._windows = Windows()  # sliding windows over pools and patterns
        self._images: dict[int, tuple[Pool, np.ndarray]] = {}  # CPU pools' bytes, in place
        self._peer_specs: tuple[object, dict[int, PoolSpec]] | None = None  # (info, its pools)
        self._patterns_prepared: set[tuple[int, int]] = set()  # (peer rank, pool): images built
        # crc32 of the sender's pattern per (rank, pool, offset, length) fragment
        self._pattern_sums: dict[tuple[int, int, int, int], int] = {}

    def fill(self, pools: dict[int, Pool]) -> None:
        """Write this rank's pattern into ``pools`` (the ones to check from now on); no byte is
        targeted yet."""
        for pool in pools.values():
            fill_pattern(self.rank, pool)
        self.pools = pools
        self._touched = {pid: np.zeros(p.tensor.numel(), dtype=bool) for pid, p in pools.items()}
        self._unmarked.clear()

    def prepare_patterns(self, directory: Directory) -> None:
        """Fill mode, generation side: build the pattern images of the pools of every context
        peer (what the checks compare with) on a thread of their own, so that the first
        verified receive from a peer does not wait for them (about 20 ms per 20 MB pool here).
        Each image once per process, and only while they take at most half the images' budget
        (the checks build what they need themselves otherwise)."""
        if directory.role == "context":
            return
        wanted = []
        for peer in directory.peers.values():
            for pool in peer.info.get("pools", []):
                try:
                    key = (peer.rank, int(pool["id"]))
                    nbytes = int(pool["num_slots"]) * int(pool["slot_stride_bytes"])
                except (KeyError, TypeError, ValueError):
                    continue
                if key not in self._patterns_prepared:
                    wanted.append((*key, nbytes))
        if not wanted or sum(n for _, _, n in wanted) > PATTERN_CACHE_BYTES // 2:
            return
        self._patterns_prepared.update((rank, pool) for rank, pool, _ in wanted)

        def build() -> None:
            for rank, pool_id, nbytes in wanted:
                if pattern_image(rank, pool_id, nbytes) is None:
                    return  # the budget is spent: the checks compute spans past it

        threading.Thread(target=build, daemon=True, name="kvplane-patterns").start()

    def note_receive(self, handle: Handle) -> None:
        """Fill mode, before the first byte lands: remember the receive. The bytes it will write
        are marked in ``_touched`` only when a check needs them (:meth:`_mark_noted`), so a
        receive without ``verify`` pays this one dict entry and nothing else."""
        if handle.side != "receive":
            return
        self._unmarked[handle] = None
        if len(self._unmarked) > UNMARKED_MAX:  # no check for a long while: keep it bounded
            with self._marks_lock:
                if self._unmarked:
                    self._mark_targeted(self._unmarked.popitem(last=False)[0])

    def mark_some(self) -> bool:
        """Fill mode, the progress thread with nothing pending for a while: mark a few noted
        receives, so that the next check does not mark them all on its own request's time
        (64 receives took about 50 ms here). Whether some are left."""
        if not self._unmarked:
            return False
        with self._marks_lock:
            for _ in range(min(MARK_WHEN_IDLE, len(self._unmarked))):
                self._mark_targeted(self._unmarked.popitem(last=False)[0])
            return bool(self._unmarked)

    def _mark_noted(self) -> None:
        """Mark the bytes of every receive noted so far, before a check reads ``_touched``."""
        with self._marks_lock:  # a check that returns from here sees every earlier mark done
            while self._unmarked:
                self._mark_targeted(self._unmarked.popitem(last=False)[0])

    def _mark_targeted(self, handle: Handle, writes: list[_Writes] | None = None) -> None:
        """The bytes ``handle`` (a receive) writes, marked in ``_touched`` (from its already
        planned ``writes`` where given)."""
        if writes is None:
            writes = self._planned_writes(handle, sources=False)
        for _, dst_pool, _, dst, lengths, length in writes:
            touched = self._touched[dst_pool]
            if length:  # one row per fragment of a writeable window: one assignment in C
                self._windows.rows(("touched", dst_pool), touched, length, writeable=True)[dst] = (
                    True
                )
                continue
            for d, n in zip(dst.tolist(), lengths.tolist(), strict=True):
                touched[d : d + n] = True

    def _planned_writes(self, handle: Handle, *, sources: bool = True) -> list[_Writes]:
        """What ``handle`` writes into this rank's pools, fragment by fragment, per pool pair:
        ``(sender rank × 10⁶ + sender pool, destination pool, source offsets, destination
        offsets, lengths, their one length or 0)`` (empty fragments left out); without
        ``sources`` the source offsets are meaningless (no peer needed)."""
        from workers.executors import align_request
        from workers.handover import normalize_blocks

        pairs = normalize_blocks(handle.blocks)
        num_tokens = handle.num_tokens
        out = []
        for route in handle.entry.routes:
            if route.receiver_rank != self.rank:
                continue
            aligned, src, dst = align_request(route, pairs, num_tokens)
            out += self._route_writes(handle, aligned, src, dst, sources=sources)
        return out

    def _route_writes(
        self,
        handle: Handle,
        route: Route,
        src: Mapping[int, np.ndarray],
        dst: Mapping[int, np.ndarray],
        *,
        sources: bool = True,
    ) -> list[_Writes]:
        """:meth:`_planned_writes` of one route, already aligned to the request's blocks."""
        src_specs: Mapping[int, PoolSpec] = _AnySpec()
        if sources:
            peer = self.peer_of(handle.peer, route.sender_rank)
            if peer is None:
                raise VerificationError(
                    f"no endpoint of {handle.peer} rank {route.sender_rank} to verify against"
                )
            src_specs = self._specs_of(peer.info)
        out = []
        fragments = expand_fragments(route, src_specs, self.pools, src, dst)
        for (src_pool, dst_pool), (so, do, ln) in fragments.items():
            keep = ln > 0
            if not keep.all():
                so, do, ln = so[keep], do[keep], ln[keep]
            source = route.sender_rank * 1_000_000 + src_pool
            out.append((source, dst_pool, so, do, ln, uniform_length(ln)))
        return out

    def _specs_of(self, info: Mapping[str, Any]) -> dict[int, PoolSpec]:
        """A peer's pool specs from its published info (parsed once per info)."""
        kept = self._peer_specs
        if kept is not None and kept[0] is info:
            return kept[1]
        specs = {int(p["id"]): PoolSpec.from_dict(p) for p in info["pools"]}
        self._peer_specs = (info, specs)
        return specs

    def _pool_image(self, pool_id: int) -> tuple[np.ndarray, bool]:
        """Pool ``pool_id``'s bytes as a flat ``uint8`` array, and whether it lasts: a CPU pool
        in place (the same array while the pool is, so its windows are kept), a device pool
        copied to the host (once per check)."""
        pool = self.pools[pool_id]
        if pool.tensor.device.type != "cpu":
            return pool.tensor.detach().cpu().numpy().view(np.uint8), False
        kept = self._images.get(pool_id)
        if kept is None or kept[0] is not pool:
            kept = (pool, pool.tensor.detach().numpy().view(np.uint8))
            self._images[pool_id] = kept
        return kept[1], True

    def check_filled(self, handle: Handle, routes: Sequence[RouteState]) -> str | None:
        """Before a verified receive resolves (fill mode): check its bytes; a reason fails it.
        The receive's own ``routes`` (aligned already) give the fragments; a route written
        fragment by fragment gets its receiver crc32 here, from the bytes the check gathers."""
        if not handle.verify:
            return None
        started = time.perf_counter()
        try:
            handle.verified_bytes = self.verify_transfer(handle, routes)
        except VerificationError as error:
            return str(error)
        finally:
            log.debug("fill check of %s: %.3f s", handle.request_id, time.perf_counter() - started)
        return None

    def verify_transfer(self, handle: Handle, routes: Sequence[RouteState] | None = None) -> int:
        """Check the bytes ``handle`` was meant to write (the sender's pattern at the planned
        source offsets) and, in the slots it wrote, every byte no transfer has targeted (still
        this rank's pattern). :meth:`verify_untouched` sweeps the rest of the pools.

        Per pool pair (:meth:`_check_pair`), long fragments of one length by crc32: the bytes
        summed where they lie against the sender's pattern summed at their sources (per-fragment
        sums of :func:`~workers.pools.pattern_image`, kept and combined), so the check reads the
        request's bytes once; other fragments, and any difference, byte by byte against the
        pattern gathered alike (or :func:`~workers.pools.pattern_spans` past the images'
        budget), which says where. Given the receive's ``routes``, a fragments-mode route
        without a checksum gets the crc32 of its bytes (the sender's order:
        :func:`~workers.executors.fragments_crc32`). Other receives' bytes are marked only
        where a slot this one wrote still holds bytes it did not target."""
        planned: list[tuple[RouteState | None, list[_Writes]]]
        if routes is None:
            planned = [(None, self._planned_writes(handle))]
        else:
            planned = [
                (state, self._route_writes(handle, state.route, state.src, state.dst))
                for state in routes
            ]
        with self._marks_lock:
            self._unmarked.pop(handle, None)
            for _, writes in planned:
                self._mark_targeted(handle, writes)
        checked = 0
        images: dict[int, tuple[np.ndarray, bool]] = {}
        slots: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
        for state, writes in planned:
            summed = state is not None and state.mode == "fragments" and state.checksum is None
            crc: int | None = 0 if summed else None
            for source, dst_pool, src, dst, lengths, length in writes:
                if not dst.size:
                    continue
                sender, src_pool = divmod(source, 1_000_000)
                if dst_pool not in images:
                    images[dst_pool] = self._pool_image(dst_pool)
                pool_image, lasting = images[dst_pool]
                crc = self._check_pair(
                    sender, src_pool, dst_pool, src, dst, lengths, length, pool_image, lasting, crc
                )
                checked += int(lengths.sum())
                stride = self.pools[dst_pool].spec.slot_stride_bytes
                first_slot, last_slot = dst // stride, (dst + lengths - 1) // stride
                within = slots.setdefault(dst_pool, [])
                crossing = first_slot != last_slot  # never a plan's fragment: no slot count
                within.append((first_slot, np.where(crossing, 0, lengths)))
                for lo, hi in zip(
                    first_slot[crossing].tolist(), last_slot[crossing].tolist(), strict=True
                ):
                    within.append((np.arange(lo + 1, hi + 1), np.zeros(hi - lo, np.int64)))
            if state is not None and crc is not None:
                state.checksum = crc & 0xFFFFFFFF
        # A slot this receive filled whole has nothing of its own left to compare. Elsewhere,
        # bytes that other receives target are marked first (they may write there too).
        # A slot is whole when this receive's fragments (which never overlap) sum to its bytes,
        # else when the marks of every receive so far cover it.
        partial = []
        for pid, written in slots.items():
            spec = self.pools[pid].spec
            touched = self._touched[pid]
            ids, where = np.unique(np.concatenate([w[0] for w in written]), return_inverse=True)
            filled = np.bincount(where, weights=np.concatenate([w[1] for w in written]))
            for slot in ids[filled != spec.slot_bytes].tolist():
                lo = slot * spec.slot_stride_bytes
                if not touched[lo : lo + spec.slot_bytes].all():
                    partial.append((pid, lo, lo + spec.slot_bytes))
        if partial:
            self._mark_noted()
        for pid, lo, hi in partial:
            checked += self._check_untouched(pid, lo, hi)
        self.stats.verified_bytes += checked
        return checked

    def _check_pair(
        self,
        sender: int,
        src_pool: int,
        dst_pool: int,
        src: np.ndarray,
        dst: np.ndarray,
        lengths: np.ndarray,
        length: int,
        pool_image: np.ndarray,
        lasting: bool,
        crc: int | None,
    ) -> int | None:
        """One pool pair of :meth:`verify_transfer`: the bytes at ``dst`` in this rank's pool
        against ``sender``'s pattern at ``src`` in its pool ``src_pool``; raises
        :class:`VerificationError`. Returns ``crc`` (None: not summed) chained over the bytes.

        Fragments of one length of at least ``GATHER_MAX`` bytes are compared by their crc32:
        the bytes summed where they lie, fragment by fragment, against the pattern's sum at the
        sources, combined from sums kept per fragment (the pattern never changes), so a
        request's check reads its bytes once. A difference, and every other shape of fragments,
        compares byte by byte (gathered side by side as 8-byte words), which says where.
        """
        image = pattern_image(sender, src_pool, int((src + lengths).max()))
        start = crc or 0
        if image is not None and crc32_combine is not None and length >= GATHER_MAX:
            view, pattern = pool_image.data, image.data
            got = start
            for offset in dst.tolist():
                got = crc32(view[offset : offset + length], got)
            want = start
            sums = self._pattern_sums
            if len(sums) > PATTERN_SUMS_MAX:
                sums.clear()
            for offset in src.tolist():
                key = (sender, src_pool, offset, length)
                one = sums.get(key)
                if one is None:
                    one = sums[key] = crc32(pattern[offset : offset + length])
                want = crc32_combine(want, one, length)
            if got == want:
                return got if crc is not None else None
        received = gather_bytes(
            pool_image,
            dst,
            lengths,
            length=length,
            windows=(self._windows, ("pool", dst_pool)) if lasting else None,
        )
        if image is None:  # past the images' budget
            expected = pattern_spans(sender, src_pool, src, lengths)
        else:
            expected = gather_bytes(
                image,
                src,
                lengths,
                length=length,
                windows=(self._windows, ("pattern", sender, src_pool)),
            )
        words = np.uint64 if received.size % 8 == 0 else np.uint8
        if not np.array_equal(received.view(words), expected.view(words)):
            wrong = np.flatnonzero(received != expected)
            ends = np.cumsum(lengths)
            fragment = int(np.searchsorted(ends, wrong[0], side="right"))
            first = int(dst[fragment] + wrong[0] - (ends[fragment] - lengths[fragment]))
            raise VerificationError(
                f"verification failed: pool {dst_pool} has {wrong.size} wrong bytes "
                f"among those written from rank {sender} (first at offset {first})"
            )
        if image is not None and crc32_combine is not None and length >= GATHER_MAX:
            raise VerificationError(  # the sums differed, the bytes not: they changed meanwhile
                f"verification failed: pool {dst_pool}: the bytes written from rank {sender} "
                "changed while they were checked"
            )
        return crc32(received.data, crc) if crc is not None else None

    def verify_untouched(self) -> int:
        """Fill mode: every byte of every pool that no transfer targeted still holds this
        rank's pattern (a stray write anywhere shows up). Returns the bytes checked."""
        self._mark_noted()
        checked = sum(
            self._check_untouched(pid, 0, pool.tensor.numel()) for pid, pool in self.pools.items()
        )
        self.stats.verified_bytes += checked
        return checked

    def _check_untouched(self, pid: int, lo: int, hi: int) -> int:
        touched = self._touched[pid][lo:hi]
        if touched.all():  # a slot the transfers filled whole: nothing of its own left
            return 0
        untouched = ~touched
        image = self.pools[pid].tensor[lo:hi].detach().cpu().numpy().view(np.uint8)
        wrong = np.flatnonzero((image != pattern_span(self.rank, pid, lo, hi - lo)) & untouched)
        if wrong.size:
            raise VerificationError(
                f"verification failed: pool {pid} has {wrong.size} bytes that no transfer "
                f"targeted but that changed (first at offset {lo + int(wrong[0])})"
            )
        return int(untouched.sum())
