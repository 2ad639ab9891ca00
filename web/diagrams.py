"""Geometry of the two pairing pictures, computed here and drawn as inline SVG by the templates.

- **Rank map**: sender rank (rows) × receiver rank (columns); one cell per route of the plan
  that carries bytes, labelled with its bytes per block; the hover title lists the route's
  slices (views, layers and head ranges).
- **Head slices**: for one receiver rank, one bar per (receiver view, layer range) spanning the
  view's model-wide heads ``[0, H)``; the receiver's own range is outlined and every slice of
  the plan fills ``[lo, hi)`` in its sender rank's colour. A view no route fills is drawn empty
  and labelled "not transferred". With different ``tokens_per_block`` (ratio ``r``) a strip above
  the bars draws one large block as the ``r`` small blocks it pairs with, and every row says that
  each head moves as ``r`` runs per large block, one per small block.

Pure: plan dictionaries (``Plan.to_dict()``) and planning-core instances in, plain data out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from geometry import GeometryError, Instance, view_geometry
from web.format import human_bytes, ranges

PALETTE_SIZE = 8
CELL_W = 84
CELL_H = 30
MAP_LEFT = 96
MAP_TOP = 56
BAR_W = 560
BAR_H = 22
ROW_H = 56
BAR_LEFT = 260


def layer_text(layers: Sequence[int]) -> str:
    """``[0, 1, 2, 3]`` → ``layers 0–3 (4)``; ``[4]`` → ``layer 4``."""
    if len(layers) == 1:
        return f"layer {layers[0]}"
    return f"layers {ranges(layers)} ({len(layers)})"


def slice_text(item: Mapping[str, Any]) -> str:
    """One slice as a line of text: view, layers and heads."""
    layers = layer_text(item["layers"])
    layout = item["layout"]
    sender_layout = item.get("sender_layout", layout)
    if sender_layout != layout:
        layout = f"{sender_layout}→{layout} (converted head by head)"
    view = f"{item['owner']}[{','.join(item['roles'])}] {layout}"
    heads = item.get("global_heads")
    if heads is None:
        what = "whole region"
    else:
        what = (
            f"heads [{heads[0]}, {heads[1]}) "
            f"(sender local [{item['sender_local_heads'][0]}, {item['sender_local_heads'][1]}) "
            f"→ receiver local [{item['receiver_local_heads'][0]}, "
            f"{item['receiver_local_heads'][1]}))"
        )
    return f"{view}, {layers}: {what}, {human_bytes(item['bytes_per_block'])}/block"


@dataclass
class Cell:
    sender: int
    receiver: int
    bytes_per_block: int
    x: int
    y: int
    label: str
    title: str
    colour: int


@dataclass
class Axis:
    rank: int
    position: int
    active: bool


@dataclass
class RankMap:
    senders: list[Axis]
    receivers: list[Axis]
    cells: list[Cell]
    width: int
    height: int
    cell_w: int = CELL_W
    cell_h: int = CELL_H
    left: int = MAP_LEFT
    top: int = MAP_TOP


def rank_map(
    plan: Mapping[str, Any],
    *,
    context_world: int,
    generation_world: int,
    active_senders: Sequence[int],
    active_receivers: Sequence[int],
) -> RankMap:
    """The rank-map matrix of a plan: every rank on both axes, cells for routes with bytes."""
    senders = [
        Axis(rank, MAP_TOP + rank * CELL_H, rank in active_senders) for rank in range(context_world)
    ]
    receivers = [
        Axis(rank, MAP_LEFT + rank * CELL_W, rank in active_receivers)
        for rank in range(generation_world)
    ]
    cells = []
    for route in plan["routes"]:
        size = int(route["bytes_per_block"])
        if size <= 0:
            continue
        sender, receiver = int(route["sender_rank"]), int(route["receiver_rank"])
        lines = [f"sender rank {sender} → receiver rank {receiver}: {size} bytes per block"]
        if int(route.get("cp_modulus", 1)) > 1:
            lines.append(f"blocks j with j % {route['cp_modulus']} == {route['cp_remainder']} only")
        lines.extend(slice_text(item) for item in route.get("slices", ()))
        cells.append(
            Cell(
                sender,
                receiver,
                size,
                MAP_LEFT + receiver * CELL_W,
                MAP_TOP + sender * CELL_H,
                human_bytes(size),
                "\n".join(lines),
                sender % PALETTE_SIZE,
            )
        )
    return RankMap(
        senders,
        receivers,
        cells,
        MAP_LEFT + generation_world * CELL_W + 8,
        MAP_TOP + context_world * CELL_H + 8,
    )


@dataclass
class Bar:
    sender: int
    x: int
    width: int
    label: str
    title: str
    colour: int


@dataclass
class SliceRow:
    view: str
    layers: str
    total_heads: int
    own: tuple[int, int]  # receiver's global head range
    own_x: int
    own_width: int
    y: int
    bars: list[Bar] = field(default_factory=list)
    note: str = ""
    runs_note: str = ""  # block-size ratio: how each head moves, drawn under the bar


@dataclass
class BlockCell:
    x: int
    width: int
    label: str


@dataclass
class BlockRatio:
    """One large block over the ``ratio`` small blocks it pairs with (by token position)."""

    ratio: int
    large_side: str
    small_side: str
    large_tokens: int
    small_tokens: int
    y: int
    large: BlockCell
    small: list[BlockCell]

    @property
    def caption(self) -> str:
        return (
            f"one {self.large_side} block ({self.large_tokens} tokens) = {self.ratio} "
            f"{self.small_side} blocks ({self.small_tokens} tokens each): large block k pairs with "
            f"small blocks {self.ratio}·k … {self.ratio}·k + {self.ratio - 1}, counted by token "
            "position from the start of the request (a partial last block moves only its tokens)"
        )


@dataclass
class HeadSlices:
    receiver: int
    rows: list[SliceRow]
    width: int
    height: int
    left: int = BAR_LEFT
    bar_w: int = BAR_W
    bar_h: int = BAR_H
    ticks: list[tuple[int, str]] = field(default_factory=list)
    blocks: BlockRatio | None = None


BLOCK_STRIP_H = 2 * BAR_H + 30


def block_ratio(plan: Mapping[str, Any], y: int) -> BlockRatio | None:
    """The block strip of a plan whose sides have different ``tokens_per_block`` (else None)."""
    context = int(plan["tokens_per_block"])
    generation = int(plan.get("generation_tokens_per_block") or context)
    if context == generation:
        return None
    large, small = max(context, generation), min(context, generation)
    ratio = large // small
    large_side = "context" if context > generation else "generation"
    small_side = "generation" if large_side == "context" else "context"
    width = BAR_W // ratio
    # labels shrink with the cell width: "context 4k+1" up to r = 4, then "+1"
    prefix = f"{small_side} " if ratio <= 4 else ""
    cells = [
        BlockCell(
            BAR_LEFT + i * width,
            width,
            f"{prefix}{ratio}k" if i == 0 else (f"{prefix}{ratio}k+{i}" if prefix else f"+{i}"),
        )
        for i in range(ratio)
    ]
    return BlockRatio(
        ratio,
        large_side,
        small_side,
        large,
        small,
        y,
        BlockCell(BAR_LEFT, width * ratio, f"{large_side} block k ({large} tokens)"),
        cells,
    )


def _scale(heads: int, total: int) -> int:
    return round(heads * BAR_W / max(total, 1))


def head_slices(plan: Mapping[str, Any], generation: Instance, receiver: int) -> HeadSlices:
    """Which sender rank fills which head range of each view of ``receiver``."""
    table = generation.table(receiver)
    by_view: dict[int, dict[tuple[int, ...], list[tuple[int, Mapping[str, Any]]]]] = {}
    for route in plan["routes"]:
        if int(route["receiver_rank"]) != receiver:
            continue
        for item in route.get("slices", ()):
            key = tuple(int(x) for x in item["layers"])
            by_view.setdefault(int(item["receiver_view"]), {}).setdefault(key, []).append(  # type: ignore[arg-type]
                (int(route["sender_rank"]), item)
            )
    rows: list[SliceRow] = []
    y = 8
    blocks = block_ratio(plan, y)
    if blocks is not None:
        y += BLOCK_STRIP_H
    for view in table.views:
        label = f"{view.owner}[{','.join(view.roles_key)}] {view.layout} @pool{view.pool}"
        try:
            geometry = view_geometry(generation, table, view)
            total = geometry.total_heads
            own = geometry.head_range
        except GeometryError:  # stored registrations were checked; keep drawing regardless
            total, own = 1, (0, 1)
        groups = by_view.get(view.index)
        if not groups:
            rows.append(
                SliceRow(
                    label,
                    f"layers {ranges(view.layers)}",
                    total,
                    own,
                    BAR_LEFT + _scale(own[0], total),
                    _scale(own[1] - own[0], total),
                    y,
                    note="not transferred: no sender view matches (see the report's warnings)",
                )
            )
            y += ROW_H
            continue
        for layers, items in sorted(groups.items()):
            row = SliceRow(
                label,
                layer_text(layers),
                total,
                own,
                BAR_LEFT + _scale(own[0], total),
                _scale(own[1] - own[0], total),
                y,
            )
            converted = sorted(
                {
                    f"{item['sender_layout']}→{item['layout']}"
                    for _, item in items
                    if item.get("sender_layout", item["layout"]) != item["layout"]
                }
            )
            if converted:
                row.note = f"layout converted {', '.join(converted)}: one run per head and token"
            if blocks is not None:
                row.runs_note = (
                    f"per head {blocks.ratio} runs of {blocks.small_tokens} tokens per "
                    f"{blocks.large_side} block, one per {blocks.small_side} block"
                )
            for sender, item in sorted(
                items, key=lambda pair: (pair[1].get("global_heads") or [0])[0]
            ):
                heads = item.get("global_heads")
                lo, hi = own if heads is None else (int(heads[0]), int(heads[1]))
                text = "all" if heads is None else f"[{lo}, {hi})"
                row.bars.append(
                    Bar(
                        sender,
                        BAR_LEFT + _scale(lo, total),
                        max(_scale(hi - lo, total), 2),
                        f"rank {sender}: {text}",
                        f"sender rank {sender}: " + slice_text(item),
                        sender % PALETTE_SIZE,
                    )
                )
            rows.append(row)
            y += ROW_H
    return HeadSlices(receiver, rows, BAR_LEFT + BAR_W + 16, y + 8, blocks=blocks)
