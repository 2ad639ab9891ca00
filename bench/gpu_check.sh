#!/usr/bin/env bash
# One-shot GPU check for the data mover (< 5 minutes on one GPU):
#   1. CUDA executor tests + VRAM<->VRAM NIXL (tests/workers/test_cuda.py; must not skip),
#   2. the transfer benchmark with --device cuda (local executors and two-process NIXL),
#   3. where VLLM_PY names a Python with a CUDA build of vLLM (and kvplane installed in it,
#      `pip install -e '.[worker]'`): vLLM's six KV cache layouts on CUDA tensors through the
#      connector's registration (tests/vllm/layouts.py), then the vLLM tier on the GPU
#      (tests/vllm/test_connector.py: two engines, kvplane's connector on CUDA tensors, tokens
#      equal to one engine's).
# Needs a CUDA build of torch and nixl; PY=/path/to/python overrides the interpreter
# (the repo .venv holds the CPU wheel). Logs go to $OUT (default test-artifacts/gpu_check).
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PY:-.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
OUT="${OUT:-test-artifacts/gpu_check}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

echo "== device"
timeout 60 "$PY" - <<'PYEOF' 2>&1 | tee "$OUT/device.txt"
import sys
import torch
if not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} sees no CUDA device: use a CUDA build (PY=...)")
print("torch", torch.__version__, "cuda", torch.version.cuda, "|", torch.cuda.get_device_name(0))
import nixl._api as api
print("nixl", api.__file__)
PYEOF

echo "== CUDA executor + VRAM NIXL tests"
set +e
timeout 180 "$PY" -m pytest -q -p no:cacheprovider --confcutdir=tests/workers \
    tests/workers/test_cuda.py -rs --timeout 150 2>&1 | tee "$OUT/pytest_cuda.txt"
rc=${PIPESTATUS[0]}
set -e
if [ "$rc" -ne 0 ]; then echo "CUDA tests failed (rc=$rc)"; exit "$rc"; fi
if grep -q "skipped" "$OUT/pytest_cuda.txt"; then echo "CUDA tests skipped: not a GPU run"; exit 1; fi

echo "== transfer bench (cuda)"
timeout 240 "$PY" bench/transfer.py --device cuda --reps 3 2>&1 \
    | grep -v "NIXL INFO" | tee "$OUT/bench_cuda.txt"
if [ -n "${VLLM_PY:-}" ]; then
  echo "== vLLM's six KV cache layouts on CUDA tensors (tests/vllm/layouts.py)"
  timeout 120 "$VLLM_PY" tests/vllm/layouts.py --device cuda | tail -n 1 > "$OUT/layouts.json"
  "$PY" - "$OUT/layouts.json" <<'PYEOF'
import json, sys
result = json.load(open(sys.argv[1]))
bad = {k: v for k, v in result["pairs"].items() if v["mismatched"]}
print(len(result["pairs"]), "layout pairs moved;", "mismatches:", bad or "none")
sys.exit(1 if bad or len(result["pairs"]) != 16 else 0)
PYEOF
  echo "== vLLM tier on CUDA ($VLLM_PY)"
  KVPLANE_VLLM_PYTHON="$VLLM_PY" timeout 300 "$PY" -m pytest -q -p no:cacheprovider \
      tests/vllm/test_connector.py -rs 2>&1 | tee "$OUT/pytest_vllm.txt"
else
  echo "== vLLM tier on CUDA: not run (VLLM_PY names no Python with vLLM)"
fi
echo "gpu_check: ok (logs in $OUT)"
