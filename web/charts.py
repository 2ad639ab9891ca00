"""Time-series charts of the last hour, computed here and drawn as inline SVG by the templates.

Each chart is a plot area of ``buckets`` equal time steps (oldest left, now right) with a
y axis from 0 to a round maximum (1, 2 or 5 × 10^k). Line charts draw one polyline per series
(broken where a bucket has no value, e.g. a minute without a finished transfer for latency);
bar charts stack one bar per series and bucket. Every non-zero point carries a hover title with
its time range and value, so the numbers stay readable without JavaScript.

Pure: lists of numbers in, plain geometry out (no database, no HTTP).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from web.format import human_bytes

WIDTH = 460
HEIGHT = 170
LEFT = 80
RIGHT = 10
TOP = 12
BOTTOM = 24
PLOT_W = WIDTH - LEFT - RIGHT
PLOT_H = HEIGHT - TOP - BOTTOM
PALETTE_SIZE = 8

Format = Callable[[float], str]


@dataclass(frozen=True)
class Point:
    x: float
    y: float
    title: str


@dataclass(frozen=True)
class Bar:
    x: float
    y: float
    width: float
    height: float
    css: str
    title: str


@dataclass
class Chart:
    """One chart's geometry; ``segments`` are polylines as ``"x,y x,y …"`` per series."""

    id: str
    title: str
    width: int = WIDTH
    height: int = HEIGHT
    left: int = LEFT
    right: int = WIDTH - RIGHT
    legend: list[tuple[str, str]] = field(default_factory=list)  # (name, css class)
    segments: list[tuple[str, str]] = field(default_factory=list)  # (css class, points)
    points: list[tuple[str, Point]] = field(default_factory=list)
    bars: list[Bar] = field(default_factory=list)
    y_ticks: list[tuple[float, str]] = field(default_factory=list)
    x_ticks: list[tuple[float, str]] = field(default_factory=list)
    empty: bool = True
    summary: str = ""


def nice_ceiling(value: float) -> float:
    """The smallest 1, 2 or 5 × 10^k that is ≥ ``value`` (1 for nothing to show)."""
    if value <= 0 or not math.isfinite(value):
        return 1.0
    exponent = math.floor(math.log10(value))
    for step in (1, 2, 5, 10):
        candidate = step * 10.0**exponent
        if candidate >= value * (1 - 1e-9):
            return candidate
    return 10.0 ** (exponent + 1)  # pragma: no cover - the loop always returns


def nice_binary_ceiling(value: float) -> float:
    """Like :func:`nice_ceiling` in units of 1024^k: ``51.2 KiB`` → ``100 KiB``."""
    if value <= 0 or not math.isfinite(value):
        return 1.0
    unit = 1024.0 ** max(0, math.floor(math.log(value, 1024)))
    return nice_ceiling(value / unit) * unit


def per_second(value: float) -> str:
    """``0.25`` → ``0.25/s``."""
    return f"{value:.3g}/s"


def bytes_per_second(value: float) -> str:
    """``1048576`` → ``1 MiB/s``."""
    return f"{human_bytes(value)}/s"


def seconds(value: float) -> str:
    """``0.0123`` → ``12.3 ms``; ``2.5`` → ``2.5 s``."""
    return f"{value * 1000:.3g} ms" if value < 1 else f"{value:.3g} s"


def count(value: float) -> str:
    return f"{int(round(value))}"


def _axes(
    chart: Chart, start: datetime, step_s: int, buckets: int, top: float, fmt: Format
) -> None:
    for fraction in (0.0, 0.5, 1.0):
        chart.y_ticks.append((TOP + PLOT_H * (1 - fraction), fmt(top * fraction)))
    span_min = buckets * step_s / 60
    for fraction in (0.0, 0.5, 1.0):
        minutes_ago = span_min * (1 - fraction)
        label = "now" if minutes_ago == 0 else f"−{minutes_ago:.0f} min"
        chart.x_ticks.append((LEFT + PLOT_W * fraction, label))


def _when(start: datetime, step_s: int, index: int) -> str:
    begin = start + timedelta(seconds=index * step_s)
    end = begin + timedelta(seconds=step_s)
    return f"{begin:%H:%M}–{end:%H:%M} UTC"


def _x(index: int, buckets: int) -> float:
    return LEFT + PLOT_W * (index + 0.5) / buckets


def line_chart(
    chart_id: str,
    title: str,
    *,
    start: datetime,
    step_s: int,
    series: Mapping[str, Sequence[float | None]],
    fmt: Format,
    binary: bool = False,
) -> Chart:
    """One polyline per series; ``None`` breaks the line (no value in that bucket).

    ``binary``: round the axis in 1024-based units (bytes).
    """
    chart = Chart(chart_id, title)
    buckets = max((len(values) for values in series.values()), default=0)
    values_seen = [v for values in series.values() for v in values if v is not None]
    top = (nice_binary_ceiling if binary else nice_ceiling)(max(values_seen, default=0.0))
    _axes(chart, start, step_s, buckets, top, fmt)
    peaks: list[str] = []
    for number, (name, values) in enumerate(series.items()):
        css = f"s{number % PALETTE_SIZE}"
        chart.legend.append((name, css))
        run: list[str] = []
        for index, value in enumerate([*values, None]):
            if value is None:
                if run:
                    chart.segments.append((css, " ".join(run)))
                run = []
                continue
            x, y = _x(index, buckets), TOP + PLOT_H * (1 - value / top)
            run.append(f"{x:.1f},{y:.1f}")
            if value:
                chart.points.append(
                    (css, Point(x, y, f"{_when(start, step_s, index)} · {name}: {fmt(value)}"))
                )
        present = [v for v in values if v is not None]
        if present and max(present) > 0:
            peaks.append(f"{name} peak {fmt(max(present))}")
    chart.empty = not peaks
    chart.summary = f"{title}, last hour: " + ("; ".join(peaks) if peaks else "nothing yet")
    return chart


def bar_chart(
    chart_id: str,
    title: str,
    *,
    start: datetime,
    step_s: int,
    series: Mapping[str, Sequence[int]],
    fmt: Format = count,
) -> Chart:
    """Stacked bars: one per bucket, a segment per series (e.g. failures by reason)."""
    chart = Chart(chart_id, title)
    buckets = max((len(values) for values in series.values()), default=0)
    totals = [sum(values[i] for values in series.values()) for i in range(buckets)]
    top = nice_ceiling(max(totals, default=0))
    _axes(chart, start, step_s, buckets, top, fmt)
    width = PLOT_W / max(buckets, 1)
    base = [0.0] * buckets
    parts: list[str] = []
    for number, (name, values) in enumerate(series.items()):
        css = f"s{(number + 5) % PALETTE_SIZE}"  # reds and ambers first
        chart.legend.append((name, css))
        for index, value in enumerate(values):
            if not value:
                continue
            height = PLOT_H * value / top
            base[index] += height
            chart.bars.append(
                Bar(
                    LEFT + width * index + 1,
                    TOP + PLOT_H - base[index],
                    max(width - 2, 1),
                    height,
                    css,
                    f"{_when(start, step_s, index)} · {name}: {fmt(value)}",
                )
            )
        if sum(values):
            parts.append(f"{name} {fmt(sum(values))}")
    chart.empty = not parts
    chart.summary = f"{title}, last hour: " + ("; ".join(parts) if parts else "none")
    return chart
