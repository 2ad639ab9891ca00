"""The vLLM tier: real engines from ``workers/testing/vllm_bed.py``."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


CHROMIUM = os.environ.get("KVPLANE_CHROMIUM", "/usr/bin/chromium")


@pytest.fixture
def page() -> Iterator[Any]:
    """A page of Debian's Chromium under Playwright (as in ``tests/e2e``); skip without it,
    fail under ``CI=true``."""
    if not Path(CHROMIUM).exists():
        reason = f"no Chromium at {CHROMIUM} (apt-get install -y chromium)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true requires the browser: {reason}")
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"]
        )
        try:
            context = browser.new_context(viewport={"width": 1440, "height": 900})
            context.set_default_timeout(10_000)
            yield context.new_page()
        finally:
            browser.close()
