"""Offline pairing check (``kvplane check``): validation and plan compile without a server.

A deployment pipeline can gate a rollout on it: the same strict schema as the API, the same
planning core, nothing stored. Exit codes of the CLI: 0 compatible, 1 incompatible, 2 bad input.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from api.schemas import InstanceCreate
from geometry import (
    GeometryError,
    Instance,
    Problem,
    compile_plan,
    parse_instance,
    validate_pairing,
)

# What each finding means for the operator, printed under it by ``kvplane check``.
EXPLANATIONS: dict[str, str] = {
    "layout_conversion": "the two sides store this view's heads in different orders (HND: "
    "head-major, NHD: token-major); kvplane converts while copying, one strided run per layer, "
    "buffer and head (a fragment per head and token with the fragments transport; the staged "
    "transport gathers them in one vectorized pass). Use one layout on both sides to avoid it.",
    "nhd_head_slicing": "NHD stores all heads of a token together, so handing a subset of heads "
    "to another rank cuts every token row: one fragment per token and sender slice. HND keeps "
    "a head contiguous over the block and needs one fragment per buffer.",
    "missing_peer_view": "the generation side has layers (owner and roles as named) that no "
    "context view holds; target layers make the pairing unusable, and so do draft layers when "
    "the context has draft layers too (both sides' drafters must match like target models). "
    "Only when the context has no draft layers at all is it a warning: the generation's draft "
    "layers are then simply not transferred.",
    "draft_layer_mismatch": "both sides hold as many draft layers but number them differently: "
    "draft layers pair by global layer id, so none would match and no draft KV would move. "
    "Number them alike on both sides (e.g. right after the target's layers).",
    "missing_peer_shard": "some context ranks of this pipeline stage hold the layer, but none "
    "of the listed CP rank (or TP shard) does: those heads or blocks would never be sent. Every "
    "TP and CP rank of a stage must register the same layers.",
    "layer_count_mismatch": "the sides hold different target layers; only the layers both hold "
    "move (e.g. an MTP layer present on one side only).",
    "tokens_per_block_mismatch": "the sides page tokens differently and kvplane cannot map one "
    "block size onto the other here. It can when the larger tokens_per_block is a whole "
    "multiple of the smaller, every view on both sides is HND and neither side uses context "
    "parallelism (CP ranks own whole blocks round-robin, so block boundaries must coincide); "
    "the message names which of these fails.",
    "tokens_per_block_ratio": "the sides page tokens differently: one block of the larger side "
    "holds the tokens of `ratio` consecutive blocks of the other side. kvplane copies each "
    "large block as `ratio` pieces, per head one run per small block (a template `ratio` times "
    "larger, still independent of the block count). Blocks pair by token position from the "
    "start of the request, so every transfer gives num_tokens (the prompt tokens; 422 "
    "ambiguous_alignment without it): each block list ends with the block of the last prompt "
    "token, and a partial last block moves exactly the tokens that exist, never a byte past "
    "the prompt. Equal tokens_per_block avoids all this.",
    "head_geometry_mismatch": "the bytes of one head of one token differ (or the replicated "
    "region size): the two sides do not hold the same data per head.",
    "state_group_mismatch": "one side keeps per-request recurrent state (Mamba/SSM conv and SSM "
    "state: a layer group with tokens_per_slot null) and the other does not, or keeps these "
    "layers paged; the generation side could not resume the request's recurrent layers.",
    "state_bytes_mismatch": "the TP-aggregated bytes of one layer's state differ (bytes per "
    "rank × shards over tp × cp, 1 under attention-DP): the two sides hold differently shaped "
    "state (d_state, head_dim, conv channels, d_conv or the state dtype differ), or one side "
    "replicates what the other shards.",
    "section_count_mismatch": "the conv state is cut into a different number of sections (e.g. "
    "x, B, C of Mamba2): the sides disagree about the conv state's channel layout.",
    "section_bytes_mismatch": "a conv-state section's TP-aggregated size differs (channels × "
    "(d_conv − 1) × itemsize); check n_groups, d_state, d_conv and the conv-state dtype.",
    "d_state_mismatch": "the SSM state size differs: the two sides do not run the same model.",
}


def explain(code: str) -> str | None:
    """One or two sentences on what a finding means (None for self-explanatory codes)."""
    return EXPLANATIONS.get(code)


def parse_body(body: Any, name: str, side: str) -> Instance:
    """Strict schema, then the page-table rules; every problem's ``loc`` starts with ``side``."""
    try:
        InstanceCreate.model_validate(body)
    except ValidationError as error:
        raise GeometryError(
            [
                Problem((side, *item["loc"]), item["msg"], "validation_error")
                for item in error.errors()
            ]
        ) from None
    try:
        return parse_instance(body, name)
    except GeometryError as error:
        raise GeometryError(
            [
                Problem((side, *problem.loc), problem.message, problem.code)
                for problem in error.problems
            ]
        ) from None


def _dp_ranks(instance: Instance, requested: int | None) -> list[int | None]:
    if requested is not None:
        return [requested]
    return list(range(instance.tp)) if instance.attention_dp else [None]


def check_bodies(
    context_body: Mapping[str, Any],
    generation_body: Mapping[str, Any],
    *,
    context_name: str = "context",
    generation_name: str = "generation",
    context_dp_rank: int | None = None,
    generation_dp_rank: int | None = None,
) -> dict[str, Any]:
    """Validate a planned pairing and compile its plans; raises GeometryError on bad input."""
    context = parse_body(context_body, context_name, "context")
    generation = parse_body(generation_body, generation_name, "generation")
    report = validate_pairing(context, generation)
    result: dict[str, Any] = report.to_dict()
    result["plans"] = []
    if not report.compatible:
        return result
    for context_dp in _dp_ranks(context, context_dp_rank):
        for generation_dp in _dp_ranks(generation, generation_dp_rank):
            plan = compile_plan(context, generation, context_dp, generation_dp)
            result["plans"].append(
                {
                    "context_dp_rank": context_dp,
                    "generation_dp_rank": generation_dp,
                    "routes": len(plan.routes),
                    "runs": plan.runs,
                    "bytes_per_block": plan.bytes_per_block,
                    "block_ratio": plan.block_ratio[0],
                    "large_side": plan.block_ratio[1],
                    "receivers": [
                        {
                            "rank": r.rank,
                            "writers": list(r.writers),
                            "equal_split_safe": r.equal_split_safe,
                        }
                        for r in plan.receivers
                    ],
                }
            )
    return result
