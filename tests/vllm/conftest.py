"""The vLLM tier: real engines from ``workers/testing/vllm_bed.py``."""

from __future__ import annotations

import os
import sys

import pytest

from workers.testing.vllm_bed import vllm_missing


def require_vllm() -> None:
    """Skip loudly without the vLLM environment; fail under ``CI=true``."""
    reason = vllm_missing()
    if reason is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true: the vLLM tier must run: {reason}")
    print(f"\nSKIPPING the vLLM tier: {reason}", file=sys.stderr)
    pytest.skip(reason)
