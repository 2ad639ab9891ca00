"""Registered page tables as frozen data: instances, rank tables, pools, views and buffers.

An *instance* has ``tp × pp × cp`` ranks; rank ``r`` decomposes CP-minor as
``r = pp_rank × (tp × cp) + tp_rank × cp + cp_rank``. Each rank reports its *pools*
(``num_slots`` slots of ``slot_bytes``, ``slot_stride_bytes`` apart) and the *views* inside them.
A view is one class of buffers (owner, roles, layout, head geometry) with rows
``{layer, offset, size}``: byte ranges inside one slot.

Data only: :mod:`geometry.parse` checks a registration body and builds these; the head
geometry (:mod:`geometry.heads`, :mod:`geometry.state`) reads them. This module imports
neither, so the geometry is built in one direction.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np

from geometry.errors import GeometryError


@dataclass(frozen=True, slots=True)
class Buffer:
    """One byte range of a slot: ``size`` bytes at ``offset``, holding (part of) ``layer``."""

    layer: int
    offset: int
    size: int


@dataclass(frozen=True, slots=True)
class Pool:
    """One registered memory region of a rank."""

    id: int
    layer_group: int
    slot_bytes: int
    slot_stride_bytes: int
    num_slots: int
    base_address: int = 0


@dataclass(frozen=True)
class View:
    """One class of buffers inside one pool, with its own head geometry.

    ``buffers_by_layer[layer]`` keeps registration order (K before V for a K/V view).
    """

    index: int
    pool: int
    owner: str
    roles: frozenset[str]
    layout: str
    num_kv_heads: int | None
    total_kv_heads: int | None
    head_dim: int | None
    dtype: str
    buffers: tuple[Buffer, ...]
    buffers_by_layer: Mapping[int, tuple[Buffer, ...]] = field(repr=False, compare=False)
    # SECTIONED (per-request state): TP-aggregated bytes of each section of one buffer
    section_bytes: tuple[int, ...] | None = None
    d_state: int | None = None  # SSM state size (compared across sides when both give it)

    @cached_property
    def layers(self) -> tuple[int, ...]:
        return tuple(self.buffers_by_layer)

    @cached_property
    def offset_table(self) -> np.ndarray:
        """Buffer offsets as int64 ``[layers, buffers_per_layer]`` (rows in ``layers`` order)."""
        return np.array(
            [[b.offset for b in self.buffers_by_layer[layer]] for layer in self.layers],
            dtype=np.int64,
        )

    @property
    def buffers_per_layer(self) -> int:
        return len(next(iter(self.buffers_by_layer.values())))

    @property
    def buffer_bytes(self) -> int:
        return self.buffers[0].size

    @cached_property
    def roles_key(self) -> tuple[str, ...]:
        return tuple(sorted(self.roles))

    def label(self) -> str:
        """Short human name: ``target[key,value]@pool0``."""
        return f"{self.owner}[{','.join(self.roles_key)}]@pool{self.pool}"


@dataclass(frozen=True)
class RankTable:
    """One rank's page table."""

    rank: int
    pools: Mapping[int, Pool]
    views: tuple[View, ...]
    kv_heads_per_rank: int | None = None
    agent_metadata: str | None = None


@dataclass(frozen=True)
class Instance:
    """One model replica and the page tables its ranks reported so far."""

    name: str
    role: str
    tp: int
    pp: int
    cp: int
    attention_dp: bool
    tokens_per_block: int
    model: str | None = None
    kv_heads_per_rank: int | None = None
    total_kv_heads: int | None = None
    ranks: tuple[RankTable | None, ...] = ()
    state_groups: frozenset[int] = frozenset()  # layer groups with ``tokens_per_slot: null``

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp

    @property
    def is_complete(self) -> bool:
        return all(table is not None for table in self.ranks)

    @property
    def missing_ranks(self) -> tuple[int, ...]:
        return tuple(rank for rank, table in enumerate(self.ranks) if table is None)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(pp_rank, tp_rank, cp_rank)`` of a flat rank (CP-minor order)."""
        pp_rank, rest = divmod(rank, self.tp * self.cp)
        tp_rank, cp_rank = divmod(rest, self.cp)
        return pp_rank, tp_rank, cp_rank

    def flat_rank(self, pp_rank: int, tp_rank: int, cp_rank: int) -> int:
        return pp_rank * (self.tp * self.cp) + tp_rank * self.cp + cp_rank

    @property
    def group_size(self) -> int:
        """``G``: attention TP group size (1 under attention-DP, where KV is not TP-sharded)."""
        return 1 if self.attention_dp else self.tp

    def group_index(self, rank: int) -> int:
        """``g``: the rank's index inside its attention TP group."""
        return 0 if self.attention_dp else self.coords(rank)[1]

    def is_state_group(self, layer_group: int) -> bool:
        """Whether ``layer_group`` holds per-request state (one slot per request, no tokens)."""
        return layer_group in self.state_groups

    def table(self, rank: int) -> RankTable:
        table = self.ranks[rank]
        if table is None:
            raise GeometryError.single(
                ("ranks", rank), "rank has not reported", "instance_not_ready"
            )
        return table

    def with_rank(self, table: RankTable) -> Instance:
        """A copy with ``table`` stored at its rank (replacing an earlier report)."""
        ranks = list(self.ranks)
        ranks[table.rank] = table
        return replace(self, ranks=tuple(ranks))
