"""Demo fleet and registration-body builders (used by ``kvplane serve --demo-fleet``, tests, bench).

Bodies follow the DESIGN's contract: one pool per rank holding a target K/V view and, optionally,
a draft K/V view with its own (smaller) head count, both HND, bfloat16.
"""

from __future__ import annotations

import logging
from typing import Any

from api import schemas
from api.db import Database
from api.errors import KvplaneError

log = logging.getLogger(__name__)

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
DEMO_CONTEXT = "demo-context-tp4"
DEMO_GENERATION = "demo-generation-tp2"


def _heads_per_rank(total_heads: int, group_size: int) -> int:
    return total_heads // min(group_size, total_heads)


def rank_body(
    rank: int,
    *,
    group_size: int,
    target_heads: int = 8,
    target_layers: int = 4,
    draft_heads: int | None = None,
    draft_layers: int = 1,
    tokens_per_block: int = 32,
    head_dim: int = 128,
    dtype: str = "bfloat16",
    num_slots: int = 256,
) -> dict[str, Any]:
    """One rank's page table: a target K/V view (+ a draft view) sharing one pool."""
    views: list[dict[str, Any]] = []
    offset = 0
    specs = [("target", target_heads, range(target_layers))]
    if draft_heads is not None:
        specs.append(("draft", draft_heads, range(target_layers, target_layers + draft_layers)))
    for owner, total, layers in specs:
        heads = _heads_per_rank(total, group_size)
        size = heads * head_dim * tokens_per_block * DTYPE_BYTES.get(dtype, 2)
        buffers = []
        for layer in layers:
            for _role in ("key", "value"):
                buffers.append({"layer": layer, "offset": offset, "size": size})
                offset += size
        views.append(
            {
                "pool": 0,
                "owner": owner,
                "roles": ["key", "value"],
                "layout": "HND",
                "num_kv_heads": heads,
                "total_kv_heads": total,
                "head_dim": head_dim,
                "dtype": dtype,
                "buffers": buffers,
            }
        )
    return {
        "rank": rank,
        "pools": [{"id": 0, "layer_group": 0, "slot_bytes": offset, "num_slots": num_slots}],
        "views": views,
    }


def instance_body(
    *,
    role: str,
    tp: int,
    pp: int = 1,
    with_ranks: bool = True,
    target_heads: int = 8,
    target_layers: int = 4,
    draft_heads: int | None = None,
    draft_layers: int = 1,
    tokens_per_block: int = 32,
    model: str | None = "demo-8b",
    num_slots: int = 256,
) -> dict[str, Any]:
    """A full registration body (``ranks`` included unless ``with_ranks`` is false)."""
    body: dict[str, Any] = {
        "role": role,
        "model": model,
        "tp": tp,
        "pp": pp,
        "cp": 1,
        "attention_dp": False,
        "tokens_per_block": tokens_per_block,
        "total_kv_heads": target_heads,
    }
    if with_ranks:
        body["ranks"] = [
            rank_body(
                rank,
                group_size=tp,
                target_heads=target_heads,
                target_layers=target_layers,
                draft_heads=draft_heads,
                draft_layers=draft_layers,
                tokens_per_block=tokens_per_block,
                num_slots=num_slots,
            )
            for rank in range(tp * pp)
        ]
    return body


def demo_fleet_bodies() -> dict[str, dict[str, Any]]:
    """The demo fleet: a TP4 context (8-head target + 2-head draft) and a TP2 generation."""
    return {
        DEMO_CONTEXT: instance_body(role="context", tp=4, draft_heads=2),
        DEMO_GENERATION: instance_body(role="generation", tp=2, draft_heads=2),
    }


def register_demo_fleet(db: Database) -> None:
    """Register the demo fleet and pair it, through the services (idempotent)."""
    from api.services import instances, pairings

    try:
        with db.write() as session:
            for name, body in demo_fleet_bodies().items():
                instances.register_instance(
                    session=session, name=name, body=schemas.InstanceCreate.model_validate(body)
                )
            row, _created = pairings.create_pairing(
                session=session, context=DEMO_CONTEXT, generation=DEMO_GENERATION
            )
            log.info("demo fleet ready: pairing %s compatible=%s", row.id, row.compatible)
    except KvplaneError as error:
        log.warning("demo fleet not registered: %s", error.detail)
