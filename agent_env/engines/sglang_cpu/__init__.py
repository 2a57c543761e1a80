"""sglang on a CPU: what :class:`~agent_env.engines.sglang.SGLangEngine` needs before it imports sglang.

sglang publishes no CPU build. Its torch-native CPU path runs after ``scripts/install_sglang_env.sh``
(a ``.venv-sglang``): CPU torch pinned, sglang installed without its CUDA-only dependencies,
PyPI's CUDA torchvision made importable (:mod:`.patch_torchvision`) and a stand-in for the
unpublished ``sgl_kernel`` CPU module (``stand_in/sgl_kernel``). :func:`prepare_cpu` checks that
this environment is the one running, and says plainly what is missing when it is not.
"""

from __future__ import annotations

import importlib.util
import os

INSTALL = "bash scripts/install_sglang_env.sh (in the otb-tir checkout), then use .venv-sglang/bin/python"

# ServerArgs defaults on a CPU (the caller's engine_kwargs win): no CUDA graphs; a KV pool sized in
# tokens rather than as a fraction of the machine's memory (sglang's CPU path reads total RAM).
CPU_DEFAULTS = {
    "device": "cpu",
    "disable_cuda_graph": True,
    "mem_fraction_static": 0.1,
    "max_total_tokens": 65536,
}


def cpu_problem() -> str | None:
    """Why sglang cannot start on this CPU here (None: it can). Imports nothing heavy."""
    if importlib.util.find_spec("sglang") is None:
        return "sglang is not installed in this environment"
    if importlib.util.find_spec("sgl_kernel") is None:
        return (
            "sglang's CPU kernels (sgl_kernel) are missing: they are not published for CPUs, and the "
            "stand-in that lets sglang's torch-native path start is installed only by the script below"
        )
    # sglang imports torchvision at start; PyPI's is a CUDA build that the script below patches
    tv = importlib.util.find_spec("torchvision")
    if tv is None or not tv.submodule_search_locations:
        return "torchvision is not installed (sglang imports it at start)"
    from importlib.metadata import version

    from agent_env.engines.sglang_cpu.patch_torchvision import MARK

    meta = os.path.join(list(tv.submodule_search_locations)[0], "_meta_registrations.py")
    with open(meta) as f:
        patched = MARK in f.read()
    if "+cu" in version("torchvision") and not patched:
        return f"torchvision {version('torchvision')} is a CUDA build that does not import next to the CPU torch"
    return None


def prepare_cpu() -> None:
    """Raise :class:`EngineError` naming the install script when sglang cannot run on this CPU;
    otherwise select sglang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``, read when sglang imports)."""
    from agent_env.engines.base import EngineError

    problem = cpu_problem()
    if problem is not None:
        raise EngineError(f"sglang cannot run on this CPU here: {problem}. Install it with {INSTALL}")
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
