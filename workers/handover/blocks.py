"""A request's block map: the two forms ``send``/``expect`` accept, and back to the REST form.

``{layer_group: (context_ids, generation_ids)}`` (engines) or
``{"0": {"context": [...], "generation": [...]}}`` (REST); each side a flat list of block ids, or
one list per CP rank (helix: each CP rank's own block table). Both sides of a request hand the
same map; :func:`normalize_blocks` checks it before anything is granted or written.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from workers.directory import HandoverError

BlockMap = Mapping[Any, Any]


def _flat_ids(raw: Any, g: int, side: str) -> list[int]:
    arr = np.asarray(raw.detach().cpu().numpy() if hasattr(raw, "detach") else raw)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise HandoverError(
            f"layer group {g}: {side} block ids must be a flat list of integers "
            "(or, on a CP side, one such list per CP rank)",
            code="invalid_blocks",
        )
    return [int(x) for x in arr.tolist()]


def _side_ids(raw: Any, g: int, side: str) -> list[int] | list[list[int]]:
    """A flat id list, or one list per CP rank (helix: each CP rank's own block table)."""
    if type(raw) is list and all(type(x) is int for x in raw):
        return raw  # the usual form, already what the rest expects
    if (
        isinstance(raw, Sequence)
        and not isinstance(raw, (str, bytes))
        and len(raw)
        and all(
            isinstance(x, (Sequence, np.ndarray)) and not isinstance(x, (str, bytes)) for x in raw
        )
    ):
        return [_flat_ids(x, g, side) for x in raw]
    return _flat_ids(raw, g, side)


def normalize_blocks(blocks: BlockMap) -> dict[int, tuple[Any, Any]]:
    """``{group: (context_ids, generation_ids)}`` from either accepted form; each side a flat
    list of ints or one list per CP rank. Raises :class:`HandoverError` if bad."""
    out: dict[int, tuple[Any, Any]] = {}
    for group, lists in blocks.items():
        try:
            g = int(group)
        except (TypeError, ValueError):
            raise HandoverError(
                f"layer group {group!r} is not an integer", code="invalid_blocks"
            ) from None
        if isinstance(lists, Mapping):
            pair = (lists.get("context"), lists.get("generation"))
        elif isinstance(lists, Sequence) and len(lists) == 2:
            pair = (lists[0], lists[1])
        else:
            raise HandoverError(
                f"layer group {g}: expected (context_ids, generation_ids)", code="invalid_blocks"
            )
        ids = []
        for side, raw in zip(("context", "generation"), pair, strict=True):
            if raw is None:
                raise HandoverError(f"layer group {g}: no {side} block list", code="invalid_blocks")
            ids.append(_side_ids(raw, g, side))
        out[g] = (ids[0], ids[1])
    return out


def blocks_of(pairs: Mapping[int, tuple[Any, Any]]) -> dict[str, Any]:
    """The REST form of a block map (``{"0": {"context": [...], "generation": [...]}}``);
    per-CP-rank lists stay lists of lists."""

    def side(ids: Iterable[Any]) -> list[Any]:
        return [side(x) if isinstance(x, (list, tuple)) else int(x) for x in ids]

    return {str(g): {"context": side(c), "generation": side(r)} for g, (c, r) in pairs.items()}
