#!/usr/bin/env bash
# One TIR-OTB training step of a Qwen3-0.6B-shaped random model at 512-token responses on one GPU
# (HF engine rollout, FSDP2 actor, fused vs unfused Σπ² peak memory). About 1.5 minutes on an H200
# (measured 2026-12-04, docs/results.md). --response-length 4096: the rollout alone takes ~6 min at the
# measured ~90 ms a decode step; raise the timeout (GPU_CHECK_TIMEOUT, seconds, default 480).
#   scripts/gpu_check.sh                 # the GPU check (fails clearly without a CUDA GPU)
#   scripts/gpu_check.sh --cpu-smoke     # tiny shape on CPU: checks the code paths
#   scripts/gpu_check.sh --no-fsdp ...   # any other flag goes to benchmarks/gpu_check.py
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PY="$ROOT/.venv/bin/python"; else PY="$(command -v python3 || command -v python)"; fi
fi
cpu_smoke=0
for a in "$@"; do [[ "$a" == "--cpu-smoke" ]] && cpu_smoke=1; done
if [[ $cpu_smoke == 0 ]]; then
  if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: no CUDA GPU visible to $PY (torch.cuda.is_available() is False)." >&2
    command -v nvidia-smi >/dev/null && nvidia-smi -L >&2 || echo "gpu_check: nvidia-smi not found either." >&2
    echo "gpu_check: run it on a GPU machine, or pass --cpu-smoke to check the code paths on CPU." >&2
    exit 2
  fi
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
export TOKENIZERS_PARALLELISM=false
exec timeout --signal=INT "${GPU_CHECK_TIMEOUT:-480}" "$PY" "$ROOT/benchmarks/gpu_check.py" "$@"
