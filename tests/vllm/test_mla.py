"""Multi-head latent attention (a tiny DeepSeek-V2-style model, ``tiny_model.py --mla``).

vLLM's CPU backend runs MLA (``CPU_MLA``) but cannot run a prompt's rest over cached KV: it turns
chunked prefill and prefix caching off for MLA models. A decode engine always computes at least
the last prompt token over the KV it loaded (measured here before the refusal: after a handover
of the latents, every continuation differed from one engine's), so the connector refuses an MLA
decode on CPU at start-up and says why. The latents' registration (``REPLICATED`` views, one
``key`` buffer per layer) and their TP 2 → TP 1 move are checked on vLLM's own views in
``test_layouts.py``.
"""

from __future__ import annotations

import pytest

from workers.testing.engine import ControlPlane
from workers.testing.vllm_bed import Engine, write_model

from .conftest import require_vllm

pytestmark = pytest.mark.slow


def test_an_mla_decode_on_cpu_is_refused_at_start_up(tmp_path) -> None:
    require_vllm()
    model = write_model(tmp_path, mla=True)
    plane = ControlPlane(tmp_path)
    plane.start()
    decode = Engine(tmp_path, model, "decode", "1", instance="vllm-decode", control_plane=plane.url)
    try:
        with pytest.raises(RuntimeError, match="the engine exited") as raised:
            decode.read(timeout_s=300)
        assert "MLA model cannot run on vLLM's CPU backend" in str(raised.value)
    finally:
        decode.stop()
        plane.stop()
