#!/usr/bin/env bash
# The GPU check: a Qwen3-0.6B-shaped random model through four training paths on one lent GPU, within
# 10 minutes, one table (leg, status, wall s, step s, tokens/s, peak GPU memory, weight-sync s):
#   local                the local trainer's step: HF engine rollout, FSDP2 actor, fused vs unfused Σπ² replays
#   verl_sync            trainer=verl, verl's V1 trainer in sync mode, vLLM on the GPU (needs verl, ray, vllm)
#   verl_separate_async  the same in separate_async with verl's nccl checkpoint engine (needs 2 GPUs)
#   sglang               the local trainer with rollout.name=sglang on the GPU (needs sglang)
# A leg that cannot run here is a "skipped: <why>" row. Each leg has its own timeout; all of them fit in
# GPU_CHECK_TIMEOUT seconds (default 600). Details: docs/training.md, "GPU check".
#   scripts/gpu_check.sh                    # the GPU check (fails clearly without a CUDA GPU)
#   scripts/gpu_check.sh --legs local,sglang
#   scripts/gpu_check.sh --cpu-smoke        # on CPU: the local leg on a tiny shape, the others composed, not run
#   scripts/gpu_check.sh --no-fsdp ...      # any other flag goes to benchmarks/gpu_check.py
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
export GPU_CHECK_TIMEOUT="${GPU_CHECK_TIMEOUT:-600}"  # the legs share it, less 30 s
exec timeout --signal=INT "$GPU_CHECK_TIMEOUT" "$PY" "$ROOT/benchmarks/gpu_check.py" "$@"
