"""Formatting helpers for the templates (registered as Jinja2 filters)."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(count: int | float | None) -> str:
    """``147456`` → ``144 KiB`` (binary units, at most 3 significant digits)."""
    if count is None:
        return "—"
    size = float(count)
    for unit in _UNITS:
        if abs(size) < 1024 or unit == _UNITS[-1]:
            if unit == "B":
                return f"{int(size)} B"
            return f"{size:.3g} {unit}"
        size /= 1024
    return f"{size:.3g} {_UNITS[-1]}"  # pragma: no cover - loop always returns


def ranges(values: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 5]`` → ``0–3, 5``."""
    ordered = sorted(set(values))
    if not ordered:
        return "—"
    parts: list[str] = []
    start = prev = ordered[0]
    for item in ordered[1:]:
        if item == prev + 1:
            prev = item
            continue
        parts.append(str(start) if start == prev else f"{start}–{prev}")
        start = prev = item
    parts.append(str(start) if start == prev else f"{start}–{prev}")
    return ", ".join(parts)


def age(moment: datetime | None, now: datetime | None = None) -> str:
    """How long ago ``moment`` was: ``4 s ago``, ``3 min ago``, ``2 h ago``, ``5 d ago``."""
    if moment is None:
        return "never"
    return ago(((now or datetime.now(UTC)) - moment).total_seconds())


def ago(seconds: float) -> str:
    """``601.4`` → ``10 min ago``; under two minutes to a tenth of a second for small values."""
    if seconds < 0:
        return "just now"
    if seconds < 10:
        return f"{seconds:.1f} s ago"
    if seconds < 120:
        return f"{int(seconds)} s ago"
    if seconds < 7200:
        return f"{int(seconds // 60)} min ago"
    if seconds < 172800:
        return f"{int(seconds // 3600)} h ago"
    return f"{int(seconds // 86400)} d ago"


def timestamp(moment: datetime | None) -> str:
    """UTC time to the second: ``2026-11-29 22:44:18Z``."""
    return "—" if moment is None else moment.strftime("%Y-%m-%d %H:%M:%SZ")


def duration(seconds: float | None) -> str:
    """``0.0123`` → ``12.3 ms``; ``0.9996`` → ``1 s``."""
    if seconds is None:
        return "—"
    if seconds < 0.9995:  # above, three digits of milliseconds round up to 1 s
        return f"{seconds * 1000:.3g} ms"
    return f"{seconds:.3g} s"


def rate(count: int | None, seconds: float | None) -> str:
    """Throughput in GB/s (decimal, as network people quote it)."""
    if not count or not seconds:
        return "—"
    return f"{count / seconds / 1e9:.3g} GB/s"


def count(number: int, noun: str, plural: str | None = None) -> str:
    """``1 route``, ``2 routes``; ``plural`` where adding an s is wrong."""
    return f"{number:,} {noun if number == 1 else plural or noun + 's'}"


FILTERS = {
    "count": count,
    "bytes": human_bytes,
    "ranges": ranges,
    "age": age,
    "ago": ago,
    "timestamp": timestamp,
    "duration": duration,
}
