"""A decode engine that must preempt a request whose KV it loaded from the prefill.

The decode's KV cache holds 70 blocks of 32 tokens (one of them vLLM's null block). Two prompts
of 1,000 tokens (32 blocks each) load together, then decode 250 tokens each in lock step: by
token ~1,090 both need a 35th block and only 69 exist, so vLLM preempts one of them (frees its
blocks and later recomputes it locally, the handover long done). Nothing in the batch can avoid
it: both requests are admitted in the same step and grow alike. The oracle is the decode engine
by itself, which preempts as well. Float32, as in ``test_configurations.py``: a recompute
prefills what was decoded, and in bfloat16 the two orders of summation part on near-ties.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from workers.testing.vllm_bed import engine_bed, handover, prompts, recorded, write_model

from .conftest import require_vllm

pytestmark = pytest.mark.slow

DECODE_BLOCKS = 70


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    require_vllm()
    workdir = tmp_path_factory.mktemp("vllm-preemption")
    model = write_model(workdir)
    options = {"dtype": "float32", "log_stats": True}
    engines = [
        ("prefill", "vllm-prefill-pre", "0", options),
        ("decode", "vllm-decode-pre", "1", {**options, "num_blocks": DECODE_BLOCKS}),
    ]
    with engine_bed(workdir, model, engines) as (plane, started):
        yield {
            "plane": plane,
            "prefill": started["vllm-prefill-pre"],
            "decode": started["vllm-decode-pre"],
        }


def test_a_loaded_request_preempted_on_the_decode_equals_one_engine(bed: dict[str, Any]) -> None:
    decode = bed["decode"]
    batch = prompts(71, (1000, 1000))
    alone = decode.generate(batch, 250)["tokens"]
    before = decode.call(op="preemptions")["preemptions"]
    assert before > 0  # the oracle itself could not hold both
    loaded = handover(bed["prefill"], decode, batch, batch, 250, context="vllm-prefill-pre")
    assert decode.call(op="preemptions")["preemptions"] > before
    assert loaded == alone
    assert len(recorded(bed["plane"].url, 2, context="vllm-prefill-pre")) == 2
    assert bed["prefill"].call(op="idle", timeout_s=30) == {"idle": True}
    assert decode.call(op="idle", timeout_s=10) == {"idle": True}
