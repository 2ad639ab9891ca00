"""Demo fleet and registration-body builders (used by ``kvplane serve --demo-fleet``, tests, bench).

Each rank has one pool holding a target K/V view and, optionally, a draft K/V view with its own
(smaller) head count, both HND, bfloat16. The bodies are thin defaults over
:mod:`geometry.builders`, which lays out the bytes.
"""

from __future__ import annotations

import logging
from typing import Any

from api import schemas
from api.db import Database
from api.errors import KvplaneError
from geometry import builders

log = logging.getLogger(__name__)

HEAD_DIM = 128

DEMO_CONTEXT = "demo-context-tp4"
DEMO_GENERATION = "demo-generation-tp2"


def _views(
    target_heads: int, target_layers: int, draft_heads: int | None, draft_layers: int
) -> list[builders.ViewSpec]:
    views = [builders.ViewSpec("target", target_layers, target_heads, HEAD_DIM)]
    if draft_heads is not None:
        views.append(builders.ViewSpec("draft", draft_layers, draft_heads, HEAD_DIM))
    return views


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
    """A full registration body (``ranks`` included unless ``with_ranks`` is false).

    Built by :func:`geometry.builders.instance_body`: target layers split over the pipeline
    stages, draft layers on the last stage, one pool per rank, HND bfloat16.
    """
    body = builders.instance_body(
        role=role,
        views=_views(target_heads, target_layers, draft_heads, draft_layers),
        tp=tp,
        pp=pp,
        tokens_per_block=tokens_per_block,
        num_slots=num_slots,
        model=model,
    )
    if not with_ranks:
        del body["ranks"]
    return body


def rank_body(
    rank: int,
    *,
    group_size: int,
    target_heads: int = 8,
    target_layers: int = 4,
    draft_heads: int | None = None,
    draft_layers: int = 1,
    tokens_per_block: int = 32,
    num_slots: int = 256,
) -> dict[str, Any]:
    """One rank's page table (``PUT .../ranks/{rank}``) of a single-stage TP ``group_size``
    instance; ``rank`` is written as given, even outside the world (bad-input tests need that)."""
    body = instance_body(
        role="context",
        tp=group_size,
        target_heads=target_heads,
        target_layers=target_layers,
        draft_heads=draft_heads,
        draft_layers=draft_layers,
        tokens_per_block=tokens_per_block,
        num_slots=num_slots,
    )
    return {**body["ranks"][0], "rank": rank}


def fake_peer(
    rank_body: dict[str, Any], agent: str, staging_bytes: int = 1 << 24
) -> dict[str, Any]:
    """A syntactically valid worker endpoint for ``rank_body`` (``POST /v1/workers`` ``peer``)
    that nothing ever dereferences: for tests that drive the job queue without NIXL."""
    return {
        "agent": agent,
        "metadata_b64": "bWV0YWRhdGE=",
        "mem_type": "DRAM",
        "device_id": 0,
        "pools": [
            {
                **pool,
                "slot_stride_bytes": pool.get("slot_stride_bytes") or pool["slot_bytes"],
                "base_address": 4096 * (pool["id"] + 1),
            }
            for pool in rank_body["pools"]
        ],
        "staging": {"address": 1 << 20, "bytes": staging_bytes},
    }


def demo_fleet_bodies() -> dict[str, dict[str, Any]]:
    """The demo fleet: a TP4 context (8-head target + 2-head draft) and a TP2 generation."""
    return {
        DEMO_CONTEXT: instance_body(role="context", tp=4, draft_heads=2),
        DEMO_GENERATION: instance_body(role="generation", tp=2, draft_heads=2),
    }


def register_demo_fleet(db: Database) -> None:
    """Register the demo fleet and pair it, through the services (idempotent)."""
    from api.services import pairings, registration

    try:
        with db.write() as session:
            for name, body in demo_fleet_bodies().items():
                registration.register_instance(
                    session=session, name=name, body=schemas.InstanceCreate.model_validate(body)
                )
            row, _created = pairings.create_pairing(
                session=session, context=DEMO_CONTEXT, generation=DEMO_GENERATION
            )
            log.info("demo fleet ready: pairing %s compatible=%s", row.id, row.compatible)
    except KvplaneError as error:
        log.warning("demo fleet not registered: %s", error.detail)
