"""What a measured figure was measured on: :func:`describe` (CPU model and count, memory,
accelerator, OS) and :func:`speed_reference` (a fixed torch workload's throughput), so that a reader
on another machine can scale a time by the ratio of the two references."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import time
from pathlib import Path

__all__ = ["FLOAT_PATHS", "cpu_kernels", "describe", "native_bf16", "speed_reference"]

# Environments that make torch on this CPU compute as another CPU of this kind would: the float
# order of a run follows the vector kernels torch dispatches to (ATen's AVX-512 / AVX2 / scalar
# kernels, MKL's code path), so a run under each shows how far a figure moves from machine to machine.
FLOAT_PATHS: dict[str, dict[str, str]] = {
    "native": {},
    # an AVX2-only CPU (no AVX-512): ATen's AVX2 kernels (MKL's sgemm gives the same bits here)
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    # every kernel on another float order: ATen's scalar kernels and MKL's SSE4.2 path
    "generic": {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
}


def describe() -> str:
    """CPU model and count, memory and accelerator, in one line (Linux /proc where available)."""
    cpu = platform.processor() or platform.machine()
    try:
        text = Path("/proc/cpuinfo").read_text()
        cpu = re.search(r"^model name\s*:\s*(.+)$", text, re.M).group(1).strip()  # type: ignore[union-attr]
    except (OSError, AttributeError):
        pass
    mem = ""
    try:
        kib = int(re.search(r"^MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text(), re.M).group(1))  # type: ignore[union-attr]
        mem = f", {kib / 2**20:.0f} GiB"
    except (OSError, AttributeError, ValueError):
        pass
    gpu = "no GPU"
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=10
        )
        if out.returncode == 0 and out.stdout.strip():
            gpu = ", ".join(sorted(set(out.stdout.split("\n")) - {""}))
    except (OSError, subprocess.TimeoutExpired):
        pass
    return f"{os.cpu_count()} × {cpu}{mem}, {gpu}, {platform.system()} {platform.release()}"


def native_bf16() -> str:
    """The CPU's native bfloat16 instructions ("avx512_bf16", "amx_bf16", both joined by "+"), or ""
    where it has none (bfloat16 is then emulated and slower: the AVX2-only VMs of this kind)."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return ""
    have = set(flags.split(":", 1)[-1].split())
    return "+".join(f for f in ("avx512_bf16", "amx_bf16") if f in have)


def cpu_kernels() -> str:
    """The vector kernels torch uses in this process (ATen's CPU capability, MKL's instruction
    limit if one is set): what decides a run's float order on a CPU."""
    import torch

    mkl = os.environ.get("MKL_ENABLE_INSTRUCTIONS")
    return f"torch CPU kernels {torch.backends.cpu.get_cpu_capability()}" + (f", MKL {mkl}" if mkl else "")


def speed_reference(reps: int = 5) -> dict[str, float]:
    """The tiny policy's kind of work at torch's default thread count: fp32 matmuls of
    [64 × 128] @ [128 × 384] and back (an MLP block of the built-in model, a batch of 64 tokens),
    as GFLOP/s, the median of ``reps`` timings of 400 pairs each."""
    import torch

    g = torch.Generator().manual_seed(0)
    x, w1, w2 = (torch.randn(*s, generator=g) for s in ((64, 128), (128, 384), (384, 128)))
    flop = 400 * 2 * (2 * 64 * 128 * 384)
    times = []
    for _ in range(reps + 1):  # the first is a warm-up
        t0 = time.perf_counter()
        y = x
        for _ in range(400):
            y = torch.tanh(y @ w1) @ w2
        times.append(time.perf_counter() - t0)
    times = sorted(times[1:])
    return {"matmul_gflops": flop / times[len(times) // 2] / 1e9, "threads": float(torch.get_num_threads())}
