"""Per-view KV-head geometry of one rank.

Notation (per view, per rank):

- ``G`` — attention TP group size (``tp``, or 1 under attention-DP); ``g`` — the rank's index in it.
- ``H`` — the view's total KV heads: the view's ``total_kv_heads``; else, for a **target** view,
  the instance's; else ``h_declared × G`` ("no duplication"). A **draft** view never takes the
  instance's total: it describes the target model.
- ``shards = min(G, H)`` with ``G % shards == 0`` and ``H % shards == 0``;
  ``replicas = G / shards`` (ranks holding identical heads: duplication when ``G > H``);
  ``shard = g // replicas``, ``replica = g % replicas``, heads held ``h = H / shards``,
  global head range ``[shard × h, (shard + 1) × h)``.
- Pairing-level duplication (:func:`geometry.validate.derive_duplication`): where a side's
  ``H`` is only the "no duplication" assumption ``h × G``, the pair's smaller head count is taken
  instead when it explains the side's per-rank count (``h = H / min(G, H)``), as TensorRT-LLM
  derives its duplicate-head factor ``max(1, h_self·G_self // (h_peer·G_peer))``.
- The declared per-rank count (the view's ``num_kv_heads``; for a legacy view that gives no head
  field at all, the rank's, else the instance's ``kv_heads_per_rank``) must equal ``h``. A view
  that gives ``total_kv_heads`` is never checked against a rank-wide count: a view never borrows
  another view's count.

Byte geometry comes from the *registered* bytes, never from dtype arithmetic, so sub-byte
element types (FP4: half a byte per element) stay exact:

- HND (``[heads][tokens][head_dim]`` per buffer): ``bytes_per_head = size / h``;
- NHD (``[tokens][heads][head_dim]``): ``token_bytes = size / tokens_per_block``,
  ``head_token_bytes = token_bytes / h``;
- REPLICATED: the whole buffer, no head math (``shards = 1``, every rank a replica).
"""

from __future__ import annotations

from dataclasses import dataclass

from geometry.errors import GeometryError, Problem
from geometry.model import Instance, RankTable, View


@dataclass(frozen=True, slots=True)
class ViewGeometry:
    """Head and byte geometry of one view on one rank."""

    layout: str
    group_size: int  # G
    group_index: int  # g
    total_heads: int  # H (1 for REPLICATED)
    shards: int
    replicas: int
    shard: int
    replica: int
    heads: int  # h, heads this rank holds
    unit_bytes: int  # HND: bytes per head; NHD: bytes per (token, head); REPLICATED: buffer bytes
    token_bytes: int  # NHD: bytes per token row; else 0

    @property
    def head_range(self) -> tuple[int, int]:
        return self.shard * self.heads, (self.shard + 1) * self.heads

    def to_dict(self) -> dict[str, object]:
        start, stop = self.head_range
        return {
            "heads_per_rank": self.heads,
            "total_heads": self.total_heads,
            "shards": self.shards,
            "replicas": self.replicas,
            "shard": self.shard,
            "replica": self.replica,
            "head_range": [start, stop],
            "bytes_per_head" if self.layout == "HND" else "unit_bytes": self.unit_bytes,
        }


def declared_heads(instance: Instance, table: RankTable, view: View) -> tuple[int | None, str]:
    """The per-rank head count a view declares, and which field it came from (legacy fallback)."""
    if view.num_kv_heads is not None:
        return view.num_kv_heads, "num_kv_heads"
    if view.total_kv_heads is not None:
        # The view states its own geometry; rank-wide counts describe other (target) layers.
        return None, "total_kv_heads"
    if table.kv_heads_per_rank is not None:
        return table.kv_heads_per_rank, "kv_heads_per_rank (rank)"
    return instance.kv_heads_per_rank, "kv_heads_per_rank (instance)"


def view_geometry(instance: Instance, table: RankTable, view: View) -> ViewGeometry:
    """Compute (and check) a view's geometry on ``table``'s rank; raises with both numbers."""
    group_size = instance.group_size
    group_index = instance.group_index(table.rank)
    if view.layout == "REPLICATED":
        return ViewGeometry(
            "REPLICATED",
            group_size,
            group_index,
            1,
            1,
            group_size,
            0,
            group_index,
            1,
            view.buffer_bytes,
            0,
        )
    declared, source = declared_heads(instance, table, view)
    total = view.total_kv_heads
    if total is None and view.owner == "target":
        total = instance.total_kv_heads
    if total is None:
        if declared is None:
            raise GeometryError(
                Problem(
                    ("num_kv_heads",),
                    "no head count: give num_kv_heads or total_kv_heads on the view, or "
                    "kv_heads_per_rank / total_kv_heads on the instance",
                    "head_count_missing",
                )
            )
        total = declared * group_size
    shards = min(group_size, total)
    if group_size % shards or total % shards:
        raise GeometryError(
            Problem(
                ("total_kv_heads",),
                f"{total} KV heads cannot be split over an attention TP group of {group_size} "
                f"(need tp % min(tp, heads) == 0 and heads % min(tp, heads) == 0)",
                "head_geometry_invalid",
            )
        )
    replicas = group_size // shards
    heads = total // shards
    if declared is not None and declared != heads:
        field = "num_kv_heads" if source == "num_kv_heads" else "kv_heads_per_rank"
        raise GeometryError(
            Problem(
                (field,),
                f"declares {declared} KV heads per rank ({source}) but {total} total heads over "
                f"an attention TP group of {group_size} give {heads} per rank",
                "head_count_mismatch",
            )
        )
    size = view.buffer_bytes
    token_bytes = 0
    if view.layout == "HND":
        if size % heads:
            raise GeometryError(
                Problem(
                    ("buffers", 0, "size"),
                    f"HND buffer of {size} bytes does not divide into {heads} heads",
                    "head_geometry_invalid",
                )
            )
        unit = size // heads
    else:
        tokens = instance.tokens_per_block
        if size % tokens or (size // tokens) % heads:
            raise GeometryError(
                Problem(
                    ("buffers", 0, "size"),
                    f"NHD buffer of {size} bytes does not divide into {tokens} tokens × "
                    f"{heads} heads",
                    "head_geometry_invalid",
                )
            )
        token_bytes = size // tokens
        unit = token_bytes // heads
    shard, replica = divmod(group_index, replicas)
    return ViewGeometry(
        view.layout,
        group_size,
        group_index,
        total,
        shards,
        replicas,
        shard,
        replica,
        heads,
        unit,
        token_bytes,
    )


def assumed_total(instance: Instance, table: RankTable, view: View) -> int | None:
    """``h_declared × G`` when a paged view's total ``H`` is not given anywhere (a draft view
    without ``total_kv_heads``, a target view without it and without an instance total):
    the "no duplication" assumption. None when ``H`` is given or the view has no head math."""
    if view.layout == "REPLICATED" or view.total_kv_heads is not None:
        return None
    if view.owner == "target" and instance.total_kv_heads is not None:
        return None
    declared, _ = declared_heads(instance, table, view)
    return None if declared is None else declared * instance.group_size


def derived_total(instance: Instance, declared: int, total: int) -> bool:
    """Whether ``total`` heads over the instance's attention TP group give ``declared`` per
    rank (the geometry rules of the module), i.e. a duplication the view's counts allow."""
    group = instance.group_size
    shards = min(group, total)
    return group % shards == 0 and total % shards == 0 and total // shards == declared
