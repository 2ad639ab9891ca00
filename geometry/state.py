"""Per-request recurrent state (Mamba/SSM conv and SSM state, linear attention): geometry.

A layer group with ``tokens_per_slot: null`` holds **one slot per request** (no token axis, no
suffix alignment): a transfer names one state slot per side. Its views shard over the **state
axis** of a rank, not over the attention TP group:

- ``G_s = 1`` under attention-DP (each DP rank holds whole state), else ``G_s = tp × cp``
  (helix: the CP ranks of a TP rank split the state further; ``cp = 1`` gives ``tp``);
- ``g_s = tp_rank × cp + cp_rank`` (0 under attention-DP): the rank's index on that axis.

**HND over SSM heads** (roles e.g. ``["ssm_state"]``): a buffer is ``[heads][head_dim][d_state]``;
one head is the unit, ``unit = head_dim × d_state × itemsize`` bytes (taken from the registered
bytes: ``unit = size / h``; when ``head_dim``, ``d_state`` and a known ``dtype`` are all given,
they must agree). Heads shard like KV heads (:mod:`geometry.heads`) with ``G_s`` for ``G``:
``H`` = the view's ``total_kv_heads``, else ``num_kv_heads × G_s`` (never the instance's KV
totals, which describe attention); ``shards = min(G_s, H)``, ``replicas = G_s / shards``,
``shard = g_s // replicas``, ``h = H / shards``, heads ``[shard × h, (shard + 1) × h)``.

**SECTIONED** (roles e.g. ``["conv_state"]``): a buffer is the channel-major conv state
``[conv_dim][d_conv − 1]`` whose channels are sections ``x, B, C`` (Mamba2; ``q, k, v`` for
gated delta nets). ``section_bytes[i] = S_i`` is the **TP-aggregated** size of section ``i`` of
one buffer; each section is split contiguously over the state axis (``shards = G_s``, no
replicas), and a rank's buffer is its share of every section, in section order:

- rank ``g_s`` holds bytes ``[g_s × S_i / G_s, (g_s + 1) × S_i / G_s)`` of section ``i``, at
  buffer offset ``P_i = Σ_{j<i} S_j / G_s``; so ``size = Σ S_i / G_s``, ``G_s | S_i``.
- Two sides pair by range intersection, as heads do: positions are counted in bytes of section 0
  (``total = S_0``, ``held = [g_s × S_0 / G_s, (g_s + 1) × S_0 / G_s)``); a common range
  ``[lo, hi)`` is, in section ``i``, the bytes ``[lo × S_i / S_0, hi × S_i / S_0)`` (whole
  bytes: ``lo`` is a multiple of ``S_0 / G`` for one side's ``G``, and ``G | S_i``), one run
  per (layer, buffer, section) at ``P_i + lo × S_i / S_0 − g_s × S_i / G_s`` on each side.
- Example: ``S = (96, 48, 48)``, context TP 4 → generation TP 2. Context rank 1 holds
  ``x[24, 48)``, ``B[12, 24)``, ``C[12, 24)`` (a 48-byte buffer); generation rank 0 holds
  ``x[0, 48)`` at 0, ``B[0, 24)`` at 48, ``C[0, 24)`` at 72. Common range ``[24, 48)`` of
  section 0: runs ``src 0 → dst 24`` (24 bytes), ``24 → 60`` (12), ``36 → 84`` (12).

**Slots.** A transfer names the request's state slot per side: ``[slot]`` (the same slot on every
CP rank of that side) or, under CP, one ``[slot]`` per CP rank; ``[]`` on either side moves no
state; more ids are ``invalid_blocks`` (:func:`state_slots`). A route's state segment applies once,
to the slots of its two ranks' CP ranks.

**REPLICATED** state (side state every rank holds whole): ``shards = 1``, ``replicas = G_s``.
NHD has no meaning without a token axis and is refused in a state group, as is SECTIONED outside
one.

Validation (:mod:`geometry.state_checks`) compares the **TP-aggregated** bytes of one buffer:
``H × unit`` (HND), ``Σ S_i`` and every ``S_i`` (SECTIONED), the region (REPLICATED).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from geometry.builders import ELEMENT_BYTES
from geometry.errors import GeometryError, Problem
from geometry.heads import ViewGeometry
from geometry.heads import view_geometry as head_view_geometry
from geometry.model import Instance, RankTable, View

STATE_LAYOUTS = ("HND", "SECTIONED", "REPLICATED")


@dataclass(frozen=True, slots=True)
class StateGeometry(ViewGeometry):
    """Geometry of a per-request state view; ``sections`` are the TP-aggregated ``S_i``.

    HND: ``heads``/``unit_bytes`` are SSM heads and bytes per head. SECTIONED: positions are
    bytes of section 0 (``total_heads = S_0``, ``heads = S_0 / G_s``), ``unit_bytes`` = the
    rank's buffer bytes.
    """

    sections: tuple[int, ...] = ()

    @property
    def aggregated_bytes(self) -> int:
        """Bytes of one buffer over the whole state axis (replicas counted once)."""
        if self.layout == "SECTIONED":
            return sum(self.sections)
        if self.layout == "REPLICATED":
            return self.unit_bytes
        return self.total_heads * self.unit_bytes

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "state_axis": self.group_size,
            "state_index": self.group_index,
            "shards": self.shards,
            "replicas": self.replicas,
            "shard": self.shard,
            "replica": self.replica,
            "aggregated_bytes": self.aggregated_bytes,
        }
        if self.layout == "HND":
            out.update(
                heads_per_rank=self.heads,
                total_heads=self.total_heads,
                head_range=list(self.head_range),
                bytes_per_head=self.unit_bytes,
            )
        elif self.layout == "SECTIONED":
            out["section_bytes"] = list(self.sections)
        return out


def state_axis(instance: Instance, rank: int) -> tuple[int, int]:
    """``(G_s, g_s)``: the state shard axis and the rank's index on it."""
    if instance.attention_dp:
        return 1, 0
    _pp_rank, tp_rank, cp_rank = instance.coords(rank)
    return instance.tp * instance.cp, tp_rank * instance.cp + cp_rank


def is_state_view(instance: Instance, table: RankTable, view: View) -> bool:
    """Whether ``view`` lives in a per-request state group of ``instance``."""
    return instance.is_state_group(table.pools[view.pool].layer_group)


def view_geometry(instance: Instance, table: RankTable, view: View) -> ViewGeometry:
    """Any view's geometry: state views here, paged (KV) views in :mod:`geometry.heads`."""
    if is_state_view(instance, table, view):
        return state_geometry(instance, table, view)
    if view.layout == "SECTIONED":
        group = table.pools[view.pool].layer_group
        raise GeometryError(
            Problem(
                ("layout",),
                f"layout SECTIONED needs a per-request state group, but layer group {group} is "
                "paged: list it in the instance's layer_groups with tokens_per_slot null",
                "state_geometry_invalid",
            )
        )
    return head_view_geometry(instance, table, view)


def _invalid(loc: tuple[str | int, ...], message: str, code: str) -> GeometryError:
    return GeometryError(Problem(loc, message, code))


def state_geometry(instance: Instance, table: RankTable, view: View) -> StateGeometry:
    """Compute (and check) a state view's geometry on ``table``'s rank."""
    axis, index = state_axis(instance, table.rank)
    size = view.buffer_bytes
    if view.layout not in STATE_LAYOUTS:
        raise _invalid(
            ("layout",),
            f"layout {view.layout} has no meaning in a per-request state group (no token axis):"
            f" use {', '.join(STATE_LAYOUTS)}",
            "state_geometry_invalid",
        )
    if view.layout == "REPLICATED":
        return StateGeometry("REPLICATED", axis, index, 1, 1, axis, 0, index, 1, size, 0, ())
    if view.layout == "SECTIONED":
        assert view.section_bytes is not None  # the parser requires it
        sections = view.section_bytes
        odd = [i for i, s in enumerate(sections) if s % axis]
        if odd:
            raise _invalid(
                ("section_bytes", odd[0]),
                f"section {odd[0]} of {sections[odd[0]]} bytes does not split over a state axis "
                f"of {axis} ranks (tp × cp, or 1 under attention-DP)",
                "state_geometry_invalid",
            )
        if sum(sections) != size * axis:
            raise _invalid(
                ("buffers", 0, "size"),
                f"SECTIONED buffer of {size} bytes, but sections {list(sections)} "
                f"(TP-aggregated, {sum(sections)} bytes) over {axis} ranks give "
                f"{sum(sections) // axis} per rank",
                "state_geometry_invalid",
            )
        per_rank = sections[0] // axis
        return StateGeometry(
            "SECTIONED", axis, index, sections[0], axis, 1, index, 0, per_rank, size, 0, sections
        )
    declared = view.num_kv_heads
    total = view.total_kv_heads
    if total is None:
        if declared is None:
            raise _invalid(
                ("num_kv_heads",),
                "an HND state view needs its own head count (SSM heads): give num_kv_heads or "
                "total_kv_heads on the view (the instance's KV-head counts describe attention)",
                "head_count_missing",
            )
        total = declared * axis
    shards = min(axis, total)
    if axis % shards or total % shards:
        raise _invalid(
            ("total_kv_heads",),
            f"{total} SSM heads cannot be split over a state axis of {axis} ranks "
            "(need axis % min(axis, heads) == 0 and heads % min(axis, heads) == 0)",
            "head_geometry_invalid",
        )
    replicas = axis // shards
    heads = total // shards
    if declared is not None and declared != heads:
        raise _invalid(
            ("num_kv_heads",),
            f"declares {declared} SSM heads per rank but {total} total heads over a state axis "
            f"of {axis} ranks give {heads} per rank",
            "head_count_mismatch",
        )
    if size % heads:
        raise _invalid(
            ("buffers", 0, "size"),
            f"HND state buffer of {size} bytes does not divide into {heads} heads",
            "head_geometry_invalid",
        )
    unit = size // heads
    element = ELEMENT_BYTES.get(view.dtype)
    if view.head_dim and view.d_state and element is not None:
        expected = view.head_dim * view.d_state * element
        if expected != unit:
            raise _invalid(
                ("buffers", 0, "size"),
                f"{unit} bytes per SSM head, but head_dim {view.head_dim} × d_state "
                f"{view.d_state} × {element} bytes ({view.dtype}) = {expected}",
                "head_geometry_invalid",
            )
    shard, replica = divmod(index, replicas)
    return StateGeometry(
        "HND", axis, index, total, shards, replicas, shard, replica, heads, unit, 0, ()
    )


# --------------------------------------------------------------------------------------------
# templates


def sectioned_runs(
    src: np.ndarray, dst: np.ndarray, lo: int, hi: int, peer: StateGeometry, local: StateGeometry
) -> np.ndarray:
    """Runs for the common range ``[lo, hi)`` (bytes of section 0) of SECTIONED buffers.

    ``src``/``dst``: buffer offsets (one per layer and buffer, same order). One run per
    (buffer, section), buffer-major: ``[src, dst, len, 1, 0, 0]``.
    """
    sections = local.sections
    first = sections[0]
    rows = []
    prefix_src = prefix_dst = 0
    for size in sections:
        start, stop = Fraction(lo * size, first), Fraction(hi * size, first)
        assert start.denominator == stop.denominator == 1, "section cut is not byte-aligned"
        held_src = peer.shard * size // peer.shards
        held_dst = local.shard * size // local.shards
        rows.append(
            (
                prefix_src + int(start) - held_src,
                prefix_dst + int(start) - held_dst,
                int(stop - start),
            )
        )
        prefix_src += size // peer.shards
        prefix_dst += size // local.shards
    table = np.asarray(rows, dtype=np.int64)  # [sections, 3]
    runs = np.zeros((src.size, len(sections), 6), dtype=np.int64)
    runs[:, :, 0] = src[:, None] + table[None, :, 0]
    runs[:, :, 1] = dst[:, None] + table[None, :, 1]
    runs[:, :, 2] = table[None, :, 2]
    runs[:, :, 3] = 1
    return runs.reshape(-1, 6)


def slice_bytes(local: StateGeometry, lo: int, hi: int, buffers: int) -> int:
    """Bytes of one layer of the common range ``[lo, hi)`` (the election's unit)."""
    if local.layout == "REPLICATED":
        return buffers * local.unit_bytes
    if local.layout == "SECTIONED":
        return buffers * sum((hi - lo) * size // local.sections[0] for size in local.sections)
    return buffers * (hi - lo) * local.unit_bytes


# --------------------------------------------------------------------------------------------
# request slots


def state_slots(raw: Any, loc: tuple[str | int, ...], cp: int) -> list[np.ndarray]:
    """One side's state slot per CP rank (``[]`` each when the side names none).

    ``[]`` → nothing to move; ``[slot]`` → the same slot on every CP rank of the side;
    ``[[slot of cp rank 0], …]`` (CP > 1) → one slot per CP rank. A state group takes exactly one
    slot per rank: more is refused (``invalid_blocks``).
    """
    nested = bool(len(raw)) and all(isinstance(item, (list, tuple)) for item in raw)
    if not nested:
        ids = list(raw)
        if len(ids) > 1:
            raise GeometryError(
                Problem(
                    loc,
                    f"{len(ids)} slot ids for a per-request state group (tokens_per_slot null): "
                    "give exactly one, the request's state slot ([slot]), or [] to move nothing",
                    "invalid_blocks",
                )
            )
        return [_slot_array(ids, loc)] * cp
    if cp < 2 or len(raw) != cp:
        raise GeometryError(
            Problem(
                loc,
                f"{len(raw)} slot lists for {cp} CP rank(s): a per-request state group takes "
                "[slot], or one [slot] per CP rank in cp_rank order when CP > 1",
                "invalid_blocks",
            )
        )
    counts = {len(item) for item in raw}
    if not counts <= {1} and counts != {0}:
        raise GeometryError(
            Problem(
                loc,
                "a per-request state group takes exactly one slot id per CP rank ([[s0], [s1], "
                f"…]) or none at all; got lists of {sorted(len(item) for item in raw)} ids",
                "invalid_blocks",
            )
        )
    return [_slot_array(list(item), (*loc, c)) for c, item in enumerate(raw)]


def _slot_array(ids: list[Any], loc: tuple[str | int, ...]) -> np.ndarray:
    array = np.asarray(ids, dtype=np.int64).reshape(-1)
    if array.size and int(array.min()) < 0:
        raise GeometryError(Problem(loc, "slot ids must be ≥ 0", "invalid_blocks"))
    return array


def pair_slots(
    context_slots: list[np.ndarray],
    generation_slots: list[np.ndarray],
    context_cp: int,
    generation_cp: int,
) -> tuple[np.ndarray, np.ndarray]:
    """``(context slot, generation slot)`` of one route, each an array of 0 or 1 ids.

    ``context_cp``/``generation_cp`` are the route's CP ranks on each side; nothing moves when
    either side names no slot.
    """
    src, dst = context_slots[context_cp], generation_slots[generation_cp]
    if not src.size or not dst.size:
        empty = np.empty(0, dtype=np.int64)
        return empty, empty
    return src, dst


def route_cp_ranks(cp_modulus: int, cp_remainder: int, cp_side: str | None) -> tuple[int, int]:
    """``(sender cp_rank, receiver cp_rank)`` of a route (0 on the side without CP)."""
    if cp_modulus < 2 or cp_side is None:
        return 0, 0
    return (cp_remainder, 0) if cp_side == "context" else (0, cp_remainder)
