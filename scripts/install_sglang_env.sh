#!/usr/bin/env bash
# Creates .venv-sglang: sglang 0.5.23 on this CPU (its torch-native backend), for rollout.name=sglang
# and the sglang engine tests. Idempotent. GPU machines do not use it: `pip install -e ".[sglang]"`.
#
# sglang publishes no CPU build; what makes its CPU path run here (docs/engines.md, measured
# 2026-12-05; each step would go away with the upstream change named):
#  1. torch 2.13.0 first and held by a constraint: sglang pins torch 2.14.1, which on this index is a
#     CUDA build (upstream: a CPU extra of sglang on PyPI).
#  2. sglang with --no-deps, then its own dependency list (read from its metadata) minus the
#     CUDA-only packages below (upstream: CUDA kernels as an extra, not base dependencies).
#  3. torchvision (sglang imports it at start) from PyPI is a CUDA build: two fake-kernel
#     registrations are guarded so it imports (agent_env/engines/sglang_cpu/patch_torchvision.py;
#     upstream: a CPU torchvision on PyPI, or torchvision guarding them).
#  4. sgl_kernel, sglang's CPU kernels, is not published: otb-tir's stand-in
#     (agent_env/engines/sglang_cpu/stand_in) goes on this environment's path through a .pth file;
#     it implements the one kernel a dense model's decode calls and raises for the others
#     (upstream: a CPU wheel of sgl-kernel).
#  5. SGLANG_USE_CPU_ENGINE=1 when sglang is imported: set by SGLangEngine on a CPU (without it,
#     device="cpu" fails importing vllm's rotary embedding).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${OTB_SGLANG_VENV:-.venv-sglang}
SGLANG_VERSION=0.5.23
# CUDA-only (or GPU-kernel) dependencies of sglang 0.5.23, left out on a CPU
CUDA_ONLY="cuda-python flash-attn-4 flashinfer-python humming-kernels nvshmem4py-cu13 quack-kernels
sgl-deep-ep sgl-deep-gemm sgl-flash-mla sglang-kernel tilelang torch-memory-saver torchaudio torchcodec
timm deepseek-recipe tml-renderers numba kernels torch torchvision"

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
V="$VENV/bin/python"
"$V" -m pip install -q --upgrade pip
"$V" -m pip install -q "torch==2.13.0"
constraints="$(mktemp)"
reqs="$(mktemp)"
trap 'rm -f "$constraints" "$reqs"' EXIT
echo "torch==2.13.0" >"$constraints"
"$V" -m pip install -q --no-deps "sglang==$SGLANG_VERSION" "torchvision==0.28.0"
"$V" -m pip install -q packaging  # reads sglang's requirement markers below (a fresh venv lacks it)
"$V" - "$CUDA_ONLY" >"$reqs" <<'PYEOF'
import importlib.metadata as md
import re
import sys

from packaging.requirements import Requirement

left_out = set(sys.argv[1].split())
for line in md.requires("sglang"):
    req = Requirement(line)
    if req.marker is not None and ("extra" in str(req.marker) or not req.marker.evaluate()):
        continue
    name = re.sub(r"[-_.]+", "-", req.name).lower()
    if name in left_out or name.startswith("nvidia-"):
        continue
    req.marker = None
    print(req)
PYEOF
"$V" -m pip install -q -c "$constraints" -r "$reqs"
"$V" -m pip install -q -c "$constraints" -e ".[test]"
"$V" -m agent_env.engines.sglang_cpu.patch_torchvision
site="$("$V" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$(pwd)/agent_env/engines/sglang_cpu/stand_in" >"$site/otb_sgl_kernel_stand_in.pth"
"$V" - <<'PYEOF'
import importlib.metadata as md

from agent_env.engines.sglang_cpu import cpu_problem

problem = cpu_problem()
if problem:
    raise SystemExit(f"sglang environment incomplete: {problem}")
for dist in ("sglang", "torch", "transformers", "torchvision"):
    print(f"  {dist} {md.version(dist)}")
PYEOF
echo "sglang environment ready: $VENV"
