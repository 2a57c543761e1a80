"""The fused CPU kernel of the OTB estimators: build, load and call ``fused_otb.c``.

The plain PyTorch estimators (:mod:`otb_tir.advantage`) are the reference and run on every
device; on CPU, for float32 inputs, they hand the whole computation to this kernel, which does it
group by group in one pass over each input (see the C file's header) and gives the same numbers.

The C file ships with the package and is compiled on first use with the system C compiler
(``$CC``, else ``cc`` / ``gcc``) into the artifact cache (:func:`agent_env.cache.publish`, keyed on
the source, the compiler and the machine), so a run pays the ~0.3 s build once per machine. Where
no compiler is found or the build fails, the estimators log one warning and use the PyTorch path
(same results, about 2–3× slower at [1024 × 8192]). ``OTB_TIR_FUSED=0`` turns the kernel off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)

__all__ = ["fused_available", "fused_otb"]

_SOURCE = Path(__file__).with_name("fused_otb.c")
_ABI_VERSION = 1
_MARKER = "otb_tir_fused.json"
_FLAGS = ["-O3", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math"]

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_failed: str | None = None
_pools: dict[int, ThreadPoolExecutor] = {}  # by size (_executor)


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _compiler_version(cc: str) -> str:
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
        return out.stdout.splitlines()[0] if out.stdout else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def _build() -> ctypes.CDLL:
    from agent_env.cache import artifact_dir, publish

    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or install gcc)")
    source = _SOURCE.read_bytes()
    key = {
        "source": hashlib.sha256(source).hexdigest(),
        "cc": _compiler_version(cc),
        "flags": _FLAGS,
        "machine": platform.machine(),
        "system": platform.system(),
    }

    def build(tmp: Path) -> dict:
        out = subprocess.run(
            [cc, *_FLAGS, "-o", str(tmp / "fused_otb.so"), str(_SOURCE)], capture_output=True, text=True, timeout=300
        )
        if out.returncode != 0:
            raise RuntimeError(f"{cc} failed ({out.returncode}): {out.stderr.strip()[-2000:]}")
        return {"cc": cc}

    folder = publish(artifact_dir(None, "fused_otb", key), _MARKER, build, record=key)
    lib = ctypes.CDLL(str(folder / "fused_otb.so"))
    if lib.otb_fused_abi_version() != _ABI_VERSION:
        raise RuntimeError("stale kernel build (ABI version mismatch)")
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.otb_fused_f32.argtypes = [p, p, p, p, p, p, p, p, i64, i64, i64, ctypes.c_int, ctypes.c_int, ctypes.c_float]
    lib.otb_fused_f32.restype = ctypes.c_int
    return lib


def _library() -> ctypes.CDLL | None:
    global _lib, _failed
    if _lib is not None or _failed is not None:
        return _lib
    with _lock:
        if _lib is None and _failed is None:
            try:
                _lib = _build()
            except Exception as exc:  # noqa: BLE001 - any build failure means: use the PyTorch path
                _failed = str(exc)
                logger.warning(
                    "fused OTB kernel unavailable (%s): using the PyTorch estimators (same results, slower)", exc
                )
    return _lib


def fused_available() -> bool:
    """True when the kernel is enabled (``OTB_TIR_FUSED`` is not ``0``) and built; builds it if needed."""
    if os.environ.get("OTB_TIR_FUSED", "1") == "0":
        return False
    return _library() is not None


def _executor(n: int) -> ThreadPoolExecutor:
    """The pool of ``n`` threads, one per size asked (at most the thread count, so a few): a pool is
    never shut down, so a call that took one can always use it while another call asks for another
    size (replacing a single pool once shut it under a concurrent caller's ``map``)."""
    with _lock:
        pool = _pools.get(n)
        if pool is None:
            pool = _pools[n] = ThreadPoolExecutor(max_workers=n, thread_name_prefix="otb-fused")
        return pool


@torch.no_grad()
def fused_otb(
    rewards: torch.Tensor,
    maskf: torch.Tensor,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None,
    group: torch.Tensor,
    n_groups: int,
    *,
    tir: bool,
    handle_zero_tail: bool,
    epsilon: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)`` of (TIR-)OTB from float32 CPU tensors; ``maskf`` is the float mask.

    ``group`` holds each row's dense group id (0..n_groups-1). Call :func:`fused_available` first.
    """
    lib = _library()
    assert lib is not None, "call fused_available() first"
    batch, resp = rewards.shape
    rewards, maskf, sum_pi_squared = rewards.contiguous(), maskf.contiguous(), sum_pi_squared.contiguous()
    rho = rollout_is_weights.contiguous() if rollout_is_weights is not None else None
    # π = exp(old log-prob) by torch (bit-identical to verl's); the kernel turns it into the advantages.
    advantages = torch.exp(old_log_probs.contiguous())
    returns = torch.empty_like(rewards)
    gid = group.cpu().numpy()
    order = np.argsort(gid, kind="stable").astype(np.int64)
    offsets = np.zeros(n_groups + 1, dtype=np.int64)
    np.cumsum(np.bincount(gid, minlength=n_groups), out=offsets[1:])
    # Split the groups into contiguous ranges of about equal row counts, one per thread.
    threads = max(1, min(torch.get_num_threads(), n_groups, batch * resp // (1 << 16) or 1))
    bounds = np.searchsorted(offsets, np.linspace(0, batch, threads + 1)[1:-1], side="left")
    ranges = list(zip([0, *bounds.tolist()], [*bounds.tolist(), n_groups]))
    args = (
        rewards.data_ptr(),
        maskf.data_ptr(),
        advantages.data_ptr(),
        sum_pi_squared.data_ptr(),
        rho.data_ptr() if rho is not None else None,
        returns.data_ptr(),
        order.ctypes.data,
        offsets.ctypes.data,
    )

    def run(begin: int, end: int) -> int:
        if begin >= end:
            return 0
        return lib.otb_fused_f32(*args, begin, end, resp, int(tir), int(handle_zero_tail), epsilon)

    if len(ranges) == 1:
        codes = [run(*ranges[0])]
    else:  # ctypes releases the GIL during the call: the ranges run in parallel
        codes = list(_executor(len(ranges)).map(lambda r: run(*r), ranges))
    if any(codes):
        raise MemoryError("fused OTB kernel: could not allocate its group tables")
    return advantages, returns
