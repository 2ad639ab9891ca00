"""Register → pair → plan → transfer → fragments through a client generated from /openapi.json.

Run by ``tests/contract/test_generated_client.py`` against a live server, with the package that
``openapi-python-client`` generated from that server's spec on the path as ``kvplane_client``;
``mypy --strict`` checks this file first. Only typed attributes are used (never
``additional_properties``). Prints a JSON summary for the test to check.

    python generated_client_flow.py http://127.0.0.1:8000
"""

from __future__ import annotations

import json
import sys
from typing import TypeVar

from kvplane_client import Client
from kvplane_client.api.instances import get_instance, register_instance
from kvplane_client.api.pairings import create_pairing, get_pairing_plan
from kvplane_client.api.transfers import create_transfer, get_transfer_fragments
from kvplane_client.models import (
    BlockLists,
    BufferCreate,
    InstanceCreate,
    InstanceRead,
    Layout,
    Owner,
    PairingCreate,
    PlanRead,
    PoolCreate,
    Problem,
    RankCreate,
    Role,
    TransferCreate,
    TransferCreateBlocks,
    TransferFragments,
    TransferMode,
    TransferRead,
    ViewCreate,
)

T = TypeVar("T")

TOKENS_PER_BLOCK = 16
HEAD_DIM = 64
LAYERS = 2
TOTAL_HEADS = 8
DTYPE_BYTES = 2  # bfloat16


def ok(answer: T | Problem | None) -> T:
    """The answer, or exit with the problem's code."""
    if answer is None or isinstance(answer, Problem):
        raise SystemExit(f"kvplane answered a problem: {answer}")
    return answer


def rank(index: int, heads: int) -> RankCreate:
    """One rank: one pool holding K and V of every layer, HND."""
    size = heads * TOKENS_PER_BLOCK * HEAD_DIM * DTYPE_BYTES
    buffers = [
        BufferCreate(layer=layer, offset=(2 * layer + kv) * size, size=size)
        for layer in range(LAYERS)
        for kv in (0, 1)
    ]
    return RankCreate(
        rank=index,
        pools=[PoolCreate(id=0, slot_bytes=2 * LAYERS * size, num_slots=64)],
        views=[
            ViewCreate(
                pool=0,
                owner=Owner.TARGET,
                roles=["key", "value"],
                layout=Layout.HND,
                num_kv_heads=heads,
                total_kv_heads=TOTAL_HEADS,
                head_dim=HEAD_DIM,
                dtype="bfloat16",
                buffers=buffers,
            )
        ],
    )


def instance(role: Role, tp: int) -> InstanceCreate:
    return InstanceCreate(
        role=role,
        tp=tp,
        tokens_per_block=TOKENS_PER_BLOCK,
        model="flow-8b",
        ranks=[rank(index, TOTAL_HEADS // tp) for index in range(tp)],
    )


def main(url: str) -> dict[str, object]:
    client = Client(base_url=url, raise_on_unexpected_status=True)

    # Register: a TP2 context and a TP1 generation.
    ctx = ok(register_instance.sync("flow-ctx", client=client, body=instance(Role.CONTEXT, 2)))
    gen = ok(register_instance.sync("flow-gen", client=client, body=instance(Role.GENERATION, 1)))
    assert ctx.status.value == gen.status.value == "ready"

    # A read is a registration body: the same models, so it goes back as it came.
    read: InstanceRead = ok(get_instance.sync("flow-ctx", client=client))
    again = InstanceCreate(
        role=read.role,
        tokens_per_block=read.tokens_per_block,
        model=read.model,
        tp=read.tp,
        pp=read.pp,
        cp=read.cp,
        attention_dp=read.attention_dp,
        kv_heads_per_rank=read.kv_heads_per_rank,
        total_kv_heads=read.total_kv_heads,
        ranks=read.ranks,
    )
    unchanged = ok(register_instance.sync("flow-ctx", client=client, body=again))
    assert unchanged.generation == read.generation

    # Pair, then read the compiled plan with its typed fields.
    pairing = ok(
        create_pairing.sync(
            client=client, body=PairingCreate(context="flow-ctx", generation="flow-gen")
        )
    )
    assert pairing.compatible, [issue.code for issue in pairing.errors]
    plan: PlanRead = ok(get_pairing_plan.sync(pairing.id, client=client))
    staging = {
        receiver.rank: [share.offset_per_block for share in receiver.staging]
        for receiver in plan.receivers
    }
    heads = sorted(
        tuple(piece.global_heads)
        for route in plan.routes
        for piece in route.slices
        if piece.global_heads is not None
    )
    cp_sides = {None if route.cp_side is None else route.cp_side.value for route in plan.routes}

    # Transfer one request: a map of typed block lists per layer group.
    blocks = TransferCreateBlocks()
    blocks["0"] = BlockLists(context=[10, 11, 12, 13], generation=[20, 21, 22])
    transfer: TransferRead = ok(
        create_transfer.sync(
            client=client,
            body=TransferCreate(
                context="flow-ctx", generation="flow-gen", request_id="flow-1", blocks=blocks
            ),
            idempotency_key="flow-1",
        )
    )
    assert transfer.mode == TransferMode.AUTO  # the server's default, sent back typed
    fragments: TransferFragments = ok(get_transfer_fragments.sync(transfer.id, client=client))
    fragment_bytes = sum(row[4] for route in fragments.routes for row in route.fragments)

    missing = get_instance.sync("nobody", client=client)
    assert isinstance(missing, Problem)

    return {
        "plan_bytes_per_block": plan.bytes_per_block,
        "plan_runs": plan.runs,
        "tokens_per_block": plan.tokens_per_block,
        "routes": len(plan.routes),
        "layer_groups": sorted({seg.layer_group for r in plan.routes for seg in r.segments}),
        "cp_sides": sorted(str(side) for side in cp_sides),
        "writer_ranks": sorted(rank for r in plan.receivers for rank in r.writer_ranks),
        "staging": {str(key): value for key, value in staging.items()},
        "global_heads": [list(pair) for pair in heads],
        "pools": len(plan.pools),
        "warnings": [warning.code for warning in plan.warnings],
        "transfer_bytes": transfer.bytes_,
        "transfer_blocks": [route.blocks for route in transfer.routes],
        "transfer_runs": sum(route.runs for route in transfer.routes),
        "fragment_bytes": fragment_bytes,
        "missing_code": missing.code,
        "missing_title": missing.title,
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
