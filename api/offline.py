"""Offline pairing check (``kvplane check``): validation and plan compile without a server.

A deployment pipeline can gate a rollout on it: the same strict schema as the API, the same
planning core, nothing stored. Exit codes of the CLI: 0 compatible, 1 incompatible, 2 bad input.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from api.geometry import (
    GeometryError,
    Instance,
    Problem,
    compile_plan,
    parse_instance,
    validate_pairing,
)
from api.schemas import InstanceCreate


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
