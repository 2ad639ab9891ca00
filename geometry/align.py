"""Block alignment by token position: which block of one side pairs with which of the other.

Shared by the planner's expansion (:mod:`geometry.expand`) and the workers
(:func:`workers.executors.align_request`), so both read a request's block lists alike.

**The rule.** A request has ``P = num_tokens`` prompt tokens whose KV exists on the context side
(``num_tokens`` travels with the transfer). With ``T`` tokens per block a side's request spans
``N = ⌈P / T⌉`` blocks, logical blocks ``0 … N−1``, block ``j`` holding tokens
``[j·T, min((j+1)·T, P))``. Every block list of a paged layer group is a *suffix* of these
blocks: it ends with the block holding token ``P − 1`` and starts wherever the side's cache
begins (prefix reuse, or a sliding window's first live block), so element ``k`` of a list of
length ``L`` is logical block ``N − L + k``. A list longer than ``N`` is refused
(``invalid_blocks``): it names blocks past the prompt (e.g. one allocated ahead for the first
decode token). Blocks pair by logical index (equal sizes) or by token range (a ratio, below).

**Without ``num_tokens``** the token positions are assumed, and only where that is exact:

- equal block sizes: the longer list starts at logical block 0 (``N`` = its length), i.e. one
  side holds the whole prompt and the other reused a prefix of it, or both hold the same blocks;
  the two lists then pair from their ends. A generation list longer than the context's is
  refused (``invalid_blocks``): it is either the context's prefix reuse or blocks allocated
  ahead of the prompt, and only ``num_tokens`` tells them apart.
- context parallelism: the same assumption per layer group; since block ``j`` lives on CP rank
  ``j mod cp`` by its index in the *request*, paged groups of different lengths in one request
  (a sliding-window group beside a full-attention one) contradict it and are refused
  (``ambiguous_alignment``).
- different block sizes: refused whenever both sides list blocks (``ambiguous_alignment``): the
  last block may be partial on either side, and only ``P`` says how many tokens it holds.

**Block-size ratio** (``tokens_per_block`` ``t`` on the small side, ``r·t`` on the large side):
small block ``s`` (tokens ``[s·t, min((s+1)·t, P))``) pairs with large block ``⌊s / r⌋``,
sub-block ``s mod r``, when both sides list them. A partial last small block (``P`` not a
multiple of ``t``) moves exactly its ``P − (N_small − 1)·t`` tokens; sub-blocks of the large
side's last block past ``P`` pair with nothing and are never written. With ``P = 20``,
``16 : 4``::

    tokens      0 ........ 15 | 16 .. 19 | 20 ................ 31
    context     C0 (16 tok)   | C1: 4 of 16 tokens exist
    generation  G0 G1 G2 G3   | G4       | (no block: past the prompt)
    pairs       C0.0→G0 C0.1→G1 C0.2→G2 C0.3→G3, C1.0→G4; C1.1–C1.3 move nothing
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from geometry.errors import GeometryError, Problem

AMBIGUOUS_ALIGNMENT = "ambiguous_alignment"
Loc = tuple[str | int, ...]


def request_blocks(num_tokens: int, tokens_per_block: int) -> int:
    """``⌈P / T⌉``: the blocks a request of ``num_tokens`` tokens spans."""
    return -(-num_tokens // tokens_per_block)


def is_nested(ids: Any) -> bool:
    """One block list per CP rank (rather than one flat list)."""
    if isinstance(ids, np.ndarray):
        return ids.ndim == 2 or (ids.dtype == object and bool(ids.size))
    return bool(len(ids)) and all(isinstance(item, (list, tuple, np.ndarray)) for item in ids)


def count(ids: Any) -> int:
    """Block ids on one side (summed over CP ranks)."""
    return sum(len(item) for item in ids) if is_nested(ids) else len(ids)


def plain_pair(context: Any, generation: Any) -> bool:
    """Both sides flat Python lists of distinct ids ≥ 0, the generation's no longer than the
    context's where both list blocks: without ``num_tokens`` (equal block sizes, no CP) such
    lists pair from their ends as :func:`align_equal` pairs them, and nothing in them is
    refused. The planner's summaries and the workers' alignment take a shortcut for them."""
    if type(context) is not list or type(generation) is not list:
        return False
    for ids in (context, generation):
        if ids and (
            not all(type(x) is int for x in ids) or min(ids) < 0 or len(set(ids)) != len(ids)
        ):
            return False
    return not (context and len(generation) > len(context))


def block_array(ids: Any, loc: Loc) -> np.ndarray:
    array = np.asarray(ids, dtype=np.int64) if len(ids) else np.empty(0, dtype=np.int64)
    if array.ndim != 1:
        raise GeometryError(Problem(loc, "must be a flat list of block ids", "invalid_blocks"))
    if array.size and array.min() < 0:
        raise GeometryError(Problem(loc, "block ids must be ≥ 0", "invalid_blocks"))
    return array


def no_duplicates(ids: np.ndarray, loc: Loc) -> None:
    if ids.size < 2:
        return
    ordered = np.sort(ids)
    repeated = ordered[1:][ordered[1:] == ordered[:-1]]
    if repeated.size:
        raise GeometryError(
            Problem(
                loc,
                f"block id {int(repeated[0])} appears more than once: one slot cannot hold two "
                "blocks of a request",
                "invalid_blocks",
            )
        )


def parse_side(raw: Any, loc: Loc, cp: int) -> tuple[list[np.ndarray], bool]:
    """``([ids])`` for a flat list, ``([ids of cp rank 0], …)`` for per-CP-rank lists."""
    if not is_nested(raw):
        return [block_array(raw, loc)], False
    if cp < 2:
        raise GeometryError(
            Problem(
                loc,
                "a list of lists (one block table per CP rank) needs CP > 1 on this side",
                "invalid_blocks",
            )
        )
    if len(raw) != cp:
        raise GeometryError(
            Problem(
                loc,
                f"{len(raw)} block lists for {cp} CP ranks: give one list per CP rank, in "
                "cp_rank order",
                "invalid_blocks",
            )
        )
    return [block_array(ids, (*loc, c)) for c, ids in enumerate(raw)], True


def _too_long(loc: Loc, listed: int, total: int, num_tokens: int | None, where: str) -> Problem:
    if num_tokens is None:
        why = f"the request has {total} blocks"
    else:
        why = f"num_tokens={num_tokens} spans {total} blocks"
    return Problem(
        loc,
        f"{where} lists {listed} blocks, but {why}: a block list is a suffix of the request's "
        "blocks, ending with the block that holds its last prompt token (drop blocks allocated "
        "past the prompt)",
        "invalid_blocks",
    )


def logical(
    lists: list[np.ndarray],
    nested: bool,
    total: int,
    cp: int,
    loc: Loc,
    num_tokens: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """``(slots, logical block indices)`` of one side whose request spans ``total`` blocks.

    A flat list is a suffix of ``0 … total−1``; per-CP-rank list ``c`` a suffix of that rank's
    blocks ``j ≡ c (mod cp)`` (logical block ``j`` at position ``j // cp``). Duplicates are
    refused within each rank's blocks, lists longer than their share of the request too.
    """
    if not nested:
        (ids,) = lists
        if ids.size > total:
            raise GeometryError(_too_long(loc, ids.size, total, num_tokens, "this side"))
        index = total - ids.size + np.arange(ids.size, dtype=np.int64)
        for c in range(cp):  # under CP, a flat list names slots of different ranks
            no_duplicates(ids[index % cp == c] if cp > 1 else ids, loc)
        return ids, index
    slots, parts = [], []
    for c, ids in enumerate(lists):
        no_duplicates(ids, (*loc, c))
        on_rank = (total - c + cp - 1) // cp  # logical blocks j < total with j % cp == c
        if ids.size > on_rank:
            raise GeometryError(
                Problem(
                    (*loc, c),
                    f"CP rank {c} lists {ids.size} blocks, but a request of {total} blocks has "
                    f"only {on_rank} on that rank"
                    + ("" if num_tokens is None else f" (num_tokens={num_tokens})"),
                    "invalid_blocks",
                )
            )
        slots.append(ids)
        parts.append(c + cp * (on_rank - ids.size + np.arange(ids.size, dtype=np.int64)))
    return np.concatenate(slots), np.concatenate(parts)


def align_equal(
    context_ids: Any,
    generation_ids: Any,
    loc: Loc,
    total: int,
    context_cp: int = 1,
    generation_cp: int = 1,
    num_tokens: int | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Equal block sizes: ``(context slots, generation slots, logical block)`` of the blocks
    both sides list, for a request of ``total`` blocks."""
    ctx_lists, ctx_nested = parse_side(context_ids, (*loc, "context"), context_cp)
    gen_lists, gen_nested = parse_side(generation_ids, (*loc, "generation"), generation_cp)
    src, src_logical = logical(
        ctx_lists, ctx_nested, total, context_cp, (*loc, "context"), num_tokens
    )
    dst, dst_logical = logical(
        gen_lists, gen_nested, total, generation_cp, (*loc, "generation"), num_tokens
    )
    if not ctx_nested and not gen_nested:  # both suffixes of one range: the common tail
        n = min(src.size, dst.size)
        return src[src.size - n :], dst[dst.size - n :], np.arange(total - n, total)
    index, src_at, dst_at = np.intersect1d(
        src_logical, dst_logical, assume_unique=True, return_indices=True
    )
    return src[src_at], dst[dst_at], index


@dataclass(frozen=True)
class RatioPairs:
    """Different block sizes: one entry per small block that moves (token order).

    ``large_blocks[k]`` and ``small_blocks[k]`` are the slots of the pair; ``sub_block[k]`` which
    small block of the large one it is. ``tail_tokens > 0``: the last pair is a partial small
    block holding that many tokens (only they move); 0: every pair is whole.
    """

    context: np.ndarray
    generation: np.ndarray
    sub_block: np.ndarray
    tail_tokens: int

    def select(self, sub: int) -> tuple[np.ndarray, np.ndarray]:
        """Whole pairs of sub-block ``sub``: ``(context slots, generation slots)``."""
        keep = self.sub_block == sub
        if self.tail_tokens:
            keep[-1] = False
        return self.context[keep], self.generation[keep]

    def tail(self, sub: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The partial last pair when it is sub-block ``sub`` (else None)."""
        if not self.tail_tokens or int(self.sub_block[-1]) != sub:
            return None
        return self.context[-1:], self.generation[-1:]


def align_ratio(
    context_ids: Any,
    generation_ids: Any,
    loc: Loc,
    ratio: int,
    large_side: str,
    small_tokens_per_block: int,
    num_tokens: int,
) -> RatioPairs:
    """Pair small blocks with sub-blocks of large ones by token range (see the module)."""
    ids = {}
    for side, raw in (("context", context_ids), ("generation", generation_ids)):
        (array,), _ = parse_side(raw, (*loc, side), 1)
        no_duplicates(array, (*loc, side))
        ids[side] = array
    small_side = "generation" if large_side == "context" else "context"
    large, small = ids[large_side], ids[small_side]
    t = small_tokens_per_block
    n_small, n_large = request_blocks(num_tokens, t), request_blocks(num_tokens, t * ratio)
    for side, array, total in ((large_side, large, n_large), (small_side, small, n_small)):
        if array.size > total:
            raise GeometryError(_too_long((*loc, side), array.size, total, num_tokens, side))
    small_index = n_small - small.size + np.arange(small.size, dtype=np.int64)
    large_index = small_index // ratio
    first_large = n_large - large.size
    keep = large_index >= first_large
    pairs = {
        large_side: large[large_index[keep] - first_large],
        small_side: small[keep],
    }
    last = num_tokens - (n_small - 1) * t  # tokens in the request's last small block
    partial = bool(keep.size and keep[-1] and last < t)
    return RatioPairs(
        pairs["context"],
        pairs["generation"],
        (small_index % ratio)[keep],
        last if partial else 0,
    )


def trimmed_length(length: int, tokens: int, small_tokens_per_block: int, loc: Loc) -> int:
    """A ratio run (one head of one small block, ``len = t × u``) cut to its first ``tokens``
    tokens: ``tokens × u`` bytes (HND holds a head's tokens contiguously, token-major)."""
    if (length * tokens) % small_tokens_per_block:
        raise GeometryError(
            Problem(
                loc,
                f"the last block holds {tokens} of {small_tokens_per_block} tokens, which ends "
                f"inside a byte of a {length}-byte head run: give num_tokens that ends on a "
                "whole byte",
                "invalid_blocks",
            )
        )
    return length * tokens // small_tokens_per_block


def request_totals(
    blocks: Mapping[int, tuple[Any, Any]],
    paged: Sequence[int],
    *,
    num_tokens: int | None,
    tokens_per_block: int,
    ratio: int,
    cp: int,
) -> dict[int, int]:
    """Per paged layer group the request's block count (equal sizes); raises where the lists
    cannot be placed exactly without ``num_tokens`` (see the module: what is assumed)."""
    if num_tokens is not None:
        if num_tokens < 1:
            raise GeometryError(
                Problem(("num_tokens",), "num_tokens must be ≥ 1", "invalid_blocks")
            )
        return {g: request_blocks(num_tokens, tokens_per_block) for g in paged}
    counts = {g: (count(blocks[g][0]), count(blocks[g][1])) for g in paged}
    moving = {g: c for g, c in counts.items() if c[0] and c[1]}
    if ratio > 1:
        if moving:
            g = min(moving)
            raise GeometryError(
                Problem(
                    ("num_tokens",),
                    f"the two sides page different numbers of tokens per block (ratio {ratio}) "
                    f"and layer group {g} lists blocks on both: give num_tokens (the prompt "
                    "tokens to move), since blocks pair by token position from the start of "
                    "the request and a partial last block holds only the tokens that exist",
                    AMBIGUOUS_ALIGNMENT,
                )
            )
        return {g: max(c) for g, c in counts.items()}
    for g, (n_context, n_generation) in sorted(moving.items()):
        if n_generation > n_context:
            raise GeometryError(
                Problem(
                    ("blocks", str(g), "generation"),
                    f"the generation lists {n_generation} blocks, the context {n_context}: "
                    "without num_tokens the longer list is taken to start at the request's "
                    "first block, which cannot tell context prefix reuse from generation "
                    "blocks allocated past the prompt; give num_tokens, or list only the "
                    "blocks that hold prompt tokens",
                    "invalid_blocks",
                )
            )
    totals = {g: max(c) for g, c in counts.items()}
    lengths = {totals[g] for g in moving}
    if cp > 1 and len(lengths) > 1:
        shown = ", ".join(f"group {g}: {totals[g]}" for g in sorted(moving))
        raise GeometryError(
            Problem(
                ("num_tokens",),
                f"under context parallelism block j lives on CP rank j mod {cp} by its index "
                "in the request; without num_tokens each layer group's longer list is taken to "
                f"start at block 0, which groups of different lengths contradict ({shown}): "
                "give num_tokens",
                AMBIGUOUS_ALIGNMENT,
            )
        )
    return totals
