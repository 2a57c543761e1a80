"""The verl platform of a machine without an accelerator: patch 1 of :mod:`otb_tir.verl.cpu`.

:func:`platform_class` builds ``PlatformCPU`` (verl's ``PlatformBase`` for torch CPU tensors and gloo)
and its device module (``torch.cpu`` plus what verl asks a device module for). It imports verl, so
:mod:`otb_tir.verl.cpu` calls it on first use of ``otb_tir.verl.cpu.PlatformCPU`` (the name the class
is registered and pickled under) and registers the class with verl's ``PlatformRegistry`` as ``cpu``.
"""

from __future__ import annotations

import contextlib
import os
from types import ModuleType
from typing import Any

__all__ = ["platform_class"]


def _device_module() -> ModuleType:
    """``torch.cpu`` plus what verl asks a device module for (memory stats, seeds, streams)."""
    import torch

    mod = ModuleType("otb_tir_cpu_device")
    for name in dir(torch.cpu):
        if not name.startswith("_"):
            setattr(mod, name, getattr(torch.cpu, name))
    zero = lambda *a, **k: 0  # noqa: E731
    noop = lambda *a, **k: None  # noqa: E731
    for name in ("memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved"):
        setattr(mod, name, zero)
    for name in ("empty_cache", "reset_peak_memory_stats", "set_device", "ipc_collect", "reset_max_memory_allocated"):
        setattr(mod, name, noop)
    mod.is_available = lambda: True
    mod.device_count = lambda: 1
    mod.current_device = lambda: "cpu"
    mod.manual_seed = torch.manual_seed
    mod.manual_seed_all = torch.manual_seed
    mod.get_rng_state = torch.get_rng_state
    mod.set_rng_state = torch.set_rng_state

    def mem_get_info(*a: Any, **k: Any) -> tuple[int, int]:
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)

    mod.mem_get_info = mem_get_info
    mod.get_device_name = lambda *a, **k: "cpu"  # verl/utils/flops_counter.py get_device_flops
    mod.memory_stats = lambda *a, **k: {}
    return mod


def platform_class() -> type:
    from verl.plugin.platform.platform_base import PlatformBase

    class PlatformCPU(PlatformBase):
        """verl platform for a machine without an accelerator (torch CPU tensors, gloo)."""

        _module: ModuleType | None = None

        @property
        def device_name(self) -> str:
            return "cpu"

        @property
        def vendor_name(self) -> str:
            return "cpu"

        @property
        def device_module(self) -> ModuleType:
            if PlatformCPU._module is None:
                PlatformCPU._module = _device_module()
            return PlatformCPU._module

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check: bool = False) -> bool:
            return os.environ.get("VERL_PLATFORM", "").strip().lower() == "cpu"  # never auto-detected

        def current_device(self) -> str:  # type: ignore[override]
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            return None

        def synchronize(self, device_index: int | None = None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            import torch

            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            self.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"  # what Ray sets for the logical GPUs

        @contextlib.contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            return "GPU"  # logical GPUs declared in ray.init (cpu_overrides)

        def ray_noset_envvars(self) -> list[str]:
            return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

        def is_ipc_supported(self) -> bool:
            return False  # verl then sends weights through shared memory

        def cudart(self) -> Any:
            return None

    return PlatformCPU
